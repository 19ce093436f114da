"""gpt-oss's harmony answers read on the host: analysis is reasoning, a message to functions.NAME a
call (either header order), final and preambles content; any split of an answer reads as the whole
does and a call's argument deltas join to its arguments; a cut anywhere leaves no markup and no call
it cut; model text gone wrong never raises; the grammar of a required call admits what the model
writes and the reader reads it."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata_mgpu.config import EngineConfig
from strata_mgpu.engine.engine import Engine
from strata_mgpu.engine.grammar import GrammarCompiler
from strata_mgpu.engine.sampler import SamplingParams
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.runner import load_reference_runner
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.tokenizer import tokenizer_from_gguf
from strata_mgpu.server.dialects import HARMONY
from strata_mgpu.server.grammars import Thinking, chat_grammar
from strata_mgpu.server.json_schema import strict_schema
from tests import engine_runs
from tests.test_tool_dialects import FUNCTIONS, JSON_VALUES, TEXT, splits

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MARKUP = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>")


def read(chunks: list[str], functions=FUNCTIONS, cut: bool = False, split: bool = True, valid: bool = True):
    """(reasoning, content, [(name, arguments)], each call's argument deltas, cut_call)."""
    answer = HARMONY.answer(split_reasoning=split, opened=False, parse_tools=True, functions=functions,
                            max_calls=None)
    reasoning, content, calls, deltas = "", "", [], []
    for c in [*chunks, None]:
        out = answer.feed(c) if c is not None else answer.finish(cut)
        reasoning += out.reasoning
        content += out.content
        calls += out.calls
        deltas += out.deltas
    heads = [d for d in deltas if d.id is not None]
    assert [(d.index, d.id, d.name) for d in heads][:len(calls)] == [(c.index, c.id, c.name) for c in calls]
    assert len(heads) == len(calls) + answer.cut_call
    pieces = [[d.arguments for d in deltas if d.index == c.index and d.id is None] for c in calls]
    for call, call_pieces in zip(calls, pieces, strict=True):
        assert "".join(call_pieces) == call.arguments and all(call_pieces)
        assert not valid or isinstance(json.loads(call.arguments), dict)
    return reasoning, content, [(c.name, c.arguments) for c in calls], pieces, answer.cut_call


def call_header(name: str, template_order: bool) -> str:
    """A call's header as gpt-oss writes it (recipient after the channel) or as its template does."""
    if template_order:
        return f"<|start|>assistant to=functions.{name}<|channel|>commentary json<|message|>"
    return f"<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"


@st.composite
def harmony_answer(draw) -> tuple[str, str, str, list[tuple[str, dict]]]:
    """(answer, its reasoning, its content, its calls): analysis messages, preambles, then a final
    message or one call (a call ends the turn: <|call|> never reaches the text)."""
    parts, reasoning, content, calls = [], "", "", []
    for _ in range(draw(st.integers(0, 3))):
        kind, text = draw(st.sampled_from(["analysis", "preamble"])), draw(TEXT)
        channel = "analysis" if kind == "analysis" else "commentary"
        parts.append(f"<|start|>assistant<|channel|>{channel}<|message|>{text}<|end|>")
        if kind == "analysis":
            reasoning += text
        else:
            content += text
    if draw(st.booleans()):
        name = draw(st.sampled_from(["f", "g"]))
        arguments = draw(st.dictionaries(TEXT, JSON_VALUES, max_size=4))
        parts.append(call_header(name, draw(st.booleans())) + json.dumps(arguments, ensure_ascii=draw(st.booleans())))
        calls.append((name, arguments))
    else:
        text = draw(TEXT)
        parts.append(f"<|start|>assistant<|channel|>final<|message|>{text}")
        content += text
    answer = "".join(parts).removeprefix("<|start|>assistant")  # the generation prompt wrote the first
    return answer, reasoning, content, calls


@SETTINGS
@given(data=st.data())
def test_any_split_reads_as_the_whole_and_the_deltas_join_to_the_arguments(data):
    text, reasoning, content, written = data.draw(harmony_answer())
    whole = read([text])
    assert whole[0] == reasoning and whole[1] == content
    assert [(n, json.loads(a)) for n, a in whole[2]] == written
    assert read(splits(data.draw, text))[:3] == whole[:3]
    assert read([text], functions=None)[:3] == whole[:3]  # any name: the same calls
    unsplit = read([text], split=False)  # reasoning not split off: it is content
    assert unsplit[0] == "" and sorted(unsplit[1]) == sorted(reasoning + content)


@SETTINGS
@given(data=st.data())
def test_a_cut_anywhere_leaves_no_markup_and_gives_no_call_it_cut(data):
    text, _, _, written = data.draw(harmony_answer())
    at = data.draw(st.integers(0, len(text)))
    reasoning, content, calls, _, cut_call = read(splits(data.draw, text[:at]), cut=True)
    assert not any(m in reasoning or m in content for m in MARKUP)
    said = reasoning + content  # nor a tag's start (the answers' own text holds no "<|")
    assert not any(said.endswith(m[:n]) for m in MARKUP for n in range(2, len(m)))
    whole = read([text])[2]
    assert calls == whole[:len(calls)]  # a call given is one whose JSON had closed
    assert not (cut_call and calls)


CORRUPTIONS = ["False", "\n", "\x01", "\\q", "NaN", "}", '"', "<|channel|>", "<|message|>", "<|end|>", "<|start|>",
               " to=functions.f", "<|constrain|>", "<|"]


@SETTINGS
@given(data=st.data())
def test_a_corrupted_answer_reads_the_same_in_every_split_and_never_raises(data):
    text, _, _, _ = data.draw(harmony_answer())
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(text)))
        text = text[:at] + data.draw(st.sampled_from(CORRUPTIONS)) + text[at:]
    whole = read([text], valid=False)
    assert read(splits(data.draw, text), valid=False)[:3] == whole[:3]
    at = data.draw(st.integers(0, len(text)))
    assert read(splits(data.draw, text[:at]), cut=True, valid=False)[:3] == \
        read([text[:at]], cut=True, valid=False)[:3]


def test_arguments_stream_as_they_are_generated():
    text = '<|channel|>commentary to=functions.g <|constrain|>json<|message|>{"s": "a long value, token by token"}'
    chunks = [text[i:i + 3] for i in range(0, len(text), 3)]
    _, _, calls, pieces, _ = read(chunks)
    assert calls == [("g", '{"s": "a long value, token by token"}')] and len(pieces[0]) > 8


@pytest.mark.parametrize("text, reasoning, content, calls", [
    # no markup at all: the model's text as it stands
    ("Just text, <b>bold</b>.", "", "Just text, <b>bold</b>.", []),
    # a function not offered: read whole, a call where its body is an object
    ('<|channel|>commentary to=functions.other <|constrain|>json<|message|>{"q": 1}', "", "", [("other", {"q": 1})]),
    ('<|channel|>commentary to=functions.other <|constrain|>json<|message|>not json', "", "not json", []),
    # a builtin tool's recipient (not functions.*): content
    ("<|channel|>analysis to=browser.search<|message|>{}", "", "{}", []),
    # the answer ends inside a header: it is dropped
    ("<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>fin", "hm", "", []),
])
def test_harmony_is_read_as_vllm_and_llamacpp_read_it(text, reasoning, content, calls):
    got = read([text])
    assert got[:2] == (reasoning, content) and [(n, json.loads(a)) for n, a in got[2]] == calls
    assert read(list(text))[:3] == got[:3]


def test_a_sure_call_that_breaks_keeps_its_text_and_one_the_limit_cuts_is_none():
    text = '<|channel|>commentary to=functions.g <|constrain|>json<|message|>{"s": nope}'
    for chunks in ([text], list(text)):
        assert read(chunks, valid=False)[2] == [("g", '{"s": nope}')]
        assert read(chunks, cut=True, valid=False)[2:3] == ([],) and read(chunks, cut=True, valid=False)[4]


def test_required_calls_on_a_random_harmony_model_read_into_arguments_that_validate(template_gguf):
    """tool_choice required on gpt-oss's vocabulary (its markup as tokens): what the grammar lets
    the random model write the reader reads into one call whose arguments validate against the
    strict schema; the grammar refuses a final answer instead, and where the model may think
    first it admits an analysis message before the call."""
    f = GGUFFile(template_gguf("gpt-oss"))
    spec, tok = spec_from_gguf(f), tokenizer_from_gguf(f)
    tok.show_markup(HARMONY.shown_markup)
    weather = {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["C", "F"]}}, "required": ["city"]}}
    compiler = GrammarCompiler(tok, spec.vocab_size)
    def admits(thinking: Thinking, text: str) -> bool:
        m = compiler.compile(chat_grammar(tok, HARMONY, functions=[weather], parallel=True, answer_schema=None,
                                          thinking=thinking)).matcher()
        return all(m.accept(t) for t in tok.encode(text, add_special=False)) and m.native.is_accepting()
    call = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
    assert admits(Thinking.OFF, call) and not admits(Thinking.OFF, "<|channel|>final<|message|>hi")
    assert admits(Thinking.OPTIONAL, "<|channel|>analysis<|message|>Paris, so.<|end|><|start|>assistant" + call)
    assert admits(Thinking.OPTIONAL, call) and not admits(Thinking.OFF, call.replace("Paris", "Paris, France!!"))
    grammar = compiler.compile(chat_grammar(tok, HARMONY, functions=[weather], parallel=True, answer_schema=None,
                                            thinking=Thinking.OFF))
    requests = [(tok.encode(f"<|start|>user<|message|>Call {i}<|end|><|start|>assistant", add_special=False),
                 SamplingParams(max_tokens=120, temperature=t, seed=i, grammar=grammar))
                for i, t in enumerate([0.0, 1.0])]
    runner = load_reference_runner(f, spec)
    outs = engine_runs.run_all(Engine(runner, tok, EngineConfig(prefix_cache=False)), requests, max_steps=2_000)
    for out in outs:
        assert out[-1].finish_reason == "stop"
        text = "".join(o.text for o in out)
        _, content, calls, _, _ = read([text], functions={"get_weather": weather["parameters"]})
        assert content == "" and [n for n, _ in calls] == ["get_weather"], text
        jsonschema.validate(json.loads(calls[0][1]), strict_schema(weather["parameters"]))
