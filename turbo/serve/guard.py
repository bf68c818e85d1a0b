"""What a server refuses from a request's head alone (`Guard`), and OpenAI's error object as a
response (`error`): shared by the engine's app (app.py) and the front process (front.py), and
torch-free for the front's sake."""

from __future__ import annotations

import hmac

from starlette.responses import JSONResponse

from .api_error import ApiError
from .limits import declared_length, too_large


def error(e: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 429 else None
    if e.status == 413:  # the rest of the body is not read: closing spares draining it
        headers = {"Connection": "close"}
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


class Guard:
    """What is refused from the request's head alone, before routing and before a byte of the body
    is read: a /v1 request without the API key (401), a body whose Content-Length is over the limit
    (413, the connection closed: its bytes are never read). A plain ASGI middleware (not
    @app.middleware's, whose task group and streams every request would pay for)."""

    def __init__(self, app, key: str | None, limit: int):
        self.app, self.limit = app, limit
        self.expected = None if key is None else f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            refusal = self.refusal(scope)
            if refusal is not None:
                response = error(refusal)
                if any(k in (b"content-length", b"transfer-encoding") for k, _ in scope["headers"]):
                    response.headers["connection"] = "close"  # a body unread: not drained either
                await response(scope, receive, send)  # (a Response never reads the body)
                return
        await self.app(scope, receive, send)

    def refusal(self, scope) -> ApiError | None:
        headers = dict(reversed(scope["headers"]))  # (lower-case names, bytes; the first of a repeated one)
        if self.expected is not None and scope["path"].startswith("/v1"):
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                return ApiError("Incorrect or missing API key (Authorization: Bearer KEY).", None, 401,
                                  code="invalid_api_key")
        if declared_length(headers.get(b"content-length")) > self.limit:
            return too_large(self.limit)
        return None
