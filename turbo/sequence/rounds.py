"""The speculative round (docs/DESIGN.md 5): draft a block, verify it with the anchor in one
trunk step, accept a prefix, roll the state back to it, tell the drafter what was kept.

The round's three parts -- `draft_block`, `judge`, `close_round` -- are played around a trunk
pass by turbo/sequence/driver.py: one sequence's through `Trunk.step`, a batch's through one
`Trunk.step_many` (turbo/serve/scheduler.py).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..backends import ops
from ..drafters import Drafter
from ..model.step import StepOut
from ..model.trunk import Trunk, TrunkState
from .sampling import RejectionSampler
from .seam import call, propose


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
    block 0. What the drafter returns is checked here, whoever wrote it (turbo/sequence/seam.py)."""
    if not block:
        return [], None
    return propose(drafter, anchor, pos, block, sampler and sampler.sampler, vocab)


def judge(proposals: list[int], q: torch.Tensor | None, logits: torch.Tensor, sampler: RejectionSampler | None,
          cut: Callable[[list[int]], int | None] | None) -> tuple[int, int, int]:
    """(accepted, bonus, landed): the acceptance rule (sampler None: greedy, `accept_greedy`;
    else the sampler's accept/resample rule, which keeps the trunk's distribution), then `cut`
    (turbo.sequence.stops) may keep fewer of the tokens the round would commit: the round is then played
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

