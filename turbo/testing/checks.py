"""Checks the tests and benchmarks share: a scripted drafter with a chosen acceptance, and
assertions of losslessness and of parity with transformers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable, NamedTuple

import torch

import turbo
from turbo.drafters import DrafterBase
from turbo.sequence.rounds import close_round, draft_block, judge


class Round(NamedTuple):
    proposals: list[int]  # the drafter's block (empty in a plain round)
    accepted: int  # how many of them are committed
    bonus: int  # the trunk's own token after them: committed too, and the next anchor


def play_round(trunk, st, drafter, anchor: int, block: int, rollback: str, sampler=None,
               cut: Callable[[list[int]], int | None] | None = None, vocab: int | None = None) -> Round:
    """One sequence's round by hand, as turbo/sequence/driver.py plays it (draft, one trunk step, judge,
    roll back), for tests that drive rounds themselves (a stand-in trunk, a chosen cut or rule).
    `vocab`: what the proposals are checked against (None: ids >= 0)."""
    proposals, q = draft_block(drafter, anchor, st.pos, block, sampler, vocab)
    out = trunk.step(st, [anchor] + proposals, drafter.aux_layers if drafter is not None else (),
                     rollback if proposals else None)
    accepted, bonus, _ = judge(proposals, q, out.logits, sampler, cut)
    close_round(trunk, st, drafter, out, proposals, accepted, bonus, rollback)
    return Round(proposals, accepted, bonus)


class ScriptedDrafter(DrafterBase):
    """Proposes the trunk's own greedy continuation, wrong at chosen positions, so the
    round's accepted count follows `schedule` exactly (under sampling: a point mass)."""

    kind = "dflash"
    aux_layers = ()
    window = None

    def __init__(self, reference: list[int], schedule: list[int], vocab: int):
        self.reference, self.schedule, self.vocab, self.round = reference, schedule, vocab, 0

    def begin(self, prompt_out, tokens=None):
        self.round = 0

    def propose(self, anchor, anchor_pos, block):
        truth = self.reference[anchor_pos + 1:anchor_pos + 1 + block]
        n = self.schedule[self.round % len(self.schedule)]
        self.round += 1
        return [t if i != n else (t + 1) % self.vocab for i, t in enumerate(truth)]


def assert_lossless(rt, prompt, reference: list[int], block: int, **kw):
    """A fixed-block generation commits exactly plain decode's `reference` tokens, drafting the
    full block every round; returns it."""
    res = rt.generate(prompt, policy="fixed", block=block, **kw)
    assert res.tokens == reference, (prompt, block)
    assert res.stats.block == block and res.stats.drafted == block * res.stats.rounds
    return res


def assert_prefill_and_64_steps_match(model, trunk) -> None:
    """Prefill logits of 40 tokens and 64 decode steps after them within 1e-4 of transformers' `model`."""
    ids = torch.randint(0, model.config.vocab_size, (1, 40 + 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits[0].float()
    st = trunk.new_state()
    prefill = trunk.prefill(st, ids[0, :40].tolist(), want_logits=True)
    assert (prefill.logits - ref[:40]).abs().max().item() < 1e-4
    worst = 0.0
    for t in range(40, 104):
        out = trunk.step(st, [int(ids[0, t])])
        worst = max(worst, (out.logits[0] - ref[t]).abs().max().item())
    assert worst < 1e-4


def assert_64_greedy_tokens_match(model, install: Path) -> None:
    """64 greedy tokens from the install equal transformers' generate."""
    prompt = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hf = model.generate(prompt, max_new_tokens=64, do_sample=False, min_new_tokens=64)[0, 24:].tolist()
    ours = turbo.open(install, backend="cpu").generate(prompt[0].tolist(), max_new_tokens=64, policy="off")
    assert ours.tokens == hf


def served_address(proc: subprocess.Popen, lines: int = 200) -> str:
    """The `serving on http://...` line a server process (task=serve, scripts/llamacpp_server.py)
    prints on stderr once it answers, read past what it logs before; AssertionError with what it
    said when it ends (or says `lines` others) first."""
    said = []
    for line in proc.stderr:
        if line.startswith("serving on http://"):
            return line
        said.append(line)
        if len(said) >= lines:
            break
    proc.kill()
    raise AssertionError(f"no address printed: {''.join(said)[-2000:]}")


def run_clis(cwd: Path, calls: list[tuple], base: tuple[str, ...] = (),
             text: bool = False) -> list[subprocess.CompletedProcess]:
    """`python -m turbo *base *call` for every call, all at once (each mostly imports torch: they
    overlap on the cores). A call's last item may be bytes: its standard input."""
    procs = []
    for call in calls:
        stdin = call[-1] if call and isinstance(call[-1], bytes) else None
        cmd = [sys.executable, "-m", "turbo", *base, *(call[:-1] if stdin is not None else call)]
        procs.append((cmd, stdin or b"", subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                          stderr=subprocess.PIPE, cwd=cwd)))
    done = []
    for cmd, stdin, p in procs:
        out, err = p.communicate(stdin, timeout=300)
        if text:
            out, err = out.decode(), err.decode()
        done.append(subprocess.CompletedProcess(cmd, p.returncode, out, err))
    return done


class Collect:
    """A scheduler sink (turbo/serve/scheduler.py `Sink`) gathering one request's deltas: its tokens,
    and the error it ended with, if any."""

    def __init__(self):
        self.tokens, self.deltas, self.error = [], [], None

    def __call__(self, d):
        if isinstance(d, Exception):
            self.error = d
        else:
            self.tokens += d.tokens
            self.deltas.append(d)

    @property
    def done(self) -> bool:
        return self.error is not None or bool(self.deltas and self.deltas[-1].finish)
