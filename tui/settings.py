"""What the TUI needs from the Hydra config (the same conf/ and overrides as `python -m turbo`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

# The draft modes ctrl+n cycles through, between generations: (policy, block).
MODES: tuple[tuple[str, int | None], ...] = (("off", None), ("auto", None)) + tuple(("fixed", b) for b in range(1, 9))
ROLLBACKS = ("checkpoint", "replay")


def mode_label(policy: str, block: int | None) -> str:
    if policy == "fixed":
        return f"fixed {block}"
    return policy if block is None else f"{policy} {block}"


def next_mode(policy: str, block: int | None) -> tuple[str, int | None]:
    """The mode after (policy, block) in MODES; a mode outside the cycle goes to its start."""
    try:
        i = MODES.index((policy, block))
    except ValueError:
        return MODES[0]
    return MODES[(i + 1) % len(MODES)]


@dataclass
class Settings:
    install: str = "tiny"
    backend: str = "auto"
    dtype: str = "float32"
    threads: int | None = None
    policy: str = "auto"
    block: int | None = None
    window: int | None = None
    rollback: str = "checkpoint"
    drafter: str = "auto"
    prompt: str = ""
    max_new_tokens: int = 256
    workload: str = ""
    # (workload name, prompt): the composed workload's prompts first, then the other workloads'.
    presets: list[tuple[str, str]] = field(default_factory=list)

    def stream_kwargs(self) -> dict:
        """The keyword arguments of Runtime.stream / generate for the current settings."""
        return dict(max_new_tokens=self.max_new_tokens, policy=self.policy, block=self.block,
                    rollback=self.rollback, drafter=self.drafter, window=self.window)

    def with_(self, **kw) -> "Settings":
        return replace(self, **kw)


def conf_dir() -> str:
    from turbo.__main__ import CONF_DIR

    return CONF_DIR


def other_workload_prompts(current: str) -> list[tuple[str, str]]:
    """Prompts of the workloads in conf/workload/ other than `current`, in name order."""
    from omegaconf import OmegaConf

    out = []
    for path in sorted(Path(conf_dir(), "workload").glob("*.yaml")):
        try:
            w = OmegaConf.load(path)
            name = str(w.get("name", path.stem))
            if name == current:
                continue
            out += [(name, str(p)) for p in (w.get("prompts") or [])]
        except Exception:  # a broken workload file only costs its presets
            continue
    return out


def settings_from_config(cfg) -> Settings:
    """A composed DictConfig -> Settings, through turbo.config.run_config (raises TurboError)."""
    from turbo.config import run_config

    rc = run_config(cfg)
    presets = [(rc.workload, p) for p in rc.prompts] + other_workload_prompts(rc.workload)
    return Settings(install=rc.install, backend=rc.backend, dtype=rc.dtype, threads=rc.threads, policy=rc.policy,
                    block=rc.block, window=rc.window, rollback=rc.rollback, drafter=rc.drafter, prompt=rc.prompt,
                    max_new_tokens=rc.max_new_tokens, workload=rc.workload, presets=presets)


def compose_settings(overrides: list[str]) -> Settings:
    """Compose conf/config.yaml with Hydra overrides exactly as `python -m turbo` does."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(version_base=None, config_dir=conf_dir(), job_name="tui"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return settings_from_config(cfg)
