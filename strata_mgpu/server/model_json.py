"""JSON a model wrote, read and written back for a response.

Read as JSON reads it, with one allowance: a raw control character inside a string (a model's
unescaped newline in a file's content) is taken as that character, as `json.loads(strict=False)`
does. `NaN` and `Infinity` are not JSON and are refused (Python's json takes them). Written with
`json.dumps`' separators, non-ASCII kept, but a lone surrogate (`"\\ud800"` read) escaped: a
response's text must encode as UTF-8.
"""

from __future__ import annotations

import json
from typing import Any


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads(text: str) -> Any:
    """The JSON value of `text`; ValueError (json.JSONDecodeError among them) where it is none."""
    return json.loads(text, strict=False, parse_constant=_no_constant)


def encodes(text: str) -> bool:
    """Whether `text` encodes as UTF-8 (it holds no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def dumps(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if encodes(text) else json.dumps(value)
