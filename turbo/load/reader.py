"""Reading an install's tensors as a load plan has them (turbo/load/load_plan.py): `Reader`, on the
host. The loader reads every part with it (turbo/load/loader.py); the open layout's writer reads the
matrices it packs with it too (turbo/load/open_layout.py), so both read exactly the same bytes."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch

from ..backends import native_exact, native_pack
from ..backends.packed import Packed, PackedRows
from ..errors import TurboError
from ..model.trunk import AttnWeights, GdnWeights, LayerWeights, MoeWeights
from ..store import layout_file, quant
from ..store.arch import Arch
from ..store.install import ST_TORCH, Entry, ResidentIndex
from .load_plan import (COPY, DRAFT, EXACT, PACKED, SEGMENTS, TENSOR, EmbedPlan, LayerPlan, Matrix, MoePlan, Source,
    packed_layout)


@dataclass
class Reader:
    """An install's tensors read as a plan has them, on the host; `dtype` the part's compute
    dtype (quantized matrices dequantized into it). `scratch`: the packing's read buffers
    (ResidentIndex.rows), one set per fused part, reused for every matrix of a load. `given`:
    sources already loaded, by their plan's name (a DFlash drafter's DRAFT_HEAD)."""
    index: ResidentIndex
    dtype: torch.dtype
    scratch: dict[int, dict[torch.dtype, torch.Tensor]] = field(default_factory=dict)
    given: dict[str, torch.Tensor] = field(default_factory=dict)

    def entry(self, s: Source) -> Entry:
        e = self.index.need(s.name)
        if s.shape is not None and e.dims != tuple(s.shape):
            raise TurboError(f"{s.name} has shape {list(e.dims)}, expected {list(s.shape)}")
        return e

    def tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor:
        self.entry(Source(name, shape))
        return self.index.load(name, dtype)

    def norm(self, name: str, n: int) -> torch.Tensor:
        return 1.0 + self.tensor(name, (n,), torch.float32)

    def plain(self, s: Source, dtype: torch.dtype, kernel: bool):
        """A source as ops.linear takes it: a tensor in `dtype`, or kept a packed QuantizedWeight."""
        if s.name in self.given:
            return self.given[s.name].to(dtype)
        self.entry(s)
        if not s.keep:
            return self.index.load(s.name, dtype)
        qw = self.index.load_quantized(s.name, dtype)
        qw.use_kernel = kernel
        return qw

    def matrix(self, m: Matrix):
        """The planned matrix: its sources fused by rows, then (native) packed as read."""
        if m.form in (TENSOR, DRAFT):  # (DRAFT: read in the part's dtype, then packed for the drafter's products)
            parts = [self.plain(s, m.dtype if m.form == TENSOR else self.dtype, m.kernel) for s in m.sources]
            w = quant.fuse(parts)
            return w if m.form == TENSOR else native_pack.pack_as(w, m.dtype, m.layout)
        entries = [self.entry(s) for s in m.sources]
        if m.mapped is not None:  # written at repack in this layout: a view of the mapped file, nothing packed
            if m.form == SEGMENTS:  # (its parts: views of it, as native_exact.segments() lays them out)
                return native_exact.read_segments(self.index.view(m.mapped), entries[0].dims[1],
                                                  [self.segment(p) for p in m.parts], m.mapped)
            return Packed(self.index.view(m.mapped), sum(e.dims[0] for e in entries), entries[0].dims[1],
                          packed_layout(self.index.entries, m))
        if m.form == SEGMENTS:
            return native_exact.segments([self.matrix(part) for part in m.parts])
        if m.form in (EXACT, PACKED):  # (mapped, not read: the packing reads each byte once)
            w = quant.fuse([self.index.load_quantized(e.name, self.dtype, mapped=True) for e in entries])
            return native_exact.exact_panels(w, entries[0].name) if m.form == EXACT else native_pack.quantized_panels(w)
        dense = {e.name: self.index.load(e.name, self.dtype) for e in entries if e.bits}  # (dequantized once)
        return native_pack.pack_rows(partial(self.rows, entries, dense, m.dtype), sum(e.dims[0] for e in entries),
                                m.dtype, m.layout)

    def segment(self, p: Matrix) -> tuple[int, str, torch.dtype, tuple[int, ...] | None]:
        """A segment's rows, layout, dtype and shape as packed (None: an exact one's, as many bytes as its data make)."""
        entries = [self.entry(s) for s in p.sources]
        n, layout = sum(e.dims[0] for e in entries), packed_layout(self.index.entries, p)
        if p.form == EXACT:
            return n, layout, torch.uint8, None
        st, shape = layout_file.packed_shape(layout, n, entries[0].dims[1], "BF16" if p.dtype == torch.bfloat16 else "F32")
        return n, layout, ST_TORCH[st], shape

    def rows(self, entries: list[Entry], dense: dict[str, torch.Tensor], into: torch.dtype,
             r0: int, r1: int) -> torch.Tensor:
        """Rows r0..r1 of the fused `entries` (a quantized one out of `dense`), for pack_rows."""
        pieces, at = [], 0
        for j, e in enumerate(entries):
            lo, hi = max(r0, at), min(r1, at + e.dims[0])
            if lo < hi:  # (each part its own buffer: one slice may read two)
                pieces.append(dense[e.name][lo - at:hi - at] if e.bits
                              else self.index.rows(e.name, lo - at, hi - at, self.scratch.setdefault(j, {})))
            at += e.dims[0]
        # (a slice across two parts: rare, the fused parts' sizes are mostly whole panels)
        return torch.cat([p.to(into) for p in pieces]) if len(pieces) > 1 else pieces[0]

    def embedding(self, p: EmbedPlan) -> tuple[object, object]:
        """The table and the lm_head, as planned (the table read once)."""
        if p.rows_of_head:
            head = self.matrix(p.head)
            return PackedRows(head), head
        e = self.entry(p.source)
        if e.bits and p.head is not None and p.head.form != COPY:  # (kept quantized: only the rows a step embeds)
            table = self.index.load_quantized(e.name, mapped=True)
            return quant.QuantizedRows(table, p.table or p.read_as or torch.float32), self.matrix(p.head)
        table = self.table(p)
        copy = self.head_copy(p, table) if p.head is not None and p.head.form == COPY else None
        table = table.to(p.table) if p.table is not None else table
        if copy is not None:
            return table, copy
        return table, table if p.head is None else self.matrix(p.head)

    def table(self, p: EmbedPlan) -> torch.Tensor:
        """The embedding table as read: a view of the mapped file where it is kept as stored (only
        the rows a step embeds are ever read), else read in `read_as`."""
        e = self.entry(p.source)
        kept = p.table or p.read_as
        # (stored -> read_as -> table is the identity when table is the stored dtype: read_as is never narrower)
        view = self.index.view(e.name) if kept is None or ST_TORCH.get(e.st_dtype) == kept else None
        return view if view is not None else self.index.load(e.name, p.read_as)

    def head_copy(self, p: EmbedPlan, table: torch.Tensor | None = None) -> Packed:
        """A tied head's quantized copy: mapped where the install holds it, else quantized now
        from `table` (the table as read_as; the repack writes exactly this)."""
        if p.head.mapped is not None:
            return self.matrix(p.head)
        return native_pack.quantized_copy(self.table(p) if table is None else table, p.head.bits)

    def layer(self, p: LayerPlan, a: Arch) -> LayerWeights:
        mixer = self.gdn(p, a) if p.gdn else self.attention(p, a)
        moe = self.moe(p.moe) if p.moe is not None else None
        return LayerWeights(
            gdn=p.gdn,
            in_norm=self.norm(p.prefix + "input_layernorm.weight", a.hidden),
            post_norm=self.norm(p.prefix + "post_attention_layernorm.weight", a.hidden),
            mixer=mixer,
            gate_up=None if moe else self.matrix(p.gate_up),
            down=None if moe else self.matrix(p.down),
            moe=moe,
        )

    def gdn(self, p: LayerPlan, a: Arch) -> GdnWeights:
        m, f32 = p.prefix + "linear_attn.", torch.float32
        conv = self.tensor(m + "conv1d.weight", (a.lin_conv_dim, 1, a.conv_kernel), f32)[:, 0]
        return GdnWeights(
            in_proj=self.matrix(p.mixer["in_proj"]),
            conv=conv.contiguous(),
            neg_a=-self.tensor(m + "A_log", (a.lin_v_heads,), f32).exp(),
            dt_bias=self.tensor(m + "dt_bias", (a.lin_v_heads,), f32),
            norm=self.tensor(m + "norm.weight", (a.lin_v_dim,), f32),
            out=self.matrix(p.mixer["out"]),
        )

    def attention(self, p: LayerPlan, a: Arch) -> AttnWeights:
        m = p.prefix + "self_attn."
        return AttnWeights(qkv=self.matrix(p.mixer["qkv"]), o=self.matrix(p.mixer["o"]),
                           q_norm=self.rotary_scaled(self.norm(m + "q_norm.weight", a.head_dim), a),
                           k_norm=self.rotary_scaled(self.norm(m + "k_norm.weight", a.head_dim), a))

    @staticmethod
    def rotary_scaled(norm: torch.Tensor, a: Arch) -> torch.Tensor:
        """yarn's attention factor: transformers scales cos and sin by it, which is the rotary
        dims of q and k scaled, so it is folded here into the norm that precedes the rotation
        (every step, the native and CUDA ones too, then computes it unchanged)."""
        factor = a.rope_scaling.attention_factor if a.rope_scaling is not None else 1.0
        if factor != 1.0:
            norm[:a.rotary_dim] *= factor
        return norm

    def moe(self, p: MoePlan) -> MoeWeights:
        """One MoE block; an expert past num_experts in the install is refused, as a missing one is."""
        if p.extra in self.index:
            raise TurboError(f"{p.extra}: the install has more experts than num_experts {len(p.gate_up)} "
                             "(config.json)")

        def m(x: Matrix | None):
            return None if x is None else self.matrix(x)
        return MoeWeights(router=m(p.router), gate_up=[m(x) for x in p.gate_up], down=[m(x) for x in p.down],
                          shared_gate_up=m(p.shared_gate_up), shared_down=m(p.shared_down),
                          shared_gate=m(p.shared_gate))
