"""The source checkpoints of a repack read and named for the install: `source_tensors` lists a
directory's tensors from their headers, `install_name` maps checkpoint names (RENAMES), and
`plan_trunk` / `plan_mtp` / `plan_drafter` plan each part (docs/DESIGN.md 4)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from ..drafters.dflash_config import ARCHITECTURES as DRAFTER_ARCHITECTURES
from ..errors import TurboError
from ..store import quant as q
from ..store.arch import arch_from_config, read_config_json
from ..store.install import safetensors_files
from ..store.safetensors_format import read_header
from ..store.tensor_shapes import MTP_PREFIX
from .formats import Source, SourceFormat, detect
from .fp8 import plan_fp8
from .int4 import plan_int4
from .moe import moe_sources
from .tensors import Planned, plan_tensors

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


def install_name(name: str) -> str | None:
    for src, dst in RENAMES:
        if name.startswith(src):
            return dst + name[len(src):]
    return None


def check_links(root: Path) -> None:
    """Refuse a symbolic link in `root` that leads out of it: repack reads only the checkpoint's
    own files (a tokenizer_config.json linked to /etc/shadow must not be copied into an install).
    The Hugging Face cache's snapshots/REV/FILE -> ../../blobs/HASH links stay inside their repo."""
    real = root.resolve()
    inside = [real]
    if real.parent.name == "snapshots":  # ~/.cache/huggingface/hub/models--ORG--NAME/snapshots/REV
        inside.append(real.parent.parent / "blobs")
    for path in sorted(root.iterdir()):
        if path.is_symlink() and not any(path.resolve().is_relative_to(d) for d in inside):
            raise TurboError(f"{path}: a symbolic link out of {root} (repack reads only the checkpoint's own files)")


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


def plan_source(found: SourceFormat, tensors: list[Source], fmt: q.QFormat | None, quantized: dict[str, dict],
                config: dict) -> tuple[list[Planned], list[Source]]:
    """(the planned tensors of an FP8 / int4 source's quantized modules, the other tensors)."""
    if found.kind == "fp8":
        return plan_fp8(found, tensors, fmt, quantized)
    if found.kind in ("awq", "gptq", "compressed-tensors"):
        return plan_int4(found, tensors, fmt, quantized)
    return [], tensors


def plan_trunk(src: Path, text_only: bool, fmt: q.QFormat | None = None,
               quantized: dict[str, dict] | None = None, found: SourceFormat | None = None,
               floats: q.QFormat | None = None) -> list[Planned]:
    """The trunk's tensors: a quantized source's modules converted (in `fmt`, else exactly), the
    float matrices quantized to `fmt` or `floats` (repack --float-quant), the rest copied."""
    config = read_config_json(src / "config.json")
    arch = arch_from_config(config, str(src / "config.json"))
    tensors = []
    listed = list(source_tensors(src))
    for name, meta, path, data_start in listed:
        new = install_name(name)
        if new is None:
            raise TurboError(f"{name}: unexpected tensor in {path.name} (expected model.*, lm_head.*, mtp.* or a vision tower)")
        if text_only and new.startswith("vision."):
            continue
        source = (name, new, meta, path, data_start)
        tensors += moe_sources(*source, arch) if arch.moe else [source]
    quantized = quantized if quantized is not None else {}
    found = found or detect(config, {n: m for n, m, _, _ in listed}, str(src / "config.json"))  # formats.py
    done, tensors = plan_source(found, tensors, fmt, quantized, config)
    return done + plan_tensors(tensors, fmt or floats, quantized, config)


def source_format(src: Path, config: dict) -> SourceFormat:
    """What `src` is (formats.detect), for repack's first line."""
    return detect(config, {n: m for n, m, _, _ in source_tensors(src)}, str(src / "config.json"))


def plan_mtp(head: Path, fmt: q.QFormat | None = None, quantized: dict[str, dict] | None = None) -> list[Planned]:
    """An MTP head's `mtp.*` tensors (as python -m turbo.train --kind mtp writes them), filed
    beside the trunk in place of any head the source carries; the loader checks their shapes
    against the trunk's."""
    tensors = []
    for name, meta, path, data_start in source_tensors(head):
        if not name.startswith(MTP_PREFIX):
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
