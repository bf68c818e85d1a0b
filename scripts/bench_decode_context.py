"""Decode at a long context against a short one, per K/V cache dtype, in one process:

    flock /work/locks/bench.lock python scripts/bench_decode_context.py qwen3.5-0.8b --threads 2 --steps 40

A decode step's cost does not depend on the cached values, only on how many there are: each
state's caches are filled with random rows and its position set (no prefill, which would take
minutes at 4096), then the steps of every (kv_cache, context) pair run interleaved, one step
each in turn, so a load change on a shared machine falls on all of them alike (--prefill: the
states come from a real prefill of random ids instead, the recurrent states included). Prints each
pair's median tok/s with the [min, max] step times, and the ratio long / short per cache.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import turbo

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shapes  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=sorted(shapes.SHAPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40, help="timed decode steps per (kv_cache, context)")
    ap.add_argument("--contexts", type=int, nargs=2, default=[512, 4096], metavar=("SHORT", "LONG"))
    ap.add_argument("--kv-cache", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16"))
    ap.add_argument("--prefill", action="store_true",
                    help="fill each state by prefilling random token ids (real states; ~35 s at 4096) instead of random rows")
    args = ap.parse_args()
    install = shapes.build(args.shape)
    runs = {}  # (kv_cache, context) -> (trunk, state, step times)
    for kv in args.kv_cache:
        trunk = turbo.open(install, threads=args.threads, kv_cache=kv).trunk
        for n in args.contexts:
            st = trunk.new_state(n + args.steps + 2)
            g = torch.Generator().manual_seed(n)
            if args.prefill:
                trunk.prefill(st, torch.randint(3, 4000, (n,), generator=g).tolist())
            else:
                for k, v in st.kv.values():
                    k.copy_(torch.randn(k.shape, generator=g)), v.copy_(torch.randn(v.shape, generator=g))
                st.pos = n
            trunk.step(st, [7])  # a warm-up step
            runs[(kv, n)] = (trunk, st, [])
    print(f"load: {os.getloadavg()}, threads {args.threads}", file=sys.stderr)
    for i in range(args.steps):
        for trunk, st, times in runs.values():
            t0 = time.perf_counter()
            trunk.step(st, [(31 * i) % 4000 + 3])
            times.append(time.perf_counter() - t0)
    short, long = args.contexts
    for kv in args.kv_cache:
        med = {n: statistics.median(runs[(kv, n)][2]) for n in args.contexts}
        for n in args.contexts:
            t = runs[(kv, n)][2]
            print(f"kv_cache {kv}, context {n}: {1 / med[n]:.2f} tok/s "
                  f"(step {1e3 * med[n]:.1f} ms [{1e3 * min(t):.1f}, {1e3 * max(t):.1f}])")
        print(f"kv_cache {kv}: decode at {long} / at {short} = {med[short] / med[long]:.3f}")


if __name__ == "__main__":
    main()
