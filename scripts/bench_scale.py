"""Real-scale CPU benchmark of load, prefill, decode and memory: a random checkpoint of a
published shape (turbo.testing.shapes; `tiny` for quick runs) through turbo, transformers (the
checkpoint's dtype) and, where `llama_cpp` imports, llama.cpp (bf16 GGUF), interleaved.

    python -m scripts.bench_scale qwen3.5-0.8b --prompts 512 --reps 3
    python -m scripts.bench_scale qwen3.5-0.8b --prompts 4096 --reps 1 --out runs.jsonl
    python -m scripts.bench_scale qwen3.5-0.8b --kv-cache float32 bfloat16 \
        --only "turbo kv=float32" "turbo kv=bfloat16" --reps 1
    python -m scripts.bench_scale qwen3.5-35b-a3b-2l --quant int4 --only "turbo int4" --prompts 32   # load, RSS, decode
    python -m scripts.bench_scale qwen3.5-0.8b --quant none int8 int4 --gguf bf16 q8_0 q4_0 --prompts 512 4096
    python -m scripts.bench_scale qwen3.5-0.8b --context --prompts 512 4096 --new 40   # decode vs context

Systems mode (the default): every repetition runs each system in a fresh process, one after
another (A, B, C, A, B, C, ...; scripts/benchlib.py), so load time and memory are that process's
own: load time, RSS after it and its peak; per prompt length n: prefill tok/s and the peak RSS
during it, then plain greedy decode tok/s at context n (--new steps) with its tokens and each
step's top-2 logit gap, the ratios of the first system's medians to each other's, and for a
MoE trunk the weight bytes a decode step reads against a dense trunk of the same active size.
--quant and --dtype pick turbo's install and activations; --baseline adds another checkout's
turbo. The machine's read bandwidth (a GEMV over 1 GB, 1 and all threads) is measured in the
run. Records are appended to --out (JSON lines; default docs/results/scale-YYYY-MM-DD.jsonl,
benchlib.results_path), and the table is printed over every record there: medians with [min, max], so runs split over several invocations (each under the bench
lock, each short) still make one table. Every repetition runs under benchlib's quiet-machine
guard: the table takes the undisturbed ones, and the line under it says how many were kept and
dropped and the load they saw. --cotenants N runs N controlled co-tenants (benchlib.cotenant:
a process spinning on one CPU each) beside every worker, the systems named "+N co-tenant": how
each behaves beside a co-tenant, a row of its own (the guard counts them as the benchmark's).

--context: decode at a short and a long context (the two --prompts) per K/V cache dtype, in
one process. A step's cost does not depend on the cached values, only on how many there are:
each state's caches are filled with random rows and its position set (no prefill, which takes
minutes at 4096; --prefill-states: a real prefill of random ids, recurrent states included),
then the steps of every (kv_cache, context) pair run interleaved, one step each in turn, so a
load change falls on all alike. Prints each pair's median tok/s with the [min, max] step
times, and the ratio long / short per cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import turbo
from scripts import benchlib
from turbo.testing import shapes

ROOT = Path(__file__).resolve().parent.parent
KV_TAG = " kv="  # a turbo system's name carries its kv_cache after this ("turbo kv=bfloat16")


def systems(args) -> dict[str, benchlib.Spec]:
    """Every system this machine can run, by name: turbo once per --quant install and kv_cache
    asked, llama.cpp once per --gguf kind (its weight repacking on unless TURBO_LLAMA_PLAIN=1:
    benchlib.LLAMA_PLAIN)."""
    spec = lambda system, path, **kw: benchlib.Spec(system, str(path), args.threads, args.prompts,  # noqa: E731
                                                    args.new, **({"env": {"PYTHONPATH": str(ROOT)}} | kw))
    out = {}
    for quant in args.quant:
        install = str(shapes.build(args.shape, quant=quant))
        tag = "".join(f" {v}" for v in (quant if quant != "none" else None, args.dtype) if v)
        out |= {f"turbo{tag}{KV_TAG}{kv}": spec("turbo", install, kv_cache=kv, dtype=args.dtype) for kv in args.kv_cache}
        out |= {} if args.kv_cache else {f"turbo{tag}": spec("turbo", install, dtype=args.dtype)}
        if args.baseline is not None:
            out[f"turbo{tag}@{args.baseline.name}"] = spec("turbo", install, dtype=args.dtype,
                                                           env={"PYTHONPATH": str(args.baseline)})
    out["transformers"] = spec("transformers", shapes.checkpoint(args.shape))
    try:
        import llama_cpp  # noqa: F401  (optional: pip install llama-cpp-python)
    except ImportError:
        print("llama.cpp: llama_cpp does not import (pip install llama-cpp-python)", file=sys.stderr)
        args.gguf = []
    for kind in args.gguf:
        gguf = shapes.gguf(args.shape, kind)
        if gguf is None:
            print(f"llama.cpp: no GGUF and no converter (set {shapes.CONVERTER_ENV}; docs/llamacpp.md)",
                  file=sys.stderr)
            break
        # llama.cpp's default weight repacking on, as its users run it (TURBO_LLAMA_PLAIN=1 in the
        # environment turns it off, where it crashes: benchlib.LLAMA_PLAIN)
        out["llama.cpp" if kind == "bf16" else f"llama.cpp {kind}"] = spec("llama.cpp", gguf)
    return {name: s for name, s in out.items() if not args.only or name in args.only}


def decode_vs_context(args) -> None:
    """The --context mode (module docstring)."""
    install = shapes.build(args.shape, quant=args.quant[0])
    runs = {}  # (kv_cache, context) -> (trunk, state, step times)
    for kv in args.kv_cache or ["float32", "bfloat16"]:
        trunk = turbo.open(install, threads=args.threads, kv_cache=kv).trunk
        for n in args.prompts:
            st = trunk.new_state(n + args.new + 2)
            g = torch.Generator().manual_seed(n)
            if args.prefill_states:
                trunk.prefill(st, torch.randint(3, 4000, (n,), generator=g).tolist())
            else:
                for k, v in st.kv.values():
                    k.copy_(torch.randn(k.shape, generator=g)), v.copy_(torch.randn(v.shape, generator=g))
                st.pos = n
            trunk.step(st, [7])  # a warm-up step
            runs[(kv, n)] = (trunk, st, [])
    print(f"load: {os.getloadavg()}, threads {args.threads}", file=sys.stderr)
    with benchlib.Guard.from_env(args.threads).rep("--context") as g:  # (one repetition: all the steps)
        for i in range(args.new):
            for trunk, st, times in runs.values():
                t0 = time.perf_counter()
                trunk.step(st, [(31 * i) % 4000 + 3])
                times.append(time.perf_counter() - t0)
    print(benchlib.guard_summary([{"guard": dataclasses.asdict(g)}]))
    if g.disturbed:
        raise SystemExit("the steps were disturbed (benchlib.Guard): rerun on a quiet machine")
    short, long = args.prompts
    for kv in dict.fromkeys(kv for kv, _ in runs):
        median = {n: statistics.median(runs[(kv, n)][2]) for n in args.prompts}
        for n in args.prompts:
            t = runs[(kv, n)][2]
            print(f"kv_cache {kv}, context {n}: {1 / median[n]:.2f} tok/s "
                  f"(step {1e3 * median[n]:.1f} ms [{1e3 * min(t):.1f}, {1e3 * max(t):.1f}])")
        print(f"kv_cache {kv}: decode at {long} / at {short} = {median[short] / median[long]:.3f}")


def report(records: list[dict], bw: list[dict]) -> str:
    gb = 1e9
    if not records:
        return "no undisturbed repetition to tabulate"
    names = list(dict.fromkeys(r["system"] for r in records))
    by = {s: [r for r in records if r["system"] == s] for s in names}
    lines = ["| | " + " | ".join(names) + " |", "| --- |" + " ---: |" * len(names)]

    def row(label: str, get, **kw) -> None:
        cells = []
        for s in names:
            vals = [v for v in (get(r) for r in by[s]) if v is not None]
            cells.append(benchlib.med(vals, **kw) if vals else "-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    row("load s", lambda r: r["load_s"], fmt="{:.2f}")
    row("peak RSS while loading, GB", lambda r: r["load_peak"], scale=gb, fmt="{:.2f}")
    row("RSS after loading, GB", lambda r: r.get("load_rss"), scale=gb, fmt="{:.2f}")
    row("peak RSS, whole process, GB", lambda r: max([r["load_peak"]] + [r[k][p] for k in r if k.isdigit()
                                                                         for p in ("prefill_peak", "decode_peak")]),
        scale=gb, fmt="{:.2f}")
    lengths = sorted({int(k) for r in records for k in r if k.isdigit()})
    for n in lengths:
        k = str(n)
        row(f"prefill {n} tok/s", lambda r: r[k]["prefill_tps"] if k in r else None)
        row(f"peak RSS, prefill {n}, GB", lambda r: r[k]["prefill_peak"] if k in r else None, scale=gb, fmt="{:.2f}")
        row(f"decode tok/s at {n}", lambda r: r[k]["decode_tps"] if k in r else None)
        row(f"GB read per decode token at {n}",
            lambda r: r[k].get("bytes_per_token") if k in r else None, scale=gb, fmt="{:.3f}")
        row(f"implied GB/s at {n}",
            lambda r: r[k]["bytes_per_token"] * r[k]["decode_tps"] if k in r and "bytes_per_token" in r[k] else None,
            scale=gb)
    lines.append("")
    for b in bw:
        lines.append(f"read bandwidth (GEMV over 1 GB): {b['one']:.1f} GB/s on 1 thread, {b['all']:.1f} GB/s on "
                     f"{b['threads']}")
    for s in names:
        if "moe_step_bytes" in by[s][-1]:
            moe, dense, stored = by[s][-1]["moe_step_bytes"]
            lines.append(f"{s}: weights read per decode step: MoE {moe / 2**20:.1f} MiB, a dense trunk of the same "
                         f"active size {dense / 2**20:.1f} MiB ({moe / dense:.3f}x; the stored experts: "
                         f"{stored / 2**30:.2f} GiB)")
    ref = by[names[0]][-1]
    for n in lengths:
        k = str(n)
        for s in names[1:]:
            other = by[s][-1]
            if k not in other or k not in ref:
                continue
            ratio = {m: statistics.median(r[k][m] for r in by[names[0]] if k in r)
                     / statistics.median(r[k][m] for r in by[s] if k in r) for m in ("prefill_tps", "decode_tps")}
            lines.append(f"{names[0]} / {s} at {n}: prefill {ratio['prefill_tps']:.2f}x, "
                         f"decode {ratio['decode_tps']:.2f}x (medians)")
            a, b = ref[k], other[k]
            i = benchlib.first_divergence(a["tokens"], b["tokens"])
            where = ("identical" if i is None else
                     f"first divergence at step {i} (top-2 gap there: {names[0]} {a['gaps'][i]:.3f}, "
                     f"{s} {b['gaps'][i]:.3f})")
            lines.append(f"greedy tokens after the {n}-token prompt, {names[0]} vs {s} ({len(a['tokens'])} steps): "
                         f"{where}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=sorted(shapes.SHAPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompts", type=int, nargs="+", default=[512, 4096],
                    help="prompt lengths (--context: the short and the long context)")
    ap.add_argument("--new", type=int, default=32, help="decode steps timed after each prompt (--context: per pair)")
    ap.add_argument("--out", type=Path, help="records appended here, the table made over all of them (JSON lines; "
                    "default docs/results/scale-YYYY-MM-DD.jsonl, today's)")
    ap.add_argument("--baseline", type=Path, help="another turbo checkout, run as one more system")
    ap.add_argument("--only", nargs="+", help="run only these systems")
    ap.add_argument("--kv-cache", nargs="+", default=[], choices=("auto", "float32", "bfloat16"),
                    help="turbo's K/V cache (OpenOptions.kv_cache), each value its own system 'turbo kv=VALUE' "
                         "(--context: default float32 bfloat16)")
    ap.add_argument("--quant", nargs="+", default=["none"],
                    help="turbo's installs: the repack's --quant (none, int4, int8, ...), one system each")
    ap.add_argument("--gguf", nargs="+", default=["bf16"],
                    help="llama.cpp's GGUFs of the shape: bf16, q8_0, q4_0, q4_k_m, one system each")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), help="turbo's OpenOptions.dtype (default: its own)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds a system's worker may take")
    ap.add_argument("--cotenants", type=int, default=0,
                    help="run this many controlled co-tenants (a CPU-bound spin loop each) beside every worker")
    ap.add_argument("--context", action="store_true", help="decode vs context in one process (module docstring)")
    ap.add_argument("--prefill-states", action="store_true",
                    help="--context: fill each state by a prefill of random ids (~35 s at 4096), not random rows")
    args = ap.parse_args()
    if args.context:
        if len(args.prompts) != 2:
            ap.error("--context takes two --prompts: the short and the long context")
        return decode_vs_context(args)
    chosen = systems(args)
    args.out = args.out or benchlib.results_path("scale")
    print(f"load: {os.getloadavg()}; records: {args.out}", file=sys.stderr)
    if args.cotenants:  # their own columns: "turbo +1 co-tenant"
        chosen = {f"{name} +{args.cotenants} co-tenant": spec for name, spec in chosen.items()}
    benchlib.run(chosen, args.reps, args.timeout, args.out, benchlib.Guard.from_env(args.threads + args.cotenants),
                 cotenants=args.cotenants)
    with benchlib.Guard.from_env(args.threads).rep("bandwidth") as g:
        bw = {"bandwidth": True, "one": benchlib.bandwidth(1), "all": benchlib.bandwidth(args.threads),
              "threads": args.threads}
    with args.out.open("a") as f:
        f.write(json.dumps(bw | {"guard": dataclasses.asdict(g)}) + "\n")
    records = [json.loads(line) for line in args.out.read_text().splitlines()]
    runs = [r for r in records if "system" in r and r["threads"] == args.threads]
    # the table: undisturbed repetitions only (benchlib.Guard); the line under it says how many
    print(report(benchlib.kept(runs), benchlib.kept([r for r in records if "bandwidth" in r])))
    print(benchlib.guard_summary(runs))


if __name__ == "__main__":
    main()
