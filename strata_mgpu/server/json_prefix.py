"""A JSON object (or array) read as it arrives: how much of it is well formed so far.

`JsonPrefix.feed` takes the text piece by piece. `safe` is the length of the longest prefix read
so far that ends at a point where JSON may be cut and closed: right after a `{` or `[`, after a
whole member or item, or inside a string value (not inside a key, an escape, a number or a
literal); a streamed tool call gives out its arguments up to there, never closing them itself.
`end` is the text's length once the outermost container has closed; `broken` says a character
broke it (nothing after it is read). A raw control character inside a string does not break it
(`json.loads(strict=False)` reads it too): `text` is what was read with each such character
escaped, so that it parses, and `safe_text` is `safe` measured in `text`.
"""

from __future__ import annotations

import json
import re

_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_LITERALS = ("true", "false", "null")
_SPACE = " \t\r\n"
_CLOSER = {"{": "}", "[": "]"}
_ESCAPES = frozenset('"\\/bfnrtu')
_HEX = frozenset("0123456789abcdefABCDEF")

# what the next character may be (outside strings and tokens)
_START, _VALUE, _VALUE_OR_END, _KEY, _KEY_OR_END, _COLON, _AFTER = range(7)


class JsonPrefix:
    def __init__(self) -> None:
        self.n = 0  # characters read
        self.safe = 0
        self.text = ""  # what was read, raw control characters inside strings escaped
        self.safe_text = 0
        self.end: int | None = None
        self.broken = False
        self._stack: list[str] = []  # the open containers: "{" or "["
        self._mode = _START
        self._string: bool | None = None  # inside a string: True for a key, False for a value
        self._raw: str | None = None  # the escape of the control character just read inside a string
        self._escape = 0  # inside an escape: characters still to come (-1 right after "\", 1..4 in "\u....")
        self._token = ""  # a number or literal being read
        self._piece: list[str] = []  # what this feed adds to text
        self._n_text = 0  # text's length, with the piece

    @property
    def done(self) -> bool:
        return self.end is not None or self.broken

    def feed(self, text: str) -> None:
        self._piece = []
        for c in text:
            if self.done:
                break
            self._read(c)
            if self.broken:
                break
            self.n += 1
            if self._raw is None:
                self._piece.append(c)
                self._n_text += 1
            else:
                self._piece.append(self._raw)
                self._n_text += len(self._raw)
                self._raw = None
            if self.end is None:
                self._note_safe()
        self.text += "".join(self._piece)

    def _read(self, c: str) -> None:
        if self._string is not None:
            self._in_string(c)
            return
        if self._token:
            if self._token[0] in "tfn":
                if c.isalpha():
                    self._token += c
                    self.broken = not any(lit.startswith(self._token) for lit in _LITERALS)
                    return
                ok = self._token in _LITERALS
            else:
                if c in "0123456789+-.eE":
                    self._token += c
                    return
                ok = _NUMBER.fullmatch(self._token) is not None
            if not ok:
                self.broken = True
                return
            self._token, self._mode = "", _AFTER
            self._note_safe()  # the number or literal ended before c
        if c in _SPACE:
            return
        mode = self._mode
        if mode == _START:
            if c not in "{[":
                self.broken = True
                return
            self._open(c)
        elif mode in (_VALUE, _VALUE_OR_END):
            if c == "]" and mode == _VALUE_OR_END:
                self._close(c)
            elif c in "{[":
                self._open(c)
            elif c == '"':
                self._string = False
            elif c in "-0123456789tfn":
                self._token = c
            else:
                self.broken = True
        elif mode in (_KEY, _KEY_OR_END):
            if c == '"':
                self._string = True
            elif c == "}" and mode == _KEY_OR_END:
                self._close(c)
            else:
                self.broken = True
        elif mode == _COLON:
            self.broken = c != ":"
            self._mode = _VALUE
        elif c == ",":
            self._mode = _KEY if self._stack[-1] == "{" else _VALUE
        elif c in "}]":
            self._close(c)
        else:
            self.broken = True

    def _in_string(self, c: str) -> None:
        if self._escape == -1:  # the character after "\"
            self.broken = c not in _ESCAPES
            self._escape = 4 if c == "u" else 0
        elif self._escape:
            self.broken = c not in _HEX
            self._escape -= 1
        elif c == "\\":
            self._escape = -1
        elif c == '"':
            self._mode = _COLON if self._string else _AFTER
            self._string = None
        elif ord(c) < 0x20:
            self._raw = json.dumps(c)[1:-1]

    def _open(self, c: str) -> None:
        self._stack.append(c)
        self._mode = _KEY_OR_END if c == "{" else _VALUE_OR_END

    def _close(self, c: str) -> None:
        if _CLOSER[self._stack[-1]] != c:
            self.broken = True
            return
        self._stack.pop()
        self._mode = _AFTER
        if not self._stack:
            self.end = self.n + 1

    def _note_safe(self) -> None:
        if self._token or self._escape:
            return
        if self._string is False or self._string is None and self._mode in (_AFTER, _VALUE_OR_END, _KEY_OR_END):
            self.safe, self.safe_text = self.n, self._n_text
