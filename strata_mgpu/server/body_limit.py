"""A cap on request bodies, so one huge request cannot hold the server's memory and time."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from strata_mgpu.server.errors import error_body

# A token of text is ~4 bytes; JSON's \uXXXX escapes make a CJK or emoji token ~12-18 bytes, a token
# id in a list ~7. 128 bytes a token is far above all of them: a body past it cannot be a prompt that
# fits the context, so reading it would only spend memory and the tokenizer's time.
BODY_BYTES_PER_TOKEN = 128
MIN_BODY_BYTES = 1 << 20  # 1 MiB: room for long chats with small contexts


def max_body_bytes(n_ctx: int) -> int:
    """The largest request body worth reading for sequences of `n_ctx` tokens."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * n_ctx)


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets a 413 in OpenAI's shape, whether its
    Content-Length says so or its chunks add up to it. A body within the cap is read here whole."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away mid-body: the app sees that
                first = message
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                first = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                break
        pending: list[Message] = [first]

        async def replay() -> Message:  # the body once, then the client's own messages (disconnect)
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = error_body(413, f"the request body is over {self.max_bytes} bytes, the most this server reads "
                               f"(it follows the context size)")
        await JSONResponse(body, status_code=413)(scope, receive, send)
