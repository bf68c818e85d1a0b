"""`policy="adaptive"`: choose the block of every round from what this generation has measured.

`AdaptiveChooser` estimates tokens per second for every block 0..max_block (0: a plain round) from
the acceptance and round costs it `observe`s and plays the best (`next_block`); `LazyContext` feeds
the drafter in one batch after plain rounds. The algorithm: docs/DESIGN.md 3.1.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from statistics import median
from typing import TYPE_CHECKING

from ..drafters import Drafter
from .stats import count_positions

if TYPE_CHECKING:
    import torch

    from .sampling import Sampler


_COSTS: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()
# A round's cost counted in plain rounds from its rows (`counted_costs`): the chooser's clock under
# sampling, where the blocks decide which seeded draws each token gets, so they must repeat run to run.
DRAFT_ROUND, DRAFT_ROW, VERIFY_ROW, ROLLBACK_ROW = 0.1, 0.02, 0.05, 0.01


def counted_costs(block: int) -> tuple[float, float, float]:
    """(draft, verify, rollback) of a round at `block`, in plain rounds, from counts alone."""
    return (DRAFT_ROUND + DRAFT_ROW * block if block else 0.0, 1.0 + VERIFY_ROW * block, ROLLBACK_ROW * block)


def _shared_costs(memory: tuple | None, max_block: int, fresh):
    """The cost samples of (owner, *tag): one set per owner (the drafter object, which the
    runtime keeps for its life) and tag (the rollback strategy), kept across generations: a
    round's cost is the machine's and the model's, not the text's. Without `memory`, fresh."""
    fresh = tuple(fresh)
    if memory is None:
        return fresh
    owner, *tag = memory
    try:
        table = _COSTS.setdefault(owner, {})
    except TypeError:  # not weak-referenceable
        return fresh
    return table.setdefault((max_block, *tag), fresh)


class AdaptiveChooser:
    def __init__(self, max_block: int, decay: float = 0.8, prior: float = 1.0, probe_every: int = 8,
                 probe_max: int = 128, samples: int = 15, explore_within: float = 0.85, min_samples: int = 3,
                 bootstrap: list[int] | None = None, memory: tuple | None = None, refresh: int = 64,
                 optimism: float = 0.25, counted: bool = False):
        if max_block < 1:
            raise ValueError(f"max_block {max_block} < 1")
        self.max_block, self.decay, self.prior = max_block, decay, prior
        self.reached = [0.0] * max_block  # rounds that judged proposal i+1 (decayed)
        self.landed = [0.0] * max_block  # ... and accepted it
        fresh = ({b: deque(maxlen=samples) for b in range(max_block + 1)} for _ in range(3))
        shared = _shared_costs(memory, max_block, fresh)
        self.draft, self.verify, self.rollback = shared
        # costs measured by earlier generations on the same drafter, window and rollback
        self.warm = any(self.verify[b] for b in range(max_block + 1))
        # the widest block reads acceptance at every position it reaches; a second block fixes
        # the cost lines; the plain round is measured, never inferred
        self.bootstrap = list(bootstrap) if bootstrap is not None else [max_block]
        self.bootstrap_next = None if bootstrap is not None else self._bootstrap_after
        self.probe_every, self.probe_max = probe_every, probe_max
        self.plain_streak, self.next_probe = 0, probe_every
        self.explore_within, self.min_samples = explore_within, min_samples
        self.flush_s = 0.0  # drafter context fed since the last observe (LazyContext)
        self.chosen: list[int] = []  # the block of every round, in order
        self.optimism = optimism  # choose by an upper bound on acceptance: few readings, wide bounds, bigger blocks tried
        self.rounds, self.last, self.refresh = 0, {}, refresh  # last: the round each block was last played
        self._per_block: dict[int, tuple[float, float, float]] = {}  # costs() of each played block, until it plays again
        self.landed_all = False  # the last round was at the widest block and landed every proposal
        self.counted = counted  # costs from counted_costs, not the seconds observed (under sampling)

    def _bootstrap_after(self, accepted: int) -> list[int]:
        """The rounds after the first (at the widest block): a second block fixes the cost
        lines and each is measured twice (the faster of two readings survives one stall). When
        the first round landed at least half its proposals the plain round is left to the
        explore rule; when it did not, the plain round is measured twice and the widest block
        (the dearest round) not again."""
        if self.warm:  # the costs are known: the first round read the acceptance, that is all
            return []
        mid = max(1, self.max_block // 4)
        if accepted >= max(1, self.max_block // 2):
            return [mid, self.max_block, mid]
        return [0, mid, 0]

    # ---- estimates -------------------------------------------------------------------

    def acceptance(self, optimism: float = 0.0) -> list[float]:
        """p_i, i = 1..max_block: the estimated chance proposal i lands given 1..i-1 did
        (with `optimism` > 0, that many standard deviations above it: an upper bound)."""
        out, prev = [], 0.5
        for r, l in zip(self.reached, self.landed):
            prev = (l + self.prior * prev) / (r + self.prior)
            sd = (prev * (1 - prev) / (r + self.prior + 1)) ** 0.5
            out.append(min(1.0, prev + optimism * sd))
        return out

    def expected_tokens(self, block: int, p: list[float] | None = None) -> float:
        return self._tokens_per_block(self.acceptance() if p is None else p)[block]

    @staticmethod
    def _tokens_per_block(p: list[float]) -> list[float]:
        """Expected tokens of a round at every block 0..len(p), in one pass."""
        tokens, run = [1.0], 1.0
        for pi in p:
            run *= pi
            tokens.append(tokens[-1] + run)
        return tokens

    @staticmethod
    def _line(points: dict[int, float]) -> tuple[float, float] | None:
        """Least-squares a + b*x through the points (flat through one point; None for none)."""
        if not points:
            return None
        n = len(points)
        if n == 1:
            return next(iter(points.values())), 0.0
        mx, my = sum(points) / n, sum(points.values()) / n
        sxy = sxx = 0.0
        for x, y in points.items():
            sxy += (x - mx) * (y - my)
            sxx += (x - mx) * (x - mx)
        slope = sxy / sxx
        if slope < 0:  # noise: a cost never falls with the block
            return my, 0.0
        return my - slope * mx, slope

    def _typical(self, xs) -> float:
        # interference on a shared machine only ever slows a round down: with few samples the
        # fastest is the best guess, with enough the median
        return median(xs) if len(xs) >= self.min_samples else min(xs)

    def costs(self) -> dict[int, float]:
        """Seconds per round at every block 0..max_block.

        A block played before: its own medians (draft, verify) and mean (rollback). Otherwise the
        structure of a round: draft = d0 + d1*b (none at b = 0), verify = v0 + v1*(b + 1 rows),
        rollback = r0 + r1*b (none at 0), each fitted over the blocks played. Empty until a
        round has been observed."""
        played = [b for b in range(self.max_block + 1) if self.verify[b]]
        if not played:
            return {}
        for b in played:  # (every round asks; only the block just observed has changed)
            if b not in self._per_block:
                self._per_block[b] = (self._typical(self.draft[b]), self._typical(self.verify[b]),
                                      sum(self.rollback[b]) / len(self.rollback[b]))
        dmed = {b: self._per_block[b][0] for b in played if b}
        vmed = {b + 1: self._per_block[b][1] for b in played}
        rmean = {b: self._per_block[b][2] for b in played if b}
        dl, vl, rl = self._line(dmed), self._line(vmed), self._line(rmean)
        out = {}
        for b in range(self.max_block + 1):
            if b in played:
                out[b] = vmed[b + 1] + (dmed[b] + rmean[b] if b else 0.0)
                continue
            c = vl[0] + vl[1] * (b + 1)
            if b:
                c += (dl[0] + dl[1] * b) if dl else 0.0
                c += max(rl[0] + rl[1] * b, 0.0) if rl else 0.0
            out[b] = max(c, 1e-9)
        return out

    def rates(self) -> dict[int, float]:
        """Estimated tokens per second at every block (empty before the first observation)."""
        tokens = self._tokens_per_block(self.acceptance(self.optimism))
        return {b: tokens[b] / c for b, c in self.costs().items()}

    # ---- the interface the round loop calls ------------------------------------------

    def next_block(self) -> int:
        if self.bootstrap:
            b = self.bootstrap.pop(0)
        elif self.landed_all:
            # the widest block landed every proposal: acceptance rose at every position, which
            # lifts the widest block's estimate most of all -- it stays the choice, unrecomputed
            b, self.plain_streak, self.next_probe = self.max_block, 0, self.probe_every
        elif self.plain_streak and self.plain_streak + 1 < self.next_probe:
            # a plain round teaches nothing about acceptance: the choice stands until the next probe
            # (and leaving plain decoding for a block that only ties it costs a cold drafter)
            b = 0
            self.plain_streak += 1
        else:
            rates = self.rates()
            b = max(rates, key=lambda k: (rates[k], -k))
            # a block that looks competitive is measured `min_samples` times before it is ruled
            # out or trusted: one slow round (the machine is shared) must not bury a block for good
            # (the plain round, the safe choice, is held to a looser bar)
            # and one that stays close is read again every `refresh` rounds: a stale reading taken
            # in a stall would otherwise stand for good, as nothing else replaces it
            close = [k for k in rates if rates[k] >= (self.explore_within if k else 0.5) * rates[b]
                     and (len(self.verify[k]) < self.min_samples or self.rounds - self.last.get(k, -1) > self.refresh)]
            if close:
                b = max(close, key=lambda k: (rates[k], -k))
            if b == 0:
                self.plain_streak += 1
                if self.plain_streak >= self.next_probe:  # speculation lost: look again, rarely, widely
                    b = self.max_block
                    self.plain_streak = 0
                    self.next_probe = min(self.next_probe * 2, self.probe_max)
            else:
                self.plain_streak = 0
                self.next_probe = self.probe_every
        self.chosen.append(b)
        self.last[b] = self.rounds
        self.rounds += 1
        return b

    def observe(self, block: int, accepted: int, draft_s: float, verify_s: float, rollback_s: float) -> None:
        if not 0 <= block <= self.max_block or not 0 <= accepted <= block:
            raise ValueError(f"round at block {block} accepted {accepted}")
        if self.counted:
            (draft_s, verify_s, rollback_s), self.flush_s = counted_costs(block), 0.0
        if block == self.max_block and self.plain_streak == 0 and self.chosen[-2:-1] == [0] and 2 * accepted >= block:
            self.next_probe = self.probe_every  # a probe that landed: look again soon, not after twice as long
        if self.bootstrap_next is not None and len(self.chosen) == 1:
            self.bootstrap, self.bootstrap_next = self.bootstrap_next(accepted), None
        self.landed_all = block == self.max_block and accepted == block
        if block:  # evidence fades a round at a time (plain rounds add none: they leave it as it stood)
            self.reached = [r * self.decay for r in self.reached]
            self.landed = [l * self.decay for l in self.landed]
            count_positions(self.reached, self.landed, block, accepted)
        # feeding the drafter the previous spec round's rows is a cost of speculating, paid every
        # round; rows buffered by plain rounds are fed once, on the way back (a switch, not a block)
        after_plain = len(self.chosen) > 1 and self.chosen[-2] == 0
        self._per_block.pop(block, None)
        self.draft[block].append(max(draft_s - self.flush_s, 0.0) if after_plain else draft_s)
        self.flush_s = 0.0
        self.verify[block].append(verify_s)
        self.rollback[block].append(rollback_s)


class LazyContext:
    """Wraps a drafter for the adaptive loop: `commit` keeps what the drafter's `defer` returns,
    and the next `propose` hands it all to `commit_deferred` first (one batch), so plain rounds
    do no drafter work at all (turbo.drafters.Drafter)."""

    def __init__(self, drafter: Drafter, chooser: AdaptiveChooser):
        self.inner, self.chooser = drafter, chooser
        self.kind, self.aux_layers, self.window = drafter.kind, drafter.aux_layers, drafter.window
        self.pending: list = []  # what defer returned, one item per round since the last propose

    def commit(self, out, kept: int, tokens: list[int]) -> None:
        self.pending.append(self.inner.defer(out, kept, tokens))

    def propose(self, anchor: int, anchor_pos: int, block: int) -> list[int]:
        self.flush()
        return self.inner.propose(anchor, anchor_pos, block)

    def propose_sampled(self, anchor: int, anchor_pos: int, block: int,
                        sampler: Sampler) -> tuple[list[int], torch.Tensor | None]:
        self.flush()
        return self.inner.propose_sampled(anchor, anchor_pos, block, sampler)

    def flush(self) -> None:
        """Commit what is pending (also at a generation's end, for a session that keeps the context)."""
        if self.pending:
            t = time.perf_counter()
            self.inner.commit_deferred(self.pending)
            self.pending = []
            self.chooser.flush_s += time.perf_counter() - t
