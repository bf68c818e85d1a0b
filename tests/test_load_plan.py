"""The load plan (turbo/load/load_plan.py) on its own: each matrix's format for the bundled tiny
install, quantized installs (int4, int8, a tied head, MoE experts) and the drafters, decided from
the index's headers alone (every entry pointed at a file that does not exist)."""

import dataclasses
from pathlib import Path

import pytest
import torch
from test_mtp import add_mtp, mtp_tensors

from turbo.errors import TurboError
from turbo.load.load_plan import (COPY, DRAFT, DRAFT_HEAD, NATIVE_OFF, PACKED, PANELS, TENSOR, Host, layer_matrices,
    plan_dflash, plan_mtp, plan_trunk)
from turbo.repack import repack
from turbo.sequence.options import OpenOptions
from turbo.store.install import open_install
from turbo.testing import hf_config, make_checkpoint, make_drafter, make_moe_checkpoint

CPU = torch.device("cpu")
VNNI = Host(None, ("pairs", "int8"))  # a host whose native step reads int4 / int8 packed
PLAIN = Host(None, ())  # one without the int8 dot products
WIDE = dict(hidden_size=128, intermediate_size=256, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=32)


def headers_only(install):
    """The install's index entries, every one pointing at a file that is not there: a plan built
    from them reads no tensor bytes."""
    gone = Path("/nonexistent/weights.safetensors")
    return {n: dataclasses.replace(e, file=gone) for n, e in install.index.entries.items()}


def plan(install, host=VNNI, **opts):
    return plan_trunk(headers_only(install), install.arch, OpenOptions(**opts), CPU, host)


def matrices(p):
    return [m for layer in p.layers for m in layer_matrices(layer)]


def quant_install(tmp, fmt, mtp=False, moe=False, **over):
    src = tmp / "hf"
    if moe:
        make_moe_checkpoint(src, hidden_size=128, intermediate_size=128, head_dim=32, moe_intermediate_size=64,
                            shared_expert_intermediate_size=64)
    else:
        make_checkpoint(src, 0, **WIDE, **over)
    if mtp:
        add_mtp(src, mtp_tensors(hf_config(**WIDE, **over)))
    cfg = hf_config(**WIDE, **over)
    d = None if moe else make_drafter(tmp / "drafter", cfg.hidden_size, cfg.vocab_size,
                                      [0, cfg.num_hidden_layers - 2], intermediate=cfg.intermediate_size)
    return open_install(repack(src, tmp / "install", drafter=d, quiet=True, quant=fmt))


@pytest.fixture(scope="module")
def int4(tmp_path_factory):
    return quant_install(tmp_path_factory.mktemp("q4"), "int4", mtp=True)


def test_tiny_packs_bf16_panel_pairs_and_reads_the_table_out_of_the_head():
    tiny = open_install("tiny")
    p = plan(tiny)
    assert p.why_torch is None and p.storage == p.kv == torch.bfloat16
    assert p.embed.rows_of_head and p.embed.head.form == PANELS and p.embed.head.layout == "panel_pairs"
    assert [s.name for s in p.embed.head.sources] == ["trunk.embed_tokens.weight"]
    assert {(m.form, m.dtype) for m in matrices(p)} == {(PANELS, torch.bfloat16)}
    gdn = p.layers[0]
    assert gdn.gdn and [s.name.rsplit(".", 2)[-2] for s in gdn.mixer["in_proj"].sources] == [
        "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"]
    # the torch step: off by the options, or the library not to be had; its tensors in the compute dtype
    assert plan(tiny, native=False).why_torch == NATIVE_OFF
    off = plan(tiny, Host("no C compiler on PATH (set CC)"), dtype="bfloat16")
    assert off.why_torch == "no C compiler on PATH (set CC)" and off.storage is None
    assert {(m.form, m.dtype) for m in matrices(off)} == {(TENSOR, torch.bfloat16)}
    assert off.embed.head is None and off.embed.table is None  # tied: the table itself is the head


def test_int4_is_read_packed_where_the_host_can(int4):
    p = plan(int4)
    assert p.why_torch is None and p.storage == torch.float32  # the float matrices left: the fp32 table
    assert {(m.form, m.bits) for m in matrices(p)} == {(PACKED, 4)}
    assert (p.embed.head.form, p.embed.head.bits) == (PACKED, 4) and p.embed.table == torch.float32
    # no int8 dot products: dequantized exactly into fp32 panels
    assert {(m.form, m.dtype) for m in matrices(plan(int4, PLAIN))} == {(PANELS, torch.float32)}
    # bf16 activations: int4 is the packed kernel's, which the native step does not run
    kept = plan(int4, dtype="bfloat16")
    assert kept.why_torch == "packed quantized matrices"
    assert all(m.form == TENSOR and m.kernel and all(s.keep for s in m.sources) for m in matrices(kept))
    # dequant: tensors in the compute dtype, nothing kept
    assert not any(s.keep for m in matrices(plan(int4, native=False, quant_cpu="dequant")) for s in m.sources)


def dflash_layers(install) -> int:
    return sum(n.startswith("dflash.layers.") and n.endswith(".input_layernorm.weight") for n in install.index.entries)


def plan_dflash_on(install, host=VNNI, head=torch.float32, dtype=torch.float32, device=CPU, **opts):
    embed = torch.empty(install.arch.vocab, install.arch.hidden, device="meta")  # (the trunk's table: its kind only)
    return plan_dflash(headers_only(install), dflash_layers(install), True, True, dtype, opts=OpenOptions(**opts),
                       device=device, host=host, embed=embed, head=head)


def test_drafters_have_their_matrices_planned(int4):
    mtp = plan_mtp(headers_only(int4), int4.arch, torch.float32, NATIVE_OFF, "auto", Host())
    assert set(mtp.matrices) == {"fc"} and [s.name for s in mtp.layer.mixer["qkv"].sources] == [
        "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.self_attn.k_proj.weight",
        "mtp.layers.0.self_attn.v_proj.weight"]
    assert mtp.storage == torch.float32 and mtp.stored == {"U32"}  # (the MTP head is quantized too)
    assert (mtp.why_torch, mtp.layout, mtp.head) == (NATIVE_OFF, None, None)
    layers = dflash_layers(int4)
    dflash = plan_dflash_on(int4, native=False)
    assert {"fc", "layers.0.q", "layers.1.down", "layers.1.attn_proj", "layers.1.mlp_proj"} <= set(dflash.matrices)
    assert len(dflash.matrices) == 1 + layers * 9
    assert dflash.why_torch == NATIVE_OFF and [s.name for s in dflash.head.sources] == [DRAFT_HEAD]
    for m in (*mtp.matrices.values(), *layer_matrices(mtp.layer), *dflash.matrices.values(), dflash.head):
        assert m.form == TENSOR and m.dtype == torch.float32 and not any(s.keep for s in m.sources)
    no_conv = plan_dflash(headers_only(int4), 2, False, False, torch.float32, opts=OpenOptions(native=False),
                          device=CPU, host=Host(), embed=None, head=torch.float32)
    assert "layers.0.attn_proj" not in no_conv.matrices


@pytest.mark.parametrize("products, layout", [("auto", "int8"), ("fp32", "panels"), ("bf16", "pairs"),
                                              ("int8", "int8")])
def test_native_drafters_are_packed_for_their_products(int4, products, layout):
    """On the native step every drafter matrix is read packed for the draft products (DRAFT), so
    the step constructors bind them as given; the DFlash lm_head keeps a bf16 trunk head bf16."""
    mtp = plan_mtp(headers_only(int4), int4.arch, torch.float32, None, products, VNNI)
    assert mtp.why_torch is None and mtp.layout == layout
    for m in (*mtp.matrices.values(), *layer_matrices(mtp.layer)):
        assert (m.form, m.dtype, m.layout) == (DRAFT, mtp.storage, layout)
    for head in (torch.float32, torch.bfloat16):
        dflash = plan_dflash_on(int4, head=head, draft_products=products)
        assert dflash.why_torch is None and dflash.layout == layout
        assert {(m.form, m.dtype, m.layout) for m in dflash.matrices.values()} == {(DRAFT, dflash.storage, layout)}
        assert (dflash.head.form, dflash.head.dtype, dflash.head.layout) == (DRAFT, head, layout)


def test_drafter_products_follow_the_host_and_the_step(int4):
    assert plan_dflash_on(int4, PLAIN).layout == "panels"  # auto: the fastest the host has
    with pytest.raises(TurboError, match="draft_products int8"):
        plan_dflash_on(int4, PLAIN, draft_products="int8")
    torch_step = plan_dflash_on(int4, dtype=torch.bfloat16)
    assert torch_step.why_torch == "activations are bfloat16" and torch_step.head.form == TENSOR
    assert plan_dflash_on(int4, Host("no C compiler on PATH (set CC)")).why_torch == "no C compiler on PATH (set CC)"
    with pytest.raises(TurboError, match=r"draft_products bf16: the drafter's native CPU pass is not in use "
                                         r"\(the drafter runs on cuda\)"):
        plan_dflash_on(int4, Host(), device=torch.device("cuda"), draft_products="bf16")
    with pytest.raises(TurboError, match=r"draft_products int8: the MTP head's native CPU step is not in use "
                                         r"\(TURBO_NATIVE=0\)"):
        plan_mtp(headers_only(int4), int4.arch, torch.float32, NATIVE_OFF, "int8", Host())


def test_int8_tied_head_is_a_copy_in_the_layers_format(tmp_path):
    inst = quant_install(tmp_path, "int8", tie_word_embeddings=True)
    p = plan(inst)
    assert {(m.form, m.bits) for m in matrices(p)} == {(PACKED, 8)}
    assert (p.embed.head.form, p.embed.head.bits, p.embed.rows_of_head) == (COPY, 8, False)
    assert p.embed.read_as is None and p.embed.table == p.storage  # read as stored, kept exact


def test_moe_experts_share_one_format_and_the_gates_stay_float(tmp_path):
    p = plan(quant_install(tmp_path, "int4", moe=True))
    blocks = [layer.moe for layer in p.layers if layer.moe is not None]
    assert blocks and all(layer.gate_up is None for layer in p.layers)
    for moe in blocks:
        assert {(m.form, m.bits) for m in (*moe.gate_up, *moe.down, moe.shared_gate_up, moe.shared_down)} == {
            (PACKED, 4)}
        assert {(m.form, m.dtype) for m in (moe.router, moe.shared_gate)} == {(PANELS, p.storage)}
        assert moe.extra.endswith(f"experts.{len(moe.gate_up)}.gate_proj.weight")
