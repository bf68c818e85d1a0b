"""An HF checkpoint (turbo.testing's random ones) written as a llama.cpp GGUF with gguf's
GGUFWriter, following llama.cpp's converter (conversion/qwen.py: Qwen3_5TextModel and its
bases): names from gguf's TensorNameMap, V heads reordered to tiled order, A_log -> -exp,
dt_bias -> ssm_dt.bias, conv1d squeezed, norm weights + 1 (not the gated one), experts
stacked, the MTP layer as block num_hidden_layers (nextn.*), or alone (`mtp="only"`).
Q4_K and Q6_K, which gguf.quants cannot quantize, are packed here (simple min/max scales)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

NEXTN = {"fc": "nextn.eh_proj", "pre_fc_norm_embedding": "nextn.enorm", "pre_fc_norm_hidden": "nextn.hnorm",
         "norm": "nextn.shared_head_norm"}
KEEP_F32 = ("ssm_conv1d", "ffn_gate_inp")  # llama.cpp keeps these (and every 1-D tensor) in F32
UNUSED = 5  # gguf.TokenType.UNUSED: the converter's padding tokens


def _reorder(t: torch.Tensor, dim: int, k_heads: int, per_k: int, unit: int) -> torch.Tensor:
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], k_heads, per_k, unit, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).contiguous().reshape(shape)


def converted(name: str, t: torch.Tensor, cfg: dict) -> tuple[str, torch.Tensor]:
    """The converter's tensor transforms (fp32), the HF name kept (dt_bias renamed)."""
    t = t.float()
    nk, nv, dk, dv = (cfg[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                       "linear_value_head_dim"))
    if nk != nv and "linear_attn." in name:
        r = nv // nk
        if ".in_proj_qkv." in name:
            t = torch.cat([t[:2 * nk * dk], _reorder(t[2 * nk * dk:], 0, nk, r, dv)])
        elif ".in_proj_z." in name:
            t = _reorder(t, 0, nk, r, dv)
        elif ".in_proj_a." in name or ".in_proj_b." in name or name.endswith((".A_log", ".dt_bias")):
            t = _reorder(t, 0, nk, r, 1)
        elif ".conv1d" in name:
            t = torch.cat([t[:2 * nk * dk], _reorder(t[2 * nk * dk:], 0, nk, r, dv)])
        elif ".out_proj." in name:
            t = _reorder(t, 1, nk, r, dv)
    if name.endswith(".A_log"):
        t = -torch.exp(t)
    elif name.endswith(".dt_bias"):
        name = name[:-len(".dt_bias")] + ".dt_proj.bias"
    elif "conv1d" in name:
        t = t.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        t = t + 1
    return name, t


def _q4_k(x: np.ndarray) -> np.ndarray:
    """[n, 256] fp32 -> Q4_K blocks (ggml-common.h block_q4_K), min/max scales per 32."""
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    lo, hi = np.minimum(sub.min(-1), 0), np.maximum(sub.max(-1), 0)
    scale, mins = (hi - lo) / 15, -lo
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (mins.max(-1) / 63).astype(np.float16)
    safe = lambda v: np.where(v == 0, 1, v)  # noqa: E731
    sc = np.clip(np.round(scale / safe(d.astype(np.float32))[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(mins / safe(dmin.astype(np.float32))[:, None]), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[:, None] * sc
    q = np.clip(np.round((sub + (dmin.astype(np.float32)[:, None] * m)[..., None]) / safe(step)[..., None]), 0, 15)
    q = q.astype(np.uint8).reshape(n, 4, 2, 32)
    scales = np.concatenate([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)], axis=1)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    return np.concatenate([d.reshape(n, 1).view(np.uint8), dmin.reshape(n, 1).view(np.uint8), scales, qs], axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """[n, 256] fp32 -> Q6_K blocks (block_q6_K), a scale per 16."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    s = np.abs(sub).max(-1) / 31
    d = (s.max(-1) / 127).astype(np.float16)
    df = np.where(d == 0, 1, d.astype(np.float32))
    sc = np.clip(np.round(s / df[:, None]), -128, 127).astype(np.int8)
    step = df[:, None] * np.where(sc == 0, 1, sc)
    q = (np.clip(np.round(sub / step[..., None]), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)
    ql = (q[:, :, :64] & 15) | ((q[:, :, 64:] & 15) << 4)
    hi = (q >> 4).reshape(n, 2, 4, 32)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d.reshape(n, 1).view(np.uint8)],
                          axis=1)


def quantized(t: torch.Tensor, qtype: str):
    """(array, raw dtype) for GGUFWriter.add_tensor: `qtype`, or F16 where its blocks do not fit."""
    import gguf  # an optional test dependency

    kind = gguf.GGMLQuantizationType[qtype]
    a = t.numpy().astype(np.float32)
    block = gguf.GGML_QUANT_SIZES[kind][0]
    if qtype == "F32":
        return a, None
    if a.shape[-1] % block:
        return a.astype(np.float16), None
    if qtype in ("Q4_K", "Q6_K"):
        packed = (_q4_k if qtype == "Q4_K" else _q6_k)(a.reshape(-1, 256))
        return packed.reshape(*a.shape[:-1], -1), kind
    return gguf.quants.quantize(a, kind), kind


def _tokenizer(writer, directory: Path, vocab_size: int) -> None:
    """The tokenizer as llama.cpp's converter writes it (base.py: get_vocab_base): one token per row
    of the embedding, ids the tokenizer lacks as `[PAD{i}]` of type UNUSED (llama.cpp refuses a
    token list shorter than token_embd), added tokens CONTROL / USER_DEFINED."""
    spec = json.loads((directory / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    added = {a["id"]: a for a in spec.get("added_tokens", [])}
    size = max(vocab_size, max([*vocab.values(), *added]) + 1)
    tokens, types = [f"[PAD{i}]" for i in range(size)], [UNUSED] * size
    for tok, i in vocab.items():
        tokens[i], types[i] = tok, 1
    for i, a in added.items():
        tokens[i], types[i] = a["content"], 3 if a["special"] else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    # llama.cpp's name for GPT-2's split (its ByteLevel pre-tokenizer's regex); "gpt2" it does not know
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(0)


def write_gguf(src: Path, path: Path, qtype: str = "F32", mtp: str = "inline", chat_template: str | None = None,
               tensors: dict[str, torch.Tensor] | None = None, types: dict[str, str] | None = None) -> Path:
    """The HF checkpoint `src` as a GGUF at `path`, its 2-D weights in `qtype` (`types`: another
    for some GGUF names, as llama-quantize's --token-embedding-type). mtp: "inline" (its mtp.*
    tensors as block num_hidden_layers, if any), "none", or "only" (the MTP GGUF)."""
    import gguf  # an optional test dependency
    from safetensors.torch import load_file

    cfg = json.loads((src / "config.json").read_text())
    if tensors is None:
        tensors = {k: v for f in sorted(src.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    moe = "num_experts" in cfg
    arch = gguf.MODEL_ARCH.QWEN35MOE if moe else gguf.MODEL_ARCH.QWEN35
    n = cfg["num_hidden_layers"]
    n_mtp = 1 if mtp != "none" and any(k.startswith("mtp.") for k in tensors) else 0
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_block_count(n + n_mtp)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta")))
    w.add_rope_dimension_count(int(cfg["head_dim"] * rope.get("partial_rotary_factor", 0.25)))
    w.add_rope_dimension_sections([11, 11, 10, 0])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if moe:
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    else:
        w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(cfg["linear_key_head_dim"])
    w.add_ssm_group_count(cfg["linear_num_key_heads"])
    w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    w.add_full_attention_interval(4)
    if n_mtp:
        w.add_nextn_predict_layers(n_mtp)
    _tokenizer(w, src, cfg["vocab_size"])
    if chat_template is not None:
        w.add_chat_template(chat_template)
    names = gguf.get_tensor_name_map(arch, n + n_mtp)
    experts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name in sorted(tensors):
        t = tensors[name]
        if name.startswith("mtp."):
            parts = name.split(".", 3)
            if not n_mtp:
                continue
            if parts[1] == "layers":
                name = f"model.layers.{n + int(parts[2])}.{parts[3]}"
            else:
                new = f"{NEXTN[parts[1]]}.{parts[2]}"  # renamed before the transforms: enorm, hnorm get + 1
                _put(w, f"blk.{n}.{new}", converted(f"model.layers.{n}.{new}", t, cfg)[1], qtype)
                continue
        elif mtp == "only" and name not in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            continue
        if ".mlp.experts." in name:  # model.layers.L.mlp.experts.E.gate_proj.weight -> stacked
            stem, e, proj = name.rsplit(".", 3)[0], int(name.split(".")[-3]), name.split(".")[-2]
            experts.setdefault(f"{stem}.{proj}.weight", []).append((e, t.float()))
            continue
        name, t = converted(name, t, cfg)
        _add(w, names, name, t, qtype, types or {})
    for name, parts in experts.items():
        _add(w, names, name, torch.stack([t for _, t in sorted(parts, key=lambda p: p[0])]), qtype, types or {})
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add(w, names, name: str, t: torch.Tensor, qtype: str, types: dict[str, str]) -> None:
    new = names.get_name(name, try_suffixes=(".weight", ".bias"))
    if new is None:
        raise ValueError(f"{name}: no GGUF name")
    _put(w, new, t, types.get(new, qtype))


def _put(w, new: str, t: torch.Tensor, qtype: str) -> None:
    if t.dim() <= 1 or any(k in new for k in KEEP_F32):
        w.add_tensor(new, t.float().numpy())
        return
    a, raw = quantized(t, qtype)
    w.add_tensor(new, a, raw_dtype=raw)
