"""Training is tied to inference: the trainable DFlash2 module and MTP head (turbo/train), with random
weights, exported as `python -m turbo.train` writes them and filed by repack, give the inference
drafters' logits (turbo/drafters, the torch step, fp32) on the same context. Losslessness holds for
any drafter, so only a test like this one sees the two forwards drift apart."""

from __future__ import annotations

import pytest
import torch

from turbo.backends import ops
from turbo.load.loader import load_dflash, load_mtp, load_trunk
from turbo.repack import repack
from turbo.sequence.options import OpenOptions
from turbo.store.install import open_install
from turbo.testing import make_install
from turbo.train import dflash2, mtp

# max |logit difference| (and |final state difference|) between the trained module and the drafter,
# both fp32, logits up to ~4 here (measured: DFlash2 <2e-5, MTP <3e-6)
ATOL = 1e-4
TOKENS = 80
# RoPE sees relative distance only: at a base of 1e4 a base off by one moves no angle past fp32's
# noise, so the trunk here rotates half of each head (the DFlash2 drafter all of it) at a small base
ROPE = {"rope_type": "default", "rope_theta": 64.0, "partial_rotary_factor": 0.5}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A random trunk's install, its torch-step trunk (fp32), its embedding and lm_head as
    python -m turbo.train reads them, and token ids to run on."""
    inst = open_install(make_install(tmp_path_factory.mktemp("parity"), 2, rope_parameters=ROPE)[1])
    trunk = load_trunk(inst, OpenOptions(native=False), "cpu")
    embed = inst.index.load("trunk.embed_tokens.weight", torch.float32)
    lm_head = inst.index.load("trunk.lm_head.weight", torch.float32)
    ids = torch.randint(2, inst.arch.vocab, (TOKENS,), generator=torch.Generator().manual_seed(3)).tolist()
    return inst, trunk, embed, lm_head, ids


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random (norms, the conv's kernels too, so every term counts), and held at
    bf16 values: the export writes bf16, so both sides then run the very same weights."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            scale = 0.2 if p.dim() < 2 or p.dim() == 3 else 0.08
            p.copy_((torch.randn(p.shape, generator=g) * scale).bfloat16().float())


def test_dflash2_module_gives_the_drafters_logits(setup, tmp_path):
    inst, trunk, embed, lm_head, ids = setup
    shape = dflash2.draft_shape(inst.arch, mask_token=1, block=4, window=12, target_layers=[1, 2])
    model = dflash2.DFlash2(shape, embed, lm_head)
    randomize_(model, 0)
    (tmp_path / "d").mkdir()
    dflash2.export(model, tmp_path / "d")
    filed = open_install(repack(inst.path, tmp_path / "install", drafter=tmp_path / "d", quiet=True))
    drafter = load_dflash(filed, trunk.embed, ops.dense(trunk.lm_head), opts=OpenOptions(native=False))
    assert drafter.step_name == "torch" and drafter.dtype == torch.float32

    aux = trunk.prefill(trunk.new_state(len(ids)), ids, shape.target_layers).aux
    anchors = [0, 3, 11, 20, 50, TOKENS - 2]  # no context; short; window-limited (12 positions) from 13 on
    with torch.no_grad():
        logits, final = model(torch.tensor([ids]), aux[None], torch.tensor([anchors]))
    for i, a in enumerate(anchors):
        drafter.reset()
        drafter.add_context(aux[:a])
        ref_logits, ref_final = drafter.forward_block(ids[a], a, shape.block)
        assert (logits[0, i] - ref_logits).abs().max().item() < ATOL, f"anchor {a}"
        assert (final[0, i] - ref_final).abs().max().item() < ATOL, f"anchor {a}"


def test_mtp_head_gives_the_drafters_logits(setup, tmp_path):
    inst, trunk, embed, lm_head, ids = setup
    head = mtp.MtpHead(inst.arch, embed, lm_head)
    randomize_(head, 1)
    (tmp_path / "m").mkdir()
    mtp.export(head, tmp_path / "m")
    filed = open_install(repack(inst.path, tmp_path / "install", mtp_head=tmp_path / "m", quiet=True))
    drafter = load_mtp(filed, trunk)
    assert drafter.stepper.name == "torch"

    out = trunk.prefill(trunk.new_state(len(ids)), ids)
    hidden = ops.rms_norm(out.hidden, trunk.final_norm, inst.arch.rms_eps)  # as turbo.train.data stores it
    fed = torch.randint(2, inst.arch.vocab, (len(ids),), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():  # step 1: row p -> token p+2; step 2: row r, fed fed[r+1], at r+1
        logits1, logits2 = head(hidden[None], torch.tensor([ids]), fed[None])
    for a in (1, 6, 17, 50, TOKENS - 2):  # the anchor: step 1 is row a-1, step 2 row a
        st = trunk.new_state(len(ids))
        drafter.begin(trunk.prefill(st, ids[:a]), ids[:a + 1])
        out1, ref1 = drafter.step_row(drafter.last_x, a - 1)
        _, ref2 = drafter.step_row(drafter.fuse(out1, [int(fed[a])]), a)
        assert (logits1[0, a - 1] - ref1[0]).abs().max().item() < ATOL, f"step 1 at anchor {a}"
        assert (logits2[0, a - 1] - ref2[0]).abs().max().item() < ATOL, f"step 2 at anchor {a}"
