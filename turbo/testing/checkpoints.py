"""Small random checkpoints (trunks, MoE trunks, DFlash drafters) in the HF layout, and installs
made from them by the real repack. transformers and safetensors are optional test dependencies:
imported inside the functions that need them."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from turbo.repack import repack


def tiny_tokenizer(vocab: int):
    """A byte-level BPE of exactly `vocab` ids (merges of a fixed text fill the rest)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|mask|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = ["def f(x):\n    return x + 1\n", "The quick brown fox jumps over the lazy dog. " * 3,
            "12 + 34 = 46; 7 * 8 = 56\n"] * 20
    tok.train_from_iterator(text, trainer)
    spec = json.loads(tok.to_str())
    ids = spec["model"]["vocab"]
    if len(ids) >= vocab:
        return tok
    # the text runs out of merges (318 ids): the rest are tokens no merge makes, so text encodes as
    # before and every id decodes, as a real checkpoint's unused tokens do (install_check.py pads)
    ids.update({f"<|unused{i}|>": i for i in range(len(ids), vocab)})
    return Tokenizer.from_str(json.dumps(spec))


def hf_config(**over):
    from transformers import Qwen3_5TextConfig  # optional test dependency

    base = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, tie_word_embeddings=False,
                rms_norm_eps=1e-6, max_position_embeddings=4096)
    base.update(over)
    return Qwen3_5TextConfig(**base)


def randomize_(model, seed: int) -> None:
    """Non-zero norm weights, A_log and dt_bias, so every term of the math is exercised."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if "linear_attn.norm" in name else 0.0))
            elif name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g) * 2.0 - 1.0)
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.08)


def make_checkpoint(directory: Path, seed: int = 0, **over):
    """A Qwen3_5ForCausalLM with random weights saved as an HF checkpoint; returns the model."""
    from transformers import Qwen3_5ForCausalLM  # optional test dependency

    torch.manual_seed(seed)
    cfg = hf_config(**over)
    model = Qwen3_5ForCausalLM(cfg).float().eval()
    randomize_(model, seed)
    model.save_pretrained(directory)
    tiny_tokenizer(cfg.vocab_size).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return model


def make_install(tmp: Path, seed: int = 0, drafter: Path | None = None, **over):
    src = tmp / f"hf{seed}"
    model = make_checkpoint(src, seed, **over)
    out = repack(src, tmp / f"install{seed}", drafter=drafter, quiet=True)
    return model, out


def make_drafter(directory: Path, hidden: int, vocab: int, target_layers: list[int], seed: int = 0,
                 block_size: int = 8, window: int = 64, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                 intermediate: int = 96, rank: int = 8, top_k: int = 16, **config_over) -> Path:
    """A random DFlash2 drafter in the published layout (unprefixed names)."""
    from safetensors.torch import save_file  # optional test dependency

    g = torch.Generator().manual_seed(seed)
    taps, group = 2, 16

    def r(*shape, s=0.1):
        return (torch.randn(shape, generator=g) * s).contiguous()

    t = {"fc.weight": r(hidden, len(target_layers) * hidden), "hidden_norm.weight": r(hidden),
         "norm.weight": r(hidden), "candidate_selector.hidden_projection.weight": r(rank, hidden),
         "candidate_selector.predecessor_codebook": r(vocab, rank, s=0.5),
         "candidate_selector.successor_codebook": r(vocab, rank, s=0.5)}
    for l in range(5):
        p = f"layers.{l}."
        t |= {p + "input_layernorm.weight": r(hidden), p + "post_attention_layernorm.weight": r(hidden),
              p + "self_attn.q_proj.weight": r(heads * head_dim, hidden),
              p + "self_attn.k_proj.weight": r(kv_heads * head_dim, hidden),
              p + "self_attn.v_proj.weight": r(kv_heads * head_dim, hidden),
              p + "self_attn.o_proj.weight": r(hidden, heads * head_dim),
              p + "self_attn.q_norm.weight": r(head_dim), p + "self_attn.k_norm.weight": r(head_dim),
              p + "mlp.gate_proj.weight": r(intermediate, hidden), p + "mlp.up_proj.weight": r(intermediate, hidden),
              p + "mlp.down_proj.weight": r(hidden, intermediate)}
        for stem in ("attention_conv", "mlp_conv"):
            t[p + f"{stem}.kernel_projection.weight"] = r(2 * taps * (hidden // group), hidden)
            t[p + f"{stem}.base_kernel"] = r(2, taps, hidden, s=0.5)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(t, str(directory / "model.safetensors"))
    config = {"architectures": ["DFlash2DraftModel"], "hidden_size": hidden, "num_hidden_layers": 5,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
              "intermediate_size": intermediate, "rms_norm_eps": 1e-6, "vocab_size": vocab,
              "sliding_window": window, "layer_types": ["sliding_attention"] * 5, "is_causal": False,
              "rope_parameters": {"rope_theta": 10000.0},
              "dflash_config": {"block_size": block_size, "mask_token_id": 1, "target_layer_ids": target_layers,
                                "conv_kernel_size": taps, "conv_group_size": group, "selector_rank": rank,
                                "selector_top_k": top_k}}
    config.update(config_over)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def published_dflash_config(hidden: int, vocab: int, target_layers: list[int], num_target_layers: int,
                            block_size: int = 16, window: int = 64, heads: int = 4, kv_heads: int = 2,
                            head_dim: int = 16, intermediate: int = 96) -> dict:
    """A config.json in the published DFlash layout (as z-lab's Qwen3.5 drafters ship it)."""
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": hidden,
            "num_hidden_layers": 5, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "head_dim": head_dim, "intermediate_size": intermediate, "rms_norm_eps": 1e-6, "vocab_size": vocab,
            "sliding_window": window, "use_sliding_window": True, "num_target_layers": num_target_layers,
            "layer_types": ["sliding_attention"] * 4 + ["full_attention"], "tie_word_embeddings": False,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "dflash_config": {"block_size": block_size, "mask_token_id": 1, "target_layer_ids": target_layers}}


def make_published_dflash(directory: Path, hidden: int, vocab: int, target_layers: list[int], num_target_layers: int,
                          seed: int = 0, block_size: int = 16, window: int = 64, **config_over) -> Path:
    """A random DFlash drafter in the published layout (`DFlashDraftModel`: unprefixed names,
    no conv, no candidate selector): make_drafter's five layers without those tensors."""
    from safetensors.torch import load_file, save_file  # optional test dependency

    make_drafter(directory, hidden, vocab, target_layers, seed, block_size, window)
    path = directory / "model.safetensors"
    tensors = {n: t for n, t in load_file(str(path)).items()
               if "_conv." not in n and not n.startswith("candidate_selector.")}
    save_file(tensors, str(path))
    config = published_dflash_config(hidden, vocab, target_layers, num_target_layers, block_size, window)
    (directory / "config.json").write_text(json.dumps(config | config_over, indent=2))
    return directory


def make_spec_install(tmp: Path, seed: int = 0, **over):
    """A random trunk plus a random drafter, repacked together."""
    cfg = hf_config(**over)
    drafter = make_drafter(tmp / f"drafter{seed}", cfg.hidden_size, cfg.vocab_size, [0, cfg.num_hidden_layers - 2],
                           seed=seed)
    return make_install(tmp, seed, drafter=drafter, **over)


MOE_BASE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


def make_moe_checkpoint(directory: Path, model_type: str = "qwen3_5_moe", seed: int = 0, fused: bool = False,
                        **over):
    """A Qwen3_5MoeForCausalLM or Qwen3NextForCausalLM with random weights saved as an HF
    checkpoint: its experts one by one as save_pretrained writes them, or (`fused`) stacked
    as transformers holds them (gate_up_proj [E, 2I, H], down_proj [E, H, I]); returns the model."""
    # optional test dependencies
    from safetensors.torch import save_file
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3NextConfig, Qwen3NextForCausalLM

    config, causal = {"qwen3_5_moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM),
                      "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM)}[model_type]
    torch.manual_seed(seed)
    dense = hf_config().to_dict()
    base = {k: dense[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                  "num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_key_heads",
                                  "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                                  "linear_conv_kernel_dim", "tie_word_embeddings", "rms_norm_eps",
                                  "max_position_embeddings")}
    model = causal(config(**(base | MOE_BASE | over))).float().eval()
    randomize_(model, seed)
    model.save_pretrained(directory)
    if fused:
        tensors = {k: v.contiguous() for k, v in model.state_dict().items()
                   if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    tiny_tokenizer(model.config.vocab_size).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return model


def make_moe_install(tmp: Path, seed: int = 0, model_type: str = "qwen3_5_moe", fused: bool = False, **over):
    src = tmp / f"hf{seed}"
    model = make_moe_checkpoint(src, model_type, seed, fused, **over)
    return model, repack(src, tmp / f"install{seed}", quiet=True)
