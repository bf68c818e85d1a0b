"""The vision tower (turbo/vision/tower.py) against transformers' Qwen3_5VisionModel on random
tiny configs (patch sizes, merge sizes, depths, images of several aspect ratios), and its config
and tensors refused by name in one line."""

from __future__ import annotations

import pytest
import torch

from turbo.errors import TurboError
from turbo.vision.config import vision_config
from turbo.vision.tower import encode, tower_from_state_dict


def tiny_tower(patch: int, merge: int, depth: int, seed: int = 0):
    from transformers import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    vc = dict(depth=depth, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=patch,
              spatial_merge_size=merge, temporal_patch_size=2, out_hidden_size=24, num_position_embeddings=16)
    torch.manual_seed(seed)
    model = Qwen3_5VisionModel(Qwen3_5VisionConfig(**vc)).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if "norm" in name and name.endswith("weight") else 0.0))
    return vc, model, {"model.visual." + k: v for k, v in model.state_dict().items()}


@pytest.mark.parametrize("patch,merge,depth", [(4, 2, 2), (2, 1, 1), (3, 3, 3)])
def test_tower_equals_transformers(patch, merge, depth):
    vc, model, state = tiny_tower(patch, merge, depth)
    c = vision_config({"vision_config": vc}, 24)
    w = tower_from_state_dict(state, c)
    g = torch.Generator().manual_seed(1)
    for grid in ([(1, 2 * merge, 3 * merge)], [(1, 5 * merge, merge), (1, 4 * merge, 4 * merge)], [(2, merge, 2 * merge)]):
        n = sum(t * h * wd for t, h, wd in grid)
        pixels = torch.randn(n, c.patch_dim, generator=g)
        with torch.no_grad():
            ref = model(pixels, grid_thw=torch.tensor(grid)).pooler_output
        out = encode(c, w, pixels, grid)
        assert out.shape == ref.shape
        assert (out - ref).abs().max().item() < 1e-4


def test_config_fields_refused_by_name():
    vc, _, _ = tiny_tower(4, 2, 1)
    for key in ("depth", "patch_size", "spatial_merge_size", "out_hidden_size"):
        with pytest.raises(TurboError, match=f"missing required field '{key}'"):
            vision_config({"vision_config": {k: v for k, v in vc.items() if k != key}}, 24)
    with pytest.raises(TurboError, match="out_hidden_size"):
        vision_config({"vision_config": vc}, 32)
    with pytest.raises(TurboError, match="num_position_embeddings"):
        vision_config({"vision_config": vc | {"num_position_embeddings": 15}}, 24)
    assert vision_config({"vision_config": vc | {"deepstack_visual_indexes": []}}, 24).depth == vc["depth"]
    with pytest.raises(TurboError, match="deepstack_visual_indexes"):
        vision_config({"vision_config": vc | {"deepstack_visual_indexes": [0]}}, 24)
    with pytest.raises(TurboError, match="hidden_act"):
        vision_config({"vision_config": vc | {"hidden_act": "relu"}}, 24)


def test_tensors_refused_in_one_line():
    vc, _, state = tiny_tower(4, 2, 1)
    c = vision_config({"vision_config": vc}, 24)
    bad = dict(state) | {"model.visual.blocks.0.attn.qkv.weight": torch.zeros(96, 31)}
    with pytest.raises(TurboError, match=r"vision.blocks.0.attn.qkv.weight: shape \[96, 31\], expected \[96, 32\]"):
        tower_from_state_dict(bad, c)
    with pytest.raises(TurboError, match="missing tensor vision.merger.norm.bias"):
        tower_from_state_dict({k: v for k, v in state.items() if not k.endswith("merger.norm.bias")}, c)
    with pytest.raises(TurboError, match="vision.blocks.1.norm1.weight: a tensor this vision tower does not have"):
        tower_from_state_dict(dict(state) | {"model.visual.blocks.1.norm1.weight": torch.zeros(32)}, c)
    with pytest.raises(TurboError, match="expected"):
        encode(c, tower_from_state_dict(state, c), torch.zeros(5, c.patch_dim), [(1, 2, 2)])
