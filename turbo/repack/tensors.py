"""How each output tensor of a repack is produced: copied in bounded chunks, quantized a slice
of rows at a time, or carried packed from an MLX-layout source. `plan_tensors` decides, `Planned`
(turbo/store/safetensors_format.py) is the result; docs/DESIGN.md 4 has the formats and what is quantized."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from ..errors import TurboError
from ..store import quant as q
from ..store.quant import QUANT_SLICE
from ..store.safetensors_format import Planned

COPY_CHUNK = 4 * 1024 * 1024
FLOAT_ST = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
ST_BYTES = {"BF16": 2, "F16": 2, "F32": 4}


Pieces = list[tuple[int, int]]  # a tensor's bytes: (absolute offset, size) ranges of its file, in order


def _copier(path: Path, pieces: Pieces) -> Callable[[object], None]:
    def write(out) -> None:
        with path.open("rb") as f:
            for offset, size in pieces:
                f.seek(offset)
                left = size
                while left:
                    chunk = f.read(min(COPY_CHUNK, left))
                    if not chunk:
                        raise TurboError(f"{path}: truncated while copying")
                    out.write(chunk)
                    left -= len(chunk)
    return write


def _pieces(meta: dict, data_start: int) -> Pieces:
    """A source tensor's bytes: its data_offsets, or the ranges of a tensor cut out of another
    (`pieces`, relative to the data start: an expert out of a fused stack, see moe)."""
    spans = meta["pieces"] if "pieces" in meta else [meta["data_offsets"]]
    return [(data_start + b, e - b) for b, e in spans]


def plan_copy(name: str, meta: dict, path: Path, data_start: int) -> Planned:
    pieces = _pieces(meta, data_start)
    return Planned(name, meta["dtype"], list(meta["shape"]), sum(n for _, n in pieces), _copier(path, pieces))


def quantizable(new: str, meta: dict, fmt: q.QFormat) -> bool:
    """The rank-2 projection matrices (docs/DESIGN.md 4); everything else stays float."""
    if meta["dtype"] not in FLOAT_ST or len(meta["shape"]) != 2 or not new.endswith(".weight"):
        return False
    if not all(meta["shape"]):  # an empty matrix (a shared expert of width 0) stays as it is
        return False
    module = new[:-len(".weight")].rsplit(".", 1)[-1]
    if new.startswith("vision."):  # the tower's attention and MLP / merger matrices (turbo/vision/tower.py)
        return module in ("qkv", "proj", "linear_fc1", "linear_fc2") and meta["shape"][1] % fmt.group == 0
    if not new.startswith(("trunk.", "mtp.", "dflash.")):
        return False
    if not (module.endswith("_proj") or module.startswith("in_proj") or module in ("fc", "lm_head")):
        return False
    return meta["shape"][1] % fmt.group == 0


def _read_span(path: Path, pieces: Pieces, begin: int, size: int, name: str) -> bytearray:
    """Bytes begin..begin+size of a source tensor (counted over its pieces, in order)."""
    data, at, skip = bytearray(size), 0, begin
    with path.open("rb") as f:
        for offset, n in pieces:
            if skip >= n:
                skip -= n
                continue
            take = min(n - skip, size - at)
            f.seek(offset + skip)
            if f.readinto(memoryview(data)[at:at + take]) != take:
                raise TurboError(f"{path}: truncated while reading {name}")
            at, skip = at + take, 0
            if at == size:
                break
    return data


def _load_source(path: Path, pieces: Pieces, st: str, shape: list[int], name: str, r0: int = 0,
                 r1: int | None = None) -> torch.Tensor:
    """Rows r0..r1 (all by default) of a source matrix: the one copy of them in memory."""
    r1 = shape[0] if r1 is None else r1
    row = ST_BYTES[st] * (int(torch.Size(shape[1:]).numel()) if len(shape) > 1 else 1)
    data = _read_span(path, pieces, r0 * row, (r1 - r0) * row, name)
    return torch.frombuffer(data, dtype=getattr(torch, FLOAT_ST[st])).reshape([r1 - r0, *shape[1:]])


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


class _QuantJob:
    """Quantizes one source tensor a slice of rows at a time when its packed weight is written,
    keeping the slices' scales and biases (1/32 of a bf16 source's bytes) for the two tensors
    written right after; then drops them."""

    def __init__(self, name: str, path: Path, pieces: Pieces, st: str, shape: list[int], fmt: q.QFormat):
        self.args = (path, pieces, st, shape, name)
        self.fmt, self.name, self.parts = fmt, name, None

    def writer(self, i: int) -> Callable[[object], None]:
        def write(out) -> None:
            if i == 0:
                rows, cols = self.args[3]
                step = max(1, QUANT_SLICE // cols)
                self.parts = [[], []]
                for r0 in range(0, rows, step):
                    w = _load_source(*self.args, r0, min(rows, r0 + step))
                    packed, scales, biases = q.quantize(w, self.fmt, self.name)
                    out.write(packed.contiguous().view(-1).view(torch.uint8).numpy())
                    self.parts[0].append(_tensor_bytes(scales))
                    self.parts[1].append(_tensor_bytes(biases))
                    del w, packed  # (before the next slice is read)
                return
            for chunk in self.parts[i - 1]:
                out.write(chunk)
            self.parts[i - 1] = []
            if i == 2:
                self.parts = None
        return write


def _mlx_spec(config: dict, module: str) -> tuple[int, int] | None:
    """(bits, group) an MLX-layout config declares for `module` (per-module overrides first)."""
    spec = config.get("quantization") or config.get("quantization_config")
    if not isinstance(spec, dict):
        return None
    over = spec.get(module)
    if isinstance(over, dict) and "bits" in over:
        spec = over
    try:
        return int(spec["bits"]), int(spec["group_size"])
    except (KeyError, TypeError, ValueError):
        return None


def _cast_writer(path: Path, pieces: Pieces, st: str, shape: list[int], name: str, to_st: str):
    def write(out) -> None:
        out.write(_tensor_bytes(_load_source(path, pieces, st, shape, name).to(getattr(torch, FLOAT_ST[to_st]))))
    return write


def plan_tensors(tensors: list[tuple[str, str, dict, Path, int]], fmt: q.QFormat | None,
                 quantized: dict[str, dict], config: dict) -> list[Planned]:
    """Copy, quantize, or carry (already packed) each (source name, install name, meta, file, data start)."""
    by_src = {t[0]: t for t in tensors}
    companions = {n for n in by_src if n.endswith((".scales", ".biases"))}
    planned = []
    for name, new, meta, path, data_start in tensors:
        if name in companions:
            base = name.rsplit(".", 1)[0]
            if not any(by_src.get(c, (0, 0, {}))[2].get("dtype") == "U32" for c in (base + ".weight", base)):
                raise TurboError(f"{name}: quantization scales/biases without a packed U32 {base}.weight")
            continue
        if meta["dtype"] == "U32" and name.endswith(".weight"):
            # an MLX-layout quantized source: carry it packed
            base = name[:-len(".weight")]
            mspec = _mlx_spec(config, base)
            if mspec is None:
                raise TurboError(f"{name}: packed U32 weight but config.json declares no quantization "
                                 f"{{group_size, bits}}")
            src_fmt = q.format_for(bits=mspec[0], group=mspec[1], name=name)
            if fmt is not None and fmt != src_fmt:
                raise TurboError(f"{name}: the checkpoint is already {src_fmt.name}; --quant {fmt.name} would "
                                 f"requantize it (use --quant none or --quant {src_fmt.name})")
            sc, bi = by_src.get(base + ".scales"), by_src.get(base + ".biases")
            if sc is None or bi is None:
                raise TurboError(f"{name}: packed U32 weight without {base}.scales / {base}.biases")
            for comp in (sc, bi):
                if comp[2]["dtype"] not in FLOAT_ST:
                    raise TurboError(f"{comp[0]}: stored as {comp[2]['dtype']}, expected BF16, F16 or F32")
            q.check_shapes(name, src_fmt, tuple(meta["shape"]), tuple(sc[2]["shape"]), tuple(bi[2]["shape"]))
            planned.append(plan_copy(new, meta, path, data_start))
            for suffix, comp in ((".scales", sc), (".biases", bi)):
                cb, ce = comp[2]["data_offsets"]
                if comp[2]["dtype"] == src_fmt.scale_st:
                    planned.append(Planned(new + suffix, src_fmt.scale_st, list(comp[2]["shape"]), ce - cb,
                                           _copier(comp[3], [(comp[4] + cb, ce - cb)])))
                else:
                    count = (ce - cb) // ST_BYTES[comp[2]["dtype"]]
                    planned.append(Planned(new + suffix, src_fmt.scale_st, list(comp[2]["shape"]), count * 2,
                                           _cast_writer(comp[3], [(comp[4] + cb, ce - cb)], comp[2]["dtype"],
                                                        list(comp[2]["shape"]), comp[0], src_fmt.scale_st)))
            quantized[new] = {"code": src_fmt.code, "group": src_fmt.group, "bits": src_fmt.bits}
        elif fmt is not None and quantizable(new, meta, fmt):
            rows, cols = meta["shape"]
            job = _QuantJob(new, path, _pieces(meta, data_start), meta["dtype"], meta["shape"], fmt)
            groups = cols // fmt.group
            planned.append(Planned(new, "U32", [rows, cols * fmt.bits // 32], rows * cols * fmt.bits // 8, job.writer(0)))
            planned.append(Planned(new + ".scales", fmt.scale_st, [rows, groups], rows * groups * 2, job.writer(1)))
            planned.append(Planned(new + ".biases", fmt.scale_st, [rows, groups], rows * groups * 2, job.writer(2)))
            quantized[new] = {"code": fmt.code, "group": fmt.group, "bits": fmt.bits}
        else:
            planned.append(plan_copy(new, meta, path, data_start))
    return planned
