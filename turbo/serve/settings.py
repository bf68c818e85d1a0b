"""task=serve's settings: the `serve.*` keys (conf/task/serve.yaml) read into a `ServeConfig`,
which checks its fields itself (as the option types do, turbo/sequence/options.py), and the
generation defaults a server takes from the top-level keys (policy, block, drafter...)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from omegaconf import DictConfig, ListConfig

from ..errors import TurboError
from ..sequence.options import GenerationOptions, integer
from .limits import MIB

ENGINES = ("local", "ray")
FRONTS = ("process", "inline")  # engine=local: the HTTP side in a process of its own (front.py), or the engine's


def _count(name: str, value: object, lo: int, hi: int | None = None, span: str | None = None) -> int:
    """serve.NAME as an int in lo..hi (hi None: no upper bound), else TurboError in one line
    saying `span` (by default: >= lo, and <= hi)."""
    n = integer(value)
    if n is None or n < lo or (hi is not None and n > hi):
        span = span or f">= {lo}" + (f" and <= {hi}" if hi is not None else "")
        raise TurboError(f"config: serve.{name}={value!r}, expected an integer {span}")
    return n


def _size(name: str, value: object) -> None:
    """serve.NAME, a size in SIZES' unit: a number >= 0 that the server's byte count keeps above
    its least (a value that rounds to too few bytes is refused, not served with a limit that
    refuses everything)."""
    unit, size, least, why = SIZES[name]
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < float("inf"):
        raise TurboError(f"config: serve.{name}={value!r}, expected a number of {unit} >= 0")
    if int(value * size) < least and not (name == "cache_gb" and value == 0):
        raise TurboError(f"config: serve.{name}={value!r}, expected a number of {unit} > 0 ({value!r} {unit} is "
                         f"{int(value * size)} bytes{why})")


def _one_of(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise TurboError(f"config: serve.{name}={value!r} is not one of {', '.join(choices)}")


@dataclass(frozen=True)
class ServeLimits:
    """What a server's scheduler holds to (the defaults conf/task/serve.yaml repeats for Hydra;
    tests/test_config_keys.py holds the two equal). Each field checked as it is set."""

    max_running: int = 16  # sequences in the running batch
    max_waiting: int = 64  # requests queued beyond it; more are refused (Overloaded)
    memory_gb: float = 4.0  # K/V caches and recurrent states of the running sequences, reserved at admission
    cache_gb: float = 1.0  # the prefix cache's snapshots (LRU)
    prefill_chunk: int = 256  # prompt rows a sequence runs per step (long prompts do not stall the batch)
    snapshot_every: int = 1024  # the prefix cache keeps a long prompt's state every this many rows (0: never)

    def __post_init__(self) -> None:
        for name, lo in (("max_running", 1), ("max_waiting", 0), ("prefill_chunk", 1), ("snapshot_every", 0)):
            object.__setattr__(self, name, _count(name, getattr(self, name), lo))
        for name in ("memory_gb", "cache_gb"):
            _size(name, getattr(self, name))


LIMIT_KEYS = tuple(f.name for f in fields(ServeLimits))
# the sizes, as the server counts them (app.body_limit, Scheduler): a value that rounds to too few
# bytes is refused at startup, not served with a limit that refuses everything.
# name: (its unit, bytes in it, the fewest bytes, why); cache_gb=0 is no prefix cache
SIZES = {"memory_gb": ("GB", 2**30, 1, ", and every request's state needs some"),
         "cache_gb": ("GB", 2**30, 1, "; 0 turns the prefix cache off"),
         "max_body_mb": ("MB", MIB, 1024, ", under the 1 KiB a request's body needs"),
         "state_gb": ("GB", 2**30, 1, ", and a state file needs some")}


@dataclass(frozen=True)
class ServeConfig:
    """task=serve's settings, each field checked as it is set (`serve_config` reads them from the
    config; the API key's file and environment are read there)."""

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
    state_dir: str | None = None  # the prefix cache's states also kept here, loaded at start (None: off)
    state_gb: float = 4.0  # state_dir's bound on disk (the oldest files by mtime go first)

    def __post_init__(self) -> None:
        object.__setattr__(self, "port", _count("port", self.port, 0, 65535))
        object.__setattr__(self, "replicas", _count("replicas", self.replicas, 1))
        _size("max_body_mb", self.max_body_mb)
        object.__setattr__(self, "max_body_mb", float(self.max_body_mb))
        object.__setattr__(self, "http_nice", _count("http_nice", self.http_nice, 0, 19, "in 0..19"))
        _one_of("engine", self.engine, ENGINES)
        _one_of("front", self.front, FRONTS)
        if not isinstance(self.host, str) or not self.host:
            raise TurboError(f"config: serve.host={self.host!r}, expected an address to listen on")
        if not isinstance(self.remote_images, bool):
            raise TurboError(f"config: serve.remote_images={self.remote_images!r}, expected true or false")
        if not isinstance(self.limits, ServeLimits):
            raise TurboError(f"config: serve limits {self.limits!r}, expected a ServeLimits")
        object.__setattr__(self, "image_dirs", image_dirs(self.image_dirs))
        _size("state_gb", self.state_gb)
        if self.state_dir is not None and (not isinstance(self.state_dir, str) or not self.state_dir
                                           or os.path.exists(self.state_dir) and not os.path.isdir(self.state_dir)):
            raise TurboError(f"config: serve.state_dir={self.state_dir!r}, expected a directory (made if missing) "
                             "or null")


def serve_config(cfg: DictConfig) -> ServeConfig:
    """The `serve.*` keys as a ServeConfig (which checks them); the API key read from its file or
    the environment where the config names none."""
    node = cfg.get("serve")
    if not isinstance(node, DictConfig):
        raise TurboError("config: serve is missing (task=serve composes conf/task/serve.yaml)")
    s = {str(k): v for k, v in node.items()}
    limits = ServeLimits(**{k: s.get(k) for k in LIMIT_KEYS})
    text = {k: str(s[k]) if s.get(k) is not None else None
            for k in ("ray_address", "model_name", "chat_template", "api_key_file", "state_dir")}
    text["api_key"] = api_key(s.get("api_key"), text["api_key_file"])
    return ServeConfig(host=s.get("host"), port=s.get("port"), engine=s.get("engine"), replicas=s.get("replicas"),
                       limits=limits, image_dirs=s.get("image_dirs"), remote_images=s.get("remote_images", False),
                       max_body_mb=s.get("max_body_mb"), http_nice=s.get("http_nice", 0),
                       front=s.get("front", "process"), state_gb=s.get("state_gb", 4.0), **text)


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


def image_dirs(value: object) -> tuple[str, ...]:
    """serve.image_dirs: existing directories, as their real paths (one directory, or a list of them)."""
    dirs = [value] if isinstance(value, str) else list(value) if isinstance(value, (ListConfig, list, tuple)) else None
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
