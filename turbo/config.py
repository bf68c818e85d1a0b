"""The run configuration as Hydra composes it (conf/), read into the two option sets."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from .errors import TurboError
from .options import GenerationOptions, OpenOptions


@dataclass(frozen=True)
class RunConfig:
    install: str
    opening: OpenOptions  # environment resolved (OpenOptions.from_env)
    generation: GenerationOptions
    prompt: str
    workload: str
    prompts: tuple[str, ...]
    task: str


def _opt_int(cfg: DictConfig, key: str) -> int | None:
    v = cfg.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise TurboError(f"config: {key}={v!r}, expected an integer or null")
    return v


def _opt_float(cfg: DictConfig, key: str, default: float) -> float:
    v = cfg.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TurboError(f"config: {key}={v!r}, expected a number")
    return float(v)


def run_config(cfg: DictConfig) -> RunConfig:
    try:
        install = cfg.install.path
        workload = cfg.workload
        prompts = tuple(str(p) for p in workload.prompts)
        task = cfg.task.name
    except Exception as e:  # omegaconf raises several kinds for absent keys
        raise TurboError(f"config: {e}".splitlines()[0]) from None
    if not prompts and cfg.get("prompt") is None:
        raise TurboError(f"config: workload {workload.get('name')!r} has no prompts and no prompt= was given")
    policy = cfg.get("policy")
    name = policy.get("name") if isinstance(policy, DictConfig) else policy
    max_new = _opt_int(cfg, "max_new_tokens")
    opening = OpenOptions.from_env(backend=str(cfg.get("backend", "auto")), dtype=str(cfg.get("dtype", "float32")),
                                   draft_products=str(cfg.get("draft_products", "auto")),
                                   threads=_opt_int(cfg, "threads"))
    generation = GenerationOptions(
        max_new_tokens=max_new if max_new is not None else int(workload.max_new_tokens), policy=str(name),
        block=_opt_int(cfg, "block"), rollback=str(cfg.get("rollback")), drafter=str(cfg.get("drafter")),
        window=_opt_int(cfg, "window"), temperature=_opt_float(cfg, "temperature", 0.0), top_k=_opt_int(cfg, "top_k"),
        top_p=_opt_float(cfg, "top_p", 1.0), min_p=_opt_float(cfg, "min_p", 0.0), seed=_opt_int(cfg, "seed"))
    return RunConfig(install=str(install), opening=opening, generation=generation,
                     prompt=str(cfg.prompt) if cfg.get("prompt") is not None else prompts[0],
                     workload=str(workload.get("name", "")), prompts=prompts, task=str(task))
