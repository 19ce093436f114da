"""A log line for every API request, rejected ones too: method, path, status, the request's id and,
for an error, its message.

ASGI middleware, outermost: it sees the 413s of the body cap and the 400s of validation alike. A
request's id is set here (`req-` + hex), replaced by a handler that names the request itself
(`chatcmpl-...`, the id the engine's log line carries). A success is logged as its response
starts; an error once its body is out.

Levels: a 5xx is an ERROR, but `/health` is polled and is logged at DEBUG whatever it answers
(the loader logs its start and end itself, once); a request turned away while the model loads is
a WARNING; a client that left before its answer, 499 (nginx's and llama-server's code), is INFO.
"""

from __future__ import annotations

import json
import logging
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("strata.server")
ERROR_BODY_BYTES = 8192  # an error body is read for its message up to this much
PROBED_PATHS = frozenset({"/health"})


def level(path: str, status: int, code: str | None = None) -> int:
    if path in PROBED_PATHS:
        return logging.DEBUG
    if code == "model_loading":
        return logging.WARNING
    return logging.ERROR if status >= 500 else logging.INFO


class RequestLog:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["request_id"] = "req-" + uuid.uuid4().hex
        status = 0
        body = bytearray()
        logged = False

        def line(reason: str, code: str | None = None) -> None:
            nonlocal logged
            logged = True
            path = scope.get("path", "")
            log.log(level(path, status, code), "%s %s %d %s%s", scope.get("method", ""), path, status,
                    state.get("request_id", "-"), f": {reason}" if reason else "")

        async def logging_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if status < 400:
                    line("")
            elif message["type"] == "http.response.body" and status >= 400 and not logged:
                if len(body) < ERROR_BODY_BYTES:
                    body.extend(message.get("body", b"")[:ERROR_BODY_BYTES - len(body)])
                if not message.get("more_body", False):
                    line(*_reason(bytes(body)))
            await send(message)

        try:
            await self.app(scope, receive, logging_send)
        finally:
            if not logged:  # no response at all (the handler raised, or the client left first)
                status = status or 500
                line("no response was sent")


def _reason(body: bytes) -> tuple[str, str | None]:
    """An error body's message and code (OpenAI's shape), else its first bytes and no code."""
    try:
        error = json.loads(body)["error"]
        return str(error.get("message") or error), error.get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        return body[:200].decode("utf-8", errors="replace"), None
