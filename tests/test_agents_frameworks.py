"""The agent frameworks users point at a local server, end to end, through the real templates of
qwen3moe files (tests/data/templates): LangChain (`bind_tools` forced and auto, a tool round trip,
`with_structured_output` json_schema strict), the OpenAI Agents SDK (an agent with a function
tool, run to its final answer) and the official openai client (a call, then the assistant message
with content null and the tool's result sent back: the shape that was a 500 on Qwen3's template).

The model is scripted (tests/scripted.py): it writes what the template's model writes, reasoning
and calls in that template's markup, so each test is deterministic and fails where the server
mis-renders, mis-parses or mis-constrains. Qwen3-Coder writes its calls as XML
(`<function=...><parameter=...>`), which the server reads in that dialect (server/dialects.py)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.scripted import client_for, http_client, prompt_text, say, scripted_engine

TEMPLATES = ["qwen3", "qwen3-thinking-2507", "qwen3-coder"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = "Weather in Paris?"


class Model:
    """What the template's model writes: its reasoning and its calls in the template's markup."""

    def __init__(self, template: str):
        self.template = template

    def thinks(self, reasoning: str) -> str:
        if self.template == "qwen3-thinking-2507":
            return f"{reasoning}\n</think>\n\n"  # its generation prompt opened the block
        if self.template == "qwen3":
            return f"<think>\n{reasoning}\n</think>\n\n"
        return ""  # Qwen3-Coder does not think

    def calls(self, *calls: tuple[str, dict]) -> str:
        if self.template == "qwen3-coder":
            return "\n".join("<tool_call>\n<function=" + name + ">\n" + "".join(
                f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items()) + "</function>\n</tool_call>"
                for name, args in calls)
        return "\n".join(f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"
                         for name, args in calls)


@pytest.fixture(scope="module", params=TEMPLATES)
def served(request, template_gguf):
    """(Model, engine, runner) on a scripted tiny model carrying that real template."""
    with scripted_engine(template_gguf(request.param)) as (engine, runner):
        yield Model(request.param), engine, runner


def test_the_openai_client_round_trip(served):
    model, engine, runner = served
    call = model.thinks("Paris: one call.") + model.calls(("get_weather", {"city": "Paris"}))
    say(engine, runner, call, call, model.thinks("It said sunny.") + "Sunny in Paris.")  # whole, streamed, then
    client = client_for(engine)
    messages: list[dict] = [{"role": "user", "content": ASK}]
    r = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER], temperature=0, max_tokens=64)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert not choice.message.content
    if model.template != "qwen3-coder":
        assert choice.message.model_extra["reasoning_content"] == "Paris: one call."
    with client.chat.completions.stream(model="m", messages=messages, tools=[WEATHER], temperature=0,
                                        max_tokens=64) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in calls]
    messages += [{"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
                 {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER], temperature=0, max_tokens=64)
    assert (r.choices[0].finish_reason, r.choices[0].message.content) == ("stop", "Sunny in Paris.")
    prompt = prompt_text(engine, runner)
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt and "get_weather" in prompt


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_thinking_off_is_asked_of_every_template_and_the_call_still_comes(served, tool_choice):
    """`enable_thinking: false`, as clients send it to any Qwen3 server: Qwen3's template then
    writes an empty think block; Qwen3-Thinking-2507's ignores it and opens one, so its model
    still reasons first, and a required call must be let through after the block closes."""
    model, engine, runner = served
    thinking = model.thinks("Paris: one call.") if model.template == "qwen3-thinking-2507" else ""
    say(engine, runner, thinking + model.calls(("get_weather", {"city": "Paris"})))
    r = client_for(engine).chat.completions.create(
        model="m", messages=[{"role": "user", "content": ASK}], tools=[WEATHER], tool_choice=tool_choice,
        temperature=0, max_tokens=64, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert [json.loads(c.function.arguments) for c in choice.message.tool_calls] == [{"city": "Paris"}]
    assert choice.message.model_extra.get("reasoning_content") == ("Paris: one call." if thinking else None)


# -- LangChain ---------------------------------------------------------------------------------------

def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


@pytest.fixture(scope="module")
def chat_model(served):
    langchain_openai = pytest.importorskip("langchain_openai")
    _, engine, _ = served
    return langchain_openai.ChatOpenAI(model="m", base_url="http://testserver/v1", api_key="k", temperature=0,
                                       max_tokens=64, max_retries=0, http_client=http_client(engine))


@pytest.mark.parametrize("tool_choice", ["get_weather", "auto"])
def test_langchain_bind_tools_forced_and_auto_then_the_result_sent_back(served, chat_model, tool_choice):
    from langchain_core.messages import HumanMessage, ToolMessage

    model, engine, runner = served
    say(engine, runner, model.thinks("Paris: one call.") + model.calls(("get_weather", {"city": "Paris"})),
        model.thinks("It said sunny.") + "Sunny in Paris.")
    bound = chat_model.bind_tools([get_weather], tool_choice=tool_choice)
    history = [HumanMessage(ASK)]
    called = bound.invoke(history)
    assert [(c["name"], c["args"]) for c in called.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert called.response_metadata["finish_reason"] == "tool_calls" and not called.content
    assert '"name": "get_weather"' in prompt_text(engine, runner) or "<name>get_weather</name>" in \
        prompt_text(engine, runner)
    history += [called, ToolMessage(get_weather(**called.tool_calls[0]["args"]),
                                    tool_call_id=called.tool_calls[0]["id"])]
    final = chat_model.bind_tools([get_weather]).invoke(history)  # its assistant message: content null
    assert final.content == "Sunny in Paris." and not final.tool_calls
    assert "<tool_response>\nsunny in Paris\n</tool_response>" in prompt_text(engine, runner)


def test_langchain_structured_output_json_schema_strict(served, chat_model):
    from pydantic import BaseModel

    class Forecast(BaseModel):
        city: str
        days: int

    model, engine, runner = served
    say(engine, runner, model.thinks("Two days.") + '{"city": "Paris", "days": 2}')
    structured = chat_model.with_structured_output(Forecast, method="json_schema", strict=True)
    assert structured.invoke(ASK) == Forecast(city="Paris", days=2)


# -- the OpenAI Agents SDK ---------------------------------------------------------------------------

def test_an_openai_agents_sdk_agent_runs_a_tool_to_its_final_answer(served):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    from strata_mgpu.server.app import ServerState, create_app

    model, engine, runner = served
    say(engine, runner, model.thinks("Paris: one call.") + model.calls(("get_weather", {"city": "Paris"})),
        model.thinks("It said sunny.") + "Sunny in Paris.")
    asked: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"sunny in {city}"

    async def run() -> str:
        app = create_app(ServerState(model_name="m", engine=engine))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as http:
            client = AsyncOpenAI(base_url="http://testserver/v1", api_key="k", max_retries=0, http_client=http)
            agent = agents.Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                                 model=agents.OpenAIChatCompletionsModel(model="m", openai_client=client),
                                 model_settings=agents.ModelSettings(temperature=0, max_tokens=64))
            result = await agents.Runner.run(agent, ASK)
            return result.final_output

    agents.set_tracing_disabled(True)
    assert asyncio.run(run()) == "Sunny in Paris."
    assert asked == ["Paris"]
    prompt = prompt_text(engine, runner)
    assert "Answer with the weather." in prompt and "<tool_response>\nsunny in Paris\n</tool_response>" in prompt
