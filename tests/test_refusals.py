"""Every refusal names the field, tensor or value: drafter config, shapes, policies, blockers."""

import copy
import dataclasses
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import turbo
from turbo.drafters.dflash_config import derive_shape, parse_config
from turbo.errors import TurboError
from turbo.sequence.policy import (DFLASH_SERVING_BLOCK, MOE_SPECULATION_BLOCKER_MARKER,
    VISION_SPECULATION_BLOCKER_MARKER, DraftPolicy, plan, policy_from_env, speculation_blocker)
from turbo.store.arch import arch_from_config, read_config_json
from turbo.store.install import open_install
from turbo.testing import tiny_tokenizer

CPU = (1, 2, 3)


@pytest.fixture(scope="module")
def spec(spec_install):
    return open_install(spec_install[1])


@pytest.fixture(scope="module")
def dcfg(spec):
    return copy.deepcopy(spec.drafter_config)


REQUIRED = ["architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "rms_norm_eps", "vocab_size", "sliding_window", "layer_types",
            "is_causal", "rope_parameters", "dflash_config"]
REQUIRED_DFLASH = ["block_size", "mask_token_id", "target_layer_ids", "conv_kernel_size", "conv_group_size",
                   "selector_rank", "selector_top_k"]


@pytest.mark.parametrize("key", REQUIRED)
def test_missing_config_field_is_refused_by_name(spec, dcfg, key):
    cfg = {k: v for k, v in dcfg.items() if k != key}
    with pytest.raises(TurboError, match=key):
        parse_config(cfg, spec.arch)


@pytest.mark.parametrize("key", REQUIRED_DFLASH)
def test_missing_dflash_config_field_is_refused_by_name(spec, dcfg, key):
    cfg = copy.deepcopy(dcfg)
    del cfg["dflash_config"][key]
    with pytest.raises(TurboError, match=key):
        parse_config(cfg, spec.arch)


BAD = [
    ("dflash_config.conv_kernel_size", 3, "conv_kernel_size' is 3"),
    ("dflash_config.conv_group_size", 24, "conv_group_size' is 24"),
    ("dflash_config.selector_top_k", 1, "selector_top_k' is 1"),
    ("dflash_config.block_size", 1, "block_size' is 1"),
    ("dflash_config.target_layer_ids", [], "target_layer_ids' is empty"),
    ("dflash_config.target_layer_ids", [0, 4], "target_layer_ids' has 4"),
    ("layer_types", ["sliding_attention"] * 4, "layer_types"),
    ("layer_types", ["full_attention"] * 5, "layer_types"),
    ("hidden_size", 128, "hidden_size' is 128"),
    ("architectures", ["Qwen3ForCausalLM"], "architectures"),
    ("rope_parameters", {}, "rope_theta"),
]


@pytest.mark.parametrize("path,value,needle", BAD)
def test_unhonourable_config_values_are_refused(spec, dcfg, path, value, needle):
    cfg = copy.deepcopy(dcfg)
    node = cfg
    *parents, leaf = path.split(".")
    for p in parents:
        node = node[p]
    node[leaf] = value
    with pytest.raises(TurboError, match=needle.replace("[", r"\[")):
        parse_config(cfg, spec.arch)


def drafter_install(tmp_path, spec_path, edit):
    """The spec install with its drafter tensors edited."""
    dst = tmp_path / "inst"
    shutil.copytree(spec_path, dst)
    path = dst / "dflash" / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    edit(t)
    save_file({k: v.contiguous() for k, v in t.items()}, str(path))
    return open_install(dst)


SHAPE_CASES = [
    (lambda t: t.__setitem__("dflash.candidate_selector.successor_codebook", torch.zeros(100, 8)),
     "codebook shape mismatch"),
    (lambda t: t.__setitem__("dflash.candidate_selector.predecessor_codebook", torch.zeros(320, 100)),
     "codebook shape mismatch"),
    (lambda t: [t.pop(k) for k in list(t) if k.startswith("dflash.layers.4.")], "has 4 contiguous layers, expected 5"),
    (lambda t: t.__setitem__("dflash.layers.5.input_layernorm.weight", torch.zeros(64)),
     "has 6 contiguous layers, expected 5"),
    (lambda t: t.__setitem__("dflash.layers.0.self_attn.q_proj.weight", torch.zeros(60, 64)), "do not divide"),
    (lambda t: t.__setitem__("dflash.fc.weight", torch.zeros(64, 100)), "not a whole number of 64-wide aux states"),
    (lambda t: t.__setitem__("dflash.hidden_norm.weight", torch.zeros(64, 1)), r"\[64, 1\], expected a \[64\] vector"),
    (lambda t: t.__setitem__("dflash.layers.2.mlp_conv.base_kernel", torch.zeros(2, 2, 64, 1)), "base_kernel"),
    (lambda t: t.__setitem__("dflash.layers.0.attention_conv.kernel_projection.weight", torch.zeros(12, 64)),
     "kernel_projection.weight has 12 rows against the 16"),
    (lambda t: t.__setitem__("dflash.layers.3.self_attn.o_proj.weight", torch.zeros(64, 32)),
     r"dflash.layers.3.self_attn.o_proj.weight has shape \[64, 32\], expected \[64, 64\]"),
    (lambda t: t.pop("dflash.norm.weight"), "dflash.norm.weight"),
]


@pytest.mark.parametrize("edit,needle", SHAPE_CASES)
def test_shape_derive_refusals(tmp_path, spec_install, edit, needle):
    inst = drafter_install(tmp_path, spec_install[1], edit)
    with pytest.raises(TurboError, match=needle):
        derive_shape(inst.index, 64, 320)


def test_derive_reads_the_published_shapes(spec):
    s = derive_shape(spec.index, 64, 320)
    assert (s.layers, s.head_dim, s.num_heads, s.num_kv_heads, s.inter, s.conv_rows, s.rank, s.aux_count) == (
        5, 16, 4, 2, 96, 16, 8, 2)


# ---- blockers, in the order of docs/DESIGN.md 6 ----------------------------------------------------


def test_blocker_order_vision_first(spec, tmp_path, spec_install):
    dst = tmp_path / "vis"
    shutil.copytree(spec_install[1], dst)
    save_file({"vision.patch_embed.proj.weight": torch.zeros(4, 3)}, str(dst / "vision.safetensors"))
    inst = open_install(dst)
    arch = dataclasses.replace(inst.arch, num_experts=8, layer_types=("linear_attention",) * 4)
    inst = dataclasses.replace(inst, arch=arch)
    assert speculation_blocker(inst, "dflash", CPU).startswith(VISION_SPECULATION_BLOCKER_MARKER)


def test_blocker_moe_then_no_full_layer_then_probe(spec):
    moe = dataclasses.replace(spec, arch=dataclasses.replace(spec.arch, num_experts=64))
    assert speculation_blocker(moe, "dflash", CPU).startswith(MOE_SPECULATION_BLOCKER_MARKER)
    linear = dataclasses.replace(spec, arch=dataclasses.replace(spec.arch, layer_types=("linear_attention",) * 4))
    assert "declares none" in speculation_blocker(linear, "dflash", CPU)
    moved = dataclasses.replace(spec, arch=dataclasses.replace(
        spec.arch, layer_types=("full_attention",) + ("linear_attention",) * 3))
    assert "trunk.layers.0.self_attn.q_proj.weight is missing" in speculation_blocker(moved, "dflash", CPU)


def test_blocker_dtype_names_dtype_and_coverage(spec):
    reason = speculation_blocker(spec, "dflash", (4, 15, 16))
    assert "dtype 3" in reason and "int4 (4)" in reason and "trunk.layers.3.self_attn.q_proj.weight" in reason


def test_blocker_no_drafter_points_to_repack(plain_install):
    reason = speculation_blocker(open_install(plain_install[1]), "dflash", CPU)
    assert "dflash.fc.weight" in reason and "--drafter" in reason
    assert speculation_blocker(open_install(plain_install[1]), "mtp", CPU).startswith("this install carries no MTP")


# ---- policies --------------------------------------------------------------------------------


def test_policies(spec, plain_install):
    assert plan(spec, "auto", None, "auto", CPU).block == DFLASH_SERVING_BLOCK == 2
    assert plan(spec, "off", 4, "auto", CPU).drafter is None
    assert plan(spec, "fixed", 5, "auto", CPU).block == 5
    with pytest.raises(TurboError, match="block 9 is outside 1..8"):
        plan(spec, "fixed", 9, "auto", CPU)
    with pytest.raises(TurboError, match="needs a block"):
        plan(spec, "fixed", None, "auto", CPU)
    with pytest.raises(TurboError, match="block 6 is outside 1..4: the drafter's trained block is 4"):
        plan(spec, "fixed", 6, "auto", CPU, trained_block=4)
    bare = open_install(plain_install[1])
    p = plan(bare, "auto", None, "auto", CPU)
    assert p.drafter is None and "no DFlash2 drafter" in p.off_reason
    with pytest.raises(TurboError, match="no DFlash2 drafter"):
        plan(bare, "fixed", 2, "auto", CPU)
    with pytest.raises(TurboError, match="policy 'sometimes'"):
        plan(spec, "sometimes", None, "auto", CPU)


@pytest.mark.parametrize("value,expected", [(None, DraftPolicy("auto")), ("", DraftPolicy("auto")),
                                            ("abc", DraftPolicy("auto")), ("0", DraftPolicy("off")),
                                            ("3", DraftPolicy("fixed", 3)), (" 8 ", DraftPolicy("fixed", 8))])
def test_env_policy(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("TURBO_DFLASH_DRAFT", raising=False)
    else:
        monkeypatch.setenv("TURBO_DFLASH_DRAFT", value)
    assert policy_from_env() == expected


def test_env_policy_drives_the_api(monkeypatch, spec_install):
    # read when the runtime opens: one runtime's default policy does not change under it
    monkeypatch.setenv("TURBO_DFLASH_DRAFT", "3")
    rt = turbo.open(spec_install[1], backend="cpu")
    assert rt.generate([5, 6, 7], max_new_tokens=4).stats.block == 3
    monkeypatch.setenv("TURBO_DFLASH_DRAFT", "0")
    assert rt.generate([5, 6, 7], max_new_tokens=4).stats.block == 3
    assert turbo.open(spec_install[1], backend="cpu").generate([5, 6, 7], max_new_tokens=4).stats.drafter is None


def test_auto_falls_back_and_says_why(plain_install):
    out = turbo.open(plain_install[1], backend="cpu").generate([5, 6, 7], max_new_tokens=4)
    assert out.stats.drafter is None and "no DFlash2 drafter" in out.stats.speculation_off_reason


# ---- every config value checked: type, range, consistency ----------------------------------------

NAN = float("nan")


def _edited(cfg: dict, path: str, value) -> dict:
    cfg = copy.deepcopy(cfg)
    node = cfg
    *parents, leaf = path.split(".")
    for p in parents:
        node = node[p]
    node[leaf] = value
    return cfg


TRUNK_BAD = [
    ("rms_norm_eps", 0, "rms_norm_eps' is 0.0, expected a number in \\(0, 1\\)"),
    ("rms_norm_eps", -1, "rms_norm_eps' is -1.0"), ("rms_norm_eps", NAN, "rms_norm_eps' is nan"),
    ("rms_norm_eps", 1e12, "rms_norm_eps' is 1000000000000.0"),
    ("rope_parameters.rope_theta", 0, "rope_theta' is 0.0, expected a positive number"),
    ("rope_parameters.rope_theta", NAN, "rope_theta' is nan"),
    ("rope_parameters.partial_rotary_factor", 0.01, "partial_rotary_factor = 0, expected a positive even number"),
    ("rope_parameters.partial_rotary_factor", 0.3125, "partial_rotary_factor = 5, expected a positive even number"),
    ("eos_token_id", -1, "eos_token_id' has -1, expected token ids in 0..319"),
    ("eos_token_id", 320, "eos_token_id' has 320"), ("eos_token_id", "2", "eos_token_id' has '2'"),
    ("eos_token_id", [1, 2.0], "eos_token_id' has 2.0"),
    ("num_experts", "8", "num_experts' is '8', expected an integer >= 0"),
    ("num_experts", -1, "num_experts' is -1"),
    ("max_position_embeddings", 2**31, "max_position_embeddings' is 2147483648, expected at most 16777216"),
    ("head_dim", 10**400, "head_dim' is 1000000000000.*0000, expected at most 2147483647"),
    ("num_attention_heads", 3, "num_attention_heads 3 is not a multiple of num_key_value_heads 2"),
    ("linear_num_key_heads", 3, "linear_num_value_heads 4 is not a multiple of linear_num_key_heads 3"),
    ("hidden_size", 64.0, "hidden_size' is 64.0, expected int"),
    ("tie_word_embeddings", 0, "tie_word_embeddings"),
    ("model_type", ["qwen3_5"], "model_type \\['qwen3_5'\\] is not supported"),
]


@pytest.mark.parametrize("path,value,needle", TRUNK_BAD)
def test_trunk_config_values_are_refused_by_name(spec, path, value, needle):
    with pytest.raises(TurboError, match=needle) as e:
        arch_from_config(_edited(spec.config, path, value))
    assert "\n" not in str(e.value)


def test_trunk_config_valid_values_pass(spec):
    a = arch_from_config(_edited(_edited(spec.config, "eos_token_id", [0, 319]), "num_experts", None))
    assert a.eos_token_ids == (0, 319) and a.num_experts == 0


DRAFTER_BAD = [
    ("sliding_window", 2**31, "sliding_window' is 2147483648, expected at most 4096"),
    ("dflash_config.target_layer_ids", [0, 0], "target_layer_ids' is \\[0, 0\\], expected distinct layer ids"),
    ("num_key_value_heads", 3, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ("num_hidden_layers", 4, "layer_types"),
    ("head_dim", 15, "head_dim' is 15, expected an even number"),
    ("rms_norm_eps", NAN, "rms_norm_eps' is nan"),
    ("rope_parameters.rope_theta", -1, "rope_theta' is -1.0"),
    ("dflash_config.selector_top_k", 321, "selector_top_k' is 321, expected 2..320"),
    ("dflash_config", [1], "dflash_config' is \\[1\\], expected dict"),
]


@pytest.mark.parametrize("path,value,needle", DRAFTER_BAD)
def test_drafter_config_values_are_refused_by_name(spec, dcfg, path, value, needle):
    with pytest.raises(TurboError, match=needle):
        parse_config(_edited(dcfg, path, value), spec.arch)


def test_drafter_layer_count_is_the_ports(spec, dcfg):
    cfg = _edited(_edited(dcfg, "num_hidden_layers", 4), "layer_types", ["sliding_attention"] * 4)
    with pytest.raises(TurboError, match="num_hidden_layers' is 4, expected 5"):
        parse_config(cfg, spec.arch)


@pytest.mark.parametrize("text,needle", [("[" * 100000 + "]" * 100000, "nested too deeply"),
                                         ('{"a": ' + "9" * 5000 + "}", "not readable JSON")])
def test_deep_or_huge_json_is_one_line(tmp_path, text, needle):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(TurboError, match=needle) as e:
        read_config_json(path)
    assert "\n" not in str(e.value) and len(str(e.value)) < 300


def _install_copy(tmp_path, spec_install, edit_config=None):
    dst = tmp_path / "inst"
    shutil.copytree(spec_install[1], dst)
    if edit_config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_tokenizer_past_the_vocab_is_refused_and_a_smaller_one_is_fine(tmp_path, spec_install):
    dst = _install_copy(tmp_path, spec_install)
    tiny_tokenizer(300).save(str(dst / "tokenizer.json"))  # smaller: the model's vocab padded, as Qwen3.5's is
    assert turbo.open(dst, backend="cpu").generate([5, 6, 7], max_new_tokens=2).tokens
    tok = tiny_tokenizer(318)
    tok.add_tokens(["<|a|>", "<|b|>", "<|c|>"])  # added tokens: the last one past the model's 320 rows
    tok.save(str(dst / "tokenizer.json"))
    with pytest.raises(TurboError, match="the tokenizer's ids reach 320 .a vocabulary of 321., expected ids below "
                                         "the model's vocab_size 320"):
        turbo.open(dst, backend="cpu")


def test_undeclared_trunk_layers_are_refused(tmp_path, spec_install):
    def drop_last(cfg):
        cfg["num_hidden_layers"] = 3
        cfg["layer_types"] = cfg["layer_types"][:3]
    with pytest.raises(TurboError, match="num_hidden_layers' is 3, but the install carries trunk.layers.3"):
        turbo.open(_install_copy(tmp_path, spec_install, drop_last), backend="cpu")


def test_a_broken_drafter_config_is_refused_at_open(tmp_path, spec_install):
    dst = _install_copy(tmp_path, spec_install)
    cfg = json.loads((dst / "dflash" / "config.json").read_text())
    cfg["dflash_config"] = [1]
    (dst / "dflash" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TurboError, match="dflash_config' is \\[1\\], expected dict"):
        turbo.open(dst, backend="cpu")
