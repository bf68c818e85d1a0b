"""The CPU backend's native code -- native.c (the trunk's step and the packed products) and
native_dflash.c (the DFlash2 pass) -- compiled once per machine with the host's C compiler.

`library()` returns the loaded library, or None when it cannot be had (no compiler, a failed
build, or TURBO_NATIVE=0); the trunk and drafters then run their torch code, which is just as
lossless, only slower. `why_not()` says which. The build goes to a per-user cache, keyed by the
source, the compiler and the machine, and is renamed into place whole, so parallel jobs
(a Hydra multirun) never load a half-written file.
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

import torch

from ..errors import TurboError

# native.c: the trunk's step; native_*.c: further parts (built into the same library)
SOURCES = sorted(Path(__file__).parent.glob("native*.c"))
HEADER = Path(__file__).with_name("native.h")  # what they share
# No -ffast-math: the row-stability argument in native.c needs sums in program order.
# -fopenmp: the library then shares the libgomp torch has loaded (native.c, set_threads).
FLAGS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-fopenmp"], ["-O3", "-march=native"], ["-O3"])

_lib: ctypes.CDLL | None = None
_why: str | None = None
_tried = False


class Layer(ctypes.Structure):
    """native.c's Layer: one trunk layer's weights (pointers) and sizes."""

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
    ]


WTYPES = {torch.float32: 0, torch.bfloat16: 1}

# native.c's entry points: p a pointer (a Layer's address too), i an int, f a float
SIGNATURES = {
    "linear_packed": "p i i p i i p",
    "dot_products": "",
    "set_threads": "i",
    "gdn_layer": "p p i p p p p p p",
    "embed_rows": "p i i p i i p",
    "copy_rows": "p i i p i",
    "attn_layer": "p p i i i p p i",
    "head": "p i i p f p i i p p",
    "gdn_recurrence": "p i i i i p p p p p p p",
    "dflash_forward": "p i i i p p",
    "dflash_add_context": "p p i i",
    "dflash_select": "p p i i i p i p p i i p",
}
RETURNS_INT = {"dot_products"}  # (the rest return nothing)
_C = {"p": ctypes.c_void_p, "i": ctypes.c_int, "f": ctypes.c_float}


def _cache_dir() -> Path:
    root = os.environ.get("TURBO_CACHE") or os.environ.get("XDG_CACHE_HOME")
    return Path(root) / "turbo" if root else Path.home() / ".cache" / "turbo"


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(b"".join(src.read_bytes() for src in [*SOURCES, HEADER]) + " ".join(map(str, FLAGS)).encode()
                         + version.encode() + platform.machine().encode() + platform.node().encode()).hexdigest()[:16]
    errors = []
    for dest_dir in (_cache_dir(), Path(tempfile.gettempdir()) / "turbo-native"):
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


def library() -> ctypes.CDLL | None:
    global _lib, _why, _tried
    if os.environ.get("TURBO_NATIVE", "1") == "0":
        return None
    if not _tried:
        _tried = True
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
        try:
            if cc is None:
                raise RuntimeError("no C compiler on PATH (set CC)")
            lib = ctypes.CDLL(str(_build(cc)))
            for name, args in SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes = [_C[a] for a in args.split()]
                fn.restype = ctypes.c_int if name in RETURNS_INT else None
            _lib = lib
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            _why = str(e)
    return _lib


_threads = 0


def threaded() -> ctypes.CDLL | None:
    """library(), its matrix products split over torch's intra-op thread count (checked
    on every call: `threads=` or torch.set_num_threads may change it)."""
    global _threads
    lib = library()
    n = torch.get_num_threads()
    if lib is not None and n != _threads:
        lib.set_threads(n)
        _threads = n
    return lib


def why_not() -> str | None:
    """Why the native step is not in use (None when it is)."""
    if os.environ.get("TURBO_NATIVE", "1") == "0":
        return "TURBO_NATIVE=0"
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
    - "pairs" (bf16): data[p, j, l, t] = w[16p + l, 2j + t], for bf16 dot products (wtype 2,
      inputs rounded to bf16);
    - "int8": per output a scale max|w| / 127 (fp32), 128 x the sum of its int8 values
      (int32), then data[p, j, l, t] = round(w[16p + l, 4j + t] / scale) as int8, all in one
      byte buffer, for int8 dot products (wtype 3, inputs quantised per row).
    The last two are for drafters: their products are not the fp32 function."""

    data: torch.Tensor
    n: int
    k: int
    layout: str = "panels"

    @property
    def wtype(self) -> int:
        return {"pairs": 2, "int8": 3}.get(self.layout) or WTYPES[self.data.dtype]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def dense(self) -> torch.Tensor:
        """The [n, k] matrix back (a copy; int8: the dequantised values)."""
        n_pad = -(-self.n // PANEL) * PANEL
        if self.layout == "int8":
            scale = self.data[:4 * n_pad].view(torch.float32)
            q = self.data[8 * n_pad:].view(torch.int8).reshape(n_pad // PANEL, -1, PANEL, 4)
            w = q.permute(0, 2, 1, 3).reshape(n_pad, -1).float() * scale[:, None]
            return w[:self.n, :self.k].contiguous()
        if self.layout == "pairs":
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
        return self.packed.data[ids // PANEL, :, ids % PANEL]


def table_of(embed: torch.Tensor | PackedRows) -> tuple[int, int, int]:
    """An embedding table as native code reads it: (pointer, wtype, 1 if panels else 0)."""
    if isinstance(embed, PackedRows):
        return embed.packed.data.data_ptr(), WTYPES[embed.dtype], 1
    assert embed.is_contiguous() and embed.device.type == "cpu"
    return embed.data_ptr(), WTYPES[embed.dtype], 0


def storage_dtype(dtype: torch.dtype, stored: set[str]) -> torch.dtype:
    """The dtype native code keeps matrices in, for compute `dtype` and the checkpoint's
    stored dtypes (safetensors names): a bf16 checkpoint's stay bf16 under fp32 compute --
    widened exactly in the products, they give fp32 copies' results bit for bit from half
    the bytes (a decode step reads every matrix once per token)."""
    return torch.bfloat16 if dtype == torch.float32 and stored == {"BF16"} else dtype


def pack(w: torch.Tensor, layout: str = "panels") -> Packed:
    n, k = w.shape
    quad = {"panels": 1, "pairs": 2, "int8": 4}[layout]
    padded = torch.nn.functional.pad(w, (0, -k % quad, 0, -n % PANEL))
    if layout == "panels":
        return Packed(padded.reshape(-1, PANEL, k).transpose(1, 2).contiguous(), n, k)
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


def pack_as(w: torch.Tensor, storage: torch.dtype, layout: str) -> Packed:
    """w packed in `layout`: panels keep `storage` (fp32 or bf16), pairs are bf16, int8 quantises."""
    return pack(w.to(torch.bfloat16 if layout == "pairs" else storage), layout)


def linear_packed(x: torch.Tensor, w: Packed) -> torch.Tensor:
    """x [R, k] @ w^T in fp32 (bf16 weights widened exactly; the drafters' "pairs" and "int8"
    layouts: bf16 or int8 dot products); row-stable by construction."""
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], w.n)
    threaded().linear_packed(x.data_ptr(), x.shape[0], w.k, w.data.data_ptr(), w.wtype, w.n, y.data_ptr())
    return y
