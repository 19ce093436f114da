from __future__ import annotations

import shutil
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.tokenizer import tokenizer_from_gguf

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def forward(self, x):\n    return self.down(x) * 2  # 3.14159\n\n\n\tindented",
    "  leading spaces, trailing   ",
    "Numbers 12345 and 2026-11-29, it's we'll they'd I'M",
    "Ünïcödé café naïve 日本語 emoji 🚀🦀 and ẞ",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
]


@pytest.fixture(scope="module")
def tok(tiny_gguf):
    return tokenizer_from_gguf(GGUFFile(tiny_gguf))


@pytest.fixture(scope="module")
def hf_tok(tiny_gguf, tmp_path_factory):
    """transformers' own GGUF tokenizer conversion: an implementation we did not write."""
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("hf_tok")
    shutil.copy(tiny_gguf, d / "m.gguf")
    return AutoTokenizer.from_pretrained(d, gguf_file="m.gguf")


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers_gguf_tokenizer(tok, hf_tok, text):
    assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text), skip_special=False) == text


def test_ascii_merges_make_multi_char_tokens(tok):
    ids = tok.encode("the quick brown fox")
    assert len(ids) < 0.7 * len("the quick brown fox")
    assert tok.encode(" the") == [tok.tokens.index("Ġthe")]


def test_special_tokens(tok):
    ids = tok.encode("<|im_start|>user<|im_end|>")
    assert ids[0] == tok.tokens.index("<|im_start|>") and ids[-1] == tok.tokens.index("<|im_end|>")
    assert tok.decode(ids) == "user"  # control tokens skipped
    assert tok.eos_id == tok.tokens.index("<|im_end|>")
    assert tok.eos_id in tok.eot_ids
    assert tok.encode("<think>x</think>")[0] == tok.tokens.index("<think>")


def test_incremental_detokenizer_never_splits_a_character(tok):
    text = "日本語 🚀 café"
    ids = tok.encode(text)
    assert len(ids) > len(text)  # multi-byte characters span several byte tokens
    d = tok.detokenizer()
    deltas = [d.push(i) for i in ids] + [d.flush()]
    assert "".join(deltas) == text
    for delta in deltas:
        assert "\ufffd" not in delta
    assert any(delta == "" for delta in deltas)  # held back mid-character


def test_incremental_detokenizer_flushes_incomplete_tail(tok):
    ids = tok.encode("🚀")
    d = tok.detokenizer()
    out = "".join(d.push(i) for i in ids[:-1])
    assert out == ""
    assert d.flush() == "\ufffd"


def test_chat_template(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(msgs)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert tok.apply_chat_template(msgs, enable_thinking=False).endswith("<think>\n\n</think>\n\n")
    assert not tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("assistant\n")
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert "user\nab<|im_end|>" in tok.apply_chat_template(parts)


def test_chat_template_is_sandboxed():
    from strata_mgpu.model.tokenizer import ChatTemplate

    t = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ValueError, match="chat template failed"):
        t.render([])
    with pytest.raises(ValueError, match="does not parse"):
        ChatTemplate("{% for %}")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=60))
def test_random_text_encodes_like_transformers_and_round_trips(tok, hf_tok, text):
    """Qwen's own tokenizer normalizes to NFC first (its tokenizer.json, and Qwen2Tokenizer);
    transformers' GGUF conversion does not, so the two are compared on NFC text."""
    nfc = unicodedata.normalize("NFC", text)
    assert tok.encode(text) == tok.encode(nfc) == hf_tok.encode(nfc, add_special_tokens=False)
    assert tok.decode(tok.encode(text), skip_special=False) == nfc
