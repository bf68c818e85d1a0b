"""Repacking the checkpoints people download (docs/formats.md): FP8 block-wise, AWQ, GPTQ (with and
without act order) and compressed-tensors pack-quantized int4, written here in each format's own
layout from a random Qwen3.5; the install's weights equal the source's dequantization, its greedy
tokens transformers' on the dequantized model, speculation on it is lossless, and malformed
sources are refused in one line with nothing written."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import turbo
from turbo.repack import main as repack_main
from turbo.repack import repack
from turbo.store import quant
from turbo.store.install import open_install
from turbo.testing import assert_64_greedy_tokens_match, make_checkpoint
from turbo.testing.source_formats import set_config, write_fp8, write_int4

WIDE = dict(hidden_size=128, intermediate_size=256, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=32,
            num_hidden_layers=4)


def add_random_mtp(src, cfg) -> None:
    """A random MTP head (mtp.* beside the trunk) and mtp_num_hidden_layers 1."""
    g = torch.Generator().manual_seed(9)
    h, hd, nh, nkv, inter = (cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
                             cfg.intermediate_size)
    p = "mtp.layers.0."
    shapes = {"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,), "mtp.pre_fc_norm_hidden.weight": (h,),
              "mtp.norm.weight": (h,), p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
              p + "self_attn.q_proj.weight": (2 * nh * hd, h), p + "self_attn.k_proj.weight": (nkv * hd, h),
              p + "self_attn.v_proj.weight": (nkv * hd, h), p + "self_attn.o_proj.weight": (h, nh * hd),
              p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
              p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
              p + "mlp.down_proj.weight": (h, inter)}
    path = src / "model.safetensors"
    save_file(load_file(str(path)) | {n: torch.randn(s, generator=g) * 0.08 for n, s in shapes.items()}, str(path),
              metadata={"format": "pt"})
    set_config(src, mtp_num_hidden_layers=1)


def _source(tmp, kind, **kw):
    src = tmp / f"{kind}-src"
    model = make_checkpoint(src, 4, **WIDE)
    if kind == "fp8":
        add_random_mtp(src, model.config)
        deq = write_fp8(src)
    else:
        deq = write_int4(src, kind, **kw)
    with torch.no_grad():  # the reference: transformers' model on the dequantized weights
        params = dict(model.named_parameters())
        for name, w in deq.items():
            if name in params:
                params[name].copy_(w.float())
    return model, src, deq


def assert_lossless_speculation(rt, mtp: bool) -> None:
    prompt = "def f(x):\n    return x"
    plain = rt.generate(prompt, max_new_tokens=20, policy="off", stop_at_eos=False).tokens
    drafters = ["ngram"] + (["mtp"] if mtp else [])
    for drafter in drafters:
        for block in range(1, 9):
            for rollback in ("checkpoint", "replay"):
                res = rt.generate(prompt, max_new_tokens=20, policy="fixed", block=block, rollback=rollback,
                                  drafter=drafter, stop_at_eos=False)
                assert res.tokens == plain, (drafter, block, rollback)


INT4 = {"awq-g128": ("awq", dict(group=128)), "gptq-g32-sym": ("gptq", dict(group=32, sym=True)),
        "gptq-g128-actorder": ("gptq", dict(group=128, act_order=True)), "ct-g128": ("ct", dict(group=128)),
        "ct-g32-sym": ("ct", dict(group=32, sym=True))}


@pytest.mark.parametrize("case", list(INT4))
def test_int4_sources_convert_exactly(case, tmp_path, capsys):
    kind, kw = INT4[case]
    model, src, deq = _source(tmp_path, kind, **kw)
    capsys.readouterr()  # (what making the checkpoint printed)
    assert repack_main([str(src), str(tmp_path / "out")]) == 0
    first = capsys.readouterr().err.strip().splitlines()[0]
    assert first.startswith(f"found {'compressed-tensors' if kind == 'ct' else kind} int4 (group {kw['group']}")
    idx = open_install(tmp_path / "out").index
    for name, ref in deq.items():
        got = idx.load("trunk." + name[len("model."):])
        if kw.get("act_order"):  # re-quantized: within half a step of turbo's fp32-scaled groups
            step = (ref.reshape(ref.shape[0], -1, kw["group"]).amax(-1) - ref.reshape(ref.shape[0], -1, kw["group"])
                    .amin(-1)) / 15
            assert ((got - ref).abs().reshape(ref.shape[0], -1, kw["group"]) <= step[..., None] * 0.5 + 1e-6).all()
        else:  # the source library's dequantization ((q - z) * s in fp16), bit for bit
            assert torch.equal(got, ref) and torch.equal(got.half(), ref.half())
    if not kw.get("act_order"):
        assert_64_greedy_tokens_match(model, tmp_path / "out")
    if case == "awq-g128":
        assert_lossless_speculation(turbo.open(tmp_path / "out", backend="cpu"), mtp=False)
        # --quant int4: the levels carried into groups of 64 with bf16 scales (rounding stated in repack_int4)
        repack(src, tmp_path / "int4", quiet=True, quant="int4")
        name = next(iter(deq))
        got = open_install(tmp_path / "int4").index.load("trunk." + name[len("model."):])
        assert (got - deq[name]).abs().max() <= deq[name].abs().max() * 2 ** -7


def test_fp8_source_is_transformers_dequantization_with_its_mtp_head(tmp_path, capsys):
    model, src, deq = _source(tmp_path, "fp8")
    capsys.readouterr()  # (what making the checkpoint printed)
    assert repack_main([str(src), str(tmp_path / "out")]) == 0
    assert capsys.readouterr().err.strip().splitlines()[0].startswith("found FP8 e4m3 in 128x128 blocks; writing fp8")
    inst = open_install(tmp_path / "out")
    for name, ref in deq.items():  # the codes and block scales kept (quant.FP8), read as transformers' bf16
        new = ("trunk." + name[len("model."):]) if name.startswith("model.") else name
        assert inst.index.need(new).dtype == quant.FP8.code and torch.equal(inst.index.load(new, torch.bfloat16), ref)
    assert any(n.startswith("mtp.") for n in deq)
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    assert_64_greedy_tokens_match(model, tmp_path / "out")
    assert_lossless_speculation(turbo.open(tmp_path / "out", backend="cpu"), mtp=True)


def _refused(tmp_path, capsys, src, match: str) -> None:
    capsys.readouterr()
    assert repack_main([str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and match in err[0], err
    assert not (tmp_path / "out").exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())


def test_malformed_sources_are_refused_in_one_line(tmp_path, capsys):
    _, src, _ = _source(tmp_path, "fp8")
    path = src / "model.safetensors"
    state = load_file(str(path))
    name = next(n for n in state if n.endswith("weight_scale_inv"))
    state[name] = torch.ones(state[name].shape[0] + 1, state[name].shape[1])
    save_file(state, str(path))
    _refused(tmp_path, capsys, src, "one scale per 128x128 block")

    _, src, _ = _source(tmp_path, "gptq", group=32)
    path = src / "model.safetensors"
    state = load_file(str(path))
    name = next(n for n in state if n.endswith(".g_idx"))
    state[name] = state[name][:-1].contiguous()
    save_file(state, str(path))
    _refused(tmp_path, capsys, src, "g_idx of shape")

    set_config(src, quantization_config={"quant_method": "hqq", "bits": 4})
    _refused(tmp_path, capsys, src, "quantization method 'hqq' is not one repack reads")
    set_config(src, quantization_config={"quant_method": "awq", "bits": 4, "group_size": 32})
    _refused(tmp_path, capsys, src, "is not a awq checkpoint's tensor")  # GPTQ's g_idx in an AWQ checkpoint
