"""The trunk's step (NativeTrunkStep) and the MTP head's layer (NativeMtpStep) through native.c,
with the ctypes structs of a packed trunk layer (native.h's Layer, Moe) they hand it.
"""

from __future__ import annotations

import ctypes

import torch

from .native_lib import WTYPES, Layer, Moe, library, threaded
from .native_pack import ptr, table_of
from .step import GdnTrace, StepOut, TrunkState

# Rows per call of the native prefill: its working set (activations [chunk, ...], attention
# scores [chunk, heads, prompt]) is bounded by it, and every matrix is read once per chunk.
PREFILL_CHUNK = 256


def moe_struct(a, moe) -> Moe:
    """native.h's Moe for one packed MoE block (ctypes keeps its pointer arrays alive with it)."""
    gate_up = (ctypes.c_void_p * len(moe.gate_up))(*(ptr(w) for w in moe.gate_up))
    down = (ctypes.c_void_p * len(moe.down))(*(ptr(w) for w in moe.down))
    s = Moe(experts=a.num_experts, top_k=a.experts_per_token, inter=a.moe_intermediate,
            shared_inter=a.shared_intermediate if moe.shared_gate_up is not None else 0,
            norm_topk=a.norm_topk_prob, wtype=moe.router.wtype, ewtype=moe.gate_up[0].wtype, router=ptr(moe.router),
            gate_up=gate_up, down=down, shared_gate_up=ptr(moe.shared_gate_up), shared_down=ptr(moe.shared_down),
            shared_gate=ptr(moe.shared_gate))
    return s


def layer_struct(a, layer, inv_freq: torch.Tensor, kv_dtype: torch.dtype) -> Layer:
    """native.c's struct for one packed layer, an attention layer's K/V cache in `kv_dtype`
    (its tensors must outlive it: it holds pointers)."""
    m = layer.mixer
    s = Layer(hidden=a.hidden, inter=a.intermediate, wtype=(m.in_proj if layer.gdn else m.qkv).wtype, eps=a.rms_eps,
              in_norm=ptr(layer.in_norm), post_norm=ptr(layer.post_norm),
              gate_up=ptr(layer.gate_up), down=ptr(layer.down))
    if layer.moe is not None:
        s.moe = ctypes.pointer(moe_struct(a, layer.moe))
    if layer.gdn:
        s.in_proj, s.out, s.conv = ptr(m.in_proj), ptr(m.out), ptr(m.conv)
        s.neg_a, s.dt_bias, s.gnorm = ptr(m.neg_a), ptr(m.dt_bias), ptr(m.norm)
        s.kheads, s.kdim, s.vheads, s.vdim, s.taps = a.lin_k_heads, a.lin_k_dim, a.lin_v_heads, a.lin_v_dim, a.conv_kernel
    else:
        s.qkv, s.o, s.q_norm, s.k_norm, s.inv_freq = ptr(m.qkv), ptr(m.o), ptr(m.q_norm), ptr(m.k_norm), ptr(inv_freq)
        s.heads, s.kv_heads, s.head_dim, s.rot = a.num_heads, a.num_kv_heads, a.head_dim, a.rotary_dim
        s.kv_type = WTYPES[kv_dtype]
    return s


def trunk_refusal(device: torch.device, dtype: torch.dtype, quantized_kept: bool) -> str | None:
    """Why the trunk's step cannot run here (None: it can, the library built): on the CPU,
    with every matrix a plain fp32 or bf16 one or one its products read packed
    (`quantized_kept`: some stay packed quantized in another format).
    Asked before any weight loads: the native step's matrices are packed as they are read."""
    if device.type != "cpu":
        return f"the trunk runs on {device.type}"
    if quantized_kept:
        return "packed quantized matrices"
    if dtype not in WTYPES:
        return f"matrices in {str(dtype).removeprefix('torch.')}"
    return None


def spare(st: TrunkState, key: tuple, rows: int, held: torch.Tensor) -> torch.Tensor:
    """`rows` GDN states [rows, Hv, dk, dv] for a step of sequence `st` to write, from two
    buffers it keeps per `key`: the one `held` (the state the step reads, which its trace keeps
    as the snapshot) does not lie in. Fresh ones (1 MB a layer and row at 0.8B: ~140 MB per
    9-row verify) come back from the allocator as new pages the kernel zeroes first, a second
    write of every checkpoint; so a step's states and checkpoints live until this sequence's
    next step, as a trace is used."""
    pair = st.scratch.setdefault(key, [None, None])
    base = held.untyped_storage().data_ptr()
    j = next(j for j, buf in enumerate(pair) if buf is None or buf.untyped_storage().data_ptr() != base)
    if pair[j] is None or pair[j].shape[0] < rows:
        pair[j] = torch.empty(rows, *held.shape)
    return pair[j][:rows]


class NativeTrunkStep:
    """The trunk's step through native.c: one call per layer, the torch step's contract and
    traces. A step is short (a fraction of a millisecond), so the Python here is kept to a
    few buffers per layer and raw pointers (the layers' structs built once, here).
    The trunk arrives packed (turbo/loader.py packs each matrix as it reads it)."""

    name = "native"
    prefill_rows_are_steps = True  # tests/test_native_prefill.py

    def __init__(self, trunk):
        self.trunk = trunk
        self.structs = [layer_struct(trunk.arch, layer, trunk.inv_freq, trunk.kv_dtype) for layer in trunk.layers]
        self.addresses = [ctypes.addressof(s) for s in self.structs]

    def step(self, st: TrunkState, tokens: list[int], aux_layers: tuple[int, ...],
             rollback: str | None) -> StepOut:
        x, aux, traces = self._rows(st, tokens, aux_layers, rollback)
        return StepOut(self._head(x), x, aux, traces)

    def prefill(self, st: TrunkState, tokens: list[int], aux_layers: tuple[int, ...], want_logits: bool) -> StepOut:
        """The prompt as steps of PREFILL_CHUNK rows: each a verify-sized call (its rows equal
        decode steps), so the working set is one chunk's (attention scores [chunk, heads,
        prompt], no [prompt, prompt] matrix) and the lm_head runs only where logits are asked."""
        parts = [self._rows(st, tokens[c:c + PREFILL_CHUNK], aux_layers, None)
                 for c in range(0, len(tokens), PREFILL_CHUNK)]
        x = torch.cat([p[0] for p in parts])
        aux = torch.cat([p[1] for p in parts]) if parts[0][1] is not None else None
        return StepOut(self._head(x if want_logits else x[-1:]), x, aux)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        t, a = self.trunk, self.trunk.arch
        logits = torch.empty(x.shape[0], a.vocab)
        threaded().head(x.data_ptr(), x.shape[0], a.hidden, t.final_norm.data_ptr(), a.rms_eps,
                        t.lm_head.data.data_ptr(), t.lm_head.wtype, a.vocab, logits.data_ptr(), None)
        return logits

    def _rows(self, st: TrunkState, tokens: list[int], aux_layers: tuple[int, ...], rollback: str | None):
        """R rows through every layer: (the residual stream x [R, H], aux, traces)."""
        t = self.trunk
        a, lib = t.arch, threaded()
        rows, p0 = len(tokens), st.pos
        if not 0 <= min(tokens) <= max(tokens) < a.vocab:  # the C reads the rows it is given
            raise ValueError(f"a token of {tokens} is not an id in 0..{a.vocab - 1}")
        t.reserve(st, p0 + rows)
        x = torch.empty(rows, a.hidden)  # [R, H]: the residual stream, updated in place layer by layer
        xp = x.data_ptr()
        lib.embed_rows(*table_of(t.embed), (ctypes.c_int * rows)(*tokens), rows, a.hidden, xp)
        taps, conv_dim = a.conv_kernel, a.lin_conv_dim
        hv, dk, dv = a.lin_v_heads, a.lin_k_dim, a.lin_v_dim
        slot = {layer: j for j, layer in enumerate(sorted(aux_layers))}  # in layer order, as the torch step cats them
        aux = torch.empty(rows, len(slot) * a.hidden) if slot else None
        traces = {}
        for i, address in enumerate(self.addresses):
            if i in st.gdn:
                state, window = st.gdn[i]
                new_state, ext = spare(st, ("state", i), 1, state)[0], torch.empty(taps - 1 + rows, conv_dim)
                inputs = torch.empty(rows * hv * (2 * dk + dv + 2))  # q, k, v, g, beta (native_gdn.c)
                # the states after rows 0..R-2 (after the last: new_state)
                states = spare(st, ("states", i), rows - 1, state) if rollback == "checkpoint" else None
                lib.gdn_layer(address, xp, rows, state.data_ptr(), new_state.data_ptr(), window.data_ptr(),
                              ext.data_ptr(), inputs.data_ptr(), ptr(states) if rows > 1 else None)
                window = ext[rows:]  # [taps-1, C]: a view that keeps all of ext [taps-1+R, C] alive
                if rollback is None and rows >= taps:  # (a prefill chunk's ext: 6 MB a layer at 0.8B)
                    window = window.clone()
                st.gdn[i] = (new_state, window)
                if rollback is not None:
                    traces[i] = GdnTrace(state, ext, self._inputs(inputs, rows) if rollback == "replay" else None,
                                         [*states.unbind(0), new_state] if states is not None else None)
            else:
                kc, vc = st.kv[i]
                lib.attn_layer(address, xp, rows, p0, 0, kc.data_ptr(), vc.data_ptr(), kc.shape[1])
            if i in slot:
                lib.copy_rows(xp, rows, a.hidden, aux.data_ptr() + 4 * slot[i] * a.hidden, len(slot) * a.hidden)
        st.pos = p0 + rows
        return x, aux, traces

    def _inputs(self, flat: torch.Tensor, rows: int) -> tuple[torch.Tensor, ...]:
        """native_gdn.c's recurrence inputs of `rows` rows, as the trace's q, k, v, g, beta."""
        a = self.trunk.arch
        hv, dk, dv = a.lin_v_heads, a.lin_k_dim, a.lin_v_dim
        q, k, v, g, beta = flat.split([rows * hv * dk, rows * hv * dk, rows * hv * dv, rows * hv, rows * hv])
        return q.view(rows, hv, dk), k.view(rows, hv, dk), v.view(rows, hv, dv), g.view(rows, hv), beta.view(rows, hv)

    def replay(self, trace: GdnTrace, kept: int) -> torch.Tensor:
        a = self.trunk.arch
        before = trace.snapshot.contiguous()
        state = torch.empty_like(before)
        library().gdn_recurrence(ptr(before), ptr(state), kept, a.lin_v_heads, a.lin_k_dim, a.lin_v_dim,
                            *(ptr(x) for x in trace.inputs), None, None)
        return state


class NativeMtpStep:
    """The MTP head's layer (native_attn.c's attn_layer) and head, on the trunk's native step.
    The head's matrices arrive packed for its products (turbo/loader.py, load_plan.plan_mtp)."""

    name = "native"

    def __init__(self, head):
        self.head = head
        self.struct = layer_struct(head.arch, head.layer, head.trunk.inv_freq, head.trunk.kv_dtype)
        self.address = ctypes.addressof(self.struct)

    def _layer(self, x: torch.Tensor, p0: int) -> torch.Tensor:
        """Rows x at p0.. through the layer (K/V written, attending from start)."""
        h = self.head
        h.reserve(p0 + x.shape[0])
        y = x.float().contiguous().clone()
        threaded().attn_layer(self.address, y.data_ptr(), y.shape[0], p0, h.start,
                              h.k.data_ptr(), h.v.data_ptr(), h.k.shape[1])
        return y

    def write(self, x: torch.Tensor, p0: int) -> None:
        self._layer(x, p0)

    def row(self, x: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.head
        a = h.arch
        y = self._layer(x, pos)
        out, logits = torch.empty(1, a.hidden), torch.empty(1, a.vocab)
        lm = h.trunk.lm_head
        threaded().head(y.data_ptr(), 1, a.hidden, h.final_norm.data_ptr(), h.eps, ptr(lm), lm.wtype, a.vocab,
                        logits.data_ptr(), out.data_ptr())
        return out, logits
