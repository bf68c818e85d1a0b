"""Affine group quantization of projection matrices: the formats (`FORMATS`, `QFormat`), MLX-layout
packing (`pack` / `unpack`), `quantize` / `dequantize`, and the CPU paths a quantized matrix takes
(`QuantizedWeight`, `Int4Kernel`, `keep_packed`). Formats and packing: docs/DESIGN.md 4; the CPU
paths (dequant, packed, kernel, native, auto): docs/DESIGN.md 7.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from ..errors import TurboError


@dataclass(frozen=True)
class QFormat:
    name: str
    code: int
    bits: int
    group: int
    scale_dtype: torch.dtype
    scale_st: str  # the safetensors dtype string of scales / biases


FORMATS = {
    "int4": QFormat("int4", 4, 4, 64, torch.bfloat16, "BF16"),
    "int8": QFormat("int8", 5, 8, 64, torch.bfloat16, "BF16"),
    "int2": QFormat("int2", 16, 2, 128, torch.float16, "F16"),
    "int1": QFormat("int1", 15, 1, 128, torch.float16, "F16"),
}
GROUP = 64  # the group of the formats the native CPU step reads packed (int4, int8)
# Affine int4 with fp32 scales and biases in a source's own group: what AWQ / GPTQ / compressed-tensors
# int4 convert into exactly (turbo/repack/int4.py, docs/formats.md); repack writes them, --quant does not.
EXACT_INT4 = {g: QFormat(f"int4g{g}", code, 4, g, torch.float32, "F32") for g, code in ((32, 17), (64, 18), (128, 19))}
# GGUF's Q8_0, Q4_0, Q4_1 and Q4_K blocks held exactly (turbo/repack/gguf.py, docs/formats.md): group 32,
# fp32 scales and biases (the int4 one is EXACT_INT4's). Not --quant choices.
GGUF_FORMATS = {"int4g32": EXACT_INT4[32], "int8g32": QFormat("int8g32", 25, 8, 32, torch.float32, "F32")}
# FP8 block-wise sources (turbo/repack/fp8.py): the e4m3 codes as 8-bit levels, each row's fp32 block scale
# per group of 128 columns (its 128x128 block's), biases 0; w = bf16(e4m3(q) * scale) (transformers').
FP8 = QFormat("fp8", 26, 8, 128, torch.float32, "F32")
FLOAT8_CODES = (FP8.code,)
BY_CODE = {f.code: f for f in (*FORMATS.values(), *EXACT_INT4.values(), *GGUF_FORMATS.values(), FP8)}
BY_BITS = {f.bits: f for f in FORMATS.values()}
QUANT_CODES = tuple(sorted(BY_CODE))
# The formats (bits, group) alone may name, without a code: an MLX-layout source's. int8 is
# named by its code only (repack --quant int8 writes it); an 8-bit MLX source is not carried.
BITS_NAMED = (4, 2, 1)
# Weights quantized or packed per slice of rows (each row's groups are its own, so the bytes are those
# of the whole matrix): quantizing holds ~40 bytes a weight, several GB for a vocab-sized head at once.
# A repack (turbo/repack/tensors.py) and an open layout's writer (turbo/load/open_layout.py) both slice by it.
QUANT_SLICE = 1 << 20
METADATA_KEY = "turbo.quant"  # safetensors __metadata__ key: json {name: {code, group, bits}}

# The CPU representation of a quantized matrix in the trunk (docs/DESIGN.md 7): auto,
# dequant, packed, kernel or native (OpenOptions.quant_cpu, read from this variable at the edges).
QUANT_CPU_ENV = "TURBO_QUANT_CPU"  # how packed quantized matrices run on the CPU (CPU_MODES)
CPU_MODE_ENV = QUANT_CPU_ENV


CPU_MODES = ("auto", "dequant", "packed", "kernel", "native")
NATIVE_BITS = (4, 8)  # the formats the native step reads packed (groups of GROUP)


def native_reads(mode: str, bits: int, dtype: torch.dtype) -> bool:
    """Whether the native step reads a `bits` matrix packed under `mode` (where it runs)."""
    auto = mode == "auto" and not (bits == 4 and dtype == torch.bfloat16)
    return bits in NATIVE_BITS and (mode == "native" or auto)


def keep_packed(mode: str, bits: int, dtype: torch.dtype, native: bool = False) -> bool:
    """Whether the trunk keeps a quantized matrix as a QuantizedWeight (else dequantizes it at
    load); `native`: the native step can run here."""
    if native and native_reads(mode, bits, dtype):
        return True
    return mode == "packed" or (bits == 4 and (mode == "kernel" or (mode == "auto" and dtype == torch.bfloat16)))


def cpu_mode(mode: str) -> str:
    """`mode` checked against CPU_MODES."""
    if mode not in CPU_MODES:
        raise TurboError(f"{CPU_MODE_ENV}={mode!r} is not one of {', '.join(CPU_MODES)}")
    return mode


def format_for(code: int | None = None, bits: int | None = None, group: int | None = None,
               name: str = "tensor") -> QFormat:
    """The format a (code) or (bits, group) pair names; TurboError naming the tensor otherwise."""
    if code is not None:
        fmt = BY_CODE.get(code)
        if fmt is None:
            raise TurboError(f"{name}: quantization code {code} is not one of {', '.join(map(str, QUANT_CODES))}")
        if bits is not None and bits != fmt.bits:
            raise TurboError(f"{name}: code {code} is {fmt.bits}-bit, the metadata says bits {bits}")
        if group is not None and group != fmt.group:
            raise TurboError(f"{name}: code {code} uses groups of {fmt.group}, the metadata says group {group}")
        return fmt
    fmt = BY_BITS.get(bits) if bits in BITS_NAMED else None  # type: ignore[arg-type]
    if fmt is None:
        raise TurboError(f"{name}: {bits}-bit quantization is not supported (expected bits 4, 2 or 1)")
    if group != fmt.group:
        raise TurboError(f"{name}: {bits}-bit with group size {group} is not a format an install carries "
                         f"(dtype {fmt.code} is {bits}-bit in groups of {fmt.group})")
    return fmt


def check_shapes(name: str, fmt: QFormat, packed: tuple[int, ...], scales: tuple[int, ...],
                 biases: tuple[int, ...]) -> tuple[int, int]:
    """Validate a packed weight and its companions; returns the logical (out, in)."""
    if len(packed) != 2:
        raise TurboError(f"{name}: packed {fmt.name} weight has shape {list(packed)}, expected rank 2")
    out, words = packed
    cols = words * 32 // fmt.bits
    if cols % fmt.group:
        raise TurboError(f"{name}: group size {fmt.group} does not divide its {cols} columns")
    want = (out, cols // fmt.group)
    if tuple(scales) != want:
        raise TurboError(f"{name}: scales have shape {list(scales)}, expected {list(want)} "
                         f"({out} rows x {cols}/{fmt.group} groups)")
    if tuple(biases) != want:
        raise TurboError(f"{name}: biases have shape {list(biases)}, expected {list(want)} "
                         f"({out} rows x {cols}/{fmt.group} groups)")
    return out, cols


# ---- pack / unpack ------------------------------------------------------------------------


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q [out, in] integer levels in 0..2**bits-1 -> int32 [out, in*bits/32] (uint32 bits)."""
    per = 32 // bits
    out, cols = q.shape
    if cols % per:
        raise TurboError(f"{cols} columns do not fill whole {bits}-bit words ({per} per uint32)")
    if bits in (4, 8) and sys.byteorder == "little":  # the words' own bytes (as _levels reads them)
        b = q.to(torch.uint8, copy=True)
        b = b if bits == 8 else b[:, 0::2] | b[:, 1::2] << 4
        return b.contiguous().view(torch.int32).reshape(out, cols // per)
    shifts = torch.arange(per, dtype=torch.int64) * bits
    words = (q.to(torch.int64).reshape(out, cols // per, per) << shifts).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 (uint32 bits) [out, words] -> uint8 levels [out, words * 32 / bits]."""
    return _levels(packed, bits).to(torch.uint8)


def _levels(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if bits in (4, 8) and sys.byteorder == "little":  # field j at bits j * bits: the words' own bytes
        b = packed.contiguous().view(torch.uint8).reshape(packed.shape[0], -1)
        return b if bits == 8 else torch.stack((b & 15, b >> 4), -1).reshape(packed.shape[0], -1)
    # int32 arithmetic shifts: the mask drops the sign bits the top field drags in
    shifts = torch.arange(32 // bits, dtype=torch.int32, device=packed.device) * bits
    return ((packed[..., None] >> shifts) & ((1 << bits) - 1)).reshape(packed.shape[0], -1)


# ---- quantize / dequantize ----------------------------------------------------------------


def quantize(w: torch.Tensor, fmt: QFormat, name: str = "tensor") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] float -> (packed int32, scales, biases) in the format's storage dtypes."""
    if w.dim() != 2:
        raise TurboError(f"{name}: only rank-2 matrices are quantized, this one has shape {list(w.shape)}")
    out, cols = w.shape
    if cols % fmt.group:
        raise TurboError(f"{name}: group size {fmt.group} does not divide its {cols} columns")
    g = w.float().reshape(out, cols // fmt.group, fmt.group)
    lo, hi = g.amin(-1), g.amax(-1)
    levels = (1 << fmt.bits) - 1
    scales = ((hi - lo) / levels).to(fmt.scale_dtype)
    biases = lo.to(fmt.scale_dtype)
    s, b = scales.float()[..., None], biases.float()[..., None]
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.where(s > 0, torch.round((g - b) / safe), torch.zeros_like(g)).clamp_(0, levels)
    return pack(q.reshape(out, cols), fmt.bits), scales, biases


def dequantize(packed: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int, group: int,
               dtype: torch.dtype = torch.float32, float8: bool = False) -> torch.Tensor:
    """The float matrix [out, in] (computed in fp32, then cast to `dtype`). `float8` (FP8): the
    levels are e4m3 codes, w = bf16(e4m3(q) * scale), biases unused."""
    q = _levels(packed, bits)
    out, cols = q.shape
    if float8:
        v = q.to(torch.uint8).view(torch.float8_e4m3fn).float().reshape(out, cols // group, group)
        return (v * scales.float()[..., None]).to(torch.bfloat16).reshape(out, cols).to(dtype)
    w = q.float().reshape(out, cols // group, group) * scales.float()[..., None] + biases.float()[..., None]
    return w.reshape(out, cols).to(dtype)


@dataclass
class QuantizedRows:
    """An embedding table kept quantized (a GGUF's tied Q8_0 / Q4_x token_embd, whose head the
    products read as stored): a step dequantizes only the rows it embeds, each exactly as the
    whole table's dequantization would give it (the same elementwise arithmetic), where the whole
    table in fp32 would cost seconds at every open and 4 bytes a weight."""

    weight: "QuantizedWeight"
    dtype: torch.dtype  # the rows'
    _dense: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def __getitem__(self, ids) -> torch.Tensor:
        ids = torch.as_tensor(ids)
        flat, w = ids.reshape(-1), self.weight
        rows = dequantize(w.packed[flat], w.scales[flat], w.biases[flat], w.bits, w.group, self.dtype, w.float8)
        return rows.reshape(*ids.shape, rows.shape[-1])

    def dense(self) -> torch.Tensor:
        """The whole table, dequantized once (native code that needs a pointer to rows: a DFlash drafter's)."""
        if self._dense is None:
            self._dense = self.weight.dequantize(self.dtype).contiguous()
        return self._dense


@dataclass
class QuantizedWeight:
    """A packed affine-quantized matrix. `shape` is the logical [out, in]; `dtype` the
    compute dtype ops.linear multiplies in (what `calibrate_rows` keys its padding on)."""

    packed: torch.Tensor  # int32 [out, in*bits/32]
    scales: torch.Tensor  # [out, in/group]
    biases: torch.Tensor
    bits: int
    group: int
    dtype: torch.dtype = torch.float32
    use_kernel: bool = False  # ops.linear multiplies through Int4Kernel (when it probes row-stable)
    _kernel: object = None
    _dense: torch.Tensor | None = None  # use_kernel's fallback: dequantized once
    float8: bool = False  # quant.FP8: the levels are e4m3 codes

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.packed.shape[0], self.packed.shape[1] * 32 // self.bits))

    @property
    def code(self) -> int:
        return BY_BITS[self.bits].code

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self.packed, self.scales, self.biases, self.bits, self.group, dtype or self.dtype,
                          self.float8)

    def to(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized matrix (for code that wants a plain tensor, e.g. the drafter's lm_head)."""
        return self.dequantize(dtype)

    def dense(self) -> torch.Tensor:
        """The matrix ops.linear multiplies by when no kernel runs: per call, or cached once
        when this weight was meant for the kernel and the kernel refused it."""
        if not self.use_kernel:
            return self.dequantize()
        if self._dense is None:
            self._dense = self.dequantize()
        return self._dense

    def kernel(self):
        """The Int4Kernel for this weight, or None where it is not row-stable here (probed once)."""
        if self._kernel is None:
            try:
                k = Int4Kernel(self)
                self._kernel = k if k.row_stable(self.dtype) else False
            except RuntimeError:  # shapes the kernel does not take (rows not a multiple of 16, ...)
                self._kernel = False
        return self._kernel or None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.biases))


def fuse(parts: list) -> torch.Tensor | QuantizedWeight:
    """Row-concatenate matrices (the trunk's qkv|z|b|a, q|k|v, gate|up fusions). Packed parts
    of one format fuse packed (groups run along the input dim, so rows concatenate as-is);
    a mix of formats or of packed and float parts falls back to float."""
    if len(parts) == 1:
        return parts[0]
    if not any(isinstance(p, QuantizedWeight) for p in parts):
        return torch.cat(parts)
    first = parts[0]
    if all(isinstance(p, QuantizedWeight) and (p.bits, p.group, p.scales.dtype, p.dtype, p.float8)
           == (first.bits, first.group, first.scales.dtype, first.dtype, first.float8) for p in parts):
        return QuantizedWeight(torch.cat([p.packed for p in parts]), torch.cat([p.scales for p in parts]),
                               torch.cat([p.biases for p in parts]), first.bits, first.group, first.dtype,
                               all(p.use_kernel for p in parts), float8=first.float8)
    dtype = next(p.dtype for p in parts if isinstance(p, QuantizedWeight))
    return torch.cat([p.dequantize() if isinstance(p, QuantizedWeight) else p.to(dtype) for p in parts])


# ---- CPU matmul paths (scripts/bench_quant.py measures them) ------------------------------


def linear_dequant(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """Dequantize per call, then one GEMM (what ops.linear does with a QuantizedWeight)."""
    return torch.nn.functional.linear(x.to(w.dtype), w.dequantize()).float()


def rows_stand_alone(mm, xs: torch.Tensor) -> bool:
    """Whether every row of mm(xs[:m]), for m = 2..len(xs), equals mm of that row alone (the
    row-stability probe `ops.calibrate_rows` and `Int4Kernel.row_stable` both run)."""
    alone = [mm(xs[i:i + 1])[0] for i in range(xs.shape[0])]
    return all(torch.equal(mm(xs[:m])[i], alone[i]) for m in range(2, xs.shape[0] + 1) for i in range(m))


class Int4Kernel:
    """The integer path: torch's packed-int4 CPU GEMM (int4 only; w = (q - 8) * s + zero
    with zero = bias + 8 s), activations in the scales' dtype. Not row-stable by contract:
    `row_stable` probes it on this weight before the forward trusts it."""

    def __init__(self, w: QuantizedWeight):
        if w.bits != 4:
            raise TurboError("the int4 kernel takes 4-bit weights only")
        q = unpack(w.packed, 4).to(torch.int32)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        s, b = w.scales.float(), w.biases.float()
        self.sz = torch.stack([s, b + 8 * s], -1).transpose(0, 1).contiguous()
        self.group = w.group
        self.dtype = torch.float32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(self.dtype).contiguous(), self.packed, self.group,
                                                           self.sz).float()

    def row_stable(self, dtype: torch.dtype, max_rows: int = 9, seed: int = 0) -> bool:
        """Every row of a 1..max_rows-row call equals the same row computed alone."""
        self.dtype = dtype
        self.sz = self.sz.to(dtype)
        g = torch.Generator().manual_seed(seed)
        return rows_stand_alone(self, torch.randn(max_rows, self.sz.shape[0] * self.group, generator=g))
