from __future__ import annotations

import contextlib
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata_mgpu.model.gguf_reader import GGUFArray, GGUFError, GGUFFile
from strata_mgpu.model.synthetic import write_model
from tests.gguf_bytes import ARRAY, STRING, U32, RawGGUF, RawTensor, kv_u32, s, valid


def write(tmp_path: Path, data: bytes, name: str = "m.gguf") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def test_matches_gguf_py_on_synthetic_model(tiny_gguf):
    ours = GGUFFile(tiny_gguf)
    ref = GGUFReader(tiny_gguf)
    assert set(ours.tensors) == {t.name for t in ref.tensors}
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.ggml_type == t.tensor_type
        assert mine.shape == tuple(int(d) for d in reversed(t.shape.tolist()))
        assert mine.offset == t.data_offset
        assert mine.nbytes == t.n_bytes
        assert np.array_equal(ours.tensor_data(t.name).reshape(-1), np.asarray(t.data).reshape(-1).view(np.uint8))
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        v = ours.metadata[key]
        if isinstance(v, GGUFArray):
            assert len(v) == len(field.data)
            assert v[0] == field.contents(0) and v[-1] == field.contents(len(field.data) - 1)
        else:
            assert v == pytest.approx(field.contents())


def test_arrays_are_lazy_and_tensor_data_zero_copy(tiny_gguf):
    f = GGUFFile(tiny_gguf)
    tokens = f.metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, GGUFArray) and tokens._cache is None
    assert tokens[0] == "!" and tokens._cache is not None
    data = f.tensor_data("blk.0.ffn_gate_exps.weight")
    assert isinstance(data.base, np.memmap) or isinstance(data, np.memmap)
    assert not data.flags.writeable
    assert data.shape == (8, 256, 256 // 256 * 144)


def test_hand_built_valid_file(tmp_path):
    f = GGUFFile(write(tmp_path, valid().build()))
    assert f.metadata["general.architecture"] == "test"
    assert f.metadata["tokenizer.ggml.tokens"].tolist() == ["a", "b", "ab", "<s>"]
    assert f.metadata["test.scores"].numpy().tolist() == [1.0, 2.0, 3.0]
    assert f.tensors["c.weight"].shape == (2, 1, 1, 32)
    assert f.tensor_data("a.weight").shape == (2, 32)


def test_split_files_load_as_one(tmp_path):
    single = tmp_path / "one" / "m.gguf"
    write_model(single, "tiny", seed=3)
    split = tmp_path / "split" / "m.gguf"
    write_model(split, "tiny", seed=3, split_max_bytes=2_000_000)
    shards = sorted(split.parent.glob("m-*-of-*.gguf"))
    assert len(shards) >= 3
    a, b = GGUFFile(single), GGUFFile(shards[0])
    assert len(b.shard_paths) == len(shards)
    assert set(a.tensors) == set(b.tensors)
    for name in a.tensors:
        assert np.array_equal(a.tensor_data(name), b.tensor_data(name)), name
    assert b.metadata["tokenizer.ggml.tokens"].tolist() == a.metadata["tokenizer.ggml.tokens"].tolist()
    shards[-1].unlink()
    with pytest.raises(GGUFError, match="missing"):
        GGUFFile(shards[0])


def _bad(**changes) -> RawGGUF:
    g = valid()
    for k, v in changes.items():
        setattr(g, k, v)
    return g


MALFORMED = {
    "bad magic": (_bad(magic=b"GGUG").build(), "bad magic"),
    "version 1": (_bad(version=1).build(), "unsupported GGUF version 1"),
    "version 99": (_bad(version=99).build(), "unsupported GGUF version 99"),
    "absurd kv count": (_bad(n_kv=2**60).build(), "metadata count"),
    "absurd tensor count": (_bad(n_tensors=2**62).build(), "tensor count"),
    "kv count one too many": (_bad(n_kv=5).build(), "key|type|length|past the end"),
    "string length past end": (RawGGUF(kvs=[struct.pack("<Q", 2**40) + b"k"]).build(), "runs past the end"),
    "unknown value type": (RawGGUF(kvs=[s("k") + struct.pack("<I", 77)]).build(), "unknown value type 77"),
    "nested array": (RawGGUF(kvs=[s("k") + struct.pack("<IIQ", ARRAY, ARRAY, 1)]).build(), "nested arrays"),
    "absurd array length": (RawGGUF(kvs=[s("k") + struct.pack("<IIQ", ARRAY, U32, 2**61)]).build(),
                            "array length"),
    "string array past end": (RawGGUF(kvs=[s("k") + struct.pack("<IIQ", ARRAY, STRING, 2) + s("a")
                                           + struct.pack("<Q", 1000)]).build(),
                              r"'k'\[1\]"),
    "duplicate key": (RawGGUF(kvs=[kv_u32("a", 1), kv_u32("a", 2)]).build(), "duplicate metadata key 'a'"),
    "alignment not power of two": (RawGGUF(kvs=[kv_u32("general.alignment", 24)]).build(), "power of two"),
    "alignment zero": (RawGGUF(kvs=[kv_u32("general.alignment", 0)]).build(), "power of two"),
    "invalid utf-8 key": (RawGGUF(kvs=[s(b"\xff\xfe") + struct.pack("<II", U32, 1)]).build(), "UTF-8"),
    "five dims": (RawGGUF(tensors=[RawTensor("t", [1, 1, 1, 1, 32])]).build(), "5 dimensions"),
    "zero dims": (RawGGUF(tensors=[RawTensor("t", [])]).build(), "0 dimensions"),
    "zero-sized dim": (RawGGUF(tensors=[RawTensor("t", [32, 0])]).build(), "bad dimensions"),
    "unknown tensor type": (RawGGUF(tensors=[RawTensor("t", [32], ggml_type=1234)]).build(), "unknown tensor type"),
    "row not whole blocks": (RawGGUF(tensors=[RawTensor("t", [33], ggml_type=8, nbytes=34)]).build(),
                             "not a multiple of Q8_0's block size 32"),
    "misaligned offset": (RawGGUF(tensors=[RawTensor("t", [8]), RawTensor("u", [8], offset=36)]).build(),
                          "not a multiple of the alignment"),
    "offset past end": (RawGGUF(tensors=[RawTensor("t", [8], offset=2**40)]).build(), "past the end"),
    "overflowing size": (RawGGUF(tensors=[RawTensor("t", [2**40, 2**40], nbytes=0)]).build(),
                         "overflows|past the end"),
    "overlapping tensors": (RawGGUF(tensors=[RawTensor("t", [16]), RawTensor("u", [16], offset=32)]).build(),
                            "overlaps"),
    "duplicate tensor": (RawGGUF(tensors=[RawTensor("t", [8]), RawTensor("t", [8])]).build(),
                         "duplicate tensor name 't'"),
    "empty file": (b"", "too short"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_files_raise_one_clear_error(tmp_path, case):
    data, pattern = MALFORMED[case]
    with pytest.raises(GGUFError, match=pattern) as e:
        GGUFFile(write(tmp_path, data))
    assert "\n" not in str(e.value)


def test_every_truncation_is_a_clear_error(tmp_path):
    data = valid().build()
    ok_len = None
    for n in range(len(data)):
        p = write(tmp_path, data[:n])
        try:
            GGUFFile(p)
        except GGUFError as e:
            assert "\n" not in str(e)
            continue
        ok_len = n  # only the data section's tail may go without the header noticing... it must not
        break
    assert ok_len is None, f"truncated to {ok_len} of {len(data)} bytes and still accepted"


def test_truncated_synthetic_model(tiny_gguf, tmp_path):
    data = tiny_gguf.read_bytes()
    for n in (0, 3, 23, 100, 1000, 30_000, len(data) // 2, len(data) - 1):
        with pytest.raises(GGUFError):
            GGUFFile(write(tmp_path, data[:n]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_mutated_files_never_crash(tmp_path, data):
    """Flip, overwrite or cut bytes of a valid file: it parses or raises GGUFError, nothing else."""
    raw = bytearray(valid().build())
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw) - 1))
        how = data.draw(st.sampled_from(["byte", "u64", "cut"]))
        if how == "byte":
            raw[at] = data.draw(st.integers(0, 255))
        elif how == "u64":
            v = data.draw(st.sampled_from([0, 1, 2**31, 2**32 - 1, 2**63 - 1, 2**64 - 1]))
            raw[at:at + 8] = struct.pack("<Q", v)[: len(raw) - at]
        else:
            del raw[at:]
            break
    p = write(tmp_path, bytes(raw))
    try:
        f = GGUFFile(p)
    except GGUFError as e:
        assert "\n" not in str(e)
        return
    for name in f.tensors:  # whatever parsed must be readable
        f.tensor_data(name).sum()
    for v in f.metadata.values():
        if isinstance(v, GGUFArray):
            with contextlib.suppress(GGUFError):
                v.tolist()


def test_info_on_malformed_file_is_one_line_no_traceback(tmp_path):
    p = write(tmp_path, _bad(n_tensors=2**62).build())
    r = subprocess.run([sys.executable, "-m", "strata_mgpu", "info", str(p)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "tensor count" in lines[0] and "Traceback" not in r.stderr
