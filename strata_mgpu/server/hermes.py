"""The Hermes/Qwen3 tool dialect: a call is a JSON object of its name and arguments,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Read as it arrives: once the block starts `{"name": "<an offered function>", "arguments": {`, the
call is sure (its head may be sent) and its arguments are given out as far as they are well
formed (`json_prefix.JsonPrefix`); they end with the object's last brace, as the model wrote them
(a raw control character inside a string escaped). A sure call whose arguments break, or whose
block ends before they close, keeps the rest of its text as the model wrote it (up to the call
object's closing brace): its arguments are then no JSON, and nothing is invented to close them.
A block of another shape (keys in another order, arguments given as a JSON string, a name not
offered) is read once whole (`model_json.loads`): a JSON object with a string `name` and object
(or JSON-string) `arguments` is a call, its arguments written back as JSON; anything else is no
call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from strata_mgpu.server import model_json
from strata_mgpu.server.json_prefix import JsonPrefix
from strata_mgpu.server.json_schema import json_rule

NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# the head of a call read as it arrives; it must end within HEAD_LIMIT characters of the block
_STRING = r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"'  # JSON's escapes only
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*(' + _STRING + r')\s*,\s*"arguments"\s*:\s*(?=\S)')
HEAD_LIMIT = 1024


class HermesReader:
    def __init__(self, functions: Mapping[str, Any] | None):
        self._names = None if functions is None else frozenset(functions)
        self._body = ""
        self._decided = False  # the head has been read (or cannot be)
        self._name: str | None = None
        self._start = 0  # where the arguments start in the body
        self._json = JsonPrefix()

    @property
    def name(self) -> str | None:
        return self._name

    @property
    def arguments(self) -> str:
        return self._json.text[:self._json.safe_text] if self._name is not None else ""

    @property
    def complete(self) -> bool:
        return self._name is not None and self._json.end is not None

    def feed(self, text: str) -> None:
        self._body += text
        if not self._decided:
            self._read_head()
        if self._name is not None:
            self._json.feed(self._body[self._start + self._json.n:])

    def _read_head(self) -> None:
        m = _HEAD.match(self._body)
        if m is not None and m.end() <= HEAD_LIMIT:
            self._decided = True
            try:
                name = model_json.loads(m[1])
            except ValueError:
                return
            if self._body[m.end()] == "{" and (self._names is None or name in self._names) and \
                    model_json.encodes(name):
                self._name, self._start = name, m.end()
        elif len(self._body) > HEAD_LIMIT:
            self._decided = True

    def end(self, closed: bool) -> tuple[str, str] | None:
        if self._name is not None:
            if self._json.end is not None:
                return self._name, self._json.text
            # broken or unterminated: the rest as the model wrote it, up to the call object's own
            # closing brace (so it is no JSON, and a client's parse of it fails)
            rest = self._body.rstrip().removesuffix("}")
            return self._name, self.arguments + rest[self._start + self._json.safe:]
        return _whole_call(self._body) if closed else None


def _whole_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a block read whole, or None where it is no call."""
    try:
        obj = model_json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not model_json.encodes(obj["name"]):
        return None
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # arguments given as a JSON string: it must hold an object
        try:
            arguments = model_json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return obj["name"], model_json.dumps(arguments)


def function_rules(functions: list[dict[str, Any]], strict: bool) -> list[str]:
    """The grammar's `function`: one call's JSON, its arguments following the function's schema.
    Each function's parameters are a `%json` rule of their own, so that a `$ref` to `#/$defs/...`
    (pydantic's nested models) points into the parameters' own root."""
    rules = ["function: " + " | ".join(f"fn{i}" for i in range(len(functions)))]
    for i, function in enumerate(functions):
        head = '{"name": ' + json.dumps(function["name"], ensure_ascii=False) + ', "arguments": '
        rules += [f'fn{i}: {json.dumps(head, ensure_ascii=False)} fn{i}_arguments "}}"',
                  f"fn{i}_arguments: " + json_rule(function.get("parameters") or NO_PARAMETERS, strict=strict)]
    return rules
