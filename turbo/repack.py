"""HF checkpoint (+ DFlash2 drafter) -> turbo install, streaming tensor by tensor.

    python -m turbo.repack SRC OUT [--drafter DIR] [--text-only]

Peak memory stays at one copy buffer: tensor bytes are copied from the source file to
the output file in bounded chunks, never materialised as a whole model. The output is
written into a temporary sibling directory and renamed at the end, so an interrupted
repack leaves no half install behind.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from tqdm import tqdm

from .arch import arch_from_config, read_config_json
from .errors import TurboError
from .install import DRAFTER_DIR, read_header, safetensors_files

COPY_CHUNK = 4 * 1024 * 1024
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "vocab.json", "merges.txt")
# Checkpoint name prefix -> install prefix, most specific first.
RENAMES = (
    ("model.language_model.", "trunk."),
    ("model.visual.", "vision."),
    ("model.vision_tower.", "vision."),
    ("visual.", "vision."),
    ("model.", "trunk."),
    ("lm_head.", "trunk.lm_head."),
    ("mtp.", "mtp."),
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


def _copier(path: Path, offset: int, size: int) -> Callable[[object], None]:
    def write(out) -> None:
        with path.open("rb") as f:
            f.seek(offset)
            left = size
            while left:
                chunk = f.read(min(COPY_CHUNK, left))
                if not chunk:
                    raise TurboError(f"{path}: truncated while copying")
                out.write(chunk)
                left -= len(chunk)
    return write


def source_tensors(directory: Path) -> Iterator[tuple[str, dict, Path, int]]:
    files = safetensors_files(directory)
    if not files:
        raise TurboError(f"{directory}: no *.safetensors files (expected an HF checkpoint)")
    for path in files:
        if not path.is_file():
            raise TurboError(f"{path}: missing (listed by model.safetensors.index.json)")
        header, data_start = read_header(path)
        for name, meta in header.items():
            if name != "__metadata__":
                yield name, meta, path, data_start


def plan_copy(name: str, meta: dict, path: Path, data_start: int) -> Planned:
    begin, end = meta["data_offsets"]
    return Planned(name, meta["dtype"], list(meta["shape"]), end - begin, _copier(path, data_start + begin, end - begin))


def write_safetensors(path: Path, planned: list[Planned], progress: tqdm | None = None) -> None:
    header: dict = {"__metadata__": {"format": "pt", "writer": "turbo.repack"}}
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


def plan_trunk(src: Path, text_only: bool) -> list[Planned]:
    planned = []
    for name, meta, path, data_start in source_tensors(src):
        new = install_name(name)
        if new is None:
            raise TurboError(f"{name}: unexpected tensor in {path.name} (expected model.*, lm_head.*, mtp.* or a vision tower)")
        if text_only and new.startswith("vision."):
            continue
        planned.append(plan_copy(new, meta, path, data_start))
    return planned


def plan_drafter(drafter: Path) -> list[Planned]:
    config = read_config_json(drafter / "config.json")
    if config.get("architectures") != ["DFlash2DraftModel"]:
        raise TurboError(
            f"{drafter / 'config.json'}: architectures is {config.get('architectures')!r}, expected ['DFlash2DraftModel']"
        )
    planned = []
    for name, meta, path, data_start in source_tensors(drafter):
        new = name if name.startswith("dflash.") else "dflash." + name
        planned.append(plan_copy(new, meta, path, data_start))
    return planned


def repack(src: str | Path, out: str | Path, drafter: str | Path | None = None, text_only: bool = False,
           quiet: bool = False) -> Path:
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise TurboError(f"{src}: no such checkpoint directory")
    if out.exists():
        raise TurboError(f"{out}: already exists (expected a new directory to write the install into)")
    config = read_config_json(src / "config.json")
    arch_from_config(config, str(src / "config.json"))  # refuse what the runtime could not open
    if not (src / "tokenizer.json").is_file():
        raise TurboError(f"{src / 'tokenizer.json'}: missing (the install needs the checkpoint's tokenizer)")
    trunk = plan_trunk(src, text_only)
    if drafter is not None and not Path(drafter).is_dir():
        raise TurboError(f"{drafter}: no such drafter directory")
    drafter_plan = plan_drafter(Path(drafter)) if drafter is not None else []
    if text_only:
        config = {k: v for k, v in config.items() if k != "vision_config"}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
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
            write_safetensors(tmp / "model.safetensors", trunk, bar)
            if drafter_plan:
                (tmp / DRAFTER_DIR).mkdir()
                shutil.copyfile(Path(drafter) / "config.json", tmp / DRAFTER_DIR / "config.json")
                write_safetensors(tmp / DRAFTER_DIR / "model.safetensors", drafter_plan, bar)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m turbo.repack", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="HF checkpoint directory (Qwen3_5ForCausalLM or Qwen3_5ForConditionalGeneration)")
    parser.add_argument("out", help="the install directory to create")
    parser.add_argument("--drafter", help="a published DFlash2 drafter directory to file under dflash.")
    parser.add_argument("--text-only", action="store_true", help="leave the vision tower out")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        path = repack(args.src, args.out, args.drafter, args.text_only, args.quiet)
    except TurboError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote install {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
