"""`/v1/chat/completions` and `/v1/completions`: prompt in, engine outputs out (whole or SSE)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from strata_mgpu.engine.engine import ContextOverflow, Engine, RequestOutput
from strata_mgpu.server.errors import APIError, error_body
from strata_mgpu.server.schemas import ChatCompletionRequest, CompletionRequest, _Generation

DISCONNECT_POLL_S = 0.25


@dataclass(frozen=True)
class Shape:
    """How one endpoint words its responses."""

    id_prefix: str
    prompt_field: str  # the request field that holds the prompt: the `param` of errors about its length
    object: str
    chunk_object: str
    whole_choice: Callable[[str, str | None], dict[str, Any]]  # (text, finish_reason) -> choice
    delta_choice: Callable[[str | None, str | None], dict[str, Any]]  # (text or None, finish_reason)
    first_choice: dict[str, Any] | None  # sent before any text (the chat role), or nothing


CHAT = Shape(
    id_prefix="chatcmpl-", prompt_field="messages", object="chat.completion", chunk_object="chat.completion.chunk",
    whole_choice=lambda text, reason: {"index": 0, "message": {"role": "assistant", "content": text},
                                       "logprobs": None, "finish_reason": reason},
    delta_choice=lambda text, reason: {"index": 0, "delta": {} if text is None else {"content": text},
                                       "logprobs": None, "finish_reason": reason},
    first_choice={"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None},
)
TEXT = Shape(
    id_prefix="cmpl-", prompt_field="prompt", object="text_completion", chunk_object="text_completion",
    whole_choice=lambda text, reason: {"index": 0, "text": text, "logprobs": None, "finish_reason": reason},
    delta_choice=lambda text, reason: {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason},
    first_choice=None,
)


# What `Tokenizer.apply_chat_template` itself passes to the template: a request may not set them.
TEMPLATE_ARGUMENTS = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})


def chat_prompt(engine: Engine, body: ChatCompletionRequest) -> list[int]:
    """The chat's prompt tokens. Slow for a long chat (template, then tokenizer): call it off the event loop."""
    reserved = sorted(TEMPLATE_ARGUMENTS & body.chat_template_kwargs.keys())
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(map(repr, reserved))}: the server sets "
                            f"{', '.join(sorted(TEMPLATE_ARGUMENTS))} itself", param="chat_template_kwargs")
    messages = [m.as_template_dict() for m in body.messages]
    try:
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **body.chat_template_kwargs)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    return engine.tokenizer.encode(text)


def text_prompt(engine: Engine, body: CompletionRequest) -> list[int]:
    """The prompt's tokens. Slow for a long text: call it off the event loop."""
    if isinstance(body.prompt, str):
        return engine.tokenizer.encode(body.prompt)
    vocab = engine.runner.spec.vocab_size
    if any(not 0 <= t < vocab for t in body.prompt):
        raise APIError(400, f"prompt token ids must be in 0..{vocab - 1}", param="prompt")
    return list(body.prompt)


async def complete(request: Request, engine: Engine, model: str, body: _Generation, prompt: list[int],
                   shape: Shape) -> JSONResponse | StreamingResponse:
    room = engine.n_ctx - len(prompt)
    max_tokens = body.requested_max_tokens() or room
    if room < 1 or max_tokens > room:
        raise APIError(400, str(ContextOverflow(len(prompt), max_tokens, engine.n_ctx)), param=shape.prompt_field,
                       code="context_length_exceeded", n_prompt_tokens=len(prompt), n_ctx=engine.n_ctx)
    try:
        params = body.sampling(max_tokens)
    except ValueError as e:
        raise APIError(400, str(e)) from None
    loop = asyncio.get_running_loop()
    outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
    rid = shape.id_prefix + uuid.uuid4().hex
    engine.submit(prompt, params, lambda out: loop.call_soon_threadsafe(outputs.put_nowait, out), request_id=rid)
    created = int(time.time())
    if body.stream:
        return StreamingResponse(_stream(request, engine, rid, created, model, body, shape, outputs),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return await _whole(request, engine, rid, created, model, shape, outputs)


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


def _usage(out: RequestOutput) -> dict[str, int]:
    return {"prompt_tokens": out.n_prompt_tokens, "completion_tokens": out.n_generated,
            "total_tokens": out.n_prompt_tokens + out.n_generated}


async def _whole(request: Request, engine: Engine, rid: str, created: int, model: str, shape: Shape,
                 outputs: asyncio.Queue[RequestOutput]) -> JSONResponse:
    parts = []
    try:
        while True:
            out = await _next(request, engine, rid, outputs)
            if out is None:
                return JSONResponse(error_body(400, "client disconnected"), status_code=400)
            parts.append(out.text)
            if out.finished:
                break
    except asyncio.CancelledError:
        engine.abort(rid)
        raise
    if out.finish_reason == "error":
        raise APIError(out.error_status, f"generation failed: {out.error}")
    return JSONResponse({
        "id": rid, "object": shape.object, "created": created, "model": model,
        "choices": [shape.whole_choice("".join(parts), out.finish_reason)],
        "usage": _usage(out), "timings": out.timings.as_dict() if out.timings else None,
    })


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


async def _stream(request: Request, engine: Engine, rid: str, created: int, model: str, body: _Generation,
                  shape: Shape, outputs: asyncio.Queue[RequestOutput]) -> AsyncIterator[bytes]:
    def chunk(choice: dict[str, Any] | None, **extra: Any) -> bytes:
        return _sse({"id": rid, "object": shape.chunk_object, "created": created, "model": model,
                     "choices": [choice] if choice else [], **extra})

    finished = False
    try:
        if shape.first_choice:
            yield chunk(shape.first_choice)
        while not finished:
            out = await _next(request, engine, rid, outputs)
            if out is None:
                return
            finished = out.finished
            if out.finish_reason == "error":
                yield _sse(error_body(out.error_status, f"generation failed: {out.error}"))
                break
            if out.text:
                yield chunk(shape.delta_choice(out.text, None))
            if out.finished:
                yield chunk(shape.delta_choice(None, out.finish_reason),
                            timings=out.timings.as_dict() if out.timings else None)
                if body.include_usage:
                    yield chunk(None, usage=_usage(out))
        yield _sse("[DONE]")
    finally:
        if not finished:  # the client went away (or the server is stopping): free the request now
            engine.abort(rid)
