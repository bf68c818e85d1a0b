"""python -m turbo [Hydra overrides]: task=generate streams text and a stats line;
task=probe measures acceptance per block (turbo.probe)."""

from __future__ import annotations

import gc
import importlib.util
import os
import sys

import hydra
from omegaconf import DictConfig

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
# hydra/launcher=NAME -> the Hydra plugin that runs it (conf/hydra/launcher: local is joblib, slurm submitit)
LAUNCHER_PLUGINS = {"joblib": "hydra_joblib_launcher", "local": "hydra_joblib_launcher",
                    "submitit_local": "hydra_submitit_launcher", "submitit_slurm": "hydra_submitit_launcher",
                    "slurm": "hydra_submitit_launcher"}


def run(cfg: DictConfig) -> int:
    import torch

    from .config import run_config
    from .engine import open as open_runtime

    rc = run_config(cfg)
    if rc.opening.threads:
        torch.set_num_threads(rc.opening.threads)
    rt = open_runtime(rc.install, rc.opening)
    # A full collection walks every tracked object -- ~180k once torch is imported, ~100 ms
    # here -- and would land in the middle of some decode step. What exists once the runtime
    # is open (modules, the model) lives as long as the process: moved out of reach.
    gc.freeze()
    if rc.task == "probe":
        from .probe import run_probe
        return run_probe(cfg, rc, runtime=rt)
    events = rt.stream(rc.prompt, rc.generation)
    if rt.backend.note:  # only once the request is known to be valid: a refusal stays one line
        print(rt.backend.note, file=sys.stderr)
    stats = None
    sys.stdout.write(rc.prompt)
    for i, event in enumerate(events):
        if i == 0 and event.stats.speculation_off_reason and rc.generation.policy != "off":
            print(f"\n[turbo] speculation off: {event.stats.speculation_off_reason}", file=sys.stderr)
        sys.stdout.write(event.text)
        sys.stdout.flush()
        stats = event.stats
    print()
    print(stats.line())
    return 0


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    from .errors import TurboError

    try:
        code = run(cfg)
    except TurboError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if code:
        sys.exit(code)


def override_error(argv: list[str]) -> str | None:
    """Compose the config once up front, so a bad override (an unknown key or group option)
    is one line and exit 2 here rather than Hydra's multi-line report. Sweeps (-m) and
    hydra.* settings are left to Hydra."""
    if any(a in ("-m", "--multirun") for a in argv):
        return None
    overrides = [a for a in argv if not a.startswith("-") and not a.startswith(("hydra.", "hydra/"))]
    from hydra import compose, initialize_config_dir

    try:
        with initialize_config_dir(version_base=None, config_dir=CONF_DIR, job_name="turbo"):
            compose(config_name="config", overrides=overrides)
    except Exception as e:  # Hydra raises several kinds; all mean "this override cannot compose"
        return " ".join(str(e).split("Config search path")[0].split())
    return None


def launcher_missing(argv: list[str]) -> str | None:
    """The sweep launcher an override selects, when its Hydra plugin is not installed (one line
    naming the extra, where Hydra would report a missing config group)."""
    from .extras import missing

    for a in argv:
        name, _, value = a.lstrip("+").partition("=")
        plugin = LAUNCHER_PLUGINS.get(value) if name == "hydra/launcher" else None
        if plugin is not None and not _installed(f"hydra_plugins.{plugin}"):
            return missing("sweeps", plugin.replace("_", "-"))
    return None


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # not even the parent package (no Hydra plugin at all)
        return False


if __name__ == "__main__":
    problem = launcher_missing(sys.argv[1:]) or override_error(sys.argv[1:])
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    main()
