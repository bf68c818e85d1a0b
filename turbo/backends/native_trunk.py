"""The trunk's step (NativeTrunkStep) and the MTP head's layer (NativeMtpStep) through native.c,
with the ctypes structs of a packed trunk layer (native.h's Layer, Moe) they hand it.
"""

from __future__ import annotations

import ctypes

import torch

from ..model.step import GdnTrace, StepOut, TrunkState
from ..store import quant
from .native_lib import WTYPES, Layer, Moe, library, threaded
from .packed import ptr, table_of

# Rows per call of the native prefill: its working set (activations [chunk, ...], attention
# scores [chunk, heads, prompt]) is bounded by it, and every matrix is read once per chunk.
PREFILL_CHUNK = 256


def _ints(values: list[int]):
    return (ctypes.c_int * len(values))(*values)


def _ptrs(arr: ctypes.Array, tensors) -> ctypes.Array:
    """`arr` (a C array, one entry per sequence of a call, reused layer after layer: cheaper than
    a new one) filled with the tensors' data pointers (NULL for None)."""
    arr[:] = [t.data_ptr() if t is not None else None for t in tensors]
    return arr


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
        # the conv's taps [C, taps] as [taps, C] (native_gdn.c's loops run over channels), once here
        s.conv_taps = m.conv.reshape(a.lin_conv_dim, a.conv_kernel).t().contiguous()
        s.in_proj, s.out, s.conv = ptr(m.in_proj), ptr(m.out), ptr(s.conv_taps)
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


def _mm_chunk(mm, r0: int, r1: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """MmRows' part in prompt rows r0..r1 (a prefill chunk), as `_rows` takes it."""
    inside = (mm.rows >= r0) & (mm.rows < r1)
    return mm.rows[inside] - r0, mm.embeds[inside].float(), mm.freq_positions[r0:r1].to(torch.int32).contiguous()


class NativeTrunkStep:
    """The trunk's step through native.c: one call per layer, the torch step's contract and
    traces. A step is short (a fraction of a millisecond), so the Python here is kept to a
    few buffers per layer and raw pointers (the layers' structs built once, here).
    The trunk arrives packed (turbo/load/loader.py packs each matrix as it reads it)."""

    name = "native"
    prefill_rows_are_steps = True  # tests/test_native_prefill.py

    def __init__(self, trunk):
        self.trunk = trunk
        self.structs = [layer_struct(trunk.arch, layer, trunk.inv_freq, trunk.kv_dtype) for layer in trunk.layers]
        self.addresses = [ctypes.addressof(s) for s in self.structs]

    def step(self, st: TrunkState, tokens: list[int], aux_layers: tuple[int, ...],
             rollback: str | None) -> StepOut:
        return self.step_many([st], [tokens], [aux_layers], [rollback], [len(tokens)])[0]

    def step_many(self, states: list[TrunkState], tokens: list[list[int]], aux_layers: list[tuple[int, ...]],
                  rollback: list[str | None], logit_rows: list[int]) -> list[StepOut]:
        """`step` for many sequences in one pass per layer (native_gdn.c's gdn_layer_seqs,
        native_attn.c's attn_layer_seqs): each sequence's bits are those of its `step`
        alone; logits for the last logit_rows[i] rows of sequence i, the head run once."""
        if not states:
            return []
        rows = self._rows(states, tokens, aux_layers, rollback)
        if len(rows) == 1:  # (the last rows of one sequence: a view, nothing to gather)
            logits = [self._head(rows[0][0][rows[0][0].shape[0] - logit_rows[0]:])]
        else:
            asked = torch.cat([x[x.shape[0] - k:] for (x, _, _), k in zip(rows, logit_rows)])
            logits = self._head(asked).split(logit_rows)
        return [StepOut(lg, x, aux, traces) for lg, (x, aux, traces) in zip(logits, rows)]

    def prefill(self, st: TrunkState, tokens: list[int], aux_layers: tuple[int, ...], want_logits: bool,
                mm=None) -> StepOut:
        """The prompt as steps of PREFILL_CHUNK rows: each a verify-sized call (its rows equal
        decode steps), so the working set is one chunk's (attention scores [chunk, heads,
        prompt], no [prompt, prompt] matrix) and the lm_head runs only where logits are asked.
        mm (turbo.vision.positions.MmRows): the image rows' embeddings and every row's rotation."""
        parts = [self._rows([st], [tokens[c:c + PREFILL_CHUNK]], [aux_layers], [None],
                            None if mm is None else [_mm_chunk(mm, c, c + PREFILL_CHUNK)])[0]
                 for c in range(0, len(tokens), PREFILL_CHUNK)]
        if mm is not None:
            st.rope_delta = mm.delta
        x = torch.cat([p[0] for p in parts])
        aux = torch.cat([p[1] for p in parts]) if parts[0][1] is not None else None
        return StepOut(self._head(x if want_logits else x[-1:]), x, aux)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        t, a = self.trunk, self.trunk.arch
        logits = torch.empty(x.shape[0], a.vocab)
        if x.shape[0]:
            threaded().head(x.data_ptr(), x.shape[0], a.hidden, t.final_norm.data_ptr(), a.rms_eps,
                            t.lm_head.data.data_ptr(), t.lm_head.wtype, a.vocab, logits.data_ptr(), None)
        return logits

    def _rows(self, states: list[TrunkState], tokens: list[list[int]], aux_layers: list[tuple[int, ...]],
              rollback: list[str | None], mm: list | None = None, x0: torch.Tensor | None = None
              ) -> list[tuple[torch.Tensor, torch.Tensor | None, dict[int, GdnTrace]]]:
        """Each sequence's rows through every layer, all sequences in one call per layer:
        per sequence (its residual stream x [R, H], a view of the call's, aux, traces). mm: per
        sequence None or (image rows, their embeddings, the rows' rotation [R, rot/2] int32).
        x0 [sum R, H] fp32: the rows' residual stream as a previous pipeline stage left it
        (turbo/parallel), in place of the embedding (None: embed the tokens)."""
        t = self.trunk
        a, lib = t.arch, threaded()
        n, rows = len(states), [len(tk) for tk in tokens]
        flat = [tok for tk in tokens for tok in tk]
        if min(rows) < 1 or not 0 <= min(flat) <= max(flat) < a.vocab:  # the C reads the rows it is given
            raise ValueError(f"a sequence's tokens {tokens} are empty or not ids in 0..{a.vocab - 1}")
        p0 = [st.pos for st in states]
        for st, r in zip(states, rows):
            t.reserve(st, st.pos + r)
        total, offs = sum(rows), [sum(rows[:s]) for s in range(n)]
        x = torch.empty(total, a.hidden)  # [sum R, H]: the residual stream, updated in place layer by layer
        xp = x.data_ptr()
        if x0 is not None:
            x.copy_(x0)
        elif isinstance(t.embed, quant.QuantizedRows):  # (rows dequantized here, not the whole table)
            x.copy_(t.embed[flat])
        else:
            lib.embed_rows(*table_of(t.embed), (ctypes.c_int * total)(*flat), total, a.hidden, xp)
        rpos = [None] * n  # each sequence's rotation per row and frequency (None: at its positions)
        for s, st in enumerate(states):
            if mm is not None and mm[s] is not None:
                image_rows, embeds, rpos[s] = mm[s]
                x[offs[s] + image_rows] = embeds
            elif st.rope_delta:
                rpos[s] = (torch.arange(p0[s], p0[s] + rows[s], dtype=torch.int32) + st.rope_delta)[:, None] \
                    .expand(rows[s], a.rotary_dim // 2).contiguous()
        c_rpos = _ptrs((ctypes.c_void_p * n)(), rpos) if any(r is not None for r in rpos) else None
        taps, conv_dim = a.conv_kernel, a.lin_conv_dim
        hv, dk, dv = a.lin_v_heads, a.lin_k_dim, a.lin_v_dim
        # each sequence's aux layers in layer order, as the torch step cats them
        slots = [{layer: j for j, layer in enumerate(sorted(al))} for al in aux_layers]
        aux = [torch.empty(r, len(sl) * a.hidden) if sl else None for r, sl in zip(rows, slots)]
        traces: list[dict[int, GdnTrace]] = [{} for _ in states]
        c_rows, zeros, c_p0, caps = _ints(rows), _ints([0] * n), _ints(p0), _ints([0] * n)
        a0, a1, a2, a3, a4, a5 = ((ctypes.c_void_p * n)() for _ in range(6))
        per_row = hv * (2 * dk + dv + 2)  # a row's recurrence inputs: q, k, v, g, beta (native_gdn.c)
        ext_offs = [o + s * (taps - 1) for s, o in enumerate(offs)]
        ext_rows = total + n * (taps - 1)
        # a window left a view keeps the call's whole ext alive until the next step: where a
        # prefill chunk's is in it (6 MB a layer at 0.8B), every window is copied out instead
        clone_windows = any(rb is None and r >= taps for r, rb in zip(rows, rollback))
        for i, address in enumerate(self.addresses):
            if i in states[0].gdn:
                olds = [st.gdn[i] for st in states]
                # a step that keeps no rollback updates its state in place (no trace holds the
                # old one): 2 MB of memory traffic a layer and sequence instead of 3, and one
                # buffer's footprint; a step that keeps one writes a spare (its trace's snapshot)
                new = [s if rb is None else spare(st, ("state", i), 1, s)[0]
                       for st, rb, (s, _) in zip(states, rollback, olds)]
                # every sequence's ext [taps-1+R, C] and recurrence inputs in one buffer each
                ext, inputs = torch.empty(ext_rows, conv_dim), torch.empty(total * per_row)
                ep, ip = ext.data_ptr(), inputs.data_ptr()
                a3[:] = [ep + 4 * o * conv_dim for o in ext_offs]
                a4[:] = [ip + 4 * o * per_row for o in offs]
                # the states after rows 0..R-2 (after the last: new)
                kept = [spare(st, ("states", i), r - 1, s) if rb == "checkpoint" else None
                        for st, r, rb, (s, _) in zip(states, rows, rollback, olds)]
                lib.gdn_layer_seqs(address, xp, n, c_rows, _ptrs(a0, [s for s, _ in olds]), _ptrs(a1, new),
                                   _ptrs(a2, [w for _, w in olds]), a3, a4,
                                   _ptrs(a5, [k if r > 1 else None for k, r in zip(kept, rows)]))
                for s, st in enumerate(states):
                    r, rb, e = rows[s], rollback[s], ext_offs[s]
                    window = ext[e + r:e + r + taps - 1]  # [taps-1, C]: a view that keeps all of ext alive
                    if clone_windows:
                        window = window.clone()
                    st.gdn[i] = (new[s], window)
                    if rb is not None:
                        traces[s][i] = GdnTrace(olds[s][0], ext[e:e + taps - 1 + r],
                                                self._inputs(inputs[offs[s] * per_row:(offs[s] + r) * per_row], r)
                                                if rb == "replay" else None,
                                                [*kept[s].unbind(0), new[s]] if kept[s] is not None else None)
            else:
                kv = [st.kv[i] for st in states]
                caps[:] = [k.shape[1] for k, _ in kv]
                lib.attn_layer_seqs(address, xp, n, c_rows, c_p0, zeros, _ptrs(a0, [k for k, _ in kv]),
                                    _ptrs(a1, [v for _, v in kv]), caps, c_rpos)
            for s, sl in enumerate(slots):
                if i in sl:
                    lib.copy_rows(xp + 4 * offs[s] * a.hidden, rows[s], a.hidden,
                                  aux[s].data_ptr() + 4 * sl[i] * a.hidden, len(sl) * a.hidden)
        for st, r in zip(states, rows):
            st.pos += r
        return [(x[o:o + r], ax, tr) for o, r, ax, tr in zip(offs, rows, aux, traces)]

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
    The head's matrices arrive packed for its products (turbo/load/loader.py, load_plan.plan_mtp)."""

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
