"""The prefix cache's shared K/V blocks (turbo/sequence/state_cache.py): entries along one prompt
hold its rows once, a restored entry is exact (its rows the bits a cold prefill writes, its tokens a
cold generation's), eviction frees only the blocks no survivor holds, the bytes stay in budget."""

from __future__ import annotations

import random

import pytest
import torch

import turbo
from turbo.sequence.options import GenerationOptions as G
from turbo.sequence.state_cache import BLOCK, Entry, StateCache, block_keys, row_bytes
from turbo.serve.scheduler import Request, Scheduler, ServeLimits
from turbo.testing.checks import Collect


@pytest.fixture(scope="module")
def tiny():
    return turbo.open("tiny", threads=1)


def run(sched: Scheduler, req: Request) -> Collect:
    sink = Collect()
    sched.submit(req, sink)
    steps = 0
    while not sink.done:
        sched.step()
        steps += 1
        assert steps < 5000
    assert sink.error is None
    return sink


def long_prompt(tiny, n: int) -> list[int]:
    ids = tiny.encode(tiny.decode(list(range(200, 4000, 7))) * 6)
    assert len(ids) >= n
    return ids[:n]


def check_books(cache: StateCache) -> None:
    """Each block counted once, held by exactly the entries that list it, none orphaned."""
    held: dict[bytes, int] = {}
    for e in cache.entries.values():
        for b in e.kv.blocks if e.kv is not None else ():
            assert cache.blocks[b.key] is b
            held[b.key] = held.get(b.key, 0) + 1
    assert held == {k: b.refs for k, b in cache.blocks.items()}
    assert cache.nbytes == sum(e.nbytes for e in cache.entries.values()) + sum(b.nbytes for b in cache.blocks.values())
    assert cache.nbytes <= cache.budget


def rows_equal(a: dict, b: dict, n: int) -> bool:
    return all(torch.equal(a[i][j][:, :n], b[i][j][:, :n]) for i in a for j in (0, 1))


def test_entries_along_one_prompt_hold_its_rows_once(tiny):
    """10 entries at boundaries of one 2,000-token prompt: one copy of its rows (31 blocks and
    each entry's tail) plus 10 recurrent snapshots, not 10 copies; each restores to its bits."""
    trunk, ids = tiny.trunk, long_prompt(tiny, 2001)
    cache, st = StateCache(float("inf")), trunk.new_state(2048)
    bounds = list(range(200, 2001, 200))
    for b in bounds:
        if st.pos == 0:
            trunk.prefill(st, ids[:b])
        else:
            trunk.extend(st, ids[st.pos:b])
        cache.keep_copy(trunk, st, ids[:b + 1], None, None)
    check_books(cache)
    row, snap = row_bytes(st.kv), trunk.snapshot(st).nbytes
    assert len(cache.blocks) == 2000 // BLOCK
    assert cache.nbytes == 10 * snap + (2000 // BLOCK * BLOCK + sum(b % BLOCK for b in bounds)) * row
    assert cache.nbytes < 10 * snap + 1.3 * 2000 * row < 10 * snap + sum(bounds) * row / 4  # (copies: 11,000 rows)
    for b in bounds:
        e = cache.entries[tuple(ids[:b + 1])]
        back = StateCache.restore(trunk, e, 64)
        assert back.pos == b and rows_equal(back.kv, st.kv, b)  # (rows below a position never change)
        whole = StateCache.entry_kv(e)
        assert all(k.shape[1] == v.shape[1] == b for k, v in whole.values()) and rows_equal(whole, st.kv, b)
    # an entry kept from its whole rows (entry_kv's) shares the blocks already there
    again = StateCache(float("inf"))
    for n in (1000, 2000):
        e = cache.entries[tuple(ids[:n + 1])]
        assert again.keep(list(e.tokens), e.trunk, StateCache.entry_kv(e)) is not None
    assert len(again.blocks) == 2000 // BLOCK and all(b.refs == (2 if i < 1000 // BLOCK else 1)
                                                        for i, b in enumerate(again.blocks.values()))
    check_books(again)


def test_blocks_are_keyed_by_the_whole_prefix():
    """Equal rows under different earlier tokens (or another image's tag) never share a block."""
    kv = {3: (torch.randn(2, 300, 8), torch.randn(2, 300, 8))}
    a = list(range(1000, 1300))
    b = [7] + a[1:]  # differs in block 0 only
    c = a[:100] + [(5, ((1, 2, 2), "f00"))] + a[101:]  # an image row tagged in block 1
    d = a[:100] + [(5, ((1, 2, 2), "ba4"))] + a[101:]  # the same place, another image
    ka, kb, kc, kd = (block_keys(t, 4) for t in (a, b, c, d))
    assert not set(ka) & set(kb)
    assert kc[0] == kd[0] == ka[0] and not set(kc[1:]) & set(kd[1:]) and not set(kc[1:]) & set(ka[1:])
    cache = StateCache(float("inf"))
    for t in (a, b, c, d, a[:200]):
        cache.keep(t, None, kv)
    assert len(cache.blocks) == 4 + 4 + 3 + 3  # a's, b's, c's past block 0, d's past block 0 (a[:200]: a's)
    check_books(cache)


@pytest.mark.parametrize("opts", [dict(policy="off"), dict(policy="fixed", block=4, drafter="dflash"),
                                  dict(temperature=0.8, seed=7, policy="fixed", block=4)])
def test_a_restored_entry_gives_a_cold_generation(tiny, opts):
    """A prompt, then a prompt going on from its answer: the second starts from a kept entry (the
    answer's, or the prompt's where a last round ran past the answer) and gives the tokens of a
    cold generation; its own entries share the first prompt's blocks."""
    sched = Scheduler(tiny, ServeLimits(prefill_chunk=128))
    o = G(max_new_tokens=12, **opts)
    first = long_prompt(tiny, 700)
    answer = run(sched, Request(list(first), o)).tokens
    assert answer == tiny.generate(first, o).tokens
    check_books(sched.cache)
    then = first + answer + tiny.encode("\nQ: and then?\nA:")
    sink = run(sched, Request(list(then), o))
    assert sink.tokens == tiny.generate(then, o).tokens
    assert sink.deltas[-1].cached_tokens >= len(first) - 1  # (a kept state's last token is its anchor)
    assert sum(b.refs >= 2 for b in sched.cache.blocks.values()) >= (len(first) - 1) // BLOCK
    check_books(sched.cache)


def test_eviction_frees_blocks_and_spares_the_survivors(tiny):
    """Under a small budget requests sharing a prefix evict each other's entries: the blocks no
    survivor holds go, and a survivor, restored after its neighbours left, is the cold bits and
    gives the cold tokens."""
    trunk = tiny.trunk
    common = long_prompt(tiny, 400)
    o = G(max_new_tokens=8, policy="off")
    one = trunk.snapshot(trunk.new_state(1)).nbytes + 700 * row_bytes(trunk.new_state(1).kv)  # about an entry
    sched = Scheduler(tiny, ServeLimits(cache_gb=3.5 * one / 2**30))
    prompts = [common + tiny.encode(f"\n# variant {i}:\n" + f"x{i} = y + {i}\n" * 25) for i in range(6)]
    answers = [run(sched, Request(list(p), o)).tokens for p in prompts]
    cache = sched.cache
    gone = tuple(prompts[0] + answers[0])
    assert gone not in cache.entries and tuple(prompts[0]) not in cache.entries  # evicted ...
    keys = block_keys(gone, (len(gone) - 1) // BLOCK)
    shared = len(common) // BLOCK  # (the blocks under the common prefix alone)
    assert all(k in cache.blocks for k in keys[:shared]) and not any(k in cache.blocks for k in keys[shared:])
    check_books(cache)  # ... and every block of an evicted entry no survivor holds is gone
    survivor = cache.entries[tuple(prompts[-1] + answers[-1])]
    cold = trunk.new_state(1024)
    trunk.prefill(cold, list(survivor.tokens[:-1]))
    back = StateCache.restore(trunk, survivor, 64)
    assert rows_equal(back.kv, cold.kv, survivor.pos)
    assert all(torch.equal(a, b) for i in cold.gdn for a, b in zip(back.gdn[i], cold.gdn[i]))
    then = prompts[-1] + answers[-1] + tiny.encode("\n# and more\n")
    sink = run(sched, Request(list(then), o))
    assert sink.tokens == tiny.generate(then, o).tokens and sink.deltas[-1].cached_tokens == survivor.pos
    check_books(sched.cache)


def test_a_thousand_distinct_short_prompts_keep_within_budget(tiny):
    """1,000 distinct prompts (some sharing a first block): the bytes never pass the budget, and
    what leaves takes its blocks with it."""
    trunk, rng = tiny.trunk, random.Random(0)
    st = trunk.new_state(256)
    trunk.prefill(st, long_prompt(tiny, 200))
    snap = trunk.snapshot(st)
    cache = StateCache(12 * (snap.nbytes + 200 * row_bytes(st.kv)))
    heads = [[rng.randrange(5, 5000) for _ in range(BLOCK)] for _ in range(5)]
    seen = set()
    for i in range(1000):
        tail = [rng.randrange(5, 5000) for _ in range(rng.randrange(2, 130))]
        tokens = heads[i % 5] + tail if i % 2 else tail
        assert tuple(tokens) not in seen
        seen.add(tuple(tokens))
        assert isinstance(cache.keep(tokens, snap, st.kv), Entry)
        assert cache.nbytes <= cache.budget
    check_books(cache)
    assert 5 <= len(cache.entries) < 1000
