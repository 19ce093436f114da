from __future__ import annotations

import dataclasses

import pytest
from gguf import GGUFWriter

from strata_mgpu.model.gguf_reader import GGUFError, GGUFFile
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.synthetic import PRESETS


def test_spec_of_tiny(tiny_gguf):
    spec = spec_from_gguf(GGUFFile(tiny_gguf))
    expected = PRESETS["tiny"].spec("strata-synthetic-tiny")
    assert spec == dataclasses.replace(expected, rms_eps=spec.rms_eps)  # stored as float32
    assert spec.rms_eps == pytest.approx(1e-6)
    assert spec.gqa_group == 2 and spec.q_dim == 256 and spec.kv_dim == 128
    assert not spec.tied_output


def test_30b_shapes():
    spec = PRESETS["30b-a3b"].spec("x")
    assert spec.n_params == pytest.approx(30.5e9, rel=0.02)
    assert spec.n_active_params == pytest.approx(3.3e9, rel=0.1)


def _copy_with(src, dst, *, drop_key=None, drop_tensor=None, reshape=None, arch=None, add=None, set_key=None):
    """Rewrite a GGUF with one thing changed, via gguf-py's writer (`add`: name -> F32 array, more tensors;
    `set_key`: (key, value), the value's GGUF type its own)."""
    from gguf import GGUFReader, GGUFValueType

    r = GGUFReader(src)
    w = GGUFWriter(dst, arch or r.fields["general.architecture"].contents())
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key in (drop_key, "general.architecture") or (set_key and key == set_key[0]):
            continue
        w.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[-1] if len(field.types) > 1
                        else None)
    if set_key is not None:
        w.add_key_value(set_key[0], set_key[1], GGUFValueType.get_type(set_key[1]))
    for t in r.tensors:
        if t.name == drop_tensor:
            continue
        shape = list(reversed(t.shape.tolist()))
        data = t.data
        if t.name == reshape:
            shape = [shape[0] // 2, *shape[1:]]
            data = data[: data.shape[0] // 2]
        w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
    for name, data in (add or {}).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def assert_refused_in_one_line(src, tmp_path, message, **change) -> None:
    """`src` rewritten with `change` (as `_copy_with` takes it): the reader's GGUFError, one line, says `message`."""
    bad = _copy_with(src, tmp_path / "bad.gguf", **change)
    with pytest.raises(GGUFError, match=message) as e:
        spec_from_gguf(GGUFFile(bad))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("change, message", [
    (dict(drop_key="qwen3moe.expert_count"), "missing metadata key 'qwen3moe.expert_count'"),
    (dict(drop_tensor="blk.2.attn_k.weight"), "missing tensor 'blk.2.attn_k.weight'"),
    (dict(reshape="blk.1.attn_v.weight"), "tensor 'blk.1.attn_v.weight' has shape"),
    (dict(arch="llama"), "architecture 'llama' is not supported"),
])
def test_spec_errors_name_the_problem(tiny_gguf, tmp_path, change, message):
    bad = _copy_with(tiny_gguf, tmp_path / "bad.gguf", **change)
    with pytest.raises(GGUFError, match=message):
        spec_from_gguf(GGUFFile(bad))
