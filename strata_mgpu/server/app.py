"""The FastAPI application: routes, API key, health while loading, metrics."""

from __future__ import annotations

import asyncio
import hmac
import time
from dataclasses import dataclass, field

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from strata_mgpu.engine.engine import Engine
from strata_mgpu.server.body_limit import MIN_BODY_BYTES, BodyLimit
from strata_mgpu.server.completions import REASONING_FORMATS, ChatOptions, complete, prepare_chat, prepare_text
from strata_mgpu.server.dialects import PARSER_NAMES, choose_dialect
from strata_mgpu.server.errors import APIError, install_error_handlers
from strata_mgpu.server.grammars import Grammars
from strata_mgpu.server.request_log import RequestLog
from strata_mgpu.server.schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest


@dataclass
class ServerState:
    """What the routes share. `engine` is None until the model has loaded. `tool_call_parser`: the tool
    dialect's name, or 'auto'."""

    model_name: str
    api_key: str | None = None
    engine: Engine | None = None
    load_error: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    reasoning_format: str = "deepseek"
    grammars: Grammars = field(default_factory=Grammars)
    tool_call_parser: str = "auto"
    lenient_json_schema: bool = False
    _options: tuple[Engine, ChatOptions] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.reasoning_format not in REASONING_FORMATS:
            raise ValueError(f"reasoning format {self.reasoning_format!r}: one of {', '.join(REASONING_FORMATS)}")
        if self.tool_call_parser not in PARSER_NAMES:
            raise ValueError(f"tool call parser {self.tool_call_parser!r}: one of {', '.join(PARSER_NAMES)}")

    def chat_options(self, engine: Engine) -> ChatOptions:
        """How chats are read for `engine`: chosen once for it (and the control tokens its dialect reads
        answers by are decoded as text from then on)."""
        if self._options is None or self._options[0] is not engine:
            template = engine.tokenizer.chat_template
            dialect = choose_dialect(self.tool_call_parser, template.source if template else None)
            engine.tokenizer.show_markup(dialect.shown_markup)  # its answers' markup reaches the text
            self._options = (engine, ChatOptions(dialect, self.reasoning_format, not self.lenient_json_schema))
        return self._options[1]


def create_app(state: ServerState, max_body_bytes: int = MIN_BODY_BYTES) -> FastAPI:
    """The API over `state`; request bodies over `max_body_bytes` get a 413."""
    # No Swagger UI or ReDoc: both load their scripts from a CDN (a blank page offline) and FastAPI serves
    # them without the API key. The schema itself is served below, behind the key.
    app = FastAPI(title="strata-mgpu", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(RequestLog)  # added last: outermost, so it sees the body cap's 413s too

    def authorized(request: Request) -> None:
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), state.api_key):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer ...)", code="invalid_api_key")

    def engine() -> Engine:
        if state.engine is None:
            raise APIError(503, state.load_error or "the model is loading", code="model_loading")
        return state.engine

    def check_model(name: str | None) -> None:
        if name is not None and name != state.model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {state.model_name!r}",
                           param="model", code="model_not_found")

    auth = [Depends(authorized)]

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.engine is None:
            status = {"status": "error", "error": state.load_error} if state.load_error else {"status": "loading"}
            return JSONResponse(status, status_code=503)
        return JSONResponse({"status": "ok"})

    def model_card() -> dict:
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "strata-mgpu"}

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    async def model(model_id: str) -> dict:
        check_model(model_id)
        return model_card()

    @app.post("/v1/embeddings", dependencies=auth)
    async def embeddings() -> None:
        raise APIError(404, "embeddings are not served by this server: it serves /v1/chat/completions and "
                            "/v1/completions", code="endpoint_not_served")

    @app.get("/openapi.json", dependencies=auth, include_in_schema=False)
    async def openapi() -> dict:
        return app.openapi()

    # Templates and tokenizers run in worker threads: a long prompt takes seconds, and on the event
    # loop it would hold up every other client (health checks and streams included) meanwhile.
    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        eng = engine()
        prepared = await asyncio.to_thread(prepare_chat, eng, state.grammars, body, state.chat_options(eng))
        return await complete(request, eng, state.model_name, body, prepared, "chat")

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        eng = engine()
        prepared = await asyncio.to_thread(prepare_text, eng, state.grammars, body, not state.lenient_json_schema)
        return await complete(request, eng, state.model_name, body, prepared, "text")

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(body: TokenizeRequest) -> dict:
        tokens = await asyncio.to_thread(engine().tokenizer.encode, body.text, add_special=body.add_special)
        return {"tokens": tokens}

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(body: DetokenizeRequest) -> dict:
        tok = engine().tokenizer
        if any(not 0 <= t < tok.vocab_size for t in body.tokens):
            raise APIError(400, f"token ids must be in 0..{tok.vocab_size - 1}", param="tokens")
        return {"content": tok.decode(body.tokens)}

    @app.post("/reset_prefix_cache", dependencies=auth)
    async def reset_prefix_cache() -> dict:
        """vLLM's name: drop the cached KV blocks (those a request is copying in stay)."""
        eng = engine()
        if eng.prefix is None:
            raise APIError(400, "the prefix cache is off (--no-prefix-cache)", code="prefix_cache_off")
        dropped = await asyncio.wrap_future(eng.reset_prefix_cache())
        return {"dropped_blocks": dropped}

    @app.get("/metrics", dependencies=auth)
    async def metrics() -> Response:
        eng = engine()
        return Response(eng.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
