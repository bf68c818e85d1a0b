"""The native step of two revisions of native*.c, interleaved in one process: a decode step and
a verify of R rows (plain, keeping checkpoints) and optionally a prefill, on a published shape,
random weights.

    python -m scripts.bench_builds e93c3d2 HEAD [--format int4 bf16] [--reps 7] [--rows 9] [--prefill 512]

Each revision's C sources (git show REV:turbo/backends/native*.c) are built as turbo builds
them and loaded side by side; each repetition times both on the same loaded install, one after
the other, so the machine's drift falls on both. Only the C step differs (the Python around
it is this checkout's), and the revisions' structs must match this checkout's. Medians
(min..max) of --reps. A benchmark, not a test: time it under the machine's bench lock.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import turbo
from scripts import benchlib
from scripts.benchlib import step_times
from turbo.backends import native_build, native_lib
from turbo.testing import shapes

ROOT = Path(__file__).resolve().parent.parent
QUANT = {"bf16": "none", "int8": "int8", "int4": "int4"}


def build(rev: str, out: Path) -> ctypes.CDLL:
    """native*.c and native.h at `rev`, compiled into out/REV.so and loaded with turbo's signatures."""
    src = out / rev
    src.mkdir()
    names = subprocess.run(["git", "ls-tree", "--name-only", rev, "turbo/backends/"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    sources = []
    for name in names:
        if Path(name).name.startswith("native") and name.endswith((".c", ".h")):
            text = subprocess.run(["git", "show", f"{rev}:{name}"], cwd=ROOT, check=True, capture_output=True).stdout
            (src / Path(name).name).write_bytes(text)
            sources += [str(src / Path(name).name)] if name.endswith(".c") else []
    lib_path = out / f"{rev}.so"
    done = subprocess.run(["cc", *native_build.FLAGS[0], "-shared", "-fPIC", "-o", str(lib_path), *sources, "-lm"],
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{rev}: the build failed: {done.stderr.strip()[-500:]}")
    lib = ctypes.CDLL(str(lib_path))
    for name, args in native_lib.SIGNATURES.items():
        if hasattr(lib, name):
            fn = getattr(lib, name)
            fn.argtypes = [native_lib._C[a] for a in args.split()]
            fn.restype = ctypes.c_int if name in native_lib.RETURNS_INT else None
    if native_lib._struct_mismatch(lib):
        raise SystemExit(f"{rev}: its structs are not this checkout's ({native_lib._struct_mismatch(lib)})")
    return lib


def prefill_time(rt, tokens: int) -> float:
    """Seconds of a prefill of `tokens` tokens (logits of the last row only)."""
    st = rt.trunk.new_state(tokens + 1)
    ids = torch.randint(0, 4000, (tokens,), generator=torch.Generator().manual_seed(2)).tolist()
    t = time.perf_counter()
    rt.trunk.prefill(st, ids)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("revs", nargs=2, help="two git revisions (the first is the baseline)")
    ap.add_argument("--shape", default="qwen3.5-0.8b", choices=sorted(shapes.SHAPES))
    ap.add_argument("--format", nargs="+", default=["int4", "bf16"], choices=tuple(QUANT))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=9)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--calls", type=int, default=6, help="steps per timing")
    ap.add_argument("--prefill", type=int, default=0, metavar="TOKENS",
                    help="also time a prefill of this many tokens (tok/s)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if native_lib.library() is None:
        raise SystemExit(f"the native library is unavailable: {native_lib.why_not()}")
    with tempfile.TemporaryDirectory() as tmp:
        libs = {rev: build(rev, Path(tmp)) for rev in args.revs}
        rts = {f: turbo.open(str(shapes.build(args.shape, quant=QUANT[f])), backend="cpu") for f in args.format}
        prompt = torch.randint(0, 4000, (128,), generator=torch.Generator().manual_seed(0)).tolist()
        got: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
        filled: dict[tuple[str, str], list[float]] = {}
        guard, seen = benchlib.Guard.from_env(args.threads), []
        for rep in range(args.reps):
            for f, rt in rts.items():
                for rev, lib in libs.items():
                    native_lib._lib, native_lib._threads = lib, 0  # threaded() sets the count on this library
                    with guard.rep(f"rep {rep} {f} {rev}") as g:
                        t = step_times(rt, prompt, [args.rows], args.calls)
                        tps = args.prefill / prefill_time(rt, args.prefill) if args.prefill else None
                    seen.append({"guard": dataclasses.asdict(g)})
                    if g.disturbed:  # dropped (benchlib.Guard)
                        continue
                    got.setdefault((f, rev), []).append((t["decode"], t[args.rows, None], t[args.rows, "checkpoint"]))
                    if tps is not None:
                        filled.setdefault((f, rev), []).append(tps)
    print(f"{args.shape}, {args.threads} threads, medians of the undisturbed of {args.reps} interleaved runs "
          f"(min..max), ms")
    print(benchlib.guard_summary(seen))
    print(f"| format | revision | decode step | verify {args.rows} rows | with checkpoints | "
          f"verify / step | with checkpoints |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for (f, rev), runs in got.items():
        cell = lambda i: f"{statistics.median(r[i] for r in runs) * 1e3:.1f} ({min(r[i] for r in runs) * 1e3:.1f}.." \
                         f"{max(r[i] for r in runs) * 1e3:.1f})"  # noqa: E731
        ratio = lambda i: f"{statistics.median(r[i] / r[0] for r in runs):.2f}"  # noqa: E731
        print(f"| {f} | {rev} | {cell(0)} | {cell(1)} | {cell(2)} | {ratio(1)} | {ratio(2)} |")
    for (f, rev), tps in filled.items():
        print(f"{f} {rev}: prefill {args.prefill} tokens {statistics.median(tps):.1f} tok/s "
              f"({min(tps):.1f}..{max(tps):.1f})")


if __name__ == "__main__":
    main()
