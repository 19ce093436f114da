"""Strict, lazy GGUF reader.

Validates a file the way ggml does before anything trusts it: magic, version, counts bounded by
the file's size, string and array lengths, value and tensor types, alignment, dims, byte counts,
and that every tensor lies aligned, inside the data section and apart from every other tensor.
Every failure raises `GGUFError` with a one-line message naming the key or tensor and the byte
offset. Metadata arrays are decoded only when asked for; tensor data are zero-copy views of one
read-only `np.memmap` per file. Split models (`NAME-00001-of-00003.gguf`) open as one: give the
first shard's path.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, Keys

GGUF_VERSIONS = (2, 3)
MAX_DIMS = 4
INT64_MAX = 2**63 - 1

# GGUF value type id -> (name, struct format, byte size); STRING (8) and ARRAY (9) are variable.
_SCALARS: dict[int, tuple[str, str, int]] = {
    0: ("uint8", "<B", 1),
    1: ("int8", "<b", 1),
    2: ("uint16", "<H", 2),
    3: ("int16", "<h", 2),
    4: ("uint32", "<I", 4),
    5: ("int32", "<i", 4),
    6: ("float32", "<f", 4),
    7: ("bool", "<?", 1),
    10: ("uint64", "<Q", 8),
    11: ("int64", "<q", 8),
    12: ("float64", "<d", 8),
}
_NUMPY_OF = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8",
             11: "<i8", 12: "<f8"}
T_STRING = 8
T_ARRAY = 9
_SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class GGUFError(ValueError):
    """A GGUF file is malformed or does not fit what was asked of it. The message is one line."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes live. `shape` is numpy/torch order (ggml's ne reversed)."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in its shard file
    nbytes: int
    shard: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def row_bytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.ggml_type]
        return self.shape[-1] // block * type_size


class GGUFArray:
    """A metadata array, decoded on first use. Numeric arrays are numpy views of the file."""

    def __init__(self, file: _Shard, key: str, elem_type: int, count: int, offset: int,
                 string_offsets: np.ndarray | None):
        self._file = file
        self.key = key
        self.elem_type = elem_type
        self.count = count
        self.offset = offset  # byte offset of the first element
        self._string_offsets = string_offsets  # start of each string's length prefix
        self._cache: list[Any] | None = None

    def __len__(self) -> int:
        return self.count

    def numpy(self) -> np.ndarray:
        if self.elem_type == T_STRING:
            raise GGUFError(f"metadata {self.key!r}: array of strings has no numeric view")
        arr = np.frombuffer(self._file.data, dtype=_NUMPY_OF[self.elem_type], count=self.count,
                            offset=self.offset)
        return arr.astype(bool) if self.elem_type == 7 else arr

    def tolist(self) -> list[Any]:
        if self._cache is None:
            if self.elem_type == T_STRING:
                assert self._string_offsets is not None
                data = self._file.data
                out = []
                for off in self._string_offsets.tolist():
                    n = int.from_bytes(data[off:off + 8], "little")
                    out.append(_decode_utf8(data[off + 8:off + 8 + n], self.key, off))
                self._cache = out
            else:
                self._cache = self.numpy().tolist()
        return self._cache

    def __getitem__(self, i: int) -> Any:
        return self.tolist()[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.tolist())

    def __repr__(self) -> str:
        kind = "string" if self.elem_type == T_STRING else _SCALARS[self.elem_type][0]
        return f"GGUFArray({kind}[{self.count}])"


def _decode_utf8(raw: bytes | memoryview, what: str, offset: int) -> str:
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError as e:
        raise GGUFError(f"{what}: string at byte {offset} is not valid UTF-8") from e


class _Shard:
    """One parsed .gguf file: its metadata, tensor table and a read-only memmap of its bytes."""

    def __init__(self, path: Path, index: int):
        self.path = path
        self.index = index
        try:
            self.size = path.stat().st_size
        except OSError as e:
            raise GGUFError(f"{path}: cannot open: {e.strerror}") from e
        if self.size < 24:
            raise GGUFError(f"{path}: file is {self.size} bytes, too short for a GGUF header (24 bytes)")
        self.memmap = np.memmap(path, dtype=np.uint8, mode="r")
        self.data = self.memmap.data  # a memoryview of the mapped bytes
        self.pos = 0
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._parse()

    # -- primitive reads, all bounds-checked -------------------------------------------------
    def _need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GGUFError(f"{self.path}: {what} at byte {self.pos} needs {n} bytes, file ends at {self.size}")

    def _scalar(self, vtype: int, what: str) -> Any:
        _, fmt, n = _SCALARS[vtype]
        self._need(n, what)
        (v,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += n
        return v

    def _u32(self, what: str) -> int:
        return self._scalar(4, what)

    def _u64(self, what: str) -> int:
        return self._scalar(10, what)

    def _string(self, what: str) -> str:
        start = self.pos
        n = self._u64(f"{what} length")
        if n > self.size - self.pos:
            raise GGUFError(f"{self.path}: {what}: string length {n} at byte {start} runs past the end "
                            f"of the file ({self.size} bytes)")
        raw = self.data[self.pos:self.pos + n]
        self.pos += n
        return _decode_utf8(raw, f"{self.path}: {what}", start)

    # -- structure ---------------------------------------------------------------------------
    def _parse(self) -> None:
        magic = self._u32("magic")
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: bad magic {magic:#010x} at byte 0 (not a GGUF file)")
        version = self._u32("version")
        if version not in GGUF_VERSIONS:
            raise GGUFError(f"{self.path}: unsupported GGUF version {version} at byte 4 "
                            f"(supported: {', '.join(map(str, GGUF_VERSIONS))})")
        n_tensors = self._u64("tensor count")
        n_kv = self._u64("metadata count")
        # Each key-value takes at least 8 (key length) + 4 (type) + 1 bytes, each tensor info
        # at least 8 + 4 + 8 + 4 + 8: counts beyond what the file could hold are corrupt.
        if n_kv > (self.size - self.pos) // 13:
            raise GGUFError(f"{self.path}: metadata count {n_kv} at byte 16 exceeds what {self.size} bytes can hold")
        if n_tensors > (self.size - self.pos) // 32:
            raise GGUFError(f"{self.path}: tensor count {n_tensors} at byte 8 exceeds what {self.size} bytes can hold")
        for i in range(n_kv):
            key_at = self.pos
            key = self._string(f"metadata key #{i}")
            if key in self.metadata:
                raise GGUFError(f"{self.path}: duplicate metadata key {key!r} at byte {key_at}")
            self.metadata[key] = self._value(key)

        alignment = self.metadata.get(Keys.General.ALIGNMENT, GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 \
                or alignment & (alignment - 1):
            raise GGUFError(f"{self.path}: metadata {Keys.General.ALIGNMENT!r} = {alignment!r} "
                            f"is not a positive power of two")
        self.alignment = alignment

        infos = [self._tensor_info(i) for i in range(n_tensors)]
        data_start = -(-self.pos // alignment) * alignment
        if data_start > self.size:
            raise GGUFError(f"{self.path}: data section would start at byte {data_start}, past the end "
                            f"of the file ({self.size} bytes)")
        self.data_start = data_start
        self._place_tensors(infos)

    def _value(self, key: str) -> Any:
        at = self.pos
        vtype = self._u32(f"metadata {key!r} type")
        if vtype in _SCALARS:
            return self._scalar(vtype, f"metadata {key!r}")
        if vtype == T_STRING:
            return self._string(f"metadata {key!r}")
        if vtype == T_ARRAY:
            return self._array(key)
        raise GGUFError(f"{self.path}: metadata {key!r}: unknown value type {vtype} at byte {at}")

    def _array(self, key: str) -> GGUFArray:
        at = self.pos
        elem_type = self._u32(f"metadata {key!r} array type")
        count = self._u64(f"metadata {key!r} array length")
        if elem_type == T_ARRAY:
            raise GGUFError(f"{self.path}: metadata {key!r}: nested arrays are not supported (byte {at})")
        if elem_type != T_STRING and elem_type not in _SCALARS:
            raise GGUFError(f"{self.path}: metadata {key!r}: unknown array element type {elem_type} at byte {at}")
        remaining = self.size - self.pos
        elem_min = 8 if elem_type == T_STRING else _SCALARS[elem_type][2]
        if count > remaining // elem_min:
            raise GGUFError(f"{self.path}: metadata {key!r}: array length {count} at byte {at + 4} runs past "
                            f"the end of the file ({self.size} bytes)")
        first = self.pos
        offsets = None
        if elem_type == T_STRING:
            offsets = self._skip_strings(key, count)
        else:
            self.pos += count * elem_min
        return GGUFArray(self, key, elem_type, count, first, offsets)

    def _skip_strings(self, key: str, count: int) -> np.ndarray:
        offsets = np.empty(count, dtype=np.int64)
        data, size, pos = self.data, self.size, self.pos
        from_bytes = int.from_bytes
        for i in range(count):
            if pos + 8 > size:
                raise GGUFError(f"{self.path}: metadata {key!r}[{i}]: string length at byte {pos} runs past "
                                f"the end of the file ({size} bytes)")
            n = from_bytes(data[pos:pos + 8], "little")
            offsets[i] = pos
            pos += 8 + n
            if pos > size:
                raise GGUFError(f"{self.path}: metadata {key!r}[{i}]: string of {n} bytes at byte "
                                f"{offsets[i]} runs past the end of the file ({size} bytes)")
        self.pos = pos
        return offsets

    def _tensor_info(self, i: int) -> tuple[str, int, GGMLQuantizationType, tuple[int, ...], int]:
        at = self.pos
        name = self._string(f"tensor #{i} name")
        n_dims = self._u32(f"tensor {name!r} dimension count")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"{self.path}: tensor {name!r} at byte {at}: {n_dims} dimensions "
                            f"(1 to {MAX_DIMS} allowed)")
        ne = tuple(self._u64(f"tensor {name!r} dimension {d}") for d in range(n_dims))
        if any(d == 0 or d > INT64_MAX for d in ne):
            raise GGUFError(f"{self.path}: tensor {name!r} at byte {at}: bad dimensions {list(ne)} "
                            f"(each must be in 1..2^63-1)")
        raw_type = self._u32(f"tensor {name!r} type")
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFError(f"{self.path}: tensor {name!r} at byte {at}: unknown tensor type {raw_type}") from None
        if ggml_type not in GGML_QUANT_SIZES:
            raise GGUFError(f"{self.path}: tensor {name!r} at byte {at}: type {ggml_type.name} has no block size")
        offset = self._u64(f"tensor {name!r} offset")
        return name, at, ggml_type, ne, offset

    def _place_tensors(self, infos: list[tuple[str, int, GGMLQuantizationType, tuple[int, ...], int]]) -> None:
        data_size = self.size - self.data_start
        spans = []
        for name, at, ggml_type, ne, rel_offset in infos:
            if name in self.tensors:
                raise GGUFError(f"{self.path}: duplicate tensor name {name!r} at byte {at}")
            block, type_size = GGML_QUANT_SIZES[ggml_type]
            if ne[0] % block:
                raise GGUFError(f"{self.path}: tensor {name!r}: row length {ne[0]} is not a multiple of "
                                f"{ggml_type.name}'s block size {block}")
            n_elem = math.prod(ne)
            if n_elem > INT64_MAX:
                raise GGUFError(f"{self.path}: tensor {name!r}: element count overflows int64 ({list(ne)})")
            nbytes = n_elem // block * type_size
            if rel_offset % self.alignment:
                raise GGUFError(f"{self.path}: tensor {name!r}: data offset {rel_offset} is not a multiple of "
                                f"the alignment {self.alignment}")
            if nbytes > data_size or rel_offset > data_size - nbytes:
                raise GGUFError(f"{self.path}: tensor {name!r}: {nbytes} bytes at data offset {rel_offset} "
                                f"(byte {self.data_start + rel_offset}) run past the end of the file "
                                f"({self.size} bytes)")
            info = TensorInfo(name, ggml_type, tuple(reversed(ne)), self.data_start + rel_offset, nbytes,
                              self.index)
            self.tensors[name] = info
            spans.append(info)
        spans.sort(key=lambda t: t.offset)
        for a, b in zip(spans, spans[1:], strict=False):
            if a.offset + a.nbytes > b.offset:
                raise GGUFError(f"{self.path}: tensor {b.name!r} at byte {b.offset} overlaps tensor {a.name!r} "
                                f"(bytes {a.offset}..{a.offset + a.nbytes})")


class GGUFFile:
    """A GGUF model, one file or several split shards, parsed and validated. `metadata` maps keys to
    Python scalars, strings or lazy `GGUFArray`s; `tensors` maps names to `TensorInfo`."""

    def __init__(self, path: str | Path):
        first = Path(path)
        self.path = first
        self._shards = [_Shard(first, 0)]
        count = self._shards[0].metadata.get(Keys.Split.LLM_KV_SPLIT_COUNT)
        if count is not None:
            self._open_other_shards(first, count)
        self.metadata: Mapping[str, Any] = self._shards[0].metadata
        self.tensors: dict[str, TensorInfo] = {}
        for shard in self._shards:
            for name, info in shard.tensors.items():
                if name in self.tensors:
                    raise GGUFError(f"{shard.path}: tensor {name!r} also stands in shard "
                                    f"{self._shards[self.tensors[name].shard].path.name}")
                self.tensors[name] = info
        declared = self._shards[0].metadata.get(Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT)
        if declared is not None and declared != len(self.tensors):
            raise GGUFError(f"{first}: {Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT} says {declared} tensors, "
                            f"the shards hold {len(self.tensors)}")

    def _open_other_shards(self, first: Path, count: Any) -> None:
        key = Keys.Split.LLM_KV_SPLIT_COUNT
        if not isinstance(count, int) or not 1 <= count <= 99999:
            raise GGUFError(f"{first}: metadata {key!r} = {count!r} is not a shard count")
        if count == 1:
            return
        m = _SPLIT_NAME.match(first.name)
        no = self._shards[0].metadata.get(Keys.Split.LLM_KV_SPLIT_NO)
        if m and int(m["count"]) == count and isinstance(no, int) and no > 0:
            raise GGUFError(f"{first}: this is shard {no + 1} of {count} of a split model: give the first, "
                            f"{m['stem']}-00001-of-{count:05d}.gguf")
        if not m or int(m["no"]) != 1 or int(m["count"]) != count:
            raise GGUFError(f"{first}: metadata {key!r} = {count}, but the file is not named "
                            f"NAME-00001-of-{count:05d}.gguf")
        for no in range(2, count + 1):
            p = first.with_name(f"{m['stem']}-{no:05d}-of-{count:05d}.gguf")
            if not p.exists():
                raise GGUFError(f"{first}: shard {no} of {count} is missing ({p.name})")
            shard = _Shard(p, no - 1)
            got = shard.metadata.get(Keys.Split.LLM_KV_SPLIT_NO)
            if got != no - 1 or shard.metadata.get(key) != count:
                raise GGUFError(f"{p}: split metadata says shard {got} of {shard.metadata.get(key)}, "
                                f"expected {no - 1} of {count}")
            self._shards.append(shard)

    @property
    def shard_paths(self) -> list[Path]:
        return [s.path for s in self._shards]

    @property
    def file_bytes(self) -> int:
        return sum(s.size for s in self._shards)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str, kind: type | tuple[type, ...]) -> Any:
        """The value of `key`, which must exist and be of `kind` (int also accepts no bool)."""
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: missing metadata key {key!r}")
        v = self.metadata[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        ok = isinstance(v, kinds) and not (isinstance(v, bool) and bool not in kinds)
        if float in kinds and isinstance(v, int) and not isinstance(v, bool):
            ok, v = True, float(v)
        if not ok:
            names = "/".join(k.__name__ for k in kinds)
            raise GGUFError(f"{self.path}: metadata {key!r} should be {names}, found {type(v).__name__}")
        return v

    def tensor_data(self, name: str) -> np.ndarray:
        """uint8 bytes of tensor `name`, shaped [..., row_bytes] (zero-copy, read-only)."""
        info = self.tensor(name)
        shard = self._shards[info.shard]
        flat = shard.memmap[info.offset:info.offset + info.nbytes]
        return flat.reshape(*info.shape[:-1], info.row_bytes)

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: missing tensor {name!r}") from None

    def close(self) -> None:
        """Drop this object's references to the maps; views handed out keep theirs alive."""
        self._shards = []

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
