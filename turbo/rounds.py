"""The speculative round (docs/DESIGN.md 5): draft a block, verify it with the anchor in one
trunk step, accept a prefix, roll the state back to it, tell the drafter what was kept.

`play_round` is one sequence's round (turbo/engine.py loops it); a batch of sequences plays the
same three parts -- `draft_block`, `judge`, `close_round` -- around one `Trunk.step_many`
(turbo/serve/scheduler.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from . import ops
from .backends.step import StepOut
from .drafters import Drafter
from .drafters.seam import call, propose
from .sampling import RejectionSampler
from .trunk import Trunk, TrunkState


@dataclass(slots=True)
class RoundResult:
    """What one round committed (proposals[:accepted] + [bonus]) and what its parts took."""

    proposals: list[int]  # the drafter's block (empty in a plain round)
    accepted: int  # how many of them are committed (the trunk confirmed them; a stop may keep fewer)
    bonus: int  # the trunk's own token after them: committed too, and the next anchor
    replayed: int  # rows the rollback ran again
    draft_s: float
    verify_s: float
    rollback_s: float
    landed: int  # how many proposals the trunk confirmed (the counters' acceptance)


def accept_greedy(proposals: list[int], logits: torch.Tensor) -> tuple[int, int]:
    """Proposal i lands while it is the trunk's argmax after row i and all before it landed;
    the next token is the trunk's argmax after the last row kept. On the CPU a row is looked at
    only when every proposal before it landed (a 248K-vocabulary row costs a pass of its own);
    elsewhere all rows in one call (one transfer)."""
    if logits.device.type == "cpu":
        target = lambda n: ops.argmax(logits[n])  # noqa: E731
    else:
        target = logits.argmax(dim=-1).tolist().__getitem__
    n = 0
    while True:
        t = target(n)
        if n == len(proposals) or proposals[n] != t:
            return n, t
        n += 1


def draft_block(drafter: Drafter | None, anchor: int, pos: int, block: int, sampler: RejectionSampler | None,
                vocab: int | None) -> tuple[list[int], torch.Tensor | None]:
    """The drafter's proposals after `anchor` (at `pos`) and, under sampling, their q; none at
    block 0. What the drafter returns is checked here, whoever wrote it (turbo/drafters/seam.py)."""
    if not block:
        return [], None
    return propose(drafter, anchor, pos, block, sampler and sampler.sampler, vocab)


def judge(proposals: list[int], q: torch.Tensor | None, logits: torch.Tensor, sampler: RejectionSampler | None,
          cut: Callable[[list[int]], int | None] | None) -> tuple[int, int, int]:
    """(accepted, bonus, landed): the acceptance rule (sampler None: greedy, `accept_greedy`;
    else the sampler's accept/resample rule, which keeps the trunk's distribution), then `cut`
    (turbo.stops) may keep fewer of the tokens the round would commit: the round is then played
    as if only the proposals before the last kept one had landed, and that one were the trunk's
    bonus (it is the trunk's own token there), so the state and the drafter end exactly at it.
    `landed`: what the trunk confirmed (the counters' acceptance)."""
    accepted, bonus = accept_greedy(proposals, logits) if sampler is None else sampler(proposals, q, logits)
    landed, keep = accepted, cut(proposals[:accepted] + [bonus]) if cut is not None else None
    if keep is not None and keep <= accepted:
        accepted, bonus = keep - 1, proposals[keep - 1]
    return accepted, bonus, landed


def close_round(trunk: Trunk, st: TrunkState, drafter: Drafter | None, out: StepOut, proposals: list[int],
                accepted: int, bonus: int, rollback: str) -> int:
    """Roll the state back to the kept rows and tell the drafter what was kept; the rows replayed."""
    replayed = trunk.rollback(st, out, len(proposals) + 1, accepted + 1, rollback)
    if drafter is not None:
        call(drafter, "commit", drafter.commit, out, accepted + 1, proposals[:accepted] + [bonus])
    return replayed


def play_round(trunk: Trunk, st: TrunkState, drafter: Drafter | None, anchor: int, block: int, rollback: str,
               sampler: RejectionSampler | None = None,
               cut: Callable[[list[int]], int | None] | None = None, vocab: int | None = None) -> RoundResult:
    """Draft `block` proposals after `anchor` (none at block 0), verify them with the anchor in
    one trunk step, accept a prefix (`judge`), roll the state back to it and tell the drafter
    what was kept. `vocab`: what the proposals are checked against (None: ids >= 0, for a
    stand-in trunk). A batch of sequences plays the same three parts around one
    `Trunk.step_many` (turbo/serve/scheduler.py)."""
    t0 = time.perf_counter()
    proposals, q = draft_block(drafter, anchor, st.pos, block, sampler, vocab)
    t1 = time.perf_counter()
    out = trunk.step(st, [anchor] + proposals, drafter.aux_layers if drafter is not None else (),
                     rollback if proposals else None)
    accepted, bonus, landed = judge(proposals, q, out.logits, sampler, cut)
    t2 = time.perf_counter()
    replayed = close_round(trunk, st, drafter, out, proposals, accepted, bonus, rollback)
    t3 = time.perf_counter()
    return RoundResult(proposals, accepted, bonus, replayed, t1 - t0, t2 - t1, t3 - t2, landed)
