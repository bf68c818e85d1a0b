"""Checkpoints in the formats people download, written in each format's own layout from a float
checkpoint (AWQ, GPTQ, compressed-tensors int4; Qwen's FP8): tests/test_repack_formats.py checks
repack against them, scripts/bench_formats.py times the installs converted from them. The GGUF
writer: gguf_writer.py."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..repack.int4 import AWQ_REVERSE

AWQ_ORDER = [AWQ_REVERSE.index(j) for j in range(8)]  # AutoAWQ's pack order, 0 2 4 6 1 3 5 7


def words(nib: torch.Tensor) -> torch.Tensor:
    """[..., 8] nibbles (low first) -> int32 words (uint32 bits)."""
    w = (nib.to(torch.int64) << (torch.arange(8) * 4)).sum(-1)
    return torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32)


def quantize_groups(w: torch.Tensor, group: int, sym: bool, perm: torch.Tensor | None = None):
    """AutoAWQ / GPTQ's min-max int4 of w [out, in] over groups of inputs (in `perm` order):
    levels q [out, in], zeros z and fp16 scales s [out, G], and g_idx [in]."""
    out, cols = w.shape
    perm = torch.arange(cols) if perm is None else perm
    g_idx = torch.empty(cols, dtype=torch.int32)
    g_idx[perm] = (torch.arange(cols) // group).int()
    g = w[:, perm].reshape(out, cols // group, group)
    if sym:
        s = (g.abs().amax(-1) / 7.5).clamp(min=1e-5).half()
        z = torch.full_like(s, 8, dtype=torch.int32)
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        s = ((hi - lo).clamp(min=1e-5) / 15).half()
        z = (-torch.round(lo / s.float())).clamp(0, 15).int()
    qg = (torch.round(g / s.float()[..., None]) + z[..., None]).clamp(0, 15).int()
    q = torch.empty(out, cols, dtype=torch.int32)
    q[:, perm] = qg.reshape(out, cols)
    return q, z, s, g_idx


def quantized_modules(state: dict, group: int) -> list[str]:
    """The projections a quantizer converts: in whole groups, outputs in words of 8."""
    return [n for n, t in state.items() if t.dim() == 2 and n.endswith("_proj.weight") and "embed" not in n
            and t.shape[1] % group == 0 and t.shape[0] % 8 == 0]


def write_int4(src: Path, kind: str, group: int, sym: bool = False, act_order: bool = False,
               reference: bool = True) -> dict:
    """Rewrite the checkpoint at `src` as `kind` int4; returns {module: fp32 dequantization}
    (empty without `reference`)."""
    from safetensors.torch import load_file, save_file  # an optional test dependency

    path = src / "model.safetensors"
    state = load_file(str(path))
    deq, g = {}, torch.Generator().manual_seed(3)
    for name in quantized_modules(state, group):
        w, base = state.pop(name), name[:-len(".weight")]
        perm = torch.randperm(w.shape[1], generator=g) if act_order else None
        q, z, s, g_idx = quantize_groups(w, group, sym, perm)
        if reference:
            deq[name] = (q - z[:, g_idx.long()]).float() * s.float()[:, g_idx.long()]
        out, cols = w.shape
        if kind == "awq":  # [in, out / 8], outputs in AWQ's order
            state[base + ".qweight"] = words(q.T.reshape(cols, -1, 8)[..., AWQ_ORDER])
            state[base + ".qzeros"] = words(z.T.reshape(-1, out // 8, 8)[..., AWQ_ORDER])
            state[base + ".scales"] = s.T.contiguous()
        elif kind == "gptq":  # [in / 8, out] along the inputs; v1 zeros stored minus one
            state[base + ".qweight"] = words(q.T.reshape(cols // 8, 8, out).transpose(1, 2))
            state[base + ".qzeros"] = words(((z.T - 1) & 15).reshape(-1, out // 8, 8))
            state[base + ".scales"] = s.T.contiguous()
            state[base + ".g_idx"] = g_idx
        else:  # compressed-tensors: value + 8 along the inputs, zero points + 8 along the outputs
            state[base + ".weight_packed"] = words(q.reshape(out, cols // 8, 8))
            state[base + ".weight_scale"] = s
            state[base + ".weight_shape"] = torch.tensor([out, cols])
            if not sym:
                state[base + ".weight_zero_point"] = words(z.T.reshape(-1, out // 8, 8)).T.contiguous()
    save_file(state, str(path), metadata={"format": "pt"})
    spec = {"awq": {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"},
            "gptq": {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order, "sym": sym},
            "ct": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                   "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                       "num_bits": 4, "type": "int", "strategy": "group", "group_size": group, "symmetric": sym}}}}}
    set_config(src, quantization_config=spec[kind])
    return deq


def write_fp8(src: Path, block: int = 128, reference: bool = True) -> dict:
    """Rewrite as Qwen's FP8: e4m3 codes and fp32 weight_scale_inv per block (transformers' own
    quantizer's arithmetic: scale = max|w| / 448); returns {module: bf16 dequantization by
    transformers' own function} (empty without `reference`)."""
    from safetensors.torch import load_file, save_file  # an optional test dependency

    path = src / "model.safetensors"
    state = load_file(str(path))
    deq = {}
    for name in [n for n, t in state.items() if t.dim() == 2 and n.endswith("_proj.weight")
                 and t.shape[0] % block == 0 and t.shape[1] % block == 0]:
        w = state[name]
        blocks = w.reshape(w.shape[0] // block, block, w.shape[1] // block, block)
        scale = blocks.abs().amax((1, 3)).clamp(min=1e-12) / 448.0
        codes = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(w.shape)
        state[name], state[name[:-len("weight")] + "weight_scale_inv"] = codes, scale.float()
        if reference:
            from transformers.integrations.finegrained_fp8 import Fp8Dequantize  # (as safetensors)
            deq[name] = Fp8Dequantize(None)._dequantize_one(codes, scale, output_dtype=torch.bfloat16)
    save_file(state, str(path), metadata={"format": "pt"})
    set_config(src, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [block, block]})
    return deq


def set_config(src, **over) -> None:
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(cfg | over))


