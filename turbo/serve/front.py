"""The front process (serve.front=process, the default): the HTTP side that faces the clients,
in a process of its own, before the engine's. It holds the listening socket and refuses what
needs no model -- a missing API key, a body over serve.max_body_mb, a body that is not JSON or
not valid Unicode or nested too deep, a prompt longer than the context could hold -- and relays
everything else, byte for byte, to the engine's own app (app.py) over a Unix socket, streams
included.

Why a process: a flood of such requests keeps an event loop busy parsing and refusing, and in
the engine's process that loop held the GIL the engine's step thread needs between its kernels
(measured: the loop 80% of a core on refusals, the engine's share of the GIL down to a quarter,
other clients' p99 3x; docs/hardening.md). In a process of its own the flood costs the engine
nothing but the cores it takes. torch is not imported here (about 50 MiB).

    python -m turbo task=serve    # main.py starts this process, hands it the socket, and writes
                                  # its settings to its stdin (one JSON line: the key stays off argv)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import sys
import threading
from dataclasses import asdict, dataclass

import httpx
import uvicorn
from starlette.requests import ClientDisconnect, Request

from .api_error import ApiError
from .body import check_text_lengths, parse_json
from .guard import Guard, error
from .head import HeadLimits
from .limits import read_body
from .listen import address

CHECKED = {"/v1/completions": False, "/v1/chat/completions": True}  # path: chat
# not relayed: each hop writes its own (a request's length httpx's, a response's framing uvicorn's)
HOP_BY_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade", b"proxy-connection"}
NOT_SENT = HOP_BY_HOP | {b"host", b"content-length", b"expect"}
NOT_ANSWERED = HOP_BY_HOP | {b"date", b"server"}


@dataclass(frozen=True)
class FrontConfig:
    engine_socket: str  # the engine app's Unix socket (in a directory only this user reads)
    fd: int  # the listening socket, inherited
    host: str
    port: int
    api_key: str | None
    max_body: int  # bytes
    max_chars: int  # a prompt longer than this cannot fit the context (limits.max_token_chars)
    max_positions: int
    nice: int  # serve.http_nice: this whole process that much nicer

    def line(self) -> bytes:
        return json.dumps(asdict(self)).encode() + b"\n"


class Front:
    """The relay (plain ASGI; `Guard` in front of it refuses from the head)."""

    def __init__(self, cfg: FrontConfig):
        self.cfg = cfg
        self.client: httpx.AsyncClient | None = None  # made on the server's loop

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        if self.client is None:
            self.client = httpx.AsyncClient(
                transport=httpx.AsyncHTTPTransport(uds=self.cfg.engine_socket), base_url="http://engine",
                timeout=None, limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        request = Request(scope, receive)
        try:
            body = await read_body(request.stream(), self.cfg.max_body, request.headers.get("content-length"))
            chat = CHECKED.get(scope["path"]) if scope["method"] == "POST" else None
            if chat is not None:
                d = parse_json(body)
                check_text_lengths(d.get("prompt"), d.get("messages"), chat, self.cfg.max_chars,
                                   self.cfg.max_positions)
        except ClientDisconnect:
            return
        except ApiError as e:
            await error(e)(scope, receive, send)
            return
        await self.relay(scope, receive, send, body)

    async def relay(self, scope, receive, send, body: bytes) -> None:
        """The request to the engine's app, its answer back as it comes. A client that goes away
        closes the engine's connection too (its app then cancels the request's ticket)."""
        path = scope["raw_path"].decode("latin-1") if scope.get("raw_path") else scope["path"]
        if scope.get("query_string"):
            path += "?" + scope["query_string"].decode("latin-1")
        request = self.client.build_request(scope["method"], path, content=body, headers=[
            (k, v) for k, v in scope["headers"] if k.lower() not in NOT_SENT])
        upstream = asyncio.ensure_future(self.client.send(request, stream=True))
        gone = asyncio.ensure_future(disconnected(receive))
        response = None
        try:
            await asyncio.wait({upstream, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not upstream.done():  # the client left while the engine worked on a whole answer
                upstream.cancel()
                return
            try:
                response = upstream.result()
            except httpx.TransportError as e:
                await error(ApiError(f"the engine is not answering ({type(e).__name__})", None, 503,
                                     "server_error"))(scope, receive, send)
                return
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": [(k, v) for k, v in response.headers.raw if k.lower() not in NOT_ANSWERED]})
            try:
                async for piece in response.aiter_raw():
                    if gone.done():
                        return
                    await send({"type": "http.response.body", "body": piece, "more_body": True})
            except httpx.TransportError:  # the engine's process went away mid-answer: the client's ends cut
                return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            gone.cancel()
            if response is not None:
                await response.aclose()


async def disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class FrontServer(uvicorn.Server):
    """Says `serving on` once it answers; leaves the signals alone (the parent, the engine's
    process, stops it by closing this process's stdin)."""

    def __init__(self, config: uvicorn.Config, said: str):
        super().__init__(config)
        self.said = said

    def capture_signals(self):
        return contextlib.nullcontext()

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            print(f"serving on {self.said}", file=sys.stderr, flush=True)


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (Ctrl-C reaches the parent, which stops this one)
    cfg = FrontConfig(**json.loads(sys.stdin.buffer.readline()))
    if cfg.nice > 0:
        with contextlib.suppress(OSError):
            os.nice(cfg.nice)
    sock = socket.socket(fileno=cfg.fd)
    app = Guard(Front(cfg), key=cfg.api_key, limit=cfg.max_body)
    server = FrontServer(uvicorn.Config(app, http=HeadLimits, log_level="warning", access_log=False, lifespan="off",
                                        timeout_graceful_shutdown=5), address(cfg.host, cfg.port))

    def watch_parent() -> None:  # stdin's end: the engine's process is stopping (or gone)
        sys.stdin.buffer.read()
        server.should_exit = True

    threading.Thread(target=watch_parent, daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        # the engine's private directory (main.py's turbo-serve-*), should its process have died of a
        # signal before its own cleanup: this process outlives it, told by stdin's end
        shutil.rmtree(os.path.dirname(cfg.engine_socket), ignore_errors=True)
    return 0 if server.started else 2


if __name__ == "__main__":
    sys.exit(main())
