"""CudaTrunkStep: the trunk's step (turbo/model/step.py TrunkStep) as device programs over
buffers allocated at open (issue #55). DEVICE-UNVERIFIED: run so far only on the host device
(turbo/backends/cuda_sim, through turbo.testing.host_cuda.HostDevice: the kernels' CUDA C built for the host).

A step of R rows (1..16 a launch; more in launches of 16) is, per layer, 8 launches (kernels.py):
  GDN layer:        add_rms_norm (x += y; h = in_norm(x)), in_proj product, gdn_step (conv, gates,
                    recurrence with checkpoints, gated norm), out product -> y,
                    add_rms_norm (post_norm), gate_up product, silu_mul, down product -> y
  attention layer:  the same with the qkv product, attn_rows (norms, RoPE, K/V store, scores,
                    softmax, gated sums), the o product
then add_rms_norm (final norm) and the lm_head product; the logits and the hidden rows come
back in one download each. The residual stream x [R, H] lives on the device; each sublayer's
output y is added by the next norm's launch.

Graphs. Everything a launch reads that changes between two steps of one shape lives in device
memory the host writes before the launches: the token ids [R] and the seq block (per GDN layer its
windows, ext, state in / out and checkpoints as addresses; per attention layer its K, V addresses
and the position p0: gdn_step_ind_f32 / attn_rows_ind_f32 read them), one HtoD each. So the
launches' arguments are a function of (R, logit rows, aux layers) alone, and with graphs=True the
device program of each such shape is captured once (cuStreamBeginCapture in global mode on a
blocking stream of its own, cuStreamEndCapture, cuGraphInstantiate) and replayed with one
cuGraphLaunch a step: ids and seq block up, the replay, logits and hidden rows down, one sync.
graphs=False issues the same launches one by one (tests/test_cuda_plan.py: same signatures, same bits).

State. Per sequence (TrunkState.scratch["cuda"], allocated at its first step): each GDN layer's
state in two buffers [2, Hv, dk, dv] (a step that keeps a rollback writes the one it does not
read: the other stays the trace's snapshot), its R-1 checkpoints [15, Hv, dk, dv], two conv
windows [2, K-1, C] and ext [K-1+16, C]; each attention layer's K, V [kv_heads, capacity,
head_dim] fp32. TrunkState.gdn holds DeviceRef views of these (the trunk's snapshot / restore /
rollback work on them unchanged: clone() is a device copy, a slice a view); a step first brings
a state or window that lies elsewhere (a checkpoint, a clone) into its buffers by a DtoD copy.
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass

import torch

from ...model.step import GdnTrace, StepOut, TrunkState
from ...store import quant
from ..packed import QUANTIZED, Packed, PackedRows, quantized_unpanel
from . import kernels as sk

CHUNK = sk.MAX_ROWS  # rows a launch; a longer step or prefill goes in chunks of it (rows stay steps)
DEFAULT_CAPACITY = 4096  # positions of a sequence's K/V (the step refuses past it)


class DeviceRef:
    """A view of device memory standing where the trunk keeps a tensor (TrunkState.gdn, a trace):
    pointer, shape (fp32). clone() copies it into a fresh allocation (freed with the clone);
    [a:b] on the first dimension is a view."""

    def __init__(self, dev, ptr: int, shape: tuple[int, ...], owned: bool = False):
        self.dev, self.ptr, self.shape, self._owned = dev, int(ptr), tuple(shape), owned

    @property
    def nbytes(self) -> int:
        n = 4
        for s in self.shape:
            n *= s
        return n

    def clone(self) -> DeviceRef:
        ptr = self.dev.alloc(self.nbytes)
        self.dev.dtod(ptr, self.ptr, self.nbytes)
        return DeviceRef(self.dev, ptr, self.shape, owned=True)

    def __getitem__(self, key) -> DeviceRef:
        row = self.nbytes // self.shape[0]
        if isinstance(key, int):
            key = key + self.shape[0] if key < 0 else key
            return DeviceRef(self.dev, self.ptr + key * row, self.shape[1:])
        start, stop, step = key.indices(self.shape[0])
        assert step == 1
        return DeviceRef(self.dev, self.ptr + start * row, (stop - start, *self.shape[1:]))

    def unbind(self, dim: int = 0) -> list[DeviceRef]:
        return [self[i] for i in range(self.shape[0])]

    def download(self) -> torch.Tensor:
        out = torch.empty(self.shape)
        self.dev.dtoh(out.data_ptr(), self.ptr, self.nbytes)
        return out

    def __del__(self):
        if self._owned:
            try:
                self.dev.free(self.ptr)
            except Exception:  # noqa: BLE001 - a context torn down first: nothing to free
                pass


def _free_all(dev, ptrs: list[int]) -> None:
    """A sequence's device buffers, freed when its state is collected."""
    for ptr in ptrs:
        try:
            dev.free(ptr)
        except Exception:  # noqa: BLE001 - a context torn down first: nothing to free
            pass


class _OnStream:
    """A device whose launches go on one stream (the kernels.py wrappers name none)."""

    def __init__(self, dev, stream: int):
        self._dev, self.stream = dev, stream

    def launch(self, module, kernel, grid, block, args, shared=0, stream=None):
        self._dev.launch(module, kernel, grid, block, args, shared, self.stream if stream is None else stream)

    def __getattr__(self, name):
        return getattr(self._dev, name)


@dataclass
class Matrix:
    """A matrix resident as stored: bf16 [n, k] raw, or int8 / int4 affine (words, bf16 scales, biases)."""

    fmt: str  # "bf16" | "int8" | "int4"
    w: int
    scales: int
    biases: int
    n: int
    k: int
    group: int = 64


def _host_matrix(m) -> tuple[str, list[torch.Tensor], int, int]:
    """(format, host tensors as stored, n, k) of a trunk matrix (Packed, PackedRows or a tensor)."""
    if isinstance(m, PackedRows):
        m = m.packed
    if isinstance(m, Packed):
        if m.layout in QUANTIZED:
            words, scales, biases = quantized_unpanel(m)
            return f"int{QUANTIZED[m.layout]}", [words[:m.n], scales[:m.n], biases[:m.n]], m.n, m.k
        if m.dtype == torch.bfloat16 and m.layout in ("panels", "panel_pairs", "pairs"):
            return "bf16", [m.dense()], m.n, m.k
        raise ValueError(f"the CUDA step does not read a {m.layout} {m.dtype} matrix yet")
    if isinstance(m, quant.QuantizedWeight):
        ok = m.bits in (4, 8) and not m.float8 and m.scales.dtype == torch.bfloat16 and m.group % 32 == 0
        if not ok:
            raise ValueError(f"the CUDA step reads int4 / int8 affine with bf16 scales (got {m.bits} bits, "
                             f"{m.scales.dtype} scales, group {m.group})")
        return f"int{m.bits}", [m.packed, m.scales, m.biases], m.shape[0], m.shape[1]
    if isinstance(m, torch.Tensor) and m.dtype == torch.float32 and m.dim() == 2:
        as_bf16 = m.to(torch.bfloat16)
        if not torch.equal(as_bf16.float(), m):
            raise ValueError(f"the CUDA step reads bf16 matrices: an fp32 one {tuple(m.shape)} holds values bf16 does not")
        m = as_bf16  # (every value a bf16 one: the same matrix, held in half the bytes)
    if isinstance(m, torch.Tensor) and m.dtype == torch.bfloat16 and m.dim() == 2:
        return "bf16", [m], m.shape[0], m.shape[1]
    raise ValueError(f"the CUDA step reads bf16 / int8 / int4 matrices (got {type(m).__name__})")


class CudaTrunkStep:
    """The trunk's step on a device (`dev`: cuda_kernels.Kernels, or a HostDevice)."""

    name = "cuda"
    prefill_rows_are_steps = True  # prefill chunks are steps of CHUNK rows

    def __init__(self, trunk, dev, capacity: int = DEFAULT_CAPACITY, graphs: bool = False):
        a = trunk.arch
        # eager: every launch and copy on the legacy default stream (0), ordered with the synchronous
        # copies, one sync a step (the logits' download). graphs: each step shape captured once on
        # a stream of its own and replayed there (step_graph below)
        self.trunk, self.dev, self.arch, self.capacity = trunk, _OnStream(dev, 0), a, capacity
        self.graphs = graphs
        self._graphs: dict[tuple, object] = {}  # (rows, logit rows, aux slots) -> graph exec
        # blocking (flags 0): ordered with the legacy stream's copies (a snapshot's clone, _bring)
        self.gstream = dev.stream(0) if graphs else 0
        if graphs:  # load the modules now: a module load is no call to make inside a capture
            for module in ("step", "bgemv"):
                dev.module(module)
        dev = self.dev
        self._held: list[int] = []
        self.sizes: dict[int, int] = {}  # bytes of each allocation (plan.py's accounting)
        up = self._upload
        self.embed = self._matrix(trunk.embed)
        if self.embed.fmt != "bf16":
            raise ValueError("the CUDA step gathers a bf16 embedding")
        self.lm_head = self.embed if trunk.lm_head is trunk.embed or (
            isinstance(trunk.embed, PackedRows) and trunk.embed.packed is trunk.lm_head) else self._matrix(trunk.lm_head)
        self.final_norm = up(trunk.final_norm)
        self.layers = []
        for layer in trunk.layers:
            m = layer.mixer
            d = dict(gdn=layer.gdn, in_norm=up(layer.in_norm), post_norm=up(layer.post_norm), moe=None)
            if layer.moe is None:
                d.update(gate_up=self._matrix(layer.gate_up), down=self._matrix(layer.down))
            else:
                d["moe"] = self._moe(layer.moe)
            if layer.gdn:
                d.update(proj=self._matrix(m.in_proj), out=self._matrix(m.out), conv=up(m.conv), neg_a=up(m.neg_a),
                         dt_bias=up(m.dt_bias), gnorm=up(m.norm))
            else:
                d.update(proj=self._matrix(m.qkv), out=self._matrix(m.o), q_norm=up(m.q_norm), k_norm=up(m.k_norm))
            self.layers.append(d)
        # RoPE's cos, sin [capacity, rot/2, 2] (positions at index: rope_delta 0)
        f = torch.arange(capacity, dtype=torch.float32)[:, None] * trunk.inv_freq.float()[None, :]
        self.rope = up(torch.stack([torch.cos(f), torch.sin(f)], -1))
        # the step's activations, [CHUNK, ...] each
        H, R = a.hidden, CHUNK
        widest = max(m["proj"].n for m in self.layers)
        mixer_out = max(a.lin_v_heads * a.lin_v_dim, a.num_heads * a.head_dim)
        self.ids = self._alloc(4 * R)                     # [R] int32 token ids
        self.x = self._alloc(4 * R * H)                    # [R, H] the residual stream
        self.h = self._alloc(4 * R * H)                    # [R, H] a norm's output
        self.y = self._alloc(4 * R * H)                    # [R, H] a sublayer's output
        self.proj = self._alloc(4 * R * widest)            # [R, P] the mixer's input product
        self.mix = self._alloc(4 * R * mixer_out)          # [R, vd | heads * hd] the mixer's output
        self.gu = self._alloc(4 * R * 2 * a.intermediate)  # [R, 2 I]
        self.act = self._alloc(4 * R * a.intermediate)     # [R, I]
        self.logits = self._alloc(4 * R * a.vocab)         # [R, vocab]
        self.scores = self._alloc(4 * R * a.num_heads * capacity)  # [R, heads, capacity] attention scratch
        self.aux = self._alloc(4 * R * H * max(1, a.num_layers))   # [layers, R, H] requested layers' outputs
        # the per-sequence, per-step values the mixers read (the only ones that change between two
        # steps of one shape): written by one HtoD before the step's launches, so the launches'
        # arguments (and a captured graph's) never change. Per GDN layer sk.GDN_SEQ_SLOTS, per
        # attention layer sk.ATT_SEQ_SLOTS int64 (addresses, p0)
        self.seq_at, n = [], 0
        for L in self.layers:
            self.seq_at.append(n)
            n += sk.GDN_SEQ_SLOTS if L["gdn"] else sk.ATT_SEQ_SLOTS
        self.seq_host = torch.zeros(max(1, n), dtype=torch.int64)  # its host copy, rewritten each step
        self.seqp = self._alloc(8 * max(1, n))                      # [slots] int64 on the device
        if any(m["moe"] is not None for m in self.layers):
            E, k, I = a.num_experts, a.experts_per_token, a.moe_intermediate
            S = max(1, a.shared_intermediate)
            self.probs = self._alloc(4 * R * E)           # [R, E] router logits, then probabilities
            self.mids = self._alloc(4 * R * k)            # [R, k] int32 experts (ascending)
            self.mw = self._alloc(4 * R * k)              # [R, k] their weights
            self.egu = self._alloc(4 * R * k * 2 * I)     # [R k, 2 I] routed gate | up
            self.eact = self._alloc(4 * R * k * I)        # [R k, I]
            self.eout = self._alloc(4 * R * k * H)        # [R k, H] routed outputs
            self.sgu = self._alloc(4 * R * 2 * S)         # [R, 2 S] shared gate | up
            self.sact = self._alloc(4 * R * S)            # [R, S]
            self.sout = self._alloc(4 * R * H)            # [R, H] shared output
            self.sgate = self._alloc(4 * R)               # [R, 1] shared gate logit

    # ---- open ----------------------------------------------------------------------------

    def _alloc(self, nbytes: int) -> int:
        ptr = self.dev.alloc(nbytes)
        self._held.append(ptr)
        self.sizes[ptr] = nbytes
        return ptr

    def _upload(self, t: torch.Tensor) -> int:
        t = t.detach().contiguous()
        ptr = self._alloc(t.numel() * t.element_size())
        self.dev.htod(ptr, t.data_ptr(), t.numel() * t.element_size())
        return ptr

    def _matrix(self, m) -> Matrix:
        fmt, parts, n, k = _host_matrix(m)
        ptrs = [self._upload(p if p.dtype != torch.bfloat16 else p.view(torch.int16)) for p in parts]
        group = k // parts[1].shape[1] if fmt != "bf16" else 64
        return Matrix(fmt, ptrs[0], *(ptrs[1:] or [0, 0]), n=n, k=k, group=group)

    def _moe(self, moe) -> dict:
        """A MoE block resident: the router, every expert's matrices and the device tables of
        their pointers (the routing picks them on the device), the shared expert."""
        gate_up = [self._matrix(m) for m in moe.gate_up]
        down = [self._matrix(m) for m in moe.down]
        if any(m.fmt != "bf16" for m in gate_up + down):
            raise ValueError("the CUDA step's routed experts are bf16 only yet")
        table = lambda ms: self._upload(torch.tensor([m.w for m in ms], dtype=torch.int64))  # noqa: E731
        d = dict(router=self._matrix(moe.router), gate_up=table(gate_up), down=table(down), shared=None)
        if moe.shared_gate_up is not None:
            d["shared"] = (self._matrix(moe.shared_gate_up), self._matrix(moe.shared_down),
                           self._matrix(moe.shared_gate))
        return d

    def close(self) -> None:
        for g in self._graphs.values():
            self.dev.graph_destroy(graph_exec=g)
        self._graphs = {}
        for ptr in self._held:
            self.dev.free(ptr)
        self._held = []

    # ---- per-sequence device state --------------------------------------------------------

    def _seq(self, st: TrunkState) -> dict:
        seq = st.scratch.get("cuda")
        if seq is not None:
            return seq
        a, dev = self.arch, self.dev
        per = a.lin_v_heads * a.lin_k_dim * a.lin_v_dim
        C, K = a.lin_conv_dim, a.conv_kernel
        seq = {"gdn": {}, "kv": {}}
        owned: list[int] = []  # the sequence's buffers, freed with its state (a server opens many)

        def alloc(nbytes: int) -> int:
            owned.append(dev.alloc(nbytes))
            return owned[-1]

        for i, layer in enumerate(self.layers):
            if layer["gdn"]:
                g = dict(states=[alloc(4 * per) for _ in range(2)],      # 2 x [Hv, dk, dv]
                         ckpt=alloc(4 * per * (CHUNK - 1)),             # [15, Hv, dk, dv]
                         windows=[alloc(4 * (K - 1) * C) for _ in range(2)],  # 2 x [K-1, C]
                         ext=alloc(4 * (K - 1 + CHUNK) * C))           # [K-1+16, C]
                s, w = st.gdn[i]
                for ptr, src in ((g["states"][0], s), (g["windows"][0], w)):
                    if isinstance(src, DeviceRef):  # a restored snapshot's (a prefix cache hit, a session)
                        dev.dtod(ptr, src.ptr, src.nbytes)
                        continue
                    host = src.contiguous().float()  # a fresh state's zeros, or a CPU state handed over
                    dev.htod(ptr, host.data_ptr(), host.numel() * 4)
                st.gdn[i] = (DeviceRef(dev, g["states"][0], (a.lin_v_heads, a.lin_k_dim, a.lin_v_dim)),
                             DeviceRef(dev, g["windows"][0], (K - 1, C)))
                seq["gdn"][i] = g
            else:
                n = 4 * a.num_kv_heads * self.capacity * a.head_dim
                kc, vc = alloc(n), alloc(n)  # [kv_heads, capacity, hd] fp32 each
                dev.memset(kc, n), dev.memset(vc, n)
                if st.pos:  # a state that holds rows (a copy the prefix cache restored): its K/V mirror's
                    for dst, host in zip((kc, vc), st.kv[i]):
                        rows = host[:, :st.pos].float().contiguous()
                        for h in range(a.num_kv_heads):
                            dev.htod(dst + 4 * h * self.capacity * a.head_dim, rows[h].data_ptr(), rows[h].nbytes)
                seq["kv"][i] = (kc, vc)
        st.scratch["cuda"] = seq
        weakref.finalize(st, _free_all, dev, owned)
        return seq

    def _mirror_kv(self, st: TrunkState, seq: dict, p0: int, rows: int) -> None:
        """The rows p0..p0+rows just written to each layer's device K/V, copied into the state's
        host caches (fp32: the trunk's kv_dtype on this step), where the prefix cache, sessions and
        state files read a sequence's K/V. One small copy a head (the logits' sync covers it)."""
        a = self.arch
        for i, (kc, vc) in seq["kv"].items():
            for src, host in zip((kc, vc), st.kv[i]):
                if host.dtype != torch.float32 or not host.is_contiguous() or host.shape[1] < p0 + rows:
                    raise ValueError(f"the CUDA step mirrors its K/V into fp32 host caches (kv_dtype float32) "
                                     f"holding {p0 + rows} positions (Trunk.reserve)")
                for h in range(a.num_kv_heads):
                    dst = host[h, p0:p0 + rows]
                    self.dev.dtoh(dst.data_ptr(), src + 4 * (h * self.capacity + p0) * a.head_dim, dst.nbytes)

    def _bring(self, ref: DeviceRef, bufs: list[int]) -> int:
        """The index of the buffer of `bufs` holding `ref` (copied into bufs[0] or [1] if elsewhere)."""
        if ref.ptr in bufs:
            return bufs.index(ref.ptr)
        self.dev.dtod(bufs[0], ref.ptr, ref.nbytes, stream=self.gstream or None)
        return 0

    # ---- the step ---------------------------------------------------------------------------

    def step(self, st: TrunkState, tokens: list[int], aux_layers: tuple[int, ...], rollback: str | None) -> StepOut:
        return self.step_many([st], [tokens], [aux_layers], [rollback], [len(tokens)])[0]

    def step_many(self, states, tokens, aux_layers, rollback, logit_rows) -> list[StepOut]:
        """One sequence after another (each its own launches: its bits are its `step`'s)."""
        outs = []
        for st, tk, al, rb, k in zip(states, tokens, aux_layers, rollback, logit_rows):
            out = self._rows(st, tk, al, rb, k)
            outs.append(out)
        return outs

    def prefill(self, st: TrunkState, tokens: list[int], aux_layers: tuple[int, ...], want_logits: bool,
                mm=None) -> StepOut:
        if mm is not None:
            raise ValueError("the CUDA step has no multimodal rows yet")
        return self._rows(st, tokens, aux_layers, None, len(tokens) if want_logits else 1)

    def replay(self, trace: GdnTrace, kept: int):
        """The state after `kept` rows: the step keeps every row's checkpoint, so the same bits."""
        return trace.states[kept - 1] if kept else trace.snapshot

    def _rows(self, st: TrunkState, tokens: list[int], aux_layers: tuple[int, ...], rollback: str | None,
              logit_rows: int) -> StepOut:
        a = self.arch
        if st.rope_delta:
            raise ValueError("the CUDA step rotates rows at their positions only (no image rows yet)")
        if not tokens or not 0 <= min(tokens) <= max(tokens) < a.vocab:
            raise ValueError(f"tokens {tokens} are empty or not ids in 0..{a.vocab - 1}")
        if st.pos + len(tokens) > self.capacity:
            raise ValueError(f"the CUDA step holds {self.capacity} positions; {st.pos + len(tokens)} asked")
        if rollback is not None and len(tokens) > CHUNK:
            raise ValueError(f"a step that keeps a rollback takes at most {CHUNK} rows")
        seq = self._seq(st)
        R = len(tokens)
        hidden, logits, aux, traces = [], [], [], {}
        for c0 in range(0, R, CHUNK):
            chunk = tokens[c0:c0 + CHUNK]
            want = max(0, logit_rows - (R - c0 - len(chunk)))  # this chunk's rows among the last logit_rows
            h, lg, ax = self._chunk(st, seq, chunk, aux_layers, rollback, min(want, len(chunk)), traces)
            hidden.append(h), aux.append(ax)
            if lg is not None:
                logits.append(lg)
        logits_t = torch.cat(logits) if logits else torch.empty(0, a.vocab)
        aux_t = torch.cat(aux) if aux_layers else None
        return StepOut(logits_t, torch.cat(hidden), aux_t, traces)

    def _chunk(self, st, seq, tokens, aux_layers, rollback, want, traces):
        """One launch of R rows: the host writes ids and the seq block, then the device program
        (eager, or its graph replayed), then the downloads."""
        a, dev = self.arch, self.dev
        R, H = len(tokens), a.hidden
        slots = tuple(sorted(aux_layers))
        s = self.gstream or None  # copies on the graph's stream when graphed (one sync a step)
        ids = torch.tensor(tokens, dtype=torch.int32)
        self._seq_block(st, seq, R, rollback, traces)
        dev.htod(self.ids, ids.data_ptr(), 4 * R, stream=s)
        dev.htod(self.seqp, self.seq_host.data_ptr(), self.seq_host.numel() * 8, stream=s)
        if self.graphs:
            dev.graph_launch(self.step_graph(R, want, slots), self.gstream)
        else:
            self._program(R, want, slots)
        lg = None
        if want:
            lg = torch.empty(want, a.vocab)
            dev.dtoh(lg.data_ptr(), self.logits, lg.numel() * 4, stream=s)
        hid = torch.empty(R, H)
        dev.dtoh(hid.data_ptr(), self.x, hid.numel() * 4, stream=s)
        ax = None
        if slots:
            parts = torch.empty(len(slots), CHUNK, H)
            dev.dtoh(parts.data_ptr(), self.aux, parts.numel() * 4, stream=s)
        if s is not None:
            dev.sync(s)  # the step's one sync
        if slots:
            ax = parts[:, :R].permute(1, 0, 2).reshape(R, len(slots) * H).contiguous()
        if seq["kv"] and st.kv:
            self._mirror_kv(st, seq, st.pos, R)
        st.pos += R
        return hid, lg, ax

    def step_graph(self, R: int, want: int, slots: tuple[int, ...]):
        """The executable graph of the device program for (R rows, `want` logit rows, aux slots),
        captured on the first step of that shape: every value that changes between two such
        steps is in the ids and seq buffers, which the host writes before each replay."""
        key = (R, want, slots)
        g = self._graphs.get(key)
        if g is None:
            dev = self.dev
            dev.stream = self.gstream  # _OnStream: the program's launches go to the capturing stream
            dev.begin_capture(self.gstream)
            try:
                self._program(R, want, slots)
            finally:
                graph = dev.end_capture(self.gstream)  # ends the capture even when a launch failed
                dev.stream = 0
            g = self._graphs[key] = dev.instantiate(graph)
            dev.graph_destroy(graph=graph)
        return g

    def _program(self, R: int, want: int, slots: tuple[int, ...]) -> None:
        """The step's launches for R rows, their arguments fixed by (R, want, slots): no host
        value, no sync, no allocation (the same list eager and captured)."""
        a, k = self.arch, self.dev
        H = a.hidden
        sk.embed_rows(k, self.embed.w, self.ids, self.x, R, H)
        y = 0  # the sublayer output the next norm adds (0: none yet)
        for i, L in enumerate(self.layers):
            sk.add_rms_norm(k, self.x, y, L["in_norm"], self.h, R, H, a.rms_eps)
            self._product(L["proj"], self.h, self.proj, R)
            seqp = self.seqp + 8 * self.seq_at[i]
            if L["gdn"]:
                sk.gdn_step_ind(k, self.proj, seqp, L["conv"], L["neg_a"], L["dt_bias"], L["gnorm"], self.mix, R,
                                a.lin_k_heads, a.lin_k_dim, a.lin_v_heads, a.lin_v_dim, a.conv_kernel, a.rms_eps)
            else:
                sk.attn_rows_ind(k, self.proj, seqp, L["q_norm"], L["k_norm"], self.rope, self.scores, self.mix, R,
                                 self.capacity, a.num_heads, a.num_kv_heads, a.head_dim, a.rotary_dim, a.rms_eps)
            self._product(L["out"], self.mix, self.y, R)
            sk.add_rms_norm(k, self.x, self.y, L["post_norm"], self.h, R, H, a.rms_eps)
            if L["moe"] is None:
                self._product(L["gate_up"], self.h, self.gu, R)
                sk.silu_mul(k, self.gu, self.act, R, a.intermediate)
                self._product(L["down"], self.act, self.y, R)
            else:
                self._moe_block(L["moe"], R)
            y = self.y
            if i in slots:  # the layer's output: the residual add now (the next norm then adds nothing)
                sk.add_rms_norm(k, self.x, self.y, L["post_norm"], self.h, R, H, a.rms_eps)
                k.dtod(self.aux + 4 * slots.index(i) * CHUNK * H, self.x, 4 * R * H, stream=k.stream)
                y = 0
        sk.add_rms_norm(k, self.x, y, self.final_norm, self.h, R, H, a.rms_eps)
        if want:
            self._product(self.lm_head, self.h + 4 * (R - want) * H, self.logits, want)

    def _moe_block(self, M: dict, R: int) -> None:
        """y = the MoE block of h (native_moe.c's order): router, routing, the routed experts
        (two gathered products over the rows' k experts), the gated shared expert, their sum."""
        a, k = self.arch, self.dev
        E, top, I, H = a.num_experts, a.experts_per_token, a.moe_intermediate, a.hidden
        self._product(M["router"], self.h, self.probs, R)
        sk.moe_route(k, self.probs, self.mids, self.mw, R, E, top, a.norm_topk_prob)
        sk.experts_product(k, self.h, self.mids, M["gate_up"], self.egu, R * top, H, 2 * I, top)
        sk.silu_mul(k, self.egu, self.eact, R * top, I)
        sk.experts_product(k, self.eact, self.mids, M["down"], self.eout, R * top, I, H, 1)
        shared = gate = 0
        if M["shared"] is not None:
            sgu, sdown, sgate = M["shared"]
            S = a.shared_intermediate
            self._product(sgu, self.h, self.sgu, R)
            sk.silu_mul(k, self.sgu, self.sact, R, S)
            self._product(sdown, self.sact, self.sout, R)
            self._product(sgate, self.h, self.sgate, R)
            shared, gate = self.sout, self.sgate
        sk.moe_combine(k, self.eout, self.mw, shared, gate, self.y, R, top, H)

    def _product(self, m: Matrix, x: int, y: int, rows: int) -> None:
        sk.rows_product(self.dev, m.fmt, x, m.w, y, rows, m.k, m.n, m.scales, m.biases, m.group)

    def _seq_block(self, st, seq, R, rollback, traces) -> None:
        """Fill seq_host for this step: each GDN layer's buffers (bringing a state or window that
        lies elsewhere into them first) and the states it will leave, each attention layer's K/V
        and position; and st.gdn / the traces as the step will leave them."""
        a, dev, b = self.arch, self.dev, self.seq_host
        shape = (a.lin_v_heads, a.lin_k_dim, a.lin_v_dim)
        C, K = a.lin_conv_dim, a.conv_kernel
        for i, L in enumerate(self.layers):
            o = self.seq_at[i]
            if not L["gdn"]:
                kc, vc = seq["kv"][i]
                b[o:o + 3] = torch.tensor([kc, vc, st.pos], dtype=torch.int64)
                continue
            g = seq["gdn"][i]
            sref, wref = st.gdn[i]
            si = self._bring(sref, g["states"])
            wi = self._bring(wref, g["windows"])
            so = si if rollback is None else 1 - si  # keep the state read as the trace's snapshot
            b[o:o + 6] = torch.tensor([g["windows"][wi], g["windows"][1 - wi], g["ext"], g["states"][si],
                                       g["states"][so], g["ckpt"] if R > 1 else 0], dtype=torch.int64)
            new = DeviceRef(dev, g["states"][so], shape)
            st.gdn[i] = (new, DeviceRef(dev, g["windows"][1 - wi], (K - 1, C)))
            if rollback is not None:
                per = DeviceRef(dev, g["ckpt"], (CHUNK - 1, *shape))
                traces[i] = GdnTrace(DeviceRef(dev, g["states"][si], shape), DeviceRef(dev, g["ext"], (K - 1 + R, C)),
                                     None, [per[r] for r in range(R - 1)] + [new])
