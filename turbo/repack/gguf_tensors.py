"""One GGUF tensor into install tensors: `decode` reads it as floats or as affine groups of 32
(`Affine`: Q8_0, Q4_0, Q4_1 and Q4_K exactly), the inverses of llama.cpp's converter transforms
run on that form (`Inverse`), and `plan_gguf` gives the Planned parts, carried exactly in turbo's
group-32 formats (quant.GGUF_FORMATS), as floats, or re-quantized (docs/formats.md, GGUF)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ..errors import TurboError
from ..store import quant as q
from .tensors import Planned, _tensor_bytes, quantizable

FLOAT_TYPES = {"F32": (np.float32, 4), "F16": (np.float16, 2), "BF16": (np.uint16, 2)}  # carried as they are
EXACT_TYPES = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q4_K": 4}  # affine per 32 columns: carried exactly
GROUP = 32
EMBED = "trunk.embed_tokens.weight"


@dataclass
class Affine:
    """w[r, c] = levels[r, c] * scales[r, c // 32] + biases[r, c // 32], in fp32: the product is
    exact (a 4/8-bit level times an f16 scale, or Q4_K's f16 d times a 6-bit scale), so the one
    rounding is the sum's, as in gguf.quants.dequantize."""

    levels: torch.Tensor  # uint8 [rows, cols]
    scales: torch.Tensor  # fp32 [rows, cols / 32]
    biases: torch.Tensor
    bits: int

    def dense(self) -> torch.Tensor:
        rows, cols = self.levels.shape
        w = self.levels.float().reshape(rows, cols // GROUP, GROUP) * self.scales[..., None] + self.biases[..., None]
        return w.reshape(rows, cols)

    def take_rows(self, idx: torch.Tensor) -> Affine:
        return Affine(self.levels[idx], self.scales[idx], self.biases[idx], self.bits)


Decoded = torch.Tensor | Affine


def _f16(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16).astype(np.float32))


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32] levels: low nibbles first, then high (ggml's Q4 order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _affine(raw: np.ndarray, kind: str, rows: int, cols: int) -> Affine:
    """The blocks of an exact type as levels, scales and biases per 32 columns (ggml-common.h's
    block layouts, as gguf.quants reads them)."""
    import gguf  # optional (pip install gguf): only GGUF sources need it, gguf._open says so

    if kind == "Q4_K":
        b = raw.reshape(-1, 144)
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, m = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
        scales = d * torch.from_numpy(sc.astype(np.float32))  # exact in fp32: 11 x 6 bits
        biases = -(dmin * torch.from_numpy(m.astype(np.float32)))
        qs = b[:, 16:].reshape(-1, 4, 32)  # sub-blocks 2j, 2j+1: low, high nibbles of 32 bytes
        levels = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8 * 32)
    else:
        size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[kind]
        b = raw.reshape(-1, size)
        scales = _f16(b[:, 0:2])
        if kind == "Q8_0":
            levels = b[:, 2:] ^ 0x80  # the int8 q as q + 128 (one byte a weight, no wider copy)
            biases = scales * -128.0
        elif kind == "Q4_0":
            levels, biases = _nibbles(b[:, 2:]), scales * -8.0
        else:
            levels, biases = _nibbles(b[:, 4:]), _f16(b[:, 2:4])
    return Affine(torch.from_numpy(np.ascontiguousarray(levels)).reshape(rows, cols),
                  scales.reshape(rows, cols // GROUP).contiguous(), biases.reshape(rows, cols // GROUP).contiguous(),
                  EXACT_TYPES[kind])


def decode(tensor, rows: slice | None = None) -> Decoded:
    """A GGUF tensor (gguf.ReaderTensor) as a rank-2 (or rank-1) float tensor or `Affine`,
    `rows` of its leading 2-D view only (an expert out of a stack)."""
    import gguf  # optional (pip install gguf): only GGUF sources need it, gguf._open says so

    kind = tensor.tensor_type.name
    shape = [int(n) for n in reversed(tensor.shape.tolist())]  # ggml's ne, reversed: torch's order
    cols = shape[-1]
    raw = np.asarray(tensor.data)
    if len(shape) > 1:
        raw = raw.reshape(int(np.prod(shape[:-1])), -1)
        if rows is not None:
            raw = raw[rows]
    n_rows = raw.shape[0] if len(shape) > 1 else 1
    if kind in FLOAT_TYPES:
        t = torch.from_numpy(np.ascontiguousarray(raw).view(FLOAT_TYPES[kind][0]).copy())
        t = t.view(torch.bfloat16) if kind == "BF16" else t
        return t.reshape(n_rows, cols) if len(shape) > 1 else t.reshape(cols)
    if kind in EXACT_TYPES:
        return _affine(np.ascontiguousarray(raw).view(np.uint8), kind, n_rows, cols)
    w = gguf.quants.dequantize(np.ascontiguousarray(raw), tensor.tensor_type)
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).reshape(n_rows, cols)


def _dense(d: Decoded) -> torch.Tensor:
    return d.dense() if isinstance(d, Affine) else d.float()


@dataclass
class Inverse:
    """The inverse of the converter's transforms for one tensor, in order: row order, column
    order (in units of `col_unit` columns), an elementwise function (fp32), a final shape."""

    row_idx: torch.Tensor | None = None
    col_idx: torch.Tensor | None = None
    col_unit: int = 1
    elementwise: Callable[[torch.Tensor], torch.Tensor] | None = None
    shape: list[int] | None = None

    def keeps_groups(self) -> bool:
        """Whether the result is still affine per 32 columns (else it is dequantized, exactly)."""
        return self.elementwise is None and (self.col_idx is None or self.col_unit % GROUP == 0)

    def __call__(self, d: Decoded) -> Decoded:
        if isinstance(d, Affine) and not self.keeps_groups():
            d = d.dense()
        if self.row_idx is not None:
            d = d.take_rows(self.row_idx) if isinstance(d, Affine) else d[self.row_idx]
        if self.col_idx is not None:
            if isinstance(d, Affine):
                per = self.col_unit // GROUP
                groups = (self.col_idx[::self.col_unit, None] // GROUP + torch.arange(per)).reshape(-1)
                d = Affine(d.levels[:, self.col_idx], d.scales[:, groups], d.biases[:, groups], d.bits)
            else:
                d = d[:, self.col_idx]
        if self.elementwise is not None:
            d = self.elementwise(d.float())
        if self.shape is not None and not isinstance(d, Affine):
            d = d.reshape(self.shape)
        return d


@dataclass
class Requant:
    """Tensors of types turbo's formats do not hold exactly, re-quantized to `fmt`: the worst
    max abs error against gguf's dequantization, by source type."""

    fmt: q.QFormat | None
    floats: q.QFormat | None = None  # repack --float-quant: the float matrices' format
    worst: dict[str, float] = field(default_factory=dict)


class _Job:
    """Decodes and converts one tensor when its first part is written; hands out the parts."""

    def __init__(self, make: Callable[[], list[bytes]]):
        self.make, self.parts = make, None

    def writer(self, i: int, last: int) -> Callable[[object], None]:
        def write(out) -> None:
            if self.parts is None:
                self.parts = self.make()
            out.write(self.parts[i])
            self.parts[i] = b""
            if i == last:
                self.parts = None
        return write


def plan_gguf(name: str, tensor, shape: list[int], inverse: Inverse, requant: Requant, quantized: dict[str, dict],
              rows: slice | None = None) -> list[Planned]:
    """The install tensor(s) `name` of shape `shape` made from `tensor` (`rows` of it)."""
    kind = tensor.tensor_type.name
    meta = {"dtype": "F32", "shape": shape}
    matrix = len(shape) == 2 and quantizable(name, meta, q.GGUF_FORMATS["int8g32"])  # turbo's rule: projections
    n = int(np.prod(shape))

    def convert() -> Decoded:
        return inverse(decode(tensor, rows))

    # the embedding too, carried exactly: a tied head then reads the source's own codes (at 0.8B the
    # head is a third of a step's bytes: Q8_0 as int8g32 reads 0.27 GB, as fp32 1 GB)
    if kind in EXACT_TYPES and (matrix or name == EMBED and len(shape) == 2) and inverse.keeps_groups():
        fmt = q.GGUF_FORMATS["int4g32" if EXACT_TYPES[kind] == 4 else "int8g32"]

        def make() -> list[bytes]:
            a = convert()
            return [_tensor_bytes(q.pack(a.levels, a.bits)), _tensor_bytes(a.scales),
                    _tensor_bytes(a.biases)]
        return _parts(name, shape, fmt, make, quantized)
    if kind in FLOAT_TYPES and matrix and requant.floats is not None and shape[1] % requant.floats.group == 0:
        return _parts(name, shape, requant.floats, lambda: [_tensor_bytes(t) for t in q.quantize(
            _dense(convert()).reshape(shape), requant.floats, name)], quantized)
    if kind in FLOAT_TYPES and inverse.elementwise is None:
        job = _Job(lambda: [_tensor_bytes(convert())])
        return [Planned(name, kind, shape, n * FLOAT_TYPES[kind][1], job.writer(0, 0))]
    if kind not in EXACT_TYPES and kind not in FLOAT_TYPES and matrix:
        if requant.fmt is None:
            raise TurboError(f"{name}: stored as {kind}")  # repack/gguf.py names every such type at once
        fmt = requant.fmt
        if shape[1] % fmt.group == 0:
            def make() -> list[bytes]:
                w = _dense(convert())
                parts = q.quantize(w, fmt, name)
                err = (q.dequantize(*parts, fmt.bits, fmt.group) - w).abs().max().item()
                requant.worst[kind] = max(requant.worst.get(kind, 0.0), err)
                return [_tensor_bytes(t) for t in parts]
            return _parts(name, shape, fmt, make, quantized)
    job = _Job(lambda: [_tensor_bytes(_dense(convert()).reshape(shape))])  # exact: gguf's dequantization
    return [Planned(name, "F32", shape, n * 4, job.writer(0, 0))]


def _parts(name: str, shape: list[int], fmt: q.QFormat, make: Callable[[], list[bytes]],
           quantized: dict[str, dict]) -> list[Planned]:
    rows, cols = shape
    groups, sb = cols // fmt.group, torch.tensor([], dtype=fmt.scale_dtype).element_size()
    job = _Job(make)
    quantized[name] = {"code": fmt.code, "group": fmt.group, "bits": fmt.bits}
    return [Planned(name, "U32", [rows, cols * fmt.bits // 32], rows * cols * fmt.bits // 8, job.writer(0, 2)),
            Planned(name + ".scales", fmt.scale_st, [rows, groups], rows * groups * sb, job.writer(1, 2)),
            Planned(name + ".biases", fmt.scale_st, [rows, groups], rows * groups * sb, job.writer(2, 2))]
