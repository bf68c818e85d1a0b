"""Weights as the native products (native_products.c, native_qproducts.c) read them: `Packed` (a
matrix in one of its layouts), `PackedRows` (an embedding table read out of a packed lm_head),
packing from dense, quantized or streamed rows, and `linear_packed`, the product itself. The
library: native_lib.py.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from .. import quant
from .native_lib import WTYPES, dot_layouts, threaded

def ptr(t: torch.Tensor | Packed | None) -> int | None:
    """A contiguous tensor's (or packed matrix's) data pointer for a ctypes call (None for NULL)."""
    if t is None:
        return None
    if isinstance(t, Packed):
        t = t.data
    assert t.is_contiguous() and t.device.type == "cpu"
    return t.data_ptr()


PANEL = 16  # outputs per panel of a packed matrix (native_products.c: one vector register)


@dataclasses.dataclass
class Packed:
    """A matrix w [n, k] laid out as native_products.c reads it (`layout`):
    - "panels": panels of 16 outputs, data[p, i, l] = w[16p + l, i] ([ceil(n/16), k, 16],
      the last panel zero-padded); fp32 or bf16 (widened exactly: the fp32 products);
    - "panel_pairs" (bf16, wtype 6): the panels two inputs at a time, data[p, j, l, t] =
      w[16p + l, 2j + t] ([ceil(n/16), ceil(k/2), 16, 2]): the same products bit for bit,
      each load widening two inputs' weights (a verify's many rows are arithmetic-bound);
    - "pairs" (bf16): data[p, j, l, t] = w[16p + l, 2j + t], for bf16 dot products (wtype 2,
      inputs rounded to bf16);
    - "int8": per output a scale max|w| / 127 (fp32), 128 x the sum of its int8 values
      (int32), then data[p, j, l, t] = round(w[16p + l, 4j + t] / scale) as int8, all in one
      byte buffer, for int8 dot products (wtype 3, inputs quantised per row).
    - "q4", "q8" (wtype 4, 5): an affine int4 / int8 matrix (turbo.quant, groups of 64) read
      packed, `quantized_panels`;
    - "exact" (wtype 8): affine int4 / int8 with fp32 scales in any group, "fp8" (wtype 9): e4m3
      codes and block scales, both read as stored in float products (`exact_panels`: the torch
      step's dequantized weights exactly); "segments" (wtype 7): row segments of their own layouts.
    "pairs", "int8", "q4" and "q8" are not the fp32 function: "pairs" and "int8" are for drafters, "q4" and "q8"
    (the trunk's quantized installs) round the inputs to 8 bits per group of 64."""

    data: torch.Tensor
    n: int
    k: int
    layout: str = "panels"
    parts: list | None = None  # "segments": the segments (views of `data`)

    @property
    def wtype(self) -> int:
        return LAYOUT_WTYPES.get(self.layout) or WTYPES[self.data.dtype]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def dense(self) -> torch.Tensor:
        """The [n, k] matrix back (a copy; int8: the dequantised values)."""
        n_pad = -(-self.n // PANEL) * PANEL
        if self.layout in EXACT_LAYOUTS:
            return exact_dense(self)
        if self.layout in QUANTIZED:
            return quant.dequantize(*quantized_unpanel(self), QUANTIZED[self.layout], quant.GROUP)[:self.n]
        if self.layout == "int8":
            scale = self.data[:4 * n_pad].view(torch.float32)
            q = self.data[8 * n_pad:].view(torch.int8).reshape(n_pad // PANEL, -1, PANEL, 4)
            w = q.permute(0, 2, 1, 3).reshape(n_pad, -1).float() * scale[:, None]
            return w[:self.n, :self.k].contiguous()
        if self.layout in ("pairs", "panel_pairs"):
            return self.data.permute(0, 2, 1, 3).reshape(n_pad, -1)[:self.n, :self.k].contiguous()
        return self.data.transpose(1, 2).reshape(-1, self.k)[:self.n].contiguous()


LAYOUT_WTYPES = {"pairs": 2, "int8": 3, "q4": 4, "q8": 5, "panel_pairs": 6, "segments": 7, "exact": 8, "fp8": 9}
EXACT_LAYOUTS = ("segments", "exact", "fp8")  # native_exact.py


@dataclasses.dataclass
class PackedRows:
    """An embedding table read out of a packed matrix's panels: with tied embeddings the
    table and the lm_head are one matrix, kept once. Row t is packed.data[t // 16, :, t % 16]."""

    packed: Packed

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.packed.dtype

    def __getitem__(self, ids) -> torch.Tensor:
        ids = torch.as_tensor(ids)
        if self.packed.layout == "panel_pairs":
            rows = self.packed.data[ids // PANEL, :, ids % PANEL]  # [..., ceil(k/2), 2]
            return rows.reshape(*rows.shape[:-2], -1)[..., :self.packed.k]
        return self.packed.data[ids // PANEL, :, ids % PANEL]


def table_of(embed: torch.Tensor | PackedRows) -> tuple[int, int, int]:
    """An embedding table as native code reads it: (pointer, wtype, layout: 0 row-major, 1 panels,
    2 panel pairs)."""
    if isinstance(embed, PackedRows):
        return embed.packed.data.data_ptr(), WTYPES[embed.dtype], 2 if embed.packed.layout == "panel_pairs" else 1
    if isinstance(embed, quant.QuantizedRows):
        embed = embed.dense()
    assert embed.is_contiguous() and embed.device.type == "cpu"
    return embed.data_ptr(), WTYPES[embed.dtype], 0


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


QUANTIZED = {"q4": 4, "q8": 8}  # the affine layouts read packed, and their bits
LAYOUT_OF_BITS = {bits: layout for layout, bits in QUANTIZED.items()}


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


def quantized_unpanel(p: Packed) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantized_panels backwards: (packed levels, scales, biases) of the padded matrix."""
    bits, panels, groups = QUANTIZED[p.layout], p.data.shape[0], p.data.shape[1]
    scales, biases = (p.data[:, :, at:at + 2 * PANEL].contiguous().view(torch.bfloat16).transpose(1, 2)
                      .reshape(-1, groups) for at in (0, 2 * PANEL))
    q = p.data[:, :, 4 * PANEL:].reshape(panels, groups, -1, PANEL, 4)
    if bits == 4:
        q = torch.cat([q & 15, q >> 4], dim=2)
    q = q.permute(0, 3, 1, 2, 4).reshape(panels * PANEL, -1)
    return quant.pack(q, bits), scales, biases


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


from .native_exact import exact_dense, exact_panels, reads_exact  # noqa: E402  (they build Packed)


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
