"""`policy="adaptive"`: choose the block of every round from what this generation has measured.

Tokens per round at block b are 1 + E[accepted | b], and with the per-position (conditional)
acceptance p_i measured so far, E[accepted | b] = sum_{k<=b} p_1 * ... * p_k. A round at b costs
draft(b) + verify(b + 1 rows) + rollback(b), each the measured time of the rounds played at b
(medians of the recent ones for draft and verify, the mean for rollback, which is 0 when the
round keeps every row). The chooser plays the b in 0..max_block with the most tokens per
second, where b = 0 is a plain decode round (one trunk row, no draft): when speculation does
not pay it decodes exactly as `off` does, plus a rare probe round to notice if it starts to.

Costs at blocks not yet played are interpolated linearly between played ones (extrapolated
from the nearest two), so the first rounds bootstrap with the widest block and a plain round,
and every block the rule then picks is measured before it is trusted for long.
While it decodes plainly the drafter's context is fed lazily (`LazyContext`): the committed rows
are buffered and added in one batch before the next draft, so a plain round costs what `off`'s does. Acceptance is
shrunk towards the previous position's estimate (positions not yet reached inherit it), and
old rounds fade by `decay` per round so a generation whose text changes character is followed.
"""

from __future__ import annotations

from collections import deque
from statistics import median

import torch


class AdaptiveChooser:
    def __init__(self, max_block: int, decay: float = 0.99, prior: float = 2.0, probe_every: int = 16,
                 probe_max: int = 256, samples: int = 15):
        if max_block < 1:
            raise ValueError(f"max_block {max_block} < 1")
        self.max_block, self.decay, self.prior = max_block, decay, prior
        self.reached = [0.0] * max_block  # rounds that judged proposal i+1 (decayed)
        self.landed = [0.0] * max_block  # ... and accepted it
        self.draft = {b: deque(maxlen=samples) for b in range(max_block + 1)}
        self.verify = {b: deque(maxlen=samples) for b in range(max_block + 1)}
        self.rollback = {b: deque(maxlen=samples) for b in range(max_block + 1)}
        self.bootstrap = [0, 0, max_block, 0]  # plain rounds cost what `off` pays; 3 make a median
        self.probe_every, self.probe_max = probe_every, probe_max
        self.plain_streak, self.next_probe = 0, probe_every
        self.chosen: list[int] = []  # the block of every round, in order

    # ---- estimates -------------------------------------------------------------------

    def acceptance(self) -> list[float]:
        """p_i, i = 1..max_block: the estimated chance proposal i lands given 1..i-1 did."""
        out, prev = [], 0.5
        for r, l in zip(self.reached, self.landed):
            prev = (l + self.prior * prev) / (r + self.prior)
            out.append(prev)
        return out

    def expected_tokens(self, block: int, p: list[float] | None = None) -> float:
        p = self.acceptance() if p is None else p
        total, run = 1.0, 1.0
        for i in range(block):
            run *= p[i]
            total += run
        return total

    def _measured(self) -> dict[int, float]:
        return {b: (median(self.draft[b]) + median(self.verify[b]) + sum(self.rollback[b]) / len(self.rollback[b]))
                for b in range(self.max_block + 1) if self.verify[b]}

    def cost(self, block: int, measured: dict[int, float] | None = None) -> float | None:
        """Seconds per round at `block`: measured, or interpolated from the measured blocks."""
        m = self._measured() if measured is None else measured
        if block in m:
            return m[block]
        if not m:
            return None
        xs = sorted(m)
        lo = [x for x in xs if x < block]
        hi = [x for x in xs if x > block]
        if lo and hi:
            a, b = lo[-1], hi[0]
        elif len(xs) >= 2:
            a, b = (xs[-2], xs[-1]) if lo else (xs[0], xs[1])
        else:
            return m[xs[0]]
        t = (block - a) / (b - a)
        return max(m[a] + t * (m[b] - m[a]), 1e-9)

    def rates(self) -> dict[int, float]:
        """Estimated tokens per second at every block (blocks with no cost estimate left out)."""
        m, p = self._measured(), self.acceptance()
        out = {}
        for b in range(self.max_block + 1):
            c = self.cost(b, m)
            if c is not None:
                out[b] = self.expected_tokens(b, p) / c
        return out

    # ---- the interface the round loop calls ------------------------------------------

    def next_block(self) -> int:
        if self.bootstrap:
            b = self.bootstrap.pop(0)
        else:
            rates = self.rates()
            b = max(rates, key=lambda k: (rates[k], -k))
            if b == 0:
                self.plain_streak += 1
                if self.plain_streak >= self.next_probe:  # speculation lost: look again, rarely
                    spec = {k: v for k, v in rates.items() if k > 0}
                    b = max(spec, key=lambda k: (spec[k], -k))
                    self.plain_streak = 0
                    self.next_probe = min(self.next_probe * 2, self.probe_max)
            else:
                self.plain_streak = 0
                self.next_probe = self.probe_every
        self.chosen.append(b)
        return b

    def observe(self, block: int, accepted: int, draft_s: float, verify_s: float, rollback_s: float) -> None:
        if not 0 <= block <= self.max_block or not 0 <= accepted <= block:
            raise ValueError(f"round at block {block} accepted {accepted}")
        if block:
            self.reached = [r * self.decay for r in self.reached]
            self.landed = [l * self.decay for l in self.landed]
            for i in range(min(block, accepted + 1)):
                self.reached[i] += 1
                if i < accepted:
                    self.landed[i] += 1
        self.draft[block].append(draft_s)
        self.verify[block].append(verify_s)
        self.rollback[block].append(rollback_s)


class LazyContext:
    """Wraps a drafter for the adaptive loop: `commit` buffers the committed rows, and the next
    `propose` feeds them to the drafter first (in one batch when the drafter takes its context
    as aux rows), so plain rounds do no drafter work at all."""

    def __init__(self, drafter):
        self.inner, self.pending = drafter, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def commit(self, out, kept: int) -> None:
        self.pending.append((out, kept))

    def flush(self) -> None:
        if not self.pending:
            return
        if hasattr(self.inner, "add_context") and all(o.aux is not None for o, _ in self.pending):
            self.inner.add_context(torch.cat([o.aux[:k] for o, k in self.pending]))
        else:
            for o, k in self.pending:
                self.inner.commit(o, k)
        self.pending = []

    def propose(self, anchor: int, anchor_pos: int, block: int) -> list[int]:
        self.flush()
        return self.inner.propose(anchor, anchor_pos, block)
