"""`/v1/chat/completions` and `/v1/completions`: a request -> its prompt, constraints and sampling ->
the engine -> JSON or SSE. Prompt, grammar and template run off the event loop (`prepare_chat`,
`prepare_text`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from strata_mgpu.engine.engine import ContextOverflow, Engine, RequestOutput
from strata_mgpu.engine.grammar import Grammar, GrammarError
from strata_mgpu.model.tokenizer import Tokenizer
from strata_mgpu.server.answer import ChatDelta
from strata_mgpu.server.chat_output import ChatAnswer, tool_call_delta
from strata_mgpu.server.dialects import ToolDialect
from strata_mgpu.server.errors import APIError, error_body
from strata_mgpu.server.grammars import Grammars, Thinking, chat_grammar, text_grammar
from strata_mgpu.server.logprobs import LegacyLogprobs, chat_entries
from strata_mgpu.server.messages import template_messages, template_tools
from strata_mgpu.server.reasoning import opens_reasoning
from strata_mgpu.server.schemas import ChatCompletionRequest, CompletionRequest, NamedToolChoice, _Generation

log = logging.getLogger("strata.server")

DISCONNECT_POLL_S = 0.25
REASONING_FORMATS = ("deepseek", "none")  # llama-server's --reasoning-format names

# What `Tokenizer.apply_chat_template` itself passes to the template: a request may not set them.
TEMPLATE_ARGUMENTS = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"})


@dataclass(frozen=True)
class ChatOptions:
    """How the server reads chats, fixed at load: its tool dialect, `--reasoning-format`, and whether
    JSON schemas are read strictly."""

    dialect: ToolDialect
    reasoning_format: str = "deepseek"
    strict_json: bool = True


@dataclass(frozen=True)
class Prepared:
    """A request made ready off the event loop: its prompt, and what constrains and shapes its answer."""

    prompt: list[int]
    grammar: Grammar | None = None
    banned: tuple[int, ...] = ()  # token ids it may not draw
    split_reasoning: bool = False  # reasoning (<think> blocks, harmony's analysis) becomes reasoning_content
    opened_reasoning: bool = False  # the prompt opened a reasoning block
    parse_tools: bool = False
    functions: Mapping[str, dict[str, Any]] | None = None  # the offered functions' parameter schemas, by name
    max_calls: int | None = None  # parallel_tool_calls false: 1
    dialect: ToolDialect | None = None  # a chat's


# -- preparing a request (worker threads) -------------------------------------------------------------

def prepare_chat(engine: Engine, grammars: Grammars, body: ChatCompletionRequest, options: ChatOptions) -> Prepared:
    """The chat's prompt tokens and constraints. Slow for a long chat: call it off the event loop."""
    reserved = sorted(TEMPLATE_ARGUMENTS & body.chat_template_kwargs.keys())
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(map(repr, reserved))}: the server sets "
                            f"{', '.join(sorted(TEMPLATE_ARGUMENTS))} itself", param="chat_template_kwargs")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    functions = _called_functions(body)
    tok = engine.tokenizer
    dialect = options.dialect
    messages = dialect.adapt_history(template_messages(body.messages))
    kwargs = dict(body.chat_template_kwargs)
    if body.offered_tools:
        kwargs["tools"] = template_tools(body.offered_tools)
    if body.reasoning_effort is not None:  # OpenAI's field, as the template variable gpt-oss's template reads
        template = tok.chat_template
        if template is None or "reasoning_effort" not in template.source:
            raise APIError(400, "reasoning_effort: not supported by this model's chat template: thinking is on or "
                                "off, chat_template_kwargs.enable_thinking", param="reasoning_effort")
        kwargs["reasoning_effort"] = body.reasoning_effort
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    split = options.reasoning_format == "deepseek"
    opened = opens_reasoning(text, (dialect.think_open, dialect.think_close))
    if opened:  # a template that always opens one (Qwen3-Thinking-2507's) ignores enable_thinking
        thinking = Thinking.OPENED
    elif not split or body.chat_template_kwargs.get("enable_thinking") is False:
        thinking = Thinking.OFF
    else:
        thinking = Thinking.OPTIONAL
    answer_schema = body.response_format.schema_of_answer if body.response_format else None
    if functions is not None and body.tool_choice not in (None, "auto"):
        answer_schema = None  # a call is required: the answer is calls
    param = "tools" if functions else "response_format"
    with _schema_errors(param):
        lark = chat_grammar(tok, dialect, functions=functions, parallel=body.parallel_tool_calls,
                            answer_schema=answer_schema, thinking=thinking, strict=options.strict_json)
    banned: tuple[int, ...] = ()
    call_token = dialect.call_token
    if body.tool_choice == "none" and body.tools and call_token is not None and call_token in tok.tokens:
        banned = (tok.tokens.index(call_token),)  # OpenAI's none: the model must not call
    offered = {t.function.name: t.function.parameters or {} for t in body.offered_tools}
    return Prepared(prompt=tok.encode(text), grammar=_compiled(engine, grammars, lark, param),
                    banned=banned, split_reasoning=split, opened_reasoning=split and opened,
                    parse_tools=bool(body.offered_tools), functions=offered,
                    max_calls=None if body.parallel_tool_calls else 1, dialect=dialect)


def _called_functions(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The functions a grammar lets the answer call: all offered ones for 'required' (and for 'auto'
    beside a JSON response_format), the named one; None where calls are free text."""
    tools = body.offered_tools
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: each function needs its own name", param="tools")
    choice = body.tool_choice
    if (choice == "required" or isinstance(choice, NamedToolChoice)) and not tools:
        raise APIError(400, "tool_choice: a required or named tool call needs 'tools'", param="tool_choice")
    if isinstance(choice, NamedToolChoice):
        named = [t for t in tools if t.function.name == choice.function.name]
        if not named:
            raise APIError(400, f"tool_choice: no tool is named {choice.function.name!r} (tools: "
                                f"{', '.join(map(repr, names))})", param="tool_choice")
        return [named[0].function.model_dump(exclude_unset=True)]
    if choice == "required" or (tools and choice in (None, "auto") and body.response_format is not None
                                and body.response_format.schema_of_answer is not None):
        return [t.function.model_dump(exclude_unset=True) for t in tools]
    return None


@contextmanager
def _schema_errors(param: str) -> Iterator[None]:
    """A client's schema that breaks the building of its grammar is a 400 naming it: the schemas
    are arbitrary JSON, so whatever fails in reading them (ValueError where the reading checks,
    anything else where it did not foresee the shape) is the request's fault."""
    try:
        yield
    except ValueError as e:
        raise APIError(400, f"{param}: {e}", param=param) from None
    except Exception as e:
        raise APIError(400, f"{param}: the schema cannot be read ({type(e).__name__}: {e})", param=param) from None


def _compiled(engine: Engine, grammars: Grammars, lark: str | None, param: str) -> Grammar | None:
    if lark is None:
        return None
    try:
        compiler = grammars.compiler(engine)
    except Exception as e:  # llguidance cannot read this model's vocabulary
        raise APIError(400, f"structured output is not available for this model's tokenizer: {e}", param=param) \
            from None
    try:
        return compiler.compile(lark)
    except GrammarError as e:
        raise APIError(400, f"{param}: the schema cannot be followed: {e}", param=param) from None


def prepare_text(engine: Engine, grammars: Grammars, body: CompletionRequest, strict_json: bool = True) -> Prepared:
    """The prompt's tokens and its JSON grammar. Slow for a long text: call it off the event loop."""
    if isinstance(body.prompt, str):
        prompt = engine.tokenizer.encode(body.prompt)
    else:
        vocab = engine.runner.spec.vocab_size
        if any(not 0 <= t < vocab for t in body.prompt):
            raise APIError(400, f"prompt token ids must be in 0..{vocab - 1}", param="prompt")
        prompt = list(body.prompt)
    schema = body.response_format.schema_of_answer if body.response_format else None
    with _schema_errors("response_format"):
        lark = text_grammar(schema, strict=strict_json)
    return Prepared(prompt=prompt, grammar=_compiled(engine, grammars, lark, "response_format"))


# -- how each endpoint words its answer ----------------------------------------------------------------

def _merged(a: ChatDelta, b: ChatDelta) -> ChatDelta:
    return ChatDelta(a.reasoning + b.reasoning, a.content + b.content, a.deltas + b.deltas, a.calls + b.calls)


class _ChatView:

    id_prefix, object, chunk_object, prompt_field = "chatcmpl-", "chat.completion", "chat.completion.chunk", \
        "messages"

    def __init__(self, tok: Tokenizer, prepared: Prepared, logprobs: bool):
        self.tok = tok
        assert prepared.dialect is not None, "a chat is prepared with its dialect"
        self.answer = ChatAnswer(prepared.dialect, split_reasoning=prepared.split_reasoning,
                                 opened=prepared.opened_reasoning, parse_tools=prepared.parse_tools,
                                 functions=prepared.functions, max_calls=prepared.max_calls)
        self.entries: list[dict[str, Any]] | None = [] if logprobs else None
        self.failed = False  # reading the answer failed: the rest is content

    @property
    def done(self) -> bool:
        return not self.failed and self.answer.done

    def first_choices(self) -> list[dict[str, Any]]:
        return [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]

    def _read(self, out: RequestOutput) -> ChatDelta:
        """The answer's new pieces; where reading fails (a bug the model's text found), that text
        and all that follows as content, the failure logged: never a 500 nor a stream cut off."""
        if not self.failed:
            try:
                delta = self.answer.feed(out.text)
                if out.finished:
                    delta = _merged(delta, self.answer.finish(cut=out.finish_reason == "length"))
                return delta
            except Exception:
                log.exception("reading the answer failed; the rest of it is given as content")
                self.failed = True
        self.answer.content.append(out.text)
        return ChatDelta(content=out.text)

    def choices(self, out: RequestOutput) -> list[dict[str, Any]]:
        delta = self._read(out)
        parts: list[dict[str, Any]] = []
        if delta.reasoning:
            parts.append({"reasoning_content": delta.reasoning})
        if delta.content:
            parts.append({"content": delta.content})
        parts += [tool_call_delta(piece) for piece in delta.deltas]
        logprobs = None
        if self.entries is not None and out.logprobs:
            new = chat_entries(self.tok, out.logprobs)
            self.entries += new
            logprobs = {"content": new, "refusal": None}
            parts = parts or [{}]
        return [{"index": 0, "delta": part, "logprobs": logprobs if i == 0 else None, "finish_reason": None}
                for i, part in enumerate(parts)]

    def finish_reason(self, reason: str | None, streamed: bool = False) -> str | None:
        """'tool_calls' where the answer made whole calls and ended, or ran to the limit (a call it
        cut is left out); but 'length' in a stream that gave out the head of the call it cut: the
        client must know its last call is incomplete."""
        if self.answer.calls and reason in ("stop", "length") and not (streamed and self.answer.cut_call):
            return "tool_calls"
        return reason

    def last_choice(self, reason: str | None) -> dict[str, Any]:
        return {"index": 0, "delta": {}, "logprobs": None, "finish_reason": self.finish_reason(reason, streamed=True)}

    def whole_choice(self, reason: str | None) -> dict[str, Any]:
        logprobs = None if self.entries is None else {"content": self.entries, "refusal": None}
        return {"index": 0, "message": self.answer.message(), "logprobs": logprobs,
                "finish_reason": self.finish_reason(reason)}


class _TextView:
    id_prefix, object, chunk_object, prompt_field = "cmpl-", "text_completion", "text_completion", "prompt"

    def __init__(self, tok: Tokenizer, logprobs: bool):
        self.tok = tok
        self.text: list[str] = []
        self.logprobs = LegacyLogprobs(tok) if logprobs else None  # a stream's, run on chunk by chunk
        self.entries: list[Any] = []

    done = False  # a text answer ends with the engine's request

    def first_choices(self) -> list[dict[str, Any]]:
        return []

    def choices(self, out: RequestOutput) -> list[dict[str, Any]]:
        self.text.append(out.text)
        block = None
        if self.logprobs is not None and out.logprobs:
            self.entries += out.logprobs
            block = self.logprobs.block(out.logprobs)
        if not out.text and block is None:
            return []
        return [{"index": 0, "text": out.text, "logprobs": block, "finish_reason": None}]

    def finish_reason(self, reason: str | None) -> str | None:
        return reason

    def last_choice(self, reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": "", "logprobs": None, "finish_reason": reason}

    def whole_choice(self, reason: str | None) -> dict[str, Any]:
        block = LegacyLogprobs(self.tok).block(self.entries) if self.logprobs is not None else None
        return {"index": 0, "text": "".join(self.text), "logprobs": block, "finish_reason": reason}


_View = _ChatView | _TextView


# -- running it -------------------------------------------------------------------------------------

async def complete(request: Request, engine: Engine, model: str, body: _Generation, prepared: Prepared,
                   endpoint: Literal["chat", "text"]) -> JSONResponse | StreamingResponse:
    logprobs = body.requested_logprobs() is not None
    view: _View = (_ChatView(engine.tokenizer, prepared, logprobs) if endpoint == "chat"
                   else _TextView(engine.tokenizer, logprobs))
    prompt = prepared.prompt
    room = engine.n_ctx - len(prompt)
    max_tokens = body.requested_max_tokens() or room
    if room < 1 or max_tokens > room:
        raise APIError(400, str(ContextOverflow(len(prompt), max_tokens, engine.n_ctx)), param=view.prompt_field,
                       code="context_length_exceeded", n_prompt_tokens=len(prompt), n_ctx=engine.n_ctx)
    try:
        params = body.sampling(max_tokens, engine.runner.spec.vocab_size, grammar=prepared.grammar,
                               banned=prepared.banned)
    except ValueError as e:
        param = "logit_bias" if "logit_bias" in str(e) else None
        raise APIError(400, str(e), param=param) from None
    loop = asyncio.get_running_loop()
    outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
    rid = view.id_prefix + uuid.uuid4().hex
    request.state.request_id = rid
    engine.submit(prompt, params, lambda out: loop.call_soon_threadsafe(outputs.put_nowait, out), request_id=rid)
    created = int(time.time())
    if body.stream:
        return StreamingResponse(_stream(request, engine, rid, created, model, body, view, outputs),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return await _whole(request, engine, rid, created, model, view, outputs)


async def _next(request: Request, engine: Engine, rid: str, outputs: asyncio.Queue[RequestOutput]
                ) -> RequestOutput | None:
    """The next output, or None once the client has gone (the request is then aborted)."""
    while True:
        try:
            return await asyncio.wait_for(outputs.get(), timeout=DISCONNECT_POLL_S)
        except TimeoutError:
            if await request.is_disconnected():
                engine.abort(rid)
                return None


def _usage(out: RequestOutput) -> dict[str, object]:
    cached = out.timings.cache_n if out.timings else 0
    return {"prompt_tokens": out.n_prompt_tokens, "completion_tokens": out.n_generated,
            "total_tokens": out.n_prompt_tokens + out.n_generated,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _ended(engine: Engine, rid: str, view: _View, out: RequestOutput) -> str | None:
    """The engine's finish reason, or 'tool_calls' where the answer has all the calls it may have (the
    rest of the generation is then stopped)."""
    if out.finished:
        return out.finish_reason
    if view.done:
        engine.abort(rid)
        return "stop"
    return None


async def _whole(request: Request, engine: Engine, rid: str, created: int, model: str, view: _View,
                 outputs: asyncio.Queue[RequestOutput]) -> JSONResponse:
    ended = False
    try:
        while True:
            out = await _next(request, engine, rid, outputs)
            if out is None:
                ended = True  # _next aborted it
                return JSONResponse(error_body(499, "client disconnected"), status_code=499)  # nginx's code
            ended = out.finished
            if out.finish_reason == "error":
                raise APIError(out.error_status, f"generation failed: {out.error}")
            view.choices(out)
            reason = _ended(engine, rid, view, out)
            if reason is not None:
                ended = True
                break
    finally:
        if not ended:  # cancelled, or the handler failed: free the request now, as a stream does
            engine.abort(rid)
    return JSONResponse({
        "id": rid, "object": view.object, "created": created, "model": model,
        "choices": [view.whole_choice(reason)],
        "usage": _usage(out), "timings": out.timings.as_dict() if out.timings else None,
    })


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


async def _stream(request: Request, engine: Engine, rid: str, created: int, model: str, body: _Generation,
                  view: _View, outputs: asyncio.Queue[RequestOutput]) -> AsyncIterator[bytes]:
    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return _sse({"id": rid, "object": view.chunk_object, "created": created, "model": model,
                     "choices": choices, **extra})

    finished = False
    try:
        for choice in view.first_choices():
            yield chunk([choice])
        while not finished:
            out = await _next(request, engine, rid, outputs)
            if out is None:
                return
            if out.finish_reason == "error":
                finished = True
                yield _sse(error_body(out.error_status, f"generation failed: {out.error}"))
                break
            for choice in view.choices(out):
                yield chunk([choice])
            reason = _ended(engine, rid, view, out)
            if reason is not None:
                finished = True
                yield chunk([view.last_choice(reason)], timings=out.timings.as_dict() if out.timings else None)
                if body.include_usage:
                    yield chunk([], usage=_usage(out))
        yield _sse("[DONE]")
    finally:
        if not finished:  # the client went away (or the server is stopping): free the request now
            engine.abort(rid)
