"""Packing weights as the native products (native_products.c, native_qproducts.c) read them, into
a `Packed` matrix (turbo/backends/packed.py: the layouts): from dense, quantized or streamed rows
(an exact format's through native_exact.py), and `linear_packed`, the product itself. The
library: native_lib.py.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..store import quant
from .native_exact import exact_panels, reads_exact
from .native_lib import dot_layouts, threaded
from .packed import LAYOUT_OF_BITS, PANEL, QUANTIZED, Packed


def storage_dtype(dtype: torch.dtype, stored: set[str]) -> torch.dtype:
    """The dtype native code keeps matrices in, for compute `dtype` and the checkpoint's
    stored dtypes (safetensors names): a bf16 checkpoint's stay bf16 under fp32 compute --
    widened exactly in the products, they give fp32 copies' results bit for bit from half
    the bytes (a decode step reads every matrix once per token)."""
    return torch.bfloat16 if dtype == torch.float32 and stored == {"BF16"} else dtype


def panels_into(dst: torch.Tensor, w: torch.Tensor) -> None:
    """w [m, k] into the first ceil(m/16) panels of dst [panels, k, 16] (the "panels" layout,
    in dst's dtype: a last partial panel zero-padded), in one strided copy."""
    m, k = w.shape
    full = m // PANEL
    dst[:full].copy_(w[:full * PANEL].reshape(full, PANEL, k).transpose(1, 2))
    if m % PANEL:
        dst[full].zero_()
        dst[full, :, :m % PANEL].copy_(w[full * PANEL:].T)


def quantized_panels(w: quant.QuantizedWeight, rows: int = 16384) -> Packed:
    """An affine int4 / int8 matrix (groups of 64) as native_qproducts.c's qtile reads it: per panel of 16
    outputs and group, the scales and biases (bf16, 16 each), then the levels, words of 4 inputs
    x 16 outputs (int4: two words to a byte, inputs 4j + t low and 4j + 32 + t high). Padded
    outputs have scale and bias 0. `rows` outputs at a time, whole panels: the unpacking holds
    ~16 bytes a weight, several GB for a vocab-sized head at once."""
    n, k = w.shape
    return _panels_by_slices(n, k, w.bits, rows, lambda r0, r1: _panels_of(
        w.packed[r0:r1], w.scales[r0:r1], w.biases[r0:r1], w.bits, k))


def _panels_by_slices(n: int, k: int, bits: int, rows: int,
                      slice_panels: Callable[[int, int], torch.Tensor]) -> Packed:
    """The packed matrix of n outputs from `slice_panels(r0, r1)` (_panels_of's bytes of outputs
    r0..r1), `rows` (a multiple of 16: whole panels) at a time, into one buffer."""
    out = None
    for r0 in range(0, n, rows):
        part = slice_panels(r0, min(n, r0 + rows))
        if out is None:
            out = torch.empty(-(-n // PANEL), *part.shape[1:], dtype=torch.uint8)
        out[r0 // PANEL:r0 // PANEL + part.shape[0]] = part
    return Packed(out, n, k, LAYOUT_OF_BITS[bits])


def _panels_of(packed: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """quantized_panels' bytes [panels, groups, group bytes] of a slice of outputs."""
    groups, pad = k // quant.GROUP, -packed.shape[0] % PANEL
    q = torch.nn.functional.pad(quant.unpack(packed, bits), (0, 0, 0, pad))
    q = q.reshape(-1, PANEL, groups, quant.GROUP // 4, 4).permute(0, 2, 3, 1, 4)  # [panel, g, word, out, 4]
    if bits == 4:
        q = q[:, :, :8] | q[:, :, 8:] << 4
    sb = [torch.nn.functional.pad(t.to(torch.bfloat16), (0, 0, 0, pad)).reshape(-1, PANEL, groups).transpose(1, 2)
          for t in (scales, biases)]  # [panel, g, out]
    parts = [t.contiguous().view(torch.uint8) for t in sb] + [q.reshape(*q.shape[:2], -1)]
    return torch.cat(parts, dim=2)


def pack(w: torch.Tensor, layout: str = "panels") -> Packed:
    n, k = w.shape
    if layout == "panels":
        data = torch.empty(-(-n // PANEL), k, PANEL, dtype=w.dtype)
        panels_into(data, w)
        return Packed(data, n, k)
    quad = {"pairs": 2, "int8": 4}[layout]
    padded = torch.nn.functional.pad(w, (0, -k % quad, 0, -n % PANEL))
    if layout == "pairs":
        assert w.dtype == torch.bfloat16, "bf16 dot products read bf16 matrices"
        return Packed(padded.reshape(-1, PANEL, padded.shape[1] // 2, 2).permute(0, 2, 1, 3).contiguous(), n, k, layout)
    padded = padded.float()
    scale = padded.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(padded / scale[:, None]).clamp(-127, 127).to(torch.int8)
    corr = 128 * q.sum(dim=1, dtype=torch.int32)
    quads = q.reshape(-1, PANEL, padded.shape[1] // 4, 4).permute(0, 2, 1, 3).contiguous()
    data = torch.cat([scale.view(torch.uint8), corr.view(torch.uint8), quads.view(torch.uint8).reshape(-1)])
    return Packed(data, n, k, layout)


# Rows packed per slice when a matrix is packed as it is read (pack_rows): a few MB at a time.
PACK_SLICE_ROWS = 64 * PANEL


def pack_rows(read: Callable[[int, int], torch.Tensor], n: int, storage: torch.dtype,
              layout: str = "panels") -> Packed:
    """The matrix [n, k] whose rows r0..r1 `read(r0, r1)` returns, packed in panels of `storage`
    ("panels", or bf16 "panel_pairs") a slice of rows at a time: the panels are panel-major, so
    rows 16a..16b pack to panels a..b on their own, and only the packed matrix and one slice
    are ever resident."""
    data, k = None, None
    for r0 in range(0, n, PACK_SLICE_ROWS):
        part = read(r0, min(n, r0 + PACK_SLICE_ROWS))
        if data is None:
            k = part.shape[1]
            data = (torch.empty(-(-n // PANEL), k, PANEL, dtype=storage) if layout == "panels" else
                    torch.empty(-(-n // PANEL), -(-k // 2), PANEL, 2, dtype=storage))
        if layout == "panels":
            panels_into(data[r0 // PANEL:], part)
        else:
            pairs_into(data[r0 // PANEL:], part)
    return Packed(data, n, k, layout)


def pairs_into(dst: torch.Tensor, w: torch.Tensor) -> None:
    """w [m, k] into the first ceil(m/16) panels of dst [panels, ceil(k/2), 16, 2] (the
    "panel_pairs" layout; a last partial panel and an odd k's last pair zero-padded)."""
    m, k = w.shape
    if k % 2:  # (a copy of the slice: the matrices of the family have even widths)
        w = torch.nn.functional.pad(w, (0, 1))
    # a pair is one 32-bit word: the panels' transpose over words, as fast as panels_into's
    panels_into(dst.view(torch.int32).view(dst.shape[0], dst.shape[1], PANEL), w.to(dst.dtype).view(torch.int32))


def pack_as(w: torch.Tensor | quant.QuantizedWeight, storage: torch.dtype, layout: str) -> Packed:
    """w packed in `layout`: panels keep `storage` (fp32 or bf16), pairs are bf16, int8 quantises;
    an affine-quantized w is read packed whatever the layout (quantized_panels) where the
    library has the products for it, else dequantized (fp32 panels)."""
    if isinstance(w, quant.QuantizedWeight):
        if reads_exact(w):
            return exact_panels(w)
        return quantized_panels(w) if native_bits(w) else pack(fp32_matrix(w))
    return pack(w.to(torch.bfloat16 if layout == "pairs" else storage), layout)


def linear_packed(x: torch.Tensor, w: Packed) -> torch.Tensor:
    """x [R, k] @ w^T in fp32 (bf16 weights widened exactly; the drafters' "pairs" and "int8"
    layouts: bf16 or int8 dot products); row-stable by construction."""
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], w.n)
    threaded().linear_packed(x.data_ptr(), x.shape[0], w.k, w.data.data_ptr(), w.wtype, w.n, y.data_ptr())
    return y


def reads_packed(bits: int, group: int) -> bool:
    """Whether the native step's products read a matrix of this affine format packed (int4 / int8
    in groups of 64, where the CPU has the int8 dot products)."""
    return bits in QUANTIZED.values() and group == quant.GROUP and "int8" in dot_layouts()


def native_bits(w) -> int | None:
    """A matrix's bits where the native step reads it packed (None: a float matrix, or another format)."""
    return (w.bits if isinstance(w, quant.QuantizedWeight) and w.scales.dtype == torch.bfloat16
            and reads_packed(w.bits, w.group) else None)


def fp32_matrix(w) -> torch.Tensor:
    """A float or quantized matrix as an fp32 tensor (a quantized one dequantized)."""
    return w.dequantize(torch.float32) if isinstance(w, quant.QuantizedWeight) else w.float()


def quantized_copy(w: torch.Tensor, bits: int, rows: int = 16384) -> Packed:
    """w quantized to the native format of `bits` and packed, `rows` at a time (a vocab-sized
    lm_head in fp32 at once would be several times its size)."""
    fmt = quant.BY_BITS[bits]
    return _panels_by_slices(*w.shape, bits, rows, lambda r0, r1: _panels_of(*quant.quantize(w[r0:r1], fmt), bits,
                                                                             w.shape[1]))
