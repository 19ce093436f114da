"""The tagged tool dialects (Hermes/Qwen3's JSON calls, Qwen3-Coder's XML calls, GLM-4.5's key/value
calls) on the host: any split of
an answer into deltas reads as the whole does; the argument deltas joined are the final arguments
and parse; calls stream before their close tag; a cut anywhere leaves no markup in the content and
gives no call it cut; a broken call keeps the model's text; XML values take their schema's types;
the dialect chosen from a template; the grammars of calls (token by token, through llguidance)
strict unless lenient, $refs included, and what they admit the reader reads into arguments that
validate."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from strata_mgpu.config import EngineConfig
from strata_mgpu.engine.engine import Engine
from strata_mgpu.engine.grammar import GrammarCompiler
from strata_mgpu.engine.sampler import SamplingParams
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.runner import load_reference_runner
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.tokenizer import tokenizer_from_gguf
from strata_mgpu.model.vocab import CHAT_TEMPLATE
from strata_mgpu.server.app import ServerState
from strata_mgpu.server.dialects import (
    DIALECTS,
    GLM45,
    HARMONY,
    HERMES,
    QWEN3_CODER,
    TaggedDialect,
    choose_dialect,
    dialect_of_template,
)
from strata_mgpu.server.grammars import Thinking, chat_grammar, text_grammar
from strata_mgpu.server.json_schema import strict_schema
from strata_mgpu.server.qwen3_coder import value_json
from strata_mgpu.server.tool_calls import ToolCallParser
from tests import engine_runs
from tests.conftest import template_text

TEMPLATES = Path(__file__).parent / "data" / "templates"
TYPED = {"type": "object", "properties": {
    "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"}, "b": {"type": "boolean"},
    "a": {"type": "array"}, "o": {"type": "object"}}}
FUNCTIONS = {"f": TYPED, "g": {"type": "object", "properties": {"s": {"type": "string"}}}}


def read(dialect: TaggedDialect, chunks: list[str], functions=FUNCTIONS, cut: bool = False, valid: bool = True):
    """(content, [(name, arguments)], the argument deltas of each call, where in `chunks` each
    call's first argument delta came, cut_call) of an answer fed in `chunks`; `valid`: each
    call's arguments are a JSON object's text."""
    p = ToolCallParser(dialect, functions)
    content, calls, deltas, first = "", [], [], {}
    for i, c in enumerate([*chunks, None]):
        out = p.feed(c) if c is not None else p.finish(cut)
        content += out.content
        calls += out.calls
        deltas += out.deltas
        for d in out.deltas:
            if d.id is None:
                first.setdefault(d.index, i)
    heads = [d for d in deltas if d.id is not None]
    # the calls' heads, and that of a call the limit cut (no call)
    assert [(d.index, d.id, d.name) for d in heads][:len(calls)] == [(c.index, c.id, c.name) for c in calls]
    assert len(heads) == len(calls) + p.cut_call
    pieces = [[d.arguments for d in deltas if d.index == c.index and d.id is None] for c in calls]
    for call, call_pieces in zip(calls, pieces, strict=True):
        assert "".join(call_pieces) == call.arguments and all(call_pieces)
        assert not valid or isinstance(json.loads(call.arguments), dict)
    return content, [(c.name, c.arguments) for c in calls], pieces, first, p.cut_call


# -- answers as each dialect writes them --------------------------------------------------------------

TEXT = st.text(alphabet="ab é\"\\\n{}[]<>/=:,", max_size=8)  # no letters of a tag: content never opens one
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | TEXT,
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                           max_leaves=6)
TYPED_VALUES = {"s": TEXT, "i": st.integers(-10**9, 10**9), "b": st.booleans(),
                "n": st.floats(allow_nan=False, allow_infinity=False, width=32),
                "a": st.lists(JSON_VALUES, max_size=3), "o": st.dictionaries(TEXT, JSON_VALUES, max_size=3)}


@st.composite
def hermes_answer(draw) -> tuple[str, list[tuple[str, dict]]]:
    parts, calls = [draw(TEXT)], []
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(["f", "g"]))
        arguments = draw(st.dictionaries(TEXT, JSON_VALUES, max_size=4))
        obj = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=draw(st.booleans()))
        parts += [f"<tool_call>\n{obj}\n</tool_call>", draw(TEXT)]
        calls.append((name, arguments))
    return "".join(parts), calls


@st.composite
def xml_answer(draw) -> tuple[str, list[tuple[str, dict]]]:
    parts, calls = [draw(TEXT)], []
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(["f", "g"]))
        keys = draw(st.lists(st.sampled_from(sorted(FUNCTIONS[name]["properties"])), unique=True, max_size=6))
        arguments = {k: draw(TYPED_VALUES[k]) for k in keys}
        params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                         for k, v in arguments.items())
        parts += [f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>", draw(TEXT)]
        calls.append((name, arguments))
    return "".join(parts), calls


@st.composite
def glm_answer(draw) -> tuple[str, list[tuple[str, dict]]]:
    """As GLM-4.5's template writes calls: a string value as it is, any other as JSON."""
    parts, calls = [draw(TEXT)], []
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(["f", "g"]))
        keys = draw(st.lists(st.sampled_from(sorted(FUNCTIONS[name]["properties"])), unique=True, max_size=6))
        arguments = {k: draw(TYPED_VALUES[k]) for k in keys}
        pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v)}</arg_value>\n"
                        for k, v in arguments.items())
        parts += [f"<tool_call>{name}\n{pairs}</tool_call>", draw(TEXT)]
        calls.append((name, arguments))
    return "".join(parts), calls


ANSWERS = {"hermes": hermes_answer(), "qwen3_coder": xml_answer(), "glm45": glm_answer()}
TAGGED = tuple(ANSWERS)  # harmony's answers are no tagged blocks: tests/test_harmony.py
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def drawn(data, name: str) -> tuple[TaggedDialect, str, list[tuple[str, dict]]]:
    """The dialect of `name`, and an answer in it with the calls it writes."""
    text, written = data.draw(ANSWERS[name])
    dialect = DIALECTS[name]
    assert isinstance(dialect, TaggedDialect)
    return dialect, text, written


def splits(draw, text: str) -> list[str]:
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("name", TAGGED)
@SETTINGS
@given(data=st.data())
def test_any_split_reads_as_the_whole_and_the_deltas_join_to_the_arguments(name, data):
    dialect, text, written = drawn(data, name)
    whole = read(dialect, [text])
    assert [(n, json.loads(a)) for n, a in whole[1]] == written  # the values as written, typed
    assert dialect.call_open not in whole[0]
    chunks = splits(data.draw, text)
    assert read(dialect, chunks)[:2] == whole[:2]
    anyone = read(dialect, [text], functions=None)  # any name: the same calls (XML values untyped: strings)
    assert anyone[0] == whole[0] and [n for n, _ in anyone[1]] == [n for n, _ in whole[1]]
    if dialect is HERMES:
        assert anyone[1] == whole[1]


@pytest.mark.parametrize("name", TAGGED)
@SETTINGS
@given(data=st.data())
def test_a_cut_anywhere_leaves_no_markup_and_gives_no_call_it_cut(name, data):
    """The calls a cut answer gives are the whole answer's first ones: those closed before the
    cut, and one whose arguments had ended (its close tag cut off); a call cut inside its
    arguments is none (`cut_call` where its head was out), nothing closes it."""
    dialect, text, _ = drawn(data, name)
    at = data.draw(st.integers(0, len(text)))
    content, calls, pieces, _, cut_call = read(dialect, splits(data.draw, text[:at]), cut=True)
    assert dialect.call_open not in content and "<function=" not in content and "<parameter=" not in content
    assert "<arg_key>" not in content and "<arg_value>" not in content
    whole = read(dialect, [text])[1]
    complete = text[:at].count(dialect.call_close)
    assert calls == whole[:len(calls)]
    assert len(calls) - complete in (0, 1) and not (cut_call and len(calls) > complete)


CORRUPTIONS = ["False", "\n", "\x01", "\\q", "NaN", "}", '"', "<tool_call>", "</tool_call>", "<parameter=s>",
               "<arg_key>", "</arg_value>", "<arg_value>"]


@pytest.mark.parametrize("name", TAGGED)
@SETTINGS
@given(data=st.data())
def test_a_corrupted_answer_reads_the_same_in_every_split_and_never_raises(name, data):
    """Model text gone wrong anywhere (Python literals, raw control characters, bad escapes, NaN,
    stray brackets and tags): whole, split, and cut at any point, the same calls and content, and
    each call's deltas join to its arguments."""
    dialect, text, _ = drawn(data, name)
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(text)))
        text = text[:at] + data.draw(st.sampled_from(CORRUPTIONS)) + text[at:]
    whole = read(dialect, [text], valid=False)
    assert read(dialect, splits(data.draw, text), valid=False)[:2] == whole[:2]
    at = data.draw(st.integers(0, len(text)))
    assert read(dialect, splits(data.draw, text[:at]), cut=True, valid=False)[:2] == \
        read(dialect, [text[:at]], cut=True, valid=False)[:2]


@pytest.mark.parametrize("dialect, text", [
    (HERMES, '<tool_call>\n{"name": "g", "arguments": {"s": "a long value,\\nwritten token by token"}}\n</tool_call>'),
    (QWEN3_CODER, "<tool_call>\n<function=g>\n<parameter=s>\na long value,\nwritten token by token\n</parameter>\n"
                  "</function>\n</tool_call>"),
    (GLM45, "<tool_call>g\n<arg_key>s</arg_key>\n<arg_value>a long value,\nwritten token by token</arg_value>\n"
            "</tool_call>"),
])
def test_arguments_stream_as_they_are_generated_not_when_the_call_closes(dialect, text):
    chunks = [text[i:i + 3] for i in range(0, len(text), 3)]
    close = text.index("</tool_call>") // 3  # the chunk the close tag starts in
    _, calls, pieces, first, _ = read(dialect, chunks)
    assert json.loads(calls[0][1]) == {"s": "a long value,\nwritten token by token"}
    assert first[0] < close - 8 and len(pieces[0]) > 8  # the value came in pieces, long before the close


# -- the XML dialect's reading -------------------------------------------------------------------------

@pytest.mark.parametrize("value, schema, expected", [
    ("Paris", {"type": "string"}, "Paris"), ("12", {"type": "string"}, "12"), ("12", {}, "12"),
    ("12", {"type": "integer"}, 12), (" -3.5e2 ", {"type": "number"}, -350.0), ("True", {"type": "boolean"}, True),
    ("false", {"type": "boolean"}, False), ('{"a": [1]}', {"type": "object"}, {"a": [1]}),
    ("[1, 2]", {"type": "array"}, [1, 2]), ("null", {"type": ["integer", "null"]}, None),
    ("twelve", {"type": "integer"}, "twelve"), ("{'a': 1}", {"type": "object"}, "{'a': 1}"),
    ("2", {"enum": [1, 2]}, 2), ("x", {"anyOf": [{"type": "string"}, {"type": "integer"}]}, "x"),
    # not JSON: NaN stays text; a lone surrogate is written escaped (the response must encode)
    ("NaN", {"type": "number"}, "NaN"), ("-Infinity", {"type": "number"}, "-Infinity"),
    ('{"a": "\\ud800"}', {"type": "object"}, {"a": "\ud800"}),
    # a schema that says nothing readable is text
    ("1", {"enum": None}, "1"), ("1", {"enum": "ab", "anyOf": 3}, "1"),
])
def test_xml_values_take_the_type_their_schema_declares(value, schema, expected):
    assert json.loads(value_json(value, schema)) == expected
    assert value_json(value, schema).encode()


@pytest.mark.parametrize("text, content, calls", [
    # a value ended by the next parameter or by </function>, as vLLM's reader takes it
    ("<tool_call>\n<function=f>\n<parameter=i>\n7\n<parameter=s>\nx\n</function>\n</tool_call>", "",
     [("f", {"i": 7, "s": "x"})]),
    # a function not offered: read whole at its close, a call then
    ("<tool_call>\n<function=other>\n<parameter=q>\n1\n</parameter>\n</function>\n</tool_call>", "",
     [("other", {"q": "1"})]),
    # not the dialect's shape: content, tags and all
    ("ok <tool_call>\n{\"name\": \"f\"}\n</tool_call>", "ok <tool_call>\n{\"name\": \"f\"}\n</tool_call>", []),
    ("<tool_call>\n<function=f\nbroken>\n</tool_call> x", "<tool_call>\n<function=f\nbroken>\n</tool_call> x", []),
    # junk between parameters is not part of the call
    ("<tool_call>\n<function=g>\nhm <b> <parameter=s>\nv\n</parameter>\n</function>\n</tool_call>", "",
     [("g", {"s": "v"})]),
])
def test_xml_calls_are_read_as_vllm_reads_them(text, content, calls):
    got = read(QWEN3_CODER, [text])
    assert got[0] == content and [(n, json.loads(a)) for n, a in got[1]] == calls
    assert read(QWEN3_CODER, list(text))[:2] == got[:2]


@pytest.mark.parametrize("arguments", ['{"s": "ab", "t": nope}', '{"path": "a.py", "overwrite": False}',
                                       '{"s": "it\'s \\x41"}', '{"s": "a", }', '{"s": NaN}'])
def test_a_sure_call_that_breaks_keeps_its_text_as_written_whole_and_streamed(arguments):
    """The head was out (the name read, the arguments opened): the call stays, its arguments the
    model's text (no JSON: a client's parse fails, as it should), never cut short into a valid
    call with less in it; every split agrees."""
    text = f'<tool_call>\n{{"name": "g", "arguments": {arguments}}}\n</tool_call> after'
    for chunks in ([text], list(text)):
        content, calls, _, _, cut = read(HERMES, chunks, valid=False)
        assert calls == [("g", arguments)] and content == "after" and not cut
    with pytest.raises(ValueError):
        json.loads(arguments, parse_constant=lambda c: int(c))  # NaN is no JSON


def test_raw_control_characters_in_strings_are_read_and_escaped_whole_and_streamed():
    """A model's unescaped newline or tab inside a string value (json.loads(strict=False) reads
    it): the call's arguments are that JSON with the characters escaped, in every split."""
    text = '<tool_call>\n{"name": "g", "arguments": {"s": "import os\nos.remove(x)\t1"}}\n</tool_call>'
    for chunks in ([text], list(text)):
        content, calls, _, _, _ = read(HERMES, chunks)
        assert content == "" and calls == [("g", '{"s": "import os\\nos.remove(x)\\t1"}')]
    # a block read whole (keys in another order) reads them the same way
    other = '<tool_call>\n{"arguments": {"s": "a\nb"}, "name": "g"}\n</tool_call>'
    assert read(HERMES, [other])[:2] == ("", [("g", '{"s": "a\\nb"}')])


@pytest.mark.parametrize("body", ['{"name": "f\\q", "arguments": {"s": 1}}',
                                  '{"name": "f\\ud800", "arguments": {}}', '{"arguments": {"s": NaN}, "name": "g"}',
                                  '{"arguments": {"s": "\\ud800"}, "name": 3}'])
def test_a_block_that_is_no_call_is_content_in_every_split(body):
    """A name with a bad escape or a lone surrogate, NaN (not JSON), a name not a string: content."""
    text = f"<tool_call>\n{body}\n</tool_call>"
    for chunks in ([text], list(text)):
        assert read(HERMES, chunks)[:2] == (text, [])


def test_a_lone_surrogate_read_whole_is_written_back_escaped():
    text = '<tool_call>\n{"arguments": {"s": "\\ud800 é"}, "name": "g"}\n</tool_call>'
    (name, arguments), = read(HERMES, [text])[1]
    assert arguments == '{"s": "\\ud800 \\u00e9"}' and json.loads(arguments) == {"s": "\ud800 é"}


# -- which dialect ---------------------------------------------------------------------------------------

def test_the_dialect_comes_from_the_template_and_the_option_overrides_it():
    assert dialect_of_template((TEMPLATES / "qwen3-coder.jinja").read_text()) is QWEN3_CODER
    assert dialect_of_template((TEMPLATES / "qwen3.jinja").read_text()) is HERMES
    assert dialect_of_template(CHAT_TEMPLATE) is HERMES and dialect_of_template(None) is HERMES
    assert dialect_of_template(template_text("glm-4.5")) is GLM45
    assert dialect_of_template(template_text("gpt-oss")) is HARMONY
    assert choose_dialect("glm45", None) is GLM45 and choose_dialect("harmony", CHAT_TEMPLATE) is HARMONY
    assert choose_dialect("qwen3_coder", CHAT_TEMPLATE) is QWEN3_CODER
    assert choose_dialect("auto", (TEMPLATES / "qwen3-coder.jinja").read_text()) is QWEN3_CODER
    with pytest.raises(ValueError, match="hermes, qwen3_coder"):
        choose_dialect("mistral", None)
    with pytest.raises(ValueError, match="tool call parser 'mistral'"):
        ServerState(model_name="m", tool_call_parser="mistral")


# -- grammars ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def loaded(tiny_gguf):
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    tok = tokenizer_from_gguf(f)
    return f, spec, tok, GrammarCompiler(tok, spec.vocab_size)


def admits(loaded, lark: str, text: str) -> bool:
    """Whether the grammar takes `text` (as the tokenizer spells it) and then may end there."""
    _, _, tok, compiler = loaded
    m = compiler.compile(lark).matcher()
    return all(m.accept(t) for t in tok.encode(text, add_special=False)) and m.native.is_accepting()


LANGCHAIN_ARGS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                   "where": {"type": "object", "properties": {"lat": {
                                                       "type": "number"}}}}, "required": ["city"]}
WEATHER = {"name": "get_weather", "parameters": LANGCHAIN_ARGS}


def calls_grammar(loaded, dialect, functions, strict=True, parallel=True):
    return chat_grammar(loaded[2], dialect, functions=functions, parallel=parallel, answer_schema=None,
                        thinking=Thinking.OFF, strict=strict)


def test_strict_schemas_refuse_keys_nobody_declared_and_the_lenient_reading_admits_them(loaded):
    """LangChain's schemas say nothing of additionalProperties: read strictly, an extra key (at
    the top or in a nested object) is refused, in tool arguments and JSON answers alike."""
    good = '{"city": "Paris", "where": {"lat": 1.5}}'
    extra = '{"city": "Paris", "wind": 3}'
    nested = '{"city": "Paris", "where": {"lat": 1.5, "lon": 2}}'
    for strict in (True, False):
        calls = calls_grammar(loaded, HERMES, [WEATHER], strict=strict)
        answer = text_grammar(LANGCHAIN_ARGS, strict=strict)

        def call(args: str) -> str:
            return f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>'
        assert admits(loaded, calls, call(good)) and admits(loaded, answer, good)
        for bad in (extra, nested):
            assert admits(loaded, calls, call(bad)) is not strict
            assert admits(loaded, answer, bad) is not strict
    # an object parameter of the XML dialect is JSON: strict the same way
    xml = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=where>\n{}\n" \
          "</parameter>\n</function>\n</tool_call>"
    for strict in (True, False):
        lark = calls_grammar(loaded, QWEN3_CODER, [WEATHER], strict=strict)
        assert admits(loaded, lark, xml.format('{"lat": 1.5}'))
        assert admits(loaded, lark, xml.format('{"lat": 1.5, "lon": 2}')) is not strict


STRICTNESS = [  # (schema, instances the strict reading admits, instances it refuses)
    # every object that lists properties is closed: at the top, in items, in $defs
    ({"type": "object", "properties": {"a": {"type": "array", "items": {"properties": {"x": {}}}},
                                       "d": {"$ref": "#/$defs/d"}}, "$defs": {"d": {"properties": {"y": {}}}}},
     [{"a": [{"x": 1}], "d": {"y": 2}}], [{"z": 1}, {"a": [{"q": 1}]}, {"d": {"q": 1}}]),
    # anyOf members that only add constraints to the same object are not closed themselves
    ({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "required": ["a"],
      "anyOf": [{"properties": {"a": {"const": "x"}}}, {"properties": {"b": {"const": 1}}}]},
     [{"a": "x", "b": 2}, {"a": "y", "b": 1}], [{"a": "y", "b": 2}, {"a": "x", "c": 1}]),
    # anyOf members that are objects of their own are
    ({"anyOf": [{"type": "object", "properties": {"p": {}}}, {"type": "object", "properties": {"q": {}}}]},
     [{"p": 1}, {"q": 1}], [{"p": 1, "z": 2}]),
    # allOf: the objects inside a member closed, the member itself not (nor an object whose
    # members list keys it does not)
    ({"type": "object", "properties": {"o": {"allOf": [{"type": "object", "properties": {
        "in": {"type": "object", "properties": {"k": {"type": "integer"}}}}}]}}},
     [{"o": {"in": {"k": 1}}}], [{"o": {"in": {"k": 1, "zzz": 2}}}, {"p": 1}]),
    ({"type": "object", "properties": {"a": {}}, "allOf": [{"properties": {"b": {}}}]}, [{"a": 1, "b": 2}], []),
    # not (and if/then/else, dependentSchemas) left alone: closing its schema would invert it
    ({"type": "object", "properties": {"a": {}, "b": {}},
      "not": {"properties": {"a": {"const": 1}}, "required": ["a"]}},
     [{"a": 2, "b": 1}], [{"a": 1, "b": 1}, {"a": 2, "c": 1}]),
    # a schema's own word on other keys is kept
    ({"type": "object", "properties": {"a": {}}, "unevaluatedProperties": {"type": "integer"}},
     [{"a": 1, "z": 3}], [{"a": 1, "z": "s"}]),
    ({"properties": {"a": {}}, "additionalProperties": {"type": "integer"}}, [{"a": 1, "z": 3}], [{"z": "s"}]),
    ({"properties": {}, "patternProperties": {"^x": {}}}, [{"x1": 1}], []),
]


@pytest.mark.parametrize("schema, admitted, refused", STRICTNESS)
def test_strictness_closes_objects_and_leaves_what_describes_the_same_object_to_it(schema, admitted, refused):
    """jsonschema the judge: the strict reading admits the instances that follow the schema
    without undeclared keys, and refuses the rest; the input schema is not changed."""
    before = json.dumps(schema)
    strict = strict_schema(schema)
    assert json.dumps(schema) == before
    for instance in admitted:
        jsonschema.validate(instance, schema)
        jsonschema.validate(instance, strict)
    for instance in refused:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(instance, strict)


def test_json_whitespace_is_bounded_and_the_object_can_end(loaded):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    lark = text_grammar(schema)
    assert admits(loaded, lark, '{"city": "Paris"}')
    for padded in ('{ "city": "Paris"}', '{"city":  "Paris"}', '{"city": "Paris"\n}', '{"city": "Paris"} '):
        assert not admits(loaded, lark, padded), padded


def test_the_xml_grammar_holds_calls_to_the_offered_functions_and_their_parameters(loaded):
    unit = {"name": "convert", "parameters": {"type": "object", "properties": {
        "value": {"type": "number"}, "unit": {"enum": ["C", "F"]}, "note": {"type": "string", "maxLength": 5}},
        "required": ["value", "unit"]}}
    lark = calls_grammar(loaded, QWEN3_CODER, [WEATHER, unit])

    def call(name: str, params: str) -> str:
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"

    def param(k: str, v: str) -> str:
        return f"<parameter={k}>\n{v}\n</parameter>\n"
    two = call("get_weather", param("city", "Paris\nand <b>more</b>")) + "\n" + \
        call("convert", param("value", "21.5") + param("unit", "C") + param("note", "warm"))
    assert admits(loaded, lark, two)
    for bad in [call("nope", param("city", "x")),  # not offered
                call("convert", param("value", "21.5")),  # a required parameter missing
                call("convert", param("value", "hot") + param("unit", "C")),  # not a number
                call("convert", param("value", "1") + param("unit", "K")),  # not in the enum
                call("convert", param("value", "1") + param("unit", "C") + param("note", "too long")),
                call("get_weather", param("city", "a</parameter>b")),  # a value cannot hold its end tag
                call("get_weather", param("city", "x") + param("wind", "3"))]:  # not a parameter
        assert not admits(loaded, lark, bad), bad
    assert not admits(loaded, calls_grammar(loaded, QWEN3_CODER, [WEATHER], parallel=False), two)


def test_the_xml_grammar_holds_text_values_to_their_listed_strings_through_refs_and_optionals(loaded):
    """A string parameter's const, its enum under anyOf beside null (Optional[Literal[...]]) or
    behind a $ref: only those strings are admitted."""
    parameters = {"type": "object", "properties": {
        "mode": {"anyOf": [{"enum": ["fast", "slow"], "type": "string"}, {"type": "null"}]},
        "kind": {"const": "k"}, "color": {"$ref": "#/$defs/Color"}},
        "$defs": {"Color": {"enum": ["red", "blue"], "type": "string"}}}
    lark = calls_grammar(loaded, QWEN3_CODER, [{"name": "paint", "parameters": parameters}])

    def call(mode: str, kind: str, color: str) -> str:
        return (f"<tool_call>\n<function=paint>\n<parameter=mode>\n{mode}\n</parameter>\n<parameter=kind>\n{kind}"
                f"\n</parameter>\n<parameter=color>\n{color}\n</parameter>\n</function>\n</tool_call>")
    assert admits(loaded, lark, call("slow", "k", "blue"))
    for bad in (call("medium", "k", "blue"), call("slow", "other", "blue"), call("slow", "k", "green")):
        assert not admits(loaded, lark, bad), bad


@pytest.mark.parametrize("dialect", [HERMES, QWEN3_CODER, GLM45], ids=lambda d: d.name)
def test_constrained_calls_on_the_random_model_read_into_arguments_that_validate(loaded, dialect):
    """What the grammar lets the random model write, the dialect's reader reads into calls whose
    arguments validate against the (strict) schema."""
    f, spec, tok, compiler = loaded
    weather = {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                         "unit": {"enum": ["C", "F"]}}, "required": ["city", "days"]}}
    grammar = compiler.compile(calls_grammar(loaded, dialect, [weather], parallel=False))
    runner = load_reference_runner(f, spec)
    requests = [(tok.encode(f"Call number {i}:"), SamplingParams(max_tokens=200, temperature=t, seed=i,
                                                                 grammar=grammar))
                for i, t in enumerate([0.0, 0.8, 1.2])]
    outs = engine_runs.run_all(Engine(runner, tok, EngineConfig(prefix_cache=False)), requests, max_steps=2_000)
    for out in outs:
        assert out[-1].finish_reason == "stop"
        text = tok.decode([t for o in out for t in o.token_ids], skip_special=False)
        content, calls, _, _, _ = read(dialect, [text], functions={"get_weather": weather["parameters"]})
        assert content == "" and len(calls) == 1 and calls[0][0] == "get_weather"
        jsonschema.validate(json.loads(calls[0][1]), strict_schema(weather["parameters"]))


class Item(BaseModel):
    name: str = Field(max_length=6)
    count: int = Field(ge=0, le=9)


class Order(BaseModel):
    item: Item
    gift: Item | None


@pytest.mark.parametrize("dialect", [HERMES, QWEN3_CODER, GLM45], ids=lambda d: d.name)
def test_nested_pydantic_models_refs_and_defs_hold_and_read_in_both_dialects(loaded, dialect):
    """openai.pydantic_function_tool's schema of a nested model and an Optional one ($defs, a
    $ref, anyOf [$ref, null]): tool_choice required compiles, and what the random model writes
    under it reads into a call that validates against the original schema."""
    f, spec, tok, compiler = loaded
    function = openai.pydantic_function_tool(Order)["function"]
    schema = function["parameters"]
    assert "$defs" in schema and schema["properties"]["item"] == {"$ref": "#/$defs/Item"}
    grammar = compiler.compile(calls_grammar(loaded, dialect, [function], parallel=False))
    runner = load_reference_runner(f, spec)
    requests = [(tok.encode(f"Order {i}:"), SamplingParams(max_tokens=240, temperature=t, seed=i, grammar=grammar))
                for i, t in enumerate([0.0, 1.0])]
    outs = engine_runs.run_all(Engine(runner, tok, EngineConfig(prefix_cache=False)), requests, max_steps=2_000)
    for out in outs:
        assert out[-1].finish_reason == "stop"
        text = tok.decode([t for o in out for t in o.token_ids], skip_special=False)
        content, calls, _, _, _ = read(dialect, [text], functions={"Order": schema})
        assert content == "" and len(calls) == 1 and calls[0][0] == "Order"
        jsonschema.validate(json.loads(calls[0][1]), schema)
    # the XML dialect reads a $ref parameter as the object it points at (not as text)
    xml = ('<tool_call>\n<function=Order>\n<parameter=item>\n{"name": "a", "count": 1}\n</parameter>\n'
           '<parameter=gift>\nnull\n</parameter>\n</function>\n</tool_call>')
    if dialect is QWEN3_CODER:
        (_, arguments), = read(dialect, [xml], functions={"Order": schema})[1]
        assert json.loads(arguments) == {"item": {"name": "a", "count": 1}, "gift": None}
