"""Malformed MoE checkpoints, installs and configs, refused by name in one line; the MoE blocker
from the command line."""

import json

import pytest
from safetensors.torch import load_file, save_file
from test_cli import one_line_error, run

from turbo.errors import TurboError
from turbo.load.loader import load_trunk
from turbo.repack import repack
from turbo.sequence.options import OpenOptions
from turbo.store.arch import arch_from_config
from turbo.store.install import open_install
from turbo.testing import make_moe_checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe-bad")
    make_moe_checkpoint(tmp / "loose", "qwen3_5_moe", 8)
    make_moe_checkpoint(tmp / "fused", "qwen3_next", 8, fused=True)
    return tmp


def _with_config(src, dst, **fields):
    """A copy of checkpoint `src` at `dst` with config.json's `fields` replaced."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config | fields))
    return dst


def _refused(fn, needle):
    with pytest.raises(TurboError, match=needle) as e:
        fn()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("layout,experts,needle", [
    ("fused", 6, r"model\.layers\.0\.mlp\.experts\.(gate_up|down)_proj has shape \[8, \d+, \d+\]: a stack of \[8\] "
                 r"experts, expected num_experts 6"),
    ("loose", 6, r"model\.layers\.0\.mlp\.experts\.6\.down_proj\.weight: expert 6 of a layer configured for "
                 r"num_experts 6"),
])
def test_an_expert_count_disagreeing_with_the_stack_is_refused_at_repack(checkpoints, tmp_path, layout, experts,
                                                                         needle):
    src = _with_config(checkpoints / layout, tmp_path / "src", num_experts=experts)
    _refused(lambda: repack(src, tmp_path / "out", quiet=True), needle)
    assert not (tmp_path / "out").exists()


def test_an_install_short_of_or_past_its_experts_is_refused_at_open(checkpoints, tmp_path):
    install = repack(checkpoints / "loose", tmp_path / "install", quiet=True)
    config = json.loads((install / "config.json").read_text())
    for experts, needle in ((10, r"trunk\.layers\.0\.mlp\.gate\.weight has shape \[8, 64\], expected \[10, 64\]"),
                            (7, r"trunk\.layers\.0\.mlp\.experts\.7\.gate_proj\.weight: the install has more experts "
                                r"than num_experts 7")):
        (install / "config.json").write_text(json.dumps(config | {"num_experts": experts}))
        _refused(lambda: load_trunk(open_install(install), OpenOptions(), "cpu"), needle)


@pytest.mark.parametrize("name", ["trunk.layers.2.mlp.shared_expert_gate.weight",
                                  "trunk.layers.3.mlp.experts.5.down_proj.weight"])
def test_a_missing_shared_expert_gate_or_expert_is_refused_by_name(checkpoints, tmp_path, name):
    install = repack(checkpoints / "loose", tmp_path / "install", quiet=True)
    path = install / "model.safetensors"
    tensors = load_file(str(path))
    del tensors[name]
    save_file(tensors, str(path))
    _refused(lambda: load_trunk(open_install(install), OpenOptions(), "cpu"),
             "missing tensor " + name.replace(".", r"\."))


def test_a_misshapen_expert_is_refused_by_name(checkpoints, tmp_path):
    install = repack(checkpoints / "loose", tmp_path / "install", quiet=True)
    path = install / "model.safetensors"
    tensors = load_file(str(path))
    tensors["trunk.layers.1.mlp.experts.3.up_proj.weight"] = tensors["trunk.layers.1.mlp.experts.3.up_proj.weight"][1:]
    save_file(tensors, str(path))
    _refused(lambda: load_trunk(open_install(install), OpenOptions(), "cpu"),
             r"trunk\.layers\.1\.mlp\.experts\.3\.up_proj\.weight has shape \[31, 64\], expected \[32, 64\]")


def _config(checkpoints, layout="loose"):
    return json.loads((checkpoints / layout / "config.json").read_text())


@pytest.mark.parametrize("layout,field,value,needle", [
    ("loose", "num_experts_per_tok", 9, "num_experts_per_tok' is 9, expected at most num_experts 8"),
    ("loose", "num_experts_per_tok", 0, "num_experts_per_tok' is 0, expected a positive integer"),
    ("loose", "num_experts", None, "missing required field 'num_experts'"),
    ("loose", "moe_intermediate_size", None, "missing required field 'moe_intermediate_size'"),
    ("loose", "shared_expert_intermediate_size", None, "missing required field 'shared_expert_intermediate_size'"),
    ("loose", "shared_expert_intermediate_size", -1,
     "shared_expert_intermediate_size' is -1, expected an integer >= 0"),
    ("fused", "norm_topk_prob", None, "missing required field 'norm_topk_prob'"),
    ("fused", "norm_topk_prob", 1, "norm_topk_prob' is 1, expected bool"),
    ("fused", "decoder_sparse_step", 0, "decoder_sparse_step' is 0, expected a positive integer"),
    ("fused", "mlp_only_layers", [4], r"mlp_only_layers' is \[4\], expected layer ids in 0..3"),
])
def test_moe_config_values_are_refused_by_name(checkpoints, layout, field, value, needle):
    _refused(lambda: arch_from_config(_config(checkpoints, layout) | {field: value}), needle)


def test_qwen3_next_projections_of_the_wrong_grouping_are_refused(checkpoints, tmp_path):
    src = _with_config(checkpoints / "fused", tmp_path / "src", linear_num_value_heads=2)
    _refused(lambda: repack(src, tmp_path / "out", quiet=True),
             r"linear_attn\.in_proj_ba\.weight has shape \[8, 64\], expected \[4, 64\] \(per key head")


def test_the_moe_blocker_exits_2_under_fixed(checkpoints, tmp_path):
    install = repack(checkpoints / "loose", tmp_path / "install", quiet=True)
    one_line_error(run(tmp_path, f"install.path={install}", "prompt=hi", "+policy=fixed", "block=2"),
                   "speculation blocked [moe]", "routes to 8 experts")
