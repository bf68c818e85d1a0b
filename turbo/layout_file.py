"""The open layout: the native step's matrices as it reads them, written once (by repack, or
`python -m turbo.open_layout INSTALL` for an older install) into `packed.safetensors` beside the
install's weights, so that opening maps them instead of packing them. This module names the
packed tensors, gives their shapes, and decides at open whether an install's packed file is
used (its layout version and the weights it was written from); turbo/open_layout.py writes it.
docs/formats.md, "Layout".
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Mapping

from .errors import TurboError
from .safetensors_format import read_header

# Bumped whenever a packed layout, or how the plan fuses sources into one matrix, changes: a
# file of another version is not read (the install then packs at open, and says how to rewrite it).
# 2: the converted formats' matrices (native_exact's SEGMENTS), written for a host that reads them.
# 3: FP8 codes two inputs a word (native_exact._fp8_bytes).
LAYOUT_VERSION = 3
PACKED_FILE = "packed.safetensors"
PREFIX = "packed."  # every packed tensor's name: packed.<layout>.<its first source's name>
VERSION_KEY = "turbo.layout"
SOURCE_KEY = "turbo.layout.source"  # fingerprint() of the weights it was packed from
ALIGN = 64  # the data section's alignment in the file (every packed matrix is a multiple of 64 bytes)
PANEL = 16
GROUP = 64  # turbo's int4 / int8 (quant.GROUP)
SAMPLES, SAMPLE_BYTES = 64, 4096


def upgrade_command(root: Path) -> str:
    return f"python -m turbo.open_layout {root}"


def packed_name(layout: str, first_source: str) -> str:
    return f"{PREFIX}{layout}.{first_source}"


def packed_shape(layout: str, n: int, k: int, float_dtype: str) -> tuple[str, tuple[int, ...]]:
    """(safetensors dtype, shape) of the matrix [n, k] packed in `layout` (backends/packed.py, Packed's
    data): "panels" [panels, k, 16] of `float_dtype` (F32 / BF16), "panel_pairs" (BF16)
    [panels, ceil(k/2), 16, 2], "q4" / "q8" bytes [panels, k / 64, scales + biases + levels]."""
    panels = -(-n // PANEL)
    if layout == "panels":
        return float_dtype, (panels, k, PANEL)
    if layout == "panel_pairs":
        return "BF16", (panels, -(-k // 2), PANEL, 2)
    bits = {"q4": 4, "q8": 8}[layout]
    return "U8", (panels, k // GROUP, 4 * PANEL + PANEL * GROUP * bits // 8)


def target(entries: Mapping, layout: str | None, sources: list[str], floats: bool,
           float_dtype: str) -> tuple[str, str, tuple[int, ...]] | None:
    """(name, safetensors dtype, shape) of the packed tensor that holds `sources` (in `entries`,
    an index's) fused by rows in `layout`; None where the open layout holds no such matrix.
    `floats`: float panels, only of sources all stored float (no dequantized matrix is written)."""
    es = [entries.get(s) for s in sources]
    if layout is None or any(e is None or len(e.dims) != 2 or not all(e.dims) or (floats and e.bits) for e in es):
        return None
    return (packed_name(layout, sources[0]),
            *packed_shape(layout, sum(e.dims[0] for e in es), es[0].dims[1], float_dtype))


def fingerprint(files: list[Path]) -> str:
    """The weights' identity, cheap to read at every open: each file's name, size and header,
    and SAMPLES strided SAMPLE_BYTES of its data (a file replaced by other weights of the same
    shapes changes them)."""
    h = hashlib.sha256()
    for path in files:
        header = read_header(path)
        size = path.stat().st_size
        h.update(f"{path.name}:{size}:".encode())
        with path.open("rb") as f:
            h.update(f.read(header.data_start))
            span = size - header.data_start
            for i in range(SAMPLES):
                f.seek(header.data_start + span * i // SAMPLES)
                h.update(f.read(min(SAMPLE_BYTES, span)))
    return h.hexdigest()


def check(root: Path, weights: list[Path]) -> tuple[Path | None, str | None]:
    """The install's packed file to index (None: there is none it can use) and, where one is
    there but not used, the one line that says why and how to rewrite it."""
    path = root / PACKED_FILE
    if not path.exists():
        return None, None
    try:
        meta = read_header(path).metadata or {}
    except TurboError as e:
        why = f"unreadable ({e})"
    else:
        version = meta.get(VERSION_KEY)
        if version != str(LAYOUT_VERSION):
            why = f"layout version {version}, this turbo reads {LAYOUT_VERSION}"
        elif meta.get(SOURCE_KEY) != fingerprint(weights):
            why = "written from other weights than the install's"
        else:
            return path, None
    return None, (f"note: {path}: {why}; its matrices are packed at every open instead (slower): "
                  f"{upgrade_command(root)} rewrites it")


def check_aligned(name: str, offset: int) -> None:
    if offset % ALIGN:
        raise TurboError(f"{name}: packed at data offset {offset}, not {ALIGN}-aligned")

