"""The Qwen3.5 vision tower in torch ops (transformers' Qwen3_5VisionModel): the patch embedding
(its Conv3d, whose stride equals its kernel, as one matmul over the flattened patches), the
learned position grid resampled bilinearly (align_corners) to each image's patch grid, ViT blocks
with the 2-D (height, width) rotary embedding, attention within each image, and the patch merger
(merge x merge patches -> one trunk token). Weights: the install's `vision.*` tensors (repack
renames model.visual.*), each shape checked against the config in one line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from ..errors import TurboError
from ..store.install import Install, shape4
from .config import VisionConfig

PREFIX = "vision."
LN_EPS = 1e-6


@dataclass
class Block:
    norm1: tuple[torch.Tensor, torch.Tensor]  # LayerNorm weight, bias
    norm2: tuple[torch.Tensor, torch.Tensor]
    qkv: tuple[torch.Tensor, torch.Tensor]  # Linear weight [3*hidden, hidden], bias
    proj: tuple[torch.Tensor, torch.Tensor]
    fc1: tuple[torch.Tensor, torch.Tensor]
    fc2: tuple[torch.Tensor, torch.Tensor]


@dataclass
class TowerWeights:
    patch: tuple[torch.Tensor, torch.Tensor]  # [hidden, C*T*P*P] (the Conv3d flattened), bias
    pos_embed: torch.Tensor  # [num_pos, hidden]
    blocks: list[Block]
    merger_norm: tuple[torch.Tensor, torch.Tensor]
    merger_fc1: tuple[torch.Tensor, torch.Tensor]
    merger_fc2: tuple[torch.Tensor, torch.Tensor]


def expected_shapes(c: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every tower tensor's name (after `vision.`) and shape."""
    h, m = c.hidden, c.hidden * c.merge * c.merge
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embed.proj.weight": (h, c.in_channels, c.temporal, c.patch, c.patch),
        "patch_embed.proj.bias": (h,), "pos_embed.weight": (c.num_pos, h),
        "merger.norm.weight": (h,), "merger.norm.bias": (h,),
        "merger.linear_fc1.weight": (m, m), "merger.linear_fc1.bias": (m,),
        "merger.linear_fc2.weight": (c.out_hidden, m), "merger.linear_fc2.bias": (c.out_hidden,)}
    for i in range(c.depth):
        b = f"blocks.{i}."
        shapes |= {b + "norm1.weight": (h,), b + "norm1.bias": (h,), b + "norm2.weight": (h,), b + "norm2.bias": (h,),
                   b + "attn.qkv.weight": (3 * h, h), b + "attn.qkv.bias": (3 * h,),
                   b + "attn.proj.weight": (h, h), b + "attn.proj.bias": (h,),
                   b + "mlp.linear_fc1.weight": (c.intermediate, h), b + "mlp.linear_fc1.bias": (c.intermediate,),
                   b + "mlp.linear_fc2.weight": (h, c.intermediate), b + "mlp.linear_fc2.bias": (h,)}
    return shapes


def check_tensors(c: VisionConfig, names: Iterable[str], dims: Callable[[str], tuple[int, ...]]) -> None:
    """Every `vision.*` tensor among `names` the config's, of its shape (dims(name): the stored
    shape), none missing; else TurboError naming the first that is not."""
    shapes = expected_shapes(c)
    present = {n[len(PREFIX):] for n in names if n.startswith(PREFIX)}
    extra = sorted(present - shapes.keys())
    if extra:
        raise TurboError(f"{PREFIX}{extra[0]}: a tensor this vision tower does not have (config.json's vision_config: depth {c.depth})")
    for name, shape in shapes.items():
        full = PREFIX + name
        if name not in present:
            raise TurboError(f"missing tensor {full} (config.json's vision_config declares it)")
        stored = tuple(dims(full))
        if shape4(stored, full) != shape4(shape, full):
            raise TurboError(f"{full}: shape {list(stored)}, expected {list(shape)} (from config.json's vision_config)")


def load_tower(c: VisionConfig, names: Iterable[str], dims: Callable[[str], tuple[int, ...]],
               read: Callable[[str], torch.Tensor], device: torch.device | str = "cpu") -> TowerWeights:
    """The tower's weights in fp32 from the `vision.*` tensors among `names` (dims(name): the
    stored shape; read(name): the tensor), checked first (`check_tensors`)."""
    check_tensors(c, names, dims)
    got = {name: read(PREFIX + name).float().reshape(shape).to(device) for name, shape in expected_shapes(c).items()}

    def pair(n: str) -> tuple[torch.Tensor, torch.Tensor]:
        return got[n + ".weight"], got[n + ".bias"]

    blocks = [Block(pair(f"blocks.{i}.norm1"), pair(f"blocks.{i}.norm2"), pair(f"blocks.{i}.attn.qkv"),
                    pair(f"blocks.{i}.attn.proj"), pair(f"blocks.{i}.mlp.linear_fc1"), pair(f"blocks.{i}.mlp.linear_fc2"))
              for i in range(c.depth)]
    w, b = pair("patch_embed.proj")
    return TowerWeights((w.reshape(c.hidden, -1), b), got["pos_embed.weight"], blocks, pair("merger.norm"),
                        pair("merger.linear_fc1"), pair("merger.linear_fc2"))


def _grid_rows(c: VisionConfig, grid: list[tuple[int, int, int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each patch's (row, col) in its image, in the processor's order: t, then merge blocks in
    raster order, then the merge x merge patches within a block."""
    rows, cols = [], []
    m = c.merge
    for t, h, w in grid:
        r = torch.arange(h, device=device)[:, None].expand(h, w)
        q = torch.arange(w, device=device)[None, :].expand(h, w)
        r = r.reshape(h // m, m, w // m, m).transpose(1, 2).reshape(-1)
        q = q.reshape(h // m, m, w // m, m).transpose(1, 2).reshape(-1)
        rows.append(r.repeat(t))
        cols.append(q.repeat(t))
    return torch.cat(rows), torch.cat(cols)


def position_embedding(c: VisionConfig, pos: torch.Tensor, grid: list[tuple[int, int, int]]) -> torch.Tensor:
    """The learned side x side grid resampled bilinearly (align_corners) to each image's h x w
    grid, at every patch (transformers' get_vision_interpolation_indices_and_weights)."""
    side, dev = c.grid_side, pos.device
    row, col = _grid_rows(c, grid, dev)
    hs = torch.cat([torch.full((t * h * w,), h, device=dev) for t, h, w in grid])
    ws = torch.cat([torch.full((t * h * w,), w, device=dev) for t, h, w in grid])

    def taps(index: torch.Tensor, size: torch.Tensor):
        src = index.float() * (side - 1) / torch.clamp(size - 1, min=1)
        floor = torch.floor(src)
        near = floor.long()[:, None] + torch.arange(2, device=dev)
        weight = (1 - (src[:, None] - floor[:, None] - torch.arange(2, device=dev)).abs()).clamp(min=0)
        return near.clamp(0, side - 1), weight

    ht, hw = taps(row, hs)
    wt, ww = taps(col, ws)
    idx = (ht[:, :, None] * side + wt[:, None, :]).reshape(-1, 4)
    wgt = (hw[:, :, None] * ww[:, None, :]).reshape(-1, 4)
    return (pos[idx] * wgt[:, :, None]).sum(1)


def rotary(c: VisionConfig, grid: list[tuple[int, int, int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [patches, head_dim]: a quarter of the head's frequencies rotate by the patch's row,
    the next quarter by its column, the second half repeats the first (rotate_half)."""
    quarter = c.head_dim // 2
    inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float, device=device) / quarter))
    row, col = _grid_rows(c, grid, device)
    freqs = torch.cat([row.float()[:, None] * inv_freq, col.float()[:, None] * inv_freq], dim=-1)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin[:, None]


def _ln(x: torch.Tensor, p: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), p[0], p[1], LN_EPS)


def _lin(x: torch.Tensor, p: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.linear(x, p[0], p[1])


def encode(c: VisionConfig, w: TowerWeights, pixels: torch.Tensor, grid: list[tuple[int, int, int]]) -> torch.Tensor:
    """pixels [patches, C*T*P*P] (image.py's, or transformers' processor's pixel_values) for the
    images of `grid` ((t, h, w) patches each) -> [patches / merge^2, out_hidden]: the trunk's
    embeddings of the images' <|image_pad|> tokens, in order."""
    total = sum(t * h * wd for t, h, wd in grid)
    if pixels.ndim != 2 or pixels.shape != (total, c.patch_dim):
        raise TurboError(f"vision: pixels of shape {list(pixels.shape)}, expected [{total}, {c.patch_dim}] for grids {grid}")
    if any(h % c.merge or wd % c.merge for _, h, wd in grid):
        raise TurboError(f"vision: a grid of {grid} is not a multiple of the merge size {c.merge}")
    x = _lin(pixels.float(), w.patch) + position_embedding(c, w.pos_embed, grid)
    cos, sin = rotary(c, grid, x.device)
    lengths = [h * wd for t, h, wd in grid for _ in range(t)]  # attention within each frame
    n, heads = x.shape[0], c.heads
    for b in w.blocks:
        q, k, v = _lin(_ln(x, b.norm1), b.qkv).reshape(n, 3, heads, c.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        # [1, heads, rows, d]: the batched form takes torch's fused CPU kernel (the 3-D one the math path)
        outs = [F.scaled_dot_product_attention(qs.transpose(0, 1)[None], ks.transpose(0, 1)[None],
                                               vs.transpose(0, 1)[None])[0]
                for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths))]
        x = x + _lin(torch.cat(outs, dim=1).transpose(0, 1).reshape(n, -1), b.proj)
        h = _lin(_ln(x, b.norm2), b.fc1)
        h = F.gelu(h, approximate="tanh" if c.act == "gelu_pytorch_tanh" else "none")
        x = x + _lin(h, b.fc2)
    merged = _ln(x, w.merger_norm).reshape(-1, c.hidden * c.merge * c.merge)
    return _lin(F.gelu(_lin(merged, w.merger_fc1)), w.merger_fc2)


def install_names(install: Install) -> list[str]:
    """The index's tensors, a quantized matrix's scales and biases folded into it (--quant)."""
    entries = install.index.entries

    def companion(n: str) -> bool:
        base = n.rsplit(".", 1)[0]
        return n.endswith((".scales", ".biases")) and base in entries and bool(entries[base].bits)

    return [n for n in entries if not companion(n)]


def tower_from_install(install: Install, c: VisionConfig, device: torch.device | str = "cpu") -> TowerWeights:
    """The tower in fp32 (a quantized matrix dequantized as it is read)."""
    index = install.index
    return load_tower(c, install_names(install), lambda n: index.need(n).dims, index.load, device)


def tower_from_state_dict(state: dict[str, torch.Tensor], c: VisionConfig, prefix: str = "model.visual.") -> TowerWeights:
    """From a transformers model's state dict (the parity tests)."""
    named = {PREFIX + k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    return load_tower(c, named.keys(), lambda n: tuple(named[n].shape), named.__getitem__)
