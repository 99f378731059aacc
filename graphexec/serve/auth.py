"""The API key check: an ASGI middleware in front of the routes."""

from __future__ import annotations

import hmac

from graphexec.serve.errors import APIError


class ApiKey:
    """ASGI middleware: /v1/*, /tokenize and /detokenize need `Authorization: Bearer KEY`
    (a 401 OpenAI error object otherwise); /health and /metrics stay open, as vLLM's."""

    OPEN = ("/health", "/metrics")

    def __init__(self, app, key: str) -> None:
        self.app, self._want = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.OPEN:
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self._want):
                err = APIError(401, "a valid API key is needed: Authorization: Bearer <key>",
                               None, "invalid_request_error", "invalid_api_key")  # fmt: skip
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
