"""A trainable DFlash2 drafter (docs/DESIGN.md 2.2): the runtime's draft pass, differentiable and
over many blocks at once, its losses and its export in the published layout.

The forward is the one turbo/drafters/dflash.py runs at inference: row 0 of a block is the
anchor's embedding, rows 1..B the mask token's; every layer attends to the fused aux states of
the context positions [anchor - window, anchor) and bidirectionally within the block; the
grouped conv wraps both sublayers; the candidate selector rescores each row's top-k.
Parameter names are the published checkpoint's (no `dflash.` prefix); the trunk's embedding and
lm_head are frozen buffers, not exported.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..backends.ops import apply_rope, rms_norm, rope_cos_sin, rope_inv_freq
from ..drafters.dflash_config import DFLASH2_ARCH, DFLASH_GROUP_SIZE, DFLASH_LAYERS, DFLASH_TAPS
from ..errors import TurboError
from ..store.arch import Arch
from ..store.safetensors_format import write_tensors

# the published DFlash recipe's decay per block size (w_k = exp(-(k - 1) / gamma)); others: block / 2
PUBLISHED_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def spread_target_layers(num_layers: int, count: int) -> list[int]:
    """The trunk layers whose outputs condition the drafter, spread as z-lab's DFlash helper
    (model/utils.py build_target_layer_ids) spreads them: evenly from layer 1 to layer n - 3. A
    trunk too shallow for `count` distinct ones there gets as many as fit (one: the middle layer)."""
    count = min(count, num_layers - 3)
    if count <= 1:
        return [num_layers // 2]
    start, end = 1, num_layers - 3
    return [int(round(start + i * (end - start) / (count - 1))) for i in range(count)]


@dataclass(frozen=True)
class DraftShape:
    """Everything the drafter's config.json records (and the trainable model is built from)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rank: int
    top_k: int
    block: int
    window: int
    target_layers: tuple[int, ...]
    mask_token: int
    vocab: int
    rope_theta: float
    eps: float
    layers: int = DFLASH_LAYERS
    taps: int = DFLASH_TAPS
    group: int = DFLASH_GROUP_SIZE


def _divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def draft_shape(arch: Arch, mask_token: int, heads: int | None = None, kv_heads: int | None = None,
                head_dim: int | None = None, intermediate: int | None = None, rank: int | None = None,
                top_k: int = 16, block: int = 8, window: int = 256, target_layers: list[int] | None = None,
                target_count: int = DFLASH_LAYERS) -> DraftShape:
    """The drafter's shape: the widths given, the rest scaled from the trunk within what the
    runtime's DFlash2 pass takes (q and k rows <= hidden, the MLP <= 4 x hidden)."""
    h = arch.hidden
    head_dim = head_dim or arch.head_dim
    heads = heads or max(1, min(arch.num_heads, h // head_dim))
    kv_heads = kv_heads or _divisor_at_most(heads, arch.num_kv_heads)
    intermediate = intermediate or min(arch.intermediate, 4 * h)
    rank = rank or max(8, h // 8)
    layers = tuple(target_layers) if target_layers else tuple(spread_target_layers(arch.num_layers, target_count))
    checks = ((h % DFLASH_GROUP_SIZE == 0, f"the trunk's hidden_size {h} is not a multiple of the conv group "
                                           f"{DFLASH_GROUP_SIZE} (a DFlash2 drafter's width is the trunk's)"),
              (heads * head_dim <= h, f"--heads {heads} x --head-dim {head_dim} exceeds the hidden size {h}"),
              (heads % kv_heads == 0, f"--heads {heads} is not a multiple of --kv-heads {kv_heads}"),
              (head_dim % 2 == 0, f"--head-dim {head_dim} is odd (RoPE rotates pairs)"),
              (intermediate <= 4 * h, f"--intermediate {intermediate} exceeds 4 x the hidden size {h}"),
              (rank <= h, f"--rank {rank} exceeds the hidden size {h}"),
              (2 <= top_k <= arch.vocab, f"--top-k {top_k} is outside 2..{arch.vocab} (the vocab)"),
              (block >= 2, f"--block {block} is below 2"),
              (1 <= window <= arch.max_positions, f"--window {window} is outside 1..{arch.max_positions}"),
              (all(0 <= t < arch.num_layers for t in layers) and len(set(layers)) == len(layers),
               f"--target-layers {list(layers)}: expected distinct ids in 0..{arch.num_layers - 1}"),
              (0 <= mask_token < arch.vocab, f"mask token {mask_token} is not an id below the vocab {arch.vocab}"))
    for ok, why in checks:
        if not ok:
            raise TurboError(why)
    return DraftShape(h, heads, kv_heads, head_dim, intermediate, rank, top_k, block, window, layers, mask_token,
                      arch.vocab, arch.rope_theta, arch.rms_eps)


class ZeroNorm(nn.Module):
    """The zero-centred RMSNorm of trunk and drafter (ops.rms_norm with scale 1 + w)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, 1.0 + self.weight, self.eps)


def rope_tables(pos: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ops.rope_cos_sin for integer positions of any shape -> cos, sin [..., rot]."""
    cos, sin = rope_cos_sin(pos.flatten(), inv_freq)
    return cos.view(*pos.shape, -1), sin.view(*pos.shape, -1)


class GroupedConv(nn.Module):
    """Per-row dynamic kernels (one per group of channels) over a static base kernel, causal
    along the block's rows; zero-initialised dynamics and an identity base: a pass-through."""

    def __init__(self, s: DraftShape):
        super().__init__()
        self.taps, self.group, self.groups = s.taps, s.group, s.hidden // s.group
        self.kernel_projection = nn.Linear(s.hidden, 2 * s.taps * self.groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)
        base = torch.zeros(2, s.taps, s.hidden)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)

    def _conv(self, h: torch.Tensor, dyn: torch.Tensor, side: int) -> torch.Tensor:
        # h [..., R, H]; dyn [..., R, taps, groups]: the output row's kernels
        k = self.base_kernel[side] + dyn.repeat_interleave(self.group, dim=-1)
        out = k[..., 0, :] * h
        for o in range(1, self.taps):
            out = out + k[..., o, :] * F.pad(h, (0, 0, o, 0))[..., :h.shape[-2], :]
        return out

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dyn = self.kernel_projection(x).unflatten(-1, (2, self.taps, self.groups))
        return self._conv(x, dyn[..., 0, :, :], 0), dyn[..., 1, :, :]

    def finish(self, y: torch.Tensor, dyn: torch.Tensor) -> torch.Tensor:
        return self._conv(y, dyn, 1)


class Attention(nn.Module):
    def __init__(self, s: DraftShape):
        super().__init__()
        self.h, self.kvh, self.hd = s.heads, s.kv_heads, s.head_dim
        self.q_proj = nn.Linear(s.hidden, s.heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)
        self.q_norm = ZeroNorm(s.head_dim, s.eps)
        self.k_norm = ZeroNorm(s.head_dim, s.eps)

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """ctx [N, T, H] (fused aux states) -> k, v [N, T, kvh, hd]; k rotated at its position."""
        k = self.k_norm(self.k_proj(ctx).unflatten(-1, (self.kvh, self.hd)))
        return apply_rope(k, cos, sin), self.v_proj(ctx).unflatten(-1, (self.kvh, self.hd))

    def forward(self, u, ck, cv, cmask, cos, sin):
        """u [N, A, R, H] block rows; ck / cv [N, T, kvh, hd]; cmask [N, A, T] (visible context);
        cos / sin [N, A, R, hd] at the block's positions."""
        rep = self.h // self.kvh
        q = self.q_norm(self.q_proj(u).unflatten(-1, (self.h, self.hd)))
        q = apply_rope(q, cos, sin)
        kb = self.k_norm(self.k_proj(u).unflatten(-1, (self.kvh, self.hd)))
        kb = apply_rope(kb, cos, sin)
        vb = self.v_proj(u).unflatten(-1, (self.kvh, self.hd))
        ck, cv = ck.repeat_interleave(rep, 2), cv.repeat_interleave(rep, 2)  # head h reads kv head h // rep
        kb, vb = kb.repeat_interleave(rep, 3), vb.repeat_interleave(rep, 3)
        scale = self.hd ** -0.5
        s_ctx = torch.einsum("narhd,nthd->nahrt", q, ck) * scale
        s_ctx = s_ctx.masked_fill(~cmask[:, :, None, None, :], float("-inf"))
        s_blk = torch.einsum("narhd,nashd->nahrs", q, kb) * scale
        p = torch.cat([s_ctx, s_blk], -1).softmax(-1)
        t = ck.shape[1]
        o = torch.einsum("nahrt,nthd->narhd", p[..., :t], cv) + torch.einsum("nahrs,nashd->narhd", p[..., t:], vb)
        return self.o_proj(o.flatten(-2))


class Mlp(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, s: DraftShape):
        super().__init__()
        self.input_layernorm = ZeroNorm(s.hidden, s.eps)
        self.post_attention_layernorm = ZeroNorm(s.hidden, s.eps)
        self.self_attn = Attention(s)
        self.mlp = Mlp(s.hidden, s.intermediate)
        self.attention_conv = GroupedConv(s)
        self.mlp_conv = GroupedConv(s)

    def forward(self, x, ck, cv, cmask, cos, sin):
        u, d = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(u, ck, cv, cmask, cos, sin), d)
        u, d = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(u), d)


class CandidateSelector(nn.Module):
    def __init__(self, s: DraftShape):
        super().__init__()
        self.hidden_projection = nn.Linear(s.hidden, s.rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.randn(s.vocab, s.rank) * 0.02)
        self.successor_codebook = nn.Parameter(torch.randn(s.vocab, s.rank) * 0.02)

    def scores(self, logits, final, pred, cand) -> torch.Tensor:
        """score_ij = logits_i[c_ij] + dot(pred_cb[pred_i] * proj_i, succ_cb[c_ij])."""
        q = self.predecessor_codebook[pred] * self.hidden_projection(final)
        return logits.gather(-1, cand) + torch.einsum("...r,...kr->...k", q, self.successor_codebook[cand])


class DFlash2(nn.Module):
    """The drafter over the trunk's frozen `embed` [vocab, H] and `lm_head` [vocab, H]."""

    def __init__(self, s: DraftShape, embed: torch.Tensor, lm_head: torch.Tensor):
        super().__init__()
        self.shape = s
        self.fc = nn.Linear(len(s.target_layers) * s.hidden, s.hidden, bias=False)
        self.hidden_norm = ZeroNorm(s.hidden, s.eps)
        self.layers = nn.ModuleList([Layer(s) for _ in range(s.layers)])
        self.norm = ZeroNorm(s.hidden, s.eps)
        self.candidate_selector = CandidateSelector(s)
        for m in self.modules():
            if isinstance(m, nn.Linear) and m.weight.abs().sum() > 0:  # (the conv's projections stay zero)
                nn.init.normal_(m.weight, std=0.02)
        self.register_buffer("embed", embed.float(), persistent=False)
        self.register_buffer("lm_head", lm_head.float(), persistent=False)
        self.register_buffer("inv_freq", rope_inv_freq(s.head_dim, s.rope_theta), persistent=False)

    def forward(self, ids: torch.Tensor, aux: torch.Tensor, anchors: torch.Tensor):
        """ids [N, T]; aux [N, T, n_aux*H]; anchors [N, A] positions. Returns logits [N, A, B, V]
        and final states [N, A, B, H] of rows 1..B."""
        s = self.shape
        n, t = ids.shape
        dev = ids.device
        ctx = self.hidden_norm(self.fc(aux.float()))
        tpos = torch.arange(t, device=dev)
        ccos, csin = rope_tables(tpos.expand(n, t), self.inv_freq)
        cmask = (tpos[None, None] < anchors[..., None]) & (tpos[None, None] >= anchors[..., None] - s.window)
        rows = torch.full((n, anchors.shape[1], s.block + 1), s.mask_token, dtype=torch.long, device=dev)
        rows[..., 0] = ids.gather(1, anchors)
        x = F.embedding(rows, self.embed)
        bcos, bsin = rope_tables(anchors[..., None] + torch.arange(s.block + 1, device=dev), self.inv_freq)
        for layer in self.layers:
            ck, cv = layer.self_attn.context_kv(ctx, ccos, csin)
            x = layer(x, ck, cv, cmask, bcos, bsin)
        final = self.norm(x)[..., 1:, :]
        return final @ self.lm_head.T, final


def decay_weights(block: int, gamma: float, device: torch.device) -> torch.Tensor:
    """DFlash's position-decay weight: w_k = exp(-(k - 1) / gamma) for block row k = 1..B."""
    return torch.exp(-torch.arange(block, dtype=torch.float32, device=device) / gamma)


def loss(model: DFlash2, ids: torch.Tensor, aux: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor,
         gamma: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Block-wise cross entropy against ids[a + k] under the decay weight, plus the candidate
    selector's cross entropy over each row's top-k (teacher-forced predecessors) where the
    target is among them. lengths [N]: targets at or past a sequence's length do not count."""
    s = model.shape
    logits, final = model(ids, aux, anchors)
    pos = anchors[..., None] + torch.arange(1, s.block + 1, device=ids.device)
    valid = pos < lengths[:, None, None]
    tgt = ids.gather(1, pos.clamp(max=ids.shape[1] - 1).flatten(1)).view(pos.shape)
    w = decay_weights(s.block, gamma, ids.device).expand_as(tgt) * valid
    ce = F.cross_entropy(logits.flatten(0, 2), tgt.flatten(), reduction="none").view_as(tgt)
    loss_tok = (ce * w).sum() / w.sum().clamp(min=1e-9)
    pred = torch.cat([ids.gather(1, anchors)[..., None], tgt[..., :-1]], -1)
    cand = logits.detach().topk(s.top_k, -1).indices
    hit = cand == tgt[..., None]
    ws = w * hit.any(-1)
    sc = model.candidate_selector.scores(logits, final, pred, cand)
    sce = F.cross_entropy(sc.flatten(0, 2), hit.float().argmax(-1).flatten(), reduction="none").view_as(tgt)
    loss_sel = (sce * ws).sum() / ws.sum().clamp(min=1)
    return loss_tok + loss_sel, {"loss": loss_tok.item() + loss_sel.item(), "tok": loss_tok.item(),
                                 "sel": loss_sel.item()}


def default_gamma(block: int) -> float:
    return PUBLISHED_GAMMA.get(block, block / 2)


def config_json(s: DraftShape) -> dict:
    """dflash/config.json as turbo/drafters/dflash_config.py parses a DFlash2 drafter's."""
    return {
        "architectures": [DFLASH2_ARCH], "model_type": "dflash2", "hidden_size": s.hidden,
        "num_hidden_layers": s.layers, "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim, "intermediate_size": s.intermediate, "rms_norm_eps": s.eps, "vocab_size": s.vocab,
        "sliding_window": s.window, "layer_types": ["sliding_attention"] * s.layers, "is_causal": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": s.rope_theta}, "torch_dtype": "bfloat16",
        "dflash_config": {"block_size": s.block, "mask_token_id": s.mask_token,
                          "target_layer_ids": list(s.target_layers), "conv_kernel_size": s.taps,
                          "conv_group_size": s.group, "selector_rank": s.rank, "selector_top_k": s.top_k},
    }


def export(model: DFlash2, out: Path) -> None:
    """config.json + model.safetensors (bf16, published names): what repack --drafter files."""
    tensors = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    write_tensors(out / "model.safetensors", tensors, {"format": "pt"})
    (out / "config.json").write_text(json.dumps(config_json(model.shape), indent=2) + "\n")


def shape_record(s: DraftShape) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(s).items()}


def parameters(model: nn.Module) -> int:
    return sum(math.prod(p.shape) for p in model.parameters())
