"""A byte-level BPE vocabulary for synthetic models, laid out like Qwen's.

Ids 0.. are the 256 byte characters, then merges learned from a short built-in text, then merges
extending existing tokens by one printable character, in a fixed order; the special tokens
follow, as in Qwen3. Every merge joins two existing tokens, so the vocabulary is a valid BPE and
ASCII text round-trips.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

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


def build_vocab(vocab_size: int) -> Vocab:
    n_normal = vocab_size - len(SPECIAL_TOKENS)
    if n_normal < 256:
        raise ValueError(f"vocab size {vocab_size} is too small: needs 256 byte tokens "
                         f"+ {len(SPECIAL_TOKENS)} specials")
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
    types = [TokenType.NORMAL] * len(tokens) + [t for _, t in SPECIAL_TOKENS]
    return Vocab(tokens=tokens + [t for t, _ in SPECIAL_TOKENS], types=[int(t) for t in types], merges=merges)
