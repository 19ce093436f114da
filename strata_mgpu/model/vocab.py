"""A byte-level BPE vocabulary for synthetic models, in one of three families of added tokens.

Ids 0.. are the 256 byte characters, then merges learned from a short built-in text, then merges
extending existing tokens by one printable character, in a fixed order; the family's special
tokens follow. Every merge joins two existing tokens, so the vocabulary is a valid BPE and ASCII
text round-trips. The families (`FAMILIES`) are the added tokens a model family's chat template
writes, typed and ended as llama.cpp's converter writes that family's files:

- `qwen` (the default): Qwen3's ChatML tokens, `<tool_call>`, `<think>`; ends at `<|im_end|>`.
- `harmony` (gpt-oss's o200k_harmony): `<|start|>`, `<|channel|>`, `<|message|>`, `<|constrain|>`,
  `<|end|>`, `<|call|>`, `<|return|>`, all control tokens; EOS `<|return|>`, BOS `<|startoftext|>`.
- `glm` (GLM-4.5): `[gMASK]`, `<sop>`, the role tokens, `<think>`, `<tool_call>`, `<arg_key>`,
  `<arg_value>`, ... all control tokens (HF marks them special); BOS `[gMASK]`, EOT `<|user|>`, EOM
  `<|observation|>`.

The qwen family's ids and size are those the vocabulary always had (tests compare exact text on it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

from gguf import GGUFWriter
from gguf.constants import TokenType
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from strata_mgpu.model.tokenizer import BYTE_TO_UNICODE, QWEN2_SPLIT

# (text, type) in Qwen3's order: the added tokens its chat templates and code completion write (no vision or
# repository tokens).
SPECIAL_TOKENS: tuple[tuple[str, TokenType], ...] = (
    ("<|endoftext|>", TokenType.CONTROL),
    ("<|im_start|>", TokenType.CONTROL),
    ("<|im_end|>", TokenType.CONTROL),
    ("<|fim_prefix|>", TokenType.CONTROL),
    ("<|fim_middle|>", TokenType.CONTROL),
    ("<|fim_suffix|>", TokenType.CONTROL),
    ("<|fim_pad|>", TokenType.CONTROL),
    ("<tool_call>", TokenType.USER_DEFINED),
    ("</tool_call>", TokenType.USER_DEFINED),
    ("<tool_response>", TokenType.USER_DEFINED),
    ("</tool_response>", TokenType.USER_DEFINED),
    ("<think>", TokenType.USER_DEFINED),
    ("</think>", TokenType.USER_DEFINED),
)

# gpt-oss's added tokens that its chat format writes, in their id order (o200k_harmony; the reserved ones left out)
HARMONY_TOKENS: tuple[tuple[str, TokenType], ...] = tuple((t, TokenType.CONTROL) for t in (
    "<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
    "<|message|>", "<|call|>"))

# GLM-4.5's added tokens, in their id order (no image, video or audio tokens)
GLM_TOKENS: tuple[tuple[str, TokenType], ...] = tuple((t, TokenType.CONTROL) for t in (
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>", "<|assistant|>",
    "<|observation|>", "<|code_prefix|>", "<|code_middle|>", "<|code_suffix|>", "<think>", "</think>", "<tool_call>",
    "</tool_call>", "<tool_response>", "</tool_response>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
    "/nothink"))


@dataclass(frozen=True)
class VocabFamily:
    """A family's added tokens and the ones its files name (None: not written)."""

    name: str
    specials: tuple[tuple[str, TokenType], ...]
    eos: str
    bos: str
    pad: str
    eot: str | None = None
    eom: str | None = None
    markers: tuple[str, ...] = ()  # what a chat template of this family writes (and no other family's does)


FAMILIES: dict[str, VocabFamily] = {f.name: f for f in (
    VocabFamily("qwen", SPECIAL_TOKENS, eos="<|im_end|>", bos="<|endoftext|>", pad="<|endoftext|>",
                markers=("<|im_start|>",)),
    VocabFamily("harmony", HARMONY_TOKENS, eos="<|return|>", bos="<|startoftext|>", pad="<|endoftext|>",
                markers=("<|channel|>", "<|message|>")),
    VocabFamily("glm", GLM_TOKENS, eos="<|endoftext|>", bos="[gMASK]", pad="<|endoftext|>", eot="<|user|>",
                eom="<|observation|>", markers=("[gMASK]", "<|assistant|>")),
)}
DEFAULT_FAMILY = "qwen"


def family_of_template(source: str) -> str | None:
    """The one family whose markers the chat template writes, or None where none or several do."""
    found = [f.name for f in FAMILIES.values() if all(m in source for m in f.markers)]
    return found[0] if len(found) == 1 else None


# A ChatML template in the form of Qwen3's (its own wording): tools listed in the system block,
# each assistant call as <tool_call>{"name": ..., "arguments": ...}</tool_call> (arguments as
# given: a string is written as it is), tool results as one user turn of <tool_response> blocks,
# reasoning as <think>...</think> on the turns after the last user message, content as a string or
# a list of text parts, and the `enable_thinking` switch (false: an empty think block is given).
CHAT_TEMPLATE = r"""
{%- macro text_of(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content if part['type'] == 'text' -%}{{ part['text'] }}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(system='', skip=0, last_user=-1) -%}
{%- if messages and messages[0]['role'] == 'system' -%}
{%- set ns.system = text_of(messages[0]['content']) -%}
{%- set ns.skip = 1 -%}
{%- endif -%}
{%- for message in messages -%}
{%- if message['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if ns.system -%}{{- ns.system + '\n\n' -}}{%- endif -%}
{{- '# Tools\n\nThese functions are yours to call. Their signatures, one JSON object a line:\n<tools>' -}}
{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\n</tools>\n\nTo call functions, answer with one block a call, each a JSON object of the name and' -}}
{{- ' the arguments:\n<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}' -}}
{{- '\n</tool_call><|im_end|>\n' -}}
{%- elif ns.skip -%}
{{- '<|im_start|>system\n' + ns.system + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- set role = message['role'] -%}
{%- if loop.index0 < ns.skip -%}
{%- elif role == 'assistant' -%}
{%- set content = text_of(message['content']) -%}
{{- '<|im_start|>assistant\n' -}}
{%- if message['reasoning_content'] and loop.index0 > ns.last_user -%}
{{- '<think>\n' + message['reasoning_content'].strip() + '\n</think>\n\n' -}}
{%- endif -%}
{{- content -}}
{%- for call in message['tool_calls'] or [] -%}
{%- set fn = call['function'] if call['function'] is defined else call -%}
{%- if content or not loop.first -%}{{- '\n' -}}{%- endif -%}
{{- '<tool_call>\n{"name": ' + (fn['name'] | tojson) + ', "arguments": ' -}}
{%- if fn['arguments'] is string -%}{{- fn['arguments'] -}}{%- else -%}{{- fn['arguments'] | tojson -}}{%- endif -%}
{{- '}\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- elif role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\n<tool_response>\n' + text_of(message['content']) + '\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- else -%}
{{- '<|im_start|>' + role + '\n' + text_of(message['content']) + '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}
{%- endif -%}
"""


@dataclass(frozen=True)
class Vocab:
    tokens: list[str]
    types: list[int]
    merges: list[str]  # "left right", in rank order
    family: VocabFamily

    def id_of(self, token: str) -> int:
        return self.tokens.index(token)


def _corpus() -> str:
    return resources.files("strata_mgpu").joinpath("data/corpus.txt").read_text(encoding="utf-8")


def _trained(n_normal: int) -> tuple[list[str], list[str]]:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    alphabet = [BYTE_TO_UNICODE[b] for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=n_normal, min_frequency=2, show_progress=False,
                                  initial_alphabet=alphabet, special_tokens=[])
    tok.train_from_iterator(_corpus().splitlines(keepends=True), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    by_id = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return [t for t, _ in by_id], merges


def build_vocab(vocab_size: int, family: str = DEFAULT_FAMILY) -> Vocab:
    """`vocab_size` tokens in all, the family's added tokens last (ValueError: an unknown family, or too small)."""
    if family not in FAMILIES:
        raise ValueError(f"vocabulary family {family!r}: one of {', '.join(FAMILIES)}")
    specials = FAMILIES[family].specials
    n_normal = vocab_size - len(specials)
    if n_normal < 256:
        raise ValueError(f"vocab size {vocab_size} is too small: needs 256 byte tokens "
                         f"+ {len(specials)} specials")
    tokens, merges = _trained(n_normal)
    known = set(tokens)
    # Extend existing tokens by one printable ASCII character (space shown as 'Ġ'), in id order.
    extenders = [BYTE_TO_UNICODE[b] for b in range(32, 127)]
    base = 256
    while len(tokens) < n_normal:
        stem = tokens[base]
        for c in extenders:
            if len(tokens) >= n_normal:
                break
            if stem + c not in known:
                known.add(stem + c)
                tokens.append(stem + c)
                merges.append(f"{stem} {c}")
        base += 1
    types = [TokenType.NORMAL] * len(tokens) + [t for _, t in specials]
    return Vocab(tokens=tokens + [t for t, _ in specials], types=[int(t) for t in types], merges=merges,
                 family=FAMILIES[family])


def write_vocab(w: GGUFWriter, vocab: Vocab) -> None:
    """The tokenizer's keys as llama.cpp's converter writes the family's files (pre-tokenizer: qwen2's
    split, the only one read here), and the family's name under `strata.synthetic.vocab`."""
    family = vocab.family
    w.add_string("strata.synthetic.vocab", family.name)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    w.add_token_merges(vocab.merges)
    w.add_eos_token_id(vocab.id_of(family.eos))
    w.add_pad_token_id(vocab.id_of(family.pad))
    w.add_bos_token_id(vocab.id_of(family.bos))
    if family.eot is not None:
        w.add_eot_token_id(vocab.id_of(family.eot))
    if family.eom is not None:
        w.add_eom_token_id(vocab.id_of(family.eom))
    w.add_add_bos_token(False)
