"""MoE checkpoints into the one install layout: `moe_sources` cuts a fused expert stack into its
experts, and regroups Qwen3-Next's per-key-head projections into Qwen3.5's four, as row ranges
of the source file (never held whole). docs/DESIGN.md 4, "MoE checkpoints"."""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import TurboError
from ..store.arch import Arch
from .tensors import ST_BYTES

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
