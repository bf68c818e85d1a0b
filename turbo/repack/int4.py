"""AWQ, GPTQ and compressed-tensors pack-quantized int4 into turbo's affine int4 (docs/formats.md).

Every source group is w = (q - z) * s: levels q and zero z in 0..15, a 16-bit float scale s. That is
turbo's affine group w = q * scale + bias with scale = s and bias = -z * s, and in fp32 both are exact
(z * s needs at most 5 + 11 significant bits), as is their sum q * s - z * s = (q - z) * s: the
install's fp32 dequantization is the exact product, and rounded to the source's dtype it is the
source library's own dequantization bit for bit. The default target, quant.EXACT_INT4[group], keeps
the source's group and fp32 scales for that reason. `--quant int4` carries the levels into turbo's
int4 (groups of 64, bf16 scales: each group of 128 is two of 64; s and -z * s round to bf16, 8
significant bits, a relative error up to 2**-9 of each), the other formats re-quantize the
dequantized matrix. GPTQ's act order (g_idx not in input order) puts one group's inputs all over
the row, which turbo's contiguous groups cannot hold: those matrices are re-quantized from their
fp32 dequantization (error: half a step of the new groups), and the repack says so.
"""

from __future__ import annotations

import torch

from ..errors import TurboError
from ..store import quant as q
from .formats import Source, SourceFormat, modules, need_shape, quantized_planned, read
from .tensors import Planned

AWQ_REVERSE = [0, 4, 1, 5, 2, 6, 3, 7]  # AWQ packs outputs 0 2 4 6 1 3 5 7 into nibbles 0..7: natural j = nibble AWQ_REVERSE[j]
SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [r, w] -> [r, w, 8] its nibbles, the low one first."""
    return (packed[..., None] >> SHIFTS) & 15


Levels = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # q [out, in], z [out, G] (int), s [out, G] (float)


def _awq(m: dict[str, Source], group: int, name: str) -> tuple[int, int, callable]:
    qw, qz, sc = m[".qweight"], m[".qzeros"], m[".scales"]
    cols, words = qw[2]["shape"]
    rows = words * 8
    G = cols // group
    need_shape(sc, [G, rows], f"AWQ scales: [in / group {group}, out]")
    need_shape(qz, [G, words], "AWQ qzeros: [in / group, out / 8]")

    def levels() -> Levels:
        un = lambda t: nibbles(read(t))[..., AWQ_REVERSE].reshape(t[2]["shape"][0], -1).T
        return un(qw), un(qz), read(sc).T
    return rows, cols, levels


def _gptq(m: dict[str, Source], found: SourceFormat, name: str) -> tuple[int, int, callable, torch.Tensor | None]:
    qw, qz, sc = m[".qweight"], m[".qzeros"], m[".scales"]
    words, rows = qw[2]["shape"]
    cols, G = words * 8, words * 8 // found.group
    need_shape(sc, [G, rows], f"GPTQ scales: [in / group {found.group}, out]")
    need_shape(qz, [G, rows // 8], "GPTQ qzeros: [in / group, out / 8]")
    g_idx = None
    if ".g_idx" in m:
        gi = m[".g_idx"]
        if list(gi[2]["shape"]) != [cols] or gi[2]["dtype"] not in ("I32", "I64"):
            raise TurboError(f"{gi[0]}: g_idx of shape {gi[2]['shape']} ({gi[2]['dtype']}), expected [{cols}] "
                             f"integers (a group per input)")
        g_idx = read(gi).long()
        if g_idx.numel() and (g_idx.min() < 0 or g_idx.max() >= G):
            raise TurboError(f"{gi[0]}: g_idx names groups outside 0..{G - 1}")
        if torch.equal(g_idx, torch.arange(cols) // found.group):
            g_idx = None  # in input order: contiguous groups

    def levels() -> Levels:
        z = (nibbles(read(qz)).reshape(G, rows) + found.zero_offset) & 15  # v1: zero - 1 stored (wrapping)
        return nibbles(read(qw).T).reshape(rows, cols), z.T, read(sc).T
    return rows, cols, levels, g_idx


def _compressed(m: dict[str, Source], found: SourceFormat, name: str) -> tuple[int, int, callable]:
    wp, sc = m[".weight_packed"], m[".weight_scale"]
    if ".weight_shape" not in m:
        raise TurboError(f"{wp[0]}: no weight_shape beside it")
    shape = read(m[".weight_shape"]).tolist()
    rows, words = wp[2]["shape"]
    if shape != [rows, words * 8]:
        raise TurboError(f"{m['.weight_shape'][0]}: {shape}, expected [{rows}, {words * 8}] (weight_packed's)")
    cols, G = words * 8, words * 8 // found.group
    need_shape(sc, [rows, G], f"weight_scale: [out, in / group {found.group}]")
    zp = m.get(".weight_zero_point")
    if not found.symmetric:
        if zp is None:
            raise TurboError(f"{wp[0]}: asymmetric but no weight_zero_point beside it")
        need_shape(zp, [-(-rows // 8), G], "weight_zero_point: [out / 8, in / group], packed along the outputs")

    def levels() -> Levels:
        # stored: value + 8 in 0..15 (pack_to_int32's offset), zero points likewise
        z = (nibbles(read(zp).T).reshape(G, -1)[:, :rows].T if zp is not None and not found.symmetric
             else torch.full((rows, G), 8, dtype=torch.int32))
        return nibbles(read(wp)).reshape(rows, cols), z, read(sc)
    return rows, cols, levels


def dequantize(lv: Levels, group: int, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 matrix (q - z) * s (exact: see the module docstring)."""
    qv, z, s = lv
    if g_idx is None:
        g_idx = torch.arange(qv.shape[1]) // group
    return (qv - z[:, g_idx]).float() * s.float()[:, g_idx]


def convert(lv: Levels, group: int, fmt: q.QFormat, g_idx: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """(packed, scales, biases) of a source matrix in `fmt`: its levels carried where the groups
    nest (fmt's group divides the source's), else re-quantized from its dequantization."""
    qv, z, s = lv
    if g_idx is not None or fmt.bits != 4 or group % fmt.group:
        return q.quantize(dequantize(lv, group, g_idx), fmt)
    rep = group // fmt.group
    s32 = s.float().repeat_interleave(rep, 1)
    bias = -z.float().repeat_interleave(rep, 1) * s32
    return q.pack(qv.to(torch.uint8), 4), s32.to(fmt.scale_dtype), bias.to(fmt.scale_dtype)


# the companions each format's module must carry (GPTQ's g_idx and compressed-tensors' zero point
# are optional: contiguous groups, symmetric codes)
REQUIRED = {"awq": (".qweight", ".qzeros", ".scales"), "gptq": (".qweight", ".qzeros", ".scales"),
            "compressed-tensors": (".weight_packed", ".weight_scale", ".weight_shape")}


def plan_int4(found: SourceFormat, tensors: list[Source], fmt: q.QFormat | None,
              quantized: dict[str, dict]) -> tuple[list[Planned], list[Source]]:
    suffixes = {"awq": (".qweight", ".qzeros", ".scales"), "gptq": (".qweight", ".qzeros", ".scales", ".g_idx"),
                "compressed-tensors": (".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_shape")}
    by_module, rest = modules(tensors, suffixes[found.kind])
    planned, reordered = [], 0
    first = suffixes[found.kind][0]
    for base, m in by_module.items():
        if first not in m:
            raise TurboError(f"{next(iter(m.values()))[0]}: without its module's {first[1:]}")
        lacking = [x for x in REQUIRED[found.kind] if x not in m]
        if lacking:  # (else a KeyError where the module is read)
            raise TurboError(f"{m[first][0]}: its module has no {base.rsplit('.', 1)[-1]}{lacking[0]} tensor, expected "
                             f"{', '.join(base.rsplit('.', 1)[-1] + x for x in REQUIRED[found.kind])} "
                             f"({found.kind})")
        if m[first][2]["dtype"] != "I32" or len(m[first][2]["shape"]) != 2:
            raise TurboError(f"{m[first][0]}: {m[first][2]['dtype']} {m[first][2]['shape']}, expected a rank-2 I32 "
                             f"packed int4 matrix")
        g_idx = None
        if found.kind == "awq":
            rows, cols, levels = _awq(m, found.group, base)
        elif found.kind == "gptq":
            rows, cols, levels, g_idx = _gptq(m, found, base)
        else:
            rows, cols, levels = _compressed(m, found, base)
        if cols % found.group:
            raise TurboError(f"{m[first][0]}: {cols} inputs are not whole groups of {found.group}")
        target = fmt or q.EXACT_INT4[found.group]
        if cols % target.group:  # (a --quant format whose group does not divide this matrix)
            raise TurboError(f"{m[first][0]}: {cols} inputs are not whole groups of {target.group} ({target.name})")
        reordered += g_idx is not None
        planned += quantized_planned(base + ".weight", lambda lv=levels, gi=g_idx, t=target:
                                     convert(lv(), found.group, t, gi), rows, cols, target, quantized)
    if reordered:
        found.notes.append(f"note: {reordered} GPTQ act-order matrices (g_idx not in input order) are re-quantized from their "
              f"dequantization (turbo's groups are contiguous; error up to half a step of the new groups)")
    return planned, rest
