"""A trainable MTP head (docs/DESIGN.md 2.3), its losses and its export as `mtp.*` tensors.

The input convention is the runtime's (turbo/drafters/mtp.py): row p reads the trunk's hidden
state at p after its final norm and the embedding of token p+1, rotates at p and predicts the
trunk's greedy token at p+2. Step 1 is teacher-forced and causal over the sequence; step 2
feeds step 1's output back with the trunk's greedy token, one position on, attending to step
1's K/V at positions <= r and its own, as a draft round chains it. The layer starts as a copy
of the trunk's last full-attention layer, `norm` as its final norm, fc as [small | identity].
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..backends.ops import apply_rope, rope_cos_sin, rope_inv_freq
from ..store.arch import Arch
from ..store.install import Install
from ..store.safetensors_format import write_tensors
from ..store.tensor_shapes import MTP_PREFIX
from .dflash2 import Mlp, ZeroNorm


class GatedAttention(nn.Module):
    """The trunk's full-attention mixer: q_proj carries a sigmoid gate per head."""

    def __init__(self, a: Arch):
        super().__init__()
        self.nh, self.nkv, self.hd = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_proj = nn.Linear(a.hidden, 2 * a.num_heads * a.head_dim, bias=False)
        self.k_proj = nn.Linear(a.hidden, a.num_kv_heads * a.head_dim, bias=False)
        self.v_proj = nn.Linear(a.hidden, a.num_kv_heads * a.head_dim, bias=False)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, a.hidden, bias=False)
        self.q_norm = ZeroNorm(a.head_dim, a.rms_eps)
        self.k_norm = ZeroNorm(a.head_dim, a.rms_eps)

    def project(self, x, cos, sin):
        """x [B, T, H] -> q [B, nh, T, d], k, v [B, nkv, T, d], gate [B, T, nh*d]."""
        b, t, _ = x.shape
        qg = self.q_proj(x).view(b, t, self.nh, 2 * self.hd)
        q, gate = qg[..., :self.hd], qg[..., self.hd:].reshape(b, t, -1)
        k = self.k_proj(x).view(b, t, self.nkv, self.hd)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd)
        q = apply_rope(self.q_norm(q), cos, sin).transpose(1, 2)
        k = apply_rope(self.k_norm(k), cos, sin).transpose(1, 2)
        return q, k, v.transpose(1, 2), gate

    def attend(self, q, k, v, gate, mask=None, causal=False):
        rep = self.nh // self.nkv
        att = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                             attn_mask=mask, is_causal=causal)
        b, _, t, _ = att.shape
        return self.o_proj(att.transpose(1, 2).reshape(b, t, -1) * torch.sigmoid(gate))


class MtpLayer(nn.Module):
    def __init__(self, a: Arch):
        super().__init__()
        self.input_layernorm = ZeroNorm(a.hidden, a.rms_eps)
        self.post_attention_layernorm = ZeroNorm(a.hidden, a.rms_eps)
        self.self_attn = GatedAttention(a)
        self.mlp = Mlp(a.hidden, a.intermediate)


class MtpHead(nn.Module):
    """The head over the trunk's frozen `embed` and `lm_head` [vocab, H]."""

    def __init__(self, a: Arch, embed: torch.Tensor, lm_head: torch.Tensor):
        super().__init__()
        self.pre_fc_norm_embedding = ZeroNorm(a.hidden, a.rms_eps)
        self.pre_fc_norm_hidden = ZeroNorm(a.hidden, a.rms_eps)
        self.fc = nn.Linear(2 * a.hidden, a.hidden, bias=False)
        self.layers = nn.ModuleList([MtpLayer(a)])
        self.norm = ZeroNorm(a.hidden, a.rms_eps)
        self.register_buffer("embed", embed.float(), persistent=False)
        self.register_buffer("lm_head", lm_head.float(), persistent=False)
        self.register_buffer("inv_freq", rope_inv_freq(a.rotary_dim, a.rope_theta), persistent=False)

    def fuse(self, hidden, tokens):
        return self.fc(torch.cat([self.pre_fc_norm_embedding(self.embed[tokens]), self.pre_fc_norm_hidden(hidden)], -1))

    def finish(self, x, y):
        layer = self.layers[0]
        x = x + y
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        out = self.norm(x)
        return out, out @ self.lm_head.T

    def forward(self, hidden, ids, greedy):
        """hidden [B, T, H] (the trunk's, after its final norm), ids [B, T], greedy [B, T] (the
        trunk's argmax at each position). Returns step-1 logits [B, T-1, V] (row p predicts the
        greedy token at p+2) and step-2 logits [B, T-2, V] (row r at r+1 predicts p+3)."""
        layer = self.layers[0]
        attn = layer.self_attn
        t, dev = ids.shape[1], ids.device
        n1, n2 = t - 1, t - 2
        x1 = self.fuse(hidden[:, :n1], ids[:, 1:])
        cos, sin = rope_cos_sin(torch.arange(n1, device=dev), self.inv_freq)
        q1, k1, v1, g1 = attn.project(layer.input_layernorm(x1), cos, sin)
        out1, logits1 = self.finish(x1, attn.attend(q1, k1, v1, g1, causal=True))
        x2 = self.fuse(out1[:, :n2], greedy[:, 1:n1])
        cos, sin = rope_cos_sin(torch.arange(1, n2 + 1, device=dev), self.inv_freq)
        q2, k2, v2, g2 = attn.project(layer.input_layernorm(x2), cos, sin)
        mask = torch.cat([torch.ones(n2, n1, dtype=torch.bool, device=dev).tril(),
                          torch.eye(n2, dtype=torch.bool, device=dev)], 1)
        _, logits2 = self.finish(x2, attn.attend(q2, torch.cat([k1, k2], 2), torch.cat([v1, v2], 2), g2, mask=mask))
        return logits1, logits2

    def init_from_trunk(self, install: Install) -> None:
        """The layer from the trunk's last full-attention layer, `norm` from its final norm."""
        src = f"trunk.layers.{install.arch.full_layers[-1]}."
        layer = self.layers[0]
        with torch.no_grad():
            layer.load_state_dict({k: install.index.load(src + k, torch.float32) for k in layer.state_dict()})
            self.norm.weight.copy_(install.index.load("trunk.norm.weight", torch.float32))
            h = self.fc.weight.shape[0]
            self.fc.weight.zero_()
            self.fc.weight[:, :h].normal_(0, 0.02)
            self.fc.weight[:, h:].copy_(torch.eye(h))


def loss(head: MtpHead, ids: torch.Tensor, hidden: torch.Tensor, greedy: torch.Tensor, lengths: torch.Tensor,
         step2_weight: float = 0.5) -> tuple[torch.Tensor, dict[str, float]]:
    """Next-next-token cross entropy against the trunk's greedy tokens: step-1 row p ->
    greedy[p+1]; step-2 row r -> greedy[r+2] where the fed token greedy[r+1] is the text's token
    r+2 (the chain a draft round meets). lengths [N]: rows past a sequence's end do not count."""
    logits1, logits2 = head(hidden.float(), ids, greedy)
    t = ids.shape[1]
    inside = torch.arange(t, device=ids.device)[None] < lengths[:, None]  # [N, T]
    m1 = inside[:, 1:]
    ce1 = F.cross_entropy(logits1.flatten(0, 1), greedy[:, 1:].flatten(), reduction="none").view_as(m1)
    l1 = (ce1 * m1).sum() / m1.sum().clamp(min=1)
    ok = (ids[:, 2:] == greedy[:, 1:-1]) & inside[:, 2:]
    ce2 = F.cross_entropy(logits2.flatten(0, 1), greedy[:, 2:].flatten(), reduction="none").view_as(ok)
    l2 = (ce2 * ok).sum() / ok.sum().clamp(min=1)
    total = l1 + step2_weight * l2
    return total, {"loss": total.item(), "step1": l1.item(), "step2": l2.item()}


def export(head: MtpHead, out: Path) -> None:
    """model.safetensors of `mtp.*` tensors (bf16): what repack --mtp files into an install."""
    tensors = {MTP_PREFIX + k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in head.state_dict().items()}
    write_tensors(out / "model.safetensors", tensors, {"format": "pt"})
