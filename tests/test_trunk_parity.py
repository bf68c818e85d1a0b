"""The trunk against transformers' Qwen3_5ForCausalLM (the oracle), over several shapes."""

import pytest
import torch

from turbo.load.loader import load_trunk
from turbo.sequence.options import OpenOptions
from turbo.store.install import open_install
from turbo.testing import assert_64_greedy_tokens_match, assert_prefill_and_64_steps_match, make_install


def Trunk(inst, dtype: str = "float32"):  # noqa: N802 (the step the environment names: step_path)
    return load_trunk(inst, OpenOptions.from_env(dtype=dtype), "cpu")

SHAPES = {
    # GQA 2, Hv/Hk 2, untied, layer_types from full_attention_interval (4), rotary 0.25
    "gqa2-hv2-untied": dict(),
    # GQA 4, Hv/Hk 1, tied, explicit layer_types, rotary 0.5
    "gqa4-hv1-tied-explicit": dict(num_key_value_heads=1, linear_num_value_heads=2, tie_word_embeddings=True,
                                   layer_types=["linear_attention", "full_attention", "linear_attention",
                                                "full_attention"],
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                    "partial_rotary_factor": 0.5}),
    # MHA, Hv/Hk 3, full_attention_interval 2, 5 layers, wider heads
    "mha-hv3-interval2": dict(num_key_value_heads=4, linear_num_value_heads=6, num_hidden_layers=5,
                              full_attention_interval=2, linear_key_head_dim=16, linear_value_head_dim=16),
}


pytestmark = pytest.mark.usefixtures("step_path")  # every test on both CPU steps


@pytest.fixture(scope="module", params=list(SHAPES))
def pair(request, tmp_path_factory):
    model, path = make_install(tmp_path_factory.mktemp(request.param), 3, **SHAPES[request.param])
    return model, path


def test_layer_types_follow_config(pair):
    model, path = pair
    arch = open_install(path).arch
    assert list(arch.layer_types) == list(model.config.layer_types)


def test_prefill_and_64_decode_steps_match_transformers(pair):
    model, path = pair
    trunk = Trunk(open_install(path))
    assert_prefill_and_64_steps_match(model, trunk)


def test_64_greedy_tokens_equal_transformers_generate(pair):
    model, path = pair
    assert_64_greedy_tokens_match(model, path)


def test_bf16_weights_stay_close(pair):
    model, path = pair
    rt32, rt16 = Trunk(open_install(path)), Trunk(open_install(path), "bfloat16")
    ids = list(range(3, 30))
    a = rt32.prefill(rt32.new_state(), ids, want_logits=True).logits
    b = rt16.prefill(rt16.new_state(), ids, want_logits=True).logits
    assert (a - b).abs().max().item() < 0.1 * a.abs().max().item()  # bf16 rounds every weight


def test_a_tied_embedding_is_kept_once(tmp_path, step_path):
    """The native step reads the embedding rows out of the packed lm_head's panels; the torch
    step shares one tensor between the two."""
    from turbo.backends import native_pack, ops, packed

    model, path = make_install(tmp_path, 3, tie_word_embeddings=True)
    trunk = Trunk(open_install(path))
    if step_path == "native":
        assert isinstance(trunk.embed, packed.PackedRows) and trunk.embed.packed is trunk.lm_head
    else:
        assert trunk.embed is trunk.lm_head
    table = model.model.embed_tokens.weight.detach()
    ids = [0, 1, 15, 16, 17, table.shape[0] - 1]  # across panels, and the last (padded) one
    assert torch.equal(trunk.embed[torch.tensor(ids)].float(), table[ids])
    row_major = Trunk(open_install(path))
    row_major.embed = ops.dense(trunk.lm_head).clone()  # a table of its own: the step reads the same rows
    out, ref = trunk.step(trunk.new_state(16), ids), row_major.step(row_major.new_state(16), ids)
    assert torch.equal(out.logits, ref.logits)
