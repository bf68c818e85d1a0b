"""Where a speculative round's time goes, and what it buys, at every block.

    python scripts/bench_round.py [--accept 0.8] [--new 192]

Times the parts of a round -- DFlash2 draft, batched verify of B+1 rows, rollback by
each strategy -- on a random trunk (hidden 256, 8 layers, vocab 4096) and a random
drafter, then tokens/s of whole generations against plain decode, with a scripted
drafter (tests/helpers.py) that lands each proposal with probability --accept, so the
acceptance is fixed and only the engine's costs vary. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import ScriptedDrafter, make_drafter, make_install  # noqa: E402

import turbo  # noqa: E402

SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=64, linear_value_head_dim=64)


def timed(fn, reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--accept", type=float, default=0.8, help="per-position acceptance of the scripted drafter")
    ap.add_argument("--new", type=int, default=192)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        drafter = make_drafter(tmp / "drafter", 256, 4096, [1, 3, 5, 7], heads=4, kv_heads=2, head_dim=64,
                               intermediate=768, rank=32, window=256)
        _, path = make_install(tmp, 0, drafter=drafter, **SHAPE)
        rt = turbo.open(path, backend="cpu")
        trunk, dflash = rt.trunk, rt.drafter("dflash", None)
        prompt = [int(t) for t in torch.randint(0, 4096, (128,), generator=torch.Generator().manual_seed(0))]

        print(f"round parts (ms), random trunk hidden 256 x 8 layers + 5-layer drafter, {args.threads} thread(s)")
        print("| block | draft | verify (B+1 rows) | rollback checkpoint | rollback replay | decode step |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: |")
        for block in range(1, 9):
            st = trunk.new_state(1024)
            out = trunk.prefill(st, prompt[:-1], dflash.aux_layers)
            dflash.begin(out)
            pos = st.pos
            draft = timed(lambda: dflash.propose(prompt[-1], pos, block), args.reps)
            rows = [prompt[-1]] + [5] * block
            parts = {}
            for strategy in ("checkpoint", "replay"):
                def verify_then_rollback(strategy=strategy):
                    o = trunk.step(st, rows, dflash.aux_layers, strategy)
                    t = time.perf_counter()
                    trunk.rollback(st, o, len(rows), 1 + block // 2, strategy)
                    parts.setdefault(strategy, []).append(time.perf_counter() - t)
                    st.pos = pos  # back to the anchor for the next repetition (the attention part)
                total = timed(verify_then_rollback, args.reps)
                parts[strategy + "_total"] = total
            rb = {s: sum(v) / len(v) for s, v in parts.items() if not s.endswith("_total")}
            verify = parts["checkpoint_total"] - rb["checkpoint"]
            step = timed(lambda: (trunk.step(st, [prompt[-1]]), setattr(st, "pos", pos)), args.reps)
            print(f"| {block} | {draft * 1e3:.2f} | {verify * 1e3:.2f} | {rb['checkpoint'] * 1e3:.3f} | "
                  f"{rb['replay'] * 1e3:.3f} | {step * 1e3:.2f} |")

        off = rt.generate(prompt, max_new_tokens=args.new, policy="off")
        reference = prompt + off.tokens
        print(f"\ntokens/s with a scripted drafter landing each proposal with p = {args.accept} "
              f"(draft cost excluded; plain decode {off.stats.decode_tokens_per_s:.1f} tok/s)")
        print("| block | rollback | accepted/round | rollback rate | tok/s | vs off |")
        print("| ---: | --- | ---: | ---: | ---: | ---: |")
        rng = random.Random(0)
        schedule = []
        for _ in range(4096):
            n = 0
            while rng.random() < args.accept and n < 8:
                n += 1
            schedule.append(n)
        for block in range(1, 9):
            for strategy in ("checkpoint", "replay"):
                scripted = ScriptedDrafter(reference, [min(n, block) for n in schedule], 4096)
                res = rt.generate(prompt, max_new_tokens=args.new, policy="fixed", block=block, rollback=strategy,
                                  drafter=scripted)
                assert res.tokens == off.tokens, "speculation changed the output"
                s = res.stats
                print(f"| {block} | {strategy} | {s.accepted_per_round:.2f} | {s.rollback_rate:.0%} | "
                      f"{s.decode_tokens_per_s:.1f} | {s.decode_tokens_per_s / off.stats.decode_tokens_per_s:.2f}x |")


if __name__ == "__main__":
    main()
