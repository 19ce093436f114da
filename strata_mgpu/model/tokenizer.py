"""Tokenizer and chat template from GGUF metadata.

`tokenizer.ggml.model = gpt2` with `pre = qwen2` becomes a `tokenizers` byte-level BPE with the
Qwen2 split regex and NFC normalization, with `pre = gpt-4o` (gpt-oss's o200k_harmony, as llama.cpp's
converter names it) one with o200k's split and no normalization (tiktoken's); CONTROL and
USER_DEFINED tokens become added tokens.
A turn ends at the file's EOS, EOT and EOM tokens and at the control tokens llama.cpp ends turns
at by name (`TURN_ENDS`: `<|im_end|>`, gpt-oss's `<|return|>` and `<|call|>`, ...).
"""

from __future__ import annotations

import codecs
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import jinja2
from gguf.constants import Keys, TokenType
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from strata_mgpu.model.gguf_reader import T_STRING, GGUFArray, GGUFError, GGUFFile

# The pre-tokenizer split of Qwen2/Qwen3 (tokenizer.json of those models).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# The split of o200k (tiktoken's pattern; gpt-oss's o200k_harmony keeps it): cased words apart, digits in threes.
_O200K_LETTERS = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"  # upper-ish, lower-ish
GPT4O_SPLIT = (rf"[^\r\n\p{{L}}\p{{N}}]?{_O200K_LETTERS[0]}*{_O200K_LETTERS[1]}+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               rf"|[^\r\n\p{{L}}\p{{N}}]?{_O200K_LETTERS[0]}+{_O200K_LETTERS[1]}*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {"qwen2": QWEN2_SPLIT, "gpt-4o": GPT4O_SPLIT}
NFC_PRE_TOKENIZERS = frozenset({"qwen2"})  # the others' text is not normalized (tiktoken normalizes nothing)
# control tokens that end a turn wherever a vocabulary holds them (gpt-oss: <|return|> ends an answer,
# <|call|> a tool call; its <|end|> ends a message inside the answer, so it is not one of these)
TURN_ENDS = ("<|im_end|>", "<|endoftext|>", "<|return|>", "<|call|>")


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (byte-level BPE alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


BYTE_TO_UNICODE = byte_to_unicode()
UNICODE_TO_BYTE = {c: b for b, c in BYTE_TO_UNICODE.items()}


@dataclass
class Tokenizer:
    """Encode/decode text for one model. Ids are the GGUF token list's indices."""

    hf: HFTokenizer
    tokens: list[str]
    token_types: list[int]
    bos_id: int | None
    eos_id: int | None
    eot_ids: frozenset[int]  # ids that end a turn (EOS, <|im_end|>, ...)
    add_bos: bool
    chat_template: ChatTemplate | None
    shown: frozenset[int] = frozenset()  # control tokens decoded as their text: a chat format's markup
    _bytes_cache: dict[int, bytes] = field(default_factory=dict, repr=False)

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @functools.cached_property
    def added_ids(self) -> tuple[int, ...]:
        """The added tokens' ids (CONTROL, USER_DEFINED): tokens that text is never split into."""
        return tuple(i for i, t in enumerate(self.token_types) if t in (TokenType.CONTROL, TokenType.USER_DEFINED))

    def encode(self, text: str, *, add_special: bool = True) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        return b"".join(self.token_bytes(i, skip_special=skip_special) for i in ids).decode("utf-8", "replace")

    def is_special(self, token_id: int) -> bool:
        return self.token_types[token_id] in (TokenType.CONTROL, TokenType.UNUSED, TokenType.UNKNOWN)

    def show_markup(self, texts: Sequence[str]) -> None:
        """Decode these control tokens (where the vocabulary holds them) as their text, not as nothing:
        the markup a chat format's answers are read by (gpt-oss's `<|channel|>`, GLM's `<tool_call>`;
        llama.cpp's preserved tokens). Set once, when the server chooses how it reads answers, before
        any request is decoded."""
        ids = {self.tokens.index(t) for t in texts if t in self.tokens}
        self.shown = frozenset(ids)

    def token_bytes(self, token_id: int, *, skip_special: bool = True) -> bytes:
        """The bytes one token stands for; control tokens give b'' when skipped."""
        if not 0 <= token_id < len(self.tokens):
            raise ValueError(f"token id {token_id} out of range 0..{len(self.tokens) - 1}")
        if skip_special and self.is_special(token_id) and token_id not in self.shown:
            return b""
        cached = self._bytes_cache.get(token_id)
        if cached is None:
            text = self.tokens[token_id]
            if self.token_types[token_id] == TokenType.NORMAL:
                cached = bytes(UNICODE_TO_BYTE[c] for c in text if c in UNICODE_TO_BYTE)
            else:
                cached = text.encode("utf-8")
            self._bytes_cache[token_id] = cached
        return cached

    def detokenizer(self, *, skip_special: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special)

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        if self.chat_template is None:
            raise ValueError("this model has no chat template (tokenizer.chat_template)")
        bos = self.tokens[self.bos_id] if self.bos_id is not None else ""
        eos = self.tokens[self.eos_id] if self.eos_id is not None else ""
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=bos, eos_token=eos, **kwargs)


class IncrementalDetokenizer:
    """Feeds token ids, returns text deltas; a multi-byte character split across tokens is held
    back until complete (or flushed with U+FFFD if the stream ends inside it)."""

    def __init__(self, tok: Tokenizer, skip_special: bool = True):
        self._tok = tok
        self._skip = skip_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._decoder.decode(self._tok.token_bytes(token_id, skip_special=self._skip))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class ChatTemplate:
    """A jinja2 chat template rendered in an immutable sandbox (HF's conventions).

    Messages reach it whole, as `apply_chat_template` passes them, with one exception: a template
    that drops content given as a list of text parts (Qwen3's renders only string content) is given
    each list joined into a string. Whether it does is found once (`takes_text_parts`).
    """

    def __init__(self, source: str):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template does not parse: line {e.lineno}: {e.message}") from None
        self.source = source
        self.takes_text_parts = self._renders_text_parts()

    def _renders_text_parts(self) -> bool:
        probe = "text-part-probe-7f3a"
        try:
            out = self._template.render(messages=[{"role": "user", "content": [{"type": "text", "text": probe}]}],
                                        add_generation_prompt=True)
        except Exception:  # a template may refuse a lone message, or lists: join them then
            return False
        return probe in out

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if not self.takes_text_parts:
            messages = [_joined_text_parts(m) for m in messages]
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **kwargs)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from None
        except Exception as e:  # the template's own Python on these messages: `'x' in None`, `None + 'x'`
            raise ValueError(f"chat template failed on these messages: {type(e).__name__}: {e}") from None


def _joined_text_parts(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if not isinstance(content, list):
        return message
    text = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return {**message, "content": text}


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def build_hf_tokenizer(tokens: list[str], types: list[int], merges: list[str], pre: str) -> HFTokenizer:
    split = PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        raise ValueError(f"pre-tokenizer {pre!r} is not supported (supported: {', '.join(PRE_TOKENIZER_SPLITS)})")
    # Every token goes into the BPE vocab with its GGUF id, so added tokens keep their ids too.
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("the token list holds duplicate tokens")
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep or not a or not b:
            raise ValueError(f"malformed merge {m!r}")
        pairs.append((a, b))
    bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False,
                     ignore_merges=False)
    hf = HFTokenizer(bpe)
    if pre in NFC_PRE_TOKENIZERS:
        hf.normalizer = normalizers.NFC()
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    hf.decoder = decoders.ByteLevel()
    added = [AddedToken(t, special=ty == TokenType.CONTROL, normalized=False)
             for t, ty in zip(tokens, types, strict=True) if ty in (TokenType.CONTROL, TokenType.USER_DEFINED)]
    if added:
        hf.add_tokens(added)
        # add_tokens assigns ids by content lookup in the vocab; check they kept the GGUF ids
        for t in added:
            if hf.token_to_id(t.content) != vocab[t.content]:
                raise ValueError(f"added token {t.content!r} got a different id")
    return hf


def tokenizer_from_gguf(f: GGUFFile) -> Tokenizer:
    K = Keys.Tokenizer
    model = f.require(K.MODEL, str)
    if model != "gpt2":
        raise GGUFError(f"{f.path}: tokenizer model {model!r} is not supported (supported: gpt2)")
    tokens_arr = f.require(K.LIST, object)
    types_arr = f.require(K.TOKEN_TYPE, object)
    merges_arr = f.require(K.MERGES, object)
    tokens, types, merges = _str_list(f, K.LIST, tokens_arr), types_arr.tolist(), _str_list(f, K.MERGES, merges_arr)
    if len(types) != len(tokens):
        raise GGUFError(f"{f.path}: {K.TOKEN_TYPE!r} has {len(types)} entries, {K.LIST!r} has {len(tokens)}")
    pre = f.get(K.PRE, "qwen2")
    try:
        hf = build_hf_tokenizer(tokens, types, merges, pre)
    except Exception as e:  # ValueError from us, tokenizers' own Exception subclass from Rust
        raise GGUFError(f"{f.path}: tokenizer: {e}") from None

    def token_id(key: str) -> int | None:
        v = f.get(key)
        if v is None:
            return None
        if not isinstance(v, int) or not 0 <= v < len(tokens):
            raise GGUFError(f"{f.path}: metadata {key!r} = {v!r} is not a token id")
        return v

    eos = token_id(K.EOS_ID)
    eot = token_id(K.EOT_ID)
    eom = token_id(K.EOM_ID)
    bos = token_id(K.BOS_ID)
    ends = {i for i in (eos, eot, eom) if i is not None}
    for name in TURN_ENDS:
        if name in tokens and types[tokens.index(name)] == TokenType.CONTROL:
            ends.add(tokens.index(name))
    template_src = f.get(K.CHAT_TEMPLATE)
    try:
        template = ChatTemplate(template_src) if isinstance(template_src, str) else None
    except ValueError as e:
        raise GGUFError(f"{f.path}: {K.CHAT_TEMPLATE}: {e}") from None
    return Tokenizer(hf=hf, tokens=tokens, token_types=types, bos_id=bos, eos_id=eos, eot_ids=frozenset(ends),
                     add_bos=bool(f.get(K.ADD_BOS, False)), chat_template=template)


def _str_list(f: GGUFFile, key: str, arr: Any) -> list[str]:
    if not isinstance(arr, GGUFArray) or arr.elem_type != T_STRING:
        raise GGUFError(f"{f.path}: metadata {key!r} should be an array of strings")
    return arr.tolist()
