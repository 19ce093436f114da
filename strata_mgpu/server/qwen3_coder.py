"""The Qwen3-Coder tool dialect: a call is XML-like markup, each parameter's value plain text,

    <tool_call>
    <function=write_file>
    <parameter=path>
    notes.txt
    </parameter>
    </function>
    </tool_call>

read as vLLM's `qwen3_coder` parser reads it: a value runs to `</parameter>` (or the next
`<parameter=` or `</function>`), one newline at each end dropped; it becomes the JSON type its
parameter's schema declares (a value that does not parse stays a string).

Streamed: once the block starts `<function=NAME>` with NAME an offered function, the call is sure;
its arguments are given out as they are read: `{`, each string value's characters as they arrive
(a newline at the value's end held back until it is known not to be the last), each other value
when it is whole, `}` at the block's end. A block the model ends early is read with what it
has; the length limit cutting one before its `</function>` leaves it no call (`complete`). A
block naming a function not offered is read once whole (a call then); any other shape is no call.
"""

from __future__ import annotations

import abc
import json
import re
from collections.abc import Mapping
from typing import Any

from strata_mgpu.server import model_json
from strata_mgpu.server.answer import partial_tail
from strata_mgpu.server.json_schema import REF_LIMIT, json_rule, resolved, strict_schema, with_definitions

_HEAD = re.compile(r"\s*<function=([^>\n]*)>")
_OPEN_FUNCTION, _OPEN_PARAMETER = "<function=", "<parameter="
_CLOSE_PARAMETER, _CLOSE_FUNCTION = "</parameter>", "</function>"
_VALUE_ENDS = (_CLOSE_PARAMETER, _OPEN_PARAMETER, _CLOSE_FUNCTION)
NAME_LIMIT = 256  # a function's or parameter's name is read within this many characters


def declared_types(schema: Any, root: Any = None, depth: int = 0) -> set[str]:
    """The JSON types a parameter's schema declares (`type`, enum and const values, anyOf /
    oneOf members, a `$ref` into `root`, the function's parameters, followed); empty where it
    declares none (or says nothing readable)."""
    schema = resolved(schema, root)
    if not isinstance(schema, dict) or depth > REF_LIMIT:  # a schema that refers to itself: what was read
        return set()
    kind = schema.get("type")
    types = {kind} if isinstance(kind, str) else {t for t in kind if isinstance(t, str)} if isinstance(kind, list) \
        else set()
    enum = schema.get("enum")
    values = (enum if isinstance(enum, list) else []) + ([schema["const"]] if "const" in schema else [])
    types |= {_json_type(v) for v in values}
    for key in ("anyOf", "oneOf"):
        members = schema.get(key)
        for member in members if isinstance(members, list) else []:
            types |= declared_types(member, root, depth + 1)
    return types


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "null" if value is None else "array" if isinstance(value, list) else "object"


def is_text(schema: Any, root: Any = None) -> bool:
    """Whether a parameter's value is given as a JSON string (it declares string, or nothing)."""
    types = declared_types(schema, root)
    return not types or "string" in types


def value_json(value: str, schema: Any, root: Any = None) -> str:
    """A parameter's text as JSON of the type its schema declares (a string where it does not parse)."""
    if not is_text(schema, root):
        text = value.strip()
        for candidate in (text, text.lower()):  # "True" for a boolean
            try:
                return model_json.dumps(model_json.loads(candidate))
            except ValueError:
                continue
    return json.dumps(value, ensure_ascii=False)


class ParameterReader(abc.ABC):
    """What the readers of calls made of a name and named parameter values share (Qwen3-Coder's XML,
    GLM-4.5's key/value pairs): the arguments given out as JSON as they are read (`{`, each text value's
    characters as they arrive, each other value when it is whole, by its schema: `value_json`). A reader
    reads its head (`_read_head`: the name, where `_start` is called) and then its body (`_read`)."""

    def __init__(self, functions: Mapping[str, dict[str, Any]] | None, any_name: bool = False):
        self._functions = functions
        self._any_name = any_name or functions is None
        self._body = ""
        self._decided = False
        self._name: str | None = None
        self._properties: dict[str, Any] = {}
        self._root: Any = None  # the function's parameters schema, where its $refs point
        self._pos = 0  # the body is read up to here
        self._out = ""  # the arguments given out
        self._members = 0
        self._sent = 0  # a text value's characters given out

    @property
    def name(self) -> str | None:
        return self._name

    @property
    def arguments(self) -> str:
        return self._out

    def feed(self, text: str) -> None:
        self._body += text
        if not self._decided:
            self._read_head()
        if self._name is not None:
            self._read(final=False)

    @abc.abstractmethod
    def _read_head(self) -> None:
        """Read the name from the body so far: `_start` where it is a call, `_decided` once it is known."""

    @abc.abstractmethod
    def _read(self, final: bool) -> None:
        """Read the body past `_pos` (`final`: nothing more comes)."""

    def _start(self, name: str, at: int) -> None:
        """The call is `name`'s, its body from `at`: its parameters' schemas looked up."""
        self._name, self._pos, self._out = name, at, "{"
        schema = (self._functions or {}).get(name) or {}
        properties = schema.get("properties") if isinstance(schema, dict) else None
        self._properties = properties if isinstance(properties, dict) else {}
        self._root = schema

    def _separator(self) -> str:
        self._members += 1
        return ", " if self._members > 1 else ""

    def _open_text(self, key: str) -> None:
        """A text value of `key` begins: its key and the opening quote given out."""
        self._out += self._separator() + json.dumps(key, ensure_ascii=False) + ': "'

    def _stream_text(self, part: str) -> None:
        """More of an open text value's characters (its quotes not among them)."""
        self._out += json.dumps(part, ensure_ascii=False)[1:-1]

    def _close_value(self, key: str, value: str, text: bool) -> None:
        """`key`'s whole value: the rest of a text value and its closing quote, else the value as JSON."""
        if text:
            self._out += json.dumps(value[self._sent:], ensure_ascii=False)[1:]
        else:
            self._out += self._separator() + json.dumps(key, ensure_ascii=False) + ": " + \
                value_json(value, self._properties.get(key), self._root)


class Qwen3CoderReader(ParameterReader):
    def __init__(self, functions: Mapping[str, dict[str, Any]] | None, any_name: bool = False):
        super().__init__(functions, any_name)
        self._param: str | None = None  # the parameter whose value is being read
        self._function_done = False  # (`_sent`: a text value's characters after its leading newline)

    @property
    def complete(self) -> bool:
        return self._function_done

    def _read_head(self) -> None:
        m = _HEAD.match(self._body)
        if m is not None:
            self._decided = True
            name = m[1].strip()
            if self._any_name or name in (self._functions or {}):
                self._start(name, m.end())
            return
        head = self._body.lstrip()
        viable = _OPEN_FUNCTION.startswith(head) if len(head) < len(_OPEN_FUNCTION) else \
            head.startswith(_OPEN_FUNCTION) and "\n" not in head and len(head) <= NAME_LIMIT
        self._decided = not viable

    def _read(self, final: bool) -> None:
        while not self._function_done:
            rest = self._body[self._pos:]
            if self._param is not None:
                if not self._read_value(rest, final):
                    return
                continue
            lt = rest.find("<")
            if lt < 0:
                self._pos = len(self._body)  # text between parameters is not part of the call
                return
            rest = rest[lt:]
            self._pos += lt
            if rest.startswith(_CLOSE_FUNCTION):
                self._function_done = True
                return
            if rest.startswith(_OPEN_PARAMETER):
                gt = rest.find(">", len(_OPEN_PARAMETER))
                if 0 <= gt <= NAME_LIMIT:
                    self._start_value(rest[len(_OPEN_PARAMETER):gt])
                    self._pos += gt + 1
                    continue
                if gt < 0 and len(rest) <= NAME_LIMIT and not final:
                    return  # the name is still arriving
            elif not final and any(tag.startswith(rest) for tag in (_OPEN_PARAMETER, _CLOSE_FUNCTION)):
                return  # a tag's start
            self._pos += 1  # a "<" that opens no tag

    def _start_value(self, param: str) -> None:
        self._param, self._sent = param, 0
        if is_text(self._properties.get(param), self._root):
            self._open_text(param)

    def _read_value(self, rest: str, final: bool) -> bool:
        assert self._param is not None
        ends = [(i, tag) for tag in _VALUE_ENDS if (i := rest.find(tag)) >= 0]
        text = is_text(self._properties.get(self._param), self._root)
        if ends or final:
            i, tag = min(ends) if ends else (len(rest) - partial_tail(rest, _VALUE_ENDS), "")
            value = rest[:i]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            self._close_value(self._param, value, text)
            self._pos += i + (len(tag) if tag == _CLOSE_PARAMETER else 0)
            self._param = None
            return True
        if text and rest:
            avail = rest[:len(rest) - partial_tail(rest, _VALUE_ENDS)]
            lead = 1 if avail.startswith("\n") else 0
            upto = len(avail) - 1 if avail.endswith("\n") else len(avail)
            if upto - lead > self._sent:
                self._stream_text(avail[lead + self._sent:upto])
                self._sent = upto - lead
        return False

    def end(self, closed: bool) -> tuple[str, str] | None:
        if self._name is not None:
            self._read(final=True)
            return self._name, self._out + "}"
        if not closed:
            return None
        whole = Qwen3CoderReader(self._functions, any_name=True)  # a name not offered: read whole
        whole.feed(self._body)
        return whole.end(True) if whole.name is not None else None


# -- its grammar ----------------------------------------------------------------------------------------

# a text value: text (`.` takes no control token; a complement alone would) without the tags that would
# end it early
_NO_TAG = r"NO_TAG: /(?s:.*)/ & ~/(?s:.*)(<\/parameter>|<parameter=|<\/function>|<\/tool_call>)(?s:.*)/"


def literal(text: str) -> str:
    """`text` as a grammar's string literal."""
    return json.dumps(text, ensure_ascii=False)


def value_rules(rule: str, schema: Any, root: dict[str, Any], strict: bool, close: str,
                no_tag: str = "NO_TAG") -> list[str]:
    """Rules for `rule`: a parameter's value, then `close` (`root`: the parameters). JSON where the schema
    is not text; one of its listed strings; else text of the `no_tag` rule (text without the tags that
    would end it early), in the schema's length bounds, matched lazily where `close` is text (a string
    literal), and up to the first `close` where that is a token no text spells."""
    if not is_text(schema, root):
        body = with_definitions(schema if isinstance(schema, dict) else {}, root)
        return [f"{rule}: {rule}_json {close}", f"{rule}_json: {json_rule(body, strict=strict)}"]
    choices = text_choices(schema, root)
    if choices:
        return [f"{rule}: ({' | '.join(literal(v) for v in choices)}) {close}"]
    schema = resolved(schema, root)
    low = schema.get("minLength", 0) if isinstance(schema, dict) else 0
    high = schema.get("maxLength") if isinstance(schema, dict) else None
    lazy = "[lazy]" if close.startswith('"') else ""
    if low > 0 or high is not None:
        token = f"{rule.upper()}_TEXT"
        bound = f"{{{low},{high if high is not None else ''}}}"
        return [f"{rule}{lazy}: {token} {close}", f"{token}: /(?s:.{bound})/ & {no_tag}"]
    return [f"{rule}{lazy}: {no_tag} {close}"]


def text_choices(schema: Any, root: Any, depth: int = 0) -> list[str] | None:
    """The strings a text parameter may be where its schema lists them (`enum`, `const`, also in
    each anyOf / oneOf member but a null one: Optional[Literal[...]]); None where it does not."""
    schema = resolved(schema, root)
    if not isinstance(schema, dict) or depth > REF_LIMIT:
        return None
    if "const" in schema:
        return [schema["const"]] if isinstance(schema["const"], str) else None
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum if all(isinstance(v, str) for v in enum) else None
    for key in ("anyOf", "oneOf"):
        members = schema.get(key)
        if isinstance(members, list) and members:
            choices: list[str] = []
            for member in members:
                if declared_types(member, root) == {"null"}:
                    continue  # the reader gives text: a null is not written here
                more = text_choices(member, root, depth + 1)
                if more is None:
                    return None
                choices += more
            return choices or None
    return None


def checked_parameters(function: dict[str, Any]) -> dict[str, Any]:
    """The function's parameters schema, its parts this grammar reads checked (ValueError naming
    the one that is not what JSON Schema says it is)."""
    where = f"function {function['name']!r}: parameters"
    parameters = function.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise ValueError(f"{where}: expected a JSON schema (an object)")
    properties = parameters.get("properties") or {}
    if not isinstance(properties, dict):
        raise ValueError(f"{where}.properties: expected an object of the parameters' schemas")
    required = parameters.get("required") or []
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValueError(f"{where}.required: expected a list of parameter names")
    for param, schema in properties.items():
        if not isinstance(schema, dict | bool):
            raise ValueError(f"{where}.properties.{param}: expected a schema (an object)")
        schema = resolved(schema, parameters)
        if not isinstance(schema, dict):
            continue
        if "enum" in schema and not isinstance(schema["enum"], list):
            raise ValueError(f"{where}.properties.{param}.enum: expected a list of values")
        for key in ("minLength", "maxLength"):
            value = schema.get(key)
            if key in schema and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"{where}.properties.{param}.{key}: expected a non-negative integer")
    return parameters


def _function_rules(i: int, function: dict[str, Any], strict: bool) -> list[str]:
    parameters = checked_parameters(function)
    if strict:
        parameters = strict_schema(parameters)
    properties = parameters.get("properties") or {}
    required = set(parameters.get("required") or ())
    head = literal(f"<function={function['name']}>\n")
    if not properties:
        return [f'fn{i}: {head} "</function>"']
    rules, seq = [], []
    for j, (param, schema) in enumerate(properties.items()):
        rule = f"fn{i}_p{j}"
        rules.append(f"{rule}: {literal(f'<parameter={param}>' + chr(10))} {rule}_v \"\\n\"")
        rules += value_rules(f"{rule}_v", schema, parameters, strict, '"\\n</parameter>"')
        seq.append(rule if param in required else f"{rule}?")
    return [f'fn{i}: {head} {" ".join(seq)} "</function>"', *rules]


def function_rules(functions: list[dict[str, Any]], strict: bool) -> list[str]:
    """The grammar's `function`: one call of one of `functions`, its listed parameters in their
    order, the required ones present, each value as its schema allows (a `$ref` followed, a JSON
    value's schema given the parameters' `$defs`). ValueError where a schema cannot be read."""
    rules = ["function: " + " | ".join(f"fn{i}" for i in range(len(functions))), _NO_TAG]
    for i, function in enumerate(functions):
        rules += _function_rules(i, function, strict)
    return rules
