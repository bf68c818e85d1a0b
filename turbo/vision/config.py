"""The vision tower's config (config.json's `vision_config`) and the multimodal token ids, each
field checked by name (turbo/store/arch.py's helpers) so a tower that disagrees with its config is
refused in one line before any tensor is read."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import TurboError
from ..store.arch import need_field, need_positive, need_rope_theta, show

ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")  # the tower MLP's; the merger's GELU is always exact


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden: int
    intermediate: int
    heads: int
    in_channels: int
    patch: int
    merge: int  # spatial_merge_size: merge x merge patches become one trunk token
    temporal: int  # temporal_patch_size: a still image is repeated this many frames
    out_hidden: int  # the trunk's hidden size
    num_pos: int  # learned position embeddings (a square grid)
    act: str
    rope_theta: float

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal * self.patch * self.patch

    @property
    def grid_side(self) -> int:
        return math.isqrt(self.num_pos)


@dataclass(frozen=True)
class TokenIds:
    image: int  # <|image_pad|>: one per merged patch
    vision_start: int
    vision_end: int


def vision_config(cfg: dict, trunk_hidden: int, where: str = "config.json") -> VisionConfig:
    v = cfg.get("vision_config")
    if not isinstance(v, dict):
        raise TurboError(f"{where}: field 'vision_config' is {show(v)}, expected an object (the vision tower's config)")
    w = f"{where} vision_config"
    rope = v.get("rope_parameters") or {"rope_theta": 10000.0}
    if not isinstance(rope, dict):
        raise TurboError(f"{w}: field 'rope_parameters' is {show(rope)}, expected an object")
    if rope.get("rope_type", "axial") not in ("axial", "default"):
        raise TurboError(f"{w}: rope_parameters.rope_type is {show(rope.get('rope_type'))}, expected 'axial'")
    if v.get("deepstack_visual_indexes"):  # Qwen3-VL's extra mergers: not Qwen3.5's tower
        raise TurboError(f"{w}: field 'deepstack_visual_indexes' is {show(v['deepstack_visual_indexes'])}, expected "
                         "none (Qwen3.5's tower has no deepstack mergers)")
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ACTIVATIONS:
        raise TurboError(f"{w}: field 'hidden_act' is {show(act)}, expected one of {', '.join(ACTIVATIONS)}")
    c = VisionConfig(
        depth=need_positive(v, "depth", w), hidden=need_positive(v, "hidden_size", w),
        intermediate=need_positive(v, "intermediate_size", w), heads=need_positive(v, "num_heads", w),
        in_channels=need_positive(v | {"in_channels": v.get("in_channels", 3)}, "in_channels", w),
        patch=need_positive(v, "patch_size", w, 4096), merge=need_positive(v, "spatial_merge_size", w, 64),
        temporal=need_positive(v, "temporal_patch_size", w, 64), out_hidden=need_positive(v, "out_hidden_size", w),
        num_pos=need_positive(v, "num_position_embeddings", w), act=act,
        rope_theta=need_rope_theta({"rope_theta": 10000.0} | rope, f"{w} rope_parameters"))
    if c.hidden % c.heads or c.head_dim % 4:
        raise TurboError(f"{w}: hidden_size {c.hidden} over num_heads {c.heads} is not a head size divisible by 4 "
                         "(the 2-D rotary embedding splits it into height and width halves)")
    if c.grid_side ** 2 != c.num_pos:
        raise TurboError(f"{w}: field 'num_position_embeddings' is {c.num_pos}, expected a square (a learned grid)")
    if c.out_hidden != trunk_hidden:
        raise TurboError(f"{w}: field 'out_hidden_size' is {c.out_hidden}, expected the trunk's hidden size {trunk_hidden}")
    return c


def token_ids(cfg: dict, vocab: int, where: str = "config.json") -> TokenIds:
    ids = []
    for key in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
        value = need_field(cfg, key, int, where)
        if not 0 <= value < vocab:
            raise TurboError(f"{where}: field '{key}' is {value}, expected a token id in 0..{vocab - 1}")
        ids.append(value)
    return TokenIds(*ids)


def mrope_section(cfg: dict, where: str = "config.json") -> tuple[int, int, int]:
    """The text rotary embedding's (t, h, w) frequency counts (rope_parameters.mrope_section):
    transformers interleaves them (frequency j is height's when j % 3 == 1 and j < 3h, width's when
    j % 3 == 2 and j < 3w, time's otherwise)."""
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    rope = text.get("rope_parameters") or {}
    sec = rope.get("mrope_section", text.get("mrope_section", [11, 11, 10]))
    w = f"{where} rope_parameters"
    if not (isinstance(sec, list) and len(sec) == 3 and all(isinstance(s, int) and not isinstance(s, bool)
                                                            and s >= 0 for s in sec)):
        raise TurboError(f"{w}: field 'mrope_section' is {show(sec)}, expected three non-negative integers")
    return sec[0], sec[1], sec[2]
