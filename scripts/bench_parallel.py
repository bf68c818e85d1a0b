"""The pipeline's costs (turbo/parallel, issue 56): decode and prefill over 2 ranks x 1 thread against
1 process x 2 threads, one pipeline hop (rows passed stage to stage untouched), and each rank's
resident memory against the single process's. Each system runs in a fresh process (`--worker`), one
after another; timings mean something only on a quiet machine (scripts/benchlib.py's guard).

    python -m scripts.bench_parallel                      # the 0.8B shape (random weights, built once)
    python -m scripts.bench_parallel --shape tiny --tokens 16   # a quick run that the script works
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def rss_kib(pid: int) -> int:
    """A process's resident memory (VmRSS), KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def worker(path: str, pipeline: int, threads: int, tokens: int, prompt_len: int) -> dict:
    import turbo

    rt = turbo.open(path, backend="cpu", threads=threads, parallel={"pipeline": pipeline})
    ids = [(7 * i + 3) % min(4096, rt.install.arch.vocab) for i in range(prompt_len)]  # (ids the shapes' tokenizer has)
    rt.generate(ids[:8], max_new_tokens=2, policy="off")  # warm
    t = time.perf_counter()
    r = rt.generate(ids, max_new_tokens=tokens, policy="off", stop_at_eos=False)
    total = time.perf_counter() - t
    out = {"pipeline": pipeline, "threads": threads, "tokens": r.tokens,
           "prefill_tok_s": r.stats.prefill_tokens_per_s, "decode_tok_s": r.stats.decode_tokens_per_s,
           "seconds": total, "rss_kib": [rss_kib(os.getpid())]}
    if pipeline > 1:
        out["rss_kib"] += [rss_kib(p) for p in rt.trunk.pids()]
        hidden = rt.install.arch.hidden
        for rows in (1, 9, 256):
            pings = [rt.trunk.ping(rows) for _ in range(20)]
            out[f"hop_ms_{rows}_rows"] = 1e3 * statistics.median(pings) / pipeline  # (a ring: P hops)
        out["hidden"] = hidden
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.5-0.8b")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        path, pipeline = args.worker.split(",")
        print(json.dumps(worker(path, int(pipeline), args.threads, args.tokens, args.prompt)))
        return
    if args.shape == "tiny":
        path = "tiny"
    else:
        from turbo.testing import shapes
        path = str(shapes.build(args.shape))
    runs = []
    for pipeline in (1, 2):
        cmd = [sys.executable, "-m", "scripts.bench_parallel", "--worker", f"{path},{pipeline}",
               "--threads", str(args.threads), "--tokens", str(args.tokens), "--prompt", str(args.prompt)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if p.returncode:
            sys.exit(f"error: the pipeline={pipeline} worker failed: {p.stderr.strip().splitlines()[-1:]}")
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    one, two = runs
    same = one["tokens"] == two["tokens"]
    print(f"shape {args.shape}: greedy tokens {'equal' if same else 'DIFFER'} ({len(one['tokens'])})")
    for r in runs:
        print(f"  pipeline {r['pipeline']} ({r['threads']} threads shared): prefill {r['prefill_tok_s']:.1f} tok/s, "
              f"decode {r['decode_tok_s']:.1f} tok/s, resident MiB per rank "
              + ", ".join(f"{k / 1024:.0f}" for k in r["rss_kib"]))
    print("  rank / single process resident: " + ", ".join(f"{k / one['rss_kib'][0]:.2f}" for k in two["rss_kib"]))
    print("  one hop (median): " + ", ".join(f"{rows} rows {two[f'hop_ms_{rows}_rows']:.3f} ms" for rows in (1, 9, 256)))
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
