"""task=serve's settings: the `serve.*` keys (conf/task/serve.yaml) checked into a `ServeConfig`,
and the generation defaults a server takes from the top-level keys (policy, block, drafter...)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from omegaconf import DictConfig, ListConfig

from ..errors import TurboError
from ..sequence.options import GenerationOptions, integer
from .limits import MIB

ENGINES = ("local", "ray")
FRONTS = ("process", "inline")  # engine=local: the HTTP side in a process of its own (front.py), or the engine's


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
# the sizes, as the server counts them (app.body_limit, Scheduler): a value that rounds to too few
# bytes is refused at startup, not served with a limit that refuses everything.
# name: (its unit, bytes in it, the fewest bytes, why); cache_gb=0 is no prefix cache
SIZES = {"memory_gb": ("GB", 2**30, 1, ", and every request's state needs some"),
         "cache_gb": ("GB", 2**30, 1, "; 0 turns the prefix cache off"),
         "max_body_mb": ("MB", MIB, 1024, ", under the 1 KiB a request's body needs")}


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: a free port (the printed address says which)
    api_key: str | None = None  # a bearer token the /v1 routes require
    api_key_file: str | None = None  # a file holding it (not in the process list, as api_key= is)
    engine: str = "local"  # local (this process) | ray (Ray Serve replicas)
    front: str = "process"  # engine=local: process (the HTTP side apart: turbo/serve/front.py) | inline
    replicas: int = 1  # engine=ray: how many (one runtime and scheduler each)
    ray_address: str | None = None  # engine=ray: an existing cluster's address; None: a local one
    limits: ServeLimits = field(default_factory=ServeLimits)
    model_name: str | None = None  # None: the install's directory name
    chat_template: str | None = None  # a .jinja file over the install's template
    image_dirs: tuple[str, ...] = ()  # the directories file:// image URLs may name (turbo/serve/images.py)
    remote_images: bool = False  # fetch http(s) image URLs (else a 400 naming this option)
    max_body_mb: float = 32.0  # a request body over it is answered 413 (a data: image of ~24 MiB fits)
    http_nice: int = 0  # Linux: the HTTP side's threads this much nicer than the engine's step thread


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
    for name, (unit, size, least, why) in SIZES.items():
        v = s.get(name)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < float("inf"):
            raise TurboError(f"config: serve.{name}={v!r}, expected a number of {unit} >= 0")
        if int(v * size) < least and not (name == "cache_gb" and v == 0):
            raise TurboError(f"config: serve.{name}={v!r}, expected a number of {unit} > 0 ({v!r} {unit} is "
                             f"{int(v * size)} bytes{why})")
    nice = integer(s.get("http_nice", 0))
    if nice is None or not 0 <= nice <= 19:
        raise TurboError(f"config: serve.http_nice={s.get('http_nice')!r}, expected an integer in 0..19")
    if s.get("engine") not in ENGINES:
        raise TurboError(f"config: serve.engine={s.get('engine')!r} is not one of {', '.join(ENGINES)}")
    if s.get("front", "process") not in FRONTS:
        raise TurboError(f"config: serve.front={s.get('front')!r} is not one of {', '.join(FRONTS)}")
    if not isinstance(s.get("host"), str) or not s["host"]:
        raise TurboError(f"config: serve.host={s.get('host')!r}, expected an address to listen on")
    text = {k: str(s[k]) if s.get(k) is not None else None
            for k in ("ray_address", "model_name", "chat_template", "api_key_file")}
    text["api_key"] = api_key(s.get("api_key"), text["api_key_file"])
    if not isinstance(s.get("remote_images", False), bool):
        raise TurboError(f"config: serve.remote_images={s.get('remote_images')!r}, expected true or false")
    return ServeConfig(host=s["host"], port=int(s["port"]), engine=s["engine"], replicas=int(s["replicas"]),
                       limits=ServeLimits(**{k: s[k] for k in LIMIT_KEYS}), image_dirs=image_dirs(s.get("image_dirs")),
                       remote_images=s.get("remote_images", False), max_body_mb=float(s["max_body_mb"]),
                       http_nice=nice, front=s.get("front", "process"), **text)


API_KEY_ENV = "TURBO_API_KEY"


def api_key(given, file: str | None) -> str | None:
    """The bearer token: serve.api_key, or the first line of serve.api_key_file, or the
    TURBO_API_KEY environment variable (the last two keep it out of the process list, where every
    local user reads a command line); two of the first are refused, an empty key too."""
    if given is not None and file is not None:
        raise TurboError("config: serve.api_key and serve.api_key_file are both set, expected one of them")
    if file is not None:
        path = os.path.expanduser(file)
        try:
            with open(path, "rb") as f:
                raw = f.read(4097)
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TurboError(f"config: serve.api_key_file={file}: not readable UTF-8 text "
                             f"({getattr(e, 'strerror', None) or e})") from None
        lines = text.splitlines()
        key, where = (lines[0].strip() if lines else ""), f"serve.api_key_file={file}"
        if len(raw) > 4096:
            raise TurboError(f"config: {where}: over 4096 bytes, expected one line holding the key")
    elif given is not None:
        key, where = str(given), "serve.api_key"
    elif os.environ.get(API_KEY_ENV) is not None:
        key, where = os.environ[API_KEY_ENV].strip(), API_KEY_ENV
    else:
        return None
    if not key or any(c.isspace() or not c.isprintable() for c in key):
        raise TurboError(f"config: {where}: the key is empty or holds spaces or control characters, expected "
                         "one printable word")
    return key


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
