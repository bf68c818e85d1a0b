"""Which checkpoint a repack reads: `detect` names the source format from config.json's
`quantization_config` and the tensors present (bf16/fp32, MLX affine, FP8 block-wise, AWQ, GPTQ,
compressed-tensors pack-quantized), refusing an unknown or mixed one; fp8.py and int4.py turn the
quantized modules of an FP8 / int4 source into planned install tensors (source.py: `plan_source`).
docs/formats.md has each format and what the conversion keeps exactly."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import TurboError
from ..store import quant as q
from .tensors import Planned

# The tensor suffixes each quantized format stores per module (the module's weight replaced by them).
SUFFIXES = {
    "fp8": (".weight_scale_inv",),
    "awq": (".qweight", ".qzeros", ".scales"),
    "gptq": (".qweight", ".qzeros", ".scales", ".g_idx"),
    "compressed-tensors": (".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_shape"),
}
FOREIGN = {".qweight", ".qzeros", ".g_idx", ".weight_packed", ".weight_zero_point", ".weight_scale_inv",
           ".weight_shape"}
ST_TORCH = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I32": torch.int32,
            "I64": torch.int64, "I8": torch.int8, "U8": torch.uint8, "F8_E4M3": torch.float8_e4m3fn}
Source = tuple  # (source name, install name, meta, file, data start), as repack/source.py plans them


@dataclass
class SourceFormat:
    """What a checkpoint is: `kind` (none, mlx, fp8, awq, gptq, compressed-tensors) and the
    parameters its conversion needs (group size, block, symmetry, act order, zero offset)."""

    kind: str
    bits: int = 0
    group: int = 0
    block: tuple[int, int] = (0, 0)
    symmetric: bool = False
    zero_offset: int = 0  # GPTQ v1 stores zero - 1
    notes: list[str] = field(default_factory=list)

    def describe(self, fmt: q.QFormat | None, floats: q.QFormat | None = None) -> str:
        """The first line a repack prints: what it found and what it will write (`floats`: the
        format of the float matrices, repack --float-quant)."""
        line = self._describe(fmt)
        return line if floats is None else f"{line}, the float matrices (and the tied head's copy) as {floats.name}"

    def _describe(self, fmt: q.QFormat | None) -> str:
        if self.kind == "none":
            return f"found a float checkpoint; writing {'a float install' if fmt is None else fmt.name + ' matrices'}"
        if self.kind == "mlx":
            return "found an MLX affine-quantized checkpoint; writing its packed matrices as they are"
        if self.kind == "fp8":
            what = f"FP8 e4m3 in {self.block[0]}x{self.block[1]} blocks"
            out = ("fp8 matrices (e4m3 codes and block scales; transformers' bf16 dequantization, bit for bit)"
                   if fmt is None else f"{fmt.name} matrices")
            return f"found {what}; writing {out}"
        zeros = "symmetric" if self.symmetric else "zero points"
        out = f"int4g{self.group} (exact: fp32 scales and biases)" if fmt is None else fmt.name
        return f"found {self.kind} int{self.bits} (group {self.group}, {zeros}); writing {out} matrices"


def _spec(config: dict) -> dict | None:
    spec = config.get("quantization_config")
    return spec if isinstance(spec, dict) else None


def _int(spec: dict, key: str, where: str, allowed: tuple[int, ...]) -> int:
    v = spec.get(key)
    if type(v) is not int or v not in allowed:
        raise TurboError(f"{where}: quantization_config {key} is {v!r}, expected one of {', '.join(map(str, allowed))}")
    return v


def _compressed_tensors(spec: dict, where: str) -> SourceFormat:
    if spec.get("format") != "pack-quantized":
        raise TurboError(f"{where}: compressed-tensors format {spec.get('format')!r} is not read "
                         f"(expected 'pack-quantized' int4)")
    groups = spec.get("config_groups")
    weights = [g.get("weights") for g in groups.values() if isinstance(g, dict)] if isinstance(groups, dict) else []
    if len(weights) != 1 or not isinstance(weights[0], dict):
        raise TurboError(f"{where}: compressed-tensors config_groups should hold one weights scheme")
    w = weights[0]
    if w.get("type", "int") != "int" or w.get("strategy") != "group" or w.get("actorder") not in (None, False):
        raise TurboError(f"{where}: compressed-tensors weights {w.get('type')!r} / {w.get('strategy')!r} "
                         f"(actorder {w.get('actorder')!r}) are not read (expected int, group, no act order)")
    return SourceFormat("compressed-tensors", _int(w, "num_bits", where, (4,)), _int(w, "group_size", where, (32, 64, 128)),
                        symmetric=bool(w.get("symmetric", True)))


def _declared(config: dict, where: str) -> SourceFormat:
    spec = _spec(config)
    if spec is None or "quant_method" not in spec:
        mlx = config.get("quantization") or spec
        return SourceFormat("mlx" if isinstance(mlx, dict) and "bits" in mlx else "none")
    method = spec["quant_method"]
    if method == "fp8":
        block = spec.get("weight_block_size")
        if spec.get("fmt", "e4m3") != "e4m3" or not (isinstance(block, list) and len(block) == 2
                                                     and all(type(b) is int and b > 0 for b in block)):
            raise TurboError(f"{where}: fp8 quantization_config (fmt {spec.get('fmt')!r}, weight_block_size "
                             f"{block!r}) is not read (expected e4m3 in blocks [rows, cols])")
        return SourceFormat("fp8", 8, block=(block[0], block[1]))
    if method == "awq":
        if str(spec.get("version", "gemm")).lower() != "gemm" or spec.get("zero_point", True) is not True:
            raise TurboError(f"{where}: AWQ version {spec.get('version')!r} (zero_point {spec.get('zero_point')!r}) is "
                             f"not read (expected the GEMM layout with zero points)")
        return SourceFormat("awq", _int(spec, "bits", where, (4,)), _int(spec, "group_size", where, (32, 64, 128)))
    if method == "gptq":
        fmt = spec.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise TurboError(f"{where}: GPTQ checkpoint_format {fmt!r} is not read (expected gptq or gptq_v2)")
        return SourceFormat("gptq", _int(spec, "bits", where, (4,)), _int(spec, "group_size", where, (32, 64, 128)),
                            symmetric=bool(spec.get("sym", True)), zero_offset=1 if fmt == "gptq" else 0)
    if method == "compressed-tensors":
        return _compressed_tensors(spec, where)
    raise TurboError(f"{where}: quantization method {method!r} is not one repack reads "
                     f"(fp8, awq, gptq, compressed-tensors, or an MLX affine checkpoint)")


def detect(config: dict, tensors: dict[str, dict], where: str) -> SourceFormat:
    """The source format config.json declares, checked against its tensors: a tensor of
    another format (or quantized tensors an unquantized config does not declare) is refused."""
    found = _declared(config, where)
    own = set(SUFFIXES.get(found.kind, ()))
    for name, meta in tensors.items():
        suffix = "." + name.rsplit(".", 1)[-1]
        if (suffix in FOREIGN and suffix not in own) or (meta["dtype"] == "F8_E4M3" and found.kind != "fp8"):
            raise TurboError(f"{where}: {name} ({meta['dtype']}) is not a {found.kind} checkpoint's tensor "
                             f"(a mixed or unknown format; repack reads one format at a time)")
    return found


def read(src: Source, name: str | None = None) -> torch.Tensor:
    """A source tensor's values (its file's bytes, in its stored dtype and shape)."""
    _, _, meta, path, data_start = src
    begin, end = meta["data_offsets"]
    if meta["dtype"] not in ST_TORCH:
        raise TurboError(f"{name or src[0]}: stored as {meta['dtype']}, not a dtype of its format")
    data = bytearray(end - begin)
    with path.open("rb") as f:
        f.seek(data_start + begin)
        if f.readinto(data) != end - begin:
            raise TurboError(f"{path}: truncated while reading {src[0]}")
    return torch.frombuffer(data, dtype=ST_TORCH[meta["dtype"]]).reshape(meta["shape"]) if data else \
        torch.empty(meta["shape"], dtype=ST_TORCH[meta["dtype"]])


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


class Parts:
    """A module's output tensors computed once, when the first is written, and dropped after
    the last: one source module in memory at a time."""

    def __init__(self, compute: Callable[[], list[torch.Tensor]]):
        self.compute, self.parts = compute, None

    def planned(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[Planned]:
        out = []
        for i, (name, st, shape) in enumerate(zip(names, dtypes, shapes)):
            size = q_size(st, shape)
            out.append(Planned(name, st, shape, size, self._writer(i, len(names))))
        return out

    def _writer(self, i: int, n: int) -> Callable[[object], None]:
        def write(out) -> None:
            if self.parts is None:
                self.parts = [tensor_bytes(t) for t in self.compute()]
            out.write(self.parts[i])
            self.parts[i] = b""
            if i == n - 1:
                self.parts = None
        return write


def q_size(st: str, shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * {"U32": 4, "F32": 4, "BF16": 2, "F16": 2}[st]


def quantized_planned(new: str, compute: Callable[[], tuple[torch.Tensor, ...]], rows: int, cols: int,
                      fmt: q.QFormat, quantized: dict[str, dict]) -> list[Planned]:
    """The packed weight, scales and biases of install matrix `new` [rows, cols] in `fmt`."""
    groups = cols // fmt.group
    quantized[new] = {"code": fmt.code, "group": fmt.group, "bits": fmt.bits}
    return Parts(lambda: list(compute())).planned(
        [new, new + ".scales", new + ".biases"], ["U32", fmt.scale_st, fmt.scale_st],
        [[rows, cols * fmt.bits // 32], [rows, groups], [rows, groups]])


def modules(tensors: list[Source], suffixes: tuple[str, ...]) -> tuple[dict[str, dict[str, Source]], list[Source]]:
    """The tensors grouped by module (install name before the suffix) for those ending in one of
    `suffixes`, and the rest."""
    by_module: dict[str, dict[str, Source]] = {}
    rest = []
    for t in tensors:
        suffix = next((s for s in suffixes if t[1].endswith(s)), None)
        if suffix is None:
            rest.append(t)
        else:
            by_module.setdefault(t[1][:-len(suffix)], {})[suffix] = t
    return by_module, rest


def need_shape(src: Source, shape: list[int], why: str) -> None:
    if list(src[2]["shape"]) != shape:
        raise TurboError(f"{src[0]}: shape {src[2]['shape']}, expected {shape} ({why})")
