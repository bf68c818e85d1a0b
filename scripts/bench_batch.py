"""A continuous batch's trunk pass against its sequences' steps one after another: Trunk.step_many
of N sequences x R rows (a decode step each: R = 1; a verify each: R = 9) against N sequential
`step` calls, on a published shape (random weights) or tiny, interleaved.

    python -m scripts.bench_batch [--shape qwen3.5-0.8b] [--seqs 1 2 4 8 16] \
        [--rows 1 9] [--context 256] [--reps 5] [--threads 2]
    python -m scripts.bench_batch --shape tiny --reps 1       # does it run

Every sequence holds the same --context prompt (prefilled once, the state copied). Before
timing a (N, R) pair, the batch's logits are checked equal to the sequential steps' (bit for
bit). Each repetition times every pair both ways (the order alternating); a timing is the mean
of --calls calls, each sequence put back to its position after a call (the K/V rows past it are
overwritten next time; the recurrent state drifts, which costs the same). Prints medians
[min, max] in ms, the speedup, and the batch's rows per second. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import torch

import turbo
from scripts import benchlib
from turbo.testing import shapes


def copies(trunk, st, n: int) -> list:
    """n independent copies of a prefilled state."""
    from turbo.model.step import TrunkState

    return [TrunkState(st.pos, {i: (k.clone(), v.clone()) for i, (k, v) in st.kv.items()},
                       {i: (s.clone(), w.clone()) for i, (s, w) in st.gdn.items()}) for _ in range(n)]


def runners(trunk, states: list, rows: list[int], rollback: str | None):
    """(batched, sequential): one call each, every state put back to its position after."""
    n, pos = len(states), states[0].pos

    def batched():
        outs = trunk.step_many(states, [rows] * n, [()] * n, [rollback] * n, [len(rows)] * n)
        for st in states:
            st.pos = pos
        return outs

    def sequential():
        outs = [trunk.step(st, rows, (), rollback) for st in states]
        for st in states:
            st.pos = pos
        return outs

    return batched, sequential


def mean_seconds(fn, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.5-0.8b", choices=("tiny", *shapes.SHAPES))
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 9], help="rows per sequence per step")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens every sequence holds")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--calls", type=int, default=3, help="calls per timing")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache", default="auto", choices=("auto", "float32", "bfloat16"))
    args = ap.parse_args()
    rt = turbo.open("tiny" if args.shape == "tiny" else str(shapes.build(args.shape)), backend="cpu",
                    threads=args.threads, kv_cache=args.kv_cache)
    trunk = rt.trunk
    if trunk.step_name != "native":
        sys.exit(f"the trunk runs the {trunk.step_name} step ({trunk.why_torch}): its step_many is a loop")
    prompt = benchlib.prompt_ids(args.context)
    first = trunk.new_state(args.context + max(args.rows) + 1)
    trunk.prefill(first, prompt)
    pairs = [(n, r) for r in args.rows for n in args.seqs]
    runs = {}
    for n, r in pairs:
        rows = benchlib.prompt_ids(r + 1)[1:]
        rollback = "checkpoint" if r > 1 else None  # a verify keeps what its rollback needs
        check = runners(trunk, copies(trunk, first, n), rows, rollback)[0](), \
            runners(trunk, copies(trunk, first, n), rows, rollback)[1]()
        if not all(torch.equal(a.logits, b.logits) for a, b in zip(*check)):
            sys.exit(f"{n} x {r} rows: the batch's logits are not the sequential steps'")
        runs[n, r] = runners(trunk, copies(trunk, first, n), rows, rollback)
    times = {pair: ([], []) for pair in pairs}
    guard, seen = benchlib.Guard.from_env(args.threads), []
    for rep in range(args.reps):
        got = {pair: ([], []) for pair in pairs}
        with guard.rep(f"rep {rep}") as g:
            for pair in pairs:
                order = (0, 1) if rep % 2 == 0 else (1, 0)
                for which in order:
                    got[pair][which].append(mean_seconds(runs[pair][which], args.calls))
        seen.append({"guard": dataclasses.asdict(g)})
        for pair in pairs if not g.disturbed else []:  # a disturbed repetition's times are dropped
            for which in (0, 1):
                times[pair][which].extend(got[pair][which])
    print(f"{args.shape}, {args.threads} threads, context {args.context}, {args.reps} reps x {args.calls} calls")
    print(benchlib.guard_summary(seen))
    if not times[pairs[0]][0]:
        sys.exit("every repetition was disturbed: rerun on a quiet machine")
    print(f"{'seqs':>5} {'rows':>5} {'step_many ms':>24} {'sequential ms':>24} {'speedup':>8} {'rows/s':>9}")
    for n, r in pairs:
        b, s = times[n, r]
        speedup = statistics.median(s) / statistics.median(b)
        print(f"{n:>5} {r:>5} {benchlib.med(b, 1e-3):>24} {benchlib.med(s, 1e-3):>24} {speedup:>7.2f}x "
              f"{n * r / statistics.median(b):>9.0f}")


if __name__ == "__main__":
    main()
