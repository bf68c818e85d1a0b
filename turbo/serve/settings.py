"""task=serve's settings: the `serve.*` keys (conf/task/serve.yaml) checked into a `ServeConfig`,
and the generation defaults a server takes from the top-level keys (policy, block, drafter...)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from omegaconf import DictConfig, ListConfig

from ..errors import TurboError
from ..options import GenerationOptions, integer

ENGINES = ("local", "ray")


@dataclass(frozen=True)
class ServeLimits:
    """What a server's scheduler holds to (the defaults conf/task/serve.yaml repeats for Hydra;
    tests/test_config_keys.py holds the two equal)."""

    max_running: int = 16  # sequences in the running batch
    max_waiting: int = 64  # requests queued beyond it; more are refused (Overloaded)
    memory_gb: float = 4.0  # K/V caches and recurrent states of the running sequences, reserved at admission
    cache_gb: float = 1.0  # the prefix cache's snapshots (LRU)
    prefill_chunk: int = 256  # prompt rows a sequence runs per step (long prompts do not stall the batch)


LIMIT_KEYS = tuple(f.name for f in fields(ServeLimits))


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: a free port (the printed address says which)
    api_key: str | None = None  # a bearer token the /v1 routes require
    engine: str = "local"  # local (this process) | ray (Ray Serve replicas)
    replicas: int = 1  # engine=ray: how many (one runtime and scheduler each)
    ray_address: str | None = None  # engine=ray: an existing cluster's address; None: a local one
    limits: ServeLimits = field(default_factory=ServeLimits)
    model_name: str | None = None  # None: the install's directory name
    chat_template: str | None = None  # a .jinja file over the install's template
    image_dirs: tuple[str, ...] = ()  # the directories file:// image URLs may name (turbo/serve/images.py)
    remote_images: bool = False  # fetch http(s) image URLs (else a 400 naming this option)


def serve_config(cfg: DictConfig) -> ServeConfig:
    node = cfg.get("serve")
    if not isinstance(node, DictConfig):
        raise TurboError("config: serve is missing (task=serve composes conf/task/serve.yaml)")
    s = {str(k): v for k, v in node.items()}
    for name in ("port", "replicas", "max_running", "max_waiting", "prefill_chunk"):
        lo = 0 if name in ("port", "max_waiting") else 1
        n = integer(s.get(name))
        if n is None or n < lo or (name == "port" and n > 65535):
            raise TurboError(f"config: serve.{name}={s.get(name)!r}, expected an integer >= {lo}"
                             + (" and <= 65535" if name == "port" else ""))
    for name in ("memory_gb", "cache_gb"):
        v = s.get(name)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < float("inf"):
            raise TurboError(f"config: serve.{name}={v!r}, expected a number of GB >= 0")
    if s.get("engine") not in ENGINES:
        raise TurboError(f"config: serve.engine={s.get('engine')!r} is not one of {', '.join(ENGINES)}")
    if not isinstance(s.get("host"), str) or not s["host"]:
        raise TurboError(f"config: serve.host={s.get('host')!r}, expected an address to listen on")
    text = {k: str(s[k]) if s.get(k) is not None else None
            for k in ("api_key", "ray_address", "model_name", "chat_template")}
    if not isinstance(s.get("remote_images", False), bool):
        raise TurboError(f"config: serve.remote_images={s.get('remote_images')!r}, expected true or false")
    return ServeConfig(host=s["host"], port=int(s["port"]), engine=s["engine"], replicas=int(s["replicas"]),
                       limits=ServeLimits(**{k: s[k] for k in LIMIT_KEYS}), image_dirs=image_dirs(s.get("image_dirs")),
                       remote_images=s.get("remote_images", False), **text)


def image_dirs(value) -> tuple[str, ...]:
    """serve.image_dirs: existing directories, as their real paths."""
    dirs = [value] if isinstance(value, str) else list(value) if isinstance(value, ListConfig) else None
    if dirs is None or not all(isinstance(d, str) and d for d in dirs):
        raise TurboError(f"config: serve.image_dirs={value!r}, expected a list of directories ([] : none)")
    bad = next((d for d in dirs if not os.path.isdir(os.path.expanduser(d))), None)
    if bad is not None:
        raise TurboError(f"config: serve.image_dirs: {bad} is not a directory")
    return tuple(os.path.realpath(os.path.expanduser(d)) for d in dirs)


def server_defaults(g: GenerationOptions) -> GenerationOptions:
    """The speculation a request gets unless its `turbo` object says otherwise: the config's
    policy, block, drafter, window, rollback and n-gram matching; sampling, stops and lengths are
    each request's (OpenAI's defaults)."""
    return GenerationOptions(policy=g.policy, block=g.block, drafter=g.drafter, window=g.window,
                             rollback=g.rollback, ngram=g.ngram, temperature=1.0)
