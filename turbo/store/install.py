"""An install directory and its resident index (docs/DESIGN.md 4).

The index is a view over the safetensors headers, built without reading tensor data:
what an install carries (drafter, MTP head, vision tower) is read off it, never off a
manifest flag, so nothing can disagree with the bytes.
"""

from __future__ import annotations

import json
import math
import mmap
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Mapping

import torch

from ..errors import TurboError
from . import layout_file, quant
from .arch import Arch, arch_from_config, read_config_json
from .quant import QuantizedWeight
from .safetensors_format import Header, TensorInfo, read_header
from .template_files import TemplateFiles, end_of_generation_ids, read_template

# The dtype numbering of docs/DESIGN.md 4 (the Rust engine's, section 10).
DTYPE_CODES = {"BF16": 1, "F16": 2, "F32": 3}
TORCH_DTYPES = {1: torch.bfloat16, 2: torch.float16, 3: torch.float32}
ST_TORCH = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "U8": torch.uint8}  # (view)
CODE_NAMES = {1: "bf16", 2: "f16", 3: "f32", 4: "int4", 5: "int8", 15: "int1", 16: "int2", 17: "int4g32", 18: "int4g64",
              19: "int4g128", 25: "int8g32"}

BUNDLED_DIR = Path(__file__).resolve().parent.parent / "installs"  # turbo/installs
DRAFTER_DIR = "dflash"
# What each file of an install may hold: a name outside its file's prefixes would shadow (or
# be shadowed by) the part that owns it. Quantized companions share their weight's prefix.
TRUNK_PREFIXES = ("trunk.", "mtp.", "vision.")
# safetensors __metadata__ key: json {table: "int8" | "int4"}, a tied head read as a copy of its float
# table in that format (repack --float-quant: the layers may mix exact formats with turbo's own)
HEAD_COPY_KEY = "turbo.head_copy"
DRAFTER_PREFIXES = ("dflash.",)
# The most elements one tensor may declare (32 GiB in bf16): the largest of a real Qwen3.5 (a
# fused MoE block's experts, 512 x 2048 x 4096) is a quarter of it. A header past it (a sparse
# file declaring a 64 GB embedding, a config inflated to match) is refused before any read.
MAX_TENSOR_ELEMENTS = 2 ** 34


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: int
    shape: tuple[int, int, int, int]  # absent dims are 0: a rank-1 [n] reads (n, 0, 0, 0)
    file: Path
    offset: int  # absolute byte offset of the data in `file`
    size_bytes: int
    st_dtype: str  # the safetensors dtype string the bytes are stored as
    dims: tuple[int, ...]  # the true shape
    # quantized weights (dtype 4 / 16 / 15): shape and dims are the logical [out, in];
    # offset / size_bytes are the packed U32 payload [out, in*bits/32] (`packed_dims`),
    # its per-group scales and biases (stored as scale_st_dtype) are the companions' bytes
    bits: int = 0
    group: int = 0
    packed_dims: tuple[int, ...] = ()
    scale_offset: int = 0
    scale_size: int = 0
    scale_st_dtype: str = ""
    bias_offset: int = 0
    bias_size: int = 0
    head_bits: int = 0  # a float table whose tied head is read as turbo's int4 / int8 copy (HEAD_COPY_KEY)


def shape4(dims: tuple[int, ...], name: str) -> tuple[int, int, int, int]:
    """The index's four-wide shape: absent dims are 0; a rank-5 tensor (a vision tower's
    Conv3d) folds its trailing dims into the fourth."""
    if len(dims) > 4:
        tail = 1
        for d in dims[3:]:
            tail *= d
        return dims[0], dims[1], dims[2], tail
    return tuple(list(dims) + [0] * (4 - len(dims)))  # type: ignore[return-value]


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    for path in [index, *directory.glob("*.safetensors")]:
        if path.exists() and not path.is_file():  # a directory named like a file is not one
            raise TurboError(f"{path}: not a file (expected the checkpoint's {path.name} to be a regular file)")
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, KeyError, TypeError, ValueError, RecursionError):
            weight_map = None
        # shards are files beside the index: a path elsewhere is not one
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) and f and Path(f).name == f
                                                       for f in weight_map.values()):
            raise TurboError(f"{index}: not a safetensors index (expected a 'weight_map' of file names)")
        return [directory / f for f in sorted(set(weight_map.values()))]
    # (an install's open layout is not weights: turbo/store/layout_file.py)
    return sorted(f for f in directory.glob("*.safetensors") if f.name != layout_file.PACKED_FILE)


class ResidentIndex:
    """name -> Entry over every safetensors file of an install (drafter included)."""

    def __init__(self, files: list[Path], prefixes: Mapping[Path, tuple[str, ...]] | None = None):
        """Every tensor of `files`; a file listed in `prefixes` may only hold names under those."""
        self.entries: dict[str, Entry] = {}
        self.headers: list[Header] = []
        self._maps: dict[Path, mmap.mmap] = {}
        self.packed: dict[str, Entry] = {}  # the open layout's tensors (layout_file), apart from the install's own
        for path in files:
            self.add_file(path, (prefixes or {}).get(path))
        self._attach_quant_companions()
        self._attach_head_copy()

    def add_file(self, path: Path, allowed: tuple[str, ...] | None, packed: bool = False) -> None:
        """Every tensor of `path` (only names under `allowed`, where given) into the index (`packed`:
        the open layout's file, into `packed`)."""
        if not path.is_file():
            raise TurboError(f"{path}: missing (listed by the install)")
        header = read_header(path)
        for name, info in header.tensors.items():
            if allowed is not None and not name.startswith(allowed):
                raise TurboError(f"{path}: tensor {name} does not belong in this file "
                                 f"(expected names under {', '.join(allowed)})")
            if name in self.entries:
                raise TurboError(f"{path}: tensor {name} is also in {self.entries[name].file}")
            self._add(info, header, self.packed if packed else self.entries)
        if not packed:
            self.headers.append(header)

    def _add(self, info: TensorInfo, header: Header, into: dict[str, Entry]) -> None:
        count = math.prod(info.shape)
        if count > MAX_TENSOR_ELEMENTS:  # before anything is mapped or allocated for it
            raise TurboError(f"{header.path}: tensor {info.name} declares {count} elements {list(info.shape)}, "
                             f"over turbo's bound of 2^34 for one tensor")
        code = DTYPE_CODES.get(info.dtype, 0)  # 0: raw storage (packed quantized payloads, scales)
        into[info.name] = Entry(info.name, code, shape4(info.shape, info.name), header.path,
                                header.data_start + info.begin, info.end - info.begin, info.dtype, info.shape)

    def _attach_quant_companions(self) -> None:
        """Fold `name.scales` / `name.biases` into `name`'s entry for every tensor the files'
        `__metadata__["turbo.quant"]` map lists ({name: {code, group, bits}}, written by
        python -m turbo.repack --quant): dtype 4 / 16 / 15, the logical shape, and the
        companions' offsets and sizes. Malformed entries are refused naming the tensor."""
        declared = self._metadata_map(quant.METADATA_KEY)
        for name, spec in declared.items():
            e = self.entries.get(name)
            if e is None:
                raise TurboError(f"{name}: listed as quantized in the metadata but not in the install")
            if not isinstance(spec, dict) or not all(spec.get(k) is None or type(spec[k]) is int
                                                     for k in ("code", "bits", "group")):
                raise TurboError(f"{name}: quantization metadata {str(spec)[:80]} is not an object of integer "
                                 f"code, bits and group")
            fmt = quant.format_for(spec.get("code"), spec.get("bits"), spec.get("group"), name)
            if e.st_dtype != "U32":
                raise TurboError(f"{name}: quantized as {fmt.name} but stored as {e.st_dtype}, expected U32")
            sc, bi = self.entries.get(name + ".scales"), self.entries.get(name + ".biases")
            if sc is None or bi is None:
                raise TurboError(f"{name}: quantized as {fmt.name} but {name}.scales / {name}.biases are missing")
            for comp in (sc, bi):
                if comp.st_dtype != fmt.scale_st:
                    raise TurboError(f"{comp.name}: stored as {comp.st_dtype}, {fmt.name} (dtype {fmt.code}) keeps "
                                     f"{fmt.scale_st} scales and biases")
            out, cols = quant.check_shapes(name, fmt, e.dims, sc.dims, bi.dims)
            self.entries[name] = Entry(name, fmt.code, shape4((out, cols), name), e.file, e.offset, e.size_bytes,
                                       e.st_dtype, (out, cols), bits=fmt.bits, group=fmt.group, packed_dims=e.dims,
                                       scale_offset=sc.offset, scale_size=sc.size_bytes, scale_st_dtype=fmt.scale_st,
                                       bias_offset=bi.offset, bias_size=bi.size_bytes)
        for name, e in self.entries.items():
            if name.endswith(".scales") and name[:-len(".scales")] in self.entries \
                    and self.entries[name[:-len(".scales")]].st_dtype == "U32" and name[:-len(".scales")] not in declared:
                raise TurboError(f"{name[:-len('.scales')]}: packed U32 with .scales but no {quant.METADATA_KEY} "
                                 f"metadata (repack it with python -m turbo.repack)")

    def _metadata_map(self, key: str) -> dict:
        """The JSON objects the files' `__metadata__[key]` hold, merged."""
        merged: dict = {}
        for header in self.headers:
            raw = (header.metadata or {}).get(key)
            if raw is None:
                continue
            try:
                table = json.loads(raw)
            except (ValueError, RecursionError):
                table = None
            if not isinstance(table, dict):
                raise TurboError(f"{header.path}: __metadata__[{key!r}] is not a JSON object")
            merged.update(table)
        return merged

    def _attach_head_copy(self) -> None:
        """The tied head's format repack --float-quant recorded (HEAD_COPY_KEY), on its table's entry."""
        for name, fmt in self._metadata_map(HEAD_COPY_KEY).items():
            e = self.entries.get(name)
            if fmt not in ("int8", "int4") or e is None or e.bits or e.st_dtype not in DTYPE_CODES or len(e.dims) != 2:
                raise TurboError(f"{name}: {HEAD_COPY_KEY} {str(fmt)[:20]!r} does not name int8 / int4 for a float "
                                 f"matrix of the install")
            self.entries[name] = replace(e, head_bits=quant.FORMATS[fmt].bits)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def get(self, name: str) -> Entry | None:
        return self.entries.get(name)

    def need(self, name: str) -> Entry:
        entry = self.entries.get(name)
        if entry is None:
            raise TurboError(f"missing tensor {name} (not in the install's resident index)")
        return entry

    def has_prefix(self, prefix: str) -> bool:
        return any(n.startswith(prefix) for n in self.entries)

    def _read_into(self, file: Path, offset: int, out: torch.Tensor, name: str) -> torch.Tensor:
        """`out`'s bytes read from `file` at `offset`, straight into its buffer (no staging copy:
        a load holds each tensor once)."""
        view = memoryview(out.view(torch.uint8).reshape(-1).numpy()) if out.numel() else memoryview(b"")
        with file.open("rb", buffering=0) as f:
            f.seek(offset)
            done = 0
            while done < len(view):  # a raw read may return less than asked (Linux caps one at ~2 GB)
                got = f.readinto(view[done:])
                if not got:
                    raise TurboError(f"{file}: truncated while reading {name}")
                done += got
        return out

    def _float_dtype(self, e: Entry) -> torch.dtype:
        # every unquantized weight is a float: integer bytes read as one would change the output silently
        torch_dtype = TORCH_DTYPES.get(DTYPE_CODES.get(e.st_dtype, 0))
        if torch_dtype is None:
            raise TurboError(f"{e.name}: stored as {e.st_dtype}, expected one of BF16, F16, F32")
        return torch_dtype

    def load_quantized(self, name: str, dtype: torch.dtype = torch.float32, mapped: bool = False):
        """A quantized entry as a packed `quant.QuantizedWeight` (compute dtype `dtype`). mapped:
        its codes, scales and biases as views of the file mapped copy-on-write (pages read when
        first touched: a table of which a step reads a few rows), where each is aligned for its
        dtype; otherwise read."""
        e = self.need(name)
        if not e.bits:
            raise TurboError(f"{name}: dtype {e.dtype} is not a quantized format")
        sdt = TORCH_DTYPES[DTYPE_CODES[e.scale_st_dtype]]
        rows, groups = e.dims[0], e.dims[1] // e.group
        parts = ((e.offset, torch.int32, tuple(e.packed_dims)), (e.scale_offset, sdt, (rows, groups)),
                 (e.bias_offset, sdt, (rows, groups)))
        if mapped and all(offset % tdtype.itemsize == 0 for offset, tdtype, _ in parts):
            file = self._map(e.file)
            tensors = [torch.frombuffer(file, dtype=tdtype, count=math.prod(shape), offset=offset).view(shape)
                       for offset, tdtype, shape in parts]  # (sizes: checked)
        else:
            tensors = [self._read_into(e.file, offset, torch.empty(shape, dtype=tdtype), name)
                       for offset, tdtype, shape in parts]
        return QuantizedWeight(*tensors, e.bits, e.group, dtype, float8=e.dtype in quant.FLOAT8_CODES)

    def _map(self, file: Path) -> mmap.mmap:
        if file not in self._maps:
            with file.open("rb") as f:
                self._maps[file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return self._maps[file]

    def load(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Read one tensor's bytes (and only those) from its file. A quantized weight is
        returned dequantized, in its logical shape (fp32 unless `dtype`)."""
        e = self.need(name)
        if e.bits:
            return self.load_quantized(name).dequantize(dtype or torch.float32)
        t = self._read_into(e.file, e.offset, torch.empty(e.dims, dtype=self._float_dtype(e)), name)
        return t.to(dtype) if dtype is not None else t

    def view(self, name: str) -> torch.Tensor | None:
        """An unquantized tensor as a view of its file mapped copy-on-write (pages read when first
        touched, shared with the page cache; nothing is read now), in its stored dtype and shape;
        None where its bytes are not aligned for that dtype. Also the open layout's tensors."""
        e = self.packed[name] if name in self.packed else self.need(name)
        dtype = ST_TORCH.get(e.st_dtype)
        if dtype is None or e.bits or e.offset % dtype.itemsize or not e.size_bytes:
            return None
        flat = torch.frombuffer(self._map(e.file), dtype=dtype, count=e.size_bytes // dtype.itemsize, offset=e.offset)
        return flat.view(e.dims)

    def rows(self, name: str, r0: int, r1: int, scratch: dict[torch.dtype, torch.Tensor]) -> torch.Tensor:
        """Rows r0..r1 of an unquantized matrix, in its stored dtype, read on their own into
        `scratch` (a flat buffer per dtype, grown as needed and reused: a matrix is packed a
        slice at a time, so loading never holds a second copy of it nor faults in fresh pages)."""
        e = self.need(name)
        dtype, cols = self._float_dtype(e), e.dims[1]
        size = (r1 - r0) * cols
        if dtype not in scratch or scratch[dtype].numel() < size:
            scratch[dtype] = torch.empty(size, dtype=dtype)
        out = scratch[dtype][:size].view(r1 - r0, cols)
        return self._read_into(e.file, e.offset + r0 * cols * out.element_size(), out, name)

def install_has_dflash(index: ResidentIndex) -> bool:
    return "dflash.fc.weight" in index


def install_has_mtp(index: ResidentIndex) -> bool:
    return "mtp.fc.weight" in index


def install_has_vision(index: ResidentIndex) -> bool:
    return index.has_prefix("vision.")


@dataclass
class Install:
    path: Path
    name: str
    config: dict
    arch: Arch
    index: ResidentIndex
    drafter_config: dict | None
    # the open layout (turbo/store/layout_file.py): whether its packed file is indexed, else why not
    packed: bool = False
    layout_note: str | None = None

    @property
    def has_dflash(self) -> bool:
        return install_has_dflash(self.index)

    @property
    def has_mtp(self) -> bool:
        return install_has_mtp(self.index)

    @property
    def has_vision(self) -> bool:
        return install_has_vision(self.index)

    # read on first use: opening an install (and raw completion) never depends on these files
    @cached_property
    def template_files(self) -> TemplateFiles:
        return read_template(self.path)

    @property
    def chat_template(self) -> str | None:
        """The checkpoint's chat template as repack kept it; None: it completes raw text only."""
        return self.template_files.source

    @cached_property
    def eos_ids(self) -> tuple[int, ...]:
        """config.json's eos ids, then generation_config.json's that are not among them: what every
        generation stops at (raw, chat, both server endpoints) unless stop_at_eos is off."""
        return end_of_generation_ids(self.arch.eos_token_ids, self.path, self.arch.vocab)


def bundled_names() -> list[str]:
    if not BUNDLED_DIR.is_dir():
        return []
    return sorted(p.name for p in BUNDLED_DIR.iterdir() if (p / "config.json").is_file())


def shipped_name(path_or_name: str | Path) -> str | None:
    """The shipped install `path_or_name` names: only a bare str ("tiny"), never a Path or a
    string with a slash ("./tiny"), so a directory in the working directory cannot stand in for it."""
    if isinstance(path_or_name, str) and "/" not in path_or_name and path_or_name in bundled_names():
        return path_or_name
    return None


def resolve(path_or_name: str | Path) -> Path:
    """The name of an install shipped inside the package, or else a directory."""
    name = shipped_name(path_or_name)
    if name is not None:
        return BUNDLED_DIR / name
    p = Path(path_or_name).expanduser()
    if p.is_dir():
        return p
    shipped = ", ".join(bundled_names()) or "none"
    raise TurboError(f"install {str(path_or_name)!r}: no such directory (expected an install directory or a shipped name: {shipped})")


def open_install(path_or_name: str | Path) -> Install:
    root = resolve(path_or_name)
    config = read_config_json(root / "config.json")
    arch = arch_from_config(config, str(root / "config.json"))
    files = safetensors_files(root)
    if not files:
        raise TurboError(f"{root}: no model.safetensors (expected the install's weights)")
    drafter_config = None
    drafter_dir = root / DRAFTER_DIR
    if drafter_dir.is_dir():
        drafter_config = read_config_json(drafter_dir / "config.json")
        drafter_files = safetensors_files(drafter_dir)
        if not drafter_files:
            raise TurboError(f"{drafter_dir}: no model.safetensors (expected the drafter's weights)")
        files = files + drafter_files
    prefixes = {f: DRAFTER_PREFIXES if f.parent == drafter_dir else TRUNK_PREFIXES for f in files}
    index = ResidentIndex(files, prefixes)
    if not index.has_prefix("trunk."):
        raise TurboError(f"{root}: no trunk.* tensors (expected an install made by python -m turbo.repack)")
    packed, note = layout_file.check(root, safetensors_files(root))
    if packed is not None:
        index.add_file(packed, (layout_file.PREFIX,), packed=True)
    name = shipped_name(path_or_name) or root.name
    return Install(root, name, config, arch, index, drafter_config, packed is not None, note)
