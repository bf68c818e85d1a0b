"""Random checkpoints of published shapes, built once and cached, for the real-scale benchmarks.

    python -m turbo.testing.shapes qwen3.5-0.8b [--cache DIR]     # prints the install's path

`build(name)` gives the install (the HF checkpoint by `write_checkpoint`, then repacked),
`checkpoint(name)` the HF directory, `gguf` a llama.cpp conversion; the shapes: docs/benchmarks.md,
"Shapes" (`SHAPES`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tokenizers import Tokenizer

from turbo.repack import repack
from turbo.testing.checkpoints import make_checkpoint, tiny_tokenizer

FULL_EVERY_4 = lambda n: ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]  # noqa: E731

SHAPES: dict[str, dict] = {
    # a random trunk of the tiny install's kind (checkpoints.hf_config's fields, fp32)
    "tiny": dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=64, linear_value_head_dim=64),
    # 752M parameters, 1.5 GB in bf16
    "qwen3.5-0.8b": dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                         layer_types=FULL_EVERY_4(24), num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                         linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                         linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=True,
                         rms_norm_eps=1e-6, max_position_embeddings=262144,
                         rope_parameters=dict(rope_type="default", rope_theta=10000000.0,
                                              partial_rotary_factor=0.25)),
    # 2.7B parameters (its active ones: 0.6B, of which the untied head and embedding 0.5B), 5.4 GB in bf16
    "qwen3.5-35b-a3b-2l": dict(vocab_size=248320, hidden_size=2048, num_hidden_layers=2,
                               layer_types=["linear_attention", "full_attention"], num_attention_heads=16,
                               num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                               linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                               num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                               shared_expert_intermediate_size=512, tie_word_embeddings=False, rms_norm_eps=1e-6,
                               max_position_embeddings=262144,
                               rope_parameters=dict(rope_type="default", rope_theta=10000000.0,
                                                    partial_rotary_factor=0.25)),
}
MOE = {"qwen3.5-35b-a3b-2l"}  # built as Qwen3_5MoeForCausalLM (the rest: Qwen3_5ForCausalLM)
SMALL = {"tiny"}  # built by checkpoints.make_checkpoint (fp32, its initialisation)

DEFAULT_CACHE = Path.home() / ".cache" / "turbo" / "shapes"
CONVERTER_ENV = "LLAMA_CONVERT_DIR"  # vendor/llama.cpp of llama-cpp-python's sdist (docs/llamacpp.md)


def _random(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Weights scaled so activations stay O(1) through the depth (as checkpoints.randomize_)."""
    if name.endswith("norm.weight") or "layernorm" in name:
        t = torch.randn(shape, generator=g) * 0.1 + (1.0 if "linear_attn.norm" in name else 0.0)
    elif name.endswith("A_log"):
        t = torch.rand(shape, generator=g) * 2.0 - 1.0
    elif name.endswith("dt_bias"):
        t = torch.randn(shape, generator=g) * 0.5
    elif len(shape) >= 2:
        t = torch.randn(shape, generator=g) * (1.0 / shape[-1] ** 0.5)
    else:
        t = torch.randn(shape, generator=g) * 0.02
    return t.to(torch.bfloat16)


def write_checkpoint(directory: Path, shape: dict, seed: int = 0, moe: bool = False) -> None:
    # optional test dependencies
    from safetensors.torch import save_file
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    config_class, model_class = (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM) if moe else \
        (Qwen3_5TextConfig, Qwen3_5ForCausalLM)
    cfg = config_class(**shape)
    with torch.device("meta"):
        model = model_class(cfg)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, p in model.state_dict().items():
        if shape.get("tie_word_embeddings") and name == "lm_head.weight":
            continue
        tensors[name] = _random(name, tuple(p.shape), g)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = cfg.to_dict()
    config.update(architectures=[model_class.__name__], torch_dtype="bfloat16", dtype="bfloat16")
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    tiny_tokenizer(shape["vocab_size"]).save(str(directory / "tokenizer.json"))  # (one id per row: install_check.py)
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


def build(name: str, cache: Path = DEFAULT_CACHE, quant: str = "none") -> Path:
    """The install of shape `name` (repacked with --quant `quant`), built on first use."""
    if name not in SHAPES:
        raise SystemExit(f"shape {name!r}: expected one of {', '.join(SHAPES)}")
    hf = cache / name / "hf"
    if not (hf / "config.json").is_file() and name in SMALL:
        make_checkpoint(hf, 0, **SHAPES[name])
    elif not (hf / "config.json").is_file():
        write_checkpoint(hf, SHAPES[name], moe=name in MOE)
    refresh_tokenizers(cache / name, SHAPES[name]["vocab_size"])
    install = cache / name / ("install" if quant == "none" else f"install-{quant}")
    if not (install / "model.safetensors").is_file():
        repack(hf, install, quiet=True, quant=quant)
    return install


def refresh_tokenizers(directory: Path, rows: int) -> None:
    """A cache built when the shapes' tokenizer had 318 ids gets one spanning the rows, which an install
    must have now (install_check.PADDING_ROWS): its checkpoint's and its installs' tokenizer.json."""
    for path in directory.glob("*/tokenizer.json"):
        if Tokenizer.from_file(str(path)).get_vocab_size() < rows:
            tiny_tokenizer(rows).save(str(path))


def checkpoint(name: str, cache: Path = DEFAULT_CACHE) -> Path:
    """The HF checkpoint directory of shape `name` (for transformers and llama.cpp's converter)."""
    build(name, cache)
    return cache / name / "hf"


# gguf()'s kinds quantized from the bf16 GGUF by llama.cpp itself (llama_model_quantize's ftype names)
LLAMA_QUANT = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
               "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}


def gguf(name: str, kind: str = "bf16", cache: Path = DEFAULT_CACHE) -> Path | None:
    """Shape `name` as a GGUF for llama.cpp, made once: "bf16" converted with the converter
    llama-cpp-python vendors ($LLAMA_CONVERT_DIR; None without it), the `LLAMA_QUANT` kinds
    (q8_0, q4_0, q4_k_m) quantized from the bf16 one by llama.cpp's own llama_model_quantize.
    The shapes' tokenizer is a small BPE the converter does not know by hash: the benchmarks'
    prompts are ids, so its pre-tokenizer is named as Qwen's."""
    out = cache / name / f"model-{kind}.gguf"
    if out.is_file():
        return out
    if kind in LLAMA_QUANT:
        import llama_cpp  # optional benchmark dependency (pip install llama-cpp-python)

        bf16 = gguf(name, "bf16", cache)
        if bf16 is None:
            return None
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, LLAMA_QUANT[kind])
        tmp = out.with_suffix(".tmp")
        if llama_cpp.llama_model_quantize(str(bf16).encode(), str(tmp).encode(), params) != 0:
            raise SystemExit("llama_model_quantize failed")
        tmp.rename(out)
        return out
    if kind != "bf16":
        raise SystemExit(f"GGUF kind {kind!r}: expected bf16 or one of {', '.join(LLAMA_QUANT)}")
    conv = os.environ.get(CONVERTER_ENV)
    if not conv:
        return None
    code = (f"import sys, runpy; sys.path[:0] = [{conv!r}, {conv + '/gguf-py'!r}]\n"
            "import conversion.base as b\n"
            "b.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'qwen2'\n"
            f"sys.argv = ['convert_hf_to_gguf.py', {str(checkpoint(name, cache))!r}, '--no-mtp', "
            f"'--outtype', 'bf16', '--outfile', {str(out)!r}]\n"
            f"runpy.run_path({conv + '/convert_hf_to_gguf.py'!r}, run_name='__main__')\n")
    subprocess.run([sys.executable, "-c", code], check=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--quant", default="none")
    args = ap.parse_args()
    print(build(args.shape, args.cache, args.quant))


if __name__ == "__main__":
    main()
