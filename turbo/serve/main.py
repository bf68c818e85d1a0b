"""python -m turbo task=serve: the server in this process (uvicorn over app.make_app), or Ray
Serve replicas (serve.engine=ray: ray_app.py). It prints `serving on http://HOST:PORT` on stderr
once it answers (stdout carries generated text alone, and a server generates none there); Ctrl-C
stops it (the CLI's `interrupted`, 130)."""

from __future__ import annotations

import os
import sys
import threading

from omegaconf import DictConfig

from ..config import RunConfig
from ..extras import require
from .listen import address, listening
from .ray_app import run_ray
from .settings import ServeConfig, serve_config, server_defaults


def run_serve(cfg: DictConfig, rc: RunConfig) -> int:
    config = serve_config(cfg)
    for module in ("fastapi", "uvicorn", "prometheus_client"):
        require(module, "serve")
    defaults = server_defaults(rc.generation)
    if config.engine == "ray":
        return run_ray(rc, defaults, config)
    return run_local(rc, defaults, config)


def run_local(rc: RunConfig, defaults, config: ServeConfig) -> int:
    # uvicorn, and fastapi / prometheus_client under app and worker: the serve extra, imported
    # once run_serve's `require` has checked it (a missing one is one line, not a traceback)
    import uvicorn

    from .app import make_app
    from .worker import Engine

    sock = listening(config.host, config.port)  # before the model loads: a port in use is refused at once
    engine = Engine(rc.install, rc.opening, defaults, config)
    port = sock.getsockname()[1]

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                lower_priority(config.http_nice)
                print(f"serving on {address(config.host, port)}", file=sys.stderr, flush=True)

    server = Server(uvicorn.Config(make_app(engine), log_level="warning", access_log=False,
                                   timeout_graceful_shutdown=5))
    engine.start()
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop()
        sock.close()
    return 0 if server.started else 2


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
