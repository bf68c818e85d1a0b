"""The native CPU library loaded (built by native_build.py; native.c says what each C file holds)
and the ctypes mirrors of native.h's structs. `library(cache_dir)` returns it, or None when it
cannot be had (no compiler, a failed build; `why_not()` says why): the loader then picks the torch
step, as lossless, only slower. Packing weights: native_pack.py; the steps: native_trunk.py,
native_dflash.py.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import torch

from ..errors import TurboError
from .native_build import build, isa_tier

_lib: ctypes.CDLL | None = None
_why: str | None = None
_tried = False
_tier: str | None = None  # the ISA tier it was built for (native_build.isa_tier; None: the native flags)


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

# native.c's entry points: p a pointer (a Layer's address too, an array), i an int, f a float
SIGNATURES = {
    "linear_packed": "p i i p i i p",
    "dot_products": "",
    "bf16_products": "i",
    "struct_size": "i",
    "set_threads": "i",
    "gdn_layer": "p p i p p p p p p",
    "gdn_layer_seqs": "p p i p p p p p p p",
    "embed_rows": "p i i p i i p",
    "copy_rows": "p i i p i",
    "attn_layer": "p p i i i p p i",
    "attn_layer_seqs": "p p i p p p p p p p",
    "head": "p i i p f p i i p p",
    "gdn_recurrence": "p p i i i i p p p p p p p",
    "dflash_forward": "p i i i p p",
    "dflash_add_context": "p p i i",
    "dflash_select": "p p i i i p i p p i i p",
    "argmax_row": "p i",
}
RETURNS_INT = {"dot_products", "bf16_products", "struct_size", "argmax_row"}  # (the rest return nothing)
_C = {"p": ctypes.c_void_p, "i": ctypes.c_int, "f": ctypes.c_float}


def _struct_mismatch(lib: ctypes.CDLL) -> str | None:
    """ctypes' layouts against the compiler's: a mismatch means the Python mirror of native.h
    went stale (a build bug), and every call would read fields at the wrong offsets."""
    for which, struct in enumerate(STRUCTS):
        c_size = lib.struct_size(which)
        if c_size != ctypes.sizeof(struct):
            return (f"native.h's {struct.__name__} is {c_size} bytes, its ctypes mirror in "
                    f"turbo/backends/native_lib.py {ctypes.sizeof(struct)}: the two disagree")
    return None


def library(cache_dir: Path | None = None, compiler: str | None = None) -> ctypes.CDLL | None:
    """The library, built (with `compiler`, default cc / gcc / clang on PATH, into `cache_dir`,
    default ~/.cache/turbo) and loaded once per process: a later call's arguments are not looked at."""
    global _lib, _why, _tried, _tier
    if not _tried:
        tier = isa_tier()  # (a TURBO_ISA this CPU cannot run is the user's error: refused, not a fallback)
        _tried, _tier = True, tier
        cc = compiler or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
        try:
            if cc is None:
                raise RuntimeError("no C compiler on PATH (set CC)")
            path, throwaway = build(cc, cache_dir, tier)
            lib = ctypes.CDLL(str(path))
            if throwaway is not None:  # loaded: the mapping outlives the file
                shutil.rmtree(throwaway, ignore_errors=True)
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
_bf16 = None  # the bf16 products chosen for this process (set_bf16_products)


def set_bf16_products(mode: str | None) -> None:
    """OpenOptions.bf16_products for the process: "auto" (AMX-BF16 where the CPU has it) or "exact"
    (the fp32 walk); None: the process's. The first runtime opened decides (None: auto); a later
    one that names the other is refused, since states and cached
    prefixes computed one way would not match rows computed the other."""
    global _bf16
    if _bf16 is None:
        _bf16 = mode or "auto"
        _lib.bf16_products(0 if _bf16 == "exact" else 1)
    elif mode is not None and mode != _bf16:
        raise TurboError(f"bf16_products {mode!r}: this process's native step already runs {_bf16!r} "
                         "(one choice per process)", field="bf16_products")


def bf16_mode() -> str | None:
    """The bf16 products this process runs (set_bf16_products; None: no runtime opened one yet)."""
    return _bf16


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


def tier() -> str | None:
    """The ISA tier the library was built for (avx2, avx512, amx; None: the native flags, or no library)."""
    return _tier if library() is not None else None


def why_not() -> str | None:
    """Why the library cannot be had (None when it can)."""
    library()
    return _why


def argmax(row: torch.Tensor) -> int:
    """torch.argmax of a contiguous fp32 row [n] on the CPU (the first of equals; a NaN wins)."""
    return _lib.argmax_row(row.data_ptr(), row.shape[0])


# A drafter's products on the CPU (`draft_products`): the packed layout each names
DRAFT_PRODUCTS = {"fp32": "panels", "bf16": "pairs", "int8": "int8"}
_NEEDS = {"pairs": "AVX512-BF16", "int8": "AVX512-VNNI or AVX2"}


def dot_layouts() -> tuple[str, ...]:
    """The layouts the library can multiply by beyond fp32 / bf16 panels ("pairs": AVX512-BF16;
    "int8": AVX512-VNNI or the AVX2 tier (native_avx2.c), also the trunk's int4 / int8; "exact": AVX512-BW, the fp32-scaled
    affine formats; "fp8": AVX512-VBMI, FP8 blocks), empty without the library."""
    lib = library()
    bits = lib.dot_products() if lib is not None else 0
    return tuple(name for bit, name in ((1, "pairs"), (2, "int8"), (4, "exact"), (8, "fp8")) if bits & bit)


def check_draft_products(products: str) -> None:
    if products != "auto" and products not in DRAFT_PRODUCTS:
        raise TurboError(f"draft_products {products!r} is not one of auto, {', '.join(DRAFT_PRODUCTS)}")


def draft_layout(products: str, have: tuple[str, ...] | None = None) -> str:
    """The layout a drafter's matrices take for `products`: "auto" is the fastest this CPU
    has (`have`, None: dot_layouts(); int8, then bf16, then fp32: on the tiny install int8
    lands as many proposals as fp32 in about two thirds of its time, see README); a named one
    it lacks is refused."""
    check_draft_products(products)
    have = dot_layouts() if have is None else have
    if products == "auto":
        return next((lay for lay in ("int8", "pairs") if lay in have), "panels")
    layout = DRAFT_PRODUCTS[products]
    if layout != "panels" and layout not in have:
        raise TurboError(f"draft_products {products}: "
                         + (f"the native library is not in use ({why_not()})" if library() is None
                            else f"this CPU has no {_NEEDS[layout]} (expected auto or fp32)"))
    return layout
