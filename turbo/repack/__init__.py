"""HF checkpoint (+ DFlash drafter) -> turbo install, streaming tensor by tensor.

    python -m turbo.repack SRC OUT [--drafter DIR] [--mtp DIR] [--text-only] [--quant none|int4|int8|int2|int1]
        [--float-quant int8|int4]

`repack` checks the sources, plans every part (source, moe, tensors) and
writes them into a temporary sibling renamed at the end (write). docs/DESIGN.md 4.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

from tqdm import tqdm

from ..chat.template import check_checkpoint
from ..drafters import mtp
from ..errors import ArgumentParser, TurboError
from ..load.install_check import load_tokenizer
from ..load.open_layout import write_layout_of
from ..store import quant as q
from ..store.arch import arch_from_config, read_config_json
from ..store.install import DRAFTER_DIR
from ..store.safetensors_format import write_safetensors
from ..store.template_files import end_of_generation_ids
from ..store.tensor_shapes import MTP_PREFIX
from .gguf import find_gguf, repack_gguf
from .source import check_links, plan_drafter, plan_mtp, plan_trunk, source_format
from .write import building, copy_file, head_copy

# Copied as they are: the chat template (chat_template.jinja, or tokenizer_config.json's) and
# generation_config.json's eos ids travel with the install (turbo/chat/template.py reads them);
# preprocessor_config.json the image processor's settings (turbo/vision/image.py).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "vocab.json", "merges.txt", "preprocessor_config.json")
FLOAT_QUANT = ("int8", "int4")  # --float-quant: turbo's formats the native step reads packed


def float_format(float_quant: str, quant: str) -> q.QFormat | None:
    """--float-quant's format for a quantized source's float matrices (None: kept float)."""
    if float_quant == "none":
        return None
    if float_quant not in FLOAT_QUANT:
        raise TurboError(f"--float-quant {float_quant!r} is not one of {', '.join(FLOAT_QUANT)}")
    if quant != "none":
        raise TurboError(f"--float-quant {float_quant} with --quant {quant}: --quant re-quantizes every matrix, "
                         f"--float-quant only a quantized source's float ones (name one of them)")
    return q.FORMATS[float_quant]


def repack(src: str | Path, out: str | Path, drafter: str | Path | None = None, text_only: bool = False,
           quiet: bool = False, quant: str = "none", mtp_head: str | Path | None = None,
           open_layout: bool = True, float_quant: str = "none") -> Path:
    src, out = Path(src), Path(out)
    floats = float_format(float_quant, quant)
    if (gguf_file := find_gguf(src)) is not None:  # a llama.cpp GGUF (turbo/repack/gguf.py)
        return repack_gguf(gguf_file, out, mtp_head and Path(mtp_head), quant, quiet, drafter and Path(drafter),
                           text_only, floats, open_layout)
    if not src.is_dir():
        raise TurboError(f"{src}: no such checkpoint directory")
    if out.exists():
        raise TurboError(f"{out}: already exists (expected a new directory to write the install into)")
    check_links(src)
    config = read_config_json(src / "config.json")
    arch = arch_from_config(config, str(src / "config.json"))  # refuse what the runtime could not open
    if not (src / "tokenizer.json").is_file():
        raise TurboError(f"{src / 'tokenizer.json'}: missing (the install needs the checkpoint's tokenizer)")
    # malformed, or not this model's: refused now, not when the install opens
    load_tokenizer(src / "tokenizer.json", arch.vocab, end_of_generation_ids(arch.eos_token_ids, src, arch.vocab))
    if quant not in ("none", *q.FORMATS):
        raise TurboError(f"--quant {quant!r} is not one of none, {', '.join(q.FORMATS)}")
    check_checkpoint(src, arch.vocab)  # a template that does not compile is refused now, not at the first chat
    fmt = q.FORMATS.get(quant)
    found = source_format(src, config)  # the format (FP8, AWQ, GPTQ, compressed-tensors: docs/formats.md)
    if floats is not None and found.kind == "none":
        raise TurboError(f"--float-quant: {src} is a float checkpoint (use --quant {floats.name})")
    if floats is not None and found.kind == "mlx":
        raise TurboError(f"--float-quant: {src} is an MLX checkpoint (it reads FP8, AWQ, GPTQ, compressed-tensors "
                         f"and GGUF sources)")
    trunk_quant: dict[str, dict] = {}
    drafter_quant: dict[str, dict] = {}
    trunk = plan_trunk(src, text_only, fmt, trunk_quant, found, floats)
    if mtp_head is not None:
        if not Path(mtp_head).is_dir():
            raise TurboError(f"{mtp_head}: no such MTP head directory")
        check_links(Path(mtp_head))
        trunk_quant = {k: v for k, v in trunk_quant.items() if not k.startswith(MTP_PREFIX)}
        trunk = [p for p in trunk if not p.name.startswith(MTP_PREFIX)] + plan_mtp(Path(mtp_head), fmt or floats,
                                                                                       trunk_quant)
    check_head(trunk, arch.tie_embeddings, src / "config.json")
    declared = mtp.declared_layers(config)
    if declared and not any(p.name.startswith("mtp.") for p in trunk):  # still an install: the trunk is whole
        print(f"note: {mtp.missing_head(str(src / 'config.json'), declared)}", file=sys.stderr)
    if drafter is not None and not Path(drafter).is_dir():
        raise TurboError(f"{drafter}: no such drafter directory")
    if drafter is not None:
        check_links(Path(drafter))
    drafter_plan = plan_drafter(Path(drafter), arch.hidden, fmt or floats, drafter_quant) if drafter is not None else []
    if not quiet:  # once the sources are checked: a refusal is one line
        print("\n".join([found.describe(fmt, floats), *found.notes]), file=sys.stderr)
    converted = found.kind not in ("none", "mlx")  # the install's matrices are no longer the source's format
    if text_only or converted:
        config = {k: v for k, v in config.items() if not (k == "vision_config" and text_only)
                  and not (k == "quantization_config" and converted)}
    with building(out) as tmp:
        total = sum(p.size for p in trunk + drafter_plan)
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"repack {src.name}", disable=quiet,
                  file=sys.stderr) as bar:
            if text_only or converted:
                (tmp / "config.json").write_text(json.dumps(config, indent=2))
            else:
                copy_file(src / "config.json", tmp / "config.json")
            for f in TOKENIZER_FILES:
                if (src / f).is_file():
                    copy_file(src / f, tmp / f)
            write_safetensors(tmp / "model.safetensors", trunk, bar, trunk_quant,
                              head_copy(trunk, trunk_quant, arch.tie_embeddings, floats))
            if drafter_plan:
                (tmp / DRAFTER_DIR).mkdir()
                copy_file(Path(drafter) / "config.json", tmp / DRAFTER_DIR / "config.json")
                write_safetensors(tmp / DRAFTER_DIR / "model.safetensors", drafter_plan, bar, drafter_quant)
        # the native step's matrices as it reads them, beside the weights: opens map them (turbo/store/layout_file.py)
        write_layout_of(tmp, open_layout)
    return out


def check_head(trunk: list, tied: bool, config: Path) -> None:
    """An untied config's lm_head (the tie flag read as transformers reads it: turbo/store/arch.py) is
    there, or refused now rather than at the first open (an install the runtime cannot open)."""
    if not tied and not any(p.name.startswith("trunk.lm_head.") for p in trunk):
        raise TurboError(f"{config}: tie_word_embeddings is false, but the checkpoint has no lm_head.weight "
                         f"(expected a separate lm_head, or tie_word_embeddings true)")


class Interrupted(BaseException):
    """SIGTERM, raised where the repack is so that its temporary directory is removed."""


def _on_sigterm(signum, frame) -> None:
    raise Interrupted


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m turbo.repack", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="HF checkpoint directory (Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, "
                                    "their MoE versions, or Qwen3NextForCausalLM), or a llama.cpp .gguf (qwen35, qwen35moe)")
    parser.add_argument("out", help="the install directory to create")
    parser.add_argument("--drafter", help="a DFlash drafter directory (DFlash2 or the published DFlash) to file under dflash.")
    parser.add_argument("--mtp", help="an MTP head directory (mtp.* tensors, python -m turbo.train --kind mtp) to "
                                      "file beside the trunk, in place of the source's own; with a .gguf source: its MTP .gguf")
    parser.add_argument("--text-only", action="store_true", help="leave the vision tower out")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--no-open-layout", action="store_true",
                        help="leave out the packed matrices opens map (packed.safetensors, about the matrices' bytes "
                             "again): smaller on disk, every open packs them (docs/formats.md, Layout)")
    parser.add_argument("--quant", default="none", choices=("none", *q.FORMATS),
                        help="quantize the projection matrices: int4 / int8 (group 64, bf16 scales, dtypes 4 / 5), int2 / int1 "
                             "(group 128, f16 scales, dtypes 16 / 15)")
    parser.add_argument("--float-quant", default="none", choices=FLOAT_QUANT,
                        help="a quantized source (FP8, AWQ, GPTQ, compressed-tensors, GGUF): its codes kept exact, its "
                             "float matrices (and the tied head's copy) to int8 / int4")
    args = parser.parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        path = repack(args.src, args.out, args.drafter, args.text_only, args.quiet, args.quant, args.mtp,
                      not args.no_open_layout, args.float_quant)
    except TurboError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Interrupted) as e:
        print("interrupted", file=sys.stderr)
        return 128 + (signal.SIGTERM if isinstance(e, Interrupted) else signal.SIGINT)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"wrote install {path}", file=sys.stderr)  # a report: standard output stays empty
    return 0

