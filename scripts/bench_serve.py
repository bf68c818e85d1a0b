"""Throughput of `python -m turbo task=serve` under N concurrent clients (scripts/load.py), beside
llama.cpp's own `llama-server --parallel N` on the same weights (--llamacpp).

    python -m scripts.bench_serve [--shape qwen3.5-0.8b] [--threads 2] [--concurrency 1 4 8] [--reps 3]
    python -m scripts.bench_serve --configs plain --llamacpp [--quant int4 --gguf q4_0]

One turbo server (serve.max_running = the widest concurrency) serves every configuration: each is
a request's "turbo" field (plain decode on the code workload; the n-gram drafter, fixed and
adaptive, on repetitive prompts). --llamacpp: llama.cpp's llama-server (scripts/build_llamacpp.py
builds it) on the shape's GGUF (--gguf), one server per concurrency N with --parallel N slots
(continuous batching, its default), plain decode on the code workload. The first load of each
configuration (each llama-server) checks every answer against the same request alone: a turbo
mismatch stops the run, a llama.cpp one is counted and printed (its batched numerics are its
own). Then repetitions at each concurrency, interleaved over the configurations and the servers,
each under benchlib's quiet-machine guard, print the medians (min..max) of the undisturbed ones:
aggregate tokens/s, and p50 / p99 of time to first token and per-token latency, and how many
repetitions were kept and dropped. A benchmark, not a test: time it on a quiet machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts import benchlib
from scripts.llamacpp_server import start_llama_server
from turbo.testing import shapes
from turbo.testing.checks import served_address

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"plain": ("code", {"policy": "off"}),
           "ngram b4": ("repetitive", {"policy": "fixed", "drafter": "ngram", "block": 4}),
           "ngram adaptive": ("repetitive", {"policy": "adaptive", "drafter": "ngram", "block": 8}),
           "dflash b4": ("code", {"policy": "fixed", "drafter": "dflash", "block": 4}),
           "plain repetitive": ("repetitive", {"policy": "off"})}


def start(cmd: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = served_address(proc)  # its address, on stderr
    except AssertionError as e:
        sys.exit(f"the server did not start: {e}")
    return proc, line.split("http://", 1)[1].split()[0]


class InProcess:
    """scripts/inprocess_load.py, kept open: the same loads at one client through the Python API."""

    def __init__(self, install: str, threads: int):
        self.proc = subprocess.Popen([sys.executable, "-m", "scripts.inprocess_load", "--install", install,
                                      "--threads", str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, cwd=ROOT)
        if self.proc.stdout.readline().strip() != "ready":
            sys.exit("scripts.inprocess_load did not start")

    def load(self, prompts: str, turbo: dict | None, args) -> dict:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "requests": args.requests,
                                          "max_tokens": args.max_tokens, "turbo": turbo}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            sys.exit("scripts.inprocess_load ended")
        return json.loads(line)

    def send_signal(self, sig: int) -> None:
        self.proc.stdin.close()

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)


def load(url: str | InProcess, prompts: str, turbo: dict | None, concurrency: int, args, check: bool,
         mismatch_ok: bool = False) -> dict:
    """scripts/load.py's figures for one load; a failure stops the run, and so does a mismatch
    against the solo answers unless `mismatch_ok` (then it is printed and counted in the figures).
    In process (one client): its figures, checked by the server's load against the same answers."""
    if isinstance(url, InProcess):
        return url.load(prompts, turbo, args)
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "scripts.load", "--base-url", f"http://{url}/v1",
               "--concurrency", str(concurrency), "--requests", str(args.requests), "--max-tokens",
               str(args.max_tokens), "--prompts", prompts, "--ignore-eos", "--json", out.name]
        cmd += ["--turbo", json.dumps(turbo)] if turbo is not None else []
        cmd += [] if check else ["--no-check"]
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        written = Path(out.name).read_text()
        figures = json.loads(written) if written else {}
        if p.returncode != 0 and not (mismatch_ok and figures.get("mismatches")):
            sys.exit(f"load.py failed: {p.stderr[-2000:]}")
        if figures.get("mismatches"):
            print(p.stderr.strip()[-4000:], file=sys.stderr)
        return figures


def med(xs: list[float], fmt: str = "{:.1f}") -> str:
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}..{fmt.format(max(xs))})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.5-0.8b", choices=("tiny", *shapes.SHAPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--configs", nargs="+", default=["plain", "ngram b4", "ngram adaptive"], choices=list(CONFIGS))
    ap.add_argument("--quant", default="none", help="turbo's install of the shape: the repack's --quant")
    ap.add_argument("--llamacpp", action="store_true", help="also llama.cpp's llama-server --parallel N per N")
    ap.add_argument("--gguf", default="bf16", help="--llamacpp: the shape's GGUF kind (bf16, q8_0, q4_0)")
    ap.add_argument("--in-process", action="store_true",
                    help="also the same loads at one client through the Python API in one process "
                         "(scripts/inprocess_load.py): what the server costs a token")
    ap.add_argument("--serve", nargs="*", default=[], metavar="KEY=VALUE",
                    help="more overrides for turbo's server (e.g. serve.front=inline)")
    ap.add_argument("--out", type=Path, help="every repetition's figures and the checks (JSON; default "
                    "docs/results/serve-YYYY-MM-DD.json, a new file each run)")
    args = ap.parse_args()
    # tiny: the shipped install, unless beside llama.cpp, whose GGUF is of the random tiny shape
    same = args.shape != "tiny" or args.llamacpp
    install = str(shapes.build(args.shape, quant=args.quant)) if same else "tiny"
    procs = []
    widest = max(args.concurrency)
    proc, url = start([sys.executable, "-m", "turbo", "task=serve", f"install.path={install}" if install != "tiny"
                       else "install=tiny", f"threads={args.threads}", "backend=cpu", "serve.port=0",
                       f"serve.max_running={widest}", f"serve.max_waiting={4 * widest}", "serve.memory_gb=8",
                       *args.serve])
    procs.append(proc)
    # (name, {concurrency: server}, prompts, the request's turbo field)
    runs = [(f"turbo {name}", dict.fromkeys(args.concurrency, url), *CONFIGS[name]) for name in args.configs]
    try:
        if args.in_process and 1 in args.concurrency:
            inproc = InProcess(install, args.threads)
            procs.append(inproc)
            runs += [(f"in process {name}", {1: inproc}, *CONFIGS[name]) for name in args.configs]
        if args.llamacpp:
            gguf = shapes.gguf(args.shape, args.gguf)
            if gguf is None:
                sys.exit(f"llama.cpp: no {args.gguf} GGUF of this shape (turbo.testing.shapes.gguf; docs/llamacpp.md)")
            urls = {}
            for c in args.concurrency:
                lproc, urls[c] = start_llama_server(str(gguf), args.threads, parallel=c)
                procs.append(lproc)
            runs.append((f"llama-server --parallel N, {args.gguf}", urls, "code", None))
        # the checked loads, every answer against its solo run: turbo's one server at the widest
        # concurrency, each llama-server at its own N
        checked = {}  # (name, concurrency) -> (mismatches, answers)
        for name, urls, prompts, turbo in runs:
            own = name.startswith("turbo")
            if isinstance(urls.get(1), InProcess):
                continue  # (the API's own answers: what the server's are checked against)
            for c in [widest] if own else args.concurrency:
                f = load(urls[c], prompts, turbo, c, args, check=True, mismatch_ok=not own)
                checked[(name, c)] = (f["mismatches"], f["requests_done"])
        guard = benchlib.Guard.from_env(args.threads)
        figures = {(name, c): [] for name, urls, *_ in runs for c in args.concurrency if c in urls}
        for rep in range(args.reps):
            order = runs if rep % 2 == 0 else runs[::-1]
            for name, urls, prompts, turbo in order:
                for c in [c for c in args.concurrency if c in urls]:
                    with guard.rep(f"rep {rep} {name} x{c}") as g:
                        f = load(urls[c], prompts, turbo, c, args, check=False, mismatch_ok=True)
                    figures[(name, c)].append(f | {"guard": dataclasses.asdict(g)})
        every = [f for fs in figures.values() for f in fs]
        args.out = args.out or benchlib.results_path("serve", ".json", fresh=True)
        print(f"figures: {args.out}", file=sys.stderr)
        args.out.write_text(json.dumps({
            "args": vars(args) | {"out": str(args.out)},
            "runs": [{"name": name, "clients": c, "reps": fs,
                      "checked": dict(zip(("mismatches", "requests"), checked[(name, at)]), at=at)}
                     for (name, c), fs in figures.items()
                     for at in [c if (name, c) in checked else widest] if (name, at) in checked]
                    + [{"name": name, "clients": c, "reps": fs} for (name, c), fs in figures.items()
                       if name.startswith("in process")]}, indent=1) + "\n")
        print(f"shape {args.shape}, {args.threads} threads, {args.requests} requests x {args.max_tokens} tokens "
              f"(ignore_eos), medians of the undisturbed of {args.reps} interleaved repetitions (min..max)")
        print(benchlib.guard_summary(every))
        print("| server, configuration | clients | tokens/s | x one client | TTFT p50 / p99 ms "
              "| per-token p50 / p99 ms | answers = alone |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for name, urls, *_ in runs:
            ones = [f["tokens_per_s"] for f in benchlib.kept(figures[(name, min(urls))])]
            one = statistics.median(ones) if ones else float("nan")
            for c in [c for c in args.concurrency if c in urls]:
                fs = benchlib.kept(figures[(name, c)])
                at = c if (name, c) in checked else widest
                bad, done = checked.get((name, at), (0, 0))
                same = (f"{done - bad} / {done}" + ("" if at == c else f" (at {widest} clients)")) \
                    if (name, at) in checked else "(the reference)"
                if not fs:
                    print(f"| {name} | {c} | - (every repetition disturbed) | | | | {same} |")
                    continue
                tps = [f["tokens_per_s"] for f in fs]
                print(f"| {name} | {c} | {med(tps)} | {statistics.median(tps) / one:.2f}x | "
                      f"{statistics.median(f['ttft_p50_ms'] for f in fs):.0f} / "
                      f"{statistics.median(f['ttft_p99_ms'] for f in fs):.0f} | "
                      f"{statistics.median(f['tpot_p50_ms'] for f in fs):.0f} / "
                      f"{statistics.median(f['tpot_p99_ms'] for f in fs):.0f} | {same} |")
    finally:
        for p in procs:
            p.send_signal(2)
            p.wait(timeout=60)


if __name__ == "__main__":
    main()
