"""Re-measure against llama.cpp in one go: every figure of the README's "Measured" table (and
docs/benchmarks.md's) against llama.cpp, in priority order, within a time budget, into one
output directory (default docs/results/vs-llamacpp-YYYY-MM-DD/, today's date);
scripts/report_vs_llamacpp.py turns that directory into the tables.

    python -m scripts.measure_vs_llamacpp --budget-min 55       # on a quiet machine, nothing else running
    python -m scripts.measure_vs_llamacpp DIR --budget-min 20   # again later: resumes, skips what is done
    python -m scripts.measure_vs_llamacpp build/vs-dry --dry    # every step with the smallest settings, guard off
    python -m scripts.report_vs_llamacpp DIR

Each step is one of the bench scripts (docs/llamacpp.md, "Re-measuring against llama.cpp"): its
stdout (the tables) in DIR/NAME.log, its stderr (progress) in DIR/NAME.err, its JSON output (where
the script writes one) in DIR, and DIR/NAME.meta.json: the command, start and end (UTC), seconds,
exit status, commit and the load average before and after it. A step whose NAME.meta.json says
exit 0 is skipped (resumable); a failed or interrupted one is rerun from scratch. A step whose
estimate (minutes on a quiet machine) does not fit the budget left is skipped and said so; the
next, shorter ones may still run. Before the first step the quiet-machine guard's check
(python -m scripts.benchlib --quiet-check) must say quiet, else nothing runs (--force: run anyway; the
guard still drops disturbed repetitions); then every install is opened once, untimed (PREPARE).
LLAMA_CONVERT_DIR and LLAMA_CPP_LIB_PATH default to the prepared build's (docs/llamacpp.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from scripts.build_llamacpp import DEFAULT_CACHE

ROOT = Path(__file__).resolve().parent.parent
LLAMA = DEFAULT_CACHE / "0.3.36"  # llama-cpp-python's source and builds (scripts/build_llamacpp.py's)
SHAPE = "qwen3.5-0.8b"
MOE = "qwen3.5-35b-a3b-2l"

# (name, estimated minutes at the full settings on a quiet 2-core machine, full args, dry args);
# the first item is a module of scripts/ (run as python -m scripts.NAME), "{dir}" is the output directory. Priority order.
SCALE = ["bench_scale", SHAPE, "--quant", "none", "int8", "int4", "--gguf", "bf16", "q8_0", "q4_0"]
STEPS = [
    ("scale512", 5, SCALE + ["--prompts", "512", "--new", "32", "--reps", "3", "--out", "{dir}/scale512.jsonl"],
     SCALE + ["--prompts", "32", "--new", "4", "--reps", "1", "--out", "{dir}/scale512.jsonl"]),
    # 4096: two repetitions (three took ~12 min), transformers left out (not llama.cpp; the README's
    # transformers prefill 4096 figure stays the old one)
    ("scale4096", 9, SCALE + ["--prompts", "4096", "--new", "32", "--reps", "2", "--timeout", "900",
                              "--only", "turbo", "turbo int8", "turbo int4", "llama.cpp", "llama.cpp q8_0",
                              "llama.cpp q4_0", "--out", "{dir}/scale4096.jsonl"],
     SCALE + ["--prompts", "64", "--new", "4", "--reps", "1", "--only", "turbo", "turbo int8", "turbo int4",
              "llama.cpp", "llama.cpp q8_0", "llama.cpp q4_0", "--out", "{dir}/scale4096.jsonl"]),
    ("serve_bf16", 12, ["bench_serve", "--shape", SHAPE, "--threads", "2", "--concurrency", "1", "4", "8",
                        "--reps", "2", "--requests", "16", "--max-tokens", "32", "--configs", "plain", "--llamacpp",
                       "--out", "{dir}/serve_bf16.json"],
     ["bench_serve", "--shape", SHAPE, "--threads", "2", "--concurrency", "1", "2", "--reps", "1",
      "--requests", "2", "--max-tokens", "4", "--configs", "plain", "--llamacpp", "--out", "{dir}/serve_bf16.json"]),
    ("llamabench_bf16", 9, ["bench_llamabench", "--shape", SHAPE, "--gguf", "bf16", "--reps", "2",
                            "--out", "{dir}/llamabench_bf16.json"],
     ["bench_llamabench", "--shape", SHAPE, "--gguf", "bf16", "--prompts", "32", "--new", "8", "--depths", "32",
      "--reps", "1", "--out", "{dir}/llamabench_bf16.json"]),
    ("llamabench_q4_0", 8, ["bench_llamabench", "--shape", SHAPE, "--gguf", "q4_0", "--reps", "2",
                            "--out", "{dir}/llamabench_q4_0.json"],
     ["bench_llamabench", "--shape", SHAPE, "--gguf", "q4_0", "--prompts", "32", "--new", "8", "--depths", "32",
      "--reps", "1", "--out", "{dir}/llamabench_q4_0.json"]),
    # the README's row: block 8 against plain decode (blocks 1 / 2 / 4 and the verify rows cut)
    ("round", 2, ["bench_round", "--shape", SHAPE, "--format", "bf16", "int4", "--threads", "2", "--reps", "3",
                  "--blocks", "4", "8", "--rows", "9"],
     ["bench_round", "--shape", SHAPE, "--format", "bf16", "int4", "--threads", "2", "--reps", "1",
      "--blocks", "8", "--rows", "9", "--new", "16", "--calls", "1"]),
    ("open_int4", 1, ["bench_open", "--shape", SHAPE, "--quant", "int4", "--gguf", "q4_0", "--reps", "3"],
     ["bench_open", "--shape", SHAPE, "--quant", "int4", "--gguf", "q4_0", "--reps", "1", "--warm", "0"]),
    ("open_bf16", 1, ["bench_open", "--shape", SHAPE, "--gguf", "bf16", "--reps", "3"],
     ["bench_open", "--shape", SHAPE, "--gguf", "bf16", "--reps", "1", "--warm", "0"]),
    ("context", 2, ["bench_scale", SHAPE, "--context", "--threads", "2", "--new", "40", "--prompts", "512", "4096"],
     ["bench_scale", SHAPE, "--context", "--threads", "2", "--new", "4", "--prompts", "32", "64"]),
    ("moe", 3, ["bench_scale", MOE, "--quant", "none", "int4", "--gguf", "bf16", "q4_0", "--prompts", "32",
                "--new", "32", "--reps", "3", "--only", "turbo", "turbo int4", "llama.cpp", "llama.cpp q4_0",
                "--out", "{dir}/moe.jsonl"],
     ["bench_scale", MOE, "--quant", "none", "int4", "--gguf", "bf16", "q4_0", "--prompts", "16", "--new", "4",
      "--reps", "1", "--only", "turbo", "turbo int4", "llama.cpp", "llama.cpp q4_0", "--out", "{dir}/moe.jsonl"]),
    # beside one controlled co-tenant; its undisturbed counterpart is scale512's (same settings)
    ("cotenant", 3, ["bench_scale", SHAPE, "--prompts", "512", "--new", "32", "--reps", "2", "--only", "turbo",
                     "llama.cpp", "--cotenants", "1", "--out", "{dir}/cotenant.jsonl"],
     ["bench_scale", SHAPE, "--prompts", "32", "--new", "4", "--reps", "1", "--only", "turbo", "llama.cpp",
      "--cotenants", "1", "--out", "{dir}/cotenant.jsonl"]),
    # if time is left: the rest of the table
    ("llamabench_q8_0", 8, ["bench_llamabench", "--shape", SHAPE, "--gguf", "q8_0", "--reps", "2",
                            "--out", "{dir}/llamabench_q8_0.json"],
     ["bench_llamabench", "--shape", SHAPE, "--gguf", "q8_0", "--prompts", "32", "--new", "8", "--depths", "32",
      "--reps", "1", "--out", "{dir}/llamabench_q8_0.json"]),
    ("serve_int4", 10, ["bench_serve", "--shape", SHAPE, "--threads", "2", "--concurrency", "1", "4", "8",
                        "--reps", "2", "--requests", "16", "--max-tokens", "32", "--configs", "plain", "--llamacpp",
                       "--quant", "int4", "--gguf", "q4_0", "--out", "{dir}/serve_int4.json"],
     ["bench_serve", "--shape", SHAPE, "--threads", "2", "--concurrency", "1", "2", "--reps", "1",
      "--requests", "2", "--max-tokens", "4", "--configs", "plain", "--llamacpp", "--quant", "int4", "--gguf",
      "q4_0", "--out", "{dir}/serve_int4.json"]),
    ("session", 2, ["bench_session", "--shape", SHAPE, "--turns", "5", "--new", "32", "--reps", "3",
                    "--threads", "2"],
     ["bench_session", "--shape", SHAPE, "--turns", "2", "--new", "4", "--reps", "1", "--threads", "2"]),
    ("session_server", 2, ["bench_session", "--shape", SHAPE, "--turns", "5", "--new", "32", "--reps", "3",
                           "--threads", "2", "--server"],
     ["bench_session", "--shape", SHAPE, "--turns", "2", "--new", "4", "--reps", "1", "--threads", "2",
      "--server"]),
]


# untimed, before every invocation's first step: each install opened once, so that its open layout is
# this turbo's and verified (an open by another turbo version rewrites it, and the next open
# checks the whole file: tens of seconds that would land in a timed repetition's load)
PREPARE = ("import turbo; from turbo.testing import shapes\n"
           f"for s, q in [('{SHAPE}', 'none'), ('{SHAPE}', 'int8'), ('{SHAPE}', 'int4'), ('{MOE}', 'none'), "
           f"('{MOE}', 'int4')]:\n"
           "    turbo.open(str(shapes.build(s, quant=q)), threads=2); print('opened', s, q, flush=True)")


def git(*a: str) -> str:
    return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def quiet(dry: bool) -> bool:
    out = subprocess.run([sys.executable, "-m", "scripts.benchlib", "--quiet-check", "2"],
                         capture_output=True, text=True, cwd=ROOT).stdout
    print(out, end="", flush=True)
    lines = out.splitlines()
    return bool(lines) and sum("NOT quiet" not in line for line in lines) >= len(lines) - 1  # one noisy sample ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path, nargs="?", help="the output directory (default: "
                    "docs/results/vs-llamacpp-YYYY-MM-DD/, today's)")
    ap.add_argument("--budget-min", type=float, default=55, help="minutes for this invocation")
    ap.add_argument("--dry", action="store_true", help="smallest settings, guard off (TURBO_BENCH_GUARD=off)")
    ap.add_argument("--force", action="store_true", help="start even if the machine is not quiet")
    ap.add_argument("--only", nargs="+", help="these steps only (names: --list)")
    ap.add_argument("--list", action="store_true", help="print the steps and their estimates")
    ap.add_argument("--no-prepare", action="store_true", help="do not open every install first (PREPARE)")
    args = ap.parse_args()
    if args.list:
        for name, est, full, _ in STEPS:
            print(f"{name:16} {est:3} min  python -m scripts.{shlex.join(full)}")
        return
    if args.dir is None:
        from scripts.benchlib import results_path  # (here: benchlib imports torch)

        args.dir = results_path("vs-llamacpp", "")
    args.dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("LLAMA_CONVERT_DIR", str(LLAMA / "src/llama_cpp_python-0.3.36/vendor/llama.cpp"))
    env.setdefault("LLAMA_CPP_LIB_PATH", str(LLAMA / "build-noamx/bin"))
    if args.dry:
        env["TURBO_BENCH_GUARD"] = "off"
    if not args.dry and not quiet(args.dry) and not args.force:
        raise SystemExit("the machine is not quiet (benchlib --quiet-check): stop what runs, or --force")
    deadline = time.monotonic() + 60 * args.budget_min
    if not args.no_prepare:
        with (args.dir / "prepare.log").open("w") as log:
            if subprocess.run([sys.executable, "-c", PREPARE], cwd=ROOT, env=env, stdout=log, stderr=log).returncode:
                raise SystemExit(f"opening the installs failed: {args.dir / 'prepare.log'}")
    for name, est, full, dry in STEPS:
        if args.only and name not in args.only:
            continue
        meta_path = args.dir / f"{name}.meta.json"
        if meta_path.is_file() and json.loads(meta_path.read_text()).get("rc") == 0:
            print(f"{name}: done before, skipped", flush=True)
            continue
        left = (deadline - time.monotonic()) / 60
        if not args.dry and est > left:
            print(f"{name}: ~{est} min, {left:.0f} min left: skipped", flush=True)
            continue
        argv = [a.replace("{dir}", str(args.dir)) for a in (dry if args.dry else full)]
        for a in argv:  # a rerun starts clean: the scripts append to their --out
            if a.startswith(str(args.dir)):
                Path(a).unlink(missing_ok=True)
        cmd = [sys.executable, "-m", f"scripts.{argv[0]}", *argv[1:]]
        meta = {"name": name, "cmd": "python -m scripts." + shlex.join(argv), "estimate_min": est, "dry": args.dry,
                "commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(git("status", "--porcelain",
                                                                                  "--untracked-files=no")),
                "start": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "load_before": os.getloadavg()}
        print(f"{name}: {meta['cmd']} (~{est} min, {left:.0f} left)", flush=True)
        t0 = time.monotonic()
        with (args.dir / f"{name}.log").open("w") as log, (args.dir / f"{name}.err").open("w") as err:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=err).returncode
        meta |= {"rc": rc, "seconds": round(time.monotonic() - t0, 1), "load_after": os.getloadavg(),
                 "end": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
        meta_path.write_text(json.dumps(meta, indent=1) + "\n")
        print(f"{name}: exit {rc} after {meta['seconds'] / 60:.1f} min", flush=True)
    print(f"done; the tables: python -m scripts.report_vs_llamacpp {args.dir}")


if __name__ == "__main__":
    main()
