"""The speculative round: draft, verify, accept, roll back (DESIGN 5), and the public API.

    rt = turbo.open("tiny")
    result = rt.generate("def fib(n):", max_new_tokens=64, policy="fixed", block=4)
    for event in rt.stream("def fib(n):"):  # one event per committed round
        print(event.text, end="")
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from tokenizers import Tokenizer

from . import ops
from .backends import Backend, native, select_backend
from .errors import TurboError
from .install import Install, open_install
from .adaptive import AdaptiveChooser, LazyContext
from .policy import ROLLBACKS, Plan, choose_drafter, plan, policy_from_env
from .stats import Stats
from .loader import load_drafter, load_trunk
from .options import OpenOptions


@dataclass
class RoundEvent:
    tokens: list[int]  # committed this round
    from_draft: list[bool]  # per token: True = an accepted proposal, False = the trunk's bonus token
    text: str  # the text these tokens added
    stats: Stats  # the counters so far (a copy)
    done: bool = False


@dataclass
class GenerateResult:
    tokens: list[int]
    text: str
    stats: Stats
    from_draft: list[bool] = field(default_factory=list)


class Runtime:
    def __init__(self, install: Install, backend: str = "auto", dtype: str = "float32", draft_products: str = "auto"):
        self.backend: Backend = select_backend(backend)
        if dtype not in ("float32", "bfloat16"):
            raise TurboError(f"dtype {dtype!r} is not one of float32, bfloat16")
        self.install = install
        self.draft_products = draft_products  # the CPU drafters' matrix products (native.draft_layout)
        # backend cuda: weights, caches and the forward on the GPU (the hot ops as PTX kernels)
        self.device = torch.device("cuda" if self.backend.name == "cuda" else "cpu")
        self.trunk = load_trunk(install, OpenOptions(dtype=dtype), self.device)
        tok = install.path / "tokenizer.json"
        if not tok.is_file():
            raise TurboError(f"{tok}: missing (expected the install's tokenizer)")
        try:
            self.tokenizer = Tokenizer.from_file(str(tok))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise TurboError(f"{tok}: not a tokenizers file ({e})") from None
        self._drafters: dict[tuple, object] = {}

    # ---- helpers -----------------------------------------------------------------------

    def encode(self, prompt: str | list[int]) -> list[int]:
        ids = list(prompt) if isinstance(prompt, (list, tuple)) else self.tokenizer.encode(prompt).ids
        if not ids:
            raise TurboError("prompt is empty (expected at least one token)")
        vocab = self.install.arch.vocab
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise TurboError(f"prompt token {bad[0]!r} is not an id in 0..{vocab - 1}")
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def drafter(self, kind: str, window: int | None):
        key = (kind, window)
        if key not in self._drafters:
            self._drafters[key] = load_drafter(kind, self.install, self.trunk, window,
                                               OpenOptions(draft_products=self.draft_products))
        return self._drafters[key]

    def plan(self, policy: str | None, block: int | None, drafter: str) -> Plan:
        if policy is None:
            mtp = choose_drafter(self.install, drafter) == "mtp"
            env = policy_from_env("TURBO_MTP_DRAFT" if mtp else "TURBO_DFLASH_DRAFT")
            policy, block = env.name, block if block is not None else env.block
        trained = None
        if self.install.drafter_config is not None:
            trained = (self.install.drafter_config.get("dflash_config") or {}).get("block_size")
        return plan(self.install, policy, block, drafter, self.backend.verify_dtypes,
                    trained if isinstance(trained, int) else None)

    # ---- the API -----------------------------------------------------------------------

    def generate(self, prompt: str | list[int], **kwargs) -> GenerateResult:
        tokens, flags, stats = [], [], None
        for event in self.stream(prompt, **kwargs):
            tokens += event.tokens
            flags += event.from_draft
            stats = event.stats
        return GenerateResult(tokens, self.decode(tokens), stats, flags)

    def stream(self, prompt: str | list[int], max_new_tokens: int = 256, policy: str | None = None,
               block: int | None = None, rollback: str = "checkpoint", drafter: str = "auto",
               window: int | None = None, stop_at_eos: bool = True) -> Iterator[RoundEvent]:
        """Yields one event per committed round. Validation happens before the first yield."""
        ids = self.encode(prompt)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise TurboError(f"max_new_tokens is {max_new_tokens!r}, expected a positive integer")
        limit = self.install.arch.max_positions
        if len(ids) + max_new_tokens > limit:
            raise TurboError(f"prompt of {len(ids)} tokens + max_new_tokens {max_new_tokens} exceeds the model's "
                             f"max_position_embeddings {limit}")
        if rollback not in ROLLBACKS:
            raise TurboError(f"rollback {rollback!r} is not one of {', '.join(ROLLBACKS)}")
        p = self.plan(policy, block, drafter)
        if window is not None and p.drafter == "mtp":
            raise TurboError(f"window {window}: the window is the DFlash2 drafter's context, and the MTP head "
                             "drafting here keeps none (drop window= or use drafter=dflash)")
        draft = self.drafter(p.drafter, window) if p.drafter else None
        stats = Stats(prompt_tokens=len(ids), policy=p.policy, drafter=p.drafter, block=p.block,
                      window=getattr(draft, "window", None), rollback=rollback, backend=self.backend.name,
                      speculation_off_reason=p.off_reason)
        return self._rounds(ids, max_new_tokens, p, draft, rollback, stats, stop_at_eos)

    def _rounds(self, ids: list[int], max_new: int, p: Plan, draft, rollback: str, stats: Stats,
                stop_at_eos: bool) -> Iterator[RoundEvent]:
        trunk, eos = self.trunk, set(self.install.arch.eos_token_ids) if stop_at_eos else set()
        aux_layers = draft.aux_layers if draft is not None else ()
        start = time.perf_counter()
        st = trunk.new_state(len(ids) + max_new + 16)
        prompt_out = trunk.prefill(st, ids[:-1], aux_layers) if len(ids) > 1 else None
        if draft is not None:
            draft.begin(prompt_out, ids)
        anchor, generated, text = ids[-1], [], Detokenizer(self.decode)
        first_done = None
        chooser = AdaptiveChooser(p.block, memory=(draft, rollback)) if p.policy == "adaptive" and draft is not None else None
        draft = LazyContext(draft, chooser) if chooser is not None else draft  # plain rounds skip the drafter's work
        while len(generated) < max_new:
            block = chooser.next_block() if chooser is not None else p.block  # adaptive: 0 = a plain round
            t0 = time.perf_counter()
            proposals = draft.propose(anchor, st.pos, block) if draft is not None and block else []
            t1 = time.perf_counter()
            rows = [anchor] + proposals
            out = trunk.step(st, rows, aux_layers, keep=rollback if proposals else None)
            targets = out.logits.argmax(dim=-1).tolist()
            n = 0
            while n < len(proposals) and proposals[n] == targets[n]:
                n += 1
            t2 = time.perf_counter()
            replayed = trunk.rollback(st, out, len(rows), n + 1, rollback)
            if chooser is not None:
                chooser.observe(block, n, t1 - t0, t2 - t1, time.perf_counter() - t2)
            if draft is not None:
                draft.commit(out, n + 1)
            stats.record_round(len(proposals), n, replayed)
            committed, flags = proposals[:n] + [targets[n]], [True] * n + [False]
            committed, flags = committed[:max_new - len(generated)], flags[:max_new - len(generated)]
            hit_eos = next((i for i, t in enumerate(committed) if t in eos), None)
            if hit_eos is not None:
                committed, flags = committed[:hit_eos + 1], flags[:hit_eos + 1]
            generated += committed
            now = time.perf_counter()
            if first_done is None:
                first_done, first_count = now, len(generated)
                stats.ttft_s = now - start
                stats.prefill_tokens_per_s = len(ids) / stats.ttft_s
            elif now > first_done:
                stats.decode_tokens_per_s = (len(generated) - first_count) / (now - first_done)
            stats.generated_tokens = len(generated)
            done = hit_eos is not None or len(generated) >= max_new
            yield RoundEvent(committed, flags, text.push(committed, final=done), stats.snapshot(), done)
            if done:
                return
            anchor = targets[n]


class Detokenizer:
    """The text each round adds, decoding only a short tail of the tokens (prefix and read
    offsets, as Hugging Face's text-generation-inference does): decoding the whole list
    every round would cost time quadratic in its length. A tail that ends inside a
    character (U+FFFD) waits for the next tokens; `final` lets it out."""

    def __init__(self, decode):
        self.decode, self.ids, self.prefix, self.read = decode, [], 0, 0

    def push(self, tokens: list[int], final: bool = False) -> str:
        self.ids += tokens
        done, text = self.decode(self.ids[self.prefix:self.read]), self.decode(self.ids[self.prefix:])
        if len(text) > len(done) and (final or not text.endswith("\ufffd")):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(done):]
        return ""


def open(path_or_name: str | Path = "tiny", backend: str = "auto", dtype: str = "float32",  # noqa: A001
         draft_products: str = "auto") -> Runtime:
    """Open an install: a directory, or the name of one shipped in the package ("tiny").
    draft_products: auto | fp32 | bf16 | int8, the CPU drafters' matrix products."""
    global _frozen
    native.check_draft_products(draft_products)  # before the install loads
    rt = Runtime(open_install(path_or_name), backend, dtype, draft_products)
    if not _frozen:
        # A full collection walks every tracked object -- ~180k once torch is imported, ~100 ms
        # here -- and would land in the middle of some decode step. What exists at the first
        # open (modules, the first model) lives as long as the process: moved out of reach.
        gc.freeze()
        _frozen = True
    return rt


_frozen = False
