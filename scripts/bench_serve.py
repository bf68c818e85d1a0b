"""Throughput of `python -m turbo task=serve` under N concurrent clients (scripts/load.py), beside
llama.cpp's OpenAI-compatible server on the same weights when llama_cpp is importable.

    python scripts/bench_serve.py [--shape qwen3.5-0.8b] [--threads 2] [--concurrency 1 4 8] [--reps 3]

One turbo server (serve.max_running = the widest concurrency) serves every configuration: each is
a request's "turbo" field (plain decode on the code workload; the n-gram drafter, fixed and
adaptive, on repetitive prompts). The first load of each configuration checks every answer
against the same request alone (a mismatch stops the run); then repetitions at each concurrency,
interleaved over the configurations and the servers, print the medians (min..max) of aggregate
tokens/s, and p50 / p99 of time to first token and per-token latency. A benchmark, not a test:
time it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

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


def load(url: str, prompts: str, turbo: dict | None, concurrency: int, args, check: bool) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, str(ROOT / "scripts" / "load.py"), "--base-url", f"http://{url}/v1",
               "--concurrency", str(concurrency), "--requests", str(args.requests), "--max-tokens",
               str(args.max_tokens), "--prompts", prompts, "--ignore-eos", "--json", out.name]
        cmd += ["--turbo", json.dumps(turbo)] if turbo is not None else []
        cmd += [] if check else ["--no-check"]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"load.py failed: {p.stderr[-2000:]}")
        return json.loads(Path(out.name).read_text())


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
    ap.add_argument("--llamacpp", action="store_true", help="also llama.cpp's server on the shape's bf16 GGUF")
    args = ap.parse_args()
    install = "tiny" if args.shape == "tiny" else str(shapes.build(args.shape))
    servers = {}
    widest = max(args.concurrency)
    proc, url = start([sys.executable, "-m", "turbo", "task=serve", f"install.path={install}" if install != "tiny"
                       else "install=tiny", f"threads={args.threads}", "backend=cpu", "serve.port=0",
                       f"serve.max_running={widest}", f"serve.max_waiting={4 * widest}", "serve.memory_gb=8"])
    servers["turbo"] = (proc, url)
    runs = [(f"turbo {name}", url, *CONFIGS[name]) for name in args.configs]
    if args.llamacpp:
        gguf = shapes.gguf(args.shape, "bf16") if args.shape != "tiny" else None
        if gguf is None:
            sys.exit("llama.cpp: no GGUF of this shape (llama_cpp importable? turbo.testing.shapes.gguf)")
        lproc, lurl = start([sys.executable, str(ROOT / "scripts" / "llamacpp_server.py"), str(gguf),
                             str(args.threads)])
        servers["llama.cpp"] = (lproc, lurl)
        runs.append(("llama.cpp plain", lurl, "code", None))
    try:
        for name, u, prompts, turbo in runs:  # the checked load: every answer equals its solo run
            load(u, prompts, turbo, widest, args, check=True)
        figures = {(name, c): [] for name, *_ in runs for c in args.concurrency}
        for rep in range(args.reps):
            order = runs if rep % 2 == 0 else runs[::-1]
            for name, u, prompts, turbo in order:
                for c in args.concurrency:
                    figures[(name, c)].append(load(u, prompts, turbo, c, args, check=False))
        print(f"shape {args.shape}, {args.threads} threads, {args.requests} requests x {args.max_tokens} tokens "
              f"(ignore_eos), medians of {args.reps} interleaved repetitions (min..max)")
        print("| server, configuration | clients | tokens/s | x one client | TTFT p50 / p99 ms | per-token p50 / p99 ms |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for name, *_ in runs:
            one = statistics.median(f["tokens_per_s"] for f in figures[(name, min(args.concurrency))])
            for c in args.concurrency:
                fs = figures[(name, c)]
                tps = [f["tokens_per_s"] for f in fs]
                print(f"| {name} | {c} | {med(tps)} | {statistics.median(tps) / one:.2f}x | "
                      f"{statistics.median(f['ttft_p50_ms'] for f in fs):.0f} / "
                      f"{statistics.median(f['ttft_p99_ms'] for f in fs):.0f} | "
                      f"{statistics.median(f['tpot_p50_ms'] for f in fs):.0f} / "
                      f"{statistics.median(f['tpot_p99_ms'] for f in fs):.0f} |")
    finally:
        for proc, _ in servers.values():
            proc.send_signal(2)
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
