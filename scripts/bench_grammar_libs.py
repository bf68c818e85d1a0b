"""llguidance against xgrammar, the two libraries made for constrained decoding that vLLM and
SGLang use, over the real Qwen3.5 vocabulary (248,320 rows): what turbo needs of one, measured.

    python -m scripts.bench_grammar_libs [--reps 5] [--out FILE.json]

For each library and each of three JSON schemas (a flat object, a tool call's arguments with enums
and nested objects, an array of records) and a regex: the tokenizer's setup; a cold compile (no
cache); then along a valid document's tokens, each step's next-token mask (the library's bitmask
over the vocabulary, filled) and the token accepted; a speculative round's rollback of 4 tokens.
The allowed-token sets of the two are compared at every step (they agree where both hold JSON
to the same compact form). xgrammar is optional: `pip install xgrammar` (it pulls torch,
transformers and triton; its wheel runs here with `--no-deps` plus apache-tvm-ffi). A benchmark,
not a test: run it on a quiet machine, one thread each (turbo masks on the engine's thread).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from scripts import benchlib
from scripts.bench_constraints import VOCAB, qwen35_tokenizer_json

END = 248046  # <|im_end|>: the constrained output's stop token
SCHEMAS = {
    "flat object": ({"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {
        "type": "string"}}, "n": {"type": "integer"}}, "required": ["name", "tags", "n"], "additionalProperties": False},
        {"name": "Ada Lovelace", "tags": ["mathematics", "poetry", "engines"], "n": 1815}),
    "tool arguments": ({"type": "object", "properties": {
        "location": {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string",
                                                                                              "maxLength": 2}},
                     "required": ["city", "country"], "additionalProperties": False},
        "unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "hourly": {"type": "boolean"}}, "required": ["location", "unit", "days", "hourly"], "additionalProperties": False},
        {"location": {"city": "Paris", "country": "FR"}, "unit": "celsius", "days": 3, "hourly": False}),
    "array of records": ({"type": "array", "items": {"type": "object", "properties": {
        "id": {"type": "integer"}, "title": {"type": "string"}, "score": {"type": "number"}},
        "required": ["id", "title", "score"], "additionalProperties": False}, "minItems": 1},
        [{"id": i, "title": f"Item number {i}", "score": i * 1.5} for i in range(6)]),
}
REGEX = (r"[0-9]{4}-[0-9]{2}-[0-9]{2} [A-Z][a-z]+ [a-z ]{1,40}\.", "2026-12-04 Friday quiet machine measurements.")


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str):
        import llguidance as llg  # optional benchmark dependency
        self.llg = llg
        self.tok = llg.LLTokenizer(tokenizer_json, n_vocab=VOCAB, eos_token=[END])

    def compile(self, schema: dict | None, regex: str | None):
        m = self.llg.LLMatcher
        text = m.grammar_from_json_schema(schema, overrides={"whitespace_flexible": False}) if schema is not None \
            else m.grammar_from_regex(regex)
        return self.llg.LLMatcher(self.tok, text, log_level=0)

    def mask(self, matcher) -> np.ndarray:
        return np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)

    def accept(self, matcher, t: int) -> None:
        assert matcher.consume_token(t), matcher.get_error()

    def rollback(self, matcher, k: int) -> None:
        matcher.rollback(k)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_json: str):
        import xgrammar as xgr  # optional benchmark dependency
        from transformers import PreTrainedTokenizerFast
        self.xgr = xgr
        hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json))
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB, stop_token_ids=[END])
        self.bitmask = xgr.allocate_token_bitmask(1, VOCAB)

    def compile(self, schema: dict | None, regex: str | None):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        grammar = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                separators=(",", ":")) if schema is not None \
            else compiler.compile_regex(regex)
        return self.xgr.GrammarMatcher(grammar, max_rollback_tokens=16)

    def mask(self, matcher) -> np.ndarray:
        matcher.fill_next_token_bitmask(self.bitmask)
        return self.bitmask.numpy().view(np.uint8)[0]

    def accept(self, matcher, t: int) -> None:
        assert matcher.accept_token(t)

    def rollback(self, matcher, k: int) -> None:
        matcher.rollback(k)


def walk(lib, matcher, tokens: list[int]) -> tuple[list[float], list[np.ndarray]]:
    """Each step's mask time (s) and allowed set (unpacked bits) along `tokens`."""
    times, sets = [], []
    for t in tokens:
        t0 = time.perf_counter()
        bits = lib.mask(matcher)
        times.append(time.perf_counter() - t0)
        sets.append(np.unpackbits(bits, bitorder="little")[:VOCAB].astype(bool))
        lib.accept(matcher, t)
    return times, sets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, help="the figures (JSON; default docs/results/grammar-libs-YYYY-MM-DD.json, "
                    "a new file each run)")
    args = ap.parse_args()
    tokenizer_json = qwen35_tokenizer_json()
    tok = Tokenizer.from_str(tokenizer_json)
    guard, seen = benchlib.Guard.from_env(1), []
    libs, setup = [], {}
    for kind in (Llguidance, Xgrammar):
        t = time.perf_counter()
        try:
            libs.append(kind(tokenizer_json))
        except ImportError as e:
            print(f"{kind.name}: not installed ({e}); skipped")
            continue
        setup[kind.name] = time.perf_counter() - t
    cases = {n: (s, None, json.dumps(doc, separators=(",", ":"))) for n, (s, doc) in SCHEMAS.items()}
    cases["regex"] = (None, REGEX[0], REGEX[1])
    figures: dict[tuple[str, str], dict[str, list[float]]] = {}
    agree: dict[str, list[float]] = {}
    for rep in range(args.reps):
        with guard.rep(f"rep {rep}") as g:
            rep_figs = {}
            for case, (schema, regex, doc) in cases.items():
                tokens = tok.encode(doc, add_special_tokens=False).ids + [END]
                sets = {}
                for lib in libs:  # interleaved: each case, one library then the other
                    t = time.perf_counter()
                    matcher = lib.compile(schema, regex)
                    compile_s = time.perf_counter() - t
                    times, sets[lib.name] = walk(lib, matcher, tokens)
                    t = time.perf_counter()
                    lib.rollback(matcher, 4)
                    rollback_s = time.perf_counter() - t
                    rep_figs[case, lib.name] = {"compile ms": 1e3 * compile_s,
                                                "mask ms (median step)": 1e3 * statistics.median(times),
                                                "mask ms (max step)": 1e3 * max(times),
                                                "rollback 4 ms": 1e3 * rollback_s}
                if len(sets) == 2:
                    a, b = sets.values()
                    agree[case] = [float(np.array_equal(x, y)) for x, y in zip(a, b)]
        seen.append({"guard": g.__dict__})
        if not g.disturbed:
            for k, v in rep_figs.items():
                for name, value in v.items():
                    figures.setdefault(k, {}).setdefault(name, []).append(value)
    print("tokenizer setup s: " + ", ".join(f"{k} {v:.2f}" for k, v in setup.items()))
    names = ["compile ms", "mask ms (median step)", "mask ms (max step)", "rollback 4 ms"]
    print(f"\nmedians of the undisturbed of {args.reps} repetitions, one thread\n")
    print("| case | library | " + " | ".join(names) + " |\n| --- | --- |" + " ---: |" * len(names))
    for (case, lib), v in figures.items():
        print(f"| {case} | {lib} | " + " | ".join(f"{statistics.median(v[n]):.3f}" for n in names) + " |")
    for case, same in agree.items():
        print(f"{case}: allowed sets equal at {sum(same):.0f} of {len(same)} steps")
    print(benchlib.guard_summary(seen))
    out = args.out or benchlib.results_path("grammar-libs", ".json", fresh=True)
    print(f"figures: {out}")
    with open(out, "w") as f:
        json.dump({"setup s": setup, "figures": {f"{c} | {l}": v for (c, l), v in figures.items()},
                   "agree": agree, "guard": seen}, f, indent=1)


if __name__ == "__main__":
    main()
