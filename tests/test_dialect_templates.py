"""gpt-oss's and GLM-4.5's own chat templates (tests/data/templates) on tiny models in their own
vocabulary families: every message shape the Qwen templates are tested with renders as
transformers' renderer renders it; through the server and the official openai client, whole and
streamed, a tool call and its reasoning come back as OpenAI's fields, the tool's result goes back
to the model through the template, and what the model writes wrong is never a 500."""

from __future__ import annotations

import json

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.tokenizer import tokenizer_from_gguf
from strata_mgpu.server.dialects import GLM45, HARMONY, choose_dialect
from tests.conftest import OTHER_FAMILY_TEMPLATES
from tests.scripted import client_for, http_client, prompt_text, say, scripted_engine
from tests.test_chat_templates import ASK, CLOCK, SHAPES, WEATHER, rendered

# gpt-oss's template writes `"// " + tool.description`: a tool without one fails there (in
# transformers alike), and the server answers 400 naming the template's failure
CLOCK_DESCRIBED = {"type": "function", "function": {**CLOCK["function"], "description": "The time"}}
TOOLS = {"gpt-oss": [WEATHER, CLOCK_DESCRIBED], "glm-4.5": [WEATHER, CLOCK]}
# what a template leaves out of a shape by its own design (transformers renders it alike)
LEFT_OUT = {"gpt-oss": {"two calls, two results, one named": {"Köln"},  # one call a message
                        "a second system message": {"Two."}}}  # a system message after the first: dropped
PROMPT_END = {"gpt-oss": "<|start|>assistant", "glm-4.5": "<|assistant|>"}
DIALECT = {"gpt-oss": HARMONY, "glm-4.5": GLM45}
# name -> (a call with its reasoning, the turn's end after it, a final answer, the turn's end after it)
ANSWERS = {
    "gpt-oss": ("<|channel|>analysis<|message|>The user wants Paris.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 2}', "<|call|>",
                "<|channel|>analysis<|message|>It is sunny.<|end|><|start|>assistant<|channel|>final<|message|>"
                "Sunny, 21 C.", "<|return|>"),
    "glm-4.5": ("\n<think>The user wants Paris.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
                "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
                "<|observation|>", "\n<think>It is sunny.</think>\nSunny, 21 C.", "<|user|>"),
}


@pytest.fixture(scope="module")
def tokenizers(template_gguf):
    return {name: tokenizer_from_gguf(GGUFFile(template_gguf(name))) for name in OTHER_FAMILY_TEMPLATES}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("template", OTHER_FAMILY_TEMPLATES)
@pytest.mark.parametrize("with_tools", [True, False], ids=["tools", "no-tools"])
def test_every_message_shape_renders_as_transformers_renders_it(tokenizers, template, shape, with_tools):
    messages, needles = SHAPES[shape]
    tok = tokenizers[template]
    body = {"messages": messages, **({"tools": TOOLS[template]} if with_tools else {})}
    text, given, tools = rendered(tok, body)
    theirs = render_jinja_template([given], tools=tools or None, chat_template=tok.chat_template.source,
                                   add_generation_prompt=True)[0][0]
    assert text == theirs
    missing = [n for n in needles if n not in text and n not in LEFT_OUT.get(template, {}).get(shape, ())]
    assert not missing, text
    assert text.endswith(PROMPT_END[template])
    if with_tools:
        assert "get_weather" in text and "get_time" in text


def test_a_tool_without_a_description_is_a_400_naming_the_template_through_the_server(template_gguf):
    with scripted_engine(template_gguf("gpt-oss")) as (engine, _):
        r = http_client(engine).post("/v1/chat/completions", json={"messages": [ASK], "tools": [CLOCK]})
    assert r.status_code == 400 and "chat template failed" in r.json()["error"]["message"], r.text


def test_the_families_hold_their_templates_markup_as_tokens(tokenizers):
    """Each family's vocabulary spells its template's markup as one token each, ends a turn where
    the model's does, and the dialect its template teaches is chosen."""
    harmony, glm = tokenizers["gpt-oss"], tokenizers["glm-4.5"]
    for tok, marks in ((harmony, ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>")),
                       (glm, ("[gMASK]", "<sop>", "<|assistant|>", "<tool_call>", "<arg_key>", "</arg_value>"))):
        for mark in marks:
            assert tok.encode(mark, add_special=False) == [tok.tokens.index(mark)], mark
    ends = {name: {tok.tokens[i] for i in tok.eot_ids} for name, tok in tokenizers.items()}
    assert ends["gpt-oss"] == {"<|return|>", "<|call|>", "<|endoftext|>"}  # <|end|> ends a message, not the turn
    assert ends["glm-4.5"] == {"<|endoftext|>", "<|user|>", "<|observation|>"}
    for name, tok in tokenizers.items():
        assert choose_dialect("auto", tok.chat_template.source) is DIALECT[name]


# -- through the server ------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=OTHER_FAMILY_TEMPLATES)
def served(request, template_gguf):
    with scripted_engine(template_gguf(request.param)) as (engine, runner):
        yield request.param, engine, runner


def test_every_message_shape_is_answered_through_the_server(served):
    name, engine, runner = served
    http = http_client(engine)
    say(engine, runner, ANSWERS[name][2], end=ANSWERS[name][3])
    for shape, (messages, needles) in SHAPES.items():
        r = http.post("/v1/chat/completions", json={"messages": messages, "tools": TOOLS[name], "max_tokens": 40,
                                                    "temperature": 0})
        assert r.status_code == 200, (shape, r.text)
        message = r.json()["choices"][0]["message"]
        assert (message["content"], message["reasoning_content"]) == ("Sunny, 21 C.", "It is sunny."), (shape, message)
        prompt = prompt_text(engine, runner)
        left_out = LEFT_OUT.get(name, {}).get(shape, ())
        assert all(n in prompt for n in needles if n not in left_out), (shape, prompt)


def test_a_call_and_its_reasoning_round_trip_whole_and_streamed_through_the_openai_client(served):
    """The call comes back as tool_calls (finish_reason tool_calls), its reasoning as
    reasoning_content, its arguments typed; streamed, the deltas join to the same call; the
    result sent back reaches the model through the template, and the final answer is content."""
    name, engine, runner = served
    client = client_for(engine)
    call, call_end, final, final_end = ANSWERS[name]
    messages: list = [{"role": "user", "content": "Weather in Paris for two days?"}]
    say(engine, runner, call, end=call_end)
    r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS[name][:1], max_tokens=80)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "The user wants Paris."
    (made,) = choice.message.tool_calls
    assert made.function.name == "get_weather" and json.loads(made.function.arguments) == {"city": "Paris", "days": 2}

    stream = client.chat.completions.create(model="m", messages=messages, tools=TOOLS[name][:1], max_tokens=80,
                                            stream=True)
    reasoning, arguments, names, reasons = "", "", [], []
    for chunk in stream:
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            for piece in c.delta.tool_calls or []:
                names += [piece.function.name] if piece.function.name else []
                arguments += piece.function.arguments or ""
            reasons += [c.finish_reason] if c.finish_reason else []
    assert (reasoning, names, json.loads(arguments), reasons) == \
        ("The user wants Paris.", ["get_weather"], {"city": "Paris", "days": 2}, ["tool_calls"])

    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": made.id, "content": "sunny, 21 C"}]
    say(engine, runner, final, end=final_end)
    r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS[name][:1], max_tokens=80)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == "Sunny, 21 C."
    prompt = prompt_text(engine, runner)
    assert "sunny, 21 C" in prompt and "get_weather" in prompt and "Paris" in prompt
    if name == "gpt-oss":  # the call's analysis is shown again, the result as the function's message
        assert "<|channel|>analysis<|message|>The user wants Paris.<|end|>" in prompt
        assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny, 21 C"' in prompt
    else:
        assert "<|observation|>\n<tool_response>\nsunny, 21 C\n</tool_response>" in prompt


BROKEN = {
    "gpt-oss": ['<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": Paris',
                "<|channel|>analysis<|message|>unfinished", "<|channel|>fin", "no markup at all",
                '<|channel|>commentary to=functions.nope <|constrain|>json<|message|>[1, 2]', "<|message|><|end|>"],
    "glm-4.5": ["<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par", "<tool_call>\n</tool_call>",
                "<think>never closed", "<arg_value>x</arg_value>", "<tool_call>nope\n<arg_key>a</arg_key>"],
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_what_the_model_writes_wrong_is_never_a_500(served, stream):
    name, engine, runner = served
    http = http_client(engine)
    for text in BROKEN[name]:
        for max_tokens in (3, 60):  # cut short, and ended by the model
            say(engine, runner, text, end=ANSWERS[name][3])
            r = http.post("/v1/chat/completions", json={"messages": [ASK], "tools": TOOLS[name][:1], "stream": stream,
                                                        "max_tokens": max_tokens})
            assert r.status_code == 200, (text, r.text)
            if not stream:
                message = r.json()["choices"][0]["message"]
                said = (message.get("content") or "") + (message.get("reasoning_content") or "")
                if name == "gpt-oss":  # harmony's markup is read, never given out
                    assert not any(m in said for m in ("<|channel|>", "<|message|>", "<|start|>", "<|end|>")), \
                        (text, message)
            else:
                assert r.text.rstrip().endswith("data: [DONE]"), r.text
