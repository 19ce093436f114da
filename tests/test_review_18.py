"""Review of gpt-oss and its harmony / GLM-4.5 dialects (eighteenth session): what a user of a real
file or an OpenAI client hits."""

from __future__ import annotations

import unicodedata

import pytest
import regex
import tiktoken.load
from gguf import GGUFWriter
from tiktoken_ext import openai_public

from strata_mgpu.engine.grammar import GrammarCompiler
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import GptOssShape, spec_from_gguf
from strata_mgpu.model.synthetic import write_model
from strata_mgpu.model.tokenizer import byte_to_unicode, tokenizer_from_gguf
from strata_mgpu.model.vocab import build_vocab
from strata_mgpu.server.dialects import GLM45, HARMONY, HERMES, QWEN3_CODER
from strata_mgpu.server.grammars import Thinking, chat_grammar
from tests.scripted import client_for, http_client, prompt_text, say, scripted_engine


def _o200k_pattern(monkeypatch) -> str:
    """tiktoken's own split pattern of o200k (gpt-oss's o200k_harmony takes it unchanged), read
    without its ranks file (not needed for the pattern)."""
    monkeypatch.setattr(tiktoken.load, "load_tiktoken_bpe", lambda *a, **k: {})
    monkeypatch.setattr(openai_public, "load_tiktoken_bpe", lambda *a, **k: {})
    return openai_public.o200k_harmony()["pat_str"]


def _harmony_vocab_file(path, pre: str):
    """A file holding only the tokenizer keys, written as llama.cpp's converter writes gpt-oss's
    (`tokenizer.ggml.pre = gpt-4o`: its o200k_harmony's hash is gpt-4o's)."""
    vocab = build_vocab(1024, "harmony")
    w = GGUFWriter(str(path), "gpt-oss")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    w.add_token_merges(vocab.merges)
    w.add_eos_token_id(vocab.id_of("<|return|>"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


BYTES = byte_to_unicode()  # the byte-level alphabet pieces are spelled in
TEXTS = ["HelloWorld, it's 12345 o'clock!\n\n  indented/path\r\n", "CamelCaseWORDSandMore don't",
         "e\u0301t\u00e9 \u00c9T\u00c9"]


def test_a_real_gpt_oss_files_tokenizer_loads_and_splits_as_tiktoken_does(tmp_path, monkeypatch):
    """ggml-org's and unsloth's gpt-oss GGUFs say `tokenizer.ggml.pre = gpt-4o`: the file loads, its
    text is split by o200k's pattern (tiktoken's, here the oracle) and not normalized (tiktoken
    normalizes nothing: a decomposed accent stays decomposed)."""
    tok = tokenizer_from_gguf(GGUFFile(_harmony_vocab_file(tmp_path / "oss.gguf", "gpt-4o")))
    pattern = _o200k_pattern(monkeypatch)
    for text in TEXTS:
        pieces = [piece for piece, _ in tok.hf.pre_tokenizer.pre_tokenize_str(text)]
        spelled = ["".join(BYTES[b] for b in p.encode()) for p in regex.findall(pattern, text)]
        assert pieces == spelled, text
        assert tok.decode(tok.encode(text, add_special=False)) == text
    assert unicodedata.normalize("NFC", TEXTS[2]) != TEXTS[2]  # the last text is not NFC: it was kept so


# -- harmony through the server ------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = {"role": "user", "content": "Weather in Paris?"}
# gpt-oss's agentic answer: it thinks, tells the user what it is about to do (a preamble: commentary
# without a recipient), then calls
PREAMBLE_CALL = ("<|channel|>analysis<|message|>The user wants Paris.<|end|><|start|>assistant<|channel|>commentary"
                 "<|message|>Let me check.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather "
                 '<|constrain|>json<|message|>{"city": "Paris"}')


@pytest.fixture(scope="module")
def harmony_served(template_gguf):
    with scripted_engine(template_gguf("gpt-oss")) as (engine, runner):
        yield engine, runner


def _preamble_round_trip(engine, runner) -> tuple[str, str]:
    """(the first turn's prompt, the second's): the model answers analysis, a preamble and a call;
    the client sends that message back as it got it, with the call's result."""
    client = client_for(engine)
    say(engine, runner, PREAMBLE_CALL, end="<|call|>")
    first = client.chat.completions.create(model="m", messages=[ASK], tools=[WEATHER], max_tokens=600)
    first_prompt = prompt_text(engine, runner)
    message = first.choices[0].message
    assert message.content == "Let me check." and message.model_extra["reasoning_content"] == "The user wants Paris."
    (call,) = message.tool_calls
    say(engine, runner, "<|channel|>final<|message|>Sunny.", end="<|return|>")
    messages = [ASK, message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r = http_client(engine).post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER],
                                                               "max_tokens": 600})
    assert r.status_code == 200, r.text
    return first_prompt, prompt_text(engine, runner)


def test_a_preamble_its_reasoning_and_a_call_sent_back_as_the_client_got_them_are_rendered(harmony_served):
    """gpt-oss's template refuses a tool-call message holding both content and thinking; the server's
    answer with a preamble is one, so an agent's next turn was a 400 (the harmony dialect adapts it)."""
    _, prompt = _preamble_round_trip(*harmony_served)
    assert "<|channel|>analysis<|message|>The user wants Paris.<|end|>" in prompt
    assert 'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>' in prompt


def test_the_adapted_history_renders_the_analysis_as_the_model_wrote_it(harmony_served):
    """The next prompt extends the one the answer was written after by the answer's analysis message
    as generated, token for token, up to the next message's `<|start|>assistant` (the prefix cache
    keeps it); the preamble, which the template has no form for, is not shown; the call follows."""
    first, second = _preamble_round_trip(*harmony_served)
    written = PREAMBLE_CALL[:PREAMBLE_CALL.index("<|channel|>commentary")]  # the analysis message and the next start
    assert written.endswith("<|end|><|start|>assistant")
    assert second.startswith(first + written), second
    assert second[len(first + written):].startswith(" to=functions.get_weather<|channel|>commentary")
    assert "Let me check." not in second


@pytest.mark.parametrize("dialect", [HERMES, QWEN3_CODER, GLM45], ids=lambda d: d.name)
def test_the_other_dialects_take_the_history_as_given(dialect):
    """Only harmony adapts a past answer: a tagged template renders content, reasoning and calls together."""
    message = {"role": "assistant", "content": "Let me check.", "thinking": "The user wants Paris.",
               "reasoning_content": "The user wants Paris.",
               "tool_calls": [{"id": "c1", "type": "function",
                               "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    history = [dict(ASK), message, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    expected = [dict(m) for m in history]
    assert dialect.adapt_history(history) == expected
    assert HARMONY.adapt_history(history)[1]["content"] == ""  # where harmony's does adapt the same message


def test_reasoning_effort_reaches_gpt_oss_template_and_a_wrong_one_is_a_400(harmony_served):
    """OpenAI's `reasoning_effort` is gpt-oss's own knob (its template writes `Reasoning: <effort>`;
    `enable_thinking` it does not read): it reaches the template; a value it has no level for is a
    400 naming the field. (A template that does not read it still refuses it: test_agents_server.)"""
    engine, runner = harmony_served
    http = http_client(engine)
    say(engine, runner, "<|channel|>final<|message|>Hi.", end="<|return|>")
    r = http.post("/v1/chat/completions", json={"messages": [ASK], "reasoning_effort": "high", "max_tokens": 100})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hi.", r.text
    assert "Reasoning: high" in prompt_text(engine, runner)
    r = http.post("/v1/chat/completions", json={"messages": [ASK], "reasoning_effort": "extreme", "max_tokens": 9})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort", r.text


# -- GLM-4.5's required calls on its own vocabulary ------------------------------------------------------

GLM_WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "note": {"type": "string", "maxLength": 12}}, "required": ["city", "days"]}}


@pytest.fixture(scope="module")
def glm_loaded(template_gguf):
    f = GGUFFile(template_gguf("glm-4.5"))
    spec, tok = spec_from_gguf(f), tokenizer_from_gguf(f)
    tok.show_markup(GLM45.shown_markup)
    return f, spec, tok, GrammarCompiler(tok, spec.vocab_size)


def test_glm_required_calls_close_on_its_vocabulary(glm_loaded):
    """GLM-4.5's files hold `<arg_value>`, `</arg_value>`, `</tool_call>` as control tokens: the grammar of
    tool_choice required (or a named function) admits a call as the template writes it and may end there.
    Before, a string value's text (a complement regex) took the control tokens too, as text: a value of a
    string parameter never ended, the call never closed, and the model ran to the length limit."""
    _, _, tok, compiler = glm_loaded
    grammars = {thinking: compiler.compile(chat_grammar(tok, GLM45, functions=[GLM_WEATHER], parallel=False,
                                                        answer_schema=None, thinking=thinking))
                for thinking in (Thinking.OFF, Thinking.OPTIONAL)}
    for thinking, lead in ((Thinking.OFF, ""), (Thinking.OPTIONAL, "\n<think>Paris.</think>\n")):
        m = grammars[thinking].matcher()
        call = (f"{lead}<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
                "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>")
        assert all(m.accept(t) for t in tok.encode(call, add_special=False)) and m.native.is_accepting(), thinking


def test_a_qwen3_coder_value_takes_no_control_token(tmp_path):
    """Qwen3-Coder's text value (tool_choice required) is text: a control token (`<|im_start|>`,
    `<|im_end|>`) inside it is refused, as in GLM's; before, the complement regex took it as text."""
    path = tmp_path / "tiny.gguf"
    write_model(path, "tiny", seed=7)
    f = GGUFFile(path)
    spec, tok = spec_from_gguf(f), tokenizer_from_gguf(f)
    compiler = GrammarCompiler(tok, spec.vocab_size)
    weather = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                      "required": ["city"]}}
    lark = chat_grammar(tok, QWEN3_CODER, functions=[weather], parallel=False, answer_schema=None,
                        thinking=Thinking.OFF)

    def admits(city: str) -> bool:
        m = compiler.compile(lark).matcher()
        text = (f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n</function>\n"
                "</tool_call>")
        return all(m.accept(t) for t in tok.encode(text, add_special=False)) and m.native.is_accepting()

    assert admits("Paris") and not admits("Par<|im_start|>is")


def test_an_assistant_message_with_empty_tool_calls_renders_on_gpt_oss(harmony_served):
    """`tool_calls: []` (clients that always send the key) is no calls, as null is: gpt-oss's template
    takes the key's presence for a call and reads its first; before, a 400 ("list object has no element 0")."""
    engine, runner = harmony_served
    say(engine, runner, "<|channel|>final<|message|>Ok.", end="<|return|>")
    messages = [ASK, {"role": "assistant", "content": "Sunny.", "tool_calls": []},
                {"role": "user", "content": "Thanks"}]
    r = http_client(engine).post("/v1/chat/completions", json={"messages": messages, "max_tokens": 100})
    assert r.status_code == 200, r.text
    assert "<|channel|>final<|message|>Sunny.<|end|>" in prompt_text(engine, runner)


def test_a_sliding_window_period_of_one_slides_no_layer():
    """llama.cpp's set_swa_pattern(n): layer i slides where i % n < n - 1, so a period of 1 slides none
    (GptOssShape's comment said every layer)."""
    shape = GptOssShape(sliding_window=128, swa_period=1)
    assert [shape.window(i) for i in range(4)] == [0, 0, 0, 0]
    assert [GptOssShape(sliding_window=128).window(i) for i in range(4)] == [128, 0, 128, 0]


def test_tool_choice_none_on_harmony_returns_no_call_though_nothing_bans_one(harmony_served):
    """harmony has no call token to ban: under tool_choice none a model that calls anyway (a function it
    knows from the history) ends its turn at <|call|> and gets no tool_calls; the call's text is content."""
    engine, runner = harmony_served
    say(engine, runner, PREAMBLE_CALL, end="<|call|>")
    r = http_client(engine).post("/v1/chat/completions", json={"messages": [ASK], "tools": [WEATHER],
                                                               "tool_choice": "none", "max_tokens": 600})
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == 'Let me check.{"city": "Paris"}'
    assert "get_weather" not in prompt_text(engine, runner)  # the tools were not given to the template
