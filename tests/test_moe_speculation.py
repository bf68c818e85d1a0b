"""Speculation on MoE installs: lossless through the routed verify where the install carries a
drafter of its own (an MTP head whose layer routes too) or with ngram, the ported MoE blocker
where no drafter is at hand; on both CPU steps."""

import types

import pytest
import torch
from test_mtp import add_mtp, mtp_tensors

import turbo
from turbo.load.load_plan import moe_tensor_shapes
from turbo.repack import repack
from turbo.sequence.policy import MOE_SPECULATION_BLOCKER_MARKER
from turbo.store.arch import arch_from_config
from turbo.testing import ScriptedDrafter, assert_lossless, make_drafter, make_moe_checkpoint, make_moe_install

PROMPTS = [[5, 17, 99, 3, 250, 41, 8], [7, 100, 3, 250, 17, 17, 17, 42, 7, 100, 3, 250, 17]]
pytestmark = pytest.mark.usefixtures("step_path")


def moe_mtp_tensors(config, seed: int) -> dict[str, torch.Tensor]:
    """A random MTP head whose layer's MLP is the checkpoint's MoE block (as Qwen3.5-35B-A3B's is)."""
    g = torch.Generator().manual_seed(2000 + seed)
    attention = mtp_tensors(types.SimpleNamespace(**config.to_dict() | {"intermediate_size": 1}), seed)
    mlp = moe_tensor_shapes(arch_from_config(config.to_dict()), "mtp.layers.0.mlp.")
    return {n: t for n, t in attention.items() if ".mlp." not in n} | {
        n: (torch.randn(shape, generator=g) * 0.08).contiguous() for n, shape in mlp.items()}


@pytest.fixture(scope="module")
def rt(tmp_path_factory, step_path):
    tmp = tmp_path_factory.mktemp("moe-mtp")
    model = make_moe_checkpoint(tmp / "hf", "qwen3_5_moe", 6)
    add_mtp(tmp / "hf", moe_mtp_tensors(model.config, 6))
    runtime = turbo.open(repack(tmp / "hf", tmp / "install", quiet=True), backend="cpu")
    assert runtime.trunk.step_name == step_path
    return runtime


@pytest.mark.parametrize("rollback", ["checkpoint", "replay"])
@pytest.mark.parametrize("drafter", ["mtp", "ngram"])
def test_lossless_every_block(rt, drafter, rollback):
    for prompt in PROMPTS:
        ref = rt.generate(prompt, max_new_tokens=24, policy="off", stop_at_eos=False).tokens
        for block in range(1, 9):
            res = rt.generate(prompt, max_new_tokens=24, policy="fixed", block=block, drafter=drafter,
                              rollback=rollback, stop_at_eos=False)
            assert res.tokens == ref, (prompt, block)
            assert res.stats.drafter == drafter and res.stats.block == block and res.stats.rounds > 0


@pytest.mark.parametrize("rollback", ["checkpoint", "replay"])
def test_every_accepted_count_commits_plain_decode(rt, rollback):
    """A drafter right up to a chosen position: every accepted count 0..block, so the routed
    verify's rows are kept, rolled back and replayed at every depth."""
    prompt = PROMPTS[0]
    base = rt.generate(prompt, max_new_tokens=40, policy="off", stop_at_eos=False).tokens
    for block in (1, 4, 8):
        scripted = ScriptedDrafter(prompt + base + [0] * 8, list(range(block + 1)), 320)
        res = assert_lossless(rt, prompt, base[:32], block, max_new_tokens=32, drafter=scripted, rollback=rollback,
                              stop_at_eos=False)
        assert res.stats.rollbacks > 0 and res.stats.accepted > 0


def test_auto_picks_the_head(rt):
    res = rt.generate(PROMPTS[0], max_new_tokens=8, stop_at_eos=False)
    assert res.stats.drafter == "mtp" and res.stats.speculation_off_reason is None


def test_without_a_drafter_of_its_own_the_moe_blocker_holds(tmp_path):
    """The ported policy, marker and message, for every drafter that needs weights the install
    lacks: fixed refuses, auto plain-decodes and says why. ngram needs none: it speculates."""
    _, path = make_moe_install(tmp_path, 7)
    bare = turbo.open(path, backend="cpu")
    plain = bare.generate([1, 2, 3], max_new_tokens=6, policy="off", stop_at_eos=False).tokens
    prompt = [5, 17, 99, 5, 17, 99, 5, 17]
    ref = bare.generate(prompt, max_new_tokens=24, policy="off", stop_at_eos=False).tokens
    for block in (1, 4, 8):
        res = bare.generate(prompt, max_new_tokens=24, policy="fixed", block=block, drafter="ngram", stop_at_eos=False)
        assert res.tokens == ref and res.stats.drafter == "ngram" and res.stats.speculation_off_reason is None
    for drafter in ("auto", "dflash", "mtp"):
        with pytest.raises(turbo.TurboError, match=r"speculation blocked \[moe\]: this install routes to 8 experts"):
            bare.generate([1, 2, 3], max_new_tokens=6, policy="fixed", block=2, drafter=drafter)
    # auto falls back to plain decoding with the blocker's reason; a named drafter is refused (issue #34)
    res = bare.generate([1, 2, 3], max_new_tokens=6, policy="auto", drafter="auto", stop_at_eos=False)
    assert res.tokens == plain and res.stats.drafter is None
    assert res.stats.speculation_off_reason.startswith(MOE_SPECULATION_BLOCKER_MARKER)
    for drafter in ("dflash", "mtp"):
        with pytest.raises(turbo.TurboError, match=r"speculation blocked \[moe\]"):
            bare.generate([1, 2, 3], max_new_tokens=6, policy="auto", drafter=drafter, stop_at_eos=False)


@pytest.mark.parametrize("rollback", ["checkpoint", "replay"])
def test_a_dflash_drafter_of_its_own_speculates_losslessly(tmp_path, rollback):
    """An MoE install repacked with a DFlash2 drafter (fed by the routed trunk's aux layers)."""
    model = make_moe_checkpoint(tmp_path / "hf", "qwen3_next", 9)
    drafter = make_drafter(tmp_path / "drafter", model.config.hidden_size, model.config.vocab_size, [0, 2], seed=9)
    rt = turbo.open(repack(tmp_path / "hf", tmp_path / "install", drafter=drafter, quiet=True), backend="cpu")
    for prompt in PROMPTS:
        ref = rt.generate(prompt, max_new_tokens=20, policy="off", stop_at_eos=False).tokens
        for block in (1, 3, 8):
            res = rt.generate(prompt, max_new_tokens=20, policy="fixed", block=block, drafter="dflash",
                              rollback=rollback, stop_at_eos=False)
            assert res.tokens == ref and res.stats.drafter == "dflash" and res.stats.rounds > 0
