"""Loading apart from running: an install's tensors read, checked and prepared for a step.

`load_trunk` and `load_drafter` are what the engine calls. Each load is planned first
(turbo/load_plan.py: which format every matrix takes, from the index's headers, the arch and
the options), then read here as planned (`Reader`). Each part gets one step object, chosen
once in the plan (turbo/backends/step.py): the native CPU step where `OpenOptions.native`
allows it and it can run, else the torch step; the part keeps the reason (`why_torch`). The
options arrive resolved: nothing here reads the environment.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from functools import partial

import torch

from . import layout_file, ops, quant
from .arch import Arch
from .backends import native_dflash, native_exact, native_lib, native_pack, native_trunk
from .backends.torch_step import TorchDflashStep, TorchMtpStep, TorchTrunkStep
from .drafters.dflash import DFLASH_RESIDUAL_SCALE, DflashDrafter, DflashLayer, DflashWeights
from .drafters.dflash_config import (DflashConfig, DflashShape, derive_published_shape, derive_shape, dflash_layer_tensor,
                                      parse_drafter_config)
from .drafters.mtp import MTP_PREFIX, MtpDrafter, MtpWeights
from .errors import TurboError
from .install import ST_TORCH, Entry, Install, ResidentIndex
from .load_plan import (COPY, DFLASH_BASES, DFLASH_SELECTOR, DRAFT, DRAFT_HEAD, EXACT, NATIVE_OFF, PACKED, SEGMENTS,
                        TENSOR, DrafterPlan, EmbedPlan, Host, LayerPlan, Matrix, MoePlan, Source, TrunkPlan, mtp_tensor_shapes,
                        packed_layout, plan_dflash, plan_mtp, plan_trunk)
from .options import OpenOptions
from .policy import check_window
from .trunk import PREFIX, AttnWeights, GdnWeights, LayerWeights, MoeWeights, Trunk, TrunkWeights


def _native_refusal(opts: OpenOptions, refusal: str | None) -> str | None:
    """Why a part does not take the native step: the options, the part's own `refusal`,
    or the library's build (built here, once per process, into opts.cache_dir)."""
    if not opts.native:
        return NATIVE_OFF
    if refusal is not None:
        return refusal
    native_lib.library(opts.cache_dir, opts.compiler)
    return native_lib.why_not()


def host(opts: OpenOptions, device: torch.device) -> Host:
    """What a plan needs of this machine: the native library built (only for the CPU, where asked)."""
    if device.type != "cpu" or not opts.native:
        return Host()
    why = _native_refusal(opts, None)
    return Host(why, native_lib.dot_layouts() if why is None else ())


def _to(t, device: torch.device):
    """A tensor or a part's weights (dataclasses of them) moved to `device`, once read on the host."""
    return t if device.type == "cpu" else ops.to_device(t, device)


def _norm(index, name: str, device: torch.device) -> torch.Tensor:
    """A drafter's RMSNorm weight as the forward reads it, 1 + w in fp32 (computed on the host,
    as on the CPU, then moved)."""
    return _to(1.0 + index.load(name, torch.float32), device)


# ---- reading as planned ---------------------------------------------------------------------


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
            return native_pack.Packed(self.index.view(m.mapped), sum(e.dims[0] for e in entries), entries[0].dims[1],
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
            return native_pack.PackedRows(head), head
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

    def head_copy(self, p: EmbedPlan, table: torch.Tensor | None = None) -> native_pack.Packed:
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


# ---- the trunk ------------------------------------------------------------------------------


def load_trunk(install: Install, opts: OpenOptions, device: torch.device | str) -> Trunk:
    """The trunk's weights in `opts.dtype` on `device` (prepared on the host exactly as for
    the CPU, then moved there once), on the native step where it can run. Planned first
    (load_plan.plan_trunk: the step, and every matrix's format), then read: the native step's
    matrices are views of the install's open layout, mapped (turbo/layout_file.py: nothing read
    at open); a matrix it does not hold is packed as it is read, a slice at a time
    (native_pack.pack_rows), so loading holds about the packed weights and nothing twice."""
    device = torch.device(device)
    quant.cpu_mode(opts.quant_cpu)  # (refused before the library is built)
    here = host(opts, device)
    if here.library is None:  # an older install (none, or a stale open layout) converts itself once
        from .open_layout import convert_on_open  # (turbo/open_layout.py: it reads with this module's Reader)
        convert_on_open(install, here)
    trunk = read_trunk(install, plan_trunk(install.index.entries, install.arch, opts, device, here, install.index.packed),
                       device)
    if install.layout_note is not None and here.library is None:  # (once it opened: a refusal stays one line)
        print(install.layout_note, file=sys.stderr)
    return trunk


def read_trunk(install: Install, plan: TrunkPlan, device: torch.device) -> Trunk:
    """The trunk as `plan` has it, read on the host and moved to `device` once."""
    a = install.arch
    r = Reader(install.index, plan.dtype)
    embed, lm_head = r.embedding(plan.embed)
    final_norm = r.norm(PREFIX + "norm.weight", a.hidden)
    layers = [r.layer(p, a) for p in plan.layers]
    inv_freq = ops.rope_inv_freq(a.rotary_dim, a.rope_theta, a.rope_scaling)
    if device.type != "cpu":  # once, at load: everything above was prepared on the host exactly as for the CPU
        embed = ops.to_device(embed, device)
        lm_head = embed if a.tie_embeddings else ops.to_device(lm_head, device)
        final_norm, inv_freq = ops.to_device(final_norm, device), ops.to_device(inv_freq, device)
        layers = [ops.to_device(layer, device) for layer in layers]
    weights = TrunkWeights(embed, lm_head, final_norm, layers, inv_freq)
    step = TorchTrunkStep if plan.why_torch else native_trunk.NativeTrunkStep
    return Trunk(a, weights, plan.dtype, device, plan.kv, step, plan.why_torch)


# ---- the drafters ---------------------------------------------------------------------------


def load_drafter(kind: str, install: Install, trunk: Trunk, window: int | None, opts: OpenOptions):
    """The install's own drafter of `kind` (dflash | mtp), ready for the engine (turbo.drafters.Drafter)."""
    if kind == "dflash":
        return load_dflash(install, trunk.embed, ops.dense(trunk.lm_head), window, opts, device=trunk.device)
    return load_mtp(install, trunk, opts.draft_products)


def _dflash_shape(install: Install, cfg: DflashConfig, window: int | None) -> DflashShape:
    """The drafter's shape, derived from its tensors and checked against its config and `window`."""
    idx = install.index
    if cfg.has_conv:
        shape = derive_shape(idx, cfg.hidden, cfg.vocab, cfg.taps, cfg.group)
    else:
        shape = derive_published_shape(idx, cfg)
    for key, value, derived in (("num_attention_heads", cfg.heads, shape.num_heads),
                                ("num_key_value_heads", cfg.kv_heads, shape.num_kv_heads),
                                ("head_dim", cfg.head_dim, shape.head_dim),
                                ("intermediate_size", cfg.intermediate, shape.inter)):
        if value != derived:
            raise TurboError(f"dflash/config.json: field {key!r} is {value}, the tensors' is {derived}")
    if shape.aux_count != len(cfg.target_layers):
        raise TurboError(f"dflash.fc.weight fuses {shape.aux_count} aux states, but field 'target_layer_ids' lists "
                         f"{len(cfg.target_layers)}")
    if cfg.has_selector and shape.rank != cfg.rank:
        raise TurboError(f"dflash/config.json: selector_rank is {cfg.rank}, the codebooks have rank {shape.rank}")
    if window is not None:
        check_window(window, cfg.window)
    return shape


def load_dflash(install: Install, embed: torch.Tensor, lm_head: torch.Tensor, window: int | None = None,
                opts: OpenOptions = OpenOptions(), dtype: torch.dtype = torch.float32,
                scale: float = DFLASH_RESIDUAL_SCALE, device: torch.device | str = "cpu") -> DflashDrafter:
    """The install's DFlash drafter (DFlash2 or the published DFlash, as its config names)
    over the trunk's `embed` table and (dense) `lm_head`, in `dtype` activations on `device`;
    `window` its context (None: the trained sliding_window)."""
    if install.drafter_config is None:
        raise TurboError(f"{install.path}: no dflash/config.json (the install carries no DFlash drafter)")
    cfg = parse_drafter_config(install.drafter_config, install.arch, str(install.path / "dflash" / "config.json"))
    shape = _dflash_shape(install, cfg, window)
    idx = install.index
    device = torch.device(device)
    plan = plan_dflash(idx.entries, shape.layers, cfg.has_conv, cfg.has_selector, dtype, opts=opts, device=device,
                       host=host(opts, device), embed=embed, head=lm_head.dtype)
    r = Reader(idx, dtype, given={DRAFT_HEAD: lm_head})
    layers = [_dflash_layer(r, plan, i, cfg.has_conv, device) for i in range(shape.layers)]
    weights = DflashWeights(
        embed=embed, lm_head=r.matrix(plan.head),
        fc=_to(r.matrix(plan.matrices["fc"]), device), hidden_norm=_norm(idx, "dflash.hidden_norm.weight", device),
        final_norm=_norm(idx, "dflash.norm.weight", device),
        hidden_projection=_selector(idx, cfg.has_selector, "hidden_projection.weight", device),
        pred_codebook=_selector(idx, cfg.has_selector, "predecessor_codebook", device),
        succ_codebook=_selector(idx, cfg.has_selector, "successor_codebook", device),
        layers=layers, inv_freq=_to(ops.rope_inv_freq(cfg.head_dim, cfg.rope_theta), device))
    make_step = TorchDflashStep if plan.why_torch else native_dflash.NativeDflashStep
    return DflashDrafter(cfg, shape, weights, window or cfg.window, dtype, scale, device, make_step, plan.why_torch)


def _dflash_layer(r: Reader, plan: DrafterPlan, i: int, conv: bool, device: torch.device) -> DflashLayer:
    """Layer i of a DFlash drafter: its matrices as planned, its norms, its conv's base kernels."""
    def norm(name: str) -> torch.Tensor:
        return _norm(r.index, dflash_layer_tensor(i, name), device)

    def mat(key: str) -> torch.Tensor | None:
        m = plan.matrices.get(f"layers.{i}.{key}")
        return None if m is None else _to(r.matrix(m), device)

    def base(name: str) -> torch.Tensor | None:
        return _to(r.index.load(dflash_layer_tensor(i, name), r.dtype), device) if conv else None

    return DflashLayer(
        in_norm=norm("input_layernorm.weight"), post_norm=norm("post_attention_layernorm.weight"),
        q=mat("q"), k=mat("k"), v=mat("v"), o=mat("o"), q_norm=norm("self_attn.q_norm.weight"),
        k_norm=norm("self_attn.k_norm.weight"), gate=mat("gate"), up=mat("up"), down=mat("down"),
        attn_proj=mat("attn_proj"), attn_base=base(DFLASH_BASES[0]), mlp_proj=mat("mlp_proj"),
        mlp_base=base(DFLASH_BASES[1]),
    )


def _selector(index: ResidentIndex, present: bool, name: str, device: torch.device) -> torch.Tensor | None:
    return _to(index.load(DFLASH_SELECTOR + name, torch.float32), device) if present else None


def load_mtp(install: Install, trunk: Trunk, products: str = "auto") -> MtpDrafter:
    """The install's MTP head over `trunk` (its embedding, lm_head and step: native.c's
    layer on the trunk's native step, with the `products` matrix products)."""
    if not install.has_mtp:
        raise TurboError(f"{install.path}: this install carries no MTP head (mtp.fc.weight is not in the "
                         "resident index)")
    index, arch = install.index, install.arch
    if MTP_PREFIX + "layers.1.input_layernorm.weight" in index:
        raise TurboError("mtp.layers.1.input_layernorm.weight: this head has more than one MTP layer, and this "
                         "port runs exactly one (num_nextn_predict_layers 1, as Qwen3.5 ships)")
    for name, shape in mtp_tensor_shapes(arch).items():
        dims = index.need(name).dims
        if tuple(dims) != shape:
            raise TurboError(f"{name} has shape {list(dims)}, expected {list(shape)} (from the trunk's config)")
    dtype, device = trunk.dtype, trunk.device  # the trunk's: weights moved once at load, the cache there too
    # the head runs on the trunk's step: the library is built where that is the native one
    why = None if trunk.step_name == "native" else trunk.why_torch or "the trunk runs its torch step"
    here = Host(None, native_lib.dot_layouts()) if why is None else Host()
    plan = plan_mtp(index.entries, arch, dtype, why, products, here)
    r = Reader(index, dtype)

    def norm(name: str) -> torch.Tensor:
        return _norm(index, MTP_PREFIX + name, device)

    weights = MtpWeights(
        fc=_to(r.matrix(plan.matrices["fc"]), device),
        norm_embedding=norm("pre_fc_norm_embedding.weight"),
        norm_hidden=norm("pre_fc_norm_hidden.weight"),
        final_norm=norm("norm.weight"),
        layer=_to(r.layer(plan.layer, arch), device),
    )
    return MtpDrafter(trunk, weights, TorchMtpStep if plan.why_torch else native_trunk.NativeMtpStep)
