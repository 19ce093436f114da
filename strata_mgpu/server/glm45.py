"""The GLM-4.5 tool dialect: a call is its function's name, then key/value pairs, each value plain text,

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

as GLM-4.5's template writes it (a string value as it is, any other `tojson`) and vLLM's `glm4_moe`
parser reads it: the name is the block's first line; a value runs to `</arg_value>`; a parameter
whose schema declares a string (or declares nothing) is that text as it stands, any other is read
as JSON (a value that does not parse stays a string), and one the schema does not list is read as
JSON where it parses.

Streamed: once the first line is a name offered, the call is sure; its arguments are given out as
they are read: `{`, each text value's characters as they arrive, each other value when it is
whole, `}` at the block's end. The call has no end of its own but `</tool_call>`, so the length
limit cutting a block leaves it no call (`complete` stays false). A block naming a function not
offered is read once whole (a call then, if the name is one a function may have); any other shape
is no call.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from strata_mgpu.server.answer import partial_tail
from strata_mgpu.server.json_schema import strict_schema
from strata_mgpu.server.qwen3_coder import ParameterReader, checked_parameters, is_text, literal, value_rules

_OPEN_KEY, _CLOSE_KEY = "<arg_key>", "</arg_key>"
_OPEN_VALUE, _CLOSE_VALUE = "<arg_value>", "</arg_value>"
MARKUP = (_OPEN_KEY, _CLOSE_KEY, _OPEN_VALUE, _CLOSE_VALUE)  # the tags inside a call
# the first line: a name, ended by a newline (or by the first key, where a model leaves the newline out)
_HEAD = re.compile(r"\s*([^\n<]*?)[ \t]*(?:\n|(?=<arg_key>))")
_NAME = re.compile(r"[A-Za-z0-9_.:\-]{1,256}")  # a function's name that is read without an offer
NAME_LIMIT = 256


class Glm45Reader(ParameterReader):
    def __init__(self, functions: Mapping[str, dict[str, Any]] | None, any_name: bool = False):
        super().__init__(functions, any_name)
        self._key: str | None = None  # a key read, its value not yet opened
        self._value_of: str | None = None  # the key whose value is being read

    @property
    def complete(self) -> bool:
        return False  # only `</tool_call>` ends a call's arguments

    def _read_head(self) -> None:
        m = _HEAD.match(self._body)
        if m is None:
            self._decided = len(self._body) > NAME_LIMIT
            return
        self._decided = True
        name = m[1].strip()
        if name and (name in (self._functions or {}) or (self._any_name and _NAME.fullmatch(name))):
            self._start(name, m.end())

    def _is_text(self, key: str) -> bool:
        if key not in self._properties:
            return False  # not listed: JSON where it parses (vLLM's reading)
        return is_text(self._properties[key], self._root)

    def _read(self, final: bool) -> None:
        while True:
            rest = self._body[self._pos:]
            if self._value_of is not None:
                if not self._read_value(rest, final):
                    return
                continue
            if self._key is not None:  # between a key and its value: whitespace, then the value's tag
                stripped = rest.lstrip()
                if stripped.startswith(_OPEN_VALUE):
                    self._pos += len(rest) - len(stripped) + len(_OPEN_VALUE)
                    self._open_value(self._key)
                    continue
                if not final and _OPEN_VALUE.startswith(stripped):
                    return  # the tag's start, or nothing yet
                self._key = None  # a key with no value: not part of the call
                continue
            start = rest.find(_OPEN_KEY)
            if start < 0:
                keep = 0 if final else partial_tail(rest, (_OPEN_KEY,))
                self._pos += len(rest) - keep  # text between pairs is not part of the call
                return
            end = rest.find(_CLOSE_KEY, start)
            if end < 0:
                if not final and len(rest) - start <= NAME_LIMIT:
                    self._pos += start
                    return  # the key is still arriving
                self._pos += start + len(_OPEN_KEY)  # a key that never closes: no pair
                continue
            self._key = rest[start + len(_OPEN_KEY):end].strip()
            self._pos += end + len(_CLOSE_KEY)

    def _open_value(self, key: str) -> None:
        self._key, self._value_of, self._sent = None, key, 0
        if self._is_text(key):
            self._open_text(key)

    def _read_value(self, rest: str, final: bool) -> bool:
        key = self._value_of
        assert key is not None
        end = rest.find(_CLOSE_VALUE)
        text = self._is_text(key)
        if end >= 0 or final:
            value = rest[:end] if end >= 0 else rest
            self._close_value(key, value, text)
            self._pos += len(value) + (len(_CLOSE_VALUE) if end >= 0 else 0)
            self._value_of = None
            return True
        if text:
            upto = len(rest) - partial_tail(rest, (_CLOSE_VALUE,))
            if upto > self._sent:
                self._stream_text(rest[self._sent:upto])
                self._sent = upto
        return False

    def end(self, closed: bool) -> tuple[str, str] | None:
        if self._name is None:
            if not closed:
                return None
            whole = Glm45Reader(self._functions, any_name=True)  # a name not offered, or a call of no pairs
            whole.feed(self._body + ("" if "\n" in self._body or _OPEN_KEY in self._body else "\n"))
            return whole.end(True) if whole.name is not None else None
        self._read(final=True)
        return self._name, self._out + "}"


# -- its grammar ----------------------------------------------------------------------------------------

# a text value: text (`.` takes no control token; a complement alone would take `</arg_value>` where the
# vocabulary holds it as one, and the value would never end) without the tag that would end it early
# (where the vocabulary spells it as text)
_NO_TAG = r"GLM_NO_TAG: /(?s:.*)/ & ~/(?s:.*)(<\/arg_value>|<\/tool_call>)(?s:.*)/"


def _function_rules(i: int, function: dict[str, Any], strict: bool, markup: Callable[[str], str]) -> list[str]:
    parameters = checked_parameters(function)
    if strict:
        parameters = strict_schema(parameters)
    properties = parameters.get("properties") or {}
    required = set(parameters.get("required") or ())
    rules, seq = [], []
    for j, (param, schema) in enumerate(properties.items()):
        rule = f"fn{i}_p{j}"
        rules.append(f'{rule}: {markup(_OPEN_KEY)} {literal(param)} {markup(_CLOSE_KEY)} "\\n" '
                     f'{markup(_OPEN_VALUE)} {rule}_v "\\n"')
        rules += value_rules(f"{rule}_v", schema, parameters, strict, markup(_CLOSE_VALUE), no_tag="GLM_NO_TAG")
        seq.append(rule if param in required else f"{rule}?")
    return [f"fn{i}: {literal(function['name'] + chr(10))} {' '.join(seq)}".rstrip(), *rules]


def function_rules(functions: list[dict[str, Any]], strict: bool, markup: Callable[[str], str]) -> list[str]:
    """The grammar's `function`: the text between `<tool_call>` and `</tool_call>` of one call of one
    of `functions`: its name and a newline, then its listed parameters in their order, the required
    ones present, each value as its schema allows. ValueError where a schema cannot be read."""
    rules = ["function: " + " | ".join(f"fn{i}" for i in range(len(functions))), _NO_TAG]
    for i, function in enumerate(functions):
        rules += _function_rules(i, function, strict, markup)
    return rules
