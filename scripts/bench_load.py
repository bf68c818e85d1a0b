"""What opening an install costs and what decoding on it gives: load seconds, the process's
resident memory after the load and at its peak, plain decode tokens/s.

    python scripts/bench_load.py qwen3.5-35b-a3b-2l [--quant int4] [--threads 2] [--new 32] [--reps 3]

The install is the named shape's (scripts/shapes.py, random weights, built on first use). One
process measures one tree: to compare with another checkout, run this file with
PYTHONPATH=/that/checkout (the turbo it imports is printed). A benchmark, not a test: time it under
the machine's bench lock.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shapes  # noqa: E402

import turbo  # noqa: E402


def rss_gb() -> float:
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) / 2 ** 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=sorted(shapes.SHAPES))
    ap.add_argument("--quant", default="none", help="the repack's --quant (none, int4, int8, ...)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=32, help="greedy tokens per generation")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    path = shapes.build(args.shape, quant=args.quant)
    torch.set_num_threads(args.threads)
    t = time.perf_counter()
    rt = turbo.open(str(path), backend="cpu")
    load = time.perf_counter() - t
    after = rss_gb()
    prompt = list(range(100, 132))
    rt.generate(prompt, max_new_tokens=4, policy="off", stop_at_eos=False)  # (first-call costs)
    speeds = [rt.generate(prompt, max_new_tokens=args.new, policy="off", stop_at_eos=False).stats.decode_tokens_per_s
              for _ in range(args.reps)]
    print(f"turbo from {Path(turbo.__file__).parent.parent}: {args.shape} --quant {args.quant}, step "
          f"{rt.trunk.step_name}, {args.threads} threads")
    print(f"load {load:.1f} s; RSS after it {after:.2f} GB, peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20:.2f} GB; "
          f"decode {statistics.median(speeds):.1f} tok/s ({min(speeds):.1f}..{max(speeds):.1f}, {args.reps} runs of "
          f"{args.new} tokens)")


if __name__ == "__main__":
    main()
