"""The MoE trunk (qwen3_5_moe, qwen3_next) against transformers' Qwen3_5MoeForCausalLM and
Qwen3NextForCausalLM (the oracle), repacked from both expert layouts, on both CPU steps; verify
rows against decode steps."""

import json

import pytest
import torch
from safetensors import safe_open

from turbo.load.loader import load_trunk
from turbo.repack import repack
from turbo.sequence.options import OpenOptions
from turbo.store.install import open_install
from turbo.testing import (assert_64_greedy_tokens_match, assert_prefill_and_64_steps_match, make_moe_checkpoint,
    make_moe_install)

ALTERNATING = ["full_attention", "linear_attention", "linear_attention", "full_attention"]
SHAPES = {
    # every layer routed, 8 experts top-2 (renormalised: Qwen3.5-MoE always is), a shared expert, untied
    "q35-e8k2-shared-untied": ("qwen3_5_moe", False, dict()),
    # top-k = every expert, no shared expert, tied, explicit layer types, from the fused stacks
    "q35-e4k4-unshared-tied-fused": ("qwen3_5_moe", True, dict(
        num_experts=4, num_experts_per_tok=4, shared_expert_intermediate_size=0, tie_word_embeddings=True,
        layer_types=ALTERNATING)),
    # norm_topk_prob false, layer 1 dense (mlp_only_layers), 16 experts top-3, from the fused stacks
    "next-e16k3-unnormed-dense1-fused": ("qwen3_next", True, dict(
        num_experts=16, num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[1])),
    # decoder_sparse_step 2 (layers 1, 3 routed), top-1, tied, no shared expert, full_attention_interval 2
    "next-e6k1-sparse2-tied": ("qwen3_next", False, dict(
        num_experts=6, num_experts_per_tok=1, decoder_sparse_step=2, tie_word_embeddings=True,
        shared_expert_intermediate_size=0, full_attention_interval=2)),
}

pytestmark = pytest.mark.usefixtures("step_path")  # every test on both CPU steps


def Trunk(inst):  # noqa: N802 (the step the environment names: step_path)
    return load_trunk(inst, OpenOptions.from_env(), "cpu")


@pytest.fixture(scope="module", params=list(SHAPES))
def pair(request, tmp_path_factory):
    model_type, fused, over = SHAPES[request.param]
    return make_moe_install(tmp_path_factory.mktemp(request.param), 3, model_type, fused, **over)


def test_the_config_routes_the_layers_transformers_routes(pair, step_path):
    model, path = pair
    trunk = Trunk(open_install(path))
    assert trunk.step_name == step_path
    routed = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    assert list(trunk.arch.moe_layers) == routed and routed
    assert [layer.moe is not None for layer in trunk.layers] == [i in routed for i in range(len(trunk.layers))]


def test_logits_and_64_greedy_tokens_match_transformers(pair):
    """Prefill and 64 decode steps within 1e-4, and 64 greedy tokens identical."""
    model, path = pair
    assert_prefill_and_64_steps_match(model, Trunk(open_install(path)))
    assert_64_greedy_tokens_match(model, path)


@pytest.mark.parametrize("rows", [2, 5, 9])
def test_verify_rows_equal_decode_steps_bit_for_bit(pair, rows):
    """Each row is routed on its own and adds its experts in a fixed order: a row of a batched
    verify is the one-token step it stands for, whatever the other rows picked."""
    model, path = pair
    trunk = Trunk(open_install(path))
    prompt = list(range(3, 20))
    tokens = torch.randint(0, model.config.vocab_size, (rows,), generator=torch.Generator().manual_seed(rows)).tolist()
    batch, single = trunk.new_state(), trunk.new_state()
    trunk.prefill(batch, prompt)
    trunk.prefill(single, prompt)
    verify = trunk.step(batch, tokens)
    steps = [trunk.step(single, [t]) for t in tokens]
    assert torch.equal(verify.logits, torch.cat([s.logits for s in steps]))
    assert torch.equal(verify.hidden, torch.cat([s.hidden for s in steps]))


def _tensors(install):
    with safe_open(str(install / "model.safetensors"), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


@pytest.mark.parametrize("model_type", ["qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize("quant", ["none", "int4"])
def test_both_expert_layouts_repack_to_one_install(tmp_path, model_type, quant):
    """A fused stack is cut into the per-expert tensors a published checkpoint carries, byte
    for byte; --quant covers the experts either way."""
    over = dict(moe_intermediate_size=64)  # (so that int4's group of 64 divides down_proj's rows too)
    make_moe_checkpoint(tmp_path / "loose", model_type, 4, **over)
    make_moe_checkpoint(tmp_path / "fused", model_type, 4, fused=True, **over)
    a = _tensors(repack(tmp_path / "loose", tmp_path / "a", quiet=True, quant=quant))
    b = _tensors(repack(tmp_path / "fused", tmp_path / "b", quiet=True, quant=quant))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    expert = "trunk.layers.0.mlp.experts.7."
    assert {expert + p + ".weight" for p in ("gate_proj", "up_proj", "down_proj")} <= a.keys()
    assert not any("experts.gate_up_proj" in n or "in_proj_qkvz" in n for n in a)
    if quant == "int4":
        assert a[expert + "gate_proj.weight"].dtype == torch.uint32 and expert + "down_proj.weight.scales" in a
        assert a["trunk.layers.0.mlp.gate.weight"].dtype == torch.float32  # the router stays float


def test_the_conditional_generation_layout_repacks_to_the_same_trunk(tmp_path):
    """Qwen3_5MoeForConditionalGeneration: the text model under model.language_model.* and its
    fields in text_config; the same install as the CausalLM layout's."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "causal"
    make_moe_checkpoint(src, "qwen3_5_moe", 5, fused=True)
    cond = tmp_path / "cond"
    cond.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (cond / f).write_bytes((src / f).read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    save_file({n.replace("model.", "model.language_model.", 1): t for n, t in tensors.items()},
              str(cond / "model.safetensors"), metadata={"format": "pt"})
    text = json.loads((src / "config.json").read_text())
    (cond / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
        "tie_word_embeddings": text.pop("tie_word_embeddings"), "text_config": text}))
    a = _tensors(repack(src, tmp_path / "a", quiet=True))
    b = _tensors(repack(cond, tmp_path / "b", quiet=True, text_only=True))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert open_install(tmp_path / "b").arch.moe_layers == (0, 1, 2, 3)
