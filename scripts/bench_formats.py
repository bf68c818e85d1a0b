"""Decode speed of installs converted from the formats people download (docs/formats.md), beside
turbo's own int4 / int8 / bf16 installs of the same random weights, interleaved.

    python scripts/bench_formats.py [--shape qwen3.5-0.8b] [--threads 2] [--reps 3] [--tokens 64] [--no-llama]
    python scripts/bench_formats.py --shape tiny --reps 1 --tokens 4        # a quick check that it runs

The shape's bf16 checkpoint (turbo.testing.shapes) is rewritten in each source format
(turbo.testing.source_formats: AWQ int4 g128, GPTQ int4 g32 symmetric, Qwen's FP8 in 128 x 128
blocks; turbo.testing.gguf_writer: GGUF Q4_K and Q8_0), each repacked by `python -m turbo.repack`
into what it converts to (int4g128, int4g32, fp8, int4g32, int8g32: read as stored by the native
step, native_exact.py), and turbo's own installs by `--quant int4 / int8` and as stored (bf16).
Every install decodes --tokens greedy tokens after a 32-token prompt in a fresh process, one
system after the other, --reps times (scripts/benchlib.py); medians, spreads, step and bytes
on disk are printed. llama.cpp (llama_cpp, where importable; --no-llama: not) decodes each GGUF the
converted installs came from in the same round, same prompt, greedy, same threads: its line says
where its tokens first differ from the converted install's. A GGUF llama.cpp does not open (the
shapes' small tokenizers: a token list shorter than the vocab) is left out, saying why. Built sources and installs are cached
beside the shape's.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from turbo.repack import repack
from turbo.testing import shapes
from turbo.testing.gguf_writer import write_gguf
from turbo.testing.source_formats import write_fp8, write_int4

import benchlib  # scripts/benchlib.py, beside this file

ROOT = Path(__file__).resolve().parent.parent

# name: (how the source is written from the bf16 checkpoint, what repack makes of it)
SOURCES = {
    "awq-g128": (lambda d: write_int4(d, "awq", 128, reference=False), "int4g128"),
    "gptq-g32": (lambda d: write_int4(d, "gptq", 32, sym=True, reference=False), "int4g32"),
    "fp8": (lambda d: write_fp8(d, reference=False), "fp8"),
}
GGUF = {"gguf-q4_k": ("Q4_K", "int4g32"), "gguf-q8_0": ("Q8_0", "int8g32")}
OWN = {"turbo-int4": "int4", "turbo-int8": "int8", "turbo-bf16": "none"}  # (bf16: the shape's own dtype; tiny's is fp32)


def stale(install: Path) -> bool:
    """Missing, or built before the repack code last changed (the converted layouts move with it)."""
    built = install / "model.safetensors"
    return not built.is_file() or built.stat().st_mtime < max(f.stat().st_mtime for f in (ROOT / "turbo").glob("repack*.py"))


def converted(shape: str, cache: Path) -> dict[str, tuple[Path, str]]:
    """{name: (install, its format)} for every source, each written and repacked once (a GGUF's
    file: `gguf_file`)."""
    hf, base = shapes.checkpoint(shape, cache), cache / shape
    out = {}
    for name, (write, fmt) in SOURCES.items():
        src, install = base / f"src-{name}", base / f"install-{name}"
        if stale(install):
            shutil.rmtree(install, ignore_errors=True)
            shutil.rmtree(src, ignore_errors=True)
            shutil.copytree(hf, src)
            write(src)
            repack(src, install, quiet=True)
        out[name] = (install, fmt)
    for name, (qtype, fmt) in GGUF.items():
        path, install = gguf_file(shape, cache, qtype), base / f"install-{name}"
        if stale(install):
            shutil.rmtree(install, ignore_errors=True)
            if not path.is_file():
                write_gguf(hf, path, qtype, mtp="none")
            repack(path, install, quiet=True)
        out[name] = (install, fmt)
    for name, quant in OWN.items():
        out[name] = (shapes.build(shape, cache, quant=quant), {"none": "as stored"}.get(quant, quant))
    return out


def gguf_file(shape: str, cache: Path, qtype: str) -> Path:
    return cache / shape / f"model-{qtype}.gguf"


def llama_cpp_opens(path: Path) -> bool:
    """Whether llama.cpp (llama_cpp, optional: pip install llama-cpp-python) opens the GGUF, tried in
    a process of its own; if not, one line on stderr says why (a failing worker would end the run)."""
    done = subprocess.run([sys.executable, "-c", "import sys; from llama_cpp import Llama; "
                           "Llama(model_path=sys.argv[1], n_ctx=16, verbose=False)", str(path)],
                          capture_output=True, text=True)
    if done.returncode:
        print(f"llama.cpp left out on {path.name}: {(done.stderr.strip().splitlines() or ['failed'])[-1]}",
              file=sys.stderr)
    return done.returncode == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.5-0.8b", choices=sorted(shapes.SHAPES))
    ap.add_argument("--cache", type=Path, default=shapes.DEFAULT_CACHE)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--no-llama", action="store_true", help="leave llama.cpp out")
    args = ap.parse_args()
    installs = converted(args.shape, args.cache)
    specs = {name: benchlib.Spec("turbo", str(path), args.threads, [32], args.tokens, env={"PYTHONPATH": str(ROOT)})
             for name, (path, _) in installs.items()}
    llama = {} if args.no_llama else {
        f"llama.cpp-{name[5:]}": (name, path) for name, (qtype, _) in GGUF.items()
        if llama_cpp_opens(path := gguf_file(args.shape, args.cache, qtype))}
    specs |= {who: benchlib.Spec("llama.cpp", str(path), args.threads, [32], args.tokens)
              for who, (_, path) in llama.items()}
    records = benchlib.run(specs, args.reps, timeout=900)
    print(f"{args.shape}, {args.threads} threads, {args.tokens} tokens after 32, {args.reps} reps (interleaved)")
    print(f"{'install':12s} {'format':9s} {'step':7s} {'GB':>6s}  decode tok/s: median [min, max]")
    for name, (path, fmt) in installs.items():
        mine = [r for r in records if r["system"] == name]
        if not mine:
            print(f"{name:12s} {fmt:9s} (no run finished)")
            continue
        v = [r["32"]["decode_tps"] for r in mine]
        size = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e9
        print(f"{name:12s} {fmt:9s} {mine[0]['step']:7s} {size:6.2f}  {statistics.median(v):.1f} "
              f"[{min(v):.1f}, {max(v):.1f}]")
    for who, (name, path) in llama.items():
        mine, theirs = ([r for r in records if r["system"] == s] for s in (who, name))
        if not mine:
            print(f"{who:12s} (no run finished)")
            continue
        v = [r["32"]["decode_tps"] for r in mine]
        split = benchlib.first_divergence(mine[0]["32"]["tokens"], theirs[0]["32"]["tokens"]) if theirs else None
        same = "tokens: the same" if split is None else f"tokens differ from {name}'s at {split}"
        print(f"{who:12s} {'gguf':9s} {'':7s} {path.stat().st_size / 1e9:6.2f}  {statistics.median(v):.1f} "
              f"[{min(v):.1f}, {max(v):.1f}]  ({same})")


if __name__ == "__main__":
    main()
