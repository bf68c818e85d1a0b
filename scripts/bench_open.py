"""Open time and peak RSS while opening: turbo's installs against llama.cpp's GGUFs, each open in a
fresh process, interleaved (A, B, A, B, ...), then the first token (a one-token prompt: the
pages a step reads come in there for a mapped file).

    python -m scripts.bench_open INSTALL_OR_GGUF ... [--reps 3] [--threads 2]
    python -m scripts.bench_open --shape qwen3.5-0.8b --quant int4 --gguf q4_0 --reps 3
    python -m scripts.bench_open --shape tiny --reps 1          # a check that it runs

A directory is a turbo install (opened with turbo.open), a .gguf is opened with llama_cpp.Llama
(use_mmap, its default). Per open: seconds to open, the peak RSS grown while opening (VmHWM after,
reset by /proc/self/clear_refs, less VmRSS before) against the weights' bytes (an install's
model.safetensors, or the GGUF file; an install's open layout, packed.safetensors, shown
apart), then the seconds to the first token and the RSS after it. Prints medians [min, max] per
system and each system's open time against the first's. The page cache is left as it is: run
each system once before timing (--warm, default 1) so every one reads its files from memory.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        return 1024 * int(next(line for line in f if line.startswith(key)).split()[1])


def worker(path: str, threads: int) -> dict:
    """One open of `path` in this process, and its first token."""
    gguf = path.endswith(".gguf")
    if gguf:
        from llama_cpp import Llama  # optional benchmark dependency (pip install llama-cpp-python)
    else:  # (what turbo.open imports on first use, imported here: the open is timed, not the imports)
        import turbo
        import turbo.engine  # noqa: F401
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM from here
    before = status("VmRSS")
    t0 = time.perf_counter()
    sut = (Llama(model_path=path, n_ctx=64, n_threads=threads, n_threads_batch=threads, verbose=False) if gguf
           else turbo.open(path, threads=threads))
    open_s = time.perf_counter() - t0
    rec = {"open_s": open_s, "open_grown": status("VmHWM") - before, "rss_before": before}
    t0 = time.perf_counter()
    if gguf:
        sut.eval([3])
    else:
        rec["step"] = sut.trunk.step_name
        sut.generate([3], max_new_tokens=1, policy="off")
    rec |= {"first_token_s": time.perf_counter() - t0, "rss_after_token": status("VmRSS") - before}
    return rec


def weights(path: Path) -> tuple[int, int]:
    """(the weights' bytes, the open layout's): a GGUF's file, an install's model*.safetensors."""
    if path.suffix == ".gguf":
        return path.stat().st_size, 0
    layout = path / "packed.safetensors"
    own = sum(f.stat().st_size for f in path.glob("*.safetensors") if f != layout)
    return own, layout.stat().st_size if layout.is_file() else 0


def run(paths: list[Path], reps: int, warm: int, threads: int, timeout: float) -> dict[str, list[dict]]:
    """Every path's worker per repetition, interleaved; the timed ones under benchlib's
    quiet-machine guard (each record's `guard`)."""
    from scripts import benchlib  # (here, not in the worker: it imports torch)

    records: dict[str, list[dict]] = {str(p): [] for p in paths}
    guard = benchlib.Guard.from_env(threads)
    for rep in range(-warm, reps):
        for p in paths:
            cmd = [sys.executable, "-m", "scripts.bench_open", "--worker", str(p), "--threads", str(threads)]
            with guard.rep(f"rep {rep} {p.name}") if rep >= 0 else contextlib.nullcontext() as g:
                done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
            if done.returncode != 0:
                raise SystemExit(f"{p}: {done.stderr.strip()[-2000:]}")
            rec = json.loads(done.stdout.strip().splitlines()[-1])
            rec["guard"] = dataclasses.asdict(g) if g is not None else None
            said = [line for line in done.stderr.splitlines() if line.startswith("note:")]
            tag = "warm" if rep < 0 else f"rep {rep}" + (" (disturbed)" if g.disturbed else "")
            print(f"{tag} {p.name}: open {rec['open_s']:.2f} s, grown "
                  f"{rec['open_grown'] / 2**20:.0f} MiB, first token {rec['first_token_s']:.2f} s"
                  + "".join(f"\n  {line}" for line in said), file=sys.stderr)
            if rep >= 0:
                records[str(p)].append(rec)
    return records


def med(values: list[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}, {fmt.format(max(values))}]"


def table(ran: dict[str, list[dict]], threads: int) -> None:
    """The undisturbed repetitions' medians (benchlib.Guard), and how many were kept."""
    from scripts import benchlib

    records = {path: benchlib.kept(recs) for path, recs in ran.items()}
    print(benchlib.guard_summary([r for recs in ran.values() for r in recs]))
    print(f"| system ({threads} threads) | open s | peak RSS grown while opening / weights | first token s "
          f"| weights MiB (+ open layout) | open vs the first |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    first = None
    for path, recs in records.items():
        if not recs:
            continue
        own, layout = weights(Path(path))
        opened = statistics.median(r["open_s"] for r in recs)
        first = first or opened
        kind = "llama.cpp" if path.endswith(".gguf") else f"turbo ({recs[0].get('step')})"
        print(f"| {kind} {Path(path).name} | {med([r['open_s'] for r in recs])} | "
              f"{med([r['open_grown'] / own for r in recs])} | {med([r['first_token_s'] for r in recs])} | "
              f"{own / 2**20:.0f}{f' (+{layout / 2**20:.0f})' if layout else ''} | {opened / first:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="*", type=Path, help="turbo install directories and .gguf files")
    ap.add_argument("--shape", help="a shape of turbo.testing.shapes: its install (and --gguf) built once")
    ap.add_argument("--quant", default="none", help="with --shape: the install's --quant")
    ap.add_argument("--gguf", help="with --shape: the GGUF kind beside it (bf16, q4_0)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warm", type=int, default=1, help="untimed opens first (the page cache)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.threads)))
        return
    paths = list(args.paths)
    if args.shape:
        from turbo.testing import shapes

        paths.append(shapes.build(args.shape, quant=args.quant))
        if args.gguf:
            g = shapes.gguf(args.shape, args.gguf)
            if g is None:
                raise SystemExit(f"no {args.gguf} GGUF of {args.shape} (set {shapes.CONVERTER_ENV}; docs/llamacpp.md)")
            paths.append(g)
    if not paths:
        raise SystemExit("nothing to open: give installs / GGUFs, or --shape")
    table(run(paths, args.reps, args.warm, args.threads, args.timeout), args.threads)


if __name__ == "__main__":
    main()
