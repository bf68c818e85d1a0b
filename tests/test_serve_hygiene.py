"""The server's process hygiene (issue 57): a request's head is bounded in time, bytes and fields
where the server faces its clients (turbo/serve/head.py: 408 / 431, OpenAI's error object, the
connection closed, the next client served), and the engine's 0700 turbo-serve-* directory is
gone after a SIGTERM, and after the engine is killed by a signal (the front removes it)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("httptools")

from turbo.serve.head import HEAD_BYTES, HEAD_FIELDS, HeadLimits  # noqa: E402
from turbo.testing.checks import served_address  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 0.5


class QuickHead(HeadLimits):
    timeout_s = TIMEOUT_S


async def echo(scope, receive, send):
    if scope["path"] == "/slow":  # (an answer that takes longer than a head may)
        await asyncio.sleep(2 * TIMEOUT_S)
    body, more = b"", True
    while more:
        m = await receive()
        body, more = body + m.get("body", b""), m.get("more_body", False)
    out = json.dumps({"path": scope["path"], "bytes": len(body)}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(out))]})
    await send({"type": "http.response.body", "body": out})


@pytest.fixture(scope="module")
def url():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(echo, http=QuickHead, log_level="warning", lifespan="off"))
    server.capture_signals = contextlib.nullcontext  # (a thread's server: the signals are pytest's)
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    deadline = time.time() + 10
    while not server.started and time.time() < deadline:
        time.sleep(0.01)
    yield "http://127.0.0.1:%d" % sock.getsockname()[1]
    server.should_exit = True


def connect(url: str) -> socket.socket:
    host, port = url.rsplit("/", 1)[1].split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def answer(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def refused(raw: bytes, status: int, says: str) -> None:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), raw[:200]
    assert b"connection: close" in head.lower()
    assert says in json.loads(body)["error"]["message"]


def still_served(url: str) -> None:
    r = httpx.post(url + "/v1/x", content=b"y" * (1 << 20))  # (a body, however large, is not the head)
    assert r.status_code == 200 and r.json() == {"path": "/v1/x", "bytes": 1 << 20}


@pytest.mark.parametrize("head, says", [
    (b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n", f"over {HEAD_BYTES} bytes"),
    (b"GET / HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(5000)) + b"\r\n",
     f"over {HEAD_FIELDS} header fields"),
    (b"GET /" + b"a" * (1 << 20) + b" HTTP/1.1\r\nHost: x\r\n\r\n", f"over {HEAD_BYTES} bytes"),
], ids=["a 1 MiB header", "5,000 headers", "a 1 MiB path"])
def test_a_head_over_its_bounds_is_a_431(url, head, says):
    with connect(url) as s:
        s.sendall(head)  # (read whole: the server drops what follows its answer before it closes)
        refused(answer(s), 431, says)
    still_served(url)


def test_heads_sent_a_line_a_while_are_cut_at_the_timeout(url):
    conns = [connect(url) for _ in range(20)]
    for s in conns:
        s.sendall(b"GET / HTTP/1.1\r\n")
    start = time.monotonic()
    for i in range(int(3 * TIMEOUT_S / 0.1)):  # a header line every 0.1 s: each connection is still sending
        for s in conns:
            with contextlib.suppress(OSError):
                s.sendall(b"X-%d: 1\r\n" % i)
        time.sleep(0.1)
    for s in conns:
        refused(answer(s), 408, f"did not arrive within {TIMEOUT_S:g} s")
        s.close()
    assert time.monotonic() - start < 3 * TIMEOUT_S + 2
    still_served(url)


def test_a_connection_that_sends_nothing_is_closed(url):
    with connect(url) as s:
        refused(answer(s), 408, "did not arrive")


def test_a_kept_alive_connection_gets_the_bound_afresh_for_each_request(url):
    with httpx.Client() as c:
        for _ in range(3):
            assert c.get(url + "/a").json()["path"] == "/a"
            time.sleep(TIMEOUT_S * 0.6)  # (beyond one timeout in all, within it between requests)


def test_a_pipelined_request_is_not_timed_out_while_it_is_answered(url):
    with connect(url) as s:
        s.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\nGET /slow HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        raw = answer(s)
    assert raw.count(b"HTTP/1.1 200 ") == 2 and b" 408 " not in raw, raw


def serve(tmp_path: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}  # (where mkdtemp puts its directory)
    return subprocess.Popen([sys.executable, "-m", "turbo", "task=serve", "serve.port=0", "threads=1", "backend=cpu"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_the_served_front_bounds_heads_and_no_directory_outlives_the_server(tmp_path, stop):
    proc = serve(tmp_path)
    url = served_address(proc).split()[-1]
    (private,) = tmp_path.glob("turbo-serve-*")
    assert private.stat().st_mode & 0o777 == 0o700
    with connect(url) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
        refused(answer(s), 431, "over")
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    proc.send_signal(stop)
    code = proc.wait(timeout=30)
    deadline = time.time() + 15  # (after a SIGKILL the front sees its stdin end, stops, and cleans up)
    while private.exists() and time.time() < deadline:
        time.sleep(0.1)
    assert not private.exists()
    assert code == -signal.SIGKILL if stop == signal.SIGKILL else code == 128 + signal.SIGTERM
    assert "Traceback" not in proc.stderr.read()
