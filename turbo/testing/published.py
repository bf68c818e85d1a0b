"""The published Qwen3.5-family checkpoint layouts, scaled down: each entry's config.json has the
published file's keys, nesting, tie flag, MTP declaration, RoPE parameters and layer pattern
(Qwen/Qwen3.5-0.8B ... Qwen/Qwen3.5-397B-A17B, Qwen/Qwen3-Next-80B-A3B-Instruct, and the FP8
editions' quantization_config: `FP8`), its sizes cut so a random checkpoint weighs a few MB.
`make_published` builds one by transformers' own classes (the model class the published
`architectures` names, configured by AutoConfig from that file)
and saves it as a download holds it: transformers' weights, an MTP head's `mtp.*` tensors where
the config declares one (transformers' classes do not hold the head), the tokenizer, a chat
template and, with a tower, the image processor's settings. tests/test_published_matrix.py.

What is cut, and how: hidden 64; 4 layers in the published pattern (3 linear : 1 full);
head_dim 64 with the published partial_rotary_factor 0.25 (so mrope_section [11, 11, 10] over 32
frequencies becomes [3, 3, 2] over 8); the published ratios of query to key/value heads and of
linear value to key heads; 8 or 16 experts; a tower of 2 blocks and 4-pixel patches; a 320-id
vocabulary whose last three ids are the vision markers. The MTP head's tensors are random
(transformers' classes do not hold it): its checks are losslessness, not parity.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from ..store.arch import arch_from_config
from ..store.tensor_shapes import mtp_tensor_shapes
from .checkpoints import randomize_, tiny_tokenizer
from .source_formats import write_fp8

VOCAB = 320
START_ID, IMAGE_ID, END_ID, VIDEO_ID = VOCAB - 3, VOCAB - 2, VOCAB - 1, VOCAB - 4
LAYERS = ["linear_attention"] * 3 + ["full_attention"]
# Qwen3.5's template, cut to what the tests drive: roles, text, and image / video placeholders.
TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.content is string %}{{ m.content }}{%- else %}{%- for item in m.content %}"
    "{%- if item.type in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif item.type == 'text' %}{{ item.text }}{%- endif %}{%- endfor %}{%- endif %}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def _rope() -> dict:
    return {"mrope_interleaved": True, "mrope_section": [3, 3, 2], "partial_rotary_factor": 0.25,
            "rope_theta": 10000000, "rope_type": "default"}


def _vision(model_type: str) -> dict:
    """A published vision_config's keys (its model_type as Qwen3.5 ships it: the top level's,
    which transformers renames to qwen3_5_vision / qwen3_5_moe_vision), sizes cut."""
    return {"deepstack_visual_indexes": [], "depth": 2, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 32,
            "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 48, "model_type": model_type,
            "num_heads": 2, "num_position_embeddings": 16, "out_hidden_size": 64, "patch_size": 4,
            "spatial_merge_size": 2, "temporal_patch_size": 2}


def _text(model_type: str, heads: int, kv: int, lin_k: int, lin_v: int, tie: bool, moe: dict | None) -> dict:
    text = {"attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "dtype": "bfloat16",
            "eos_token_id": 0, "full_attention_interval": 4, "head_dim": 64, "hidden_act": "silu",
            "hidden_size": 64, "initializer_range": 0.02, "layer_types": list(LAYERS),
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_num_key_heads": lin_k,
            "linear_num_value_heads": lin_v, "linear_value_head_dim": 16, "mamba_ssm_dtype": "float32",
            "max_position_embeddings": 262144, "model_type": model_type, "mtp_num_hidden_layers": 1,
            "mtp_use_dedicated_embeddings": False, "num_attention_heads": heads, "num_hidden_layers": 4,
            "num_key_value_heads": kv, "rms_norm_eps": 1e-06, "rope_parameters": _rope(),
            "tie_word_embeddings": tie, "use_cache": True, "vocab_size": VOCAB}
    if moe is None:
        text["intermediate_size"] = 96
    else:
        text |= {"moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "router_aux_loss_coef": 0.001,
                 "output_router_logits": False} | moe
    return dict(sorted(text.items()))


def _conditional(arch: str, model_type: str, text: dict) -> dict:
    return {"architectures": [arch], "image_token_id": IMAGE_ID, "model_type": model_type, "text_config": text,
            "tie_word_embeddings": text["tie_word_embeddings"], "transformers_version": "4.57.0.dev0",
            "video_token_id": VIDEO_ID, "vision_config": _vision(model_type), "vision_end_token_id": END_ID,
            "vision_start_token_id": START_ID}


def _dense(heads: int, kv: int, lin_k: int, lin_v: int, tie: bool) -> dict:
    return _conditional("Qwen3_5ForConditionalGeneration", "qwen3_5",
                        _text("qwen3_5_text", heads, kv, lin_k, lin_v, tie, None))


def _moe(heads: int, kv: int, lin_k: int, lin_v: int, experts: int, top_k: int) -> dict:
    return _conditional("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe",
                        _text("qwen3_5_moe_text", heads, kv, lin_k, lin_v, False,
                              {"num_experts": experts, "num_experts_per_tok": top_k}))


def _next() -> dict:
    """Qwen3-Next-80B-A3B: text only and flat, rope fields at the top level, no layer_types (the
    interval says), experts renormalised by norm_topk_prob, no MTP count declared (its files
    carry the head all the same: `carries_mtp`)."""
    return {"architectures": ["Qwen3NextForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
            "bos_token_id": 0, "decoder_sparse_step": 1, "eos_token_id": 0, "full_attention_interval": 4,
            "head_dim": 64, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
            "intermediate_size": 80, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_value_head_dim": 16,
            "max_position_embeddings": 262144, "mlp_only_layers": [], "model_type": "qwen3_next",
            "moe_intermediate_size": 16, "norm_topk_prob": True, "num_attention_heads": 8, "num_experts": 16,
            "num_experts_per_tok": 3, "num_hidden_layers": 4, "num_key_value_heads": 1,
            "output_router_logits": False, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06,
            "rope_scaling": None, "rope_theta": 10000000, "router_aux_loss_coef": 0.001,
            "shared_expert_intermediate_size": 16, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "transformers_version": "4.57.0.dev0", "use_cache": True, "use_sliding_window": False,
            "vocab_size": VOCAB}


# name -> the scaled config.json. Published heads (query / key-value; linear key / value) and tie:
# 0.8B 8/2, 16/16, tied; 2B 8/2, 16/16, tied; 4B 16/4, 16/32, tied; 9B 16/4, 16/32; 27B 24/4,
# 16/48; 35B-A3B 16/2, 16/32, 256 experts top 8; 122B-A10B 32/2, 16/64, 256 top 8; 397B-A17B
# 32/2, 16/64, 512 top 10; Qwen3-Next-80B-A3B 16/2, 16/32, 512 top 10.
PUBLISHED: dict[str, dict] = {
    "qwen3.5-0.8b": _dense(4, 1, 2, 2, True),
    "qwen3.5-2b": _dense(4, 1, 2, 2, True),
    "qwen3.5-4b": _dense(4, 1, 2, 4, True),
    "qwen3.5-9b": _dense(4, 1, 2, 4, False),
    "qwen3.5-27b": _dense(6, 1, 2, 6, False),
    "qwen3.5-35b-a3b": _moe(8, 1, 2, 4, 8, 2),
    "qwen3.5-122b-a10b": _moe(16, 1, 2, 8, 8, 2),
    "qwen3.5-397b-a17b": _moe(16, 1, 2, 8, 16, 3),
    "qwen3-next-80b-a3b": _next(),
}


# The FP8 editions (Qwen/Qwen3.5-27B-FP8, Qwen/Qwen3.5-35B-A3B-FP8): the float layout's matrices as
# Qwen's block-wise e4m3 with fp32 weight_scale_inv (source_formats.write_fp8) in the published
# 128 x 128 blocks; hidden and MLP widths 128, so that matrices span whole blocks (the others stay
# bf16, as write_fp8 and Qwen's quantizer leave them).
FP8 = {"qwen3.5-27b-fp8": "qwen3.5-27b", "qwen3.5-35b-a3b-fp8": "qwen3.5-35b-a3b"}
FP8_BLOCK = 128
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
              "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
LAYOUTS = [*PUBLISHED, *FP8]


def published_config(name: str) -> dict:
    if name not in FP8:
        return copy.deepcopy(PUBLISHED[name])
    config = published_config(FP8[name])
    text = config["text_config"]
    widths = ("moe_intermediate_size", "shared_expert_intermediate_size") if "num_experts" in text else \
        ("intermediate_size",)
    text |= {"hidden_size": FP8_BLOCK} | {k: FP8_BLOCK for k in widths}
    config["vision_config"]["out_hidden_size"] = FP8_BLOCK
    return config | {"quantization_config": dict(FP8_CONFIG)}


def has_tower(config: dict) -> bool:
    return "vision_config" in config


def mtp_layers(config: dict) -> int:
    return config.get("text_config", config).get("mtp_num_hidden_layers", 0)


def carries_mtp(config: dict) -> bool:
    """Whether the published checkpoint ships an MTP head's `mtp.*` tensors: Qwen3.5's declare it
    (mtp_num_hidden_layers 1); Qwen3-Next's ship one without a count in the config (vLLM's
    qwen3_next_mtp loads it from the same files)."""
    return bool(mtp_layers(config)) or config.get("model_type") == "qwen3_next"


def _mtp_head(directory: Path, config: dict, seed: int) -> None:
    """The `mtp.*` tensors a published checkpoint carries beside the trunk (shapes from the
    trunk's architecture), written into its model.safetensors."""
    from safetensors.torch import load_file, save_file  # optional test dependency

    g = torch.Generator().manual_seed(3000 + seed)
    head = {}
    for name, shape in mtp_tensor_shapes(arch_from_config(config)).items():
        scale = 0.2 if len(shape) == 1 else 0.08
        head[name] = (torch.randn(shape, generator=g) * scale).contiguous()
    path = directory / "model.safetensors"
    save_file(load_file(str(path)) | head, str(path), metadata={"format": "pt"})


def make_published(directory: Path, name: str, seed: int = 0, config: dict | None = None):
    """The checkpoint of layout `name` (or of `config`, another config.json of the same model
    class) in `directory`, built by the class its `architectures` names from what AutoConfig reads
    out of the written config.json; returns the fp32 transformers model (the reference)."""
    import transformers  # optional test dependency

    config = dict(published_config(name) if config is None else config)
    quantized = config.pop("quantization_config", None)  # transformers builds the float model; FP8 below
    directory.mkdir(parents=True, exist_ok=True)
    text = json.dumps(config, indent=2)
    (directory / "config.json").write_text(text)
    hf_config = transformers.AutoConfig.from_pretrained(directory)
    torch.manual_seed(seed)
    model = getattr(transformers, config["architectures"][0])(hf_config).float().eval()
    randomize_(model, seed)
    if has_tower(config):
        with torch.no_grad():  # the tower's LayerNorms centred on 1 (randomize_ centres RMSNorms' 1 + w on 0)
            for n, p in model.model.visual.named_parameters():
                if "norm" in n and n.endswith("weight"):
                    p.add_(1.0)
    model.save_pretrained(directory)
    (directory / "config.json").write_text(text)  # the file as published (save_pretrained rewrites it)
    if carries_mtp(config):
        _mtp_head(directory, config, seed)
    tok = tiny_tokenizer(VOCAB - 3)
    tok.add_special_tokens(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
    assert [tok.token_to_id(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")] == \
        [START_ID, IMAGE_ID, END_ID]
    tok.save(str(directory / "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if has_tower(config):  # Qwen3.5 ships its template as chat_template.jinja
        (directory / "chat_template.jinja").write_text(TEMPLATE)
    else:  # Qwen3-Next inside tokenizer_config.json
        tokenizer_config["chat_template"] = TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if quantized is not None:
        assert quantized == FP8_CONFIG, quantized
        _to_fp8(directory, model)
    if has_tower(config):
        (directory / "preprocessor_config.json").write_text(json.dumps(
            {"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2, "image_mean": [0.5] * 3,
             "image_std": [0.5] * 3, "size": {"shortest_edge": 64, "longest_edge": 64 * 64}}))
    return model


def _to_fp8(directory: Path, model) -> None:
    """The checkpoint's matrices as FP8, and the reference `model` given transformers' own bf16
    dequantization of them (an expert's gate and up stacked as transformers holds them)."""
    deq = write_fp8(directory, FP8_BLOCK)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, w in deq.items():
            if name.startswith("mtp."):  # the MTP head: transformers' classes do not hold it
                continue
            if name in params:
                params[name].copy_(w.float())
            elif ".mlp.experts." in name:  # experts.E.{gate,up,down}_proj.weight
                stem, expert, proj = name.rsplit(".", 3)[0], int(name.split(".")[-3]), name.split(".")[-2]
                if proj == "down_proj":
                    params[stem + ".down_proj"][expert].copy_(w.float())
                else:
                    rows = w.shape[0]
                    at = slice(0, rows) if proj == "gate_proj" else slice(rows, 2 * rows)
                    params[stem + ".gate_up_proj"][expert, at].copy_(w.float())
            else:
                raise AssertionError(f"{name}: no parameter of transformers' model")
