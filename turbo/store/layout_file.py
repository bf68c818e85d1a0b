"""The open layout: the native step's matrices as it reads them, written once (by repack, or
`python -m turbo.load.open_layout INSTALL` for an older install) into `packed.safetensors` beside the
install's weights, so that opening maps them instead of packing them. This module names the
packed tensors, gives their shapes, and decides at open whether an install's packed file is
used (its layout version and the weights it was written from); turbo/load/open_layout.py writes it.
docs/formats.md, "Layout".
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Mapping

from ..errors import TurboError
from .safetensors_format import read_header

# Bumped whenever a packed layout, or how the plan fuses sources into one matrix, changes: a
# file of another version is not read (the install then packs at open, and says how to rewrite it).
# 2: the converted formats' matrices (native_exact's SEGMENTS), written for a host that reads them.
# 3: FP8 codes two inputs a word (native_exact._fp8_bytes).
# 4: the weights' full digest and their size + mtime (SOURCE_KEY, STAT_KEY), each packed tensor's
#    CRC-32 (CRC_KEY): a layout proves it was built from these weights and is whole (issue 48).
LAYOUT_VERSION = 4
PACKED_FILE = "packed.safetensors"
PREFIX = "packed."  # every packed tensor's name: packed.<layout>.<its first source's name>
VERSION_KEY = "turbo.layout"
SOURCE_KEY = "turbo.layout.source"  # digest() of the weights it was packed from: every byte
CRC_KEY = "turbo.layout.crc32"  # each packed tensor's CRC-32, 8 hex digits each, in the header's order
# Beside it: what the last full check (or the write) found, by the files' stat; an open that finds
# the same stat trusts it, any write to the weights or the layout (a new ctime) makes the next
# open check in full again.
VERIFIED_FILE = ".packed.verified"
ALIGN = 64  # the data section's alignment in the file (every packed matrix is a multiple of 64 bytes)
PANEL = 16
GROUP = 64  # turbo's int4 / int8 (quant.GROUP)


def upgrade_command(root: Path) -> str:
    return f"python -m turbo.load.open_layout {root}"


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


CHUNK = 64 << 20  # digest() hashes files in chunks of this many bytes, on several threads


def _threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _chunk_digest(path: Path, start: int, size: int) -> bytes:
    h = hashlib.sha256()
    with path.open("rb") as f:
        f.seek(start)
        left = size
        while left:
            block = f.read(min(left, 1 << 20))
            if not block:
                raise TurboError(f"{path}: truncated while hashing it")
            h.update(block)
            left -= len(block)
    return h.digest()


def digest(files: list[Path]) -> str:
    """The weights' identity over every byte: SHA-256 of each file's name, size and the SHA-256 of
    each CHUNK of it (chunks hashed on several threads: hashlib lets go of the GIL). Computed when
    the layout is written, and at open only when stat_signature() says the files changed."""
    jobs = [(p, start, min(CHUNK, size - start)) for p in files
            for size in [p.stat().st_size] for start in range(0, max(size, 1), CHUNK) if size]
    with ThreadPoolExecutor(_threads()) as pool:
        parts = list(pool.map(lambda j: _chunk_digest(*j), jobs))
    h, at = hashlib.sha256(), 0
    for p in files:
        size = p.stat().st_size
        h.update(f"{p.name}:{size}:".encode())
        n = -(-size // CHUNK)
        for part in parts[at:at + n]:
            h.update(part)
        at += n
    return h.hexdigest()


def stat_signature(files: list[Path]) -> str:
    """Each file's name, size, inode, mtime and ctime (ns). Whatever writes a file changes its
    ctime, which no tool sets back (touch and cp -p set the mtime only)."""
    out = []
    for p in files:
        st = p.stat()
        out.append(f"{p.name}:{st.st_size}:{st.st_ino}:{st.st_mtime_ns}:{st.st_ctime_ns}")
    return ";".join(out)


def _verified(packed: Path, weights: list[Path], meta: dict) -> dict:
    return {"weights": stat_signature(weights), "packed": stat_signature([packed]),
            "source": meta.get(SOURCE_KEY), "crc32": hashlib.sha256((meta.get(CRC_KEY) or "").encode()).hexdigest()}


def record_verified(packed: Path, weights: list[Path], meta: dict) -> None:
    """The stat of a layout just written or checked in full, beside it (best effort: an install
    directory that is not writable checks in full at every open)."""
    tmp = packed.with_name(f"{VERIFIED_FILE}.{os.getpid()}")
    try:
        tmp.write_text(json.dumps(_verified(packed, weights, meta)))
        os.replace(tmp, packed.with_name(VERIFIED_FILE))
    except OSError:
        tmp.unlink(missing_ok=True)


def _still_verified(packed: Path, weights: list[Path], meta: dict) -> bool:
    try:
        return json.loads(packed.with_name(VERIFIED_FILE).read_text()) == _verified(packed, weights, meta)
    except (OSError, ValueError):
        return False


def segment_crcs(path: Path, header) -> str:
    """The CRC-32 of each tensor's bytes in `path` (its parsed header), 8 hex digits each, in the
    header's order; tensors on several threads (zlib lets go of the GIL), read through a map."""
    spans = [(header.data_start + t.begin, t.end - t.begin) for t in header.tensors.values()]
    if not spans:
        return ""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        try:
            def crc(span: tuple[int, int]) -> int:
                start, size, value = span[0], span[1], 0
                for at in range(start, start + size, 16 << 20):
                    value = zlib.crc32(view[at:min(start + size, at + (16 << 20))], value)
                return value
            with ThreadPoolExecutor(_threads()) as pool:
                values = list(pool.map(crc, spans))
        finally:
            view.release()
    return "".join(f"{v:08x}" for v in values)


def patch_metadata(path: Path, key: str, value: str) -> bool:
    """`key`'s value in `path`'s header rewritten in place, where it keeps its length (the header
    is not moved: the data stays where it is); False where it cannot be."""
    try:
        with path.open("r+b") as f:
            n = int.from_bytes(f.read(8), "little")
            raw = f.read(n)
            old = json.loads(raw).get("__metadata__", {}).get(key)
            if old is None or len(old) != len(value):
                return False
            needle = json.dumps(key).encode() + b":" + json.dumps(old).encode()
            at = raw.find(needle)
            if at < 0 or raw.find(needle, at + 1) >= 0:
                return False
            f.seek(8 + at)
            f.write(json.dumps(key).encode() + b":" + json.dumps(value).encode())
        return True
    except (OSError, ValueError):
        return False


def check(root: Path, weights: list[Path]) -> tuple[Path | None, str | None]:
    """The install's packed file to index (None: there is none it can use) and, where one is
    there but not used, the one line that says why and how to rewrite it. Its cost at open: the
    stat of the weights and of the layout, equal to those of its last full check (VERIFIED_FILE);
    else, once, a full check: the weights' digest() against the one it was built from and a CRC-32
    pass over every packed tensor (docs/hardening.md: the figures)."""
    path = root / PACKED_FILE
    if not path.exists():
        return None, None
    try:
        header = read_header(path)
        meta = header.metadata or {}
    except TurboError as e:
        why = f"unreadable ({e})"
    else:
        version = meta.get(VERSION_KEY)
        if version != str(LAYOUT_VERSION):
            why = f"layout version {version}, this turbo reads {LAYOUT_VERSION}"
        elif _still_verified(path, weights, meta):
            return path, None
        elif meta.get(SOURCE_KEY) != digest(weights):
            why = "written from other weights than the install's"
        else:
            crcs = segment_crcs(path, header)
            recorded = meta.get(CRC_KEY) or ""
            if crcs == recorded:
                record_verified(path, weights, meta)
                return path, None
            names = list(header.tensors)
            bad = next((names[i] for i in range(len(names)) if crcs[8 * i:8 * i + 8] != recorded[8 * i:8 * i + 8]),
                       "its checksum table")
            why = f"damaged: {bad}'s bytes do not match the checksum recorded when it was written"
    return None, (f"note: {path}: {why}; its matrices are packed at every open instead (slower): "
                  f"{upgrade_command(root)} rewrites it")


def check_aligned(name: str, offset: int) -> None:
    if offset % ALIGN:
        raise TurboError(f"{name}: packed at data offset {offset}, not {ALIGN}-aligned")

