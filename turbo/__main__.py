"""python -m turbo [Hydra overrides]: task=generate streams text and a stats line;
task=probe measures acceptance per block (turbo.probe)."""

from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def run(cfg: DictConfig) -> int:
    import torch

    from .config import run_config
    from .engine import open as open_runtime

    rc = run_config(cfg)
    if rc.threads:
        torch.set_num_threads(rc.threads)
    if rc.task == "probe":
        from .probe import run_probe
        return run_probe(cfg, rc)
    rt = open_runtime(rc.install, rc.backend, rc.dtype, rc.draft_products)
    events = rt.stream(rc.prompt, max_new_tokens=rc.max_new_tokens, policy=rc.policy, block=rc.block,
                       rollback=rc.rollback, drafter=rc.drafter, window=rc.window)
    if rt.backend.note:  # only once the request is known to be valid: a refusal stays one line
        print(rt.backend.note, file=sys.stderr)
    stats = None
    sys.stdout.write(rc.prompt)
    for i, event in enumerate(events):
        if i == 0 and event.stats.speculation_off_reason and rc.policy != "off":
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


if __name__ == "__main__":
    problem = override_error(sys.argv[1:])
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    main()
