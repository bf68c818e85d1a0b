"""The Qwen3.5 trunk: embedding, hybrid layers, head (DESIGN 2.1), on the CPU or a GPU.

Two entry points share the weights and the caches:
- `prefill` runs a whole prompt at once (chunked delta rule, causal SDPA);
- `step` runs R rows one after another's state -- R = 1 is a decode step, R = B + 1 a
  speculative verify -- with row-stable ops, so a verify row equals the decode step it
  stands for, bit for bit. It can leave what a rollback needs (`keep`).

`device` (default cpu): the weights are loaded and prepared on the host as for the CPU,
then moved there once; the caches and every tensor the forward creates live there too.
On cuda the hot ops run the PTX kernels (turbo/ops.py dispatches on the tensors' device)
and quantized matrices stay packed for the quantized GEMV kernel.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import ops, quant
from .arch import Arch
from .backends import native
from .errors import TurboError
from .install import Install

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
class LayerWeights:
    linear: bool
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    mixer: AttnWeights | GdnWeights
    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass
class TrunkState:
    """Everything one sequence has cached: `pos` positions are committed."""

    pos: int
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> K, V [Hkv, capacity, d]
    gdn: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> state [Hv, dk, dv] fp32, conv window [K-1, C]


@dataclass
class GdnTrace:
    """What one GDN layer's verify leaves behind for a rollback."""

    snapshot: torch.Tensor  # the state before the verify (never mutated: the recurrence is functional)
    ext: torch.Tensor  # [K-1+R, C]: the conv window before the verify, then the rows' conv inputs
    inputs: tuple[torch.Tensor, ...] | None  # per-row q, k, v, g, beta (replay)
    states: list[torch.Tensor] | None  # state after every row (checkpoint)


@dataclass
class StepOut:
    logits: torch.Tensor  # [R, vocab] fp32
    hidden: torch.Tensor  # [R, hidden]: the last layer's output, before the final norm
    aux: torch.Tensor | None  # [R, n_aux * hidden]: the requested layers' outputs, concatenated
    traces: dict[int, GdnTrace] = field(default_factory=dict)


def pack_layer(layer: LayerWeights, dtype: torch.dtype, layout: str = "panels") -> None:
    """The layer's matrices into native.c's packed `layout` (panels: in `dtype`), in place
    (ops.linear takes them too)."""
    def pk(w: torch.Tensor) -> native.Packed:
        return native.pack_as(w, dtype, layout)

    m = layer.mixer
    if isinstance(m, GdnWeights):
        m.in_proj, m.out = pk(m.in_proj), pk(m.out)
    else:
        m.qkv, m.o = pk(m.qkv), pk(m.o)
    layer.gate_up, layer.down = pk(layer.gate_up), pk(layer.down)


def native_layer(a: Arch, layer: LayerWeights, inv_freq: torch.Tensor) -> native.Layer:
    """native.c's struct for one packed layer (its tensors must outlive it: it holds pointers)."""
    ptr, m = native.ptr, layer.mixer
    s = native.Layer(hidden=a.hidden, inter=a.intermediate, wtype=layer.gate_up.wtype, eps=a.rms_eps,
                     in_norm=ptr(layer.in_norm), post_norm=ptr(layer.post_norm),
                     gate_up=ptr(layer.gate_up), down=ptr(layer.down))
    if isinstance(m, GdnWeights):
        s.in_proj, s.out, s.conv = ptr(m.in_proj), ptr(m.out), ptr(m.conv)
        s.neg_a, s.dt_bias, s.gnorm = ptr(m.neg_a), ptr(m.dt_bias), ptr(m.norm)
        s.kheads, s.kdim, s.vheads, s.vdim, s.taps = a.lin_k_heads, a.lin_k_dim, a.lin_v_heads, a.lin_v_dim, a.conv_kernel
    else:
        s.qkv, s.o, s.q_norm, s.k_norm, s.inv_freq = ptr(m.qkv), ptr(m.o), ptr(m.q_norm), ptr(m.k_norm), ptr(inv_freq)
        s.heads, s.kv_heads, s.head_dim, s.rot = a.num_heads, a.num_kv_heads, a.head_dim, a.rotary_dim
    return s


class Trunk:
    def __init__(self, install: Install, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        self.arch: Arch = install.arch
        self.dtype = dtype
        self.device = torch.device(device)
        on_cpu = self.device.type == "cpu"
        a = self.arch
        index = install.index

        mode = quant.cpu_mode()  # how quantized matrices run on the CPU (turbo/quant.py; measured)

        stored: set[str] = set()  # how the matrices (and the embedding) are stored: see native.storage_dtype

        def w(name: str, shape: tuple[int, ...], as_dtype: torch.dtype | None = None, matrix: bool = False):
            full = PREFIX + name
            entry = index.need(full)
            if matrix or name == "embed_tokens.weight":
                stored.add(entry.st_dtype)
            if entry.dims != tuple(shape):
                raise TurboError(f"{full} has shape {list(entry.dims)}, expected {list(shape)}")
            if matrix and entry.bits and (not on_cpu or quant.keep_packed(mode, entry.bits, as_dtype or dtype)):
                qw = index.load_quantized(full, as_dtype or dtype)  # a QuantizedWeight for ops.linear
                qw.use_kernel = mode != "packed" and on_cpu  # (on cuda: the quantized GEMV kernel)
                return qw
            return index.load(full, as_dtype or dtype)

        def norm(name: str, n: int) -> torch.Tensor:
            return 1.0 + w(name, (n,), torch.float32)

        self.embed = w("embed_tokens.weight", (a.vocab, a.hidden))
        if a.tie_embeddings:
            self.lm_head = self.embed
        else:
            self.lm_head = w("lm_head.weight", (a.vocab, a.hidden), matrix=True)
        self.final_norm = norm("norm.weight", a.hidden)
        self.layers: list[LayerWeights] = []
        hd, nh, nkv = a.head_dim, a.num_heads, a.num_kv_heads
        kd, vd = a.lin_k_heads * a.lin_k_dim, a.lin_v_heads * a.lin_v_dim
        for i in range(a.num_layers):
            p = f"layers.{i}."
            if a.is_linear(i):
                m = p + "linear_attn."
                conv = w(m + "conv1d.weight", (a.lin_conv_dim, 1, a.conv_kernel), torch.float32)[:, 0]
                mixer: AttnWeights | GdnWeights = GdnWeights(
                    in_proj=quant.fuse([
                        w(m + "in_proj_qkv.weight", (2 * kd + vd, a.hidden), matrix=True),
                        w(m + "in_proj_z.weight", (vd, a.hidden), matrix=True),
                        w(m + "in_proj_b.weight", (a.lin_v_heads, a.hidden), matrix=True),
                        w(m + "in_proj_a.weight", (a.lin_v_heads, a.hidden), matrix=True),
                    ]),
                    conv=conv.contiguous(),
                    neg_a=-w(m + "A_log", (a.lin_v_heads,), torch.float32).exp(),
                    dt_bias=w(m + "dt_bias", (a.lin_v_heads,), torch.float32),
                    norm=w(m + "norm.weight", (a.lin_v_dim,), torch.float32),
                    out=w(m + "out_proj.weight", (a.hidden, vd), matrix=True),
                )
            else:
                m = p + "self_attn."
                mixer = AttnWeights(
                    qkv=quant.fuse([
                        w(m + "q_proj.weight", (2 * nh * hd, a.hidden), matrix=True),
                        w(m + "k_proj.weight", (nkv * hd, a.hidden), matrix=True),
                        w(m + "v_proj.weight", (nkv * hd, a.hidden), matrix=True),
                    ]),
                    o=w(m + "o_proj.weight", (a.hidden, nh * hd), matrix=True),
                    q_norm=norm(m + "q_norm.weight", hd),
                    k_norm=norm(m + "k_norm.weight", hd),
                )
            self.layers.append(LayerWeights(
                linear=a.is_linear(i),
                in_norm=norm(p + "input_layernorm.weight", a.hidden),
                post_norm=norm(p + "post_attention_layernorm.weight", a.hidden),
                mixer=mixer,
                gate_up=quant.fuse([w(p + "mlp.gate_proj.weight", (a.intermediate, a.hidden), matrix=True),
                                    w(p + "mlp.up_proj.weight", (a.intermediate, a.hidden), matrix=True)]),
                down=w(p + "mlp.down_proj.weight", (a.hidden, a.intermediate), matrix=True),
            ))
        self.inv_freq = ops.rope_inv_freq(a.rotary_dim, a.rope_theta)
        if not on_cpu:  # once, at load: everything above was prepared on the host exactly as for the CPU
            self.embed = ops.to_device(self.embed, self.device)
            self.lm_head = self.embed if a.tie_embeddings else ops.to_device(self.lm_head, self.device)
            self.final_norm = ops.to_device(self.final_norm, self.device)
            self.inv_freq = ops.to_device(self.inv_freq, self.device)
            self.layers = [ops.to_device(layer, self.device) for layer in self.layers]
        self.native = self._native_layers(native.storage_dtype(dtype, stored))  # None: the torch step (row blocks calibrated below)
        if self.native is None:
            for mat in self.matrices():
                ops.calibrate_rows(mat)

    def _native_layers(self, storage: torch.dtype) -> list[native.Layer] | None:
        """native.c's per-layer structs, when the step can run there: on the CPU, with every
        matrix a plain fp32 or bf16 tensor (packed quantized matrices keep the torch step).
        The matrices are packed in `storage` dtype, the embedding kept in it."""
        mats = self.matrices()
        if (self.device.type != "cpu" or native.library() is None
                or not all(isinstance(m, torch.Tensor) and m.dtype == mats[0].dtype for m in mats)
                or mats[0].dtype not in native.WTYPES):
            return None
        for layer in self.layers:
            pack_layer(layer, storage)
        self.lm_head = native.pack(self.lm_head.to(storage))
        # tied: the embedding rows are read out of the packed lm_head (the table is kept once)
        self.embed = native.PackedRows(self.lm_head) if self.arch.tie_embeddings else self.embed.to(storage)
        return [native_layer(self.arch, layer, self.inv_freq) for layer in self.layers]

    def matrices(self) -> list[torch.Tensor]:
        """Every weight the decode/verify path multiplies by."""
        mats = [self.lm_head]
        for layer in self.layers:
            m = layer.mixer
            mats += [m.in_proj, m.out] if isinstance(m, GdnWeights) else [m.qkv, m.o]
            mats += [layer.gate_up, layer.down]
        return mats

    # ---- state -------------------------------------------------------------------------

    def new_state(self, capacity: int = 256) -> TrunkState:
        a, dev = self.arch, self.device
        kv = {i: (torch.zeros(a.num_kv_heads, capacity, a.head_dim, device=dev),
                  torch.zeros(a.num_kv_heads, capacity, a.head_dim, device=dev))
              for i in a.full_layers}
        gdn = {i: (torch.zeros(a.lin_v_heads, a.lin_k_dim, a.lin_v_dim, device=dev),
                   torch.zeros(a.conv_kernel - 1, a.lin_conv_dim, device=dev))
               for i in range(a.num_layers) if a.is_linear(i)}
        return TrunkState(0, kv, gdn)

    def _reserve(self, st: TrunkState, end: int) -> None:
        for i, (k, v) in st.kv.items():
            if k.shape[1] < end:
                cap = max(end, 2 * k.shape[1])
                k2, v2 = k.new_zeros(k.shape[0], cap, k.shape[2]), v.new_zeros(v.shape[0], cap, v.shape[2])
                k2[:, :st.pos], v2[:, :st.pos] = k[:, :st.pos], v[:, :st.pos]
                st.kv[i] = (k2, v2)

    # ---- shared pieces -----------------------------------------------------------------

    def _mlp(self, layer: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        gu = ops.linear(h, layer.gate_up)
        n = self.arch.intermediate
        return ops.linear(ops.silu(gu[:, :n]) * gu[:, n:], layer.down)

    def _gdn_inputs(self, m: GdnWeights, h: torch.Tensor, window: torch.Tensor):
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

    def _gdn_out(self, m: GdnWeights, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        a = self.arch
        y = ops.gated_rms_norm(o, z.reshape(o.shape), m.norm, a.rms_eps)
        return ops.linear(y.reshape(o.shape[0], -1), m.out)

    def _qkv(self, m: AttnWeights, h: torch.Tensor, positions: torch.Tensor):
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

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(ops.rms_norm(x, self.final_norm, self.arch.rms_eps), self.lm_head)

    # ---- prefill -----------------------------------------------------------------------

    def prefill(self, st: TrunkState, tokens: list[int], aux_layers: tuple[int, ...] = (),
                want_logits: bool = False) -> StepOut:
        """The prompt at once, from an empty state."""
        if st.pos != 0:
            raise ValueError("prefill starts from an empty state")
        a = self.arch
        n = len(tokens)
        self._reserve(st, n)
        x = self.embed[torch.tensor(tokens, device=self.device)].float()
        positions = torch.arange(n, device=self.device)
        aux = []
        for i, layer in enumerate(self.layers):
            h = ops.rms_norm(x, layer.in_norm, a.rms_eps)
            m = layer.mixer
            if isinstance(m, GdnWeights):
                state, window = st.gdn[i]
                ext, (q, k, v, g, beta), z = self._gdn_inputs(m, h, window)
                o, state = ops.gdn_chunked(state, q, k, v, g, beta)
                st.gdn[i] = (state.contiguous(), ext[ext.shape[0] - (a.conv_kernel - 1):])  # (native.c reads raw)
                y = self._gdn_out(m, o, z)
            else:
                q, k, v, gate = self._qkv(m, h, positions)
                kc, vc = st.kv[i]
                kc[:, :n], vc[:, :n] = k.transpose(0, 1), v.transpose(0, 1)
                rep = a.num_heads // a.num_kv_heads
                att = F.scaled_dot_product_attention(
                    q.transpose(0, 1)[None], k.transpose(0, 1).repeat_interleave(rep, 0)[None],
                    v.transpose(0, 1).repeat_interleave(rep, 0)[None], is_causal=True)
                y = ops.linear(att[0].transpose(0, 1).reshape(n, -1) * ops.sigmoid(gate), m.o)
            x = x + y
            x = x + self._mlp(layer, ops.rms_norm(x, layer.post_norm, a.rms_eps))
            if i in aux_layers:
                aux.append(x)
        st.pos = n
        logits = self._head(x) if want_logits else self._head(x[-1:])
        return StepOut(logits, x, torch.cat(aux, dim=-1) if aux else None)

    # ---- decode / verify ---------------------------------------------------------------

    def step(self, st: TrunkState, tokens: list[int], aux_layers: tuple[int, ...] = (),
             keep: str | None = None) -> StepOut:
        """R rows at positions pos..pos+R-1; leaves the state after the last row.

        keep: None (no rollback possible), "checkpoint" (keep the state after every row)
        or "replay" (keep the rows' recurrence inputs to replay from the snapshot)."""
        if self.native is not None:
            return self._step_native(st, tokens, aux_layers, keep)
        a = self.arch
        rows, p0 = len(tokens), st.pos
        self._reserve(st, p0 + rows)
        x = self.embed[torch.tensor(tokens, device=self.device)].float()
        positions = torch.arange(p0, p0 + rows, device=self.device)
        aux, traces = [], {}
        for i, layer in enumerate(self.layers):
            h = ops.rms_norm(x, layer.in_norm, a.rms_eps)
            m = layer.mixer
            if isinstance(m, GdnWeights):
                state, window = st.gdn[i]
                ext, inputs, z = self._gdn_inputs(m, h, window)
                o, new_state, states = ops.gdn_recurrence(state, *inputs, keep_states=keep == "checkpoint")
                st.gdn[i] = (new_state, ext[rows:])
                if keep is not None:
                    traces[i] = GdnTrace(state, ext, inputs if keep == "replay" else None, states)
                y = self._gdn_out(m, o, z)
            else:
                q, k, v, gate = self._qkv(m, h, positions)
                kc, vc = st.kv[i]
                kc[:, p0:p0 + rows], vc[:, p0:p0 + rows] = k.transpose(0, 1), v.transpose(0, 1)
                y = ops.linear(self._attend_rows(q, kc, vc, p0) * ops.sigmoid(gate), m.o)
            x = x + y
            x = x + self._mlp(layer, ops.rms_norm(x, layer.post_norm, a.rms_eps))
            if i in aux_layers:
                aux.append(x)
        st.pos = p0 + rows
        return StepOut(self._head(x), x, torch.cat(aux, dim=-1) if aux else None, traces)

    def _step_native(self, st: TrunkState, tokens: list[int], aux_layers: tuple[int, ...],
                     keep: str | None) -> StepOut:
        """`step` through native.c: one call per layer, the same contract and traces. A step
        is short (a fraction of a millisecond), so the Python here is kept to a few buffers
        per layer and raw pointers."""
        a, lib = self.arch, native.threaded()
        rows, p0 = len(tokens), st.pos
        if not 0 <= min(tokens) <= max(tokens) < a.vocab:  # the C reads the rows it is given
            raise ValueError(f"a token of {tokens} is not an id in 0..{a.vocab - 1}")
        self._reserve(st, p0 + rows)
        x = torch.empty(rows, a.hidden)
        xp = x.data_ptr()
        lib.embed_rows(*native.table_of(self.embed), (ctypes.c_int * rows)(*tokens),
                       rows, a.hidden, xp)
        taps, conv_dim = a.conv_kernel, a.lin_conv_dim
        hv, dk, dv = a.lin_v_heads, a.lin_k_dim, a.lin_v_dim
        slot = {layer: j for j, layer in enumerate(sorted(aux_layers))}  # in layer order, as the torch step cats them
        aux = torch.empty(rows, len(slot) * a.hidden) if slot else None
        traces = {}
        for i, layer in enumerate(self.native):
            if i in st.gdn:
                state, window = st.gdn[i]
                new_state, ext = torch.empty(hv, dk, dv), torch.empty(taps - 1 + rows, conv_dim)
                inputs = torch.empty(rows * hv * (2 * dk + dv + 2))  # q, k, v, g, beta (native.c)
                states = torch.empty(rows, hv, dk, dv) if keep == "checkpoint" else None
                lib.gdn_layer(ctypes.addressof(layer), xp, rows, state.data_ptr(), new_state.data_ptr(),
                              window.data_ptr(), ext.data_ptr(), inputs.data_ptr(), native.ptr(states))
                st.gdn[i] = (new_state, ext[rows:])
                if keep is not None:
                    traces[i] = GdnTrace(state, ext, self._inputs(inputs, rows) if keep == "replay" else None,
                                         list(states.unbind(0)) if states is not None else None)
            else:
                kc, vc = st.kv[i]
                lib.attn_layer(ctypes.addressof(layer), xp, rows, p0, 0, kc.data_ptr(), vc.data_ptr(), kc.shape[1])
            if i in slot:
                lib.copy_rows(xp, rows, a.hidden, aux.data_ptr() + 4 * slot[i] * a.hidden, len(slot) * a.hidden)
        st.pos = p0 + rows
        logits = torch.empty(rows, a.vocab)
        lib.head(xp, rows, a.hidden, self.final_norm.data_ptr(), a.rms_eps, self.lm_head.data.data_ptr(),
                 self.lm_head.wtype, a.vocab, logits.data_ptr(), None)
        return StepOut(logits, x, aux, traces)

    def _inputs(self, flat: torch.Tensor, rows: int) -> tuple[torch.Tensor, ...]:
        """native.c's recurrence inputs of `rows` rows, as the trace's q, k, v, g, beta."""
        hv, dk, dv = self.arch.lin_v_heads, self.arch.lin_k_dim, self.arch.lin_v_dim
        q, k, v, g, beta = flat.split([rows * hv * dk, rows * hv * dk, rows * hv * dv, rows * hv, rows * hv])
        return q.view(rows, hv, dk), k.view(rows, hv, dk), v.view(rows, hv, dv), g.view(rows, hv), beta.view(rows, hv)

    def _replay(self, tr: GdnTrace, kept: int) -> torch.Tensor:
        """The state after the first `kept` rows, recomputed from the snapshot by the same
        recurrence code the verify ran (bit for bit what those rows left)."""
        if self.native is None:
            state = tr.snapshot
            for t in range(kept):
                state, _ = ops.gdn_step(state, *(x[t] for x in tr.inputs))
            return state
        a = self.arch
        state = tr.snapshot.contiguous().clone()
        native.library().gdn_recurrence(native.ptr(state), kept, a.lin_v_heads, a.lin_k_dim, a.lin_v_dim,
                                        *(native.ptr(x) for x in tr.inputs), None, None)
        return state

    def _attend_rows(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, p0: int) -> torch.Tensor:
        """Each row attends to exactly its own causal prefix, one call per row, so a row's
        arithmetic does not depend on how many rows were verified with it."""
        a = self.arch
        groups = a.num_heads // a.num_kv_heads
        scale = a.head_dim ** -0.5
        outs = []
        for r in range(q.shape[0]):
            end = p0 + r + 1
            qr = q[r].reshape(a.num_kv_heads, groups, a.head_dim)
            scores = torch.bmm(qr, kc[:, :end].transpose(1, 2)) * scale
            outs.append(torch.bmm(torch.softmax(scores, dim=-1), vc[:, :end]).reshape(-1))
        return torch.stack(outs)

    def rollback(self, st: TrunkState, out: StepOut, rows: int, kept: int, strategy: str) -> int:
        """Keep the first `kept` of the `rows` just stepped. Returns the rows replayed."""
        if kept == rows:
            return 0
        taps = self.arch.conv_kernel
        st.pos -= rows - kept  # attention: positions past the kept rows are simply overwritten later
        replayed = 0
        for i, tr in out.traces.items():
            window = tr.ext[kept:kept + taps - 1]
            if strategy == "checkpoint":
                state = tr.states[kept - 1] if kept else tr.snapshot
            else:
                state = self._replay(tr, kept)
                replayed = kept
            st.gdn[i] = (state, window)
        return replayed
