"""What the TUI needs from the Hydra config (the same conf/ and overrides as `python -m turbo`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from turbo.config import run_config
from turbo.sequence.options import GENERATION_FIELDS, OPEN_FIELDS, GenerationOptions, OpenOptions
from turbo.shipped import CONF_DIR

# The draft modes ctrl+n cycles through, between generations: (policy, block).
MODES: tuple[tuple[str, int | None], ...] = (("off", None), ("auto", None)) + tuple(("fixed", b) for b in range(1, 9))
TEMPERATURES = (0.0, 0.7, 1.0)  # what ctrl+t cycles through (0: greedy)


def next_temperature(t: float) -> float:
    """The temperature after t in TEMPERATURES; one outside the cycle goes to its start."""
    return TEMPERATURES[(TEMPERATURES.index(t) + 1) % len(TEMPERATURES)] if t in TEMPERATURES else TEMPERATURES[0]


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


@dataclass(frozen=True)
class Settings:
    """The TUI's session: how the runtime opens and how the next generation runs (the options
    `python -m turbo` builds from the same config), and what the prompt box starts with."""

    install: str = "tiny"
    opening: OpenOptions = field(default_factory=OpenOptions.from_env)
    generation: GenerationOptions = field(default_factory=GenerationOptions)
    prompt: str = ""
    workload: str = ""
    # (workload name, prompt): the composed workload's prompts first, then the other workloads'.
    presets: list[tuple[str, str]] = field(default_factory=list)
    # chat (tui/chat.py): a template file over the install's own, the system prompt it starts
    # with, and enable_thinking for the template (None: the template's default)
    chat_template: str | None = None
    system: str | None = None
    think: bool | None = None

    # what the keys cycle (ctrl+n, ctrl+r), read where the app shows them
    @property
    def policy(self) -> str | None:
        return self.generation.policy

    @property
    def block(self) -> int | None:
        return self.generation.block

    @property
    def rollback(self) -> str:
        return self.generation.rollback

    def with_(self, **kw) -> "Settings":
        """A copy with some fields changed: the Settings' own, or any of the two option sets'."""
        gen = {k: kw.pop(k) for k in GENERATION_FIELDS if k in kw}
        opening = {k: kw.pop(k) for k in OPEN_FIELDS if k in kw}
        return replace(self, generation=self.generation.but(**gen), opening=self.opening.but(**opening), **kw)


def conf_dir() -> str:
    return str(CONF_DIR)


def other_workload_prompts(current: str) -> list[tuple[str, str]]:
    """Prompts of the workloads in conf/workload/ other than `current`, in name order."""
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
    rc = run_config(cfg)
    presets = [(rc.workload, p) for p in rc.prompts] + other_workload_prompts(rc.workload)
    # the chat keys are read where the config has them (`python -m turbo task=chat` defines them)
    template, system, think = cfg.get("chat_template"), cfg.get("system"), cfg.get("think")
    return Settings(install=rc.install, opening=rc.opening, generation=rc.generation, prompt=rc.prompt,
                    workload=rc.workload, presets=presets,
                    chat_template=str(template) if template is not None else None,
                    system=str(system) if system is not None else None,
                    think=None if think is None else str(think).lower() in ("true", "on", "1", "yes"))


def compose_settings(overrides: list[str]) -> Settings:
    """Compose conf/config.yaml with Hydra overrides exactly as `python -m turbo` does."""
    with initialize_config_dir(version_base=None, config_dir=conf_dir(), job_name="tui"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return settings_from_config(cfg)
