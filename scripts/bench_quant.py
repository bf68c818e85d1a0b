"""Quantized installs on the CPU (docs/DESIGN.md 4): the three matmul paths, tokens/s int4 vs bf16,
the size on disk per format, agreement with bf16, and int4 decode against llama.cpp's Q4_0.

    python -m scripts.bench_quant [--threads 1] [--tokens 48] [--src HF_CHECKPOINT_OR_INSTALL]
    python -m scripts.bench_quant --agreement tiny [--fmt int4] [--prompts N]
    python -m scripts.bench_quant --llamacpp qwen3.5-0.8b [--threads 2] [--reps 3] [--tokens 64]

1. matmul: one projection [out, in] at decode (1 row) and verify (3 rows) sizes:
   float weights cached (the dequantized-at-load path), dequantize per call (the packed
   QuantizedWeight path ops.linear takes), and torch's packed-int4 CPU kernel (integer path).
2. end to end: a random Qwen3.5 trunk repacked as bf16 and as int4|int2|int1; plain greedy
   decode tokens/s (policy off) for each, int4 both dequantized at load and packed; and the
   bytes of model.safetensors per format.
3. --agreement INSTALL: repack the (bf16) install to --fmt and greedy-decode every workload
   prompt (conf/workload/*.yaml, max_new_tokens each) on both: the fraction of identical
   tokens (position by position), where the first divergence falls, the same-prefix top-1
   agreement (teacher-forced on the bf16 continuation), and the perplexity of the bf16
   continuation under each.
4. --llamacpp SHAPE: turbo on the shape's `--quant int4` install (turbo.testing.shapes) against
   llama.cpp on its Q4_0 GGUF (shapes.gguf: the bf16 conversion quantized by llama.cpp's own
   llama_model_quantize; docs/llamacpp.md). Both decode --tokens greedy tokens after the same
   32-token prompt; each of --reps repetitions runs the two in fresh processes, one after the
   other (scripts/benchlib.py), and the medians and spreads are printed.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from scripts import benchlib
from turbo import engine
from turbo.repack import repack
from turbo.store import quant
from turbo.store.install import resolve
from turbo.testing import make_checkpoint, shapes

ROOT = Path(__file__).resolve().parent.parent


def best_of(fn, reps: int = 5, inner: int = 20) -> float:
    """The best of `reps` per-call times, each over `inner` calls."""
    return min(benchlib.timed(fn, inner) for _ in range(reps))


def bench_matmul(out: int, cols: int) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out, cols, generator=g) * 0.05
    fmt = quant.FORMATS["int4"]
    qw = quant.QuantizedWeight(*quant.quantize(w, fmt), fmt.bits, fmt.group)
    deq32, deq16 = qw.dequantize(torch.float32), qw.dequantize(torch.bfloat16)
    kernel, kernel16 = quant.Int4Kernel(qw), quant.Int4Kernel(qw)
    kernel16.row_stable(torch.bfloat16)  # bf16 activations and scales
    print(f"matmul [{out} x {cols}] int4 (ms per call, best of 5 x 20)")
    print(f"  {'rows':>4} {'fp32 cached':>12} {'bf16 cached':>12} {'deq/call':>10} {'kernel fp32':>12} "
          f"{'kernel bf16':>12}")
    for rows in (1, 3, 9):
        x = torch.randn(rows, cols, generator=g)
        t32 = best_of(lambda: F.linear(x, deq32))
        t16 = best_of(lambda: F.linear(x.bfloat16(), deq16))
        tdq = best_of(lambda: quant.linear_dequant(x, qw), inner=5)
        tk = best_of(lambda: kernel(x), inner=5)
        tk16 = best_of(lambda: kernel16(x))
        print(f"  {rows:>4} {t32 * 1e3:>12.3f} {t16 * 1e3:>12.3f} {tdq * 1e3:>10.3f} {tk * 1e3:>12.3f} "
              f"{tk16 * 1e3:>12.3f}")
    err = (kernel(x) - F.linear(x, deq32)).abs().max().item()
    print(f"  int4 kernel (fp32) vs dequantized fp32: max |diff| {err:.2e} (another summation order)")
    print(f"  resident bytes: fp32 {deq32.numel() * 4 / 1e6:.1f} MB, bf16 {deq16.numel() * 2 / 1e6:.1f} MB, "
          f"packed int4 {qw.nbytes / 1e6:.1f} MB")


def open_rt(install: str, dtype: str, mode: str):  # mode: OpenOptions.quant_cpu
    rt = engine.open(install, backend="cpu", dtype=dtype, quant_cpu=mode)
    rt.generate(list(range(5, 21)), max_new_tokens=4, policy="off", stop_at_eos=False)  # warm up (kernel probes)
    return rt


def decode_tps(rts: list, tokens: int, rounds: int) -> list[float]:
    """Best tokens/s of each runtime over `rounds` interleaved timed greedy decodes (the machine
    is shared with other jobs: interleaving spreads the interference over all the rows)."""
    best = [0.0] * len(rts)
    prompt = list(range(5, 21))
    for _ in range(rounds):
        for i, rt in enumerate(rts):
            t0 = time.perf_counter()
            rt.generate(prompt, max_new_tokens=tokens, policy="off", stop_at_eos=False)
            best[i] = max(best[i], tokens / (time.perf_counter() - t0))
    return best


def agreement(install: str, fmt: str, limit: int | None, tokens: int | None, spec_block: int = 0) -> None:
    base = resolve(install)
    with tempfile.TemporaryDirectory() as tmp:
        drafter = base / "dflash" if spec_block and (base / "dflash").is_dir() else None
        qpath = repack(base, Path(tmp) / fmt, drafter=drafter, quiet=True, quant=fmt)
        sizes = {n: (p / "model.safetensors").stat().st_size for n, p in (("bf16", base), (fmt, qpath))}
        print(f"size on disk: bf16 {sizes['bf16'] / 1e6:.2f} MB, {fmt} {sizes[fmt] / 1e6:.2f} MB")
        ref, qrt = engine.open(str(base), backend="cpu"), engine.open(str(qpath), backend="cpu")
        total_same = total = total_top1 = 0
        firsts: list[int] = []
        nll = {"bf16": 0.0, fmt: 0.0}
        for wl in sorted((ROOT / "conf" / "workload").glob("*.yaml")):
            cfg = yaml.safe_load(wl.read_text())
            n_new = tokens or int(cfg.get("max_new_tokens", 256))
            same = count = top1 = 0
            wl_firsts: list[int] = []
            wl_nll = {"bf16": 0.0, fmt: 0.0}
            for prompt in cfg["prompts"][:limit]:
                ids = ref.encode(prompt)
                a = ref.generate(ids, max_new_tokens=n_new, policy="off", stop_at_eos=False).tokens
                b = qrt.generate(ids, max_new_tokens=n_new, policy="off", stop_at_eos=False).tokens
                same += sum(x == y for x, y in zip(a, b))
                count += len(a)
                wl_firsts.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)))
                seq = ids + a
                argmax = {}
                for name, rt in (("bf16", ref), (fmt, qrt)):
                    st = rt.trunk.new_state(len(seq))
                    logits = rt.trunk.prefill(st, seq[:-1], want_logits=True).logits[len(ids) - 1:]
                    lp = torch.log_softmax(logits.float(), -1)
                    wl_nll[name] -= lp[torch.arange(len(a)), torch.tensor(a)].sum().item()
                    argmax[name] = lp.argmax(-1)
                top1 += int((argmax["bf16"] == argmax[fmt]).sum())
            if drafter is not None:  # speculation on both, drafter quantized alongside the trunk
                acc = {}
                for name, rt in (("bf16", ref), (fmt, qrt)):
                    runs = [rt.generate(rt.encode(p), max_new_tokens=n_new, policy="fixed", block=spec_block,
                                        stop_at_eos=False).stats for p in cfg["prompts"][:limit]]
                    acc[name] = sum(r.accepted for r in runs) / max(1, sum(r.rounds for r in runs))
                print(f"  {cfg.get('name', wl.stem):>6}: accepted per round (block {spec_block}): bf16 "
                      f"{acc['bf16']:.2f}, {fmt} {acc[fmt]:.2f}")
            total_same, total, total_top1 = total_same + same, total + count, total_top1 + top1
            firsts += wl_firsts
            for k in nll:
                nll[k] += wl_nll[k]
            print(f"  {cfg.get('name', wl.stem):>6}: identical tokens {same}/{count} = {same / count:.3f}, "
                  f"first divergence at token {sum(wl_firsts) / len(wl_firsts):.1f} (mean), same-prefix top-1 "
                  f"{top1 / count:.3f}; ppl of the bf16 continuation: bf16 {math.exp(wl_nll['bf16'] / count):.3f}, "
                  f"{fmt} {math.exp(wl_nll[fmt] / count):.3f}")
        print(f"  {'all':>6}: identical tokens {total_same}/{total} = {total_same / total:.3f}, first divergence "
              f"{sum(firsts) / len(firsts):.1f}, same-prefix top-1 {total_top1 / total:.3f}; ppl bf16 "
              f"{math.exp(nll['bf16'] / total):.3f} -> {fmt} {math.exp(nll[fmt] / total):.3f} "
              f"({100 * (math.exp((nll[fmt] - nll['bf16']) / total) - 1):+.2f}%)")


def against_llamacpp(shape: str, threads: int, reps: int, tokens: int) -> None:
    """Mode 4 (module docstring)."""
    gguf = shapes.gguf(shape, "q4_0")
    if gguf is None:
        raise SystemExit(f"{shape}: no GGUF and no converter (set {shapes.CONVERTER_ENV}; docs/llamacpp.md)")
    int4 = str(shapes.build(shape, quant="int4"))
    specs = {"turbo": benchlib.Spec("turbo", int4, threads, [32], tokens, env={"PYTHONPATH": str(ROOT)}),
             "llama.cpp": benchlib.Spec("llama.cpp", str(gguf), threads, [32], tokens)}
    ran = benchlib.run(specs, reps, timeout=600)
    records = benchlib.kept(ran)  # undisturbed repetitions only (benchlib.Guard)
    print(benchlib.guard_summary(ran))
    seen = {name: [r["32"]["decode_tps"] for r in records if r["system"] == name] for name in specs}
    if not all(seen.values()):
        raise SystemExit("a system has no undisturbed repetition: rerun on a quiet machine")
    for system, v in seen.items():
        print(f"{system:10s} int4 / Q4_0 decode tok/s: median {statistics.median(v):.1f} "
              f"[{min(v):.1f}, {max(v):.1f}] over {len(v)}")
    print(f"turbo / llama.cpp: {statistics.median(seen['turbo']) / statistics.median(seen['llama.cpp']):.2f}x")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--src", help="a bf16 HF checkpoint or install to measure (else a random trunk)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--agreement", metavar="INSTALL", help="greedy agreement of INSTALL (bf16) and its --fmt repack")
    ap.add_argument("--fmt", default="int4", choices=list(quant.FORMATS))
    ap.add_argument("--prompts", type=int, help="at most this many prompts per workload")
    ap.add_argument("--new-tokens", type=int, help="override the workloads' max_new_tokens")
    ap.add_argument("--spec-block", type=int, default=0,
                    help="also compare DFlash acceptance at this block (the install's drafter, quantized too)")
    ap.add_argument("--llamacpp", metavar="SHAPE", choices=sorted(shapes.SHAPES),
                    help="int4 decode of SHAPE against llama.cpp's Q4_0 (--tokens after a 32-token prompt)")
    ap.add_argument("--reps", type=int, default=3, help="--llamacpp: repetitions, each system in a fresh process")
    args = ap.parse_args()
    if args.llamacpp:
        against_llamacpp(args.llamacpp, args.threads, args.reps, args.tokens)
        return 0
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s)")
    if args.agreement:
        agreement(args.agreement, args.fmt, args.prompts, args.new_tokens, args.spec_block)
        return 0
    bench_matmul(4 * args.hidden, args.hidden)
    bench_matmul(args.hidden, 4 * args.hidden)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.src:
            src = resolve(args.src)
        else:
            src = tmp / "hf"
            h = args.hidden
            model = make_checkpoint(src, 0, vocab_size=4096, hidden_size=h, intermediate_size=3 * h,
                                    num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
                                    head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
                                    linear_key_head_dim=64, linear_value_head_dim=64)
            model.to(torch.bfloat16).save_pretrained(src)
        installs = {"bf16": str(repack(src, tmp / "bf16", quiet=True))}
        for fmt in quant.FORMATS:
            installs[fmt] = str(repack(src, tmp / fmt, quiet=True, quant=fmt))
        if args.src:
            print(f"\ntrunk from {args.src}")
        else:
            print(f"\nrandom trunk: hidden {h}, {args.layers} layers (3 linear : 1 full), vocab 4096, "
                  f"intermediate {3 * h}")
        print("size on disk (model.safetensors)")
        base_size = None
        for name, path in installs.items():
            size = (Path(path) / "model.safetensors").stat().st_size
            base_size = base_size or size
            print(f"  {name:>5}: {size / 1e6:8.2f} MB  ({size / base_size:.3f} of bf16)")
        print(f"plain greedy decode tokens/s ({args.tokens} tokens, policy off; best of {args.rounds} interleaved rounds)")
        rows = [("bf16 install, fp32 compute", installs["bf16"], "float32", "dequant"),
                ("bf16 install, bf16 compute", installs["bf16"], "bfloat16", "dequant"),
                ("int4, dequantized at load, fp32", installs["int4"], "float32", "dequant"),
                ("int4, dequantized at load, bf16", installs["int4"], "bfloat16", "dequant"),
                ("int4, packed (deq per call), fp32", installs["int4"], "float32", "packed"),
                ("int4, int4 kernel, bf16 (auto)", installs["int4"], "bfloat16", "auto"),
                ("int4, int4 kernel, fp32", installs["int4"], "float32", "kernel"),
                ("int2, dequantized at load, fp32", installs["int2"], "float32", "dequant"),
                ("int1, dequantized at load, fp32", installs["int1"], "float32", "dequant")]
        rts = [open_rt(path, dtype, mode) for _, path, dtype, mode in rows]
        for (label, *_), tps in zip(rows, decode_tps(rts, args.tokens, args.rounds)):
            print(f"  {label:<36} {tps:8.1f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
