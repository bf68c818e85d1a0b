"""Writing an install's open layout (turbo/store/layout_file.py): every matrix the native step would
pack at open, packed once, by the loader's own code, into `packed.safetensors`.

    python -m turbo.load.open_layout INSTALL

repack writes it with every install (`write_layout`); this command adds it to an install written
before, or rewrites one of another layout version. An older install of some size without one
this turbo reads is converted once at its first open where its directory is writable (`convert_on_open`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterator

import torch

from ..backends import native_exact, native_lib, native_pack
from ..backends.packed import LAYOUT_WTYPES
from ..errors import ArgumentParser, TurboError
from ..model.trunk import PREFIX
from ..sequence.options import OpenOptions
from ..store import layout_file, quant
from ..store.install import ST_TORCH, Entry, Install, open_install, safetensors_files
from ..store.quant import QUANT_SLICE
from ..store.safetensors_format import Planned, read_header, write_safetensors
from .load_plan import (COPY, EXACT, PACKED, SEGMENTS, EmbedPlan, Host, Matrix, TrunkPlan, layer_matrices,
    packed_layout, packed_target, plan_trunk)
from .reader import Reader

# The host the layout is written for: products that read int4 / int8 packed (AVX512-VNNI) and the
# converted formats as stored ("exact", "fp8": their bytes are the same on any CPU). A host without
# them plans other layouts for those matrices (other names), and packs them at open as before.
LAYOUT_HOST = Host(None, ("pairs", "int8", "exact", "fp8"))
# An older install converts itself at open only past this many bytes of matrices (below it
# packing at open takes well under a second, and the install is left as it is, unsaid).
CONVERT_BYTES = 256 << 20
ST_BYTES = {"BF16": 2, "F32": 4, "U8": 1}


def _matrices(plan: TrunkPlan) -> list[Matrix]:
    head = [plan.embed.head] if plan.embed.head is not None else []
    return head + [m for layer in plan.layers for m in layer_matrices(layer)]


def _window(k: int) -> int:
    """Rows packed per slice of a matrix of k inputs: whole panels, about QUANT_SLICE weights
    (the packed matrix is written a slice at a time, never held whole)."""
    return max(1, QUANT_SLICE // k // layout_file.PANEL) * layout_file.PANEL


def _table_rows(reader: Reader, p: EmbedPlan, r0: int, r1: int) -> torch.Tensor:
    """Rows r0..r1 of the embedding table as Reader.table reads it (stored, or read_as)."""
    e = reader.entry(p.source)
    rows = reader.index.rows(e.name, r0, r1, reader.scratch.setdefault(-1, {}))
    kept = p.table or p.read_as
    return rows if kept is None or ST_TORCH.get(e.st_dtype) == kept or p.read_as is None else rows.to(p.read_as)


def _read(file: Path, offset: int, out: torch.Tensor) -> torch.Tensor:
    with file.open("rb") as f:
        f.seek(offset)
        if f.readinto(memoryview(out.view(torch.uint8).reshape(-1).numpy())) != out.numel() * out.element_size():
            raise TurboError(f"{file}: truncated while reading its open layout's source")
    return out


def _quantized_rows(entries: list[Entry], r0: int, r1: int, dtype: torch.dtype) -> quant.QuantizedWeight:
    """Rows r0..r1 of the quantized `entries` fused by rows (as quant.fuse of their
    ResidentIndex.load_quantized), read from their files on their own."""
    parts, at = [], 0
    for e in entries:
        lo, hi = max(r0, at), min(r1, at + e.dims[0])
        if lo < hi:
            sdt, groups, words = ST_TORCH[e.scale_st_dtype], e.dims[1] // e.group, e.packed_dims[1]
            parts.append(quant.QuantizedWeight(
                _read(e.file, e.offset + (lo - at) * words * 4, torch.empty(hi - lo, words, dtype=torch.int32)),
                *(_read(e.file, offset + (lo - at) * groups * sdt.itemsize, torch.empty(hi - lo, groups, dtype=sdt))
                  for offset in (e.scale_offset, e.bias_offset)),
                e.bits, e.group, dtype, float8=e.dtype in quant.FLOAT8_CODES))
        at += e.dims[0]
    return quant.fuse(parts)


def _slices(reader: Reader, plan: TrunkPlan, m: Matrix) -> Iterator[torch.Tensor]:
    """The packed matrix `m` as Reader.matrix / head_copy pack it, panel-major, a slice of whole
    panels at a time (each slice packs to those panels on their own: the same bytes)."""
    if m.form == COPY:
        e = reader.entry(plan.embed.source)
        step = _window(e.dims[1])
        for r0 in range(0, e.dims[0], step):
            rows = _table_rows(reader, plan.embed, r0, min(e.dims[0], r0 + step))
            yield native_pack.quantized_copy(rows, m.bits).data
        return
    entries = [reader.entry(s) for s in m.sources]
    n, step = sum(e.dims[0] for e in entries), _window(entries[0].dims[1])
    if m.form == PACKED:
        for r0 in range(0, n, step):
            yield native_pack.quantized_panels(_quantized_rows(entries, r0, min(n, r0 + step), reader.dtype)).data
        return
    for r0 in range(0, n, step):  # PANELS: float sources only (layout_file.target), read a slice at a time
        yield native_pack.pack_rows(lambda a, b: reader.rows(entries, {}, m.dtype, r0 + a, r0 + b),
                                    min(n, r0 + step) - r0, m.dtype, m.layout).data


def _writer(reader: Reader, plan: TrunkPlan, m: Matrix, dtype: str, shape: tuple[int, ...]):
    def write(out) -> None:
        panels = 0
        for data in _slices(reader, plan, m):
            if (tuple(data.shape[1:]), data.dtype.itemsize) != (shape[1:], ST_BYTES[dtype]):
                raise TurboError(f"{m.sources[0].name}: packed as {list(data.shape)}, the layout expects "
                                 f"{list(shape)}")
            out.write(data.contiguous().view(-1).view(torch.uint8).numpy())
            panels += data.shape[0]
        if panels != shape[0]:
            raise TurboError(f"{m.sources[0].name}: packed {panels} panels, the layout expects {shape[0]}")
    return write


def _segments(reader: Reader, plan: TrunkPlan, m: Matrix) -> tuple[int, object]:
    """A SEGMENTS matrix's bytes and their writer: its table, then each part as the loader packs it
    (an exact one packed whole, once to be sized and again when written; the others a slice at a
    time), the bytes of native_exact.segments() of them, never held whole."""
    entries, parts = reader.index.entries, []
    for p in m.parts:
        if p.form == EXACT:
            packed = reader.matrix(p)  # (dropped once sized)
            parts.append((packed.n, packed.wtype, packed.data.numel() * packed.data.element_size()))
        else:
            _, dtype, shape = packed_target(entries, p)
            wtype = LAYOUT_WTYPES.get(packed_layout(entries, p)) or native_lib.WTYPES[ST_TORCH[dtype]]
            rows = sum(reader.entry(s).dims[0] for s in p.sources)
            parts.append((rows, wtype, ST_BYTES[dtype] * int(torch.Size(shape).numel())))
        packed = None
    head, offsets = native_exact.segments_table(parts)

    def write(out) -> None:
        out.write(head.numpy())
        for p, (_, _, size), start, end in zip(m.parts, parts, offsets, offsets[1:]):
            written = 0
            for data in [reader.matrix(p).data] if p.form == EXACT else _slices(reader, plan, p):
                out.write(data.contiguous().view(-1).view(torch.uint8).numpy())
                written += data.numel() * data.element_size()
            if written != size:
                raise TurboError(f"{p.sources[0].name}: packed {written} bytes, sized {size}")
            out.write(bytes(end - start - size))  # (each part 64-byte aligned)
    return offsets[-1], write


def write_layout(install: Install, host: Host = LAYOUT_HOST, matrices: bool = True) -> Path:
    """The install's open layout written into its directory (a temporary file renamed over
    packed.safetensors): every PANELS, PACKED, COPY and SEGMENTS matrix of the trunk's plan for the
    default options on `host`, as the loader packs it. An install the native step would not run, or
    `matrices` False (repack --no-open-layout), writes a layout of none: current, packed at open."""
    planned: list[Planned] = []
    try:
        plan = plan_trunk(install.index.entries, install.arch, OpenOptions(), torch.device("cpu"), host) \
            if matrices else None
    except TurboError:  # (refused at open, where it says why)
        plan = None
    if plan is not None and plan.why_torch is None:
        reader, at = Reader(install.index, plan.dtype), 0
        for m in _matrices(plan):
            want = packed_target(install.index.entries, m)
            if want is None:
                continue
            name, dtype, shape = want
            if m.form == SEGMENTS:
                size, write = _segments(reader, plan, m)
                shape = (size,)
            else:
                size, write = ST_BYTES[dtype] * int(torch.Size(shape).numel()), _writer(reader, plan, m, dtype, shape)
            layout_file.check_aligned(name, at)
            planned.append(Planned(name, dtype, list(shape), size, write))
            at += size
    weights = safetensors_files(install.path)
    meta = {layout_file.VERSION_KEY: str(layout_file.LAYOUT_VERSION),
            layout_file.SOURCE_KEY: layout_file.digest(weights),  # every byte (read here anyway: hot in the cache)
            layout_file.CRC_KEY: "0" * 8 * len(planned)}  # (filled in once the bytes are written)
    out = install.path / layout_file.PACKED_FILE
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    try:
        write_safetensors(tmp, planned, metadata=meta, align=layout_file.ALIGN)
        crcs = layout_file.segment_crcs(tmp, read_header(tmp))
        if not layout_file.patch_metadata(tmp, layout_file.CRC_KEY, crcs):
            raise TurboError(f"{tmp}: cannot record its checksums")
        os.replace(tmp, out)
        layout_file.record_verified(out, weights, meta | {layout_file.CRC_KEY: crcs})  # (checked as written)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def write_layout_of(directory: Path, matrices: bool = True) -> None:
    """repack's: the layout of the install just written into `directory` (one the runtime would
    refuse to open is left without: opening it says why)."""
    try:
        install = open_install(directory)
    except TurboError:
        return
    write_layout(install, matrices=matrices)


def convert_on_open(install: Install, host: Host) -> None:
    """An install of CONVERT_BYTES of matrices or more without an open layout this turbo reads
    (none: an older repack's; one of another layout version, or of other weights): its layout
    written once (said in one line) and indexed, so this open and the next ones map it; where
    its directory is not writable, one line says the command that writes it."""
    if install.packed:
        return
    size = sum(e.size_bytes for e in install.index.entries.values() if e.name.startswith(PREFIX) and len(e.dims) == 2)
    if size < CONVERT_BYTES:
        return
    stale = install.layout_note is not None
    try:
        path = write_layout(install, host)
    except OSError as e:
        if not stale:  # (a stale one: its note says the command, once it opened)
            print(f"note: {install.path}: written by an older repack, its matrices are packed at every open (slower); "
                  f"cannot write its open layout there ({e.strerror}): {layout_file.upgrade_command(install.path)} "
                  "writes it", file=sys.stderr)
        return
    install.index.add_file(path, (layout_file.PREFIX,), packed=True)
    install.packed, install.layout_note = True, None
    why = "its open layout was not one this turbo reads" if stale else "written by an older repack"
    print(f"note: {install.path}: {why}; its open layout is written once into {path.name} "
          f"({path.stat().st_size / 2**20:.0f} MiB): opens map it from now on", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m turbo.load.open_layout", description=__doc__.split("\n\n")[0])
    parser.add_argument("install", help="an install directory (python -m turbo.repack's)")
    args = parser.parse_args(argv)
    try:
        install = open_install(Path(args.install))
        if install.packed:
            print(f"{install.path}: its open layout is current (version {layout_file.LAYOUT_VERSION})", file=sys.stderr)
            return 0
        path = write_layout(install)
    except TurboError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {args.install}: cannot write its open layout ({e.strerror})", file=sys.stderr)
        return 2
    print(f"wrote {path} (layout version {layout_file.LAYOUT_VERSION}, {path.stat().st_size / 2**20:.0f} MiB)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
