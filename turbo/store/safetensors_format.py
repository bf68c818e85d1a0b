"""Safetensors files: headers read exactly as strictly as the safetensors library reads them
(`read_header` -> `Header` of `TensorInfo`s; only headers, never tensor data), and files written
(`write_tensors` from tensors at hand; `write_safetensors` streamed from `Planned` parts: a
repack's, an open layout's). The format, what the library accepts, and the one deliberate
difference (a name given twice is refused): docs/hardening.md, "Safetensors headers".
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from ..errors import TurboError
from .quant import METADATA_KEY

MAX_HEADER_BYTES = 100_000_000  # the library's limit
# serde_json's recursion limit: the library refuses JSON nested 128 containers deep.
MAX_DEPTH = 127
U64_MAX = 2**64 - 1
METADATA = "__metadata__"
# Every dtype the library knows, in bits per element.
DTYPE_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
              "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
              "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}
FIELDS = ("dtype", "shape", "data_offsets")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # a DTYPE_BITS key
    shape: tuple[int, ...]
    begin: int  # byte offsets relative to the data section
    end: int


@dataclass(frozen=True)
class Header:
    path: Path
    data_start: int  # absolute byte offset of the data section
    tensors: dict[str, TensorInfo]  # in the header's order
    metadata: dict[str, str] | None


class _Object(dict):
    """A JSON object that remembers the keys it was given more than once."""

    duplicates: list[str]


def _object(pairs: list[tuple[str, object]]) -> _Object:
    obj = _Object(pairs)
    obj.duplicates = [k for k in obj if sum(1 for key, _ in pairs if key == k) > 1] if len(obj) < len(pairs) else []
    return obj


def _int(literal: str) -> int | float:
    """JSON integers as serde_json types them: beyond u64 (or i64 below zero) and `-0` are floats,
    so they are not sizes; beyond f64 they are refused."""
    if literal == "-0":
        return -0.0
    value = float(literal) if len(literal) > 25 else int(literal)
    if isinstance(value, int) and -(2**63) <= value <= U64_MAX:
        return value
    return _float(literal)


def _float(literal: str) -> float:
    value = float(literal)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"number {literal[:20]}... out of range")
    return value


def _constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _check_tree(root: object) -> str | None:
    """Why serde_json would refuse what Python's json parsed (too deep, a lone surrogate), if it would."""
    stack = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            items = [*node.keys(), *node.values()]
        elif isinstance(node, list):
            items = node
        else:
            if isinstance(node, str) and any("\ud800" <= c <= "\udfff" for c in node):
                return "a string holds a lone UTF-16 surrogate"
            continue
        if depth > MAX_DEPTH:
            return f"nested more than {MAX_DEPTH} deep"
        stack.extend((item, depth + 1) for item in items)
    return None


def _size(value: object) -> bool:
    return type(value) is int and 0 <= value <= U64_MAX  # bools are ints to Python, not to JSON


def _tensor(path: Path, name: str, meta: object) -> TensorInfo:
    where = f"{path}: tensor {name!r}"
    if isinstance(meta, list) and len(meta) == len(FIELDS):  # serde reads a struct from an array too
        meta = _object(list(zip(FIELDS, meta)))
    if not isinstance(meta, dict):
        raise TurboError(f"{where}: entry is {type(meta).__name__}, expected an object with {', '.join(FIELDS)}")
    if meta.duplicates:
        raise TurboError(f"{where}: field {meta.duplicates[0]!r} is given twice")
    for field in FIELDS:
        if field not in meta:
            raise TurboError(f"{where}: no {field!r} field")
    dtype, shape, offsets = (meta[f] for f in FIELDS)
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise TurboError(f"{where}: dtype {dtype!r}, expected one of {', '.join(DTYPE_BITS)}")
    if not isinstance(shape, list) or not all(_size(d) for d in shape):
        raise TurboError(f"{where}: shape {shape!r}, expected a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_size(o) for o in offsets):
        raise TurboError(f"{where}: data_offsets {offsets!r}, expected [begin, end] non-negative integers")
    return TensorInfo(name, dtype, tuple(shape), offsets[0], offsets[1])


def _check_layout(path: Path, tensors: list[TensorInfo], data_bytes: int) -> None:
    """Sorted by offsets, the tensors must tile the data section; each one's bytes match its shape."""
    at = 0
    for t in sorted(tensors, key=lambda t: (t.begin, t.end)):
        where = f"{path}: tensor {t.name!r}"
        if t.begin != at or t.end < t.begin:
            what = "overlaps the tensor before it" if t.begin < at else f"leaves a gap at byte {at}"
            raise TurboError(f"{where}: data_offsets [{t.begin}, {t.end}] {what}, expected to begin at {at}")
        at = t.end
        count = 1
        for d in t.shape:
            count *= d
        bits = count * DTYPE_BITS[t.dtype]
        if count > U64_MAX or bits > U64_MAX:
            raise TurboError(f"{where}: shape {list(t.shape)} overflows a 64-bit size")
        if bits % 8:
            raise TurboError(f"{where}: {count} {t.dtype} elements are not a whole number of bytes")
        if t.end - t.begin != bits // 8:
            raise TurboError(f"{where}: {t.end - t.begin} bytes, expected {bits // 8} for {t.dtype}{list(t.shape)}")
    if at != data_bytes:
        raise TurboError(f"{path}: the tensors cover {at} data bytes, the file has {data_bytes} "
                         f"({'trailing bytes' if at < data_bytes else 'truncated'})")


def parse_header(path: Path, blob_head: bytes, file_size: int) -> Header:
    """The header of a safetensors file of `file_size` bytes, given its first 8 + n bytes."""
    if file_size < 8 or len(blob_head) < 8:
        raise TurboError(f"{path}: {file_size} bytes, too short for a safetensors header length")
    (n,) = struct.unpack("<Q", blob_head[:8])
    # n is the file's first 8 bytes: an error line must not print it (a linked text file's start)
    if n > MAX_HEADER_BYTES:
        raise TurboError(f"{path}: not a safetensors file (its header length exceeds the format's "
                         f"{MAX_HEADER_BYTES} bytes)")
    if 8 + n > file_size or len(blob_head) < 8 + n:
        raise TurboError(f"{path}: not a safetensors file (its header length runs past the end of the file, "
                         f"{file_size} bytes)")
    try:
        text = blob_head[8:8 + n].decode("utf-8")
    except UnicodeDecodeError:
        raise TurboError(f"{path}: header is not UTF-8") from None
    try:
        header = json.loads(text, object_pairs_hook=_object, parse_int=_int, parse_float=_float,
                            parse_constant=_constant)
        problem = _check_tree(header)
    except RecursionError:
        problem = f"nested more than {MAX_DEPTH} deep"
    except ValueError as e:  # json.JSONDecodeError included
        problem = str(e).splitlines()[0]
    if problem is not None:
        raise TurboError(f"{path}: header is not valid JSON ({problem})")
    if not isinstance(header, dict):
        raise TurboError(f"{path}: header is a JSON {type(header).__name__}, expected an object")
    if header.duplicates:
        raise TurboError(f"{path}: {header.duplicates[0]!r} is listed twice in the header")
    metadata = header.get(METADATA)
    if metadata is not None:
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise TurboError(f"{path}: {METADATA} is {json.dumps(metadata)[:60]}, expected an object of strings")
        if metadata.duplicates:
            raise TurboError(f"{path}: {METADATA} key {metadata.duplicates[0]!r} is given twice")
        metadata = dict(metadata)
    tensors = {name: _tensor(path, name, meta) for name, meta in header.items() if name != METADATA}
    _check_layout(path, list(tensors.values()), file_size - 8 - n)
    return Header(path, 8 + n, tensors, metadata)


def read_header(path: Path) -> Header:
    """Parse and validate one file's header (its tensor data is not read)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) == 8:
                head += f.read(min(struct.unpack("<Q", head)[0], MAX_HEADER_BYTES))
    except OSError as e:
        raise TurboError(f"{path}: cannot read ({e.strerror})") from None
    return parse_header(path, head, size)


def write_tensors(path: Path, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    """`tensors` (name -> a CPU torch tensor of a dtype in ST_NAMES) as a safetensors file, in
    name order (what the trainers export; the `safetensors` package is a test dependency only)."""
    st_names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int32: "I32",
                torch.int64: "I64", torch.uint8: "U8", torch.int8: "I8"}
    header: dict = {METADATA: dict(metadata or {})} if metadata else {}
    blobs, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        blob = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": st_names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section 8-byte aligned, as the library writes it
    with Path(path).open("wb") as out:
        out.write(struct.pack("<Q", len(raw)) + raw)
        for blob in blobs:
            out.write(blob)


@dataclass
class Planned:
    """One output tensor: where it goes and how its bytes are produced."""

    name: str
    dtype: str
    shape: list[int]
    size: int
    write: Callable[[object], None]  # writes exactly `size` bytes to the open output file


def write_safetensors(path: Path, planned: list[Planned], progress: tqdm | None = None,
                      quantized: dict[str, dict] | None = None, metadata: dict[str, str] | None = None,
                      align: int = 8) -> None:
    """`planned` written in order into one safetensors file, the data section `align`-aligned
    in the file (8, as the safetensors library writes; the open layout's 64: mapped as is)."""
    header: dict = {"__metadata__": {"format": "pt", "writer": "turbo.repack", **(metadata or {})}}
    if quantized:
        header["__metadata__"][METADATA_KEY] = json.dumps(quantized, separators=(",", ":"))
    offset = 0
    for p in planned:
        header[p.name] = {"dtype": p.dtype, "shape": p.shape, "data_offsets": [offset, offset + p.size]}
        offset += p.size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % align)  # the data section aligned (8 + len(raw): where it starts)
    with path.open("wb") as out:
        out.write(struct.pack("<Q", len(raw)))
        out.write(raw)
        for p in planned:
            start = out.tell()
            p.write(out)
            if out.tell() - start != p.size:
                raise TurboError(f"{p.name}: wrote {out.tell() - start} bytes, expected {p.size}")
            if progress is not None:
                progress.update(p.size)
