"""Where a continuous batch's step goes: Trunk.step_many of 1 x 1, 1 x R and N x 1 (sequences x
rows) timed interleaved, each split into its native calls (the GDN layers, the attention layers,
the head, the embedding) and the Python around them; then the scheduler's step with N running
plain greedy requests against the trunk pass inside it (what the scheduler adds per step),
and cProfile's top entries of that step.

    python -m scripts.profile_step_many [--shape qwen3.5-0.8b] [--seqs 8] \
        [--rows 8] [--context 64] [--reps 5] [--threads 2] [--no-scheduler] [--cprofile 20]
    python -m scripts.profile_step_many --shape tiny --reps 1          # does it run

A profile, not a test: absolute figures on a shared machine are noisy, compare within one run.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import pstats
import statistics
import sys
import time
from collections import defaultdict

import turbo
from scripts import benchlib
from scripts.bench_batch import copies
from turbo.backends import native_trunk
from turbo.sequence.options import GenerationOptions
from turbo.serve.scheduler import Request, Scheduler, ServeLimits
from turbo.testing import shapes

TIMED = ("embed_rows", "gdn_layer_seqs", "attn_layer_seqs", "head", "copy_rows")


class TimedLib:
    """The native library with the calls in TIMED timed (seconds summed per name)."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib, self.spent = lib, defaultdict(float)

    def __getattr__(self, name: str):
        fn = getattr(self.lib, name)
        if name not in TIMED:
            return fn

        def timed(*args):
            t = time.perf_counter()
            fn(*args)
            self.spent[name] += time.perf_counter() - t
        return timed


def trunk_split(trunk, first, shapes_: list[tuple[int, int]], reps: int) -> None:
    """step_many per (sequences, rows), interleaved, and its split into native calls and Python."""
    real = native_trunk.threaded
    timed = TimedLib(real())
    runs = {}
    for n, r in shapes_:
        states = copies(trunk, first, n)
        rows = benchlib.prompt_ids(r + 1)[1:]
        rollback = "checkpoint" if r > 1 else None
        runs[n, r] = (states, rows, rollback)
    whole: dict = defaultdict(list)
    parts: dict = defaultdict(lambda: defaultdict(list))
    for rep in range(reps):
        for key in shapes_ if rep % 2 == 0 else shapes_[::-1]:
            states, rows, rollback = runs[key]
            pos = states[0].pos
            for instrument in (False, True):
                timed.spent.clear()
                native_trunk.threaded = (lambda: timed) if instrument else real
                t = time.perf_counter()
                trunk.step_many(states, [rows] * key[0], [()] * key[0], [rollback] * key[0], [len(rows)] * key[0])
                spent = time.perf_counter() - t
                native_trunk.threaded = real
                for st in states:
                    st.pos = pos
                if instrument:
                    for name in TIMED:
                        parts[key][name].append(timed.spent[name])
                    parts[key]["python"].append(spent - sum(timed.spent.values()))
                else:
                    whole[key].append(spent)
    print(f"step_many, {reps} reps (medians, ms; the split from a second, instrumented call)")
    print(f"{'seqs x rows':>12} {'whole':>8} " + " ".join(f"{n:>15}" for n in (*TIMED, "python")))
    for key in shapes_:
        med = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
        print(f"{f'{key[0]} x {key[1]}':>12} {med(whole[key]):8.2f} "
              + " ".join(f"{med(parts[key][n]):15.2f}" for n in (*TIMED, "python")))


def scheduler_split(rt, n: int, context: int, steps: int, top: int) -> None:
    """N plain greedy requests through Scheduler.step: the step's time against step_many's in it."""
    sched = Scheduler(rt, ServeLimits(max_running=n))
    sinks = []
    for i in range(n):
        ids = benchlib.prompt_ids(context + i)[i:]
        sinks.append([])
        sched.submit(Request(ids, GenerationOptions(max_new_tokens=steps + 64, policy="off", stop_at_eos=False)),
                     sinks[-1].append)
    while any(s.prefilling for s in sched.running) or sched.waiting:
        sched.step()
    trunk = sched.trunk
    inner = trunk.step_many
    spent = []

    def timed_many(*args):
        t = time.perf_counter()
        out = inner(*args)
        spent.append(time.perf_counter() - t)
        return out

    trunk.step_many = timed_many
    whole = []
    prof = cProfile.Profile()
    for k in range(steps):
        t = time.perf_counter()
        if k == steps - 1 and top:
            prof.runcall(sched.step)
        else:
            sched.step()
        whole.append(time.perf_counter() - t)
    del trunk.step_many
    outside = [w - s for w, s in zip(whole, spent)]
    print(f"\nscheduler step, {n} running plain greedy, {steps} steps (medians, ms): whole "
          f"{1e3 * statistics.median(whole):.2f}, step_many {1e3 * statistics.median(spent):.2f}, "
          f"outside {1e3 * statistics.median(outside):.2f}")
    if top:
        pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.5-0.8b", choices=("tiny", *shapes.SHAPES))
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--rows", type=int, default=8, help="the one-sequence verify's rows")
    ap.add_argument("--install", help="an install directory to open instead of --shape's")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8, help="scheduler steps timed")
    ap.add_argument("--no-scheduler", action="store_true")
    ap.add_argument("--cprofile", type=int, default=20, help="cProfile entries of one scheduler step (0: none)")
    args = ap.parse_args()
    path = args.install or ("tiny" if args.shape == "tiny" else str(shapes.build(args.shape)))
    rt = turbo.open(path, backend="cpu",
                    threads=args.threads)
    trunk = rt.trunk
    if trunk.step_name != "native":
        sys.exit(f"the trunk runs the {trunk.step_name} step ({trunk.why_torch})")
    first = trunk.new_state(args.context + args.rows + 1)
    trunk.prefill(first, benchlib.prompt_ids(args.context))
    trunk_split(trunk, first, [(1, 1), (1, args.rows), (args.seqs, 1)], args.reps)
    if not args.no_scheduler:
        scheduler_split(rt, args.seqs, args.context, args.steps, args.cprofile)


if __name__ == "__main__":
    main()
