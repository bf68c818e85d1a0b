"""llama.cpp's own llama-bench beside the Python binding (llama-cpp-python, as scripts/benchlib.py
runs it for the other benchmarks) on the same GGUFs: the binding's figures are llama.cpp's only if
the two agree (within ~10%), so this is the check the comparisons rest on.

    nice -n 19 python -m scripts.build_llamacpp --binding          # once: the tools and the binding
    python -m scripts.bench_llamabench --shape qwen3.5-0.8b --gguf bf16 q8_0 q4_0 --reps 3
    python -m scripts.bench_llamabench --gguf-path model.gguf --prompts 32 --new 8 --depths --reps 1   # a smoke run

Per repetition and GGUF, interleaved, each a fresh process under benchlib's quiet-machine guard:
`llama-bench -m GGUF -p 512,4096 -n 128 -t 2 -r 1 -o json` (its defaults otherwise: warm-up runs,
n_batch 2048, n_ubatch 512, flash attention auto, weight repacking on), `llama-bench -p 0 -n 128
-d D` per --depths D (decode at context D, as the binding's decode after a D-token prompt), and
the binding's worker (benchlib.work: prefill of each prompt length, then --new greedy decode
steps at that context; a 1-token prompt for decode at depth 0). Prints, from the undisturbed
repetitions, each figure's medians [min, max] side by side and binding / llama-bench, with
llama-bench's build and settings. The binding runs flash attention off (its default) unless
--binding-flash-attn; llama-bench's --fa is passed through (-fa). By default the binding loads the
very libraries llama-bench runs (LLAMA_CPP_LIB_PATH, same commit: the figures then differ by the
harness alone); --binding-lib own: the ones pip built it with.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from scripts import benchlib, build_llamacpp

ROOT = Path(__file__).resolve().parent.parent
LIB_PATH = "LLAMA_CPP_LIB_PATH"  # llama-cpp-python's: the directory it loads libllama.so from


def llama_bench(gguf: Path, args, prompts: list[int], new: int, depth: int) -> list[dict]:
    """One llama-bench run (-r 1: the repetitions are ours, interleaved): its JSON records."""
    cmd = [str(build_llamacpp.tool("llama-bench")), "-m", str(gguf), "-p", ",".join(map(str, prompts)) or "0",
           "-n", str(new), "-d", str(depth), "-t", str(args.threads), "-r", "1", "-o", "json"]
    cmd += ["-fa", args.fa] if args.fa else []
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"llama-bench failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout)


def figure_of(rec: dict) -> str:
    """A llama-bench record's figure, named as the table's rows."""
    if rec["n_gen"] == 0:
        return f"prefill {rec['n_prompt']}" + (f" @ {rec['n_depth']}" if rec["n_depth"] else "")
    return f"decode {rec['n_gen']} @ {rec['n_depth']}"


def binding_lib(which: str) -> Path:
    """The directory the binding's libllama.so is loaded from: tools (llama-bench's), own (the
    package's lib/, named outright: an exported LLAMA_CPP_LIB_PATH would win otherwise), or a path."""
    if which == "tools":
        return build_llamacpp.bindir()
    if which == "own":
        return Path(importlib.util.find_spec("llama_cpp").origin).parent / "lib"
    return Path(which)


def run(ggufs: dict[str, Path], args) -> tuple[dict, list[dict], list[dict]]:
    """({(kind, figure, who): [tok/s per undisturbed repetition]}, llama-bench's records, every
    repetition's guard record)."""
    guard = benchlib.Guard.from_env(args.threads)
    seen: dict[tuple[str, str, str], list[float]] = {}
    bench_recs, guards = [], []
    env = {benchlib.LLAMA_FLASH_ATTN: "1"} if args.binding_flash_attn else {}
    env[LIB_PATH] = str(binding_lib(args.binding_lib))  # llama-cpp-python loads libllama (and its ggml) from there
    for rep in range(args.reps):
        for kind, gguf in ggufs.items():
            runs = [(args.prompts, args.new, 0)] + [([], args.new, d) for d in args.depths]
            for prompts, new, depth in runs:
                benchlib.warm_page_cache(gguf)
                with guard.rep(f"rep {rep} llama-bench {kind} d{depth}") as g:
                    recs = llama_bench(gguf, args, prompts, new, depth)
                guards.append({"guard": asdict(g)})
                for r in recs:
                    r |= {"kind": kind, "rep": rep, "guard": asdict(g)}
                    bench_recs.append(r)
                    if not g.disturbed:
                        seen.setdefault((kind, figure_of(r), "llama-bench"), []).append(r["avg_ts"])
                print(f"rep {rep} llama-bench {kind}{' (disturbed)' if g.disturbed else ''}: "
                      + ", ".join(f"{figure_of(r)} {r['avg_ts']:.1f}" for r in recs), file=sys.stderr)
            # the binding: a 1-token prompt (decode at depth 0), then each prompt length
            lengths = sorted({1, *args.prompts, *args.depths})
            spec = benchlib.Spec("llama.cpp", str(gguf), args.threads, lengths, args.new,
                                 env={"PYTHONPATH": str(ROOT), **env})
            for rec in benchlib.run({f"binding {kind}": spec}, 1, args.timeout, guard=guard):
                guards.append(rec)
                if rec["guard"]["disturbed"]:
                    continue
                for n in lengths:
                    if n in args.prompts:
                        seen.setdefault((kind, f"prefill {n}", "binding"), []).append(rec[str(n)]["prefill_tps"])
                    if n == 1 or n in args.depths:
                        depth = 0 if n == 1 else n
                        seen.setdefault((kind, f"decode {args.new} @ {depth}", "binding"), []).append(
                            rec[str(n)]["decode_tps"])
    return seen, bench_recs, guards


def table(seen: dict, bench_recs: list[dict], guards: list[dict], args) -> str:
    first = bench_recs[0] if bench_recs else {}
    keys = ("build_commit", "build_number", "cpu_info", "n_threads", "n_batch", "n_ubatch", "flash_attn", "type_k",
            "repack", "load_mode")
    lines = [f"llama-bench: {', '.join(f'{k} {first[k]}' for k in keys if k in first)}",
             f"binding: llama-cpp-python (benchlib.LlamaCpp: n_batch 512, n_ubatch 512, flash attention "
             f"{'on' if args.binding_flash_attn else 'off'}, weight repacking "
             f"{'off' if os.environ.get(benchlib.LLAMA_PLAIN) else 'on'}), {args.threads} threads, "
             f"its llama.cpp: {binding_lib(args.binding_lib)}",
             benchlib.guard_summary(guards), "",
             "| GGUF | figure, tok/s | llama-bench | binding | binding / llama-bench |",
             "| --- | --- | ---: | ---: | ---: |"]
    figures = list(dict.fromkeys((kind, fig) for kind, fig, _ in seen))
    for kind, fig in figures:
        a, b = seen.get((kind, fig, "llama-bench")), seen.get((kind, fig, "binding"))
        ratio = f"{statistics.median(b) / statistics.median(a):.2f}x" if a and b else "-"
        lines.append(f"| {kind} | {fig} | {benchlib.med(a) if a else '-'} | {benchlib.med(b) if b else '-'} "
                     f"| {ratio} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3.5-0.8b", help="a shape of turbo.testing.shapes: its GGUFs, made once")
    ap.add_argument("--gguf", nargs="+", default=["bf16"], help="the shape's GGUF kinds (bf16, q8_0, q4_0, q4_k_m)")
    ap.add_argument("--gguf-path", type=Path, nargs="+", help="GGUF files instead of the shape's")
    ap.add_argument("--prompts", type=int, nargs="+", default=[512, 4096], help="llama-bench -p")
    ap.add_argument("--new", type=int, default=128, help="llama-bench -n: decode steps")
    ap.add_argument("--depths", type=int, nargs="*", default=[512], help="decode also at these contexts (-d)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--fa", help="llama-bench -fa (on, off, auto; default: its own, auto)")
    ap.add_argument("--binding-flash-attn", action="store_true", help="the binding with flash attention on")
    ap.add_argument("--binding-lib", default="tools",
                    help="the binding's llama.cpp: tools (the libraries llama-bench runs, default), own (those "
                         "pip built it with), or a directory of libllama.so")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one process may take")
    ap.add_argument("--out", type=Path, help="llama-bench's records and the table's figures (JSON; default "
                    "docs/results/llamabench-YYYY-MM-DD.json, a new file each run)")
    args = ap.parse_args()
    if args.gguf_path:
        ggufs = {p.stem: p for p in args.gguf_path}
    else:
        from turbo.testing import shapes

        ggufs = {}
        for kind in args.gguf:
            if (path := shapes.gguf(args.shape, kind)) is None:
                raise SystemExit(f"no {kind} GGUF of {args.shape} (set {shapes.CONVERTER_ENV}; docs/llamacpp.md)")
            ggufs[kind] = path
    print(f"build: {json.dumps(build_llamacpp.build_info())}", file=sys.stderr)
    seen, bench_recs, guards = run(ggufs, args)
    print(table(seen, bench_recs, guards, args))
    args.out = args.out or benchlib.results_path("llamabench", ".json", fresh=True)
    print(f"figures: {args.out}", file=sys.stderr)
    args.out.write_text(json.dumps({"llama_bench": bench_recs, "figures": [[*k, v] for k, v in seen.items()],
                                    "build": build_llamacpp.build_info()}, indent=1) + "\n")


if __name__ == "__main__":
    main()
