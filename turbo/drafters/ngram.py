"""The n-gram drafter: prompt lookup / suffix matching, no weights (docs/DESIGN.md 2.4).

`NgramDrafter` proposes what followed the most recent earlier occurrence of the history's longest
matching suffix, from an index of n-gram -> end of its latest occurrence; `NgramConfig` holds the
`ngram.*` settings (docs/probe.md).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from ..errors import TurboError
from . import DrafterBase

SEARCHES = ("all", "prompt", "generated")


@dataclass(frozen=True)
class NgramConfig:
    """min_match 2: a single shared token ("(", a newline) is followed by almost anything, and
    on a CPU every wrong proposal is a verify row paid for and a rollback; two is where
    Hugging Face's prompt lookup sits (max_matching_ngram_size=2). max_match 4: vLLM's
    documented prompt_lookup_max; a longer match rarely changes the continuation found.
    max_proposal 8: the widest block a drafter without a trained block gets
    (turbo.sequence.policy.DFLASH_BLOCK; the block caps it as well)."""

    min_match: int = 2  # the shortest suffix that may match
    max_match: int = 4  # the longest suffix tried (the longest match wins)
    max_proposal: int = 8  # the most tokens proposed in a round
    search: str = "all"  # where the copied continuation starts: all | prompt | generated

    def __post_init__(self) -> None:
        for name in ("min_match", "max_match", "max_proposal"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TurboError(f"ngram {name} is {value!r}, expected a positive integer")
        if self.max_match < self.min_match:
            raise TurboError(f"ngram max_match {self.max_match} is below min_match {self.min_match}, "
                             "expected max_match >= min_match")
        if self.search not in SEARCHES:
            raise TurboError(f"ngram search {self.search!r} is not one of {', '.join(SEARCHES)}")


class NgramDrafter(DrafterBase):
    kind = "ngram"
    aux_layers: tuple[int, ...] = ()  # reads no trunk state
    window = None

    def __init__(self, config: NgramConfig = NgramConfig()):
        self.config = config
        self.begin(None, [])

    def begin(self, prompt_out, prompt: list[int]) -> None:
        self.history = list(prompt)  # [prompt + committed]: ends with the anchor
        p = len(prompt)
        # indexed end positions e (the continuation starts at history[e]) lie in [lo, hi)
        self.lo = p if self.config.search == "generated" else 1
        self.hi = p if self.config.search == "prompt" else sys.maxsize
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest indexed occurrence
        self.indexed = self.lo  # the next end position to index
        self._index_new()

    def _index_new(self) -> None:
        h, c = self.history, self.config
        # an end position is indexed once the token after it exists: the suffix itself never
        # matches, and every match has at least one token to copy
        end = min(len(h), self.hi)
        for e in range(self.indexed, end):
            for n in range(c.min_match, min(c.max_match, e) + 1):
                self.index[tuple(h[e - n:e])] = e
        self.indexed = max(self.indexed, end)

    def propose(self, anchor: int, anchor_pos: int, block: int) -> list[int]:
        h, c = self.history, self.config
        if anchor_pos != len(h) - 1 or h[-1] != anchor:
            raise ValueError(f"n-gram history holds {len(h)} tokens ending with {h[-1] if h else None}, "
                             f"the anchor is {anchor} at {anchor_pos}")
        for n in range(min(c.max_match, len(h)), c.min_match - 1, -1):
            e = self.index.get(tuple(h[len(h) - n:]))
            if e is not None:
                return self._continuation(e, min(block, c.max_proposal))
        return []

    def _continuation(self, e: int, k: int) -> list[int]:
        """k tokens from history[e:], the way LZ77 copies: past the history's end the copy
        reads its own output (a match e positions back means period len - e), so a loop in
        the output is proposed in full rather than cut at the anchor."""
        h = self.history
        out = h[e:e + k]
        period = len(h) - e
        while len(out) < k:
            out.append(out[len(out) - period])
        return out

    def extend(self, tokens: list[int]) -> None:
        self.history += tokens
        self._index_new()

    def commit(self, out, kept: int, tokens: list[int]) -> None:
        self.extend(tokens)

    def defer(self, out, kept: int, tokens: list[int]) -> list[int]:
        # only the ids: the adaptive loop keeps deferred items across plain stretches
        return list(tokens)

    def commit_deferred(self, items: list[list[int]]) -> None:
        self.extend([t for tokens in items for t in tokens])

    def fork(self) -> NgramDrafter:
        return NgramDrafter(self.config)

    def snapshot(self) -> tuple:
        return ()  # the history is the prompt: resume rebuilds it

    def restore(self, snap: tuple) -> None:
        pass

    def resume(self, out, prompt: list[int], start: int) -> None:
        # begin afresh: where the prompt ends bounds search=prompt|generated, and indexing is cheap
        self.begin(None, prompt)
