"""Trunk decode and prefill throughput: turbo against transformers, same checkpoint, same run.

    python scripts/bench.py [--threads 1] [--prompt 512] [--new 256]

A benchmark, not a test: wall-clock figures on a shared machine are noisy, so both sides
run in this one process, interleaved, best of --repeats, and the result is printed as a ratio.
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="turbo's trunk weights (transformers stays fp32, the checkpoint's dtype)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
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
