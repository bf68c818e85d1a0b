"""The trunk's architecture, read from an HF `config.json` (docs/DESIGN.md 2.1).

Every field the forward needs is read from the checkpoint; a missing one is refused
by name. The only fallbacks are the ones the format itself defines (layer_types from
full_attention_interval, partial_rotary_factor 0.25, as transformers does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import TurboError

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
# Families that share the hybrid layout but route to experts: recognised so the
# speculation blockers can name them, not yet served by the trunk forward.
MOE_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
LAYER_KINDS = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class Arch:
    model_type: str
    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    vocab: int
    tie_embeddings: bool
    layer_types: tuple[str, ...]
    lin_k_heads: int
    lin_v_heads: int
    lin_k_dim: int
    lin_v_dim: int
    conv_kernel: int
    rope_theta: float
    partial_rotary: float
    max_positions: int
    eos_token_ids: tuple[int, ...] = ()
    num_experts: int = 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary)

    def is_gdn(self, layer: int) -> bool:
        """A Gated DeltaNet layer (config.json's linear_attention)."""
        return self.layer_types[layer] == "linear_attention"

    @property
    def full_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if not self.is_gdn(i)]

    @property
    def lin_conv_dim(self) -> int:
        return 2 * self.lin_k_heads * self.lin_k_dim + self.lin_v_heads * self.lin_v_dim


def need_field(cfg: dict, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    """cfg[key] as `kind` (an int is a float too, a bool is neither); TurboError naming the
    field and `where` when it is missing or of another kind. (The trunk's and the drafters'
    configs both read their fields through it.)"""
    if key not in cfg or cfg[key] is None:
        raise TurboError(f"{where}: missing required field '{key}'")
    value = cfg[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TurboError(f"{where}: field '{key}' is {value!r}, expected {getattr(kind, '__name__', kind)}")
    return value


def _positive(cfg: dict, key: str, where: str) -> int:
    value = need_field(cfg, key, int, where)
    if value <= 0:
        raise TurboError(f"{where}: field '{key}' is {value}, expected a positive integer")
    return value


def read_config_json(path: Path) -> dict:
    if not path.is_file():
        raise TurboError(f"{path}: missing (expected the model's config.json)")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TurboError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise TurboError(f"{path}: expected a JSON object")
    return data


def arch_from_config(cfg: dict, where: str = "config.json") -> Arch:
    """Parse a Qwen3.5 config dict (CausalLM or ConditionalGeneration layout)."""
    top_type = cfg.get("model_type")
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    model_type = text.get("model_type", top_type)
    if model_type not in SUPPORTED_MODEL_TYPES + MOE_MODEL_TYPES:
        raise TurboError(
            f"{where}: model_type {model_type!r} is not supported, expected one of {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    w = f"{where} (text config)" if text is not cfg else where
    num_layers = _positive(text, "num_hidden_layers", w)
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = text.get("full_attention_interval", 4)
        if not isinstance(interval, int) or interval <= 0:
            raise TurboError(f"{w}: field 'full_attention_interval' is {interval!r}, expected a positive integer")
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    if not isinstance(layer_types, list) or len(layer_types) != num_layers or any(t not in LAYER_KINDS for t in layer_types):
        raise TurboError(
            f"{w}: field 'layer_types' must list {num_layers} entries of {' / '.join(LAYER_KINDS)}, got {layer_types!r}"
        )
    rope = text.get("rope_parameters")
    if rope is None:  # older configs keep rope fields at the top level
        rope = {k: text[k] for k in ("rope_theta", "partial_rotary_factor") if k in text}
    if not isinstance(rope, dict):
        raise TurboError(f"{w}: field 'rope_parameters' is {rope!r}, expected an object")
    rope_theta = need_field(rope, "rope_theta", float, f"{w} rope_parameters")
    partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    if not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise TurboError(f"{w}: field 'partial_rotary_factor' is {partial!r}, expected a number in (0, 1]")
    tie = text.get("tie_word_embeddings", cfg.get("tie_word_embeddings"))
    if not isinstance(tie, bool):
        raise TurboError(f"{w}: missing required field 'tie_word_embeddings' (expected true or false)")
    eos = text.get("eos_token_id", cfg.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    head_dim = _positive(text, "head_dim", w)
    num_heads = _positive(text, "num_attention_heads", w)
    num_kv = _positive(text, "num_key_value_heads", w)
    if num_heads % num_kv:
        raise TurboError(f"{w}: num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv}")
    arch = Arch(
        model_type=model_type,
        hidden=_positive(text, "hidden_size", w),
        intermediate=_positive(text, "intermediate_size", w),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        rms_eps=need_field(text, "rms_norm_eps", float, w),
        vocab=_positive(text, "vocab_size", w),
        tie_embeddings=tie,
        layer_types=tuple(layer_types),
        lin_k_heads=_positive(text, "linear_num_key_heads", w),
        lin_v_heads=_positive(text, "linear_num_value_heads", w),
        lin_k_dim=_positive(text, "linear_key_head_dim", w),
        lin_v_dim=_positive(text, "linear_value_head_dim", w),
        conv_kernel=_positive(text, "linear_conv_kernel_dim", w),
        rope_theta=rope_theta,
        partial_rotary=float(partial),
        max_positions=_positive(text, "max_position_embeddings", w),
        eos_token_ids=eos_ids,
        num_experts=int(text.get("num_experts", 0) or 0),
    )
    if arch.lin_v_heads % arch.lin_k_heads:
        raise TurboError(
            f"{w}: linear_num_value_heads {arch.lin_v_heads} is not a multiple of linear_num_key_heads {arch.lin_k_heads}"
        )
    if arch.rotary_dim % 2:
        raise TurboError(f"{w}: head_dim * partial_rotary_factor = {arch.rotary_dim}, expected an even number")
    return arch
