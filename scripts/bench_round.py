"""What a speculative round costs against a decode step, and what it buys, per block.

    python -m scripts.bench_round [--shape tiny|qwen3.5-0.8b|...] [--format bf16 int4 ...] [--accept 0.8]
        [--rollback checkpoint replay]

For each weight format (an install of the named shape, random weights, built once and cached:
turbo.testing.shapes), interleaved format by format in every repetition: the time of a verify
of R rows over one decode step, plain and keeping per-row state checkpoints (rollback
checkpoint), then tokens/s of whole generations against plain decode with a scripted drafter
(turbo.testing.ScriptedDrafter) landing each proposal with probability --accept, so the
acceptance is fixed and only the engine's costs vary (the draft costs nothing), once per
--rollback strategy (default checkpoint). Medians over --reps, with the spread (min..max). A
benchmark, not a test: time it under the machine's bench lock.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics

import torch

import turbo
from scripts import benchlib
from scripts.benchlib import step_times
from turbo.testing import ScriptedDrafter, shapes

QUANT = {"bf16": "none", "int8": "int8", "int4": "int4"}


def landed_schedule(accept: float, widest: int, rounds: int = 4096) -> list[int]:
    """Proposals landed per round when each lands with probability `accept` (the first miss ends
    the round), up to `widest`: n = floor(log u / log accept), u from a golden-ratio sequence
    rather than random draws, so a generation's few dozen rounds already land the expected
    sum(accept^k) (random draws from one seed landed 2.00 a round at block 8 over 96 tokens
    against 3.33 expected at 0.8)."""
    phi = (math.sqrt(5) - 1) / 2
    return [min(int(math.log(((0.5 + i * phi) % 1.0) or 1.0) / math.log(accept)), widest) for i in range(rounds)]


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}..{max(xs):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="tiny", choices=sorted(shapes.SHAPES))
    ap.add_argument("--format", nargs="+", default=["bf16"], choices=tuple(QUANT))
    ap.add_argument("--dtype", default="float32", help="OpenOptions.dtype (the activations)")
    ap.add_argument("--accept", type=float, default=0.8, help="per-position acceptance of the scripted drafter")
    ap.add_argument("--new", type=int, default=150, help="tokens per generation")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions (medians reported)")
    ap.add_argument("--calls", type=int, default=5, help="steps per timing")
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 3, 5, 9])
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--rollback", nargs="+", default=["checkpoint"], choices=("checkpoint", "replay"),
                    help="rollback strategies of the tokens/s runs (each format x strategy a row)")
    ap.add_argument("--skip-tokens", action="store_true", help="the verify table only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rts = {f: turbo.open(str(shapes.build(args.shape, quant=QUANT[f])), backend="cpu", dtype=args.dtype)
           for f in args.format}
    vocab = min(rt.trunk.arch.vocab for rt in rts.values())
    prompt = torch.randint(0, min(vocab, 4000), (128,), generator=torch.Generator().manual_seed(0)).tolist()
    schedule = landed_schedule(args.accept, max(args.blocks))
    times = {f: [] for f in rts}
    speed = {(f, rb): {} for f in rts for rb in args.rollback}
    landed = {}  # block -> accepted per round (the same every run: the schedule is fixed)
    guard, seen = benchlib.Guard.from_env(args.threads), []
    for rep in range(args.reps):
        for f, rt in rts.items():
            with guard.rep(f"rep {rep} {f} steps") as g:
                t = step_times(rt, prompt, args.rows, args.calls)
            seen.append({"guard": dataclasses.asdict(g)})
            if not g.disturbed:  # a disturbed one is dropped (benchlib.Guard)
                times[f].append(t)
        if args.skip_tokens:
            continue
        for f, rt in rts.items():
            got = {}  # (rollback, "plain" or block) -> tok/s, kept together or dropped together
            with guard.rep(f"rep {rep} {f} generations") as g:
                off = rt.generate(prompt, max_new_tokens=args.new, policy="off", stop_at_eos=False)
                for rb in args.rollback:
                    got[rb, "plain"] = off.stats.decode_tokens_per_s
                for block in args.blocks:
                    for rb in args.rollback:
                        scripted = ScriptedDrafter(prompt + off.tokens, [min(n, block) for n in schedule], vocab)
                        res = rt.generate(prompt, max_new_tokens=args.new, policy="fixed", block=block,
                                          rollback=rb, drafter=scripted, stop_at_eos=False)
                        assert res.tokens == off.tokens, "speculation changed the output"
                        got[rb, block] = res.stats.decode_tokens_per_s
                        landed[block] = res.stats.accepted / res.stats.rounds
            seen.append({"guard": dataclasses.asdict(g)})
            for (rb, which), tps in got.items() if not g.disturbed else ():
                speed[f, rb].setdefault(which, []).append(tps)
    print(f"shape {args.shape}, dtype {args.dtype}, {args.threads} thread(s), medians of the undisturbed of "
          f"{args.reps} interleaved runs (min..max)")
    print(benchlib.guard_summary(seen))
    if not all(times.values()) or not (args.skip_tokens or all(speed.values())):
        raise SystemExit("a cell has no undisturbed repetition: rerun on a quiet machine")
    print("\n| format | decode step ms | " + " | ".join(f"verify {n} rows / step (plain; checkpoints)"
                                                    for n in args.rows) + " |")
    print("| --- | ---: |" + " ---: |" * len(args.rows))
    for f, runs in times.items():
        cells = [med([r[n, None] / r["decode"] for r in runs]) + "; " +
                 med([r[n, "checkpoint"] / r["decode"] for r in runs]) for n in args.rows]
        print(f"| {f} | {med([r['decode'] * 1e3 for r in runs])} | " + " | ".join(cells) + " |")
    if args.skip_tokens:
        return
    print(f"\ntok/s at acceptance {args.accept} (scripted drafter; draft cost excluded)")
    print("| format | rollback | plain | " + " | ".join(f"block {b}" for b in args.blocks) + " | best / plain |")
    print("| --- | --- | ---: |" + " ---: |" * (len(args.blocks) + 1))
    expected = {b: sum(args.accept ** k for k in range(1, b + 1)) for b in args.blocks}
    print("| accepted per round | | - | " + " | ".join(f"{landed[b]:.2f} (expected {expected[b]:.2f})"
                                                  for b in args.blocks) + " | |")
    for (f, rb), s in speed.items():
        best = max(statistics.median(s[b]) for b in args.blocks) / statistics.median(s["plain"])
        print(f"| {f} | {rb} | {med(s['plain'])} | " + " | ".join(med(s[b]) for b in args.blocks)
              + f" | {best:.2f}x |")


if __name__ == "__main__":
    main()
