"""serve.engine=ray: the same FastAPI app (app.make_app) as a Ray Serve deployment of
serve.replicas replicas, each with its own runtime and scheduler, behind Ray's HTTP proxy on
serve.host:serve.port. A local Ray cluster by default; serve.ray_address joins an existing one
(docs/serving.md has the multi-node commands). Ray routes requests; turbo schedules none across
machines."""

from __future__ import annotations

import sys
import time

from ..config import RunConfig
from ..extras import require
from ..sequence.options import GenerationOptions, OpenOptions
from .listen import address, listening
from .settings import ServeConfig

APP_NAME = "turbo"


class Replica:
    """One replica: an Engine, and the app over it (`__serve_build_asgi_app__`, Ray's hook that
    runs after the constructor, in the replica's process)."""

    def __init__(self, install: str, opening: OpenOptions, defaults: GenerationOptions, config: ServeConfig):
        # worker and app import the serve extra (prometheus_client, fastapi): here, in the replica,
        # once run_serve's `require` has checked it; main.py imports this module before that
        from .worker import Engine

        self.engine = Engine(install, opening, defaults, config)
        self.engine.start()

    def __serve_build_asgi_app__(self):
        from .app import make_app  # (fastapi: as the Engine above)

        return make_app(self.engine)

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop()


def deployment(rc: RunConfig, defaults: GenerationOptions, config: ServeConfig):
    """The bound application: `serve.run(deployment(...))`."""
    serve = require("ray.serve", "ray")
    cpus = rc.opening.threads or 1  # Ray places each replica where that many CPUs are free
    cls = serve.deployment(num_replicas=config.replicas, ray_actor_options={"num_cpus": cpus},
                           max_ongoing_requests=config.limits.max_running + config.limits.max_waiting)(
        serve.ingress()(Replica))
    return cls.bind(rc.install, rc.opening, defaults, config)


def run_ray(rc: RunConfig, defaults: GenerationOptions, config: ServeConfig) -> int:
    ray = require("ray", "ray")
    serve = require("ray.serve", "ray")
    probe = listening(config.host, config.port)  # a port in use is refused before Ray starts; port 0 picks a free one
    port = probe.getsockname()[1]
    probe.close()
    ray.init(address=config.ray_address, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": config.host, "port": port})
        serve.run(deployment(rc, defaults, config), name=APP_NAME, route_prefix="/")
        print(f"serving on {address(config.host, port)} ({config.replicas} Ray Serve replicas)", file=sys.stderr,
              flush=True)
        while True:
            time.sleep(3600)
    finally:
        serve.shutdown()
        ray.shutdown()
