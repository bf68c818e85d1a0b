"""Fine-grained FP8 checkpoints (Qwen's and DeepSeek's: e4m3 weights, an fp32 `weight_scale_inv`
per block of [rows, cols], by default 128 x 128) into turbo installs (docs/formats.md).

The install keeps each FP8 matrix's codes and scales (quant.FP8: the codes as 8-bit levels, each
row's block scale per 128 columns), which every step reads as transformers' dequantization to bf16
(integrations/finegrained_fp8.py: the codes to fp32, times the block's scale in fp32, rounded once
to bf16), bit for bit: the model transformers runs from the checkpoint; the native step's FP8
products (native_exact.py) read the codes as stored. Blocks other than 128 columns wide, or a width
128 does not divide, are stored as that bf16 matrix. The modules the checkpoint keeps in bf16
(modules_to_not_convert: embeddings, lm_head, Gated DeltaNet projections) are copied as they are.
`--quant int8 / int4` quantizes the bf16 matrix as it would a bf16 checkpoint's.
"""

from __future__ import annotations

import torch

from ..errors import TurboError
from ..store import quant as q
from .formats import Parts, Source, SourceFormat, modules, quantized_planned, read
from .tensors import Planned, quantizable


def dequantize(codes: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """transformers' fp32 product codes * scale per block (the last blocks may be partial, as
    DeepSeek's ceil(rows / 128) grids are), not yet rounded."""
    rows, cols = codes.shape
    s = scale_inv.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return codes.float() * s


def fp8_install(codes: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """quant.FP8's (packed codes, scales, biases): the codes' bytes as little-endian words (the
    levels' order of quant.pack), each row's block scale per group of 128 columns, biases 0."""
    rows, cols = codes.shape
    scales = scale_inv.float().repeat_interleave(block[0], 0)[:rows].contiguous()
    return codes.contiguous().view(torch.uint8).view(torch.int32), scales, torch.zeros_like(scales)


def keeps_codes(block: tuple[int, int], cols: int) -> bool:
    """Whether an FP8 matrix is kept as codes (quant.FP8), not as its bf16 dequantization."""
    return block[1] == q.FP8.group and cols % q.FP8.group == 0 and block[0] % 16 == 0


def plan_fp8(found: SourceFormat, tensors: list[Source], fmt: q.QFormat | None,
             quantized: dict[str, dict]) -> tuple[list[Planned], list[Source]]:
    by_module, rest = modules(tensors, (".weight_scale_inv",))
    weights = {t[1]: t for t in rest if t[2]["dtype"] == "F8_E4M3"}
    rest = [t for t in rest if t[1] not in weights]
    planned = []
    for base, m in by_module.items():
        sc = m[".weight_scale_inv"]
        w = weights.pop(base + ".weight", None)
        if w is None:
            raise TurboError(f"{sc[0]}: no F8_E4M3 {base.rsplit('.', 1)[-1]}.weight beside it")
        if len(w[2]["shape"]) != 2:
            raise TurboError(f"{w[0]}: FP8 weight of shape {w[2]['shape']}, expected rank 2")
        rows, cols = w[2]["shape"]
        grid = [-(-rows // found.block[0]), -(-cols // found.block[1])]
        if list(sc[2]["shape"]) != grid or sc[2]["dtype"] not in ("F32", "BF16"):
            raise TurboError(f"{sc[0]}: {sc[2]['dtype']} {sc[2]['shape']}, expected F32 {grid} (one scale per "
                             f"{found.block[0]}x{found.block[1]} block of the [{rows}, {cols}] weight)")
        bf16 = lambda w=w, sc=sc: dequantize(read(w), read(sc), found.block).to(torch.bfloat16)
        new = base + ".weight"
        if fmt is not None and quantizable(new, {"dtype": "BF16", "shape": [rows, cols]}, fmt):
            planned += quantized_planned(new, lambda f=bf16, n=new: q.quantize(f(), fmt, n), rows, cols, fmt, quantized)
        elif fmt is None and keeps_codes(found.block, cols):
            planned += quantized_planned(new, lambda w=w, sc=sc: fp8_install(read(w), read(sc), found.block), rows,
                                         cols, q.FP8, quantized)
        else:
            planned += Parts(lambda f=bf16: [f()]).planned([new], ["BF16"], [[rows, cols]])
    if weights:
        name = next(iter(weights.values()))[0]
        raise TurboError(f"{name}: an F8_E4M3 weight without its weight_scale_inv")
    return planned, rest
