"""Kept states, found by the tokens they hold: token prefix -> snapshot, LRU in bytes (and in
entries). One cache serves a chat session's turns (turbo/chat/session.py), `Runtime.choices`' shared
prompt and the server's prefix cache across requests (turbo/serve/scheduler.py); a `Keeper` is such a
cache with its marks, and the only thing a sequence starts from and ends in (Driver.start / end).

A hybrid model's recurrent state cannot be cut back to an earlier position, so what is kept is a
whole state at a known position: the GDN and conv states (a RecurrentSnapshot), the K/V rows below
it, and each drafter's context there (a proposal stream depends on it, and a seeded sampled
request's tokens on the proposals). The K/V rows are copied where the entry must outlive the state
it was taken from (the server's); a session keeps none (`kv` None): its one state still holds them,
since later rows only ever overwrite later positions (`drop_past` forgets the entries a turn's
rows overwrite). An entry's `trunk` None is the owner's live state itself, as the last turn left it.

A state that goes on from an entry gives the tokens a cold prefill gives only where a prefill's
rows equal its steps bit for bit (TrunkStep.prefill_rows_are_steps): the callers check that.

Copies share their K/V rows (vLLM's hashed blocks): the rows of positions [j*BLOCK, (j+1)*BLOCK)
are a `Block`, kept once in the cache by the key of the tokens they sit under -- a sha256 chain over
tokens[:(j+1)*BLOCK], each block's digest hashing its parent's and its own tokens, so two prefixes
share a block exactly where they agree up to its end (an image row's tag is part of its token) and
keying a prefix costs one pass over it. Those rows depend on nothing else: a prefill's rows equal
its steps' (above), so whichever sequence wrote them, they are the same bits. An entry holds its
full blocks by reference and its partial tail (under BLOCK rows) as its own copy; a block goes when
the last entry holding it does, and `nbytes` (the LRU budget) counts each block once. So many
entries along one conversation (one at each message boundary, one every N tokens) cost one copy of
its rows plus their recurrent snapshots and tails; a restore copies the blocks and the tail back
into the new state's buffers. `entry_kv` reads an entry's rows whole; `keep` takes them whole.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Sequence
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

# Rows a shared K/V block holds. An entry's own copy is its tail, under BLOCK rows: at the 0.8B
# shape a row is 6 attention layers x K, V x 2 heads x 256 x 2 bytes = 12 KiB, so a tail is at most
# 756 KiB beside its 19.3 MiB recurrent snapshot (smaller blocks would save little), and a
# 2,000-token prompt is 31 blocks (few pieces to hash, count and copy back). vLLM's 16 rows suit
# its kernels reading the blocks in place; here a restore copies them out, so they need not be small.
BLOCK = 64

DraftKey = Hashable  # whose context a drafter snapshot is: (kind, window or ngram config), or the drafter
KV = dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> K, V [Hkv, rows, d] (which rows: said where used)


def tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(x) for x in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(x) for x in obj.values())
    return 0


def row_bytes(kv: KV) -> int:
    """The bytes of one position's K/V rows over every layer."""
    return sum(k[:, :1].nbytes + v[:, :1].nbytes for k, v in kv.values())


def block_keys(tokens: Sequence, blocks: int) -> list[bytes]:
    """The keys of the first `blocks` blocks under `tokens`: block j's is sha256(block j-1's key +
    repr(tokens[j*BLOCK:(j+1)*BLOCK])), so it stands for tokens[:(j+1)*BLOCK] (a tuple's repr ends
    where it ends, and an image row's tag is in it)."""
    keys, key = [], b""
    for j in range(blocks):
        key = hashlib.sha256(key + repr(tuple(tokens[j * BLOCK:(j + 1) * BLOCK])).encode()).digest()
        keys.append(key)
    return keys


@dataclass(eq=False)
class Block:
    """BLOCK positions' K/V rows, shared by every entry whose tokens begin with its key's."""
    key: bytes  # block_keys': the tokens up to its end
    kv: KV  # layer -> K, V [Hkv, BLOCK, d]: positions [j*BLOCK, (j+1)*BLOCK) (copies, never written)
    refs: int = 0  # the entries holding it (0: it leaves the cache)

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.kv)


@dataclass(eq=False)
class KvRows:
    """An entry's K/V rows below its position: shared blocks, then a tail of its own."""
    blocks: list[Block]  # positions [0, len(blocks) * BLOCK), the cache's
    tail: KV  # layer -> K, V [Hkv, pos - len(blocks) * BLOCK, d]: its own copy (under BLOCK rows)


@dataclass(eq=False)
class Entry:
    tokens: tuple  # the state holds tokens[:-1]; tokens[-1] is the anchor after them (image rows tagged)
    trunk: RecurrentSnapshot | None  # None: the owner's live state itself
    kv: KvRows | None  # its K/V rows below pos (a copy's); None: the owner's state holds them
    drafts: dict[DraftKey, Any] = field(default_factory=dict)  # drafter key -> its snapshot after the tokens
    kind: str = "prompt"  # the kind of mark it was last kept at (Keeper.keep)

    @property
    def pos(self) -> int:
        return len(self.tokens) - 1

    @property
    def nbytes(self) -> int:
        """What it holds alone (its blocks the cache counts, once)."""
        own = tensor_bytes(self.kv.tail) if self.kv is not None else 0
        return (self.trunk.nbytes if self.trunk is not None else 0) + own + tensor_bytes(self.drafts)


class StateCache:
    def __init__(self, budget_bytes: float, max_entries: int | None = None):
        # max_entries: how many snapshots (the owner's live state is not one: it goes last)
        self.budget, self.max_entries = budget_bytes, max_entries
        self.entries: OrderedDict[tuple, Entry] = OrderedDict()  # oldest use first
        self.blocks: dict[bytes, Block] = {}  # key -> a block some entry holds
        self.nbytes = 0  # the entries' own bytes and each block once
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

    def keep(self, tokens: list, trunk: RecurrentSnapshot | None, kv: KV | None, draft: DraftKey | None = None,
             snap: Any = None) -> Entry | None:
        """Keep a state holding tokens[:-1] (`trunk` None: the owner's live state) with its K/V rows
        `kv` (layer -> K, V [Hkv, >= len(tokens) - 1, d], read, not held: the blocks the cache has
        shared, the rest copied; None: the owner's state holds them) and, for drafter `draft`, its
        snapshot `snap`; the oldest entries go while over budget. None: too big."""
        key = tuple(tokens)
        e = self.entries.get(key)
        if e is None or (e.trunk is None) != (trunk is None):
            if e is not None:
                self._drop(key)
            if kv is None:
                e = Entry(key, trunk, None)
                if e.nbytes > self.budget:
                    return None
            else:
                pos, keys = len(key) - 1, block_keys(key, (len(key) - 1) // BLOCK)
                new = sum(k not in self.blocks for k in keys) * BLOCK + pos - len(keys) * BLOCK
                if (trunk.nbytes if trunk is not None else 0) + new * row_bytes(kv) > self.budget:
                    return None
                blocks = [self._hold(k, j, kv) for j, k in enumerate(keys)]
                e = Entry(key, trunk, KvRows(blocks, _rows(kv, len(keys) * BLOCK, pos)))
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
        self.keep(tokens, trunk.snapshot(st), st.kv, draft, snap)

    def drop_past(self, pos: int) -> None:
        """Forget the entries past `pos` that hold no K/V of their own: the owner's state is about
        to overwrite their rows."""
        for key in [k for k, e in self.entries.items() if e.kv is None and e.pos > pos]:
            self._drop(key)

    def drop_live(self) -> None:
        """Forget the owner's live state (it is about to move on)."""
        for key in [k for k, e in self.entries.items() if e.trunk is None]:
            self._drop(key)

    def _hold(self, key: bytes, j: int, kv: KV) -> Block:
        """Block `key` (the j-th), one more entry holding it: the cache's, or a copy of kv's rows."""
        b = self.blocks.get(key)
        if b is None:
            b = self.blocks[key] = Block(key, _rows(kv, j * BLOCK, (j + 1) * BLOCK))
            self.nbytes += b.nbytes
        b.refs += 1
        return b

    def _drop(self, key: tuple) -> None:
        e = self.entries.pop(key)
        self.nbytes -= e.nbytes
        for b in e.kv.blocks if e.kv is not None else ():
            b.refs -= 1
            if b.refs == 0:
                del self.blocks[b.key]
                self.nbytes -= b.nbytes

    @staticmethod
    def restore(trunk: Trunk, e: Entry, capacity: int) -> TrunkState:
        """A fresh state holding an entry's tokens[:-1] (an entry with its own K/V; itself left as
        it is): its blocks' rows and its tail's copied into the state's buffers."""
        st = trunk.new_state(max(capacity, len(e.tokens)))
        for j, b in enumerate(e.kv.blocks):
            _put(st.kv, b.kv, j * BLOCK)
        _put(st.kv, e.kv.tail, len(e.kv.blocks) * BLOCK)
        trunk.restore(st, e.trunk)
        return st

    @staticmethod
    def entry_kv(e: Entry) -> KV:
        """An entry's K/V rows whole (an entry with its own K/V): layer -> K, V [Hkv, e.pos, d],
        new tensors (what `keep` takes back)."""
        if e.kv is None:
            raise ValueError("entry_kv: the entry holds no K/V of its own (a live keeper's)")
        parts = [b.kv for b in e.kv.blocks] + [e.kv.tail]
        return {i: (torch.cat([p[i][0] for p in parts], dim=1), torch.cat([p[i][1] for p in parts], dim=1))
                for i in e.kv.tail}


def _rows(kv: KV, start: int, end: int) -> KV:
    """Copies of kv's rows [start, end): layer -> K, V [Hkv, end - start, d]."""
    return {i: (k[:, start:end].clone(), v[:, start:end].clone()) for i, (k, v) in kv.items()}


def _put(into: KV, rows: KV, at: int) -> None:
    """`rows` (layer -> K, V [Hkv, n, d]) written into `into`'s buffers at rows [at, at + n)."""
    for i, (k, v) in rows.items():
        into[i][0][:, at:at + k.shape[1]] = k
        into[i][1][:, at:at + v.shape[1]] = v


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


# A mark's kind: which boundary of the prompt a kept state ends at (the server reports the one a
# request went on from): the system message, the system message with the tools block, an earlier
# complete turn, a serve.snapshot_every chunk, the prompt's end, or an answer's end.
MARK_KINDS = ("system", "tools", "turn", "chunk", "prompt", "answer")
Marks = dict  # prompt row (None: the prompt's end) -> its kind (MARK_KINDS)


def added_bytes(e: Entry) -> int:
    """What keeping a new entry `e` added to its cache: what it holds alone (its recurrent state,
    its K/V tail, its drafter's context) and the K/V blocks only it holds (the ones it brought)."""
    return e.nbytes + (sum(b.nbytes for b in e.kv.blocks if b.refs == 1) if e.kv is not None else 0)


class Keeper:
    """Where sequences start from and end in (Driver.start, Driver.end): a StateCache and the
    marks where a start keeps the state it passes (each at or past the prefix it restored). Two kinds:

    - `live` (a chat session's, `Runtime.choices`'): one trunk state goes on from sequence to
      sequence; its entries hold no K/V (the state's own rows: `drop_past`), the live one as the
      last sequence left it and a snapshot at each start's mark (a session's: the start of its
      assistant turn's generation prompt, where a re-render can diverge);
    - copies (the server's prefix cache): each entry a copy that outlives its sequence, kept at
      each of the request's marks (its template's boundaries, every serve.snapshot_every rows,
      the prompt's end) and at the answer's end."""

    def __init__(self, kept: StateCache, live: bool, marks: Marks | None = None):
        self.kept, self.live = kept, live
        self.limit = kept.max_entries
        self.marks: Marks = marks if marks is not None else {None: "prompt"}  # where the next start keeps its state
        self.kept_bytes: dict[str, int] = {}  # kind -> bytes the copies kept at such marks added (evicted or not)
        self.st: TrunkState | None = None  # a live keeper's state
        self.report = TurnReport(0, 0, 0, "fresh", 0, 0)  # the last start's (and end's) account

    @classmethod
    def session(cls, limit: int = DEFAULT_SNAPSHOTS) -> Keeper:
        """A session's: the live state and `limit` snapshots, bounded in entries, not bytes."""
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise TurboError(f"snapshots {limit!r}: expected a non-negative integer")
        return cls(StateCache(math.inf, max_entries=limit), live=True, marks={0: "turn"})

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
             kind: str) -> None:
        """`st`, holding tokens[:-1], kept at a mark of `kind` ("answer": the answer's end), with
        drafter `draft`'s context `snap` there: a live keeper's snapshot (the answer's end: the
        live state itself), or a copy (its bytes counted under its kind)."""
        key = tuple(tokens)
        new = key not in self.kept.entries
        if not self.live:
            self.kept.keep_copy(trunk, st, tokens, draft, snap)
        elif kind == "answer":
            self.kept.keep(tokens, None, None, draft, snap)
        elif not new:
            self.kept.keep(tokens, self.kept.entries[key].trunk, None, draft, snap)
        else:
            self.kept.keep(tokens, trunk.snapshot(st), None, draft, snap)
        e = self.kept.entries.get(key)
        if e is None:
            return
        e.kind = kind
        if new and not self.live:
            self.kept_bytes[kind] = self.kept_bytes.get(kind, 0) + added_bytes(e)
