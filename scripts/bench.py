"""Trunk decode and prefill throughput: turbo against transformers, same checkpoint, same run.

    python scripts/bench.py [--threads 1] [--prompt 512] [--new 256]
    python scripts/bench.py --moe [--threads 2] [--prompt 32] [--new 16] [--repeats 3]

A benchmark, not a test: wall-clock figures on a shared machine are noisy, so both sides
run in this one process, interleaved, best of --repeats, and the result is printed as a ratio.

--moe: the MoE trunk at real scale (scripts/shapes.py qwen3.5-35b-a3b-2l: Qwen3.5-35B-A3B's
layer, two layers, bf16), decode tokens/s against transformers (bf16, the checkpoint's dtype),
median and spread of --repeats interleaved runs; and the weight bytes a decode step reads,
against a dense trunk of the same active size (its MLP as wide as the top-k experts and the
shared expert together).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import make_install  # noqa: E402

import turbo  # noqa: E402


def step_bytes(a, elem: int = 2) -> tuple[int, int]:
    """Weight bytes one decode step reads (`elem` bytes a weight): (the MoE trunk's -- the
    router, top_k experts and the shared expert per routed layer -- and a dense trunk's of the
    same active size). The mixers, the head and one embedding row are common to both."""
    h, kd, vd = a.hidden, a.lin_k_heads * a.lin_k_dim, a.lin_v_heads * a.lin_v_dim
    gdn = (2 * kd + 2 * vd + 2 * a.lin_v_heads) * h + h * vd
    attn = (2 * a.num_heads + 2 * a.num_kv_heads) * a.head_dim * h + h * a.num_heads * a.head_dim
    common = sum(gdn if a.is_gdn(i) else attn for i in range(a.num_layers)) + a.vocab * h + h
    active = a.experts_per_token * a.moe_intermediate + a.shared_intermediate
    routed = a.num_experts * h + 3 * h * active + (h if a.shared_intermediate else 0)
    moe = common + len(a.moe_layers) * routed
    dense = common + len(a.moe_layers) * 3 * h * active
    return moe * elem, dense * elem


def moe_main(args) -> None:
    import statistics

    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from shapes import build, checkpoint

    name = "qwen3.5-35b-a3b-2l"
    rt = turbo.open(build(name), backend="cpu")
    model = AutoModelForCausalLM.from_pretrained(checkpoint(name), dtype=torch.bfloat16).eval()
    a = rt.trunk.arch
    prompt = torch.randint(0, 4096, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    hf_decode, tb_decode = [], []
    for _ in range(args.repeats):  # interleaved: turbo, transformers, turbo, ...
        out = rt.generate(prompt[0].tolist(), max_new_tokens=args.new, policy="off", stop_at_eos=False)
        tb_decode.append(out.stats.decode_tokens_per_s)
        with torch.no_grad():
            t0 = time.perf_counter()
            model.generate(prompt, max_new_tokens=1, do_sample=False)
            t1 = time.perf_counter()
            model.generate(prompt, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)
            t2 = time.perf_counter()
        hf_decode.append((args.new - 1) / ((t2 - t1) - (t1 - t0)))

    def show(xs: list[float]) -> str:
        return f"{statistics.median(xs):7.2f} (spread {min(xs):.2f}..{max(xs):.2f})"

    moe, dense = step_bytes(a)
    print(f"shape: {name} (hidden {a.hidden}, {a.num_experts} experts top-{a.experts_per_token}, expert "
          f"{a.moe_intermediate}, shared {a.shared_intermediate}, {a.num_layers} layers, vocab {a.vocab}), bf16 "
          f"weights; prompt {args.prompt}, {args.new} new tokens, {args.threads} thread(s), {args.repeats} repeats")
    print(f"decode tok/s  turbo ({rt.trunk.step_name}) {show(tb_decode)}   transformers {show(hf_decode)}   "
          f"ratio {statistics.median(tb_decode) / statistics.median(hf_decode):.2f}x")
    print(f"weights read per decode step: MoE {moe / 2**20:.1f} MiB, a dense trunk of the same active size "
          f"{dense / 2**20:.1f} MiB ({moe / dense:.3f}x; the stored experts: "
          f"{len(a.moe_layers) * a.num_experts * 3 * a.hidden * a.moe_intermediate * 2 / 2**30:.2f} GiB)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="turbo's trunk weights (transformers stays fp32, the checkpoint's dtype)")
    ap.add_argument("--moe", action="store_true", help="the MoE trunk at real scale (module docstring)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.moe:
        return moe_main(args)
    shape = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=64, linear_value_head_dim=64)
    with tempfile.TemporaryDirectory() as tmp:
        model, path = make_install(Path(tmp), 0, **shape)
        rt = turbo.open(path, backend="cpu", dtype=args.dtype)
        prompt = torch.randint(0, 4096, (1, args.prompt), generator=torch.Generator().manual_seed(0))
        hf_prefill, hf_decode, tb_prefill, tb_decode = [], [], [], []
        for _ in range(args.repeats):
            with torch.no_grad():
                t0 = time.perf_counter()
                model.generate(prompt, max_new_tokens=1, do_sample=False)
                t1 = time.perf_counter()
                hf = model.generate(prompt, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)
                t2 = time.perf_counter()
            hf_prefill.append(args.prompt / (t1 - t0))
            hf_decode.append((args.new - 1) / ((t2 - t1) - (t1 - t0)))
            out = rt.generate(prompt[0].tolist(), max_new_tokens=args.new, policy="off")
            tb_prefill.append(out.stats.prefill_tokens_per_s)
            tb_decode.append(out.stats.decode_tokens_per_s)
            same = out.tokens == hf[0, args.prompt:].tolist()
        print(f"shape: hidden 256, 8 layers (6 GDN + 2 attention), vocab 4096; prompt {args.prompt}, "
              f"{args.new} new tokens, {args.threads} thread(s), turbo weights {args.dtype}, best of {args.repeats}")
        print(f"same greedy tokens as transformers: {same}")
        print(f"prefill tok/s  turbo {max(tb_prefill):9.1f}   transformers {max(hf_prefill):9.1f}   "
              f"ratio {max(tb_prefill) / max(hf_prefill):.2f}x")
        print(f"decode  tok/s  turbo {max(tb_decode):9.1f}   transformers {max(hf_decode):9.1f}   "
              f"ratio {max(tb_decode) / max(hf_decode):.2f}x")


if __name__ == "__main__":
    main()
