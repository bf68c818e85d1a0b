"""Every config field that changes the math is implemented (RoPE scaling, matched against
transformers) or refused by name; every field of transformers' configs is classified."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import turbo
from turbo.errors import TurboError
from turbo.load.install_check import check_tensor_names
from turbo.load.loader import load_trunk
from turbo.model.trunk import DynamicNtk
from turbo.sequence.options import OpenOptions
from turbo.store.arch import IRRELEVANT, READ, REFUSED_UNLESS_DEFAULT, arch_from_config, read_config_json
from turbo.store.install import open_install
from turbo.testing import assert_64_greedy_tokens_match, assert_prefill_and_64_steps_match, make_install

WINDOW = 32  # original_max_position_embeddings: the parity prompts (40 and 24 + 64 tokens) run past it
SCALINGS = {
    "linear-x4": {"rope_type": "linear", "factor": 4.0},
    "yarn-x4": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": WINDOW},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": WINDOW,
                    "beta_fast": 16.0, "mscale": 1.0, "mscale_all_dim": 0.5},
}


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> dict:
    _, path = make_install(tmp_path_factory.mktemp("plain"), 3)
    return read_config_json(path / "config.json")


@pytest.fixture(scope="module", params=list(SCALINGS))
def scaled(request, tmp_path_factory):
    rope = {"rope_theta": 10000.0, "partial_rotary_factor": 0.5} | SCALINGS[request.param]
    return make_install(tmp_path_factory.mktemp(request.param), 3, rope_parameters=rope, max_position_embeddings=256)


@pytest.mark.usefixtures("step_path")
def test_scaled_rope_prefill_and_decode_match_transformers(scaled):
    model, path = scaled
    assert open_install(path).arch.rope_scaling is not None
    assert_prefill_and_64_steps_match(model, load_trunk(open_install(path), OpenOptions.from_env(dtype="float32"), "cpu"))


def test_scaled_rope_64_greedy_tokens_equal_transformers(scaled):
    model, path = scaled
    assert_64_greedy_tokens_match(model, path)


@pytest.fixture(scope="module")
def dynamic(tmp_path_factory):
    """Dynamic NTK past a 32-position max_position_embeddings (factor 4: a 128-position context)."""
    rope = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    return make_install(tmp_path_factory.mktemp("dynamic"), 3, rope_parameters=rope, max_position_embeddings=WINDOW)


def test_dynamic_rope_prefill_past_the_window_matches_transformers(dynamic):
    """transformers' first forward rotates a prompt of n > max_position_embeddings rows with the
    frequencies for length n; its decode steps each for their own length (the greedy test)."""
    model, path = dynamic
    trunk = load_trunk(open_install(path), OpenOptions.from_env(dtype="float32"), "cpu")
    assert trunk.step_name == "torch" and isinstance(trunk.inv_freq, DynamicNtk)
    assert open_install(path).arch.max_positions == 4 * WINDOW
    for n in (WINDOW - 8, 40, 4 * WINDOW):
        ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
        with torch.no_grad():
            ref = model(ids).logits[0].float()
        ours = trunk.prefill(trunk.new_state(), ids[0].tolist(), want_logits=True).logits
        assert (ours - ref).abs().max().item() < 1e-4, n


def test_dynamic_rope_64_greedy_tokens_equal_transformers_and_speculation(dynamic):
    model, path = dynamic
    assert_64_greedy_tokens_match(model, path)  # 24 + 64 positions: 56 of them past the window
    rt = turbo.open(path, backend="cpu")
    plain = rt.generate([5, 6, 7] * 12, max_new_tokens=64, policy="off", stop_at_eos=False).tokens
    drafted = rt.generate([5, 6, 7] * 12, max_new_tokens=64, policy="fixed", block=4, drafter="ngram",
                          stop_at_eos=False)
    assert drafted.tokens == plain and drafted.stats.drafted > 0  # a verify row is its decode step


REFUSED = [
    ({"hidden_act": "gelu"}, "field 'hidden_act' is 'gelu', turbo implements only silu"),
    ({"hidden_act": "relu"}, "field 'hidden_act' is 'relu', turbo implements only silu"),
    ({"attention_bias": True}, "field 'attention_bias' is True, turbo implements only false"),
    ({"num_experts": 8}, "field 'num_experts' is 8 on the dense model_type qwen3_5_text, expected 0"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
     "field 'rope_type' is 'longrope', expected one of default / linear / yarn"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     "missing required field 'original_max_position_embeddings'"),
    ({"rope_scaling": {"type": "mystery", "factor": 2.0}}, "field 'rope_type' is 'mystery'"),
    ({"rope_scaling": "linear"}, "field 'rope_scaling' is 'linear', expected an object"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}},
     "field 'rope_scaling' is given beside 'rope_parameters': transformers then reads rope_scaling alone"),
    ({"attention_bias": None}, "field 'attention_bias' is None, turbo implements only false"),
]


@pytest.mark.parametrize("over,line", REFUSED, ids=[json.dumps(o)[:40] for o, _ in REFUSED])
def test_unimplemented_fields_are_refused_by_name(tiny_config, over, line):
    with pytest.raises(TurboError, match=line.replace("(", r"\(").replace(")", r"\)")) as e:
        arch_from_config(tiny_config | over)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("value", ["qwen3_5_text", ["a"], 3])
def test_a_text_config_that_is_not_an_object_is_refused(tiny_config, value):
    with pytest.raises(TurboError, match="field 'text_config' is .*, expected an object"):
        arch_from_config(tiny_config | {"text_config": value})


def _edited_install(src, tmp_path, tensors=None, config=None):
    dst = tmp_path / "inst"
    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps(cfg | config))
    if tensors is not None:
        shard = next(p for p in sorted(dst.glob("*.safetensors")) if "trunk.norm.weight" in load_file(p))
        t = load_file(shard)
        save_file(t | tensors(t), shard)
    return dst


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return make_install(tmp_path_factory.mktemp("plain2"), 3)[1]


def test_a_layer_past_num_hidden_layers_is_refused_naming_it(plain, tmp_path):
    path = _edited_install(plain, tmp_path, lambda t: {"trunk.layers.12.input_layernorm.weight":
                                                           t["trunk.norm.weight"].clone()})
    with pytest.raises(TurboError, match=r"^trunk.layers.12.input_layernorm.weight: a tensor of trunk layer 12, "
                                         r"but .* declares num_hidden_layers 4"):
        turbo_open(path)


def test_a_bias_tensor_is_refused_naming_it(plain, tmp_path):
    path = _edited_install(plain, tmp_path, lambda t: {"trunk.layers.3.self_attn.q_proj.bias":
                                                           t["trunk.norm.weight"].clone()})
    with pytest.raises(TurboError, match=r"^trunk.layers.3.self_attn.q_proj.bias: a bias tensor"):
        turbo_open(path)


def test_a_directory_named_like_the_index_is_refused(plain, tmp_path):
    path = _edited_install(plain, tmp_path)
    (path / "model.safetensors.index.json").mkdir()
    with pytest.raises(TurboError, match="model.safetensors.index.json: not a file"):
        turbo_open(path)


def test_mtp_layers_other_than_declared_are_refused(tiny_config):
    names = ["mtp.fc.weight", "mtp.layers.0.input_layernorm.weight"]
    with pytest.raises(TurboError, match=r"field 'mtp_num_hidden_layers' is 3, but the install carries 1 MTP layer"):
        check_tensor_names(names, arch_from_config(tiny_config), {"mtp_num_hidden_layers": 3}, "config.json")
    check_tensor_names(names, arch_from_config(tiny_config), {"mtp_num_hidden_layers": 1}, "config.json")


def turbo_open(path):
    return turbo.open(path, backend="cpu")


def test_every_transformers_config_field_is_classified():
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig  # optional test dependency

    lists = (set(READ), set(REFUSED_UNLESS_DEFAULT), set(IRRELEVANT))
    assert sum(map(len, lists)) == len(set().union(*lists)), "a field is in two lists"
    for cls in (Qwen3_5TextConfig, Qwen3_5MoeTextConfig, Qwen3NextConfig):
        unclassified = sorted(set(cls().to_dict()) - set().union(*lists))
        assert not unclassified, f"{cls.__name__}: classify {unclassified} in turbo/store/arch.py"


@pytest.mark.parametrize("field,value", [("hidden_act", "gelu_pytorch_tanh"), ("attention_bias", True),
                                         ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0})])
def test_each_refused_field_is_refused_when_not_at_its_default(tiny_config, field, value):
    assert field in REFUSED_UNLESS_DEFAULT
    with pytest.raises(TurboError, match=f"field '{field}'|field 'rope_type'"):
        arch_from_config(tiny_config | {field: value})
