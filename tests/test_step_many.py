"""Trunk.step_many: one pass over the rows of many sequences (a continuous batch) gives each
sequence, bit for bit, what `step` gives it alone -- logits, hidden, aux, traces and the state
after -- whatever the batch holds (batch invariance), on the native step (fp32 and bf16 K/V,
dense and MoE) and the torch step. Every check is torch.equal: a row whose result depended on
its batch fails."""

from dataclasses import dataclass

import pytest
import torch

from turbo.backends import native_lib
from turbo.load.loader import load_trunk
from turbo.model.step import TrunkState
from turbo.sequence.options import OpenOptions
from turbo.store.install import open_install
from turbo.testing import make_moe_install


@dataclass
class Entry:
    prompt: list[int]  # prefilled before the batch (empty: a fresh state)
    tokens: list[int]  # the rows in the batch
    aux: tuple[int, ...]
    rollback: str | None
    logit_rows: int


def toks(n: int, seed: int) -> list[int]:
    return [(17 * i + 31 * seed) % 250 + 3 for i in range(n)]


ENTRIES = [
    Entry([], toks(40, 1), (), None, 0),  # a fresh prompt's first chunk (the prompt goes on)
    Entry(toks(256, 2), toks(44, 3), (1,), None, 1),  # a 300-token prompt's last chunk
    Entry(toks(1, 4), toks(1, 5), (), None, 1),  # a decode step after a 1-token prompt
    Entry(toks(17, 6), toks(9, 7), (0, 2), "checkpoint", 9),  # verifies
    Entry(toks(300, 8), toks(9, 9), (2,), "replay", 9),
    Entry(toks(5, 10), toks(1, 11), (1,), "checkpoint", 1),  # a verify of one row (block 0)
    Entry([], toks(1, 12), (), None, 1),  # a 1-token prompt, whole
]


_prefilled: dict[tuple, object] = {}


def prepared(trunk, entries):
    """Each entry's state with its prompt prefilled (once per trunk and prompt; copies)."""
    states = []
    for e in entries:
        key = (id(trunk), tuple(e.prompt))
        if key not in _prefilled:
            st = trunk.new_state(16)
            if e.prompt:
                trunk.prefill(st, e.prompt)
            _prefilled[key] = st
        st = _prefilled[key]
        states.append(TrunkState(st.pos, {i: (k.clone(), v.clone()) for i, (k, v) in st.kv.items()},
                                 {i: (s.clone(), w.clone()) for i, (s, w) in st.gdn.items()}))
    return states


def batch(trunk, entries, states):
    return trunk.step_many(states, [e.tokens for e in entries], [e.aux for e in entries],
                           [e.rollback for e in entries], [e.logit_rows for e in entries])


def solo(trunk, entries, states):
    """Each entry alone through `step`, its logits cut to the rows asked. (The torch step's head
    over a 44-row chunk does not give its last row the bits of a head over that row alone:
    products past 9 rows are not padded to a row-stable shape. So there the reference is a
    step_many of the entry alone, which heads only the rows asked.)"""
    outs = []
    for e, st in zip(entries, states):
        if trunk.step_name == "torch" and e.logit_rows < len(e.tokens):
            outs.append(trunk.step_many([st], [e.tokens], [e.aux], [e.rollback], [e.logit_rows])[0])
            continue
        out = trunk.step(st, e.tokens, e.aux, e.rollback)
        out.logits = out.logits[len(e.tokens) - e.logit_rows:]
        outs.append(out)
    return outs


def same_tensors(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_tensors(x, y) for x, y in zip(a, b))
    return a.shape == b.shape and torch.equal(a, b)


def assert_same_out(a, b):
    assert same_tensors(a.logits, b.logits)
    assert same_tensors(a.hidden, b.hidden)
    assert same_tensors(a.aux, b.aux)
    assert a.traces.keys() == b.traces.keys()
    for i in a.traces:
        ta, tb = a.traces[i], b.traces[i]
        for field in ("snapshot", "ext", "inputs", "states"):
            assert same_tensors(getattr(ta, field), getattr(tb, field)), (i, field)


def assert_same_state(a, b):
    assert a.pos == b.pos
    for i in a.kv:  # the K/V rows written
        assert torch.equal(a.kv[i][0][:, :a.pos], b.kv[i][0][:, :b.pos])
        assert torch.equal(a.kv[i][1][:, :a.pos], b.kv[i][1][:, :b.pos])
    for i in a.gdn:
        assert torch.equal(a.gdn[i][0], b.gdn[i][0]) and torch.equal(a.gdn[i][1], b.gdn[i][1])


@pytest.fixture(scope="module")
def moe_install(tmp_path_factory):
    return make_moe_install(tmp_path_factory.mktemp("moe"), 3, num_hidden_layers=4)[1]


TRUNKS = {
    "native-fp32": ("tiny", dict(kv_cache="float32")),
    "native-bf16-kv": ("tiny", dict(kv_cache="bfloat16")),
    "native-moe": ("moe", dict()),
    "torch": ("tiny", dict(native=False)),
}


@pytest.fixture(scope="module", params=list(TRUNKS))
def trunk(request):
    where, opts = TRUNKS[request.param]
    if opts.get("native", True) and native_lib.library() is None:
        pytest.skip(f"native step unavailable: {native_lib.why_not()}")
    install = request.getfixturevalue("moe_install") if where == "moe" else where
    t = load_trunk(open_install(install), OpenOptions(**opts), "cpu")
    assert t.step_name == ("torch" if request.param == "torch" else "native")
    return t


def entries_for(trunk) -> list[Entry]:
    layers = trunk.arch.num_layers
    return [Entry(e.prompt, e.tokens, tuple(i for i in e.aux if i < layers), e.rollback, e.logit_rows)
            for e in ENTRIES]


def test_each_sequence_of_a_batch_is_its_solo_step(trunk):
    entries = entries_for(trunk)
    states, alone = prepared(trunk, entries), prepared(trunk, entries)
    outs, refs = batch(trunk, entries, states), solo(trunk, entries, alone)
    for e, out, ref, st, st_ref in zip(entries, outs, refs, states, alone):
        assert out.logits.shape == (e.logit_rows, trunk.arch.vocab)
        assert_same_out(out, ref)
        assert_same_state(st, st_ref)
    # and the next step from the states left: the same again
    nxt = [Entry([], toks(1, 20 + j), (), None, 1) for j in range(len(entries))]
    for out, ref in zip(batch(trunk, nxt, states), solo(trunk, nxt, alone)):
        assert_same_out(out, ref)


def test_a_sequence_has_the_same_bits_in_any_batch(trunk):
    entries = entries_for(trunk)
    orders = [list(range(len(entries))), list(reversed(range(len(entries)))), [3, 4], [4], [2, 3, 0, 4]]
    seen: dict[int, object] = {}
    for order in orders:
        chosen = [entries[j] for j in order]
        states = prepared(trunk, chosen)
        for j, out, st in zip(order, batch(trunk, chosen, states), states):
            if j in seen:
                ref, st_ref = seen[j]
                assert_same_out(out, ref)
                assert_same_state(st, st_ref)
            else:
                seen[j] = (out, st)


@pytest.mark.parametrize("kept", [0, 4])
def test_rollback_after_a_batch_is_rollback_after_a_solo_step(trunk, kept):
    entries = entries_for(trunk)
    states, alone = prepared(trunk, entries), prepared(trunk, entries)
    outs, refs = batch(trunk, entries, states), solo(trunk, entries, alone)
    for e, out, ref, st, st_ref in zip(entries, outs, refs, states, alone):
        if e.rollback is None or kept >= len(e.tokens):
            continue
        assert trunk.rollback(st, out, len(e.tokens), kept, e.rollback) == \
            trunk.rollback(st_ref, ref, len(e.tokens), kept, e.rollback)
        assert_same_state(st, st_ref)
        assert same_tensors(trunk.step(st, [7], (), None).logits, trunk.step(st_ref, [7], (), None).logits)


def test_empty_and_malformed_batches(trunk):
    assert trunk.step_many([], [], [], [], []) == []
    st = trunk.new_state(16)
    with pytest.raises(ValueError):
        trunk.step_many([st, st], [[5], [6]], [(), ()], [None, None], [1, 1])
    with pytest.raises(ValueError):
        trunk.step_many([st], [[5]], [()], [None], [2])
    with pytest.raises(ValueError):
        trunk.step_many([st], [[]], [()], [None], [0])
    assert st.pos == 0


def test_a_batch_on_two_threads_is_the_solo_steps_on_one(trunk):
    """At two threads a batch splits its recurrence by (sequence, head), its attention by
    (block, kv head) and its conv by row: each value still computed whole by one thread."""
    if trunk.step_name != "native":
        pytest.skip("the torch step's batch is its steps one after another")
    entries = entries_for(trunk)
    states, alone = prepared(trunk, entries), prepared(trunk, entries)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        outs = batch(trunk, entries, states)
    finally:
        torch.set_num_threads(threads)
    for out, ref, st, st_ref in zip(outs, solo(trunk, entries, alone), states, alone):
        assert_same_out(out, ref)
        assert_same_state(st, st_ref)


def test_a_plain_step_updates_its_state_in_place_a_verify_keeps_the_old(trunk):
    """Without a rollback nothing holds the state a step reads, so the native step writes the new
    one over it (a third less memory traffic); a verify's trace keeps it as its snapshot."""
    if trunk.step_name != "native":
        pytest.skip("the torch step's states are new tensors")
    plain, verify = prepared(trunk, [ENTRIES[2], ENTRIES[3]])
    before = {i: s.clone() for i, (s, _) in verify.gdn.items()}
    held = {i: (plain.gdn[i][0].data_ptr(), verify.gdn[i][0].data_ptr()) for i in plain.gdn}
    outs = trunk.step_many([plain, verify], [ENTRIES[2].tokens, ENTRIES[3].tokens], [(), ()],
                           [None, "checkpoint"], [1, 9])
    for i, (p, v) in held.items():
        assert plain.gdn[i][0].data_ptr() == p and verify.gdn[i][0].data_ptr() != v
        assert torch.equal(outs[1].traces[i].snapshot, before[i])
