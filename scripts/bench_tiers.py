"""turbo at each x86 ISA tier (TURBO_ISA) against llama.cpp built for the same tier
(scripts/build_llamacpp.py --tier), interleaved: bf16 prefill and decode, turbo's int4 against
llama.cpp's Q4_0, the time an int4 install takes to open, and a decode step's bytes against the
machine's measured read bandwidth.

    nice -n 19 python -m scripts.build_llamacpp --tier avx2     # once per tier (native: no --tier)
    LLAMA_CONVERT_DIR=~/.cache/turbo/llamacpp/0.3.36/src/llama_cpp_python-0.3.36/vendor/llama.cpp \\
        python -m scripts.bench_tiers --tiers avx2 native --reps 3

Per repetition, tier and weight kind (bf16; int4 vs Q4_0), one fresh process each, under
benchlib's quiet-machine guard, in turn: turbo's worker (`turbo.open` timed alone, after the
imports; prefill of --prompt ids; --new greedy decode steps), then `llama-bench -p PROMPT -n NEW
-t THREADS -r 1` of the tier's build (its defaults otherwise: weight repacking on), and with
`--systems turbo llama.cpp ik_llama.cpp` the same llama-bench run of ik_llama.cpp built for the tier
(scripts/build_ikllamacpp.py) on the same GGUFs. "native" is
turbo with TURBO_ISA unset (the best tier this CPU has) and llama.cpp's default build
(GGML_NATIVE). The GGUFs are the shape's (turbo.testing.shapes.gguf: bf16 converted by llama.cpp's
converter, Q4_0 quantized from it by the tier build's llama-quantize). Prints the medians [min,
max] and the ratios; records are appended to --out (JSON lines; default
docs/results/tiers-YYYY-MM-DD.jsonl, benchlib.results_path).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

import turbo
import turbo.engine  # (turbo imports it on first use: here, so that the open timed below is the open alone)
from scripts import benchlib, build_ikllamacpp, build_llamacpp
from turbo.backends import native_lib
from turbo.testing import shapes

ROOT = Path(__file__).resolve().parent.parent
KINDS = {"bf16": ("none", "bf16"), "int4": ("int4", "q4_0")}  # kind: (turbo's --quant, the GGUF's)


def checkout_path(path: str) -> str:
    """`path` relative to this checkout where it is inside it (records name no machine's folders)."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def worker(install: str, prompt: int, new: int, threads: int) -> dict:
    """turbo in this process: open (timed alone, after the imports), prefill, decode; the step's bytes."""
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    sut = benchlib.Turbo(install, threads, None, None)
    open_s = time.perf_counter() - t0
    t0 = time.perf_counter()  # the open's share that is the tokenizer's (tokenizers parsing tokenizer.json)
    Tokenizer.from_file(str(Path(install) / "tokenizer.json"))
    tokenizer_s = time.perf_counter() - t0
    ids = benchlib.prompt_ids(prompt)
    t0 = time.perf_counter()
    logits = sut.prefill(ids, new)
    prefill_s = time.perf_counter() - t0
    token, tokens = int(logits.argmax()), []
    t0 = time.perf_counter()
    for _ in range(new):
        tokens.append(token)
        token = int(sut.decode(token).argmax())
    decode_s = time.perf_counter() - t0
    return {"open_s": open_s, "tokenizer_s": tokenizer_s, "prefill_tps": prompt / prefill_s, "decode_tps": new / decode_s, "tokens": tokens,
            "step_bytes": sut.bytes_per_token(prompt + new // 2), "tier": native_lib.tier(),
            "turbo": checkout_path(turbo.__file__)}


def gguf_of(shape: str, kind: str, tier: str) -> Path:
    """The shape's GGUF of `kind` (bf16 by llama.cpp's converter; Q4_0 by the tier build's llama-quantize)."""
    bf16 = shapes.gguf(shape, "bf16")
    if bf16 is None:
        raise SystemExit(f"no bf16 GGUF of {shape}: set {shapes.CONVERTER_ENV} (docs/llamacpp.md)")
    if kind == "bf16":
        return bf16
    out = bf16.with_name(f"model-{kind}.gguf")
    if not out.is_file():
        tmp = out.with_suffix(".tmp")
        subprocess.run([str(build_llamacpp.tool("llama-quantize", tier=tier)), str(bf16), str(tmp), kind.upper()],
                       check=True, capture_output=True)
        tmp.rename(out)
    return out


def ik_bench(tier: str) -> Path:
    """ik_llama.cpp's llama-bench built for `tier` (scripts/build_ikllamacpp.py), or a one-line exit."""
    found = build_ikllamacpp.bindir(tier)
    if found is None:
        raise SystemExit(f"ik_llama.cpp: not built for {tier} (nice -n 19 python -m scripts.build_ikllamacpp "
                         f"--src CHECKOUT --tier {tier})")
    return found / "llama-bench"


def llama_bench(gguf: Path, tier: str, prompt: int, new: int, threads: int, ik: bool = False) -> dict:
    """llama.cpp's llama-bench (or ik_llama.cpp's, `ik`) built for `tier`, one repetition."""
    bench = ik_bench(tier) if ik else build_llamacpp.tool("llama-bench", tier=tier)
    cmd = [str(bench), "-m", str(gguf), "-p", str(prompt), "-n", str(new),
           "-t", str(threads), "-r", "1", "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"llama-bench failed: {done.stderr.strip()[-2000:]}")
    recs = json.loads(done.stdout)
    return {"prefill_tps": next(r["avg_ts"] for r in recs if r["n_gen"] == 0),
            "decode_tps": next(r["avg_ts"] for r in recs if r["n_prompt"] == 0),
            "build": json.loads((bench.parent / "build-info.json").read_text()).get("ik_llama_commit") if ik
            else build_llamacpp.build_info(tier=tier).get("llama_cpp_commit")}


def table(records: list[dict], bandwidth: float) -> str:
    kept = benchlib.kept(records)
    ik = any(r["system"] == "ik_llama.cpp" for r in kept)
    lines = ["| tier | weights | figure | turbo | llama.cpp | turbo / llama.cpp |" + (" ik_llama.cpp | turbo / ik |" if ik else ""),
             "| --- | --- | --- | ---: | ---: | ---: |" + (" ---: | ---: |" if ik else "")]
    for tier in dict.fromkeys(r["tier_asked"] for r in kept):
        for kind in dict.fromkeys(r["kind"] for r in kept):
            mine = [r for r in kept if r["tier_asked"] == tier and r["kind"] == kind]
            t = [r for r in mine if r["system"] == "turbo"]
            ll = [r for r in mine if r["system"] == "llama.cpp"]
            iks = [r for r in mine if r["system"] == "ik_llama.cpp"]
            for fig in ("prefill_tps", "decode_tps"):
                a, b, c = [r[fig] for r in t], [r[fig] for r in ll], [r[fig] for r in iks]
                ratio = f"{statistics.median(a) / statistics.median(b):.2f}x" if a and b else ""
                line = (f"| {tier} | {kind if kind == 'bf16' else 'int4 / Q4_0'} | {fig.split('_')[0]} | "
                        f"{benchlib.med(a) if a else ''} | {benchlib.med(b) if b else ''} | {ratio} |")
                if ik:
                    line += (f" {benchlib.med(c) if c else ''} | "
                             f"{f'{statistics.median(a) / statistics.median(c):.2f}x' if a and c else ''} |")
                lines.append(line)
            if t:
                step = statistics.median(r["step_bytes"] for r in t)
                dec = statistics.median(r["decode_tps"] for r in t)
                tok = [r["tokenizer_s"] for r in t if "tokenizer_s" in r]
                lines.append(f"| {tier} | {kind} | turbo open, s | {benchlib.med([r['open_s'] for r in t], fmt='{:.2f}')}"
                             + (f" (the tokenizer's parse alone: {benchlib.med(tok, fmt='{:.2f}')})" if tok else "")
                             + " | | |")
                lines.append(f"| {tier} | {kind} | turbo decode read, GB/s (of {bandwidth:.1f} measured) | "
                             f"{step * dec / 1e9:.1f} ({step / 1e9:.2f} GB a step, {100 * step * dec / 1e9 / bandwidth:.0f}%)"
                             " | | |")
    return "\n".join(lines) + "\n\n" + benchlib.guard_summary(records)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3.5-0.8b")
    ap.add_argument("--tiers", nargs="+", default=["avx2", "native"], choices=["avx2", "avx512", "amx", "native"])
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    ap.add_argument("--systems", nargs="+", default=["turbo", "llama.cpp"], choices=["turbo", "llama.cpp", "ik_llama.cpp"],
                    help="ik_llama.cpp: the fork's llama-bench (scripts/build_ikllamacpp.py) on llama.cpp's GGUFs")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, help="records appended here (JSON lines; default "
                    "docs/results/tiers-YYYY-MM-DD.jsonl, today's)")
    ap.add_argument("--worker", nargs=4, metavar=("INSTALL", "PROMPT", "NEW", "THREADS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        install, prompt, new, threads = args.worker
        print(json.dumps(worker(install, int(prompt), int(new), int(threads))))
        return
    args.out = args.out or benchlib.results_path("tiers")
    print(f"records: {args.out}", file=sys.stderr)
    installs = {kind: shapes.build(args.shape, quant=KINDS[kind][0]) for kind in args.kinds}
    llama_tier = {"native": "native", "avx2": "avx2", "avx512": "avx512", "amx": "native"}
    ggufs = {(tier, kind): gguf_of(args.shape, KINDS[kind][1], llama_tier[tier])
             for tier in args.tiers for kind in args.kinds} if {"llama.cpp", "ik_llama.cpp"} & set(args.systems) else {}
    bandwidth = benchlib.bandwidth(args.threads)
    guard = benchlib.Guard.from_env(args.threads)
    records = []
    for rep in range(args.reps):
        for tier in args.tiers:
            for kind in args.kinds:
                for system in args.systems:
                    path = installs[kind] if system == "turbo" else ggufs[tier, kind]
                    benchlib.warm_page_cache(Path(path))
                    env = {k: v for k, v in os.environ.items() if k != "TURBO_ISA"}
                    if tier != "native":
                        env["TURBO_ISA"] = tier
                    with guard.rep(f"rep {rep} {tier} {kind} {system}") as g:
                        if system == "turbo":
                            done = subprocess.run([sys.executable, "-m", "scripts.bench_tiers", "--worker", str(path),
                                                   str(args.prompt), str(args.new), str(args.threads)], cwd=ROOT,
                                                  capture_output=True, text=True, env=env, timeout=1800)
                            if done.returncode != 0:
                                raise SystemExit(f"turbo {tier} {kind}: {done.stderr.strip()[-2000:]}")
                            rec = json.loads(done.stdout.strip().splitlines()[-1])
                        else:
                            rec = llama_bench(Path(path), llama_tier[tier], args.prompt, args.new, args.threads,
                                              ik=system == "ik_llama.cpp")
                    rec |= {"system": system, "tier_asked": tier, "kind": kind, "rep": rep, "guard": g.__dict__,
                            "bandwidth_gbs": bandwidth, "cpu": build_llamacpp.cpu()}
                    records.append(rec)
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    with args.out.open("a") as f:
                        f.write(json.dumps(rec) + "\n")
                    print(f"rep {rep} {tier} {kind} {system}{' (disturbed)' if g.disturbed else ''}: prefill "
                          f"{rec['prefill_tps']:.1f}, decode {rec['decode_tps']:.2f} tok/s", file=sys.stderr)
    print(f"{build_llamacpp.cpu()}, {args.shape}, prompt {args.prompt}, {args.new} decode steps, {args.threads} "
          f"threads; read bandwidth {bandwidth:.1f} GB/s (benchlib.bandwidth)\n")
    print(table(records, bandwidth))


if __name__ == "__main__":
    main()
