"""Every message shape OpenAI's chat API allows, through the three real templates users' qwen3moe
files carry (tests/data/templates) and the synthetic one: each renders, as transformers' own
renderer renders the same messages, with nothing the client sent dropped; or it is a 400 naming
the field, never a 500 (in-process and through the server)."""

from __future__ import annotations

import json

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.tokenizer import tokenizer_from_gguf
from strata_mgpu.server.errors import APIError
from strata_mgpu.server.messages import template_messages, template_tools
from strata_mgpu.server.schemas import ChatCompletionRequest
from tests.conftest import REAL_TEMPLATES
from tests.scripted import http_client, prompt_text, say, scripted_engine

TEMPLATE_NAMES = ("synthetic", *REAL_TEMPLATES)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters, no description


def call(id_: str, name: str, arguments) -> dict:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


ASK = {"role": "user", "content": "Weather in Paris?"}
PARIS = call("call_1", "get_weather", '{"city": "Paris"}')
KOELN = call("call_2", "get_weather", '{"city":"Köln","days":2}')
ANSWER_1 = {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}

# name -> (messages, texts the prompt must hold): every shape of the spec, as agents send them.
SHAPES: dict[str, tuple[list[dict], list[str]]] = {
    "system and user strings": ([{"role": "system", "content": "Be brief."}, ASK], ["Be brief.", "Weather in Paris?"]),
    "developer": ([{"role": "developer", "content": "Be brief."}, ASK], ["Be brief."]),
    "user text parts": ([{"role": "user", "content": [{"type": "text", "text": "Weather in "},
                                                      {"type": "text", "text": "Paris?"}]}], ["Weather in Paris?"]),
    "system text parts": ([{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, ASK],
                          ["Be brief."]),
    "user content null": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": None}],
                          ["Be brief."]),
    "user with a name": ([{"role": "user", "content": "Hi", "name": "ann"}], ["Hi"]),
    "assistant text, multi-turn": ([ASK, {"role": "assistant", "content": "Sunny."},
                                    {"role": "user", "content": "Thanks"}], ["Sunny.", "Thanks"]),
    "assistant content null": ([ASK, {"role": "assistant", "content": None}, {"role": "user", "content": "?"}], ["?"]),
    "call, content null": ([ASK, {"role": "assistant", "content": None, "tool_calls": [PARIS]}, ANSWER_1],
                           ["get_weather", "Paris", "sunny, 21 C"]),
    "call, content missing": ([ASK, {"role": "assistant", "tool_calls": [PARIS]}, ANSWER_1],
                              ["get_weather", "Paris", "sunny, 21 C"]),
    "call, content empty": ([ASK, {"role": "assistant", "content": "", "tool_calls": [PARIS]}, ANSWER_1],
                            ["Paris", "sunny, 21 C"]),
    "call, content text": ([ASK, {"role": "assistant", "content": "Looking.", "tool_calls": [PARIS]}, ANSWER_1],
                           ["Looking.", "Paris", "sunny, 21 C"]),
    "call, content parts": ([ASK, {"role": "assistant", "content": [{"type": "text", "text": "Looking."}],
                                   "tool_calls": [PARIS]}, ANSWER_1], ["Looking.", "Paris"]),
    "arguments an object": ([ASK, {"role": "assistant", "content": None,
                                   "tool_calls": [call("call_1", "get_weather", {"city": "Paris", "days": 3})]},
                             ANSWER_1], ["Paris", "3"]),
    "two calls, two results, one named": (
        [ASK, {"role": "assistant", "content": None, "tool_calls": [PARIS, KOELN]}, ANSWER_1,
         {"role": "tool", "tool_call_id": "call_2", "name": "get_weather", "content": "rain"}],
        ["Paris", "Köln", "sunny, 21 C", "rain"]),
    "a result as text parts": ([ASK, {"role": "assistant", "content": None, "tool_calls": [PARIS]},
                                {"role": "tool", "tool_call_id": "call_1",
                                 "content": [{"type": "text", "text": "fog"}]}], ["fog"]),
    "a result empty": ([ASK, {"role": "assistant", "content": None, "tool_calls": [PARIS]},
                        {"role": "tool", "tool_call_id": "call_1", "content": ""}], ["Paris"]),
    "a call with no arguments": ([ASK, {"role": "assistant", "content": None,
                                        "tool_calls": [call("call_9", "get_time", "{}")]},
                                  {"role": "tool", "tool_call_id": "call_9", "content": "noon"}], ["get_time", "noon"]),
    "reasoning after the last user turn": (
        [ASK, {"role": "assistant", "content": None, "reasoning_content": "Paris: call.", "tool_calls": [PARIS]},
         ANSWER_1], ["Paris", "sunny, 21 C"]),
    "reasoning on earlier turns, every name": (
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "r1"},
         {"role": "user", "content": "c"}, {"role": "assistant", "content": "d", "reasoning": "r2"},
         {"role": "user", "content": "e"}, {"role": "assistant", "content": "f", "thinking": "r3"}, ASK],
        ["b", "d", "f", "Weather in Paris?"]),
    "think block in content": ([ASK, {"role": "assistant", "content": "<think>\nhm\n</think>\n\nSunny."},
                                {"role": "user", "content": "ok"}], ["Sunny.", "ok"]),
    "a second system message": ([{"role": "system", "content": "One."}, ASK, {"role": "system", "content": "Two."}],
                                ["One.", "Two."]),
    "agent loop, two rounds": (
        [{"role": "system", "content": "Use tools."}, ASK,
         {"role": "assistant", "content": None, "tool_calls": [PARIS]}, ANSWER_1,
         {"role": "assistant", "content": None, "tool_calls": [call("call_3", "get_time", "{}")]},
         {"role": "tool", "tool_call_id": "call_3", "content": "noon"}],
        ["Use tools.", "sunny, 21 C", "get_time", "noon"]),
}


@pytest.fixture(scope="module")
def tokenizers(tiny_gguf, template_gguf):
    files = {"synthetic": tiny_gguf, **{name: template_gguf(name) for name in REAL_TEMPLATES}}
    return {name: tokenizer_from_gguf(GGUFFile(path)) for name, path in files.items()}


def rendered(tok, body: dict) -> tuple[str, list[dict], list[dict]]:
    req = ChatCompletionRequest.model_validate(body)
    messages, tools = template_messages(req.messages), template_tools(req.offered_tools)
    return tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools or None), messages, tools


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("template", TEMPLATE_NAMES)
@pytest.mark.parametrize("with_tools", [True, False], ids=["tools", "no-tools"])
def test_every_message_shape_renders_through_every_template(tokenizers, template, shape, with_tools):
    messages, needles = SHAPES[shape]
    tok = tokenizers[template]
    body = {"messages": messages, **({"tools": [WEATHER, CLOCK]} if with_tools else {})}
    text, given, tools = rendered(tok, body)
    theirs = render_jinja_template([given], tools=tools or None, chat_template=tok.chat_template.source,
                                   add_generation_prompt=True)[0][0]
    assert text == theirs  # the sandbox renders as transformers does
    missing = [n for n in needles if n not in text]
    assert not missing, text
    assert text.endswith("<|im_start|>assistant\n<think>\n" if template == "qwen3-thinking-2507"
                         else "<|im_start|>assistant\n")
    if with_tools:
        assert "get_weather" in text.split("<|im_end|>")[0] and "get_time" in text


def test_qwen3s_template_fails_on_what_the_api_sends_and_renders_what_templates_read(tokenizers):
    """The shape every agent framework sends after a call; as given, Qwen3's template cannot
    render it (the 500 of issue 40), nor Qwen3-Coder's a call whose arguments are a string."""
    messages = [ASK, {"role": "assistant", "content": None, "tool_calls": [PARIS]}, ANSWER_1]
    with pytest.raises(ValueError, match="TypeError: argument of type 'NoneType' is not iterable"):
        tokenizers["qwen3"].apply_chat_template(messages)
    with pytest.raises(ValueError, match="chat template failed"):
        tokenizers["qwen3-coder"].apply_chat_template(messages)
    text, _, _ = rendered(tokenizers["qwen3"], {"messages": messages})
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>'
            in text)
    coder, _, _ = rendered(tokenizers["qwen3-coder"], {"messages": messages})
    assert "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>" \
           in coder


def test_a_call_is_shown_to_the_model_in_the_form_it_writes_calls(tokenizers):
    """Arguments reach Qwen3's template as a mapping: `| tojson` writes them in one spacing,
    whatever spacing the client's string had."""
    for arguments in ('{"city":"Köln","days":2}', '{ "city" : "Köln", "days" : 2 }', {"city": "Köln", "days": 2}):
        body = {"messages": [ASK, {"role": "assistant", "content": None,
                                   "tool_calls": [call("call_2", "get_weather", arguments)]},
                             {"role": "tool", "tool_call_id": "call_2", "content": "rain"}]}
        text, given, _ = rendered(tokenizers["qwen3"], body)
        assert given[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Köln", "days": 2}
        assert '{"name": "get_weather", "arguments": {"city": "Köln", "days": 2}}' in text


def test_reasoning_of_the_turn_after_the_last_user_message_is_shown_under_every_name(tokenizers):
    for name in ("reasoning_content", "reasoning", "thinking"):
        body = {"messages": [ASK, {"role": "assistant", "content": None, name: "Paris: call.", "tool_calls": [PARIS]},
                             ANSWER_1]}
        for template in ("synthetic", "qwen3", "qwen3-thinking-2507"):
            text, _, _ = rendered(tokenizers[template], body)
            assert "<think>\nParis: call.\n</think>\n\n<tool_call>" in text, (name, template)


@pytest.mark.parametrize("messages, param, needle", [
    ([{"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[0].content[1].type", "this model takes text only (the part is 'image_url')"),
    ([ASK, {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
     "messages[1].content[0].type", "text only"),
    ([{"role": "user", "content": [{"type": "file", "file": {"file_id": "f"}}]}], "messages[0].content[0].type",
     "text only"),
    ([{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}], "messages[0].content[0].type",
     "'refusal' is no content part type"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text", "needs its 'text'"),
    ([{"role": "user", "content": ["plain"]}], "messages[0].content[0]", "an object with a 'type'"),
    ([ASK, {"role": "tool", "tool_call_id": "call_1", "content": "x"}], "messages[1].tool_call_id",
     "'call_1' answers no call of an earlier assistant message (no earlier message made a call)"),
    ([ASK, {"role": "assistant", "content": None, "tool_calls": [PARIS]}, ANSWER_1,
      {"role": "tool", "tool_call_id": "call_7", "content": "x"}], "messages[3].tool_call_id",
     "the calls made: 'call_1'"),
    ([{"role": "tool", "tool_call_id": "call_1", "content": "x"},
      {"role": "assistant", "content": None, "tool_calls": [PARIS]}], "messages[0].tool_call_id", "answers no call"),
])
def test_what_no_template_can_take_is_a_400_naming_the_field(messages, param, needle):
    with pytest.raises(APIError) as e:
        template_messages(ChatCompletionRequest.model_validate({"messages": messages}).messages)
    assert (e.value.status, e.value.param) == (400, param) and needle in e.value.message, e.value.message


# -- through the server ------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=TEMPLATE_NAMES)
def served(request, tiny_gguf, template_gguf):
    """(template name, engine, runner, HTTP client) on a scripted model carrying that template."""
    path = tiny_gguf if request.param == "synthetic" else template_gguf(request.param)
    with scripted_engine(path) as (engine, runner):
        yield request.param, engine, runner, http_client(engine)


def test_every_message_shape_is_answered_through_the_server(served):
    name, engine, runner, http = served
    say(engine, runner, "Done." if name != "qwen3-thinking-2507" else "ok\n</think>\n\nDone.")
    for shape, (messages, needles) in SHAPES.items():
        r = http.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER, CLOCK], "max_tokens": 16,
                                                    "temperature": 0})
        assert r.status_code == 200, (shape, r.text)
        assert r.json()["choices"][0]["message"]["content"] == "Done.", (shape, r.json())
        prompt = prompt_text(engine, runner)
        assert all(n in prompt for n in needles), (shape, prompt)


@pytest.mark.parametrize("messages, param, needle", [
    ([ASK, {"role": "assistant", "content": None, "tool_calls": [call("call_1", "get_weather", '{"city": Paris}')]},
      ANSWER_1], "messages[1].tool_calls[0].function.arguments", "not JSON (Expecting value at character 9)"),
    ([ASK, {"role": "assistant", "content": None, "tool_calls": [PARIS, call("call_2", "get_weather", '["Paris"]')]},
      ANSWER_1], "messages[1].tool_calls[1].function.arguments", "a JSON object, not list"),
    ([ASK, {"role": "assistant", "content": None, "tool_calls": [call("call_1", "get_weather", 5)]}, ANSWER_1],
     "messages[1].tool_calls[0].function.arguments", "expected the call's arguments as a JSON object"),
    ([ASK, {"role": "tool", "tool_call_id": "call_1", "content": "x"}], "messages[1].tool_call_id", "answers no call"),
    ([ASK, {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[1].content[0].type", "text only"),
    ([{"role": "user", "content": 5}], "messages[0].content", "a string, a list of content parts or null"),
    ([{"role": "user", "content": "x", "tool_calls": [PARIS]}], "messages[0]", "only assistant messages"),
])
def test_a_bad_message_is_a_400_naming_it_through_the_server(served, messages, param, needle):
    _, _, _, http = served
    r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"], error


def test_the_tools_a_template_is_given_have_parameters(served):
    """OpenAI's tool without `parameters` takes none: Qwen3-Coder's template reads
    `tool.parameters.properties`, so it gets an empty object schema."""
    name, engine, runner, http = served
    say(engine, runner, "Done." if name != "qwen3-thinking-2507" else "ok\n</think>\n\nDone.")
    r = http.post("/v1/chat/completions", json={"messages": [ASK], "tools": [CLOCK], "max_tokens": 4})
    assert r.status_code == 200, r.text
    prompt = prompt_text(engine, runner)
    assert "get_time" in prompt
    if name == "qwen3":
        tools = prompt.split("<tools>\n")[1].split("\n</tools>")[0]
        assert json.loads(tools) == {"type": "function", "function": {"name": "get_time", "parameters": {
            "type": "object", "properties": {}}}}
