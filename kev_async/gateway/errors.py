"""OpenAI's error object, `{"error": {"message", "type", "param", "code"}}`, for every 4xx/5xx the gateway sends.

Handlers raise `ApiError`; the app turns it (and starlette's own 404/405, and any crash) into that shape,
so an OpenAI client always gets an error it can parse.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

# OpenAI's `type` for each status it uses.
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
          404: "invalid_request_error", 405: "invalid_request_error", 408: "timeout_error",
          413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
          503: "service_unavailable", 504: "timeout_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers  # e.g. Retry-After on a 429

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


async def on_api_error(_request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, ApiError)
    return error.response()


async def on_http_error(_request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, HTTPException)
    return ApiError(error.status_code, error.detail or "error", code=_http_code(error.status_code)).response()


async def on_crash(_request: Request, _error: Exception) -> JSONResponse:
    return internal_error()


def internal_error() -> JSONResponse:
    # The traceback is logged; the client gets no internals.
    return ApiError(500, "The gateway failed while handling the request.", code="internal_error").response()


def _http_code(status: int) -> str | None:
    return {404: "not_found", 405: "method_not_allowed"}.get(status)


HANDLERS = {ApiError: on_api_error, HTTPException: on_http_error, Exception: on_crash}
