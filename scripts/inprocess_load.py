"""The same load as scripts/load.py at one client, in process: the generations a server's client
streams, run through the Python API's `Runtime.stream` and timed the same way (time to the first
streamed event, then (last - first) / (tokens - 1) a token), so a server's per-token cost can be
set against the engine's own (scripts/bench_serve.py --in-process).

    python -m scripts.inprocess_load --install PATH --threads 2

It opens the install once and then reads one JSON line per load on stdin
({"prompts": "code", "requests": 16, "max_tokens": 32, "turbo": {"policy": "off"}}) and answers
each with one JSON line of load.py's figures. A benchmark tool, not a test.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import turbo
from scripts.load import percentile, prompts_of


def one(rt, prompt: str, max_tokens: int, spec: dict) -> tuple[int, float, float | None]:
    """(tokens, seconds to the first event, seconds a token after it) of one greedy generation
    run to max_tokens (past end of text, as load.py's --ignore-eos)."""
    start = time.perf_counter()
    first = last = None
    tokens = 0
    for event in rt.stream(prompt, max_new_tokens=max_tokens, temperature=0, stop_at_eos=False, **spec):
        if event.tokens:
            last = time.perf_counter()
            first = first or last
            tokens += len(event.tokens)
    first, last = first or time.perf_counter(), last or time.perf_counter()
    return tokens, first - start, (last - first) / (tokens - 1) if tokens > 1 else None


def run(rt, load: dict) -> dict:
    prompts = prompts_of(load.get("prompts", "code"))
    spec = load.get("turbo") or {}
    results = []
    start = time.perf_counter()
    for i in range(int(load.get("requests", 16))):
        results.append(one(rt, prompts[i % len(prompts)], int(load.get("max_tokens", 32)), spec))
    wall = time.perf_counter() - start
    tokens = sum(r[0] for r in results)
    ttft = [r[1] for r in results]
    tpot = [r[2] for r in results if r[2] is not None]
    return {"concurrency": 1, "requests_done": len(results), "refused": 0, "mismatches": 0,
            "seconds": round(wall, 3), "generated_tokens": tokens, "tokens_per_s": round(tokens / wall, 2),
            "ttft_p50_ms": round(1000 * percentile(ttft, 50), 1), "ttft_p99_ms": round(1000 * percentile(ttft, 99), 1),
            "tpot_p50_ms": round(1000 * percentile(tpot, 50), 1), "tpot_p99_ms": round(1000 * percentile(tpot, 99), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--install", required=True)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    rt = turbo.open(args.install, threads=args.threads, backend="cpu")
    run(rt, {"requests": 1, "max_tokens": 4})  # (warm: the first step's allocations)
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(run(rt, json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
