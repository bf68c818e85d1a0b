"""The published DFlash drafter (`DFlashDraftModel`, as z-lab's Qwen3.5 drafters ship it):
repacked in its published layout, lossless at every block up to its trained 16 on both CPU
steps, its native pass against the torch one, and its config refused field by field."""

import json
import shutil

import pytest
import torch

import turbo
from turbo.backends import native_lib, ops
from turbo.errors import TurboError
from turbo.load.loader import load_dflash, load_trunk
from turbo.sequence.options import OpenOptions
from turbo.store.install import open_install
from turbo.testing import assert_lossless, hf_config, make_install, make_published_dflash

PROMPTS = [list(range(5, 40)), [7, 100, 3, 250, 17, 17, 17, 42]]


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A random trunk (4 layers) and a random published-layout drafter, repacked together."""
    tmp = tmp_path_factory.mktemp("published")
    cfg = hf_config()
    drafter = make_published_dflash(tmp / "drafter", cfg.hidden_size, cfg.vocab_size, [0, 2],
                                    cfg.num_hidden_layers, seed=3)
    return make_install(tmp, 2, drafter=drafter)[1]


@pytest.fixture(scope="module")
def rt(published, step_path):
    return turbo.open(published, backend="cpu")


@pytest.fixture(scope="module")
def plain(rt):
    return {i: rt.generate(p, max_new_tokens=37, policy="off").tokens for i, p in enumerate(PROMPTS)}


def test_repack_files_the_published_layout_under_dflash(published):
    inst = open_install(published)
    assert inst.has_dflash and "dflash.layers.4.self_attn.q_proj.weight" in inst.index
    assert not inst.index.has_prefix("dflash.candidate_selector.")
    assert inst.drafter_config["architectures"] == ["DFlashDraftModel"]


TORCH_BLOCKS = (1, 2, 5, 8, 16)  # (the torch step's verify is slow here: a sample of the blocks)


def test_auto_drafts_with_it_and_names_its_architecture(rt, step_path):
    res = rt.generate(PROMPTS[0], max_new_tokens=8, policy="fixed", block=4)
    assert res.stats.drafter == "dflash" and res.stats.drafted > 0
    d = rt.drafter("dflash", None)
    assert d.architecture == "DFlashDraftModel" and d.block_size == 16 and d.step_name == step_path


@pytest.mark.parametrize("rollback", ["checkpoint", "replay"])
@pytest.mark.parametrize("block", range(1, 17))
def test_lossless_every_block(rt, plain, step_path, block, rollback):
    if step_path == "torch" and block not in TORCH_BLOCKS:
        pytest.skip("the torch step at blocks 1, 2, 5, 8, 16 (its rows are the native step's at every block)")
    for i, prompt in enumerate(PROMPTS):
        assert_lossless(rt, prompt, plain[i], block, max_new_tokens=37, rollback=rollback)


def test_the_trained_block_bounds_the_block(rt):
    with pytest.raises(TurboError, match="block 17 is outside 1..16"):
        rt.generate(PROMPTS[0], max_new_tokens=4, policy="fixed", block=17)


@pytest.mark.parametrize("block,rollback", [(16, "checkpoint"), (5, "replay")])
def test_lossless_past_the_window(rt, block, rollback):
    """window 4 -> a ring of 4 + 128 slots; 30 + 150 positions wrap it."""
    prompt = list(range(3, 33))
    base = rt.generate(prompt, max_new_tokens=150, policy="off").tokens
    assert assert_lossless(rt, prompt, base, block, max_new_tokens=150, rollback=rollback, window=4).stats.window == 4


def test_adaptive_reaches_the_trained_block(rt, plain):
    out = rt.generate(PROMPTS[0], max_new_tokens=37, policy="adaptive")
    assert out.tokens == plain[0] and out.stats.block == 16


@pytest.mark.parametrize("rollback", ["checkpoint", "replay"])
def test_a_17_row_verify_equals_17_decode_steps(rt, rollback):
    """The widest verify (anchor + 16 proposals) computes what 17 single steps do, bit for bit."""
    trunk, ids = rt.trunk, list(range(9, 26))
    wide, narrow = trunk.new_state(64), trunk.new_state(64)
    trunk.prefill(wide, PROMPTS[1])
    trunk.prefill(narrow, PROMPTS[1])
    out = trunk.step(wide, ids, (0, 2), rollback)
    steps = [trunk.step(narrow, [t], (0, 2), None) for t in ids]
    assert len(ids) == 17
    assert torch.equal(out.logits, torch.cat([s.logits for s in steps]))
    assert torch.equal(out.aux, torch.cat([s.aux for s in steps]))


@pytest.mark.skipif(native_lib.library() is None, reason=f"native library unavailable: {native_lib.why_not()}")
@pytest.mark.parametrize("positions, window", [(40, None), (300, 6)])  # short context; a wrapped ring
def test_native_pass_matches_torch(published, positions, window):
    inst = open_install(published)
    trunk = load_trunk(inst, OpenOptions(), "cpu")
    lm_head = ops.dense(trunk.lm_head)
    fast = load_dflash(inst, trunk.embed, lm_head, window, OpenOptions(draft_products="fp32"))
    ref = load_dflash(inst, trunk.embed, lm_head, window, OpenOptions(native=False))
    assert (fast.step_name, ref.step_name) == ("native", "torch")
    ids = [int(t) for t in torch.randint(2, 320, (positions,), generator=torch.Generator().manual_seed(positions))]
    out = trunk.prefill(trunk.new_state(positions + 8), ids[:-1], fast.aux_layers)
    for d in (fast, ref):
        d.begin(out)
    for block in range(1, 17):
        logits, final = fast.forward_block(ids[-1], positions - 1, block)
        ref_logits, ref_final = ref.forward_block(ids[-1], positions - 1, block)
        for a, b in ((logits, ref_logits), (final, ref_final)):
            assert a.shape == b.shape and (a - b).abs().max() < 1e-4 * b.abs().max()
        assert fast.propose(ids[-1], positions - 1, block) == logits.argmax(-1).tolist()


# ---- refusals -----------------------------------------------------------------------------


def _refused(published, tmp_path, edit, match: str) -> None:
    path = shutil.copytree(published, tmp_path / "edited")
    where = path / "dflash" / "config.json"
    config = json.loads(where.read_text())
    edit(config)
    where.write_text(json.dumps(config))
    inst = open_install(path)
    trunk = load_trunk(inst, OpenOptions(native=False), "cpu")
    with pytest.raises(TurboError, match=match):
        load_dflash(inst, trunk.embed, ops.dense(trunk.lm_head), opts=OpenOptions(native=False))


REQUIRED = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "rms_norm_eps", "vocab_size", "sliding_window", "rope_parameters", "dflash_config"]
REQUIRED_NESTED = [("dflash_config", "block_size"), ("dflash_config", "mask_token_id"),
                   ("dflash_config", "target_layer_ids"), ("rope_parameters", "rope_theta")]


@pytest.mark.parametrize("field", REQUIRED + [f"{a}.{b}" for a, b in REQUIRED_NESTED])
def test_a_missing_required_field_is_refused_by_name(published, tmp_path, field):
    def edit(config):
        *parents, key = field.split(".")
        for p in parents:
            config = config[p]
        del config[key]
    _refused(published, tmp_path, edit, f"missing required field '{field.split('.')[-1]}'")


DIFFERING = [  # (field path, value, what the refusal names)
    ("architectures", ["DFlash3DraftModel"], "field 'architectures' is \\['DFlash3DraftModel'\\], expected one of "
                                             "\\['DFlash2DraftModel'\\], \\['DFlashDraftModel'\\]"),
    ("hidden_size", 32, "field 'hidden_size' is 32, expected the trunk's 64"),
    ("vocab_size", 300, "field 'vocab_size' is 300, expected the trunk's 320"),
    ("num_hidden_layers", 4, "field 'layer_types' is .*, expected num_hidden_layers \\(4\\) entries"),
    ("num_attention_heads", 8, "field 'num_attention_heads' is 8, the tensors' is 4"),
    ("num_key_value_heads", 1, "field 'num_key_value_heads' is 1, the tensors' is 2"),
    ("num_key_value_heads", 3, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ("head_dim", 8, "field 'head_dim' is 8, the tensors' is 16"),
    ("intermediate_size", 64, "field 'intermediate_size' is 64, the tensors' is 96"),
    ("rms_norm_eps", -1e-6, "field 'rms_norm_eps' is -1e-06, expected a number in \\(0, 1\\)"),
    ("rms_norm_eps", "1e-6", "field 'rms_norm_eps' is '1e-6', expected float"),
    ("sliding_window", 0, "field 'sliding_window' is 0, expected a positive integer"),
    ("num_target_layers", 32, "field 'num_target_layers' is 32, expected the trunk's 4"),
    ("is_causal", True, "field 'is_causal' is True, expected false"),
    ("layer_types", ["full_attention"] * 4, "field 'layer_types' is \\['full_attention'"),
    ("layer_types", ["linear_attention"] * 5, "field 'layer_types' is \\['linear_attention'"),
    ("rope_parameters.rope_theta", 0, "field 'rope_theta' is 0.0, expected a positive number"),
    ("rope_parameters.rope_type", "yarn", "field 'rope_type' is 'yarn', expected 'default'"),
    ("dflash_config.block_size", 1, "field 'block_size' is 1, expected at least 2"),
    ("dflash_config.mask_token_id", 320, "field 'mask_token_id' is 320, expected an id below vocab 320"),
    ("dflash_config.target_layer_ids", [0, 4], "field 'target_layer_ids' has 4, expected ids in 0..3"),
    ("dflash_config.target_layer_ids", [0, 1, 2], "fuses 2 aux states, but field 'target_layer_ids' lists 3"),
    ("dflash_config.target_layer_ids", [], "field 'target_layer_ids' is empty"),
    ("output_multiplier", 2.0, "field 'output_multiplier' is 2.0, expected 1.0"),
    ("dflash_config.final_logit_softcapping", 30.0, "field 'final_logit_softcapping' is 30.0, expected none"),
]


@pytest.mark.parametrize("field, value, match", DIFFERING, ids=[f"{f}={v!r}" for f, v, _ in DIFFERING])
def test_a_differing_field_is_refused_by_name(published, tmp_path, field, value, match):
    def edit(config):
        *parents, key = field.split(".")
        for p in parents:
            config = config[p]
        config[key] = value
    _refused(published, tmp_path, edit, match)


def test_a_layer_count_the_tensors_do_not_have_is_refused(published, tmp_path):
    def edit(config):
        config["num_hidden_layers"] = 6
        del config["layer_types"]
    _refused(published, tmp_path, edit, "the DFlash drafter has 5 contiguous layers, expected num_hidden_layers 6")


def test_dflash2_tensors_under_the_published_name_are_refused(spec_install, tmp_path):
    """A DFlash2 drafter whose config claims the published architecture: its conv is named."""
    path = shutil.copytree(spec_install[1], tmp_path / "claims")
    where = path / "dflash" / "config.json"
    config = json.loads(where.read_text())
    config["architectures"] = ["DFlashDraftModel"]
    where.write_text(json.dumps(config))
    inst = open_install(path)
    trunk = load_trunk(inst, OpenOptions(native=False), "cpu")
    with pytest.raises(TurboError, match="a DFlash2 tensor, but dflash/config.json names DFlashDraftModel"):
        load_dflash(inst, trunk.embed, ops.dense(trunk.lm_head), opts=OpenOptions(native=False))


def test_repack_refuses_an_unknown_architecture(tmp_path):
    cfg = hf_config()
    drafter = make_published_dflash(tmp_path / "d", cfg.hidden_size, cfg.vocab_size, [0, 2], 4,
                                    architectures=["EagleDraftModel"])
    with pytest.raises(TurboError, match="architectures is \\['EagleDraftModel'\\], expected one of"):
        make_install(tmp_path, 4, drafter=drafter)
