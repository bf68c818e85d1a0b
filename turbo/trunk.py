"""The Qwen3.5 trunk: embedding, hybrid layers, head (docs/DESIGN.md 2.1), on the CPU or a GPU.

Two entry points share the weights and the caches:
- `prefill` runs a whole prompt at once (the step's own way: native.c in chunks of rows,
  torch ops the whole prompt per op -- chunked delta rule, causal SDPA);
- `step` runs R rows one after another's state -- R = 1 is a decode step, R = B + 1 a
  speculative verify -- with row-stable ops, so a verify row equals the decode step it
  stands for, bit for bit. It can leave what a rollback needs (`rollback`).

The trunk holds the weights (read and checked by turbo/loader.py) and the math the prefill
and the torch step share; `step` runs on the step object the loader chose (native.c or
torch ops, turbo/backends/step.py). On cuda the hot ops run the PTX kernels (turbo/ops.py
dispatches on the tensors' device) and quantized matrices stay packed for the quantized
GEMV kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from . import ops
from .arch import Arch
from .backends.step import StepOut, TrunkState, TrunkStep

PREFIX = "trunk."


@dataclass
class AttnWeights:
    qkv: torch.Tensor  # [2*H*d (query|gate per head) + 2*Hkv*d, hidden]
    o: torch.Tensor
    q_norm: torch.Tensor  # 1 + w, fp32
    k_norm: torch.Tensor


@dataclass
class GdnWeights:
    in_proj: torch.Tensor  # [qkv | z | b | a] rows fused
    conv: torch.Tensor  # [C, K] fp32
    neg_a: torch.Tensor  # -exp(A_log), fp32
    dt_bias: torch.Tensor
    norm: torch.Tensor  # plain weight, fp32
    out: torch.Tensor


@dataclass
class MoeWeights:
    """One layer's mixture of experts: the router, every expert, the gated shared expert."""

    router: torch.Tensor  # [E, hidden]
    gate_up: list[torch.Tensor]  # E x [2*I, hidden] (gate rows | up rows)
    down: list[torch.Tensor]  # E x [hidden, I]
    shared_gate_up: torch.Tensor | None  # [2*S, hidden]; None: no shared expert (S = 0)
    shared_down: torch.Tensor | None  # [hidden, S]
    shared_gate: torch.Tensor | None  # [1, hidden]: sigmoid of it scales the shared expert

    def matrices(self) -> list[torch.Tensor]:
        shared = [self.shared_gate_up, self.shared_down, self.shared_gate] if self.shared_gate_up is not None else []
        return [self.router, *self.gate_up, *self.down, *shared]


@dataclass
class LayerWeights:
    gdn: bool  # a Gated DeltaNet layer (else gated attention)
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    mixer: AttnWeights | GdnWeights
    gate_up: torch.Tensor | None  # the dense MLP (None in an MoE layer)
    down: torch.Tensor | None
    moe: MoeWeights | None = None  # the MoE block, in place of the dense MLP

    def mlp_matrices(self) -> list[torch.Tensor]:
        return self.moe.matrices() if self.moe is not None else [self.gate_up, self.down]


@dataclass
class TrunkWeights:
    embed: torch.Tensor  # [vocab, hidden]
    lm_head: torch.Tensor  # [vocab, hidden] (the embedding itself when tied)
    final_norm: torch.Tensor  # 1 + w, fp32
    layers: list[LayerWeights]
    inv_freq: torch.Tensor  # [rotary_dim / 2]


def swiglu(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate h) * up h), gate_up the two matrices' rows stacked."""
    gu = ops.linear(h, gate_up)
    n = gu.shape[1] // 2
    return ops.linear(ops.silu(gu[:, :n]) * gu[:, n:], down)


def route_rows(logits: torch.Tensor, top_k: int, renormalise: bool) -> list[list[tuple[int, float]]]:
    """Each row's experts and weights: softmax over the router logits [R, E] in fp32, the
    top_k most probable (ties to the lower expert index: a stable sort), their probabilities
    renormalised to sum to 1 when the config says so; a row at a time, so that a row's
    routing is the same whatever rows are routed with it."""
    picks = []
    for row in logits.float():
        probs, experts = torch.sort(torch.softmax(row, dim=-1), descending=True, stable=True)
        top = probs[:top_k]
        if renormalise:
            top = top / top.sum()
        picks.append(sorted(zip(experts[:top_k].tolist(), top.tolist())))
    return picks


def trunk_matrices(w: TrunkWeights | Trunk) -> list[torch.Tensor]:
    """Every weight the decode/verify path multiplies by."""
    mats = [w.lm_head]
    for layer in w.layers:
        m = layer.mixer
        mats += [m.in_proj, m.out] if layer.gdn else [m.qkv, m.o]
        mats += layer.mlp_matrices()
    return mats


class Trunk:
    def __init__(self, arch: Arch, weights: TrunkWeights, dtype: torch.dtype, device: torch.device,
                 kv_dtype: torch.dtype, make_step: Callable[[Trunk], TrunkStep], why_torch: str | None = None):
        self.arch, self.dtype, self.device = arch, dtype, device
        self.kv_dtype = kv_dtype  # the attention layers' K/V caches (turbo.loader.kv_dtype)
        self.embed, self.lm_head, self.final_norm = weights.embed, weights.lm_head, weights.final_norm
        self.layers, self.inv_freq = weights.layers, weights.inv_freq
        self.stepper = make_step(self)  # (may repack the matrices for its own products)
        self.why_torch = why_torch  # why the native step is not the one in use (None: it is)

    @property
    def step_name(self) -> str:
        return self.stepper.name

    def matrices(self) -> list[torch.Tensor]:
        return trunk_matrices(self)

    # ---- state -------------------------------------------------------------------------

    def new_state(self, capacity: int = 256) -> TrunkState:
        a, dev = self.arch, self.device
        kv = {i: (torch.zeros(a.num_kv_heads, capacity, a.head_dim, dtype=self.kv_dtype, device=dev),
                  torch.zeros(a.num_kv_heads, capacity, a.head_dim, dtype=self.kv_dtype, device=dev))
              for i in a.full_layers}  # K, V [kv_heads, capacity, head_dim] per full-attention layer
        gdn = {i: (torch.zeros(a.lin_v_heads, a.lin_k_dim, a.lin_v_dim, device=dev),
                   torch.zeros(a.conv_kernel - 1, a.lin_conv_dim, device=dev))
               for i in range(a.num_layers) if a.is_gdn(i)}
        return TrunkState(0, kv, gdn)

    def reserve(self, st: TrunkState, end: int) -> None:
        for i, (k, v) in st.kv.items():
            if k.shape[1] < end:
                cap = max(end, 2 * k.shape[1])
                k2, v2 = k.new_zeros(k.shape[0], cap, k.shape[2]), v.new_zeros(v.shape[0], cap, v.shape[2])
                k2[:, :st.pos], v2[:, :st.pos] = k[:, :st.pos], v[:, :st.pos]
                st.kv[i] = (k2, v2)

    # ---- shared pieces -----------------------------------------------------------------

    def mlp(self, layer: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        if layer.moe is not None:
            return self.moe(layer.moe, h)
        return swiglu(h, layer.gate_up, layer.down)

    def moe(self, m: MoeWeights, h: torch.Tensor) -> torch.Tensor:
        """The MoE block of R rows, each routed on its own (route_rows); an expert runs once
        over the rows that picked it, and each row adds its experts' outputs in ascending
        expert order, so its sum does not depend on the rows routed with it."""
        a = self.arch
        out = torch.zeros(h.shape[0], a.hidden, device=h.device)
        picks = route_rows(ops.linear(h, m.router), a.experts_per_token, a.norm_topk_prob)
        for e in sorted({e for row in picks for e, _ in row}):
            rows = [r for r, row in enumerate(picks) for x, _ in row if x == e]
            weights = torch.tensor([w for row in picks for x, w in row if x == e], device=h.device)
            out[rows] += swiglu(h[rows], m.gate_up[e], m.down[e]) * weights[:, None]
        if m.shared_gate_up is not None:
            out = out + ops.sigmoid(ops.linear(h, m.shared_gate)) * swiglu(h, m.shared_gate_up, m.shared_down)
        return out

    def gdn_inputs(self, m: GdnWeights, h: torch.Tensor, window: torch.Tensor):
        """Projections and conv of R rows: returns ext, (q, k, v, g, beta) per row, z."""
        a = self.arch
        rows = h.shape[0]
        kd, vd = a.lin_k_heads * a.lin_k_dim, a.lin_v_heads * a.lin_v_dim
        proj = ops.linear(h, m.in_proj)
        qkv = proj[:, :2 * kd + vd]
        z = proj[:, 2 * kd + vd:2 * kd + 2 * vd]
        b = proj[:, 2 * kd + 2 * vd:2 * kd + 2 * vd + a.lin_v_heads]
        alpha = proj[:, 2 * kd + 2 * vd + a.lin_v_heads:]
        ext = torch.cat([window, qkv])
        mixed = ops.causal_conv_rows(ext, m.conv)
        rep = a.lin_v_heads // a.lin_k_heads
        q = ops.l2norm(mixed[:, :kd].reshape(rows, a.lin_k_heads, a.lin_k_dim)) * a.lin_k_dim ** -0.5
        k = ops.l2norm(mixed[:, kd:2 * kd].reshape(rows, a.lin_k_heads, a.lin_k_dim))
        if rep > 1:  # value head h reads key head h // rep (expand+reshape: a plain copy, no index math)
            q = q[:, :, None].expand(rows, a.lin_k_heads, rep, a.lin_k_dim).reshape(rows, a.lin_v_heads, a.lin_k_dim)
            k = k[:, :, None].expand(rows, a.lin_k_heads, rep, a.lin_k_dim).reshape(rows, a.lin_v_heads, a.lin_k_dim)
        v = mixed[:, 2 * kd:].reshape(rows, a.lin_v_heads, a.lin_v_dim)
        g = m.neg_a * ops.rowwise(F.softplus, alpha + m.dt_bias)
        return ext, (q, k, v, g, ops.sigmoid(b)), z

    def gdn_out(self, m: GdnWeights, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        a = self.arch
        y = ops.gated_rms_norm(o, z.reshape(o.shape), m.norm, a.rms_eps)
        return ops.linear(y.reshape(o.shape[0], -1), m.out)

    def qkv(self, m: AttnWeights, h: torch.Tensor, positions: torch.Tensor):
        a = self.arch
        rows, hd, nh, nkv = h.shape[0], a.head_dim, a.num_heads, a.num_kv_heads
        proj = ops.linear(h, m.qkv)
        qg = proj[:, :2 * nh * hd].reshape(rows, nh, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(rows, nh * hd)
        k = proj[:, 2 * nh * hd:2 * nh * hd + nkv * hd].reshape(rows, nkv, hd)
        v = proj[:, 2 * nh * hd + nkv * hd:].reshape(rows, nkv, hd)
        cos, sin = ops.rope_cos_sin(positions, self.inv_freq)
        q = ops.apply_rope(ops.rms_norm(q, m.q_norm, a.rms_eps), cos, sin)
        k = ops.apply_rope(ops.rms_norm(k, m.k_norm, a.rms_eps), cos, sin)
        return q, k, v, gate

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(ops.rms_norm(x, self.final_norm, self.arch.rms_eps), self.lm_head)

    # ---- prefill -----------------------------------------------------------------------

    def prefill(self, st: TrunkState, tokens: list[int], aux_layers: tuple[int, ...] = (),
                want_logits: bool = False) -> StepOut:
        """The prompt at once, from an empty state (logits: the last row's, or every row's)."""
        if st.pos != 0:
            raise ValueError("prefill starts from an empty state")
        self.reserve(st, len(tokens))
        return self.stepper.prefill(st, tokens, aux_layers, want_logits)

    def prefill_torch(self, st: TrunkState, tokens: list[int], aux_layers: tuple[int, ...],
                      want_logits: bool) -> StepOut:
        """The torch step's prefill: the whole prompt per op (chunked delta rule, causal SDPA)."""
        a = self.arch
        n = len(tokens)
        x = self.embed[torch.tensor(tokens, device=self.device)].float()
        positions = torch.arange(n, device=self.device)
        aux = []
        for i, layer in enumerate(self.layers):
            h = ops.rms_norm(x, layer.in_norm, a.rms_eps)
            m = layer.mixer
            if isinstance(m, GdnWeights):
                state, window = st.gdn[i]
                ext, (q, k, v, g, beta), z = self.gdn_inputs(m, h, window)
                o, state = ops.gdn_chunked(state, q, k, v, g, beta)
                st.gdn[i] = (state.contiguous(), ext[ext.shape[0] - (a.conv_kernel - 1):])  # (native.c reads raw)
                y = self.gdn_out(m, o, z)
            else:
                q, k, v, gate = self.qkv(m, h, positions)
                kc, vc = st.kv[i]
                kc[:, :n], vc[:, :n] = k.transpose(0, 1), v.transpose(0, 1)
                rep = a.num_heads // a.num_kv_heads
                # the keys and values as cached (a bf16 cache's rounded), as the steps after read them
                att = F.scaled_dot_product_attention(
                    q.transpose(0, 1)[None], kc[:, :n].float().repeat_interleave(rep, 0)[None],
                    vc[:, :n].float().repeat_interleave(rep, 0)[None], is_causal=True)
                y = ops.linear(att[0].transpose(0, 1).reshape(n, -1) * ops.sigmoid(gate), m.o)
            x = x + y
            x = x + self.mlp(layer, ops.rms_norm(x, layer.post_norm, a.rms_eps))
            if i in aux_layers:
                aux.append(x)
        st.pos = n
        logits = self.head(x) if want_logits else self.head(x[-1:])
        return StepOut(logits, x, torch.cat(aux, dim=-1) if aux else None)

    # ---- decode / verify ---------------------------------------------------------------

    def step(self, st: TrunkState, tokens: list[int], aux_layers: tuple[int, ...] = (),
             rollback: str | None = None) -> StepOut:
        """R rows at positions pos..pos+R-1; leaves the state after the last row.

        rollback: None (no rollback possible), "checkpoint" (keep the state after every row)
        or "replay" (keep the rows' recurrence inputs to replay from the snapshot)."""
        return self.stepper.step(st, tokens, aux_layers, rollback)

    def rollback(self, st: TrunkState, out: StepOut, rows: int, kept: int, rollback: str) -> int:
        """Keep the first `kept` of the `rows` just stepped. Returns the rows replayed."""
        if kept == rows:
            return 0
        taps = self.arch.conv_kernel
        st.pos -= rows - kept  # attention: positions past the kept rows are simply overwritten later
        replayed = 0
        for i, tr in out.traces.items():
            window = tr.ext[kept:kept + taps - 1]
            if rollback == "checkpoint":
                state = tr.states[kept - 1] if kept else tr.snapshot
            else:
                state = self.stepper.replay(tr, kept)  # the recurrence code the verify ran
                replayed = kept
            st.gdn[i] = (state, window)
        return replayed
