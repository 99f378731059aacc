"""OpenAI's error object, raised by the request checks and answered by the routes."""

from __future__ import annotations

import logging
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

log = logging.getLogger(__name__)


class APIError(Exception):
    """An OpenAI error object: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type, self.code, self.headers = type, code, headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}  # fmt: skip

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Unknown routes and wrong methods answer OpenAI error objects, as OpenAI's API does."""
    what = "Invalid URL" if exc.status_code == 404 else "Method not allowed"
    err = APIError(exc.status_code, f"{what} ({request.method} {request.url.path})",
                   headers=dict(exc.headers or {}))  # fmt: skip
    return err.response()


async def internal_error(request: Request, exc: Exception) -> JSONResponse:
    """A bug, not the request: logged, and still an OpenAI error object."""
    log.exception("internal error on %s", request.url.path, exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}", None,
                    "internal_server_error").response()  # fmt: skip
