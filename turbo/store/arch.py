"""The trunk's architecture, read from an HF `config.json` (docs/DESIGN.md 2.1).

Every field the forward needs is read from the checkpoint; a missing one is refused
by name. The only fallbacks are the ones the format itself defines (layer_types from
full_attention_interval, partial_rotary_factor 0.25, as transformers does).
"""

from __future__ import annotations

import json
import math
import reprlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from ..errors import TurboError

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
# Families that share the hybrid layout and route their MLPs to experts (turbo/model/trunk.py's
# MoE block). qwen3_next publishes its linear-attention projections grouped per key head;
# the repack rewrites them into Qwen3.5's layout, so the forward serves both alike.
MOE_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
LAYER_KINDS = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class RopeScaling:
    """rope_parameters' scaling as transformers' modeling_rope_utils reads it (linear, yarn or dynamic)."""
    kind: str  # linear | yarn | dynamic
    factor: float
    original_max_positions: int = 0  # yarn: the pretrained window; dynamic: max_position_embeddings
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0  # yarn's cos/sin scale (mscale)


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
    rope_scaling: RopeScaling | None = None  # None: plain RoPE (rope_type default)
    num_experts: int = 0
    # the MoE block (all 0 / empty for a dense trunk)
    experts_per_token: int = 0  # top-k of the router
    moe_intermediate: int = 0  # one routed expert's SwiGLU width
    shared_intermediate: int = 0  # the gated shared expert's width (0: none)
    norm_topk_prob: bool = True  # renormalise the top-k probabilities to sum to 1
    moe_layers: tuple[int, ...] = ()  # the layers whose MLP is the MoE block (the rest are dense)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary)

    def is_gdn(self, layer: int) -> bool:
        """A Gated DeltaNet layer (config.json's linear_attention)."""
        return self.layer_types[layer] == "linear_attention"

    def is_moe(self, layer: int) -> bool:
        """A layer whose MLP routes to experts (decoder_sparse_step / mlp_only_layers)."""
        return layer in self.moe_layers

    @property
    def moe(self) -> bool:
        """The checkpoint is a mixture of experts (its MTP head's MLP routes too)."""
        return self.model_type in MOE_MODEL_TYPES

    @property
    def full_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if not self.is_gdn(i)]

    @property
    def lin_conv_dim(self) -> int:
        return 2 * self.lin_k_heads * self.lin_k_dim + self.lin_v_heads * self.lin_v_dim


# RoPE takes the position as an fp32 number (turbo/backends/ops.py, native.c): past 2^24 positions
# stop being exact integers, so no model may declare more.
MAX_POSITIONS = 1 << 24
INT32_MAX = 2**31 - 1
_SHORT = reprlib.Repr()  # values in messages: a deep or huge one stays one short line
_SHORT.maxlevel, _SHORT.maxlong, _SHORT.maxstring, _SHORT.maxother = 3, 40, 40, 40


def show(value: Any) -> str:
    return _SHORT.repr(value)


def need_field(cfg: dict, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    """cfg[key] as `kind` (an int is a float too, a bool is neither); TurboError naming the
    field and `where` when it is missing or of another kind. (The trunk's and the drafters'
    configs both read their fields through it.)"""
    if key not in cfg or cfg[key] is None:
        raise TurboError(f"{where}: missing required field '{key}'")
    value = cfg[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:
            raise TurboError(f"{where}: field '{key}' is {show(value)}, expected a finite number") from None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TurboError(f"{where}: field '{key}' is {show(value)}, expected {getattr(kind, '__name__', kind)}")
    return value


def need_positive(cfg: dict, key: str, where: str, at_most: int = INT32_MAX,
                  why: str = " (the kernels take sizes as 32-bit ints)") -> int:
    """cfg[key] as an integer in 1..at_most (`why` says where the bound comes from)."""
    value = need_field(cfg, key, int, where)
    if value <= 0:
        raise TurboError(f"{where}: field '{key}' is {show(value)}, expected a positive integer")
    if value > at_most:
        raise TurboError(f"{where}: field '{key}' is {show(value)}, expected at most {at_most}{why}")
    return value


def need_real(cfg: dict, key: str, where: str, ok: Callable[[float], bool], expected: str) -> float:
    """cfg[key] as a finite float for which `ok` holds (`expected` names the range)."""
    value = need_field(cfg, key, float, where)
    if not math.isfinite(value) or not ok(value):
        raise TurboError(f"{where}: field '{key}' is {show(value)}, expected {expected}")
    return value


def need_eps(cfg: dict, key: str, where: str) -> float:
    """A norm's epsilon: it only keeps 1/sqrt off zero, so anything outside (0, 1) is a typo."""
    return need_real(cfg, key, where, lambda v: 0 < v < 1, "a number in (0, 1)")


def need_rope_theta(cfg: dict, where: str) -> float:
    return need_real(cfg, "rope_theta", where, lambda v: v > 0, "a positive number")


def _token_ids(value: Any, vocab: int, where: str) -> tuple[int, ...]:
    """eos_token_id: absent, one id or a list of ids, each below the vocab."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
            raise TurboError(f"{where}: field 'eos_token_id' has {show(t)}, expected token ids in 0..{vocab - 1}")
    return tuple(ids)


def read_config_json(path: Path) -> dict:
    if not path.is_file():
        raise TurboError(f"{path}: missing (expected the model's config.json)")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:  # ValueError: bad JSON, or an int of 4300+ digits
        raise TurboError(f"{path}: not readable JSON ({show(str(e))})") from None
    except RecursionError:
        raise TurboError(f"{path}: not readable JSON (nested too deeply)") from None
    if not isinstance(data, dict):
        raise TurboError(f"{path}: expected a JSON object")
    return data


def arch_from_config(cfg: dict, where: str = "config.json") -> Arch:
    """Parse a Qwen3.5 config dict (CausalLM or ConditionalGeneration layout), every field
    checked for its type, its range and its consistency with the others."""
    top_type = cfg.get("model_type")
    if cfg.get("text_config") is not None and not isinstance(cfg["text_config"], dict):
        raise TurboError(f"{where}: field 'text_config' is {show(cfg['text_config'])}, expected an object")
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    model_type = text.get("model_type", top_type)
    if not isinstance(model_type, str) or model_type not in SUPPORTED_MODEL_TYPES + MOE_MODEL_TYPES:
        raise TurboError(
            f"{where}: model_type {show(model_type)} is not supported, expected one of {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    w = f"{where} (text config)" if text is not cfg else where
    num_layers = need_positive(text, "num_hidden_layers", w)
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = need_positive({"full_attention_interval": 4} | text, "full_attention_interval", w)
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    if not isinstance(layer_types, list) or len(layer_types) != num_layers or any(
            not isinstance(t, str) or t not in LAYER_KINDS for t in layer_types):
        raise TurboError(
            f"{w}: field 'layer_types' must list {num_layers} entries of {' / '.join(LAYER_KINDS)}, got {show(layer_types)}"
        )
    rope = text.get("rope_parameters")
    if rope is None:  # older configs keep rope fields at the top level
        rope = {k: text[k] for k in ("rope_theta", "partial_rotary_factor") if k in text}
    if not isinstance(rope, dict):
        raise TurboError(f"{w}: field 'rope_parameters' is {show(rope)}, expected an object")
    rope_theta = need_rope_theta(rope, f"{w} rope_parameters")
    _refuse_unimplemented(text, model_type, w)
    partial = need_real({"partial_rotary_factor": text.get("partial_rotary_factor", 0.25)} | rope,
                        "partial_rotary_factor", w, lambda v: 0 < v <= 1, "a number in (0, 1]")
    tie = tie_word_embeddings(cfg, text, where)
    vocab = need_positive(text, "vocab_size", w)
    head_dim = need_positive(text, "head_dim", w)
    num_heads = need_positive(text, "num_attention_heads", w)
    num_kv = need_positive(text, "num_key_value_heads", w)
    if num_heads % num_kv:
        raise TurboError(f"{w}: num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv}")
    experts = 0 if text.get("num_experts") is None else text["num_experts"]
    if not isinstance(experts, int) or isinstance(experts, bool) or experts < 0:
        raise TurboError(f"{w}: field 'num_experts' is {show(experts)}, expected an integer >= 0")
    moe = _moe_fields(text, model_type, num_layers, w) if model_type in MOE_MODEL_TYPES else {}
    dense_mlp = len(moe.get("moe_layers", ())) < num_layers
    arch = Arch(
        model_type=model_type,
        hidden=need_positive(text, "hidden_size", w),
        intermediate=need_positive(text, "intermediate_size", w) if dense_mlp else 0,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        rms_eps=need_eps(text, "rms_norm_eps", w),
        vocab=vocab,
        tie_embeddings=tie,
        layer_types=tuple(layer_types),
        lin_k_heads=need_positive(text, "linear_num_key_heads", w),
        lin_v_heads=need_positive(text, "linear_num_value_heads", w),
        lin_k_dim=need_positive(text, "linear_key_head_dim", w),
        lin_v_dim=need_positive(text, "linear_value_head_dim", w),
        conv_kernel=need_positive(text, "linear_conv_kernel_dim", w),
        rope_theta=rope_theta,
        partial_rotary=partial,
        rope_scaling=rope_scaling(text, rope, w),
        max_positions=need_positive(text, "max_position_embeddings", w, MAX_POSITIONS,
                                    " (RoPE positions are fp32: exact integers end at 2^24)"),
        eos_token_ids=_token_ids(text.get("eos_token_id", cfg.get("eos_token_id")), vocab, w),
        **({"num_experts": experts} | moe),
    )
    if arch.lin_v_heads % arch.lin_k_heads:
        raise TurboError(
            f"{w}: linear_num_value_heads {arch.lin_v_heads} is not a multiple of linear_num_key_heads {arch.lin_k_heads}"
        )
    if arch.rotary_dim <= 0 or arch.rotary_dim % 2:
        raise TurboError(f"{w}: head_dim * partial_rotary_factor = {arch.rotary_dim}, expected a positive even number")
    s = arch.rope_scaling
    if s is not None and s.kind == "dynamic":
        if arch.rotary_dim <= 2:
            raise TurboError(f"{w}: dynamic RoPE over {arch.rotary_dim} rotary dims: its exponent dim / (dim - 2) "
                             "needs more than 2")
        # the context the factor declares: transformers sets none, and past it the scaling goes on growing
        arch = replace(arch, max_positions=min(int(s.factor * s.original_max_positions), MAX_POSITIONS))
    return arch


def tie_word_embeddings(cfg: dict, text: dict, where: str) -> bool:
    """Whether the lm_head is the embedding, read where transformers reads it: in the config of
    the class that holds the head. A nested checkpoint (ForConditionalGeneration) ties by its top
    level (Qwen3_5Config's field); the text config's own flag is what its sub-model would do
    alone, and transformers writes no lm_head when the top level ties, whatever the text config
    says. A flat one (ForCausalLM) ties by its only level. Required either way: transformers
    writes it, and a guess would pick the wrong head."""
    tie = cfg.get("tie_word_embeddings")
    if tie is None:
        raise TurboError(f"{where}: missing required field 'tie_word_embeddings'"
                         f"{' at the top level' if text is not cfg else ''} (expected true or false)")
    if not isinstance(tie, bool):
        raise TurboError(f"{where}: field 'tie_word_embeddings' is {show(tie)}, expected true or false")
    return tie


def _moe_fields(text: dict, model_type: str, num_layers: int, w: str) -> dict:
    """The MoE block's fields, as transformers' Qwen3_5MoeForCausalLM / Qwen3NextForCausalLM
    read them: Qwen3.5-MoE routes every layer and always renormalises the top-k; Qwen3-Next
    says so in norm_topk_prob and routes layer i unless it is in mlp_only_layers or
    (i + 1) is not a multiple of decoder_sparse_step (the format's defaults: 1 and [])."""
    experts = need_positive(text, "num_experts", w)
    top_k = need_positive(text, "num_experts_per_tok", w)
    if top_k > experts:
        raise TurboError(f"{w}: field 'num_experts_per_tok' is {top_k}, expected at most num_experts {experts}")
    shared = need_field(text, "shared_expert_intermediate_size", int, w)
    if shared < 0:
        raise TurboError(f"{w}: field 'shared_expert_intermediate_size' is {shared}, expected an integer >= 0")
    layers = tuple(range(num_layers))
    norm = True
    if model_type == "qwen3_next":
        norm = need_field(text, "norm_topk_prob", bool, w)
        step = need_positive({"decoder_sparse_step": 1} | {k: v for k, v in text.items() if v is not None},
                             "decoder_sparse_step", w)
        dense = text.get("mlp_only_layers") or []
        if not isinstance(dense, list) or any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < num_layers
                                              for i in dense):
            raise TurboError(f"{w}: field 'mlp_only_layers' is {show(dense)}, expected layer ids in "
                             f"0..{num_layers - 1}")
        layers = tuple(i for i in layers if i not in dense and (i + 1) % step == 0)
    return dict(num_experts=experts, experts_per_token=top_k,
                moe_intermediate=need_positive(text, "moe_intermediate_size", w),
                shared_intermediate=shared, norm_topk_prob=norm, moe_layers=layers)


# The activations and rope types turbo computes; everything else is refused by name.
ACTIVATIONS = ("silu",)
ROPE_TYPES = ("default", "linear", "yarn", "dynamic")


def _refuse_unimplemented(text: dict, model_type: str, w: str) -> None:
    """Fields that change the math in ways the forward does not implement, refused when not at
    their default (so the output never silently differs from transformers')."""
    act = text.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise TurboError(f"{w}: field 'hidden_act' is {show(act)}, turbo implements only {' / '.join(ACTIVATIONS)}")
    bias = text.get("attention_bias", False)
    if bias is not False:
        raise TurboError(f"{w}: field 'attention_bias' is {show(bias)}, turbo implements only false "
                         "(attention projections without biases)")
    experts = text.get("num_experts")
    if model_type in SUPPORTED_MODEL_TYPES and isinstance(experts, int) and experts > 0:
        raise TurboError(f"{w}: field 'num_experts' is {show(experts)} on the dense model_type {model_type}, "
                         f"expected 0 (experts are read for {', '.join(MOE_MODEL_TYPES)})")


def rope_scaling(text: dict, rope: dict, w: str) -> RopeScaling | None:
    """The RoPE scaling transformers would apply (rope_parameters.rope_type, or an older
    rope_scaling object); TurboError naming anything turbo does not compute exactly."""
    legacy = text.get("rope_scaling")
    if legacy is not None and not isinstance(legacy, dict):
        raise TurboError(f"{w}: field 'rope_scaling' is {show(legacy)}, expected an object")
    legacy = legacy or {}
    params = rope | legacy  # an older rope_scaling object says how to scale; not ignored
    kind = legacy.get("rope_type", legacy.get("type")) or rope.get("rope_type", "default")
    where = f"{w} rope_parameters"
    if kind not in ROPE_TYPES:
        raise TurboError(f"{where}: field 'rope_type' is {show(kind)}, expected one of {' / '.join(ROPE_TYPES)}")
    if legacy and text.get("rope_parameters"):
        raise TurboError(f"{w}: field 'rope_scaling' is given beside 'rope_parameters': transformers then reads "
                         "rope_scaling alone (rope_theta from the top level), a RoPE unlike the one rope_parameters "
                         "describes; give one")
    if kind == "default":
        return None
    factor = need_real(params, "factor", where, lambda v: v >= 1, "a number >= 1")
    if kind == "linear":
        return RopeScaling("linear", factor)
    if kind == "dynamic":  # scaled past max_position_embeddings (model.trunk.DynamicNtk)
        return RopeScaling("dynamic", factor, need_positive(text, "max_position_embeddings", w, MAX_POSITIONS))
    original = need_positive({k: text[k] for k in ("original_max_position_embeddings",) if k in text} | params,
                             "original_max_position_embeddings", where, MAX_POSITIONS)
    fast = need_real({"beta_fast": 32.0} | {k: v for k, v in params.items() if v}, "beta_fast", where,
                     lambda v: v > 0, "a positive number")
    slow = need_real({"beta_slow": 1.0} | {k: v for k, v in params.items() if v}, "beta_slow", where,
                     lambda v: v > 0, "a positive number")
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise TurboError(f"{where}: field 'truncate' is {show(truncate)}, expected true or false")
    return RopeScaling("yarn", factor, original, fast, slow, truncate, _yarn_attention_factor(params, factor, where))


def _yarn_attention_factor(params: dict, factor: float, where: str) -> float:
    """transformers' _compute_yarn_parameters: attention_factor, or one from mscale / mscale_all_dim."""
    if params.get("attention_factor") is not None:
        return need_real(params, "attention_factor", where, lambda v: v > 0, "a positive number")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    for key, v in (("mscale", mscale), ("mscale_all_dim", mscale_all)):
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)):
            raise TurboError(f"{where}: field '{key}' is {show(v)}, expected a number")
    if mscale and mscale_all:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all))
    return get_mscale(factor)


# Every field of transformers' Qwen3_5TextConfig, Qwen3_5MoeTextConfig and Qwen3NextConfig,
# classified (tests/test_config_fields.py fails on a new one until it is listed here).
READ = ("model_type", "text_config", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size", "tie_word_embeddings", "layer_types",
        "full_attention_interval", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_num_key_heads",
        "linear_num_value_heads", "linear_value_head_dim", "max_position_embeddings", "rope_parameters",
        "rope_theta", "partial_rotary_factor", "eos_token_id", "num_experts", "num_experts_per_tok",
        "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
        "mlp_only_layers", "mtp_num_hidden_layers")
REFUSED_UNLESS_DEFAULT = ("hidden_act", "attention_bias", "rope_scaling")
IRRELEVANT = {
    "_name_or_path": "where transformers loaded it from",
    "architectures": "the class name; model_type says the layout",
    "attention_dropout": "dropout acts in training only",
    "bos_token_id": "a tokenizer-side id; the forward never adds it",
    "pad_token_id": "batch padding; turbo runs one unpadded sequence",
    "chunk_size_feed_forward": "chunks the MLP for memory, the same math",
    "dtype": "the stored dtype; turbo's compute dtype is an open option",
    "id2label": "classification heads only",
    "label2id": "classification heads only",
    "problem_type": "classification heads only",
    "initializer_range": "random initialisation only",
    "is_encoder_decoder": "generate()'s bookkeeping; these models are decoder-only",
    "output_attentions": "what transformers returns, not what it computes",
    "output_hidden_states": "what transformers returns, not what it computes",
    "output_router_logits": "what transformers returns, not what it computes",
    "return_dict": "what transformers returns, not what it computes",
    "use_cache": "transformers' K/V cache switch; the logits are the same",
    "router_aux_loss_coef": "the training loss's load-balancing term",
    "transformers_version": "which version wrote the file",
}
