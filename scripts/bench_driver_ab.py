"""The engine's speed in two checkouts, interleaved: plain decode, a speculative generation (a
scripted drafter landing each proposal with probability 0.8, so only the engine's costs vary),
and the server's scheduler under 1 / 4 / 8 concurrent requests, at one shape.

    python scripts/bench_driver_ab.py --vs OTHER_CHECKOUT [--shape tiny|qwen3.5-0.8b] [--reps 3]
        [--installs THIS_DIR OTHER_DIR]

Each repetition runs this checkout, then OTHER_CHECKOUT (its turbo imported through PYTHONPATH),
each a fresh process timing every figure once, after one untimed run of each (its native build,
its open layout written); medians over --reps with the spread (min..max) and the ratio of the
medians. --installs: a copy of the shape's install for each (two checkouts may write different
open layouts into it). Every figure is checked against the same request alone (tokens equal),
so a faster run is never a different answer. A benchmark, not a test: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLIENTS = (1, 4, 8)


def measure(shape: str, threads: int, new: int, install: str | None) -> dict:
    """One checkout's figures (the turbo on sys.path), in this process."""
    import torch

    import turbo
    from turbo.sequence.options import GenerationOptions
    from turbo.serve.scheduler import Request, Scheduler, ServeLimits
    from turbo.testing import ScriptedDrafter, shapes

    from bench_round import landed_schedule  # scripts/, beside this file

    torch.set_num_threads(threads)
    rt = turbo.open(install or str(shapes.build(shape)), backend="cpu")
    vocab = rt.trunk.arch.vocab
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, min(vocab, 4000), (64,), generator=g).tolist() for _ in range(max(CLIENTS))]
    out: dict[str, float] = {}
    rt.generate(prompts[0], max_new_tokens=4, policy="off")  # warm up (the native build, first touches)
    plain = rt.generate(prompts[0], max_new_tokens=new, policy="off", stop_at_eos=False)
    out["decode tok/s"] = plain.stats.decode_tokens_per_s
    scripted = ScriptedDrafter(prompts[0] + plain.tokens, landed_schedule(0.8, 4), vocab)
    spec = rt.generate(prompts[0], max_new_tokens=new, policy="fixed", block=4, drafter=scripted, stop_at_eos=False)
    assert spec.tokens == plain.tokens, "speculation changed the output"
    out["spec b4 tok/s"] = spec.stats.decode_tokens_per_s
    alone = {}
    for n in CLIENTS:
        sched = Scheduler(rt, ServeLimits(max_running=max(CLIENTS)))
        got: dict[int, list[int]] = {i: [] for i in range(n)}
        done = threading.Semaphore(0)

        def sink(i):
            def take(d):
                if isinstance(d, Exception):
                    raise d
                got[i].extend(d.tokens)
                if d.finish is not None:
                    done.release()
            return take

        sched.start()
        t = time.perf_counter()
        for i in range(n):
            sched.submit(Request(prompts[i], GenerationOptions(max_new_tokens=new // 2, policy="off",
                                                               stop_at_eos=False)), sink(i))
        for _ in range(n):
            done.acquire()
        seconds = time.perf_counter() - t
        sched.stop()
        for i in range(n):
            if i not in alone:
                alone[i] = rt.generate(prompts[i], max_new_tokens=new // 2, policy="off", stop_at_eos=False).tokens
            assert got[i] == alone[i], f"served request {i} of {n} differs from its solo run"
        out[f"server {n} clients tok/s"] = n * (new // 2) / seconds
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vs", help="the other checkout (its root)")
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=96, help="tokens a generation (the served ones half)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--installs", nargs=2, metavar=("THIS", "OTHER"), help="an install directory for each")
    ap.add_argument("--install", help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        figures = measure(args.shape, args.threads, args.new, args.install)
        import turbo  # (imported by measure: which checkout's it was)
        print(json.dumps({"tree": str(Path(turbo.__file__).resolve().parents[1]), **figures}))
        return
    trees = {"this": ROOT, "other": Path(args.vs).resolve()}
    installs = dict(zip(trees, args.installs)) if args.installs else {}
    runs: dict[str, list[dict]] = {k: [] for k in trees}

    def child(name: str) -> dict:
        tree = trees[name]
        env = {**os.environ, "PYTHONPATH": str(tree)}
        cmd = [sys.executable, __file__, "--child", "--shape", args.shape, "--threads", str(args.threads),
               "--new", str(args.new)] + (["--install", installs[name]] if name in installs else [])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{name} ({tree}) failed: {proc.stderr.strip().splitlines()[-1:]}")
        figures = json.loads(proc.stdout.strip().splitlines()[-1])
        if Path(figures.pop("tree")) != tree:
            sys.exit(f"{name}: imported turbo from outside {tree} (is {tree} a checkout?)")
        return figures

    for name in trees:  # untimed: each checkout's native build and open layout in place
        child(name)
    for rep in range(args.reps):
        for name in trees:
            load = os.getloadavg()[0]
            runs[name].append(child(name))
            print(f"rep {rep + 1} {name}: load {load:.2f} before", file=sys.stderr)
    print(f"shape {args.shape}, {args.threads} threads, {args.new} tokens, medians of {args.reps} interleaved "
          f"runs (min..max); this = {trees['this']}, other = {trees['other']}\n")
    print("| figure | this | other | this / other |\n| --- | ---: | ---: | ---: |")
    for key in runs["this"][0]:
        a, b = ([r[key] for r in runs[n]] for n in trees)
        cell = lambda xs: f"{statistics.median(xs):.1f} ({min(xs):.1f}..{max(xs):.1f})"  # noqa: E731
        print(f"| {key} | {cell(a)} | {cell(b)} | {statistics.median(a) / statistics.median(b):.3f} |")


if __name__ == "__main__":
    main()
