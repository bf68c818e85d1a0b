"""scripts/fuzz.py's object classes: random drafter objects (--drafters) and config.json field
mutations judged against transformers (--fields). Cases are made here and run by fuzz.py's
worker (`run_job`), which is restarted after a crash or a hang.

Drafter cases: a caller's drafter object that returns a malformed proposal list or q (wrong
types, lengths, ids off the vocabulary, NaN / negative / unnormalised / zero-at-proposal q),
raises, or re-enters the runtime from its own hooks. A malformed one must end in one TurboError
line; a well-formed one must leave the greedy tokens those of a generation without it.

Field cases: config.json with one field removed, of another type, out of range, an unknown or
random RoPE type, or a valid other value, on a small random checkpoint transformers can load.
Accepted means: turbo's fp32 prefill logits equal transformers' on the same config within
FIELD_TOLERANCE (the field irrelevant to the forward, or changing it as it says); anything else
accepted is a silent change.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

PROMPT = [5, 6, 7]
DRAFTER_TOKENS = 6
FIELD_PROMPT = list(range(3, 43))  # 40 tokens: past a scaled RoPE's 32-position window
FIELD_TOLERANCE = 1e-3
FIELD_WINDOW = 32

# ---- drafter objects ---------------------------------------------------------------------------

# what propose returns, by class: (name, must_refuse); the value is built in the worker (make_proposals)
PROPOSALS = [("valid", False), ("empty", False), ("numpy-ints", False), ("too-long", True), ("off-vocab", True),
             ("negative", True), ("huge", True), ("float", True), ("bool", True), ("none-item", True),
             ("str-item", True), ("none", True), ("tuple", True), ("generator", True), ("ndarray", True),
             ("tensor", True), ("dict", True), ("str", True), ("nested", True)]
Q_KINDS = [("q-valid", False), ("q-none", False), ("q-nan", True), ("q-negative", True), ("q-unnormalised", True),
           ("q-zeros", True), ("q-zero-at-proposal", True), ("q-wrong-shape", True), ("q-int", True),
           ("q-list", True), ("q-bf16-valid", False), ("q-not-tuple", True), ("q-triple", True)]
RAISES = [("raise-ValueError", True), ("raise-IndexError", True), ("raise-RecursionError", True),
          ("raise-StopIteration", True), ("raise-in-begin", True), ("raise-in-commit", True)]
REENTERS = [("reenter-generate", True), ("reenter-stream", True), ("reenter-caught", False)]
ATTRS = [("kind-none", True), ("kind-empty", True), ("aux-none", True), ("aux-off", True), ("aux-str", True),
         ("window-zero", True), ("window-str", True)]
DRAFTER_CLASSES = PROPOSALS + Q_KINDS + RAISES + REENTERS + ATTRS


def drafter_cases(n: int, seed: int) -> list[tuple[str, dict, bool]]:
    """n (class, job, must_refuse): the classes in turn, each case's details from its own seed."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        cls, refuse = DRAFTER_CLASSES[i % len(DRAFTER_CLASSES)]
        out.append((cls, {"drafter": cls, "seed": rng.randrange(2**32), "block": rng.choice([1, 2, 3, 4, 8])}, refuse))
    return out


def make_proposals(cls: str, rng: random.Random, block: int, vocab: int, truth: list[int]) -> Any:
    """propose's return for `cls`: `truth` the tokens a greedy generation gives from here."""
    import numpy as np
    import torch

    good = [t if rng.random() < 0.6 else rng.randrange(vocab) for t in truth[:rng.randint(1, block)]]
    bad_at = rng.randrange(len(good))

    def with_item(x):
        return good[:bad_at] + [x] + good[bad_at + 1:]

    return {
        "valid": lambda: good, "empty": lambda: [], "numpy-ints": lambda: [np.int64(t) for t in good],
        "too-long": lambda: good + [0] * (block + 1 - len(good)), "off-vocab": lambda: with_item(vocab + rng.randrange(9)),
        "negative": lambda: with_item(-rng.randint(1, vocab)), "huge": lambda: with_item(2 ** rng.choice([31, 63, 64, 200])),
        "float": lambda: with_item(float(good[bad_at]) + rng.choice([0.0, 0.5])), "bool": lambda: with_item(True),
        "none-item": lambda: with_item(None), "str-item": lambda: with_item(str(good[bad_at])), "none": lambda: None,
        "tuple": lambda: tuple(good), "generator": lambda: (t for t in good), "ndarray": lambda: np.array(good),
        "tensor": lambda: torch.tensor(good), "dict": lambda: {i: t for i, t in enumerate(good)},
        "str": lambda: " ".join(map(str, good)), "nested": lambda: [good],
    }[cls]()


def make_q(cls: str, rng: random.Random, proposals: list[int], vocab: int) -> Any:
    import torch

    n = len(proposals)
    q = torch.rand(n, vocab) + 0.01
    q = q / q.sum(-1, keepdim=True)
    rows = torch.arange(n)
    return {
        "q-valid": lambda: q, "q-none": lambda: None, "q-bf16-valid": lambda: q.bfloat16(),
        "q-nan": lambda: q.index_put((rows[:1], torch.tensor([rng.randrange(vocab)])), torch.tensor(float("nan"))),
        "q-negative": lambda: q - 2.0 / vocab, "q-unnormalised": lambda: q * rng.choice([0.5, 2.0, 1e6]),
        "q-zeros": lambda: torch.zeros(n, vocab),
        "q-zero-at-proposal": lambda: _zero_at(q, proposals, rng.randrange(n)),
        "q-wrong-shape": lambda: rng.choice([q[:, :-1], q.T.contiguous(), q[None], q.flatten(), torch.ones(n + 1, vocab)]),
        "q-int": lambda: (q * 1000).int(), "q-list": lambda: q.tolist(),
    }[cls]()


def _zero_at(q, proposals: list[int], i: int):
    q = q.clone()
    mass = q[i, proposals[i]].item()
    q[i, proposals[i]] = 0.0
    q[i] += mass / (q.shape[1] - 1)
    q[i, proposals[i]] = 0.0
    return q


def make_drafter(rt, job: dict, truth: list[int]):
    """A DrafterBase object misbehaving as `job["drafter"]` says (deterministic from job["seed"])."""
    import turbo
    from turbo.drafters import DrafterBase

    cls, rng, vocab = job["drafter"], random.Random(job["seed"]), rt.install.arch.vocab
    layers = rt.install.arch.num_layers

    class Fuzzed(DrafterBase):
        kind = "fuzzed"
        pos0 = 0

        def begin(self, prompt_out, prompt):
            self.pos0 = len(prompt) - 1
            if cls == "raise-in-begin":
                raise RuntimeError("begin failed")

        def commit(self, out, kept, tokens):
            if cls == "raise-in-commit":
                raise KeyError("commit failed")

        def _good(self, anchor_pos: int, block: int) -> list[int]:
            at = anchor_pos - self.pos0
            return make_proposals("valid", rng, block, vocab, truth[at:at + block] or [0])

        def propose(self, anchor, anchor_pos, block):
            if cls.startswith("raise-") and cls not in ("raise-in-begin", "raise-in-commit"):
                raise {"ValueError": ValueError("bad"), "IndexError": IndexError("list index out of range"),
                       "RecursionError": RecursionError("deep"), "StopIteration": StopIteration()}[cls[6:]]
            if cls.startswith("reenter-"):
                try:
                    if cls == "reenter-stream":
                        next(iter(rt.stream(PROMPT, max_new_tokens=2)))
                    else:
                        rt.generate(PROMPT, max_new_tokens=2)
                except turbo.TurboError:
                    if cls != "reenter-caught":
                        raise
                return self._good(anchor_pos, block)
            if cls in dict(PROPOSALS):
                at = anchor_pos - self.pos0
                return make_proposals(cls, rng, block, vocab, truth[at:at + block] or [0])
            return self._good(anchor_pos, block)

        def propose_sampled(self, anchor, anchor_pos, block, sampler):
            proposals = self.propose(anchor, anchor_pos, block)
            if not cls.startswith("q-") or not proposals:
                return proposals, None
            if cls == "q-not-tuple":
                return proposals
            q = make_q("q-valid" if cls == "q-triple" else cls, rng, proposals, vocab)
            return (proposals, q, None) if cls == "q-triple" else (proposals, q)

    d = Fuzzed()
    attrs = {"kind-none": ("kind", None), "kind-empty": ("kind", ""), "aux-none": ("aux_layers", None),
             "aux-off": ("aux_layers", (layers + rng.randrange(4),)), "aux-str": ("aux_layers", "0"),
             "window-zero": ("window", 0), "window-str": ("window", "64")}
    if cls in attrs:
        setattr(d, *attrs[cls])
    return d


def drafter_job(rt, job: dict, reference: list[int]) -> list[int]:
    """The tokens of a generation with the case's drafter (TurboError when refused): greedy, or
    sampled with a fixed seed for the q classes (whose reference is the same sampled run with a
    well-formed q's: a q is checked, not trusted, so a valid one gives some valid text)."""
    d = make_drafter(rt, job, reference)
    sampled = job["drafter"].startswith("q-")
    kw = dict(temperature=0.8, seed=7) if sampled else {}
    return rt.generate(PROMPT, max_new_tokens=DRAFTER_TOKENS, stop_at_eos=False, policy="fixed", block=job["block"],
                       drafter=d, **kw).tokens


# ---- config.json fields against transformers ----------------------------------------------------

ROPE_TYPES = ["default", "linear", "yarn", "dynamic", "longrope", "llama3", "ntk", "", "YARN", "mystery"]
FIELD_CLASSES = ("missing", "wrong-type", "out-of-range", "rope-type", "rope-param", "valid-other", "unknown-field")


def field_base(directory: Path):
    """A small random checkpoint (turbo.testing.make_checkpoint) and its install: (hf dir, install)."""
    from turbo.repack import repack
    from turbo.testing import make_checkpoint

    src = directory / "hf"
    make_checkpoint(src, 3, max_position_embeddings=256,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    return src, repack(src, directory / "install", quiet=True)


def _flat_fields(cfg: dict) -> list[str]:
    keys = [k for k in cfg if k != "rope_parameters"]
    return keys + [f"rope_parameters.{k}" for k in cfg.get("rope_parameters", {})]


def _other_type(v: Any, rng: random.Random) -> Any:
    options = ["64", [v], {"v": v}, None, True, 1.5, -3, "silu", []]
    return rng.choice([o for o in options if type(o) is not type(v)])


def _out_of_range(v: Any, rng: random.Random) -> Any:
    if isinstance(v, bool):
        return rng.choice([2, -1])
    if isinstance(v, (int, float)):
        return rng.choice([0, -1, -v, v * 1000, 2**31, 2**64, float("nan"), float("inf"), 1e-30])
    if isinstance(v, str):
        return rng.choice(["", "gelu", "x" * 300, v.upper()])
    if isinstance(v, list):
        return rng.choice([[], v[:-1], v + v[:1], list(reversed(v))])
    return rng.choice([0, "", []])


def _rope_params(kind: str, rng: random.Random) -> dict:
    p = {"rope_type": kind, "rope_theta": rng.choice([10000.0, 1e6]), "partial_rotary_factor": 0.5}
    if rng.random() < 0.8:
        p["factor"] = rng.choice([1.0, 2.0, 4.0, 8.0, 0.5, 0.0, -2.0, "4"])
    if rng.random() < 0.7:
        p["original_max_position_embeddings"] = rng.choice([FIELD_WINDOW, 16, 0, 512])
    for k, values in (("beta_fast", [16.0, 32.0]), ("beta_slow", [1.0, 2.0]), ("mscale", [1.0, 0.5]),
                      ("mscale_all_dim", [0.0, 1.0]), ("attention_factor", [1.0, 0.8]), ("truncate", [True, False])):
        if rng.random() < 0.2:
            p[k] = rng.choice(values)
    return p


def field_cases(base_config: dict, n: int, seed: int) -> list[tuple[str, str]]:
    """n (class, config text): the classes in turn."""
    rng = random.Random(seed)
    fields = _flat_fields(base_config)
    out = []
    for i in range(n):
        cls = FIELD_CLASSES[i % len(FIELD_CLASSES)]
        cfg = json.loads(json.dumps(base_config))
        path = rng.choice(fields)
        node, leaf = (cfg["rope_parameters"], path.split(".", 1)[1]) if path.startswith("rope_parameters.") \
            else (cfg, path)
        if cls == "missing":
            del node[leaf]
        elif cls == "wrong-type":
            node[leaf] = _other_type(node[leaf], rng)
        elif cls == "out-of-range":
            node[leaf] = _out_of_range(node[leaf], rng)
        elif cls in ("rope-type", "rope-param"):
            cfg["rope_parameters"] = _rope_params(rng.choice(ROPE_TYPES[:4]) if cls == "rope-param"
                                                  else rng.choice(ROPE_TYPES), rng)
            if rng.random() < 0.2:  # the older spelling, beside or instead of rope_parameters
                cfg["rope_scaling"] = {"type": cfg["rope_parameters"]["rope_type"], "factor": 2.0}
        elif cls == "valid-other":
            v = node[leaf]
            node[leaf] = (not v if isinstance(v, bool) else v * rng.choice([2, 0.5]) if isinstance(v, float)
                          else v + rng.choice([1, -1]) if isinstance(v, int) else v)
        else:
            cfg[rng.choice(["x_fuzz", "sliding_window", "rope_scaling", "hidden_act", "attention_bias", "qk_norm",
                            "use_sliding_window", "attn_logit_softcapping"])] = rng.choice([None, 1, 0.5, True, "x"])
        out.append((cls, json.dumps(cfg, allow_nan=True)))
    return out


def reference_logits(hf_dir: Path, cfg: dict, ids: list[int]):
    """transformers' fp32 logits for `ids` on the checkpoint's weights under config `cfg`."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**cfg)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    missing, unexpected = model.load_state_dict(load_file(str(hf_dir / "model.safetensors")), strict=False)
    if missing or unexpected:
        raise ValueError(f"weights do not fit: missing {missing[:2]}, unexpected {unexpected[:2]}")
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def field_job(install: Path, hf_dir: Path) -> dict:
    """turbo's verdict on the install's config.json and, when it generates, transformers' logits beside it."""
    import torch

    import turbo
    from turbo.store.arch import IRRELEVANT

    rt = turbo.open(str(install), backend="cpu", dtype="float32")
    st = rt.trunk.new_state(len(FIELD_PROMPT))
    ours = rt.trunk.prefill(st, FIELD_PROMPT, want_logits=True).logits.float()
    cfg = json.loads((install / "config.json").read_text())
    try:
        ref = reference_logits(hf_dir, cfg, FIELD_PROMPT)
    except Exception as e:  # noqa: BLE001 (transformers refusing it is the finding, unless ...)
        try:  # ... what it refuses is a field turbo lists as irrelevant to the forward: then without them
            ref = reference_logits(hf_dir, {k: v for k, v in cfg.items() if k not in IRRELEVANT}, FIELD_PROMPT)
        except Exception:  # noqa: BLE001
            return {"result": "generated", "tokens": [], "reference": f"{type(e).__name__}: {str(e)[:160]}"}
    diff = float((ours - ref).abs().max()) if ours.shape == ref.shape else math.inf
    ok = bool(torch.isfinite(ours).all()) and diff <= FIELD_TOLERANCE
    return {"result": "generated", "tokens": [], "reference": "match" if ok else f"max logit diff {diff:.3g}"}
