"""A matrix as the native products read it (native_products.c, native_qproducts.c): `Packed`, in
one of its layouts, and `PackedRows` (an embedding table read out of a packed lm_head); each
layout's wtype, and its bytes read back to the dense matrix they multiply by (`Packed.dense`).
The packing: native_pack.py (float panels, "q4" / "q8"), native_exact.py (the exact formats).
"""

from __future__ import annotations

import dataclasses

import torch

from ..store import quant
from .native_lib import WTYPES

PANEL = 16  # outputs per panel of a packed matrix (native_products.c: one vector register)
# The exact layouts (native_exact.py): bytes before a matrix's panels (int32 fields) or a segment
# table; int4's outputs a block (two a panel) and inputs a superblock (native_int4_lanes.c).
HEADER = 64
OCTET = 8
SUPER = 128


def ptr(t: torch.Tensor | Packed | None) -> int | None:
    """A contiguous tensor's (or packed matrix's) data pointer for a ctypes call (None for NULL)."""
    if t is None:
        return None
    if isinstance(t, Packed):
        t = t.data
    assert t.is_contiguous() and t.device.type == "cpu"
    return t.data_ptr()


@dataclasses.dataclass
class Packed:
    """A matrix w [n, k] laid out as the native products read it (`layout`; native_products.c):
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
    - "q4", "q8" (wtype 4, 5): an affine int4 / int8 matrix (turbo.store.quant, groups of 64) read
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


QUANTIZED = {"q4": 4, "q8": 8}  # the affine layouts read packed, and their bits
LAYOUT_OF_BITS = {bits: layout for layout, bits in QUANTIZED.items()}


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


def superblocks(k: int, group: int) -> list[tuple[int, int, int]]:
    """(first input, slices of 16, groups) of each superblock of 128 inputs (the last maybe shorter)."""
    return [(i0, min(SUPER, k - i0) // 16, min(SUPER, k - i0) // group) for i0 in range(0, k, SUPER)]


def _int4_dense(body: torch.Tensor, rows: int, k: int, group: int) -> torch.Tensor:
    """The inverse of native_exact._int4_bytes, dequantized as the torch step does: q * scale + bias in fp32."""
    body, out, at = body.reshape(rows // OCTET, -1), [], 0
    for _, m, ng in superblocks(k, group):
        sb = [body[:, at + 32 * ng * i:at + 32 * ng * (i + 1)].contiguous().view(torch.float32)
              .reshape(-1, ng, OCTET).transpose(1, 2).reshape(rows, ng) for i in (0, 1)]
        at += 64 * ng
        words = body[:, at:at + 512].contiguous().view(torch.int32).reshape(rows, 1, 16)
        at += 512
        lv = (words >> (4 * torch.arange(m, dtype=torch.int32))[:, None]) & 15  # [rows, m, 16]
        q = lv.reshape(rows, ng, -1).float()
        out.append((q * sb[0][:, :, None] + sb[1][:, :, None]).reshape(rows, -1))
    return torch.cat(out, dim=1)


def exact_dense(p) -> torch.Tensor:
    """The [n, k] fp32 matrix a wtype 7-9 matrix multiplies by (what its products compute with)."""
    if p.layout == "segments":
        return torch.cat([part.dense().float() for part in p.parts])
    h = p.data[:HEADER].view(torch.int32)
    fp8 = p.layout == "fp8"
    bits, group = (8, int(h[0])) if fp8 else (int(h[0]), int(h[1]))
    panels, groups = -(-p.n // PANEL), p.k // group
    if bits == 4:
        return _int4_dense(p.data[HEADER:], panels * PANEL, p.k, group)[:p.n].contiguous()
    body = p.data[HEADER + (int(h[2]) if fp8 else 0):].reshape(panels, groups, -1)
    if fp8:
        tb = p.data[HEADER:HEADER + int(h[2])].reshape(-1, groups, 256).to(torch.int32)
        t = (tb[:, :, :128] << 8 | tb[:, :, 128:]).repeat_interleave(int(h[1]), 0)[:panels]  # [panel, g, 128]
        c = body.reshape(panels, groups, group // 4, 4, 2, 4, 2).permute(0, 3, 5, 1, 2, 4, 6)
        c = c.reshape(panels, PANEL, groups, group).to(torch.int64)  # [panel, output, g, input]
        bits16 = torch.gather(t[:, None].expand(-1, PANEL, -1, -1), 3, c & 0x7F) | (c & 0x80) << 8
        w = (bits16.to(torch.int32) << 16).view(torch.float32)
    else:
        s = body[:, :, :64].contiguous().view(torch.float32)  # [panel, g, out]
        if int(h[2]) == 1:  # centered: c * scale (+ 0.0: a zero scale's -0.0 reads +0.0, as q * 0 + -0.0)
            q = body[:, :, 64:].reshape(panels, groups, group, PANEL)
            w = (q.view(torch.int8).float() * s[:, :, None] + 0.0).permute(0, 3, 1, 2)
        else:
            b = body[:, :, 64:128].contiguous().view(torch.float32)
            q = body[:, :, 128:].reshape(panels, groups, group, PANEL).float()
            w = (q * s[:, :, None] + b[:, :, None]).permute(0, 3, 1, 2)
    return w.reshape(panels * PANEL, -1)[:p.n].contiguous()
