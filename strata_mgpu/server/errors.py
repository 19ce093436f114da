"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}; `code` is a string or null."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error", 503: "unavailable_error"}


class APIError(Exception):
    """Raised by handlers; becomes an OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 **extra: Any):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.extra = status, message, param, code, extra

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code, **self.extra)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None,
               **extra: Any) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code, **extra}}


# pydantic names the member of a union it tried ('str', 'list[int]', a model's class name,
# 'function-after[...]'): not a field of the request, so not part of the name a client is shown
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "any"})


def _field_path(loc: tuple[Any, ...]) -> str:
    """pydantic's ('body', 'messages', 2, 'content') -> 'messages[2].content'."""
    path = ""
    for p in loc:
        if p == "body":
            continue
        if isinstance(p, int):
            path += f"[{p}]"
        elif isinstance(p, str) and p.isidentifier() and p.islower() and p not in _TYPE_TAGS:
            path += f".{p}" if path else p
    return path


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first error, as 'field.path: what is wrong' (the field is also the error's `param`)."""
    errs = exc.errors()
    if not errs:
        return "invalid request", None
    first = errs[0]
    if first.get("type") == "json_invalid":
        return f"invalid JSON: {first.get('msg', '')}", None
    message = str(first.get("msg", "invalid"))
    for prefix in ("Value error, ", "Assertion failed, "):
        message = message.removeprefix(prefix)
    where = _field_path(tuple(first.get("loc", ())))
    return (f"{where}: {message}" if where else message), where or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(error_body(400, message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":  # no such route: say which one was asked for
            message = f"{request.method} {request.url.path} is not served by this server"
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code)
