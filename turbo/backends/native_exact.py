"""The exact formats the native step reads as stored (native_exact.c, wtypes 8-9; native_products.c,
7): affine int4 / int8 with fp32 scales and biases in any group ("exact": quant.EXACT_INT4,
quant.GGUF_FORMATS), FP8 e4m3 codes with a scale per 128 x 128 block ("fp8": quant.FP8), and
"segments", a matrix whose row segments keep layouts of their own (a layer mixing those with bf16
matrices, as Qwen's FP8 checkpoints do). Their products are float products of exactly the torch
step's dequantized weights (FP8: bit for bit the bf16 panels' products). Read back to dense:
packed.py (`exact_dense`); the other layouts: native_pack.py.
"""

from __future__ import annotations

import torch

from ..errors import TurboError
from ..store import quant
from .native_lib import WTYPES, dot_layouts
from .packed import HEADER, LAYOUT_WTYPES, OCTET, PANEL, SUPER, Packed, superblocks

E4M3 = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # the codes >= 0, as transformers reads them


def exact_layout(float8: bool) -> str:
    return "fp8" if float8 else "exact"


def reads_format(code: int, layouts: tuple[str, ...]) -> bool:
    """Whether the products here read an install format (quant code) as stored: fp32-scaled
    affine int4 / int8, or FP8, where the CPU has their products (`layouts`: native_lib.dot_layouts)."""
    fmt = quant.BY_CODE.get(code)
    return (fmt is not None and fmt.scale_st == "F32" and fmt.bits in (4, 8) and lays_out(fmt.bits, fmt.group)
            and exact_layout(code in quant.FLOAT8_CODES) in layouts)


def reads_exact(w) -> bool:
    """Whether `w` (a QuantizedWeight) is read as stored by exact_panels here."""
    return (isinstance(w, quant.QuantizedWeight) and w.scales.dtype == torch.float32 and w.bits in (4, 8)
            and lays_out(w.bits, w.group) and exact_layout(w.float8) in dot_layouts())


def lays_out(bits: int, group: int) -> bool:
    """int4: groups of 16 to 128 inputs that tile the superblocks of 128 (quant.EXACT_INT4's 32, 64, 128)."""
    return bits != 4 or (group % 16 == 0 and SUPER % group == 0)


def _header(*fields: int) -> torch.Tensor:
    h = torch.zeros(HEADER // 4, dtype=torch.int32)
    h[:len(fields)] = torch.tensor(fields, dtype=torch.int32)
    return h.view(torch.uint8)


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t with its rows padded to `rows`, repeating the last row (a padded output's scale is its
    panel's: the FP8 tables stay one per panel; its levels are 0)."""
    return torch.cat([t, t[-1:].expand(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


def centered(w: quant.QuantizedWeight) -> bool:
    """Whether every int8 weight q * scale + bias (two roundings) is exactly c * scale, c = q - 128
    (one): each bias is -128 * scale and each scale a normal float (or +0) of at most 16
    significant bits, so that q * scale (8 + 16 bits), -128 * scale and their sum are exact in
    fp32. GGUF's Q8_0 (an f16 scale d, bias -128 d) always is; the products then form each weight
    with one multiply (native_exact.c, fpacked)."""
    s, b = w.scales.float(), w.biases.float()
    bits = s.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    return bool(w.bits == 8 and torch.equal(b, -128 * s) and ((bits & 0xFF) == 0).all()
                and (((exponent >= 1) & (exponent <= 240)) | (bits == 0)).all())


def _affine_bytes(w: quant.QuantizedWeight, centre: bool = False) -> torch.Tensor:
    """int8: [panels, groups, group bytes], per panel and group the 16 scales, the 16 biases (fp32),
    the levels (16 bytes an input); `centre`: no biases, the levels as int8 q - 128. int4: _int4_bytes."""
    n, k = w.shape
    rows, groups = -(-n // PANEL) * PANEL, k // w.group
    q = torch.nn.functional.pad(quant.unpack(w.packed, w.bits), (0, 0, 0, rows - n))
    if w.bits == 4:
        return _int4_bytes(q, *(_padded(t.float(), rows) for t in (w.scales, w.biases)), w.group)
    if centre:
        q = q ^ 0x80  # (q - 128 as a byte)
    q = q.reshape(-1, PANEL, groups, w.group).permute(0, 2, 3, 1)  # [panel, g, input, output]
    sb = [_padded(t.float(), rows).reshape(-1, PANEL, groups).transpose(1, 2).contiguous().view(torch.uint8)
          for t in (w.scales, w.biases)]
    return torch.cat([*sb[:1 if centre else 2], q.reshape(*q.shape[:2], -1)], dim=2)


def _int4_bytes(q: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, group: int) -> torch.Tensor:
    """[blocks of 8 outputs, bytes]: per superblock its groups' scales [ng, 8] and biases [ng, 8]
    (fp32), then per output 64 bytes, dword l nibble j = the level of input 16j + l
    (native_int4_lanes.c)."""
    rows, k = q.shape
    parts = []
    for i0, m, ng in superblocks(k, group):
        g0 = i0 // group
        sb = [t[:, g0:g0 + ng].reshape(-1, OCTET, ng).transpose(1, 2).contiguous().view(torch.uint8).reshape(rows // OCTET, -1)
              for t in (scales, biases)]
        lv = torch.nn.functional.pad(q[:, i0:i0 + 16 * m].reshape(rows, m, 16).to(torch.int32), (0, 0, 0, 8 - m))
        words = (lv << (4 * torch.arange(8, dtype=torch.int32))[:, None]).sum(1, dtype=torch.int32)  # [rows, 16]
        parts += [*sb, words.contiguous().view(torch.uint8).reshape(rows // OCTET, -1)]
    return torch.cat(parts, dim=1)


def _fp8_block(w: quant.QuantizedWeight, name: str) -> int:
    """Panels per scale block (8: Qwen's 128 rows): the most of 8, 4, 2, 1 whose rows share every
    group's scale, the table's (a padded output repeats the last row's)."""
    rows, groups = -(-w.shape[0] // PANEL) * PANEL, w.shape[1] // w.group
    s = _padded(w.scales.float(), rows)
    if not (s >= 0).all():
        raise TurboError(f"{name}: FP8 scales that are negative or NaN")
    for pb in (8, 4, 2, 1):
        b = torch.nn.functional.pad(s, (0, 0, 0, -rows % (pb * PANEL)), value=float("nan")).reshape(-1, pb * PANEL, groups)
        if ((b == b[:, :1]) | b.isnan()).all():
            return pb
    raise TurboError(f"{name}: FP8 scales that are not one scale per block of 16 rows")


def _fp8_bytes(w: quant.QuantizedWeight, pb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[blocks, groups, 256]: per block of pb panels and group the table bf16(e4m3(c) * scale) of
    the codes c = 0..127 (high bytes, then low bytes); [panels, groups, group * 16]: the codes in
    chunks of 4 inputs x 16 outputs, byte 16L + 8h + 2d + e = output 4L + d at input 2h + e
    (native_exact.c)."""
    n, k = w.shape
    rows, groups, g = -(-n // PANEL) * PANEL, k // w.group, w.group
    s = _padded(w.scales.float(), rows)[::pb * PANEL]  # [blocks, g]
    table = (E4M3 * s[:, :, None]).to(torch.bfloat16).view(torch.int16)
    tables = torch.cat([((table >> 8) & 0xFF).to(torch.uint8), (table & 0xFF).to(torch.uint8)], dim=2)
    c = torch.nn.functional.pad(quant.unpack(w.packed, 8), (0, 0, 0, rows - n))
    # the input pairs (e) moved as one 16-bit element: half the elements of a byte-wise permute
    c = c.contiguous().view(torch.int16).reshape(-1, 4, 4, groups, g // 4, 2).permute(0, 3, 4, 1, 5, 2)
    return tables, c.contiguous().view(torch.uint8).reshape(c.shape[0], groups, -1)  # [panel, g, chunk, L, h, d, e]


def exact_panels(w: quant.QuantizedWeight, name: str = "matrix", rows: int = 16384):
    """`w` as wtype 8 (affine, fp32 scales) or 9 (FP8) reads it, `rows` (a multiple of 128)
    outputs at a time (the unpacking holds several bytes a weight), each slice's bytes written
    into the one buffer as it is made (never a second copy of the whole)."""
    n, k = w.shape
    starts, padded = range(0, n, rows), -(-n // PANEL) * PANEL

    def part(r0: int) -> quant.QuantizedWeight:
        return quant.QuantizedWeight(w.packed[r0:r0 + rows], w.scales[r0:r0 + rows], w.biases[r0:r0 + rows], w.bits,
                                     w.group, float8=w.float8)

    def panel_rows(r0: int) -> int:
        return -(-min(rows, n - r0) // PANEL) * PANEL

    if not w.float8:
        centre, out, at = centered(w), None, HEADER
        for r0 in starts:
            body = _affine_bytes(part(r0), centre).reshape(-1)
            if out is None:  # (a panel row's bytes are the same in every slice)
                out = torch.empty(HEADER + body.numel() // panel_rows(r0) * padded, dtype=torch.uint8)
                out[:HEADER] = _header(w.bits, w.group, int(centre))
            out[at:at + body.numel()] = body
            at += body.numel()
        assert at == out.numel()
        return Packed(out, n, k, "exact")
    pb = _fp8_block(w, name)
    table_bytes = sum(-(-panel_rows(r0) // (pb * PANEL)) for r0 in starts) * (k // w.group) * 256
    out = torch.empty(HEADER + table_bytes + padded * k, dtype=torch.uint8)
    out[:HEADER] = _header(w.group, pb, table_bytes)
    at_table, at_code = HEADER, HEADER + table_bytes
    for r0 in starts:
        table, codes = (t.reshape(-1) for t in _fp8_bytes(part(r0), pb))
        out[at_table:at_table + table.numel()] = table
        out[at_code:at_code + codes.numel()] = codes
        at_table, at_code = at_table + table.numel(), at_code + codes.numel()
    assert at_table == HEADER + table_bytes and at_code == out.numel()
    return Packed(out, n, k, "fp8")


def segments_table(parts: list[tuple[int, int, int]]) -> tuple[torch.Tensor, list[int]]:
    """The bytes before a segments matrix's parts (its header and table, padded to 64) and each
    part's byte offset, for parts of (rows, wtype, bytes), each 64-byte aligned."""
    at, offsets = -(-(HEADER + 16 * len(parts)) // 64) * 64, []
    for _, _, size in parts:
        offsets.append(at)
        at += -(-size // 64) * 64
    head = torch.zeros(offsets[0], dtype=torch.uint8)
    head[:HEADER] = _header(len(parts))
    table = torch.tensor([[n | wtype << 32, off] for (n, wtype, _), off in zip(parts, offsets)], dtype=torch.int64)
    head[HEADER:HEADER + 16 * len(parts)] = table.view(torch.uint8).reshape(-1)
    return head, offsets + [at]


def segments(parts: list) -> Packed:
    """Packed matrices of one input width stacked by rows into one wtype 7 matrix: a table of
    (rows, wtype, byte offset), then each part's bytes (64-byte aligned). The parts keep views of
    the one buffer (dense() reads them)."""
    k = parts[0].k
    assert all(p.k == k for p in parts) and all(p.layout != "segments" for p in parts)
    sizes = [p.data.numel() * p.data.element_size() for p in parts]
    head, offsets = segments_table([(p.n, p.wtype, size) for p, size in zip(parts, sizes)])
    buf = torch.zeros(offsets[-1], dtype=torch.uint8)
    buf[:head.numel()] = head
    views = []
    for p, off, size in zip(parts, offsets, sizes):
        buf[off:off + size] = p.data.contiguous().view(torch.uint8).reshape(-1)
        views.append(Packed(buf[off:off + size].view(p.data.dtype).reshape(p.data.shape), p.n, k, p.layout))
    return Packed(buf, sum(p.n for p in parts), k, "segments", views)


def read_segments(buf: torch.Tensor, k: int, parts: list[tuple[int, str, torch.dtype, tuple[int, ...] | None]],
                  name: str) -> Packed:
    """A segments matrix read in place out of `buf` (bytes laid out by segments(), e.g. mapped:
    nothing copied), its parts of (rows, layout, dtype, shape; None: an exact one, its bytes up to
    the next part's) views of it; a table other than those parts' is refused."""
    count = len(parts)
    damaged = buf.numel() < HEADER + 16 * count or int(buf[:4].view(torch.int32)) != count
    table = [] if damaged else buf[HEADER:HEADER + 16 * count].view(torch.int64).reshape(count, 2).tolist()
    want = [n | (LAYOUT_WTYPES.get(layout) or WTYPES[dtype]) << 32 for n, layout, dtype, _ in parts]
    ends = [off for _, off in table[1:]] + [buf.numel()]
    if damaged or [t[0] for t in table] != want or any(not 0 < off <= end or off % 64 for (_, off), end in zip(table, ends)):
        raise TurboError(f"{name}: its segments table is not the plan's (a damaged open layout)")
    views = []
    for (n, layout, dtype, shape), (_, off), end in zip(parts, table, ends):
        size = end - off if shape is None else dtype.itemsize * int(torch.Size(shape).numel())
        if off + size > end:
            raise TurboError(f"{name}: a segment overruns the next (a damaged open layout)")
        data = buf[off:off + size].view(dtype)
        views.append(Packed(data if shape is None else data.reshape(shape), n, k, layout))
    return Packed(buf, sum(p[0] for p in parts), k, "segments", views)
