"""Lossless speculation, exact counters, rollback strategies, the drafter ring and scaling."""

import pytest
import torch

import turbo
from turbo.backends import native_lib, ops
from turbo.backends.packed import Packed
from turbo.load.loader import load_dflash, load_trunk
from turbo.sequence.options import OpenOptions
from turbo.store.install import open_install
from turbo.testing import ScriptedDrafter

PROMPTS = [list(range(5, 40)), [7, 100, 3, 250, 17, 17, 17, 42]]
pytestmark = pytest.mark.usefixtures("step_path")  # every test on both CPU steps


def Trunk(inst):  # noqa: N802 (the step the environment names: step_path sets TURBO_NATIVE)
    return load_trunk(inst, OpenOptions.from_env(), "cpu")


def DflashDrafter(inst, embed, lm_head, **kw):  # noqa: N802
    return load_dflash(inst, embed, lm_head, opts=OpenOptions.from_env(), **kw)


@pytest.fixture(scope="module")
def rt(spec_install, step_path):
    return turbo.open(spec_install[1], backend="cpu")


def test_the_step_in_use_is_the_one_asked_for(rt, step_path):
    assert rt.trunk.step_name == step_path


@pytest.fixture(scope="module")
def plain(rt):
    return {i: rt.generate(p, max_new_tokens=37, policy="off").tokens for i, p in enumerate(PROMPTS)}


@pytest.mark.parametrize("rollback", ["checkpoint", "replay"])
@pytest.mark.parametrize("block", range(1, 9))
def test_random_drafter_is_lossless(rt, plain, block, rollback):
    for i, prompt in enumerate(PROMPTS):
        # 37 new tokens: not a multiple of any block above 1
        out = rt.generate(prompt, max_new_tokens=37, policy="fixed", block=block, rollback=rollback)
        assert out.tokens == plain[i]
        assert out.stats.block == block and out.stats.drafted == block * out.stats.rounds


def test_lossless_past_the_drafter_window(rt):
    """window 4 -> a ring of 4 + 128 slots; 30 + 150 positions wrap it."""
    prompt = list(range(3, 33))
    base = rt.generate(prompt, max_new_tokens=150, policy="off").tokens
    for block, rollback in [(3, "checkpoint"), (8, "replay")]:
        out = rt.generate(prompt, max_new_tokens=150, policy="fixed", block=block, rollback=rollback, window=4)
        assert out.tokens == base and out.stats.window == 4


def test_ring_wrap_attends_exactly_the_window(spec_install):
    """A wrapped ring gives the same draft logits as an unbounded one over the same window."""
    inst = open_install(spec_install[1])
    trunk = Trunk(inst)
    wrapped = DflashDrafter(inst, trunk.embed, ops.dense(trunk.lm_head), window=6)
    unbounded = DflashDrafter(inst, trunk.embed, ops.dense(trunk.lm_head), window=6)
    unbounded.reset(capacity=10_000)
    st = trunk.new_state()
    ids = [int(t) for t in torch.randint(0, 320, (300,), generator=torch.Generator().manual_seed(3))]
    out = trunk.prefill(st, ids[:-1], wrapped.aux_layers)
    wrapped.begin(out)
    unbounded.reset(capacity=10_000)
    unbounded.add_context(out.aux)
    assert wrapped.context == 299 > wrapped.capacity
    a, _ = wrapped.forward_block(ids[-1], 299, 8)
    b, _ = unbounded.forward_block(ids[-1], 299, 8)
    assert torch.equal(a, b)


@pytest.mark.parametrize("rollback", ["checkpoint", "replay"])
def test_scripted_drafter_counters_equal_hand_computed(rt, rollback):
    prompt = PROMPTS[0]
    schedule = [4, 0, 1, 2, 3, 4, 2, 0]  # every accepted count 0..4 occurs
    base = rt.generate(prompt, max_new_tokens=24 + 8, policy="off").tokens
    scripted = ScriptedDrafter(prompt + base, schedule, 320)
    out = rt.generate(prompt, max_new_tokens=24, policy="fixed", block=4, rollback=rollback, drafter=scripted)
    s = out.stats
    assert out.tokens == base[:24]
    # by hand: 8 rounds, sum(n) = 16, rounds with n < 4: six; tokens = sum(n + 1) = 24
    assert (s.rounds, s.drafted, s.accepted, s.generated_tokens) == (8, 32, 16, 24)
    assert s.accepted_per_round == 2.0 and s.mean_acceptance_length == 3.0
    assert s.rollback_rate == 0.75
    # position i judged when n >= i-1, accepted when n >= i: 6/8, 5/6, 3/5, 2/3
    assert s.per_position_acceptance == pytest.approx([6 / 8, 5 / 6, 3 / 5, 2 / 3])
    # replay re-runs n + 1 rows on each rollback round: 1 + 2 + 3 + 4 + 3 + 1
    assert s.replayed_rows == (14 if rollback == "replay" else 0)
    assert out.from_draft == sum(([True] * n + [False] for n in schedule), [])


def test_a_drafter_object_speculates_where_the_install_ships_none(plain_install):
    """drafter=obj needs only the verify: an install without a DFlash2 drafter speculates with it."""
    plain_rt = turbo.open(plain_install[1], backend="cpu")
    prompt = PROMPTS[1]
    base = plain_rt.generate(prompt, max_new_tokens=20, policy="off").tokens
    assert plain_rt.generate(prompt, max_new_tokens=4).stats.drafter is None  # auto: nothing to draft with
    own = ScriptedDrafter(prompt + base, [2, 0, 3], 320)
    own.kind = "scripted"
    out = plain_rt.generate(prompt, max_new_tokens=20, policy="fixed", block=3, drafter=own)
    assert out.tokens == base and out.stats.drafter == "scripted" and out.stats.accepted > 0
    adaptive = plain_rt.generate(prompt, max_new_tokens=20, policy="adaptive", drafter=own)
    assert adaptive.tokens == base and adaptive.stats.block == 8
    with pytest.raises(turbo.TurboError, match="block 9 is outside 1..8"):
        plain_rt.generate(prompt, policy="fixed", block=9, drafter=own)
    with pytest.raises(turbo.TurboError, match="window 4: .* a drafter object keeps its own"):
        plain_rt.generate(prompt, policy="fixed", block=2, drafter=own, window=4)
    with pytest.raises(turbo.TurboError, match="drafter 7 is not one of auto, dflash, mtp nor a turbo.drafters.Drafter"):
        plain_rt.generate(prompt, drafter=7)


def test_stream_events_carry_round_tokens_and_running_stats(rt):
    events = list(rt.stream(PROMPTS[1], max_new_tokens=20, policy="fixed", block=3))
    assert sum(len(e.tokens) for e in events) == 20 and events[-1].done
    assert [e.stats.rounds for e in events] == list(range(1, len(events) + 1))
    assert all(len(e.tokens) == len(e.from_draft) and not e.from_draft[-1] or e.done for e in events)


def test_replay_and_checkpoint_leave_bit_identical_states(spec_install):
    trunk = Trunk(open_install(spec_install[1]))
    g = torch.Generator().manual_seed(5)
    prompt = [int(t) for t in torch.randint(0, 320, (20,), generator=g)]
    states = {}
    for strategy in ("checkpoint", "replay"):
        st = trunk.new_state()
        trunk.prefill(st, prompt)
        g.manual_seed(9)
        history = []
        for _ in range(12):
            rows = [int(t) for t in torch.randint(0, 320, (int(torch.randint(1, 10, (1,), generator=g)),),
                                                  generator=g)]
            kept = int(torch.randint(1, len(rows) + 1, (1,), generator=g))
            out = trunk.step(st, rows, rollback=strategy)
            trunk.rollback(st, out, len(rows), kept, strategy)
            history.append((st.pos, {i: (s.clone(), w.clone()) for i, (s, w) in st.gdn.items()}))
        states[strategy] = history
    for (pa, a), (pb, b) in zip(states["checkpoint"], states["replay"]):
        assert pa == pb
        for i in a:
            assert torch.equal(a[i][0], b[i][0]) and torch.equal(a[i][1], b[i][1])


def test_verify_rows_equal_decode_steps_bitwise(spec_install):
    """The property losslessness rests on: a verify row computes what a decode step does."""
    trunk = Trunk(open_install(spec_install[1]))
    prompt, rows = list(range(10, 50)), [5, 9, 200, 13, 77, 1, 2, 3, 4]
    a, b = trunk.new_state(), trunk.new_state()
    trunk.prefill(a, prompt)
    trunk.prefill(b, prompt)
    verify = trunk.step(a, rows, aux_layers=(0, 2), rollback="checkpoint")
    for r, tok in enumerate(rows):
        one = trunk.step(b, [tok], aux_layers=(0, 2))
        assert torch.equal(one.logits[0], verify.logits[r]) and torch.equal(one.aux[0], verify.aux[r])
        assert all(torch.equal(b.gdn[i][0], verify.traces[i].states[r]) for i in b.gdn)


def test_residual_scaling_fp16_matches_fp32_where_unscaled_fp16_overflows(spec_install):
    inst = open_install(spec_install[1])
    trunk = Trunk(inst)
    embed = trunk.embed * 1e6  # rows up to ~3e5: past fp16 (65504) unscaled, inside it once divided by 8
    ref = DflashDrafter(inst, embed, ops.dense(trunk.lm_head), dtype=torch.float32, scale=1.0)
    scaled = DflashDrafter(inst, embed, ops.dense(trunk.lm_head), dtype=torch.float16)
    unscaled = DflashDrafter(inst, embed, ops.dense(trunk.lm_head), dtype=torch.float16, scale=1.0)
    st = trunk.new_state()
    out = trunk.prefill(st, list(range(20, 60)), ref.aux_layers)
    for d in (ref, scaled, unscaled):
        d.begin(out)
    a, _ = ref.forward_block(60, 40, 8)
    b, _ = scaled.forward_block(60, 40, 8)
    c, _ = unscaled.forward_block(60, 40, 8)
    assert not torch.isfinite(c).all()
    assert torch.isfinite(b).all()
    assert (a - b).abs().max().item() < 2e-2 * a.abs().max().item()


def test_matrices_take_the_layout_of_the_step(spec_install, step_path):
    inst = open_install(spec_install[1])
    trunk = Trunk(inst)
    if step_path == "native":  # panels of 16 outputs, holding exactly the checkpoint's matrix
        assert all(isinstance(w, Packed) for w in trunk.matrices())
        down = inst.index.load("trunk.layers.0.mlp.down_proj.weight", torch.float32)
        assert torch.equal(trunk.layers[0].down.dense(), down)
    else:
        for w in trunk.matrices():
            assert ops.calibrate_rows(w) in ops.ROW_BLOCK_CANDIDATES + (0,)


def test_the_native_argmax_is_torchs():
    """accept_greedy's row argmax (native.c): the first of equal maxima, a NaN over any number,
    across the 16 lanes and in the tail, at widths below, at and past a vector."""
    if native_lib.library() is None:
        pytest.skip(f"native step unavailable: {native_lib.why_not()}")
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in (1, 7, 16, 17, 40, 4099, 248320):
        x = torch.randn(n, generator=g)
        rows.append(x)
        rows.append(torch.randint(-3, 3, (n,), generator=g).float())  # ties everywhere
        rows.append(torch.full((n,), float("-inf")))
        for at in {0, n // 2, n - 1}:
            y = x.clone()
            y[at] = float("nan")
            rows.append(y)
            y = x.clone()
            y[at] = y.max() + 1  # one peak, lane and tail alike
            rows.append(y)
            y = x.clone()
            y[at] = float("inf")
            y[-1] = float("inf")  # a tie at inf: the first
            rows.append(y)
    for row in rows:
        assert ops.argmax(row) == int(row.argmax()), (row.shape, row[:4])
