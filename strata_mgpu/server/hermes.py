"""The Hermes/Qwen3 tool dialect: a call is a JSON object of its name and arguments,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Read as it arrives: once the block starts `{"name": "<an offered function>", "arguments": {`, the
call is sure and its arguments are given out as far as they are well formed. A call whose
arguments break, or whose block ends before they close, is closed with what parsed. A block of
another shape (keys in another order, arguments as a JSON string, a name not offered) is read
once whole: a JSON object with a string `name` and object (or JSON-string) `arguments` is a
call, anything else is no call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from strata_mgpu.server.json_prefix import JsonPrefix
from strata_mgpu.server.json_schema import json_rule

NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# the head of a call read as it arrives; it must end within HEAD_LIMIT characters of the block
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\\x00-\x1f]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')
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
        return self._body[self._start:self._start + self._json.safe] if self._name is not None else ""

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
            name = json.loads(m[1])
            if self._body[m.end()] == "{" and (self._names is None or name in self._names):
                self._name, self._start = name, m.end()
        elif len(self._body) > HEAD_LIMIT:
            self._decided = True

    def end(self, closed: bool) -> tuple[str, str] | None:
        if self._name is not None:
            j = self._json
            if j.end is not None:
                return self._name, self._body[self._start:self._start + j.end]
            return self._name, (self.arguments + j.closing) if j.safe else "{}"
        return _whole_call(self._body) if closed else None


def _whole_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a block read whole, or None where it is no call."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # arguments given as a JSON string: it must hold an object
        try:
            inner = json.loads(arguments)
        except json.JSONDecodeError:
            return None
        return (obj["name"], arguments) if isinstance(inner, dict) else None
    if not isinstance(arguments, dict):
        return None
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


def function_call_schema(function: dict[str, Any]) -> dict[str, Any]:
    """The JSON of one call of `function` (an OpenAI tool's `function`): its name, then its arguments."""
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             "arguments": function.get("parameters") or NO_PARAMETERS},
            "required": ["name", "arguments"], "additionalProperties": False}


def function_rules(functions: list[dict[str, Any]], strict: bool) -> list[str]:
    return ["function: " + json_rule({"anyOf": [function_call_schema(f) for f in functions]}, strict=strict)]
