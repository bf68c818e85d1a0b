"""The torch step: the trunk's forward (prefill, the row-stable step, replay), the MTP head's
layer and the DFlash passes in torch ops. It is the CPU reference the native step and the CUDA
kernels are tested against; on backend=cuda the same code runs the PTX kernels (turbo/backends/ops.py
dispatches on the tensors' device). The weights it reads are turbo/model/trunk.py's dataclasses."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..model.step import GdnTrace, StepOut, TrunkState
from ..model.trunk import AttnWeights, GdnWeights, LayerWeights, MoeWeights, Trunk
from ..store.arch import Arch
from . import ops
from .dflash_math import grouped_conv, select_candidates


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


def moe(a: Arch, m: MoeWeights, h: torch.Tensor) -> torch.Tensor:
    """The MoE block of R rows, each routed on its own (route_rows); an expert runs once
    over the rows that picked it, and each row adds its experts' outputs in ascending
    expert order, so its sum does not depend on the rows routed with it."""
    out = torch.zeros(h.shape[0], a.hidden, device=h.device)
    picks = route_rows(ops.linear(h, m.router), a.experts_per_token, a.norm_topk_prob)
    for e in sorted({e for row in picks for e, _ in row}):
        rows = [r for r, row in enumerate(picks) for x, _ in row if x == e]
        weights = torch.tensor([w for row in picks for x, w in row if x == e], device=h.device)
        out[rows] += swiglu(h[rows], m.gate_up[e], m.down[e]) * weights[:, None]
    if m.shared_gate_up is not None:
        out = out + ops.sigmoid(ops.linear(h, m.shared_gate)) * swiglu(h, m.shared_gate_up, m.shared_down)
    return out


def mlp(a: Arch, layer: LayerWeights, h: torch.Tensor) -> torch.Tensor:
    if layer.moe is not None:
        return moe(a, layer.moe, h)
    return swiglu(h, layer.gate_up, layer.down)


def gdn_inputs(a: Arch, m: GdnWeights, h: torch.Tensor, window: torch.Tensor):
    """Projections and conv of R rows: returns ext, (q, k, v, g, beta) per row, z."""
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


def gdn_out(a: Arch, m: GdnWeights, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    y = ops.gated_rms_norm(o, z.reshape(o.shape), m.norm, a.rms_eps)
    return ops.linear(y.reshape(o.shape[0], -1), m.out)


def qkv(a: Arch, inv_freq: torch.Tensor, m: AttnWeights, h: torch.Tensor, positions: torch.Tensor):
    """A gated attention layer's q (normed, rotated), k (likewise), v and output gate of R rows."""
    rows, hd, nh, nkv = h.shape[0], a.head_dim, a.num_heads, a.num_kv_heads
    proj = ops.linear(h, m.qkv)
    qg = proj[:, :2 * nh * hd].reshape(rows, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(rows, nh * hd)
    k = proj[:, 2 * nh * hd:2 * nh * hd + nkv * hd].reshape(rows, nkv, hd)
    v = proj[:, 2 * nh * hd + nkv * hd:].reshape(rows, nkv, hd)
    cos, sin = ops.rope_cos_sin(positions, inv_freq)
    q = ops.apply_rope(ops.rms_norm(q, m.q_norm, a.rms_eps), cos, sin)
    k = ops.apply_rope(ops.rms_norm(k, m.k_norm, a.rms_eps), cos, sin)
    return q, k, v, gate


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, a: Arch) -> torch.Tensor:
    """One row's attention: q [heads, d] over keys / values [kv_heads, n, d], each kv head
    serving its group of query heads; [heads * d]."""
    qr = q.reshape(a.num_kv_heads, a.num_heads // a.num_kv_heads, a.head_dim)
    scores = torch.bmm(qr, keys.transpose(1, 2)) * a.head_dim ** -0.5
    return torch.bmm(torch.softmax(scores, dim=-1), values).reshape(-1)


# one layer's mixer: (layer index, its weights, its normed input rows) -> its output rows
Mixer = Callable[[int, LayerWeights, torch.Tensor], torch.Tensor]


class TorchTrunkStep:
    name = "torch"
    prefill_rows_are_steps = False  # a chunked delta rule and one attention call: within tolerance, not bits

    def __init__(self, trunk: Trunk):
        self.trunk = trunk
        for mat in trunk.matrices():  # the row blocks ops.linear pads to, once per matrix
            ops.calibrate_rows(mat)

    def _layers(self, tokens: list[int], aux_layers: tuple[int, ...], mix: Mixer, mm=None):
        """The embedded rows (mm's image rows the tower's) through every layer (`mix` the
        mixers): (last hidden, aux)."""
        t = self.trunk
        a = t.arch
        x = t.embed[torch.tensor(tokens, device=t.device)].float()
        if mm is not None:
            x[mm.rows.to(t.device)] = mm.embeds.to(x)
        aux = []
        for i, layer in enumerate(t.layers):
            x = x + mix(i, layer, ops.rms_norm(x, layer.in_norm, a.rms_eps))
            x = x + mlp(a, layer, ops.rms_norm(x, layer.post_norm, a.rms_eps))
            if i in aux_layers:
                aux.append(x)
        return x, torch.cat(aux, dim=-1) if aux else None

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        t = self.trunk
        return ops.linear(ops.rms_norm(x, t.final_norm, t.arch.rms_eps), t.lm_head)

    def prefill(self, st: TrunkState, tokens: list[int], aux_layers: tuple[int, ...], want_logits: bool,
                mm=None) -> StepOut:
        """The whole prompt per op (chunked delta rule, causal SDPA)."""
        t = self.trunk
        a = t.arch
        n = len(tokens)
        positions = torch.arange(n, device=t.device) if mm is None else mm.freq_positions.to(t.device)

        def mix(i: int, layer: LayerWeights, h: torch.Tensor) -> torch.Tensor:
            m = layer.mixer
            if isinstance(m, GdnWeights):
                state, window = st.gdn[i]
                ext, (q, k, v, g, beta), z = gdn_inputs(a, m, h, window)
                o, state = ops.gdn_chunked(state, q, k, v, g, beta)
                st.gdn[i] = (state.contiguous(), ext[ext.shape[0] - (a.conv_kernel - 1):])  # (native.c reads raw)
                return gdn_out(a, m, o, z)
            q, k, v, gate = qkv(a, t.inv_freq, m, h, positions)
            kc, vc = st.kv[i]
            kc[:, :n], vc[:, :n] = k.transpose(0, 1), v.transpose(0, 1)
            rep = a.num_heads // a.num_kv_heads
            # the keys and values as cached (a bf16 cache's rounded), as the steps after read them
            att = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], kc[:, :n].float().repeat_interleave(rep, 0)[None],
                vc[:, :n].float().repeat_interleave(rep, 0)[None], is_causal=True)
            return ops.linear(att[0].transpose(0, 1).reshape(n, -1) * ops.sigmoid(gate), m.o)

        x, aux = self._layers(tokens, aux_layers, mix, mm)
        st.pos = n
        st.rope_delta = 0 if mm is None else mm.delta
        logits = self._head(x) if want_logits else self._head(x[-1:])
        return StepOut(logits, x, aux)

    def step(self, st: TrunkState, tokens: list[int], aux_layers: tuple[int, ...],
             rollback: str | None) -> StepOut:
        return self._step(st, tokens, aux_layers, rollback, len(tokens))

    def step_many(self, states: list[TrunkState], tokens: list[list[int]], aux_layers: list[tuple[int, ...]],
                  rollback: list[str | None], logit_rows: list[int]) -> list[StepOut]:
        """`step` per sequence, one after another: the products here are row-stable only in the
        shapes `ops.calibrate_rows` measured (1..9 rows; larger calls are not padded, and
        cuBLAS / MKL pick kernels by row count), so rows of several sequences stacked into one
        call would change a sequence's bits (at tiny's shapes a row's product differs from 16
        rows on). Logits for the last logit_rows[i] rows (ops.linear
        over just those: the rows of a verify-sized call, as `step`'s head has them)."""
        return [self._step(*args) for args in zip(states, tokens, aux_layers, rollback, logit_rows)]

    def _step(self, st: TrunkState, tokens: list[int], aux_layers: tuple[int, ...],
              rollback: str | None, logit_rows: int) -> StepOut:
        t = self.trunk
        a = t.arch
        rows, p0 = len(tokens), st.pos
        t.reserve(st, p0 + rows)
        positions = torch.arange(p0, p0 + rows, device=t.device) + st.rope_delta
        traces = {}

        def mix(i: int, layer: LayerWeights, h: torch.Tensor) -> torch.Tensor:
            m = layer.mixer
            if layer.gdn:
                state, window = st.gdn[i]
                ext, inputs, z = gdn_inputs(a, m, h, window)
                o, new_state, states = ops.gdn_recurrence(state, *inputs, keep_states=rollback == "checkpoint")
                st.gdn[i] = (new_state, ext[rows:])
                if rollback is not None:
                    traces[i] = GdnTrace(state, ext, inputs if rollback == "replay" else None, states)
                return gdn_out(a, m, o, z)
            q, k, v, gate = qkv(a, t.inv_freq, m, h, positions)
            kc, vc = st.kv[i]
            kc[:, p0:p0 + rows], vc[:, p0:p0 + rows] = k.transpose(0, 1), v.transpose(0, 1)
            return ops.linear(self._attend_rows(q, kc, vc, p0) * ops.sigmoid(gate), m.o)

        x, aux = self._layers(tokens, aux_layers, mix)
        st.pos = p0 + rows
        logits = self._head(x[rows - logit_rows:]) if logit_rows else torch.empty(0, a.vocab, device=t.device)
        return StepOut(logits, x, aux, traces)

    def _attend_rows(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, p0: int) -> torch.Tensor:
        """Each row attends to exactly its own causal prefix, one call per row, so a row's
        arithmetic does not depend on how many rows were verified with it."""
        a, end = self.trunk.arch, p0 + q.shape[0]
        keys, values = kc[:, :end].float(), vc[:, :end].float()  # (a bf16 cache widened once per layer)
        return torch.stack([attend(q[r], keys[:, :p0 + r + 1], values[:, :p0 + r + 1], a) for r in range(q.shape[0])])

    def replay(self, trace: GdnTrace, kept: int) -> torch.Tensor:
        state = trace.snapshot
        for r in range(kept):
            state, _ = ops.gdn_step(state, *(x[r] for x in trace.inputs))
        return state


class TorchMtpStep:
    """The MTP head's layer with the trunk's torch pieces (qkv / mlp above)."""

    name = "torch"

    def __init__(self, head):
        self.head = head

    def write(self, x: torch.Tensor, p0: int) -> None:
        self._write_kv(x, p0)

    def _write_kv(self, x: torch.Tensor, p0: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's q and gate for rows at p0.., with their K/V written into the cache."""
        hd = self.head
        rows = x.shape[0]
        hd.reserve(p0 + rows)
        h = ops.rms_norm(x, hd.layer.in_norm, hd.eps)
        q, k, v, gate = qkv(hd.arch, hd.trunk.inv_freq, hd.layer.mixer, h, torch.arange(p0, p0 + rows, device=hd.device))
        hd.k[:, p0:p0 + rows], hd.v[:, p0:p0 + rows] = k.transpose(0, 1), v.transpose(0, 1)
        return q, gate

    def row(self, x: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        hd = self.head
        a = hd.arch
        q, gate = self._write_kv(x, pos)
        att = attend(q[0], hd.k[:, hd.start:pos + 1].float(), hd.v[:, hd.start:pos + 1].float(), a)[None]
        x = x + ops.linear(att * ops.sigmoid(gate), hd.layer.mixer.o)
        x = x + mlp(a, hd.layer, ops.rms_norm(x, hd.layer.post_norm, hd.eps))
        out = ops.rms_norm(x, hd.final_norm, hd.eps)
        return out, ops.linear(out, hd.trunk.lm_head)


class TorchDflashStep:
    """The DFlash pass (either architecture) in torch ops, in the drafter's activation dtype;
    on cuda the grouped conv and the candidate selector run the PTX kernels."""

    name = "torch"

    def __init__(self, drafter):
        self.d = drafter

    def bind(self) -> None:
        pass  # the rings are read by index on every call

    def _lin(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(w.dtype), w)

    def add_context(self, aux: torch.Tensor) -> None:
        d = self.d
        n = aux.shape[0]
        ctx = ops.rms_norm(self._lin(aux, d.fc), d.hidden_norm, d.cfg.eps).to(d.dtype)
        positions = torch.arange(d.context, d.context + n, device=d.device)
        cos, sin = ops.rope_cos_sin(positions, d.inv_freq)
        slots = positions % d.capacity
        kv, hdim = d.shape.num_kv_heads, d.shape.head_dim
        for layer, rk, rv in zip(d.layers, d.ring_k, d.ring_v):
            k = ops.rms_norm(self._lin(ctx, layer.k).reshape(n, kv, hdim), layer.k_norm, d.cfg.eps)
            rk[slots] = ops.apply_rope(k, cos, sin).to(d.dtype)
            rv[slots] = self._lin(ctx, layer.v).reshape(n, kv, hdim).to(d.dtype)

    def _conv_prepare(self, x: torch.Tensor, proj: torch.Tensor | None, base: torch.Tensor | None):
        """The conv's side 0 of x and the dynamic kernels of its side 1; (x, None) without a conv."""
        d = self.d
        if not d.cfg.has_conv:
            return x, None
        groups = d.shape.hidden // d.cfg.group
        dyn = self._lin(x, proj).reshape(x.shape[0], 2, d.cfg.taps, groups)
        return self._grouped_conv(x, base[0], dyn[:, 0]), dyn[:, 1]

    def _conv_finish(self, y: torch.Tensor, base: torch.Tensor | None, dyn: torch.Tensor | None) -> torch.Tensor:
        return y if dyn is None else self._grouped_conv(y, base[1], dyn)

    def _grouped_conv(self, h: torch.Tensor, base: torch.Tensor, dyn: torch.Tensor) -> torch.Tensor:
        cb = ops.cuda_kernels(h)
        if cb is not None:  # dflash.cu (fp32), back in the activation dtype
            return cb.grouped_conv(h, base, dyn, self.d.cfg.group).to(h.dtype)
        return grouped_conv(h, base, dyn, self.d.cfg.group)

    def _attention(self, li: int, u: torch.Tensor, anchor_pos: int) -> torch.Tensor:
        d = self.d
        layer = d.layers[li]
        rows = u.shape[0]
        h, kv, hdim = d.shape.num_heads, d.shape.num_kv_heads, d.shape.head_dim
        cos, sin = ops.rope_cos_sin(torch.arange(anchor_pos, anchor_pos + rows, device=d.device), d.inv_freq)
        q = ops.apply_rope(ops.rms_norm(self._lin(u, layer.q).reshape(rows, h, hdim), layer.q_norm, d.cfg.eps), cos, sin)
        k = ops.apply_rope(ops.rms_norm(self._lin(u, layer.k).reshape(rows, kv, hdim), layer.k_norm, d.cfg.eps), cos, sin)
        v = self._lin(u, layer.v).reshape(rows, kv, hdim).float()
        lo = max(0, anchor_pos - d.window)
        slots = torch.arange(lo, anchor_pos, device=d.device) % d.capacity
        keys = torch.cat([d.ring_k[li][slots].float(), k])  # [ctx + rows, kv, d]
        values = torch.cat([d.ring_v[li][slots].float(), v])
        rep = h // kv
        keys, values = keys.repeat_interleave(rep, 1).transpose(0, 1), values.repeat_interleave(rep, 1).transpose(0, 1)
        mask = None
        if d.cfg.is_causal:
            ctx = slots.shape[0]
            mask = torch.ones(rows, ctx + rows, dtype=torch.bool, device=d.device).tril(ctx)
        att = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask)
        return self._lin(att.transpose(0, 1).reshape(rows, h * hdim), layer.o)

    def forward(self, anchor: int, anchor_pos: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.d
        s = d.scale
        eps = d.cfg.eps / (s * s)  # norms reading the scaled stream compute the unscaled norm
        tokens = torch.tensor([anchor] + [d.cfg.mask_token] * block, device=d.device)
        x = (d.embed[tokens].float() / s).to(d.dtype)
        for li, layer in enumerate(d.layers):
            xn = ops.rms_norm(x, layer.in_norm, eps).to(d.dtype)
            u, dyn = self._conv_prepare(xn, layer.attn_proj, layer.attn_base)
            y = self._conv_finish(self._attention(li, u, anchor_pos).to(d.dtype), layer.attn_base, dyn)
            x = x + y / s
            xn = ops.rms_norm(x, layer.post_norm, eps).to(d.dtype)
            u, dyn = self._conv_prepare(xn, layer.mlp_proj, layer.mlp_base)
            y = self._lin(F.silu(self._lin(u, layer.gate)) * self._lin(u, layer.up), layer.down)
            x = x + self._conv_finish(y, layer.mlp_base, dyn) / s
        final = ops.rms_norm(x, d.final_norm, eps)[1:]
        return self._lin(final, d.lm_head).float(), final

    def select(self, logits: torch.Tensor, final: torch.Tensor, anchor: int, top_k: int) -> list[int]:
        d = self.d
        cb = ops.cuda_kernels(logits)
        select = cb.select_candidates if cb is not None and top_k <= cb.SEL_MAX_K else select_candidates
        return select(logits, final, anchor, d.hidden_projection, d.pred_codebook, d.succ_codebook, top_k)
