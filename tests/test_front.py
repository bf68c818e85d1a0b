"""The front process (turbo/serve/front.py): what needs no model is refused there and never
reaches the engine's process; the rest is relayed byte for byte, streams as they come, a client
that leaves closes the engine's side too, an engine that is gone is a 503. Against a recording
stand-in for the engine's app on a Unix socket; then the real pair of processes (task=serve):
the key stays off the front's command line, and the two stop together."""

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
from types import SimpleNamespace

import pytest

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from turbo.__main__ import SERVE_SPINCOUNT  # noqa: E402
from turbo.serve.front import Front, FrontConfig  # noqa: E402
from turbo.serve.guard import Guard  # noqa: E402
from turbo.testing.checks import served_address  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEY = "front-k3y"
MAX_BODY, MAX_CHARS = 4096, 1000


class Engine:
    """A stand-in for the engine's app: records what reaches it; /v1/completions echoes the body,
    /stream sends one chunk, waits for `release`, sends another, and notes a client gone."""

    def __init__(self):
        self.seen: list[tuple[str, str, bytes, dict]] = []
        self.release = threading.Event()
        self.gone = threading.Event()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        body, more = b"", True
        while more:
            m = await receive()
            body, more = body + m.get("body", b""), m.get("more_body", False)
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.seen.append((scope["method"], scope["path"] + "?" + scope["query_string"].decode(), body, headers))
        if scope["path"] == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
            await send({"type": "http.response.body", "body": b"data: one\n\n", "more_body": True})
            while not self.release.is_set():
                await asyncio.sleep(0.01)
            left = asyncio.ensure_future(receive())  # (the body is read: the next message is the client's end)
            for _ in range(1000):
                if left.done():
                    self.gone.set()
                    return
                await send({"type": "http.response.body", "body": b"data: more\n\n", "more_body": True})
                await asyncio.sleep(0.01)
            return
        out = json.dumps({"got": body.decode(), "type": headers.get("content-type")}).encode()
        await send({"type": "http.response.start", "status": 429 if b"busy" in body else 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(out)),
                                (b"retry-after", b"1"), (b"x-engine", b"yes")]})
        await send({"type": "http.response.body", "body": out})


def serve_in_thread(app, sock: socket.socket) -> uvicorn.Server:
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    server.capture_signals = contextlib.nullcontext  # (a thread's server: the signals are pytest's)
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    deadline = time.time() + 10
    while not server.started and time.time() < deadline:
        time.sleep(0.01)
    assert server.started
    return server


@pytest.fixture()
def pair(tmp_path):
    engine = Engine()
    path = str(tmp_path / "engine.sock")
    inner = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    inner.bind(path)
    up = serve_in_thread(engine, inner)
    outer = socket.socket()
    outer.bind(("127.0.0.1", 0))
    port = outer.getsockname()[1]
    cfg = FrontConfig(path, outer.fileno(), "127.0.0.1", port, KEY, MAX_BODY, MAX_CHARS, 2048, 0)
    front = serve_in_thread(Guard(Front(cfg), key=KEY, limit=MAX_BODY), outer)
    yield SimpleNamespace(engine=engine, url=f"http://127.0.0.1:{port}", up=up, headers={"Authorization": f"Bearer {KEY}"})
    front.should_exit = up.should_exit = True


def test_what_needs_no_model_is_refused_in_front_and_never_reaches_the_engine(pair):
    h, url = pair.headers, pair.url + "/v1/completions"

    def chunked():
        for _ in range(8):
            yield b"x" * 1024

    cases = [
        (httpx.post(url, content=b"{}", timeout=10), 401),
        (httpx.post(url, content=b"x" * (MAX_BODY + 1), headers=h, timeout=10), 413),
        (httpx.post(url, content=chunked(), headers=h, timeout=10), 413),
        (httpx.post(url, content=b"{not json", headers=h, timeout=10), 400),
        (httpx.post(url, content=b'{"prompt": "\\udcff"}', headers=h, timeout=10), 400),
        (httpx.post(url, content=b'{"prompt": ' + b"[" * 80 + b"]" * 80 + b"}", headers=h, timeout=10), 400),
        (httpx.post(url, json={"model": "m", "prompt": "a" * (MAX_CHARS + 1)}, headers=h, timeout=10), 400),
        (httpx.post(pair.url + "/v1/chat/completions", json={"model": "m", "messages": [
            {"role": "user", "content": "hi"}, {"role": "user", "content": [{"type": "text", "text": "b" * (MAX_CHARS + 1)}]}]},
            headers=h, timeout=10), 400),
    ]
    for r, status in cases:
        assert r.status_code == status, (status, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert cases[-1][0].json()["error"]["param"] == "messages[1].content"
    assert cases[-2][0].json()["error"]["param"] == "prompt"
    assert pair.engine.seen == []


def test_the_rest_is_relayed_byte_for_byte(pair):
    body = b'{"model": "m", "prompt": "caf\xc3\xa9", "busy": 1}'
    r = httpx.post(pair.url + "/v1/completions?x=1", content=body, headers={**pair.headers, "Content-Type": "application/json"},
                   timeout=10)
    assert r.status_code == 429 and r.headers["retry-after"] == "1" and r.headers["x-engine"] == "yes"
    assert r.json() == {"got": body.decode(), "type": "application/json"}
    method, path, got, headers = pair.engine.seen[-1]
    assert (method, path, got) == ("POST", "/v1/completions?x=1", body)
    assert r.headers["content-length"] == str(len(r.content)) and len(r.headers.get_list("date")) == 1
    assert httpx.get(pair.url + "/health", timeout=10).status_code == 200  # (other routes: as they are)


def test_a_stream_is_relayed_as_it_comes_and_a_client_that_leaves_closes_the_engines_side(pair):
    with httpx.stream("POST", pair.url + "/stream", content=b"{}", headers=pair.headers, timeout=10) as r:
        lines = r.iter_lines()
        assert next(lines) == "data: one"  # before the engine has sent the rest
        pair.engine.release.set()
        assert next(lines) == ""
        assert next(lines) == "data: more"
    assert pair.engine.gone.wait(5), "the engine's side still streaming 5 s after its client left"


def test_an_engine_that_is_gone_is_a_503(pair):
    pair.up.should_exit = True
    time.sleep(0.5)
    r = httpx.post(pair.url + "/v1/completions", json={"model": "m", "prompt": "hi"}, headers=pair.headers, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"


def test_the_front_imports_no_torch():
    out = subprocess.run([sys.executable, "-c", "import sys, turbo.serve.front; print('torch' in sys.modules)"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(k) for k in f.read().split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_two_processes_keep_the_key_off_argv_and_stop_together(tmp_path):
    (tmp_path / "key").write_text(KEY + "\n")
    cmd = [sys.executable, "-m", "turbo", "task=serve", "serve.port=0", "threads=1", "backend=cpu",
           f"serve.api_key_file={tmp_path / 'key'}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OMP_WAIT_POLICY", None)
    env.pop("GOMP_SPINCOUNT", None)
    runs = []
    for stop in ("kill the front", "ctrl-c"):
        proc = subprocess.Popen(cmd, cwd=tmp_path, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        url = served_address(proc).split()[-1]
        (front,) = children(proc.pid)
        with open(f"/proc/{front}/cmdline", "rb") as f:
            argv = f.read()
        assert b"turbo.serve.front" in argv and KEY.encode() not in argv
        with open(f"/proc/{front}/environ", "rb") as f:  # (the engine's, as set before torch loaded libgomp)
            environ = f.read().split(b"\0")
        assert f"GOMP_SPINCOUNT={SERVE_SPINCOUNT}".encode() in environ and not any(
            v.startswith(b"OMP_WAIT_POLICY=") for v in environ)
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert r.status_code == 200, r.text
        os.kill(front, signal.SIGKILL) if stop == "kill the front" else proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=30)
        err = proc.stderr.read()
        runs.append((stop, code, "Traceback" in err, os.path.exists(f"/proc/{front}") and
                     open(f"/proc/{front}/stat").read().split()[2] != "Z"))
    assert runs == [("kill the front", 2, False, False), ("ctrl-c", 130, False, False)]
