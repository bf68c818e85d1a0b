"""The native CPU step -- native.c (the trunk's step, the MTP head's layer, the packed
products), native_moe.c (the MoE block) and native_dflash.c (the DFlash pass, both
architectures) -- compiled once per machine with the host's C compiler, and every ctypes declaration and call into it.

`library(cache_dir)` returns the loaded library, or None when it cannot be had (no compiler,
a failed build); `why_not()` says why. Whether a part runs here is the loader's choice
(turbo/loader.py); where it does not, the torch step (turbo/backends/torch_step.py) runs, just
as lossless, only slower. The build goes to a per-user cache, keyed by the source, the
compiler and the machine, and is renamed into place whole, so parallel jobs (a Hydra
multirun) never load a half-written file.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

import torch

from .. import quant
from ..errors import TurboError
from .step import GdnTrace, StepOut, TrunkState

# native.c: the trunk's step; native_*.c: further parts (built into the same library)
SOURCES = sorted(Path(__file__).parent.glob("native*.c"))
HEADER = Path(__file__).with_name("native.h")  # what they share
# No -ffast-math: the row-stability argument in native.c needs sums in program order.
# -fopenmp: the library then shares the libgomp torch has loaded (native.c, set_threads).
FLAGS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-fopenmp"], ["-O3", "-march=native"], ["-O3"])

_lib: ctypes.CDLL | None = None
_why: str | None = None
_tried = False


class Moe(ctypes.Structure):
    """native.h's Moe: one layer's mixture of experts (pointers to packed matrices) and sizes."""

    _fields_ = [(name, ctypes.c_int) for name in (
        "experts", "top_k", "inter", "shared_inter", "norm_topk", "wtype", "ewtype")] + [
        ("router", ctypes.c_void_p), ("gate_up", ctypes.POINTER(ctypes.c_void_p)),
        ("down", ctypes.POINTER(ctypes.c_void_p)),
        ("shared_gate_up", ctypes.c_void_p), ("shared_down", ctypes.c_void_p), ("shared_gate", ctypes.c_void_p)]


class Layer(ctypes.Structure):
    """native.h's Layer: one trunk layer's weights (pointers) and sizes."""

    _fields_ = [
        ("hidden", ctypes.c_int), ("inter", ctypes.c_int), ("wtype", ctypes.c_int), ("eps", ctypes.c_float),
        ("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("gate_up", ctypes.c_void_p),
        ("down", ctypes.c_void_p),
        ("in_proj", ctypes.c_void_p), ("out", ctypes.c_void_p), ("conv", ctypes.c_void_p),
        ("neg_a", ctypes.c_void_p), ("dt_bias", ctypes.c_void_p), ("gnorm", ctypes.c_void_p),
        ("kheads", ctypes.c_int), ("kdim", ctypes.c_int), ("vheads", ctypes.c_int), ("vdim", ctypes.c_int),
        ("taps", ctypes.c_int),
        ("qkv", ctypes.c_void_p), ("o", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p), ("inv_freq", ctypes.c_void_p),
        ("heads", ctypes.c_int), ("kv_heads", ctypes.c_int), ("head_dim", ctypes.c_int), ("rot", ctypes.c_int),
        ("kv_type", ctypes.c_int),
        ("moe", ctypes.POINTER(Moe)),
    ]


class DfLayer(ctypes.Structure):
    """native.h's DfLayer: one DFlash layer's weights and its context ring (pointers)."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "in_norm", "post_norm", "q_norm", "k_norm", "q", "k", "v", "o", "gate", "up", "down",
        "attn_proj", "mlp_proj", "attn_base", "mlp_base", "ring_k", "ring_v")]


class Dflash(ctypes.Structure):
    """native.h's Dflash: the drafter's sizes, scaling and weights (pointers)."""

    _fields_ = [(name, ctypes.c_int) for name in (
        "hidden", "heads", "kv_heads", "head_dim", "inter", "taps", "group", "aux_width", "vocab", "layers",
        "window", "capacity", "causal", "mask_token", "embed_wtype", "embed_panels", "conv", "wtype", "lm_wtype")] + [
        ("eps", ctypes.c_float), ("res_eps", ctypes.c_float), ("scale", ctypes.c_float)] + [
        (name, ctypes.c_void_p) for name in ("embed", "fc", "lm_head", "hidden_norm", "final_norm", "inv_freq")] + [
        ("layer", ctypes.POINTER(DfLayer))]


STRUCTS = (Layer, Dflash, DfLayer, Moe)  # native.c's struct_size(0, 1, 2, 3)

WTYPES = {torch.float32: 0, torch.bfloat16: 1}

# native.c's entry points: p a pointer (a Layer's address too), i an int, f a float
SIGNATURES = {
    "linear_packed": "p i i p i i p",
    "dot_products": "",
    "struct_size": "i",
    "set_threads": "i",
    "gdn_layer": "p p i p p p p p p",
    "embed_rows": "p i i p i i p",
    "copy_rows": "p i i p i",
    "attn_layer": "p p i i i p p i",
    "head": "p i i p f p i i p p",
    "gdn_recurrence": "p p i i i i p p p p p p p",
    "dflash_forward": "p i i i p p",
    "dflash_add_context": "p p i i",
    "dflash_select": "p p i i i p i p p i i p",
    "argmax_row": "p i",
}
RETURNS_INT = {"dot_products", "struct_size", "argmax_row"}  # (the rest return nothing)
_C = {"p": ctypes.c_void_p, "i": ctypes.c_int, "f": ctypes.c_float}


def _build(cc: str, cache_dir: Path | None) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(b"".join(src.read_bytes() for src in [*SOURCES, HEADER]) + " ".join(map(str, FLAGS)).encode()
                         + version.encode() + platform.machine().encode() + platform.node().encode()).hexdigest()[:16]
    errors = []
    for dest_dir in (cache_dir or Path.home() / ".cache" / "turbo", Path(tempfile.gettempdir()) / "turbo-native"):
        target = dest_dir / f"native-{key}.so"
        if target.exists():
            return target
        try:
            dest_dir.mkdir(parents=True, exist_ok=True)
            for flags in FLAGS:
                fd, tmp = tempfile.mkstemp(suffix=".so", dir=dest_dir)
                os.close(fd)
                done = subprocess.run([cc, *flags, "-shared", "-fPIC", "-o", tmp, *map(str, SOURCES), "-lm"],
                                      capture_output=True, text=True)
                if done.returncode == 0:
                    os.replace(tmp, target)
                    return target
                os.unlink(tmp)
                errors.append(done.stderr.strip().splitlines()[-1:] or ["failed"])
        except OSError as e:
            errors.append([str(e)])
    raise RuntimeError(f"{cc} could not build {' '.join(s.name for s in SOURCES)}: "
                       f"{errors[-1][0] if errors else 'unknown'}")


def _struct_mismatch(lib: ctypes.CDLL) -> str | None:
    """ctypes' layouts against the compiler's: a mismatch means the Python mirror of native.h
    went stale (a build bug), and every call would read fields at the wrong offsets."""
    for which, struct in enumerate(STRUCTS):
        c_size = lib.struct_size(which)
        if c_size != ctypes.sizeof(struct):
            return (f"native.h's {struct.__name__} is {c_size} bytes, its ctypes mirror in "
                    f"turbo/backends/native.py {ctypes.sizeof(struct)}: the two disagree")
    return None


def library(cache_dir: Path | None = None, compiler: str | None = None) -> ctypes.CDLL | None:
    """The library, built (with `compiler`, default cc / gcc / clang on PATH, into `cache_dir`,
    default ~/.cache/turbo) and loaded once per process: a later call's arguments are not looked at."""
    global _lib, _why, _tried
    if not _tried:
        _tried = True
        cc = compiler or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
        try:
            if cc is None:
                raise RuntimeError("no C compiler on PATH (set CC)")
            lib = ctypes.CDLL(str(_build(cc, cache_dir)))
            for name, args in SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes = [_C[a] for a in args.split()]
                fn.restype = ctypes.c_int if name in RETURNS_INT else None
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            _why = str(e)
            return None
        _why = _struct_mismatch(lib)
        if _why is not None:  # a build bug, not a reason to fall back quietly
            raise RuntimeError(_why)
        _lib = lib
    return _lib


_threads = 0


def threaded() -> ctypes.CDLL:
    """library(), its matrix products split over torch's intra-op thread count (checked
    on every call: `threads=` or torch.set_num_threads may change it)."""
    global _threads
    lib = _lib
    n = torch.get_num_threads()
    if n != _threads:
        lib.set_threads(n)
        _threads = n
    return lib


def why_not() -> str | None:
    """Why the library cannot be had (None when it can)."""
    library()
    return _why


def ptr(t: torch.Tensor | Packed | None) -> int | None:
    """A contiguous tensor's (or packed matrix's) data pointer for a ctypes call (None for NULL)."""
    if t is None:
        return None
    if isinstance(t, Packed):
        t = t.data
    assert t.is_contiguous() and t.device.type == "cpu"
    return t.data_ptr()


PANEL = 16  # outputs per panel of a packed matrix (native.c: one vector register)


@dataclasses.dataclass
class Packed:
    """A matrix w [n, k] laid out as native.c's products read it (`layout`):
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
      packed, `quantized_panels`.
    The last three are not the fp32 function: "pairs" and "int8" are for drafters, "q4" and "q8"
    (the trunk's quantized installs) round the inputs to 8 bits per group of 64."""

    data: torch.Tensor
    n: int
    k: int
    layout: str = "panels"

    @property
    def wtype(self) -> int:
        return {"pairs": 2, "int8": 3, "q4": 4, "q8": 5, "panel_pairs": 6}.get(self.layout) or WTYPES[self.data.dtype]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def dense(self) -> torch.Tensor:
        """The [n, k] matrix back (a copy; int8: the dequantised values)."""
        n_pad = -(-self.n // PANEL) * PANEL
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
    """An affine int4 / int8 matrix (groups of 64) as native.c's qtile reads it: per panel of 16
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


# A drafter's products on the CPU (`draft_products`): the packed layout each names
DRAFT_PRODUCTS = {"fp32": "panels", "bf16": "pairs", "int8": "int8"}
_NEEDS = {"pairs": "AVX512-BF16", "int8": "AVX512-VNNI"}


def dot_layouts() -> tuple[str, ...]:
    """The drafters' layouts the library can multiply by ("pairs": AVX512-BF16; "int8":
    AVX512-VNNI), empty without the library."""
    lib = library()
    bits = lib.dot_products() if lib is not None else 0
    return tuple(name for bit, name in ((1, "pairs"), (2, "int8")) if bits & bit)


def check_draft_products(products: str) -> None:
    if products != "auto" and products not in DRAFT_PRODUCTS:
        raise TurboError(f"draft_products {products!r} is not one of auto, {', '.join(DRAFT_PRODUCTS)}")


def draft_layout(products: str) -> str:
    """The layout a drafter's matrices take for `products`: "auto" is the fastest this CPU
    has (int8, then bf16, then fp32: on the tiny install int8 lands as many proposals as
    fp32 in about two thirds of its time, see README); a named one it lacks is refused."""
    check_draft_products(products)
    have = dot_layouts()
    if products == "auto":
        return next((lay for lay in ("int8", "pairs") if lay in have), "panels")
    layout = DRAFT_PRODUCTS[products]
    if layout != "panels" and layout not in have:
        raise TurboError(f"draft_products {products}: "
                         + (f"the native library is not in use ({why_not()})" if library() is None
                            else f"this CPU has no {_NEEDS[layout]} (expected auto or fp32)"))
    return layout


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
        return quantized_panels(w) if native_bits(w) else pack(fp32_matrix(w))
    return pack(w.to(torch.bfloat16 if layout == "pairs" else storage), layout)


def linear_packed(x: torch.Tensor, w: Packed) -> torch.Tensor:
    """x [R, k] @ w^T in fp32 (bf16 weights widened exactly; the drafters' "pairs" and "int8"
    layouts: bf16 or int8 dot products); row-stable by construction."""
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], w.n)
    threaded().linear_packed(x.data_ptr(), x.shape[0], w.k, w.data.data_ptr(), w.wtype, w.n, y.data_ptr())
    return y


def argmax(row: torch.Tensor) -> int:
    """torch.argmax of a contiguous fp32 row [n] on the CPU (the first of equals; a NaN wins)."""
    return _lib.argmax_row(row.data_ptr(), row.shape[0])


# ---- the steps ----------------------------------------------------------------------------

# Rows per call of the native prefill: its working set (activations [chunk, ...], attention
# scores [chunk, heads, prompt]) is bounded by it, and every matrix is read once per chunk.
PREFILL_CHUNK = 256


def pack_layer(layer, dtype: torch.dtype, layout: str = "panels") -> None:
    """A trunk-shaped layer's (turbo.trunk.LayerWeights) matrices into `layout` (panels: in
    `dtype`), in place (ops.linear takes them too). The layer's products share one wtype: a
    layer of one native quantized format is read packed; any other mix of quantized matrices
    runs all of them in fp32 (bf16 widened exactly, the quantized ones dequantized at load)."""
    m = layer.mixer
    slots = [(m, "in_proj"), (m, "out")] if layer.gdn else [(m, "qkv"), (m, "o")]
    if layer.moe is None:
        slots += [(layer, "gate_up"), (layer, "down")]
    kinds = {native_bits(getattr(owner, name)) for owner, name in slots}
    mixed = any(isinstance(getattr(owner, name), quant.QuantizedWeight) for owner, name in slots) and (
        len(kinds) > 1 or None in kinds)
    for owner, name in slots:
        w = getattr(owner, name)
        if mixed:
            w, dtype, layout = fp32_matrix(w), torch.float32, "panels"
        setattr(owner, name, pack_as(w, dtype, layout))
    if layer.moe is None:
        return
    e = layer.moe  # native_moe.c reads the whole block in one wtype (the router's): float matrices

    def one(w):
        return pack_as(fp32_matrix(w) if isinstance(w, quant.QuantizedWeight) else w, dtype, layout)

    e.router, e.gate_up, e.down = one(e.router), [one(w) for w in e.gate_up], [one(w) for w in e.down]
    if e.shared_gate_up is not None:
        e.shared_gate_up, e.shared_down, e.shared_gate = (one(w) for w in (e.shared_gate_up, e.shared_down,
                                                                             e.shared_gate))


def moe_struct(a, moe) -> Moe:
    """native.h's Moe for one packed MoE block (ctypes keeps its pointer arrays alive with it)."""
    gate_up = (ctypes.c_void_p * len(moe.gate_up))(*(ptr(w) for w in moe.gate_up))
    down = (ctypes.c_void_p * len(moe.down))(*(ptr(w) for w in moe.down))
    s = Moe(experts=a.num_experts, top_k=a.experts_per_token, inter=a.moe_intermediate,
            shared_inter=a.shared_intermediate if moe.shared_gate_up is not None else 0,
            norm_topk=a.norm_topk_prob, wtype=moe.router.wtype, ewtype=moe.gate_up[0].wtype, router=ptr(moe.router),
            gate_up=gate_up, down=down, shared_gate_up=ptr(moe.shared_gate_up), shared_down=ptr(moe.shared_down),
            shared_gate=ptr(moe.shared_gate))
    return s


def reads_packed(bits: int, group: int) -> bool:
    """Whether the native step's products read a matrix of this affine format packed (int4 / int8
    in groups of 64, where the CPU has the int8 dot products)."""
    return bits in QUANTIZED.values() and group == quant.GROUP and "int8" in dot_layouts()


def native_bits(w) -> int | None:
    """A matrix's bits where the native step reads it packed (None: a float matrix, or another format)."""
    return w.bits if isinstance(w, quant.QuantizedWeight) and reads_packed(w.bits, w.group) else None


def fp32_matrix(w) -> torch.Tensor:
    """A float or quantized matrix as an fp32 tensor (a quantized one dequantized)."""
    return w.dequantize(torch.float32) if isinstance(w, quant.QuantizedWeight) else w.float()


def quantized_copy(w: torch.Tensor, bits: int, rows: int = 16384) -> Packed:
    """w quantized to the native format of `bits` and packed, `rows` at a time (a vocab-sized
    lm_head in fp32 at once would be several times its size)."""
    fmt = quant.BY_BITS[bits]
    return _panels_by_slices(*w.shape, bits, rows, lambda r0, r1: _panels_of(*quant.quantize(w[r0:r1], fmt), bits,
                                                                             w.shape[1]))


def layer_struct(a, layer, inv_freq: torch.Tensor, kv_dtype: torch.dtype) -> Layer:
    """native.c's struct for one packed layer, an attention layer's K/V cache in `kv_dtype`
    (its tensors must outlive it: it holds pointers)."""
    m = layer.mixer
    s = Layer(hidden=a.hidden, inter=a.intermediate, wtype=(m.in_proj if layer.gdn else m.qkv).wtype, eps=a.rms_eps,
              in_norm=ptr(layer.in_norm), post_norm=ptr(layer.post_norm),
              gate_up=ptr(layer.gate_up), down=ptr(layer.down))
    if layer.moe is not None:
        s.moe = ctypes.pointer(moe_struct(a, layer.moe))
    if layer.gdn:
        s.in_proj, s.out, s.conv = ptr(m.in_proj), ptr(m.out), ptr(m.conv)
        s.neg_a, s.dt_bias, s.gnorm = ptr(m.neg_a), ptr(m.dt_bias), ptr(m.norm)
        s.kheads, s.kdim, s.vheads, s.vdim, s.taps = a.lin_k_heads, a.lin_k_dim, a.lin_v_heads, a.lin_v_dim, a.conv_kernel
    else:
        s.qkv, s.o, s.q_norm, s.k_norm, s.inv_freq = ptr(m.qkv), ptr(m.o), ptr(m.q_norm), ptr(m.k_norm), ptr(inv_freq)
        s.heads, s.kv_heads, s.head_dim, s.rot = a.num_heads, a.num_kv_heads, a.head_dim, a.rotary_dim
        s.kv_type = WTYPES[kv_dtype]
    return s


def trunk_refusal(device: torch.device, dtype: torch.dtype, quantized_kept: bool) -> str | None:
    """Why the trunk's step cannot run here (None: it can, the library built): on the CPU,
    with every matrix a plain fp32 or bf16 one or one its products read packed
    (`quantized_kept`: some stay packed quantized in another format).
    Asked before any weight loads: the native step's matrices are packed as they are read."""
    if device.type != "cpu":
        return f"the trunk runs on {device.type}"
    if quantized_kept:
        return "packed quantized matrices"
    if dtype not in WTYPES:
        return f"matrices in {str(dtype).removeprefix('torch.')}"
    return None


def spare(st: TrunkState, key: tuple, rows: int, held: torch.Tensor) -> torch.Tensor:
    """`rows` GDN states [rows, Hv, dk, dv] for a step of sequence `st` to write, from two
    buffers it keeps per `key`: the one `held` (the state the step reads, which its trace keeps
    as the snapshot) does not lie in. Fresh ones (1 MB a layer and row at 0.8B: ~140 MB per
    9-row verify) come back from the allocator as new pages the kernel zeroes first, a second
    write of every checkpoint; so a step's states and checkpoints live until this sequence's
    next step, as a trace is used."""
    pair = st.scratch.setdefault(key, [None, None])
    base = held.untyped_storage().data_ptr()
    j = next(j for j, buf in enumerate(pair) if buf is None or buf.untyped_storage().data_ptr() != base)
    if pair[j] is None or pair[j].shape[0] < rows:
        pair[j] = torch.empty(rows, *held.shape)
    return pair[j][:rows]


class NativeTrunkStep:
    """The trunk's step through native.c: one call per layer, the torch step's contract and
    traces. A step is short (a fraction of a millisecond), so the Python here is kept to a
    few buffers per layer and raw pointers (the layers' structs built once, here).
    The trunk arrives packed (turbo/loader.py packs each matrix as it reads it)."""

    name = "native"

    def __init__(self, trunk):
        self.trunk = trunk
        self.structs = [layer_struct(trunk.arch, layer, trunk.inv_freq, trunk.kv_dtype) for layer in trunk.layers]
        self.addresses = [ctypes.addressof(s) for s in self.structs]

    def step(self, st: TrunkState, tokens: list[int], aux_layers: tuple[int, ...],
             rollback: str | None) -> StepOut:
        x, aux, traces = self._rows(st, tokens, aux_layers, rollback)
        return StepOut(self._head(x), x, aux, traces)

    def prefill(self, st: TrunkState, tokens: list[int], aux_layers: tuple[int, ...], want_logits: bool) -> StepOut:
        """The prompt as steps of PREFILL_CHUNK rows: each a verify-sized call (its rows equal
        decode steps), so the working set is one chunk's (attention scores [chunk, heads,
        prompt], no [prompt, prompt] matrix) and the lm_head runs only where logits are asked."""
        parts = [self._rows(st, tokens[c:c + PREFILL_CHUNK], aux_layers, None)
                 for c in range(0, len(tokens), PREFILL_CHUNK)]
        x = torch.cat([p[0] for p in parts])
        aux = torch.cat([p[1] for p in parts]) if parts[0][1] is not None else None
        return StepOut(self._head(x if want_logits else x[-1:]), x, aux)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        t, a = self.trunk, self.trunk.arch
        logits = torch.empty(x.shape[0], a.vocab)
        threaded().head(x.data_ptr(), x.shape[0], a.hidden, t.final_norm.data_ptr(), a.rms_eps,
                        t.lm_head.data.data_ptr(), t.lm_head.wtype, a.vocab, logits.data_ptr(), None)
        return logits

    def _rows(self, st: TrunkState, tokens: list[int], aux_layers: tuple[int, ...], rollback: str | None):
        """R rows through every layer: (the residual stream x [R, H], aux, traces)."""
        t = self.trunk
        a, lib = t.arch, threaded()
        rows, p0 = len(tokens), st.pos
        if not 0 <= min(tokens) <= max(tokens) < a.vocab:  # the C reads the rows it is given
            raise ValueError(f"a token of {tokens} is not an id in 0..{a.vocab - 1}")
        t.reserve(st, p0 + rows)
        x = torch.empty(rows, a.hidden)  # [R, H]: the residual stream, updated in place layer by layer
        xp = x.data_ptr()
        lib.embed_rows(*table_of(t.embed), (ctypes.c_int * rows)(*tokens), rows, a.hidden, xp)
        taps, conv_dim = a.conv_kernel, a.lin_conv_dim
        hv, dk, dv = a.lin_v_heads, a.lin_k_dim, a.lin_v_dim
        slot = {layer: j for j, layer in enumerate(sorted(aux_layers))}  # in layer order, as the torch step cats them
        aux = torch.empty(rows, len(slot) * a.hidden) if slot else None
        traces = {}
        for i, address in enumerate(self.addresses):
            if i in st.gdn:
                state, window = st.gdn[i]
                new_state, ext = spare(st, ("state", i), 1, state)[0], torch.empty(taps - 1 + rows, conv_dim)
                inputs = torch.empty(rows * hv * (2 * dk + dv + 2))  # q, k, v, g, beta (native.c)
                # the states after rows 0..R-2 (after the last: new_state)
                states = spare(st, ("states", i), rows - 1, state) if rollback == "checkpoint" else None
                lib.gdn_layer(address, xp, rows, state.data_ptr(), new_state.data_ptr(), window.data_ptr(),
                              ext.data_ptr(), inputs.data_ptr(), ptr(states) if rows > 1 else None)
                window = ext[rows:]  # [taps-1, C]: a view that keeps all of ext [taps-1+R, C] alive
                if rollback is None and rows >= taps:  # (a prefill chunk's ext: 6 MB a layer at 0.8B)
                    window = window.clone()
                st.gdn[i] = (new_state, window)
                if rollback is not None:
                    traces[i] = GdnTrace(state, ext, self._inputs(inputs, rows) if rollback == "replay" else None,
                                         [*states.unbind(0), new_state] if states is not None else None)
            else:
                kc, vc = st.kv[i]
                lib.attn_layer(address, xp, rows, p0, 0, kc.data_ptr(), vc.data_ptr(), kc.shape[1])
            if i in slot:
                lib.copy_rows(xp, rows, a.hidden, aux.data_ptr() + 4 * slot[i] * a.hidden, len(slot) * a.hidden)
        st.pos = p0 + rows
        return x, aux, traces

    def _inputs(self, flat: torch.Tensor, rows: int) -> tuple[torch.Tensor, ...]:
        """native.c's recurrence inputs of `rows` rows, as the trace's q, k, v, g, beta."""
        a = self.trunk.arch
        hv, dk, dv = a.lin_v_heads, a.lin_k_dim, a.lin_v_dim
        q, k, v, g, beta = flat.split([rows * hv * dk, rows * hv * dk, rows * hv * dv, rows * hv, rows * hv])
        return q.view(rows, hv, dk), k.view(rows, hv, dk), v.view(rows, hv, dv), g.view(rows, hv), beta.view(rows, hv)

    def replay(self, trace: GdnTrace, kept: int) -> torch.Tensor:
        a = self.trunk.arch
        before = trace.snapshot.contiguous()
        state = torch.empty_like(before)
        _lib.gdn_recurrence(ptr(before), ptr(state), kept, a.lin_v_heads, a.lin_k_dim, a.lin_v_dim,
                            *(ptr(x) for x in trace.inputs), None, None)
        return state


class NativeMtpStep:
    """The MTP head's layer (native.c's attn_layer) and head, on the trunk's native step.
    Packs the head's matrices in `layout` (draft_layout) in place."""

    name = "native"

    def __init__(self, head, storage: torch.dtype, layout: str):
        self.head = head
        pack_layer(head.layer, storage, layout)
        head.fc = pack_as(head.fc, storage, layout)
        self.struct = layer_struct(head.arch, head.layer, head.trunk.inv_freq, head.trunk.kv_dtype)
        self.address = ctypes.addressof(self.struct)

    def _layer(self, x: torch.Tensor, p0: int) -> torch.Tensor:
        """Rows x at p0.. through the layer (K/V written, attending from start)."""
        h = self.head
        h.reserve(p0 + x.shape[0])
        y = x.float().contiguous().clone()
        threaded().attn_layer(self.address, y.data_ptr(), y.shape[0], p0, h.start,
                              h.k.data_ptr(), h.v.data_ptr(), h.k.shape[1])
        return y

    def write(self, x: torch.Tensor, p0: int) -> None:
        self._layer(x, p0)

    def row(self, x: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.head
        a = h.arch
        y = self._layer(x, pos)
        out, logits = torch.empty(1, a.hidden), torch.empty(1, a.vocab)
        lm = h.trunk.lm_head
        threaded().head(y.data_ptr(), 1, a.hidden, h.final_norm.data_ptr(), h.eps, ptr(lm), lm.wtype, a.vocab,
                        logits.data_ptr(), out.data_ptr())
        return out, logits


# native_dflash.c's dflash_select keeps at most this many candidates per row.
SELECT_MAX_K = 64

# The DFlash layer matrices native_dflash.c reads packed.
DFLASH_MATRICES = ("q", "k", "v", "o", "gate", "up", "down", "attn_proj", "mlp_proj")


def dflash_refusal(device: torch.device, dtype: torch.dtype, embed) -> str | None:
    """Why the DFlash pass (either architecture) cannot run in native_dflash.c (None: it can, the library built):
    on the CPU, fp32 activations, a plain fp32 or bf16 embedding table."""
    if device.type != "cpu":
        return f"the drafter runs on {device.type}"
    if dtype != torch.float32:
        return f"activations are {str(dtype).removeprefix('torch.')}"
    plain_table = isinstance(embed, torch.Tensor) and embed.is_contiguous()
    if not (plain_table or isinstance(embed, PackedRows)) or embed.dtype not in WTYPES:
        return "the embedding table is not a plain fp32 or bf16 one"
    return None


class NativeDflashStep:
    """The DFlash pass and context rows in native_dflash.c (one call each). Packs the
    drafter's matrices in `layout` (draft_layout) in place, as the trunk's are: from here on
    the torch pass is not used, and memory is not doubled. A bf16 drafter's stay bf16
    (widened exactly in the product: the same values, half the bytes)."""

    name = "native"

    def __init__(self, d, layout: str):
        self.d = d
        storage = storage_dtype(d.dtype, d.stored)
        for layer in d.layers:
            for name in DFLASH_MATRICES:
                if getattr(layer, name) is not None:  # (the conv's projections: absent without a conv)
                    setattr(layer, name, pack_as(getattr(layer, name), storage, layout))
        d.fc = pack_as(d.fc, storage, layout)
        d.lm_head = pack_as(d.lm_head, torch.bfloat16 if d.lm_head_bf16 else torch.float32, layout)
        cfg, shape = d.cfg, d.shape
        embed, embed_wtype, embed_panels = table_of(d.embed)
        self.layers = (DfLayer * len(d.layers))(*(DfLayer(
            in_norm=ptr(l.in_norm), post_norm=ptr(l.post_norm), q_norm=ptr(l.q_norm), k_norm=ptr(l.k_norm),
            q=ptr(l.q), k=ptr(l.k), v=ptr(l.v), o=ptr(l.o), gate=ptr(l.gate), up=ptr(l.up), down=ptr(l.down),
            attn_proj=ptr(l.attn_proj), mlp_proj=ptr(l.mlp_proj), attn_base=ptr(l.attn_base),
            mlp_base=ptr(l.mlp_base)) for l in d.layers))
        self.struct = Dflash(
            hidden=shape.hidden, heads=shape.num_heads, kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
            inter=shape.inter, taps=cfg.taps, group=cfg.group, aux_width=d.fc.shape[1], vocab=cfg.vocab,
            layers=len(d.layers), window=d.window, causal=cfg.is_causal, conv=cfg.has_conv,
            mask_token=cfg.mask_token, embed_wtype=embed_wtype, embed_panels=embed_panels, wtype=d.fc.wtype, lm_wtype=d.lm_head.wtype,
            eps=cfg.eps, res_eps=cfg.eps / (d.scale * d.scale),
            scale=d.scale, embed=embed, fc=ptr(d.fc), hidden_norm=ptr(d.hidden_norm),
            final_norm=ptr(d.final_norm), lm_head=ptr(d.lm_head), inv_freq=ptr(d.inv_freq),
            layer=self.layers)
        self.address = ctypes.addressof(self.struct)

    def bind(self) -> None:
        d = self.d
        self.struct.capacity = d.capacity
        for layer, rk, rv in zip(self.layers, d.ring_k, d.ring_v):
            layer.ring_k, layer.ring_v = ptr(rk), ptr(rv)

    def add_context(self, aux: torch.Tensor) -> None:
        width = self.struct.aux_width
        if aux.shape[1:] != (width,):  # C reads what it is given: shapes are checked here
            raise ValueError(f"aux rows are {list(aux.shape[1:])} wide, the drafter fuses {width}")
        aux = aux.float().contiguous()
        threaded().dflash_add_context(self.address, aux.data_ptr(), aux.shape[0], self.d.context)

    def forward(self, anchor: int, anchor_pos: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        vocab, hidden = self.struct.vocab, self.struct.hidden
        if not 0 <= anchor < vocab:
            raise ValueError(f"anchor {anchor} is not a token id in 0..{vocab - 1}")
        logits, final = torch.empty(block, vocab), torch.empty(block, hidden)
        threaded().dflash_forward(self.address, anchor, anchor_pos, block, logits.data_ptr(), final.data_ptr())
        return logits, final

    def select(self, logits: torch.Tensor, final: torch.Tensor, anchor: int, top_k: int) -> list[int]:
        d, block = self.d, logits.shape[0]
        if top_k > SELECT_MAX_K:  # (imported here: turbo.drafters.dflash imports this module)
            from ..drafters.dflash import select_candidates
            return select_candidates(logits, final, anchor, d.hidden_projection, d.pred_codebook,
                                     d.succ_codebook, top_k)
        out = (ctypes.c_int * block)()
        threaded().dflash_select(logits.data_ptr(), final.data_ptr(), block, logits.shape[1], final.shape[1],
                                 d.hidden_projection.data_ptr(), d.hidden_projection.shape[0],
                                 d.pred_codebook.data_ptr(), d.succ_codebook.data_ptr(), top_k, anchor, out)
        return list(out)
