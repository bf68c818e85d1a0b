"""Two checkouts' whole runtime (Python and C) against each other, interleaved process by
process: a decode step, a 9-row verify (plain; keeping checkpoints), whole generations' decode
tokens/s (plain; n-gram block 4; a scripted drafter whose proposals land with probability 0.8 at
block 4, so only the engine's costs vary) and the server's scheduler under 1 and 8 concurrent
requests, on the shipped tiny install and on a published shape. Every speculative or served
generation is checked equal to the same request alone, so a faster run is never another answer.

    python -m scripts.bench_trees OLD_TREE NEW_TREE [--shape qwen3.5-0.8b] [--reps 5] [--threads 1]

OLD_TREE and NEW_TREE are checkouts (e.g. `git worktree add --detach ../old REV`); each run
imports turbo from its tree. Prints per figure the medians (min..max) and the median of the
pairwise new/old ratios. A benchmark, not a test: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

FIGURES = ("decode_ms", "verify9_ms", "verify9_ckpt_ms", "plain_tok_s", "ngram4_tok_s", "scripted4_tok_s",
           "serve1_tok_s", "serve8_tok_s")
CLIENTS = (1, 8)


def worker(path: str, calls: int, new: int) -> dict:
    """One tree's figures on one install (run in a process of its own)."""
    import torch

    import turbo
    from scripts.bench_round import landed_schedule  # (the tree's own scripts/: PYTHONPATH is the tree)
    from turbo.testing import ScriptedDrafter

    rt = turbo.open(path, backend="cpu")
    trunk = rt.trunk
    prompt = torch.randint(0, min(trunk.arch.vocab, 4000), (128,), generator=torch.Generator().manual_seed(0)).tolist()
    st = trunk.new_state(len(prompt) + 64)
    trunk.prefill(st, prompt)
    pos = st.pos

    def ms(rows: int, rollback: str | None) -> float:
        def step():
            trunk.step(st, prompt[:rows], (), rollback)
            st.pos = pos  # back to the anchor: the same step every call
        step()
        t = time.perf_counter()
        for _ in range(calls):
            step()
        return (time.perf_counter() - t) / calls * 1e3

    out = {k: statistics.median(f() for _ in range(3)) for k, f in (
        ("decode_ms", lambda: ms(1, None)), ("verify9_ms", lambda: ms(9, None)),
        ("verify9_ckpt_ms", lambda: ms(9, "checkpoint")))}
    for name, kw in (("plain_tok_s", dict(policy="off")), ("ngram4_tok_s", dict(policy="fixed", block=4, drafter="ngram"))):
        out[name] = statistics.median(rt.generate(prompt, max_new_tokens=new, stop_at_eos=False, **kw)
                                      .stats.decode_tokens_per_s for _ in range(2))
    plain = rt.generate(prompt, max_new_tokens=new, policy="off", stop_at_eos=False).tokens
    runs = []
    for _ in range(2):
        scripted = ScriptedDrafter(prompt + plain, landed_schedule(0.8, 4), trunk.arch.vocab)
        spec = rt.generate(prompt, max_new_tokens=new, policy="fixed", block=4, drafter=scripted, stop_at_eos=False)
        assert spec.tokens == plain, "speculation changed the output"
        runs.append(spec.stats.decode_tokens_per_s)
    out["scripted4_tok_s"] = statistics.median(runs)
    out.update(served(rt, new))
    return out


def served(rt, new: int) -> dict:
    """The scheduler's tokens/s under n concurrent requests of `new` tokens, each equal to its solo run."""
    import threading

    import torch

    from turbo import GenerationOptions
    from turbo.serve.scheduler import Request, Scheduler, ServeLimits

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, min(rt.trunk.arch.vocab, 4000), (64,), generator=g).tolist() for _ in range(max(CLIENTS))]
    opts = GenerationOptions(max_new_tokens=new, policy="off", stop_at_eos=False)
    alone = [rt.generate(p, opts).tokens for p in prompts]
    out = {}
    for n in CLIENTS:
        sched = Scheduler(rt, ServeLimits(max_running=max(CLIENTS)))
        got: dict[int, list[int]] = {i: [] for i in range(n)}
        done = threading.Semaphore(0)

        def sink(i: int):
            def take(d) -> None:
                if isinstance(d, Exception):
                    raise d
                got[i].extend(d.tokens)
                if d.finish is not None:
                    done.release()
            return take

        sched.start()
        t = time.perf_counter()
        for i in range(n):
            sched.submit(Request(prompts[i], opts), sink(i))
        for _ in range(n):
            done.acquire()
        seconds = time.perf_counter() - t
        sched.stop()
        assert all(got[i] == alone[i] for i in range(n)), f"a served request of {n} differs from its solo run"
        out[f"serve{n}_tok_s"] = n * new / seconds
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print(json.dumps(worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--shape", default="qwen3.5-0.8b")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    from scripts import benchlib  # (the driver's: the workers import their tree)
    from turbo.store.install import BUNDLED_DIR
    from turbo.testing import shapes

    installs = {"tiny": (str(BUNDLED_DIR / "tiny"), 200, 256), args.shape: (str(shapes.build(args.shape)), 8, 48)}
    runs: dict[tuple[str, str], list[dict]] = {}
    guard, seen = benchlib.Guard.from_env(args.threads), []
    for rep in range(args.reps):
        for shape, (path, calls, new) in installs.items():
            pair, quiet = {}, True
            for name, tree in (("old", args.old), ("new", args.new)):
                env = dict(os.environ, PYTHONPATH=str(tree.resolve()), OMP_NUM_THREADS=str(args.threads))
                with guard.rep(f"rep {rep} {shape} {name}") as g:
                    done = subprocess.run([sys.executable, __file__, "--worker", path, str(calls), str(new)],
                                          env=env, cwd=tree, capture_output=True, text=True, check=True)
                seen.append({"guard": dataclasses.asdict(g)})
                pair[name], quiet = json.loads(done.stdout.strip().splitlines()[-1]), quiet and not g.disturbed
            for name, rec in pair.items() if quiet else ():  # a pair with a disturbed half is dropped
                runs.setdefault((shape, name), []).append(rec)
        print(f"rep {rep + 1}/{args.reps} done, load {os.getloadavg()[0]:.2f}", file=sys.stderr)
    print(benchlib.guard_summary(seen))
    for shape in installs:
        if (shape, "old") not in runs:
            print(f"\n{shape}: every pair disturbed")
            continue
        print(f"\n{shape}: {len(runs[shape, 'old'])} undisturbed of {args.reps} interleaved pairs, "
              f"{args.threads} thread(s)\n")
        print("| figure | old | new | new / old |\n| --- | ---: | ---: | ---: |")
        for k in FIGURES:
            old, new = ([r[k] for r in runs[shape, n]] for n in ("old", "new"))
            ratio = [b / a for a, b in zip(old, new)]
            cell = lambda xs: f"{statistics.median(xs):.3f} ({min(xs):.3f}..{max(xs):.3f})"  # noqa: E731
            print(f"| {k} | {cell(old)} | {cell(new)} | {cell(ratio)} |")


if __name__ == "__main__":
    main()
