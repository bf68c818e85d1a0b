"""Kept states, found by the tokens they hold: token prefix -> snapshot, LRU in bytes (and in
entries). One cache serves a chat session's turns (turbo/chat/session.py), `Runtime.choices`' shared
prompt and the server's prefix cache across requests (turbo/serve/scheduler.py); a `Keeper` is such a
cache with its mark, and the only thing a sequence starts from and ends in (Driver.start / end).

A hybrid model's recurrent state cannot be cut back to an earlier position, so what is kept is a
whole state at a known position: the GDN and conv states (a RecurrentSnapshot), the K/V rows below
it, and each drafter's context there (a proposal stream depends on it, and a seeded sampled
request's tokens on the proposals). The K/V rows are copied where the entry must outlive the state
it was taken from (the server's); a session keeps none (`kv` None): its one state still holds them,
since later rows only ever overwrite later positions (`drop_past` forgets the entries a turn's
rows overwrite). An entry's `trunk` None is the owner's live state itself, as the last turn left it.

A state that goes on from an entry gives the tokens a cold prefill gives only where a prefill's
rows equal its steps bit for bit (TrunkStep.prefill_rows_are_steps): the callers check that.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import torch

from ..errors import TurboError
from ..model.trunk import RecurrentSnapshot, Trunk, TrunkState
from .stats import Stats

# Snapshots a session keeps: one per assistant turn (the newest). At the 0.8B shape one is the
# 18 GDN layers' state and conv window, 18 x (16*128*128 + 3*6144) x 4 bytes = 19.3 MiB,
# plus the drafter's context (turbo.drafters: snapshot).
DEFAULT_SNAPSHOTS = 4

DraftKey = Hashable  # whose context a drafter snapshot is: (kind, window or ngram config), or the drafter


def tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(x) for x in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(x) for x in obj.values())
    return 0


@dataclass(eq=False)
class Entry:
    tokens: tuple  # the state holds tokens[:-1]; tokens[-1] is the anchor after them (image rows tagged)
    trunk: RecurrentSnapshot | None  # None: the owner's live state itself
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] | None  # layer -> K, V [Hkv, len(tokens) - 1, d] copies; None: the owner's
    drafts: dict[DraftKey, Any] = field(default_factory=dict)  # drafter key -> its snapshot after the tokens

    @property
    def pos(self) -> int:
        return len(self.tokens) - 1

    @property
    def nbytes(self) -> int:
        return (self.trunk.nbytes if self.trunk is not None else 0) + tensor_bytes(self.kv) + tensor_bytes(self.drafts)


class StateCache:
    def __init__(self, budget_bytes: float, max_entries: int | None = None):
        # max_entries: how many snapshots (the owner's live state is not one: it goes last)
        self.budget, self.max_entries = budget_bytes, max_entries
        self.entries: OrderedDict[tuple, Entry] = OrderedDict()  # oldest use first
        self.nbytes = 0
        # called with each entry kept or found (the server's state files: turbo/sequence/state_files.py)
        self.on_keep: Callable[[Entry], None] | None = None

    def __len__(self) -> int:
        """The snapshots kept (the live state not counted)."""
        return sum(e.trunk is not None for e in self.entries.values())

    def lookup(self, ids: list, draft: DraftKey | None) -> Entry | None:
        """The longest entry whose tokens begin `ids`, with the drafter's context there when the
        caller's drafter keeps one (`draft`; its context pairs each row with the token after it,
        so the anchor is part of the key); the live state first among equals."""
        best = None
        for key, e in self.entries.items():
            if len(key) <= len(ids) and (draft is None or draft in e.drafts) and tuple(ids[:len(key)]) == key:
                if best is None or len(key) > len(best.tokens) or (len(key) == len(best.tokens) and e.trunk is None):
                    best = e
        if best is not None:
            self.entries.move_to_end(best.tokens)
            if self.on_keep is not None:
                self.on_keep(best)
        return best

    def keep(self, tokens: list, trunk: RecurrentSnapshot | None, kv: dict | None, draft: DraftKey | None = None,
             snap: Any = None) -> Entry | None:
        """Keep a state holding tokens[:-1] (`trunk` None: the owner's live state) and, for drafter
        `draft`, its snapshot `snap`; the oldest entries go while over budget. None: too big."""
        key = tuple(tokens)
        e = self.entries.get(key)
        if e is None or (e.trunk is None) != (trunk is None):
            if e is not None:
                self._drop(key)
            e = Entry(key, trunk, kv)
            if e.nbytes > self.budget:
                return None
            self.entries[key] = e
            self.nbytes += e.nbytes
        if draft is not None and snap is not None and draft not in e.drafts:
            e.drafts[draft] = snap
            self.nbytes += tensor_bytes(snap)
        self.entries.move_to_end(key)
        while self.nbytes > self.budget and self.entries:
            self._drop(next(iter(self.entries)))
        while self.max_entries is not None and len(self) > self.max_entries:
            self._drop(next(k for k, e in self.entries.items() if e.trunk is not None))
        kept = self.entries.get(key)
        if kept is not None and self.on_keep is not None:
            self.on_keep(kept)
        return kept

    def keep_copy(self, trunk: Trunk, st: TrunkState, tokens: list, draft: DraftKey | None, snap: Any) -> None:
        """`keep` a copy of `st` (holding tokens[:-1]) that outlives it: its recurrent state and K/V rows."""
        if self.budget <= 0 or st.pos != len(tokens) - 1 or st.pos < 1:
            return
        if tuple(tokens) in self.entries:
            self.keep(tokens, self.entries[tuple(tokens)].trunk, None, draft, snap)
            return
        kv = {i: (k[:, :st.pos].clone(), v[:, :st.pos].clone()) for i, (k, v) in st.kv.items()}
        self.keep(tokens, trunk.snapshot(st), kv, draft, snap)

    def drop_past(self, pos: int) -> None:
        """Forget the entries past `pos` that hold no K/V of their own: the owner's state is about
        to overwrite their rows."""
        for key in [k for k, e in self.entries.items() if e.kv is None and e.pos > pos]:
            self._drop(key)

    def drop_live(self) -> None:
        """Forget the owner's live state (it is about to move on)."""
        for key in [k for k, e in self.entries.items() if e.trunk is None]:
            self._drop(key)

    def _drop(self, key: tuple) -> None:
        self.nbytes -= self.entries.pop(key).nbytes

    @staticmethod
    def restore(trunk: Trunk, e: Entry, capacity: int) -> TrunkState:
        """A fresh state holding an entry's tokens[:-1] (an entry with its own K/V; itself left as it is)."""
        st = trunk.new_state(max(capacity, len(e.tokens)))
        for i, (k, v) in e.kv.items():
            st.kv[i][0][:, :k.shape[1]] = k
            st.kv[i][1][:, :v.shape[1]] = v
        trunk.restore(st, e.trunk)
        return st


class ByIdentity:
    """A drafter as the cache's key for its context: the object itself (kept alive), compared by
    identity (a caller's drafter need not be hashable, nor equal only to itself)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ByIdentity) and other.obj is self.obj


@dataclass
class TurnReport:
    prompt_tokens: int  # the rendered conversation's
    reused_tokens: int  # of them, held by the state the turn went on from
    prefilled_tokens: int  # run through the trunk before the first round
    resumed_from: str  # "last turn" | "snapshot" | "fresh"
    snapshots: int  # kept after the turn started
    snapshot_bytes: int  # what they and the last turn's drafter context hold
    tokens: list[int] = field(default_factory=list)  # generated
    stats: Stats | None = None


class Keeper:
    """Where sequences start from and end in (Driver.start, Driver.end): a StateCache and the mark
    where a start keeps the state it passes. Two kinds:

    - `live` (a chat session's, `Runtime.choices`'): one trunk state goes on from sequence to
      sequence; its entries hold no K/V (the state's own rows: `drop_past`), the live one as the
      last sequence left it and a snapshot at each start's mark (a session's: the start of its
      assistant turn's generation prompt, where a re-render can diverge);
    - copies (the server's prefix cache): each entry a copy that outlives its sequence, kept at
      the prompt's end (mark None) and at the answer's end."""

    def __init__(self, kept: StateCache, live: bool, mark: int | None = None):
        self.kept, self.live = kept, live
        self.limit = kept.max_entries
        self.mark = mark  # where a start keeps its state, in prompt rows (None: the prompt's end)
        self.st: TrunkState | None = None  # a live keeper's state
        self.report = TurnReport(0, 0, 0, "fresh", 0, 0)  # the last start's (and end's) account

    @classmethod
    def session(cls, limit: int = DEFAULT_SNAPSHOTS) -> Keeper:
        """A session's: the live state and `limit` snapshots, bounded in entries, not bytes."""
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise TurboError(f"snapshots {limit!r}: expected a non-negative integer")
        return cls(StateCache(math.inf, max_entries=limit), live=True, mark=0)

    @classmethod
    def prefix_cache(cls, budget_bytes: float) -> Keeper:
        """The server's: copies, LRU in bytes."""
        return cls(StateCache(budget_bytes), live=False)

    def forget(self) -> None:
        """A live keeper's state starts afresh: every kept row of it is about to be overwritten."""
        if self.live:
            self.kept = StateCache(math.inf, max_entries=self.limit)

    def fresh(self, trunk: Trunk, capacity: int) -> TrunkState:
        st = trunk.new_state(capacity)
        if self.live:
            self.st = st
        return st

    def restore(self, trunk: Trunk, e: Entry, capacity: int) -> TrunkState:
        """A state holding entry `e`'s tokens[:-1]: the live state put back to it, or a copy's."""
        if not self.live:
            return self.kept.restore(trunk, e, capacity)
        st = self.st
        if e.trunk is not None:
            trunk.restore(st, e.trunk)
            self.kept.drop_past(e.pos)  # later ones hold K/V this sequence overwrites
        self.kept.drop_live()  # the state moves on from here
        trunk.reserve(st, capacity)
        return st

    def keep(self, trunk: Trunk, st: TrunkState, tokens: list, draft: DraftKey | None, snap: Any,
             answer: bool = False) -> None:
        """`st`, holding tokens[:-1], and drafter `draft`'s context `snap` there: a live keeper's
        snapshot (the answer's end: the live state itself), or a copy."""
        if not self.live:
            self.kept.keep_copy(trunk, st, tokens, draft, snap)
        elif answer:
            self.kept.keep(tokens, None, None, draft, snap)
        elif tuple(tokens) in self.kept.entries:
            e = self.kept.entries[tuple(tokens)]
            self.kept.keep(tokens, e.trunk, None, draft, snap)
        else:
            self.kept.keep(tokens, trunk.snapshot(st), None, draft, snap)
