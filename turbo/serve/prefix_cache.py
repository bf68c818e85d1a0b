"""Exact prefix caching across requests: states kept by the tokens they hold, LRU in bytes.

Chat clients resend the whole conversation every turn. A hybrid model's recurrent state cannot be
cut back to an earlier position, so what is kept is a whole state at a known position: the GDN and
conv states (a RecurrentSnapshot), the K/V rows below it, and the drafter's context there (one per
drafter kind: a proposal stream depends on it, and a seeded sampled request's tokens on the
proposals). A request whose prompt begins with a kept entry's tokens starts from a copy of it and
prefills only the rest; since a native prefill's rows equal its steps bit for bit
(TrunkStep.prefill_rows_are_steps), its tokens are those a cold prefill gives. An image request's
tokens carry each image's identity on its rows (turbo/serve/images.py: cache_key).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from ..session import tensor_bytes
from ..trunk import RecurrentSnapshot, Trunk, TrunkState

DraftKey = tuple  # (kind, window or ngram config): whose context a drafter snapshot is


@dataclass(eq=False)
class Entry:
    tokens: tuple  # the state holds tokens[:-1]; tokens[-1] is the anchor after them (image rows tagged: images.py)
    trunk: RecurrentSnapshot
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> K, V [Hkv, len(tokens), d] (copies)
    drafts: dict[DraftKey, Any] = field(default_factory=dict)  # drafter key -> its snapshot after the tokens

    @property
    def nbytes(self) -> int:
        return self.trunk.nbytes + tensor_bytes(self.kv) + tensor_bytes(self.drafts)


class PrefixCache:
    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.entries: OrderedDict[tuple[int, ...], Entry] = OrderedDict()  # oldest use first
        self.nbytes = 0

    def lookup(self, ids: list[int], draft: DraftKey | None) -> Entry | None:
        """The longest entry whose tokens begin `ids`, with the drafter's context there when the
        request's drafter keeps one (`draft`; its context pairs each row with the token after
        it, so the anchor is part of the key)."""
        best = None
        for key, e in self.entries.items():
            if len(key) <= len(ids) and (best is None or len(key) > len(best.tokens)) \
                    and (draft is None or draft in e.drafts) and tuple(ids[:len(key)]) == key:
                best = e
        if best is not None:
            self.entries.move_to_end(best.tokens)
        return best

    def keep(self, trunk: Trunk, st: TrunkState, tokens: list[int], draft: DraftKey | None, snap: Any) -> None:
        """Keep the state `st` (holding tokens[:-1]) and, for drafter `draft`, its snapshot `snap`."""
        if self.budget <= 0 or st.pos != len(tokens) - 1 or st.pos < 1:
            return
        key = tuple(tokens)
        e = self.entries.get(key)
        if e is None:
            kv = {i: (k[:, :st.pos].clone(), v[:, :st.pos].clone()) for i, (k, v) in st.kv.items()}
            e = Entry(key, trunk.snapshot(st), kv)
            if e.nbytes > self.budget:
                return
            self.entries[key] = e
            self.nbytes += e.nbytes
        if draft is not None and snap is not None and draft not in e.drafts:
            e.drafts[draft] = snap
            self.nbytes += tensor_bytes(snap)
        self.entries.move_to_end(key)
        while self.nbytes > self.budget and self.entries:
            _, old = self.entries.popitem(last=False)
            self.nbytes -= old.nbytes

    @staticmethod
    def restore(trunk: Trunk, e: Entry, capacity: int) -> TrunkState:
        """A fresh state holding the entry's tokens[:-1] (the entry itself is left as it is)."""
        st = trunk.new_state(max(capacity, len(e.tokens)))
        for i, (k, v) in e.kv.items():
            st.kv[i][0][:, :k.shape[1]] = k
            st.kv[i][1][:, :v.shape[1]] = v
        trunk.restore(st, e.trunk)
        return st
