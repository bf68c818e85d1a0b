"""Bounds on a request's head (its request line and header fields) for the server that faces the
clients: the front process, or the inline server. uvicorn has none with httptools: a connection
that sends one header line a second stays open for ever, and a 1 MiB header or 5,000 of them are
read whole. `HeadLimits` is uvicorn's httptools protocol with three bounds, as nginx and Node
keep them: the head must arrive whole within HEAD_TIMEOUT_S of the connection opening (or of the
last answer on a kept-alive one), hold at most HEAD_BYTES and HEAD_FIELDS. Past one: 408 or 431,
OpenAI's error object, and the connection closed.
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .api_error import ApiError

HEAD_TIMEOUT_S = 10.0  # Node's headersTimeout is 60 s, Apache's RequestReadTimeout header 20-40 s
HEAD_BYTES = 64 << 10  # the request line and the fields' names and values; nginx reads up to 4 x 8 KiB
HEAD_FIELDS = 100  # Apache's LimitRequestFields
LINGER_S = 1.0  # after a refusal, what the client still sends is read and dropped this long (nginx's lingering close)


class HeadTooLarge(Exception):
    """Raised inside the parser's callbacks to stop it (httptools wraps it in its own error)."""


class HeadLimits(HttpToolsProtocol):
    timeout_s, max_bytes, max_fields = HEAD_TIMEOUT_S, HEAD_BYTES, HEAD_FIELDS  # (a test's subclass sets its own)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.head_bytes = self.head_fields = 0
        self.refusal: ApiError | None = None
        self.refused = False
        self.head_timer: asyncio.TimerHandle | None = None
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self.head_timer = self.loop.call_later(self.timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _too_slow(self) -> None:
        self.head_timer = None
        if not self.transport.is_closing():
            self._refuse(ApiError(f"the request's head did not arrive within {self.timeout_s:g} s", None, 408))

    def _count(self, size: int, fields: int) -> None:
        self.head_bytes += size
        self.head_fields += fields
        if self.head_bytes > self.max_bytes:
            self.refusal = ApiError(f"the request's head is over {self.max_bytes} bytes", None, 431)
        elif self.head_fields > self.max_fields:
            self.refusal = ApiError(f"the request has over {self.max_fields} header fields", None, 431)
        if self.refusal is not None:
            raise HeadTooLarge

    def data_received(self, data: bytes) -> None:
        if not self.refused:
            super().data_received(data)

    def on_url(self, url: bytes) -> None:
        self._count(len(url), 0)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value), 1)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm()
        self.head_bytes = self.head_fields = 0  # (the next head's count, pipelined or not)
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        idle = self.cycle is None or self.cycle.response_complete  # (else a pipelined request, its head in, runs)
        if idle and not self.transport.is_closing():
            self._arm()  # the next request's head on this connection (uvicorn's keep-alive closes an idle one)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a parser error: ours where a bound stopped the parser."""
        if self.refusal is None:
            super().send_400_response(msg)
        else:
            self._refuse(self.refusal)

    def _refuse(self, e: ApiError) -> None:
        """The answer, then the connection closed. Not at once: closing a socket with the client's bytes
        still unread resets the connection, and the client would lose the answer."""
        self._disarm()
        self.refused = True
        body = json.dumps(e.body()).encode()
        reason = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}[e.status]
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (e.status, reason, len(body), body))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)
