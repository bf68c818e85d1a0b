"""HF checkpoint (+ DFlash drafter) -> turbo install, streaming tensor by tensor.

    python -m turbo.repack SRC OUT [--drafter DIR] [--mtp DIR] [--text-only] [--quant none|int4|int8|int2|int1]

Peak memory stays at one copy buffer: tensor bytes are copied from the source file to
the output file in bounded chunks, never materialised as a whole model. The output is
written into a temporary sibling directory and renamed at the end, so an interrupted
repack leaves no half install behind: Ctrl-C or SIGTERM remove it (one line, `interrupted`),
and one left by a repack killed outright is removed by the next repack into that directory.

MoE checkpoints (Qwen3.5-MoE, Qwen3-Next) come out in one layout whichever expert layout they
carry: every expert's matrices on their own (see "MoE checkpoints" below for how a fused stack
is cut without holding it).

--quant int4|int8|int2|int1 quantizes the rank-2 projection matrices (turbo/quant.py: int4
and int8 in groups of 64 with bf16 scales, dtypes 4 and 5; int2 / int1 in groups of 128 with
f16 scales, dtypes 16 / 15), one tensor in memory at a time, as `name` (packed U32) + `name.scales` +
`name.biases`, recording {name: {code, group, bits}} in the file's __metadata__["turbo.quant"].
Quantized: weights of modules named `*_proj` or `in_proj*` (attention q/k/v/o, linear-attention
in_proj_qkv/z/b/a and out_proj, MLP gate/up/down, every routed and shared expert's), `fc` (the
drafter's / MTP's fusion) and an
untied `lm_head`, under trunk.*, mtp.* and dflash.*. Kept float: embeddings, norms, conv
kernels, A_log, dt_bias, routers, the drafter's kernel_projection / base_kernel and candidate
selector (small and precision-critical), the vision tower, and any projection whose input width
the group does not divide. A source already quantized in the MLX layout (U32 `weight` +
`scales` + `biases`, `quantization: {group_size, bits}` in config.json) is carried packed as is,
no round trip through bf16; its scales / biases are cast to the format's storage dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from tqdm import tqdm

from .arch import Arch, arch_from_config, read_config_json
from .chat_template import check_checkpoint
from .drafters import mtp
from .drafters.dflash_config import ARCHITECTURES as DRAFTER_ARCHITECTURES
from .errors import TurboError
from .install import DRAFTER_DIR, safetensors_files
from .safetensors_format import read_header
from . import quant as q

COPY_CHUNK = 4 * 1024 * 1024
# A repack writes into the hidden sibling `.OUT.repack-PID-RANDOM` and renames it when done.
TMP_MARK = ".repack-"
TMP_PATTERN = re.compile(r"\..+\.repack-(\d+)-[0-9a-f]{8}")
# Copied as they are: the chat template (chat_template.jinja, or tokenizer_config.json's) and
# generation_config.json's eos ids travel with the install (turbo/chat_template.py reads them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "vocab.json", "merges.txt")
# Checkpoint name prefix -> install prefix, most specific first. A Qwen3_5ForConditionalGeneration
# checkpoint's MTP head sits at the top level beside model.language_model.* and keeps its names
# (vLLM's vllm/model_executor/models/qwen3_5_mtp.py loads `mtp.*` as they are published).
RENAMES = (
    ("model.language_model.", "trunk."),
    ("model.visual.", "vision."),
    ("model.vision_tower.", "vision."),
    ("visual.", "vision."),
    ("model.", "trunk."),
    ("lm_head.", "trunk.lm_head."),
    ("mtp.", "mtp."),
    # an install as the source (e.g. quantizing one: python -m turbo.repack INSTALL OUT --quant int4)
    ("trunk.", "trunk."),
    ("vision.", "vision."),
)


@dataclass
class Planned:
    """One output tensor: where it goes and how its bytes are produced."""

    name: str
    dtype: str
    shape: list[int]
    size: int
    write: Callable[[object], None]  # writes exactly `size` bytes to the open output file


def install_name(name: str) -> str | None:
    for src, dst in RENAMES:
        if name.startswith(src):
            return dst + name[len(src):]
    return None


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
    (`pieces`, relative to the data start: an expert out of a fused stack, see moe_sources)."""
    spans = meta["pieces"] if "pieces" in meta else [meta["data_offsets"]]
    return [(data_start + b, e - b) for b, e in spans]


def source_tensors(directory: Path) -> Iterator[tuple[str, dict, Path, int]]:
    files = safetensors_files(directory)
    if not files:
        raise TurboError(f"{directory}: no *.safetensors files (expected an HF checkpoint)")
    seen: dict[str, Path] = {}
    for path in files:
        if not path.is_file():
            raise TurboError(f"{path}: missing (listed by model.safetensors.index.json)")
        header = read_header(path)
        for name, t in header.tensors.items():
            if name in seen:
                raise TurboError(f"{path}: tensor {name} is also in {seen[name]}")
            seen[name] = path
            yield name, {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [t.begin, t.end]}, path, \
                header.data_start


def plan_copy(name: str, meta: dict, path: Path, data_start: int) -> Planned:
    pieces = _pieces(meta, data_start)
    return Planned(name, meta["dtype"], list(meta["shape"]), sum(n for _, n in pieces), _copier(path, pieces))


def write_safetensors(path: Path, planned: list[Planned], progress: tqdm | None = None,
                      quantized: dict[str, dict] | None = None) -> None:
    header: dict = {"__metadata__": {"format": "pt", "writer": "turbo.repack"}}
    if quantized:
        header["__metadata__"][q.METADATA_KEY] = json.dumps(quantized, separators=(",", ":"))
    offset = 0
    for p in planned:
        header[p.name] = {"dtype": p.dtype, "shape": p.shape, "data_offsets": [offset, offset + p.size]}
        offset += p.size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data section 8-byte aligned
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


def plan_trunk(src: Path, text_only: bool, fmt: q.QFormat | None = None,
               quantized: dict[str, dict] | None = None) -> list[Planned]:
    config = read_config_json(src / "config.json")
    arch = arch_from_config(config, str(src / "config.json"))
    tensors = []
    for name, meta, path, data_start in source_tensors(src):
        new = install_name(name)
        if new is None:
            raise TurboError(f"{name}: unexpected tensor in {path.name} (expected model.*, lm_head.*, mtp.* or a vision tower)")
        if text_only and new.startswith("vision."):
            continue
        source = (name, new, meta, path, data_start)
        tensors += moe_sources(*source, arch) if arch.moe else [source]
    return plan_tensors(tensors, fmt, quantized if quantized is not None else {}, config)


def plan_mtp(head: Path, fmt: q.QFormat | None = None, quantized: dict[str, dict] | None = None) -> list[Planned]:
    """An MTP head's `mtp.*` tensors (as python -m turbo.train --kind mtp writes them), filed
    beside the trunk in place of any head the source carries; the loader checks their shapes
    against the trunk's."""
    tensors = []
    for name, meta, path, data_start in source_tensors(head):
        if not name.startswith(mtp.MTP_PREFIX):
            raise TurboError(f"{path}: tensor {name} is not an MTP head's (expected mtp.* names)")
        tensors.append((name, name, meta, path, data_start))
    return plan_tensors(tensors, fmt, quantized if quantized is not None else {}, {})


def plan_drafter(drafter: Path, hidden: int, fmt: q.QFormat | None = None,
                 quantized: dict[str, dict] | None = None) -> list[Planned]:
    """The drafter's tensors (DFlash2 or the published DFlash, both published unprefixed)
    under dflash.*; refused before anything is written unless it fuses into a trunk of width
    `hidden`. The runtime tells the two apart by the config's `architectures`."""
    config = read_config_json(drafter / "config.json")
    where = drafter / "config.json"
    if config.get("architectures") not in [[a] for a in DRAFTER_ARCHITECTURES]:
        raise TurboError(f"{where}: architectures is {config.get('architectures')!r}, expected one of "
                         f"{', '.join(repr([a]) for a in DRAFTER_ARCHITECTURES)}")
    if config.get("hidden_size") != hidden:
        raise TurboError(f"{where}: hidden_size is {config.get('hidden_size')!r}, expected the trunk's {hidden}")
    tensors = [(name, name if name.startswith("dflash.") else "dflash." + name, meta, path, data_start)
               for name, meta, path, data_start in source_tensors(drafter)]
    fc = next((t for t in tensors if t[1] == "dflash.fc.weight"), None)
    if fc is None:
        raise TurboError(f"{drafter}: no fc.weight (expected the drafter's [{hidden}, k*{hidden}] fusion)")
    if not fc[2]["shape"] or fc[2]["shape"][0] != hidden:
        raise TurboError(f"{fc[3]}: {fc[0]} has shape {fc[2]['shape']}, expected {hidden} rows (the trunk's hidden size)")
    return plan_tensors(tensors, fmt, quantized if quantized is not None else {}, config)


# ---- MoE checkpoints: one install layout -------------------------------------------------------
#
# Published MoE checkpoints carry every expert's matrices on their own
# (`mlp.experts.{e}.gate_proj.weight`, ...); transformers holds them fused
# (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]). The install keeps the
# per-expert names: a fused stack is cut into its experts as byte ranges of the source file
# (expert e's gate is rows e*2I..e*2I+I of the stack, contiguous), so it is never held in memory
# whole -- copied in COPY_CHUNK pieces, or under --quant one expert's [I, H] matrix at a time
# like any other projection. Qwen3-Next's linear-attention projections, grouped per key head
# (in_proj_qkvz, in_proj_ba), are regrouped into Qwen3.5's four the same way: as row ranges.

FUSED_EXPERTS = re.compile(r"((?:trunk|mtp)\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(?:\.weight)?")
EXPERT = re.compile(r"(?:trunk|mtp)\.layers\.\d+\.mlp\.experts\.(\d+)\..+")
NEXT_PROJECTIONS = re.compile(r"(trunk\.layers\.\d+\.linear_attn)\.(in_proj_qkvz|in_proj_ba)\.weight")


def _rows(name: str, meta: dict, rows: list[tuple[int, int]], shape: list[int]) -> dict:
    """A tensor made of row ranges [start, stop) of the rank-2 or rank-3 source `meta` (rows
    counted over its leading dims), shaped `shape`."""
    if meta["dtype"] not in ST_BYTES:
        raise TurboError(f"{name}: stored as {meta['dtype']}, expected BF16, F16 or F32 (the repack regroups its rows)")
    row = ST_BYTES[meta["dtype"]] * meta["shape"][-1]
    begin = meta["data_offsets"][0]
    return {"dtype": meta["dtype"], "shape": shape, "pieces": [(begin + a * row, begin + b * row) for a, b in rows]}


def _need_shape(name: str, meta: dict, shape: list[int], why: str) -> None:
    if list(meta["shape"]) != shape:
        raise TurboError(f"{name} has shape {meta['shape']}, expected {shape} ({why})")


def moe_sources(name: str, new: str, meta: dict, path: Path, data_start: int, arch: Arch) -> list[tuple]:
    """The install tensors (source name, install name, meta, file, data start) one tensor of an
    MoE checkpoint becomes: a fused expert stack its experts, Qwen3-Next's grouped projections
    Qwen3.5's, anything else itself."""
    e_count, h = arch.num_experts, arch.hidden
    if (m := FUSED_EXPERTS.fullmatch(new)) is not None:
        stem, kind = m.groups()
        if len(meta["shape"]) != 3 or meta["shape"][0] != e_count:
            raise TurboError(f"{name} has shape {meta['shape']}: a stack of {meta['shape'][:1]} experts, expected "
                             f"num_experts {e_count} (config.json)")
        inter = arch.moe_intermediate
        if kind == "gate_up_proj":
            _need_shape(name, meta, [e_count, 2 * inter, h], "num_experts, 2 * moe_intermediate_size, hidden_size")
            return [(f"{name}[{e}]", f"{stem}.{e}.{proj}.weight", _rows(name, meta, [(rows, rows + inter)], [inter, h]),
                     path, data_start) for e in range(e_count)
                    for proj, rows in (("gate_proj", 2 * e * inter), ("up_proj", (2 * e + 1) * inter))]
        _need_shape(name, meta, [e_count, h, inter], "num_experts, hidden_size, moe_intermediate_size")
        return [(f"{name}[{e}]", f"{stem}.{e}.down_proj.weight", _rows(name, meta, [(e * h, (e + 1) * h)], [h, inter]),
                 path, data_start) for e in range(e_count)]
    if (m := EXPERT.fullmatch(new)) is not None and int(m.group(1)) >= e_count:
        raise TurboError(f"{name}: expert {m.group(1)} of a layer configured for num_experts {e_count}")
    if (m := NEXT_PROJECTIONS.fullmatch(new)) is not None and arch.model_type == "qwen3_next":
        stem, kind = m.groups()
        hk, dk, dv, rep = arch.lin_k_heads, arch.lin_k_dim, arch.lin_v_dim, arch.lin_v_heads // arch.lin_k_heads
        if kind == "in_proj_qkvz":  # per key head: q [dk], k [dk], v [rep*dv], z [rep*dv]
            group = 2 * dk + 2 * rep * dv
            _need_shape(name, meta, [hk * group, h], "per key head: 2 * key dim + 2 * value heads per key head "
                                                      "* value dim")
            parts = (("in_proj_qkv", [(0, dk), (dk, 2 * dk), (2 * dk, 2 * dk + rep * dv)]),
                     ("in_proj_z", [(2 * dk + rep * dv, group)]))
        else:  # per key head: b [rep], a [rep]
            group = 2 * rep
            _need_shape(name, meta, [hk * group, h], "per key head: 2 * value heads per key head")
            parts = (("in_proj_b", [(0, rep)]), ("in_proj_a", [(rep, group)]))
        out = []
        for proj, spans in parts:  # one piece per (span, key head), span by span: q of every head, then k, ...
            rows = [(g * group + a, g * group + b) for a, b in spans for g in range(hk)]
            out.append((f"{name}[{proj}]", f"{stem}.{proj}.weight",
                        _rows(name, meta, rows, [sum(b - a for a, b in rows), h]), path, data_start))
        return out
    return [(name, new, meta, path, data_start)]


# ---- quantization (--quant, and MLX-layout quantized sources) ------------------------------

FLOAT_ST = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
ST_BYTES = {"BF16": 2, "F16": 2, "F32": 4}


def quantizable(new: str, meta: dict, fmt: q.QFormat) -> bool:
    """The rank-2 projection matrices (see the module docstring); everything else stays float."""
    if meta["dtype"] not in FLOAT_ST or len(meta["shape"]) != 2 or not new.endswith(".weight"):
        return False
    if not all(meta["shape"]):  # an empty matrix (a shared expert of width 0) stays as it is
        return False
    if not new.startswith(("trunk.", "mtp.", "dflash.")):
        return False
    module = new[:-len(".weight")].rsplit(".", 1)[-1]
    if not (module.endswith("_proj") or module.startswith("in_proj") or module in ("fc", "lm_head")):
        return False
    return meta["shape"][1] % fmt.group == 0


def _load_source(path: Path, pieces: Pieces, st: str, shape: list[int], name: str):
    import torch

    data = bytearray(sum(n for _, n in pieces))  # the one copy of the source tensor in memory
    at = 0
    with path.open("rb") as f:
        for offset, size in pieces:
            f.seek(offset)
            if f.readinto(memoryview(data)[at:at + size]) != size:
                raise TurboError(f"{path}: truncated while reading {name}")
            at += size
    return torch.frombuffer(data, dtype=getattr(torch, FLOAT_ST[st])).reshape(shape)


def _tensor_bytes(t) -> bytes:
    import torch

    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


class _QuantJob:
    """Quantizes one source tensor when its packed weight is written and hands the scales
    and biases, written right after, from the same result; then drops it (one tensor in memory)."""

    def __init__(self, name: str, path: Path, pieces: Pieces, st: str, shape: list[int], fmt: q.QFormat):
        self.args = (path, pieces, st, shape, name)
        self.fmt, self.name, self.parts = fmt, name, None

    def writer(self, i: int) -> Callable[[object], None]:
        def write(out) -> None:
            if self.parts is None:
                w = _load_source(*self.args)
                self.parts = [_tensor_bytes(t) for t in q.quantize(w, self.fmt, self.name)]
            out.write(self.parts[i])
            self.parts[i] = b""
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
    import torch

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


def repack(src: str | Path, out: str | Path, drafter: str | Path | None = None, text_only: bool = False,
           quiet: bool = False, quant: str = "none", mtp_head: str | Path | None = None) -> Path:
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise TurboError(f"{src}: no such checkpoint directory")
    if out.exists():
        raise TurboError(f"{out}: already exists (expected a new directory to write the install into)")
    config = read_config_json(src / "config.json")
    arch = arch_from_config(config, str(src / "config.json"))  # refuse what the runtime could not open
    if not (src / "tokenizer.json").is_file():
        raise TurboError(f"{src / 'tokenizer.json'}: missing (the install needs the checkpoint's tokenizer)")
    if quant not in ("none", *q.FORMATS):
        raise TurboError(f"--quant {quant!r} is not one of none, {', '.join(q.FORMATS)}")
    check_checkpoint(src, arch.vocab)  # a template that does not compile is refused now, not at the first chat
    fmt = q.FORMATS.get(quant)
    trunk_quant: dict[str, dict] = {}
    drafter_quant: dict[str, dict] = {}
    trunk = plan_trunk(src, text_only, fmt, trunk_quant)
    if mtp_head is not None:
        if not Path(mtp_head).is_dir():
            raise TurboError(f"{mtp_head}: no such MTP head directory")
        trunk_quant = {k: v for k, v in trunk_quant.items() if not k.startswith(mtp.MTP_PREFIX)}
        trunk = [p for p in trunk if not p.name.startswith(mtp.MTP_PREFIX)] + plan_mtp(Path(mtp_head), fmt, trunk_quant)
    declared = mtp.declared_layers(config)
    if declared and not any(p.name.startswith("mtp.") for p in trunk):  # still an install: the trunk is whole
        print(f"note: {mtp.missing_head(str(src / 'config.json'), declared)}", file=sys.stderr)
    if drafter is not None and not Path(drafter).is_dir():
        raise TurboError(f"{drafter}: no such drafter directory")
    drafter_plan = plan_drafter(Path(drafter), arch.hidden, fmt, drafter_quant) if drafter is not None else []
    if text_only:
        config = {k: v for k, v in config.items() if k != "vision_config"}
    for parent in (out.parent, *out.parent.parents):
        if parent.exists():
            if not parent.is_dir():
                raise TurboError(f"{parent}: not a directory (expected one to write the install {out.name} into)")
            break
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(out.parent)
        # os.mkdir applies the umask: the install gets an ordinary directory's permissions
        tmp = out.parent / f".{out.name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
    except OSError as e:
        raise TurboError(f"{e.filename or out.parent}: cannot create the install there ({e.strerror})") from None
    try:
        total = sum(p.size for p in trunk + drafter_plan)
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"repack {src.name}", disable=quiet,
                  file=sys.stderr) as bar:
            if text_only:
                (tmp / "config.json").write_text(json.dumps(config, indent=2))
            else:
                shutil.copyfile(src / "config.json", tmp / "config.json")
            for f in TOKENIZER_FILES:
                if (src / f).is_file():
                    shutil.copyfile(src / f, tmp / f)
            write_safetensors(tmp / "model.safetensors", trunk, bar, trunk_quant)
            if drafter_plan:
                (tmp / DRAFTER_DIR).mkdir()
                shutil.copyfile(Path(drafter) / "config.json", tmp / DRAFTER_DIR / "config.json")
                write_safetensors(tmp / DRAFTER_DIR / "model.safetensors", drafter_plan, bar, drafter_quant)
        os.rename(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise TurboError(f"{out}: cannot write the install ({e.strerror}{f': {e.filename}' if e.filename else ''})") \
            from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def remove_stale_temporaries(parent: Path) -> None:
    """Remove what a repack killed outright (kill -9, power loss) left in `parent`: its temporary
    sibling is named after its pid, and a pid that no longer runs will not finish it."""
    for path in parent.iterdir():
        m = TMP_PATTERN.fullmatch(path.name)
        if m is None or not path.is_dir() or _running(int(m.group(1))):
            continue
        shutil.rmtree(path)
        print(f"removed {path}, left by an interrupted repack", file=sys.stderr)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


class Interrupted(BaseException):
    """SIGTERM, raised where the repack is so that its temporary directory is removed."""


def _on_sigterm(signum, frame) -> None:
    raise Interrupted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m turbo.repack", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="HF checkpoint directory (Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, "
                                    "their MoE versions, or Qwen3NextForCausalLM)")
    parser.add_argument("out", help="the install directory to create")
    parser.add_argument("--drafter", help="a DFlash drafter directory (DFlash2 or the published DFlash) to file under dflash.")
    parser.add_argument("--mtp", help="an MTP head directory (mtp.* tensors, python -m turbo.train --kind mtp) to "
                                      "file beside the trunk, in place of the source's own")
    parser.add_argument("--text-only", action="store_true", help="leave the vision tower out")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--quant", default="none", choices=("none", *q.FORMATS),
                        help="quantize the projection matrices: int4 / int8 (group 64, bf16 scales, dtypes 4 / 5), int2 / int1 "
                             "(group 128, f16 scales, dtypes 16 / 15)")
    args = parser.parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        path = repack(args.src, args.out, args.drafter, args.text_only, args.quiet, args.quant, args.mtp)
    except TurboError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Interrupted) as e:
        print("interrupted", file=sys.stderr)
        return 128 + (signal.SIGTERM if isinstance(e, Interrupted) else signal.SIGINT)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"wrote install {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
