"""python -m turbo [Hydra overrides]: task=generate streams the continuation (standard output)
and a stats line (standard error); with n=K (2..16) it writes K choices of the prompt, each under
a `[choice i]` line; task=chat reads a conversation from standard input (turbo.chat_cli); task=serve is the
OpenAI-compatible server (turbo.serve.main); task=probe measures
acceptance per block (turbo.probe). --help is turbo's page (conf/hydra/help/turbo.yaml),
--hydra-help Hydra's.

A user's error (TurboError, an OS error, a bad override) ends it in one stderr line, exit 2;
Ctrl-C in `interrupted`, exit 130. task=generate, task=chat and task=serve run outside @hydra.main:
they write nothing, so it needs no Hydra output directory (a read-only working directory is fine).
"""

from __future__ import annotations

import os
import signal
import sys


SERVE_SPINCOUNT = 10_000  # libgomp's spin rounds before a waiting worker sleeps, for task=serve (below)


def _interrupted_early(signum, frame) -> None:
    print("interrupted", file=sys.stderr)
    os._exit(130)


if __name__ == "__main__":  # a Ctrl-C while the imports below run (a second or so) is one line too
    signal.signal(signal.SIGINT, _interrupted_early)
    # A server's OpenMP workers spin only while a step runs: between two engine steps (the
    # scheduler's Python, milliseconds) a worker spinning libgomp's default ~10 ms holds a core that
    # the front process and the clients need (measured: 3.0 s of 6 s spun; the engine's p99 under a
    # flood 2.8x), while one asleep at once (OMP_WAIT_POLICY=PASSIVE) is woken by the kernel at
    # each of a step's ~150 parallel regions (a served token 45% slower on an EPYC Zen 4). A spin
    # of SERVE_SPINCOUNT rounds outlasts the gaps inside a step and ends soon after it (docs/
    # serving.md, "The OpenMP workers"). Read by libgomp when torch loads it, below: so here, before
    # the imports. The environment's OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
    if "task=serve" in sys.argv[1:] and "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", str(SERVE_SPINCOUNT))

import gc  # noqa: E402
import importlib.util  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

import hydra  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from . import shipped  # noqa: E402
from .config import run_config, unknown_key  # noqa: E402
from .errors import TurboError, checked_text  # noqa: E402
from .extras import missing  # noqa: E402

CONF_DIR = str(shipped.CONF_DIR)
# hydra/launcher=NAME -> the Hydra plugin that runs it (conf/hydra/launcher: local is joblib, slurm submitit)
LAUNCHER_PLUGINS = {"joblib": "hydra_joblib_launcher", "local": "hydra_joblib_launcher",
                    "submitit_local": "hydra_submitit_launcher", "submitit_slurm": "hydra_submitit_launcher",
                    "slurm": "hydra_submitit_launcher"}


def config_keys_help() -> str:
    """conf/config.yaml's keys as that file writes them (key: default  # meaning), for the --help
    page (conf/hydra/help/turbo.yaml): every key it has, the defaults list and blank lines left out."""
    lines, keep = [], False
    for line in Path(CONF_DIR, "config.yaml").read_text().splitlines():
        if line[:1].strip() and not line.startswith("#"):  # a top-level key
            keep = not line.startswith(("defaults:", "hydra:"))
        if keep and line.strip():
            lines.append(line)
    return "\n".join(lines).replace("$", "$$")  # the page is a string.Template: $$ is a dollar sign


# replace: both __main__ and turbo.__main__ may be imported (python -m turbo, a test)
OmegaConf.register_new_resolver("turbo_config_keys", config_keys_help, replace=True)


def run(cfg: DictConfig) -> int:
    rc = run_config(cfg)
    # torch and the engine load only once the command line is known good: a refusal stays quick
    from .engine import open as open_runtime

    if rc.task == "serve":  # its runtimes open where they serve (this process, or each Ray replica)
        from .serve.main import run_serve
        return run_serve(cfg, rc)
    rt = open_runtime(rc.install, rc.opening)
    # A full collection walks every tracked object -- ~180k once torch is imported, ~100 ms
    # here -- and would land in the middle of some decode step. What exists once the runtime
    # is open (modules, the model) lives as long as the process: moved out of reach.
    gc.freeze()
    if rc.task == "probe":
        from .probe import run_probe  # (as the engine above)
        return run_probe(cfg, rc, runtime=rt)
    if rc.task == "chat":
        from .chat_cli import run_chat_cli  # (as the engine above)
        return run_chat_cli(rc, rt)
    if rc.n > 1:  # n= choices, one prefill: each under a `[choice i]` line, its stats line on stderr
        for i, r in enumerate(rt.choices(rc.prompt, rc.n, rc.generation, images=list(rc.images) or None)):
            sys.stdout.write(f"[choice {i}]\n{r.text}\n")
            sys.stdout.flush()
            print(f"[choice {i}] {r.stats.line()}", file=sys.stderr, flush=True)
        return 0
    events = rt.stream(rc.prompt, rc.generation, images=list(rc.images) or None)  # (turbo/vision)
    if rt.backend.note and rc.opening.verbose:  # once the request is known valid: a refusal stays one line
        print(rt.backend.note, file=sys.stderr)
    stats = None
    # Standard output carries the continuation alone (`prompt=- < in.txt > out.txt` holds just
    # it, as llama.cpp's tools and `ollama run` keep theirs); every report goes to stderr.
    try:
        for i, event in enumerate(events):
            if i == 0 and event.stats.speculation_off_reason and rc.generation.policy != "off":
                print(f"[turbo] speculation off: {event.stats.speculation_off_reason}", file=sys.stderr)
            stats = event.stats  # (first: a Ctrl-C once any text is out still prints its stats line)
            sys.stdout.write(event.text)
            sys.stdout.flush()
    finally:  # Ctrl-C too: the stats of what was generated
        if sys.stdout.isatty():  # on a terminal the stats line starts a line of its own; a file gets no newline
            print(flush=True)
        if stats is not None:
            print(stats.line(), file=sys.stderr, flush=True)
    return 0


def guarded(task: Callable[[], int]) -> int:
    """task()'s exit status, a user's error as one line and 2, Ctrl-C as `interrupted` and 130."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # from here on Ctrl-C is caught below
    try:
        return task()
    except (TurboError, OSError) as e:  # OSError: a path the user gave or the working directory
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    code = guarded(lambda: run(cfg))
    if code:
        sys.exit(code)


def cli(argv: list[str]) -> int:
    """Refuse a bad override in one line before Hydra (whose report is many), then run: generate
    and chat from the config composed here, probe and sweeps (-m) and Hydra's flags under @hydra.main."""
    overrides = [a for a in argv if not a.startswith("-")]
    try:  # Hydra's lexer would refuse a byte that is not UTF-8 in words of its own
        for a in argv:
            key, eq, value = a.partition("=")
            checked_text(value if eq else a, key)
    except TurboError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    argv, problem = hydra_argv(argv)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    overrides = [a for a in argv if not a.startswith("-")]
    problem = launcher_missing(argv) or unknown_key(CONF_DIR, overrides)
    if problem is None and not any(a.startswith("-") for a in argv):
        cfg, problem = composed([a for a in overrides if not a.startswith(("hydra.", "hydra/"))])
        if cfg is not None and cfg.task.get("name") in ("generate", "chat", "serve"):
            return guarded(lambda: run(cfg))
        problem = problem or output_dir_problem(overrides)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    sys.argv[1:] = argv  # (@hydra.main reads sys.argv)
    main()
    return 0


class _Refused(Exception):
    pass


def hydra_argv(argv: list[str]) -> tuple[list[str], str | None]:
    """argv as Hydra's parser takes it -- its flags (with their values) first, the overrides after
    them -- or why it cannot be (one line). Hydra's argparse reads the overrides as one positional
    run: `task=probe -m block=1,2` left `block=1,2` as an unrecognized argument (a usage page)."""
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()

    def refuse(message: str):
        raise _Refused(message)

    parser.error = refuse  # type: ignore[method-assign]
    try:
        args, unknown = parser.parse_known_intermixed_args(argv)
    except _Refused as e:
        return argv, f"{e} (Hydra's flags: see --hydra-help)"
    if unknown:
        return argv, (f"{unknown[0]}: not a flag turbo or Hydra knows (expected KEY=VALUE overrides, -m/--multirun "
                      "for a sweep, --help, or Hydra's flags of --hydra-help)")
    modes = [f for f, on in (("--run", args.run), ("--multirun", args.multirun), ("--cfg", args.cfg),
                             ("--info", args.info), ("--shell-completion", args.shell_completion)) if on]
    if len(modes) > 1:
        return argv, f"{' and '.join(modes)}: expected one of --run, --multirun, --cfg, --info, --shell-completion"
    rest, flags = list(args.overrides), []
    for a in argv:  # the overrides in their order; every other word (a flag, a flag's value) ahead of them
        if rest and a == rest[0]:
            rest.pop(0)
        else:
            flags.append(a)
    return flags + list(args.overrides), None


def composed(overrides: list[str], hydra_node: bool = False) -> tuple[DictConfig | None, str | None]:
    """(the config, None), or (None, why it cannot compose) in one line."""
    try:
        with initialize_config_dir(version_base=None, config_dir=CONF_DIR, job_name="turbo"):
            return compose(config_name="config", overrides=overrides, return_hydra_config=hydra_node), None
    except Exception as e:  # Hydra raises several kinds; all mean "this override cannot compose"
        return None, " ".join(str(e).split("Config search path")[0].split())


def output_dir_problem(overrides: list[str]) -> str | None:
    """Why Hydra could not create the run's output directory (hydra.run.dir): the probe writes
    its metrics there. Checked here, since Hydra reports it as a traceback."""
    cfg, problem = composed(overrides, hydra_node=True)
    if cfg is None:
        return problem
    path = Path(str(cfg.hydra.run.dir)).absolute()
    first = next(p for p in (path, *path.parents) if p.exists())
    if not first.is_dir():
        return f"hydra.run.dir {path}: {first} is not a directory"
    if not os.access(first, os.W_OK):
        return f"hydra.run.dir {path}: {first} is not writable (pass hydra.run.dir=A_WRITABLE_DIR)"
    # access() says yes to root, where /proc or a read-only mount still refuses: the directories
    # made here and removed again (Hydra makes them next, its ${now:...} perhaps a second later)
    made = [p for p in (path, *path.parents) if not p.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"hydra.run.dir {path}: cannot create it ({e.strerror}; pass hydra.run.dir=A_WRITABLE_DIR)"
    finally:
        for p in made:  # deepest first
            try:
                p.rmdir()
            except OSError:
                pass
    return None


def launcher_missing(argv: list[str]) -> str | None:
    """The sweep launcher an override selects, when its Hydra plugin is not installed (one line
    naming the extra, where Hydra would report a missing config group)."""
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
    sys.exit(guarded(lambda: cli(sys.argv[1:])))
