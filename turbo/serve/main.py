"""python -m turbo task=serve: the server in this process (uvicorn over app.make_app), or Ray
Serve replicas (serve.engine=ray: ray_app.py). It prints `serving on http://HOST:PORT` on stderr
once it answers (stdout carries generated text alone, and a server generates none there); Ctrl-C
stops it (the CLI's `interrupted`, 130)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading

from typing import TYPE_CHECKING

from omegaconf import DictConfig

from ..config import RunConfig
from ..extras import require
from .listen import address, listening
from .ray_app import run_ray
from .settings import ServeConfig, serve_config, server_defaults

if TYPE_CHECKING:
    from .front import FrontConfig


def run_serve(cfg: DictConfig, rc: RunConfig) -> int:
    config = serve_config(cfg)
    for module in ("fastapi", "uvicorn", "httptools", "httpx", "prometheus_client"):
        require(module, "serve")
    defaults = server_defaults(rc.generation)
    if config.engine == "ray":
        return run_ray(rc, defaults, config)
    return run_local(rc, defaults, config)


def run_local(rc: RunConfig, defaults, config: ServeConfig) -> int:
    # uvicorn, and fastapi / prometheus_client under app and worker: the serve extra, imported
    # once run_serve's `require` has checked it (a missing one is one line, not a traceback)
    import uvicorn

    from .app import body_limit, make_app
    from .front import FrontConfig  # (httpx, with uvicorn: the serve extra)
    from .head import HeadLimits
    from .worker import Engine

    sock = listening(config.host, config.port)  # before the model loads: a port in use is refused at once
    engine = Engine(rc.install, rc.opening, defaults, config)
    port = sock.getsockname()[1]
    private = tempfile.mkdtemp(prefix="turbo-serve-")  # (0700: the engine's socket is this user's alone)
    front: subprocess.Popen | None = None
    if config.front == "inline":
        inner = sock
    else:  # the engine's app on a Unix socket; the front process holds the port (front.py)
        inner = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        inner.bind(os.path.join(private, "engine.sock"))

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            nonlocal front
            await super().startup(sockets)
            if not self.started:
                return
            lower_priority(config.http_nice)
            if config.front == "inline":
                print(f"serving on {address(config.host, port)}", file=sys.stderr, flush=True)
                return
            front = start_front(FrontConfig(inner.getsockname(), sock.fileno(), config.host, port, config.api_key,
                                            body_limit(engine), engine.max_prompt_chars, engine.max_positions,
                                            config.http_nice))
            threading.Thread(target=stop_with, args=(front, self), daemon=True).start()

    server = Server(uvicorn.Config(make_app(engine), http=HeadLimits, log_level="warning", access_log=False,
                                   timeout_graceful_shutdown=5))
    engine.start()
    # uvicorn stops gracefully on SIGTERM, then raises it again with the handler it found: this one,
    # so that the cleanup below runs (the default handler would end the process before it)
    signal.signal(signal.SIGTERM, terminated)
    try:
        server.run(sockets=[inner])
    finally:
        front_died = front is not None and front.poll() is not None
        if front is not None:
            stop_front(front)
        engine.stop()
        sock.close()
        inner.close()
        shutil.rmtree(private, ignore_errors=True)
    return 0 if server.started and not front_died else 2


def terminated(sig: int, frame) -> None:
    raise SystemExit(128 + sig)  # (the shell's code for a process a signal ended)


def start_front(cfg: "FrontConfig") -> subprocess.Popen:
    """The front process (front.py), handed the listening socket and its settings (stdin: the
    API key stays out of the process list); it prints `serving on` once it answers."""
    proc = subprocess.Popen([sys.executable, "-m", "turbo.serve.front"], stdin=subprocess.PIPE, pass_fds=[cfg.fd])
    proc.stdin.write(cfg.line())
    proc.stdin.flush()
    return proc


def stop_with(front: subprocess.Popen, server) -> None:
    """The front process ended on its own (it could not start, or was killed): so does the server."""
    front.wait()
    server.should_exit = True


def stop_front(front: subprocess.Popen) -> None:
    """Its stdin's end tells it to stop (its open answers get uvicorn's graceful 5 s)."""
    with contextlib.suppress(OSError):
        front.stdin.close()
    try:
        front.wait(10)
    except subprocess.TimeoutExpired:
        front.kill()
        front.wait()


def lower_priority(nice: int) -> None:
    """This thread (the event loop's, and the threads it starts from now on: asyncio's workers)
    `nice` steps below the engine's step thread, started before it at the process's priority (Linux:
    a thread's own priority; lowering one needs no privilege). A flood of requests then takes the
    cores from the engine last; what a request spends here is small beside its decoding."""
    if nice > 0 and sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + nice)
        except OSError:  # (a sandbox that refuses it: the server runs as before)
            pass


if __name__ == "__main__":
    sys.exit("run it as python -m turbo task=serve")
