"""Decode speed of installs converted from the formats people download (docs/formats.md), beside
turbo's own int4 / int8 / bf16 installs of the same random weights, interleaved.

    python -m scripts.bench_formats [--shape qwen3.5-0.8b] [--threads 2] [--reps 3] [--tokens 64] [--no-llama]
    python -m scripts.bench_formats --shape tiny --reps 1 --tokens 4        # a quick check that it runs
    python -m scripts.bench_formats --only fp8 fp8+int8 turbo-int8 awq-g128+int4 turbo-int4 --no-llama

The shape's bf16 checkpoint (turbo.testing.shapes) is rewritten in each source format
(turbo.testing.source_formats: AWQ int4 g128, GPTQ int4 g32 symmetric, Qwen's FP8 in 128 x 128
blocks; turbo.testing.gguf_writer: GGUF Q4_K and Q8_0), each repacked by `python -m turbo.repack`
into what it converts to (int4g128, int4g32, fp8, int4g32, int8g32: read as stored by the native
step, native_exact.py; FP8 and AWQ / GPTQ also with --float-quant: "+int8" / "+int4"), and turbo's own installs by `--quant int4 / int8` and as stored (bf16).
The GGUFs llama.cpp itself quantizes from the shape's bf16 GGUF (turbo.testing.shapes.gguf: Q8_0,
Q4_0, Q4_K_M; where the bf16 GGUF is there or $LLAMA_CONVERT_DIR can make it) are repacked too
(llama-*: the Q6_K tensors llama.cpp puts in its Q4_0 and Q4_K_M, the tied embedding among them,
re-quantized with --quant int8).
Every install decodes --tokens greedy tokens after a 32-token prompt in a fresh process, one
system after the other, --reps times (scripts/benchlib.py); medians, spreads, step and bytes
on disk are printed. llama.cpp (llama_cpp, where importable; --no-llama: not) decodes each GGUF the
converted installs came from in the same round, same prompt, greedy, same threads: its line says
where its tokens first differ from the converted install's (reported, not a failure: llama.cpp
rounds the activations to 8 bits in its quantized products). Each GGUF is first tried in a process
of its own: where llama.cpp's weight repacking crashes (llama-cpp-python 0.3.36 on an AMX host) it
runs without it (benchlib.LLAMA_PLAIN, said in one line), and a GGUF it does not open or run is
left out, saying why. Built sources and installs are cached beside the shape's, rebuilt when
turbo/repack/*.py or backends/native_exact.py (or the GGUF writer, for its GGUFs) is newer.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from scripts import benchlib
from turbo.repack import repack
from turbo.testing import shapes
from turbo.testing.gguf_writer import write_gguf
from turbo.testing.source_formats import write_fp8, write_int4

ROOT = Path(__file__).resolve().parent.parent

# name: (how the source is written from the bf16 checkpoint, what repack makes of it)
SOURCES = {
    "awq-g128": (lambda d: write_int4(d, "awq", 128, reference=False), "int4g128"),
    "gptq-g32": (lambda d: write_int4(d, "gptq", 32, sym=True, reference=False), "int4g32"),
    "fp8": (lambda d: write_fp8(d, reference=False), "fp8"),
}
# a source repacked with --float-quant too (its float matrices and tied head in turbo's own format)
FLOATS = {"fp8": "int8", "awq-g128": "int4", "gptq-g32": "int4"}
GGUF = {"gguf-q4_k": ("Q4_K", "int4g32"), "gguf-q8_0": ("Q8_0", "int8g32")}  # written by gguf_writer
# quantized by llama.cpp (shapes.gguf kinds): kind -> (repack's --quant for the types it re-quantizes, format)
LLAMA = {"q8_0": ("none", "int8g32"), "q4_0": ("int8", "int4g32+int8"), "q4_k_m": ("int8", "int4g32+int8")}
OWN = {"turbo-int4": "int4", "turbo-int8": "int8", "turbo-bf16": "none"}  # (bf16: the shape's own dtype; tiny's is fp32)
WRITER = ROOT / "turbo" / "testing" / "gguf_writer.py"


def newer(path: Path, *than: Path) -> bool:
    """`path` is missing or older than any of `than`."""
    return not path.is_file() or path.stat().st_mtime < max(f.stat().st_mtime for f in than)


def stale(install: Path, *sources: Path) -> bool:
    """Missing, or built before the repack code, the exact formats' packing (its open layout) or
    its source file last changed (the converted layouts move with them)."""
    return newer(install / "model.safetensors", *(ROOT / "turbo" / "repack").glob("*.py"),
                 ROOT / "turbo" / "backends" / "native_exact.py", *sources)


def converted(shape: str, cache: Path) -> tuple[dict[str, tuple[Path, str]], dict[str, Path]]:
    """({name: (install, its format)}, {name: the GGUF it came from}) for every source, each
    written and repacked once."""
    hf, base = shapes.checkpoint(shape, cache), cache / shape
    out, ggufs = {}, {}
    for name, (write, fmt) in SOURCES.items():
        src, install = base / f"src-{name}", base / f"install-{name}"
        if stale(install):
            shutil.rmtree(install, ignore_errors=True)
            shutil.rmtree(src, ignore_errors=True)
            shutil.copytree(hf, src)
            write(src)
            repack(src, install, quiet=True)
        out[name] = (install, fmt)
        if name in FLOATS:
            floats = base / f"install-{name}-floats-{FLOATS[name]}"
            if stale(floats, install / "model.safetensors"):
                shutil.rmtree(floats, ignore_errors=True)
                repack(src, floats, quiet=True, float_quant=FLOATS[name])
            out[f"{name}+{FLOATS[name]}"] = (floats, f"{fmt}+{FLOATS[name]}")
    for name, (qtype, fmt) in GGUF.items():
        path, install = base / f"model-{qtype}-writer.gguf", base / f"install-{name}"
        if newer(path, WRITER):
            write_gguf(hf, path, qtype, mtp="none")
        ggufs[name] = path
        out[name] = (install, fmt)
    for kind, (quant, fmt) in LLAMA.items():
        path = shapes.gguf(shape, kind, cache)
        if path is None:
            print(f"llama-{kind} left out: no bf16 GGUF of {shape} (set ${shapes.CONVERTER_ENV})", file=sys.stderr)
            continue
        ggufs[f"llama-{kind}"] = path
        out[f"llama-{kind}"] = (base / f"install-llama-{kind}", fmt)
    for name, path in ggufs.items():
        install = out[name][0]
        if stale(install, path):
            shutil.rmtree(install, ignore_errors=True)
            repack(path, install, quiet=True, quant=LLAMA.get(name[6:], ("none",))[0])
    for name, quant in OWN.items():
        out[name] = (shapes.build(shape, cache, quant=quant), {"none": "as stored"}.get(quant, quant))
    return out, ggufs


LLAMA_TRY = ("import sys; from llama_cpp import Llama; import llama_cpp.llama as lib; "
             "from scripts import benchlib; d = lib.llama_cpp.llama_model_default_params; "
             "plain = sys.argv[2] == '1'; lib.llama_cpp.llama_model_default_params = "
             "(lambda: benchlib._plain(d())) if plain else d; "
             "m = Llama(model_path=sys.argv[1], n_ctx=16, verbose=False); m.eval([5, 17])")


def llama_cpp_env(path: Path) -> dict | None:
    """The environment llama.cpp (llama_cpp, optional: pip install llama-cpp-python) runs the GGUF
    in, tried (opened, two tokens evaluated) in a process of its own, as it is, else with its weight
    repacking off (one line says so); None, with one line saying why, where neither runs (a
    failing worker would end the run)."""
    code = LLAMA_TRY
    why = "failed"
    for plain in (False, True):
        done = subprocess.run([sys.executable, "-c", code, str(path), "1" if plain else "0"], capture_output=True,
                              text=True, cwd=ROOT)  # (-c: the root on the path, scripts/ a package there)
        if done.returncode == 0:
            if plain:
                print(f"llama.cpp on {path.name}: its weight repacking crashes here (exit {why}), "
                      f"run without it ({benchlib.LLAMA_PLAIN}=1)", file=sys.stderr)
            return {benchlib.LLAMA_PLAIN: "1"} if plain else {}
        why = (done.stderr.strip().splitlines() or [str(done.returncode)])[-1]
    print(f"llama.cpp left out on {path.name}: {why}", file=sys.stderr)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.5-0.8b", choices=sorted(shapes.SHAPES))
    ap.add_argument("--cache", type=Path, default=shapes.DEFAULT_CACHE)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--no-llama", action="store_true", help="leave llama.cpp out")
    ap.add_argument("--only", nargs="+", help="run only these installs (and llama.cpp on these GGUFs)")
    args = ap.parse_args()
    installs, ggufs = converted(args.shape, args.cache)
    if args.only:
        installs = {n: v for n, v in installs.items() if n in args.only}
        ggufs = {n: v for n, v in ggufs.items() if n in args.only}
    specs = {name: benchlib.Spec("turbo", str(path), args.threads, [32], args.tokens, env={"PYTHONPATH": str(ROOT)})
             for name, (path, _) in installs.items()}
    llama = {} if args.no_llama else {f"llama.cpp-{name.split('-', 1)[1]}": (name, path, env)
                                      for name, path in ggufs.items() if (env := llama_cpp_env(path)) is not None}
    specs |= {who: benchlib.Spec("llama.cpp", str(path), args.threads, [32], args.tokens, env=env)
              for who, (_, path, env) in llama.items()}
    ran = benchlib.run(specs, args.reps, timeout=900)
    records = benchlib.kept(ran)  # undisturbed repetitions only (benchlib.Guard)
    print(f"{args.shape}, {args.threads} threads, {args.tokens} tokens after 32, {args.reps} reps (interleaved)")
    print(benchlib.guard_summary(ran))
    print(f"{'install':16s} {'format':12s} {'step':7s} {'GB':>6s}  decode tok/s: median [min, max]")
    for name, (path, fmt) in installs.items():
        mine = [r for r in records if r["system"] == name]
        if not mine:
            print(f"{name:16s} {fmt:12s} (no run finished)")
            continue
        v = [r["32"]["decode_tps"] for r in mine]
        size = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e9
        print(f"{name:16s} {fmt:12s} {mine[0]['step']:7s} {size:6.2f}  {statistics.median(v):.1f} "
              f"[{min(v):.1f}, {max(v):.1f}]")
    for who, (name, path, env) in llama.items():
        mine, theirs = ([r for r in records if r["system"] == s] for s in (who, name))
        if not mine:
            print(f"{who:16s} (no run finished)")
            continue
        v = [r["32"]["decode_tps"] for r in mine]
        split = benchlib.first_divergence(mine[0]["32"]["tokens"], theirs[0]["32"]["tokens"]) if theirs else None
        same = "tokens: the same" if split is None else f"tokens differ from {name}'s at {split}"
        print(f"{who:16s} {'gguf':12s} {'plain' if env else '':7s} {path.stat().st_size / 1e9:6.2f}  "
              f"{statistics.median(v):.1f} [{min(v):.1f}, {max(v):.1f}]  ({same})")


if __name__ == "__main__":
    main()
