"""Hand-built GGUF bytes for malformed-file tests: every field under the test's control."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

STRING, ARRAY, U32, F32, U64 = 8, 9, 4, 6, 10


def s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv_u32(key: str, v: int) -> bytes:
    return s(key) + struct.pack("<II", U32, v)


def kv_str(key: str, v: str) -> bytes:
    return s(key) + struct.pack("<I", STRING) + s(v)


def kv_str_array(key: str, items: list[str]) -> bytes:
    return s(key) + struct.pack("<IIQ", ARRAY, STRING, len(items)) + b"".join(s(x) for x in items)


def kv_f32_array(key: str, items: list[float]) -> bytes:
    return s(key) + struct.pack("<IIQ", ARRAY, F32, len(items)) + struct.pack(f"<{len(items)}f", *items)


@dataclass
class RawTensor:
    name: str
    ne: list[int]  # ggml order
    ggml_type: int = 0  # F32
    offset: int | None = None  # relative to the data section; None: packed in order
    nbytes: int | None = None


@dataclass
class RawGGUF:
    kvs: list[bytes] = field(default_factory=list)
    tensors: list[RawTensor] = field(default_factory=list)
    version: int = 3
    magic: bytes = b"GGUF"
    alignment: int = 32
    n_kv: int | None = None
    n_tensors: int | None = None

    def build(self) -> bytes:
        out = bytearray(self.magic + struct.pack("<IQQ", self.version,
                                                 len(self.tensors) if self.n_tensors is None else self.n_tensors,
                                                 len(self.kvs) if self.n_kv is None else self.n_kv))
        for kv in self.kvs:
            out += kv
        offset = 0
        sizes = []
        for t in self.tensors:
            n = 1
            for d in t.ne:
                n *= d
            nbytes = t.nbytes if t.nbytes is not None else 4 * n
            sizes.append(nbytes)
            off = offset if t.offset is None else t.offset
            out += s(t.name) + struct.pack("<I", len(t.ne)) + struct.pack(f"<{len(t.ne)}Q", *t.ne)
            out += struct.pack("<IQ", t.ggml_type, off)
            offset = -(-(off + nbytes) // self.alignment) * self.alignment
        out += b"\0" * (-len(out) % self.alignment)
        data_len = min(offset, 1 << 20)  # absurd offsets are the point of some tests: don't write them
        out += bytes((i * 7) & 0xFF for i in range(data_len))
        return bytes(out)


def valid() -> RawGGUF:
    """A small, valid file: a few keys (one string array) and three F32 tensors."""
    return RawGGUF(
        kvs=[kv_str("general.architecture", "test"), kv_u32("test.block_count", 1),
             kv_str_array("tokenizer.ggml.tokens", ["a", "b", "ab", "<s>"]), kv_f32_array("test.scores", [1, 2, 3])],
        tensors=[RawTensor("a.weight", [8, 2]), RawTensor("b.weight", [4]), RawTensor("c.weight", [32, 1, 1, 2])],
    )
