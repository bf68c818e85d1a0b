"""Loading apart from running: an install's tensors read, checked and prepared for a step.

`load_trunk` and `load_drafter` are what the engine calls; everything that reads the
resident index for the forward lives here. Each part gets one step object, chosen once
(turbo/backends/step.py): the native CPU step where `OpenOptions.native` allows it and it
can run, else the torch step; the part keeps the reason (`why_torch`). The options arrive
resolved: nothing here reads the environment.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import ops, quant
from .arch import Arch
from .backends import native_dflash, native_lib, native_pack, native_trunk
from .backends.torch_step import TorchDflashStep, TorchMtpStep, TorchTrunkStep
from .drafters.dflash import DFLASH_RESIDUAL_SCALE, DflashDrafter, DflashLayer, DflashWeights
from .drafters.dflash_config import derive_published_shape, derive_shape, dflash_layer_tensor, parse_drafter_config
from .drafters.mtp import MTP_PREFIX, MtpDrafter, MtpWeights
from .errors import TurboError
from .install import Install
from .options import OpenOptions
from .trunk import PREFIX, AttnWeights, GdnWeights, LayerWeights, MoeWeights, Trunk, TrunkWeights

NATIVE_OFF = "TURBO_NATIVE=0"  # why_torch when OpenOptions.native is False
EMBED = "embed_tokens.weight"


def _native_refusal(opts: OpenOptions, refusal: str | None) -> str | None:
    """Why a part does not take the native step: the options, the part's own `refusal`,
    or the library's build (built here, once per process, into opts.cache_dir)."""
    if not opts.native:
        return NATIVE_OFF
    if refusal is not None:
        return refusal
    native_lib.library(opts.cache_dir, opts.compiler)
    return native_lib.why_not()


def _to(t, device: torch.device):
    return t if device.type == "cpu" else t.to(device)


def _norm(index, name: str, device: torch.device) -> torch.Tensor:
    """A drafter's RMSNorm weight as the forward reads it, 1 + w in fp32 (computed on the host,
    as on the CPU, then moved)."""
    return _to(1.0 + index.load(name, torch.float32), device)


# ---- the trunk ------------------------------------------------------------------------------


def _in_moe_block(name: str) -> bool:
    # (packed per block by load_moe, not per layer part with the layer's other products)
    return any(part in name for part in (".mlp.experts.", ".mlp.shared_expert", ".mlp.gate."))


def _moe_gate(name: str) -> bool:
    # the router and the shared expert's gate: [experts, hidden] and [1, hidden], read as floats
    # (native_moe.c: one wtype for them, one for the experts)
    return any(part in name for part in (".mlp.gate.", ".mlp.shared_expert_gate."))


def load_trunk(install: Install, opts: OpenOptions, device: torch.device | str) -> Trunk:
    """The trunk's weights in `opts.dtype` on `device` (prepared on the host exactly as for
    the CPU, then moved there once), on the native step where it can run. The native step's
    matrices are packed as they are read, a slice at a time (native_pack.pack_rows), so loading
    holds about the packed weights and nothing twice; whether it runs is settled first, and so
    is every matrix's format (float panels, or int4 / int8 read packed)."""
    a, index = install.arch, install.index
    dtype, device = getattr(torch, opts.dtype), torch.device(device)
    on_cpu = device.type == "cpu"
    mode = quant.cpu_mode(opts.quant_cpu)  # how quantized matrices run on the CPU (turbo/quant.py; measured)
    native_here = on_cpu and _native_refusal(opts, None) is None
    # every 2-D `trunk.*.weight` (a quantized one's logical dims), read off the index before any loads
    matrices = {name: e for name, e in index.entries.items()
                if name.startswith(PREFIX) and name.endswith(".weight") and len(e.dims) == 2}

    def read_packed(name: str, e) -> bool:
        """The native step's products read this quantized matrix as stored (turbo/quant.py: native)."""
        return (native_here and bool(e.bits) and native_pack.reads_packed(e.bits, e.group)
                and quant.native_reads(mode, e.bits, dtype) and not _moe_gate(name))

    kept = on_cpu and any(e.bits and quant.keep_packed(mode, e.bits, dtype) and not read_packed(name, e)
                          for name, e in matrices.items() if name != PREFIX + EMBED)
    why = _native_refusal(opts, native_trunk.trunk_refusal(device, dtype, kept))
    # the float matrices packed, the embedding kept, in it (None: the torch step's plain tensors)
    storage = native_pack.storage_dtype(dtype, {e.st_dtype for name, e in matrices.items() if not read_packed(name, e)}) \
        if why is None else None

    # the matrices outside MoE blocks by part ("layers.3.", "lm_head."), grouped once: an MoE
    # install has tens of thousands of expert matrices, too many to rescan for every layer
    parts: dict[str, list[tuple[str, object]]] = {}
    for name, e in matrices.items():
        if not _in_moe_block(name):
            rest = name[len(PREFIX):]
            cut = rest.index(".", len("layers.")) if rest.startswith("layers.") else rest.index(".")
            part = rest[:cut + 1]
            parts.setdefault(part, []).append((name, e))

    def packed_format(es: list[tuple[str, object]]) -> torch.dtype | int | None:
        """How the native step packs matrices that share one wtype (a layer's products; an MoE
        block's experts): the bits of the one packed format they are all read in, else fp32 if
        any is quantized (dequantized exactly), else `storage`."""
        kinds = {e.bits if read_packed(n, e) else None for n, e in es}
        if storage is None or not any(e.bits for _, e in es):
            return storage
        return kinds.pop() if len(kinds) == 1 and None not in kinds else torch.float32

    def fmt_of(part: str) -> torch.dtype | int | None:
        return packed_format(parts.get(part, []))

    def expert_fmt(names: list[str]) -> torch.dtype | int | None:
        return packed_format([(n, matrices[n]) for n in names if n in matrices])

    scratch: dict[int, dict[torch.dtype, torch.Tensor]] = {}  # the packing's read buffers per part (index.rows)

    def entry(name: str, shape: tuple[int, ...]):
        e = index.need(PREFIX + name)
        if e.dims != tuple(shape):
            raise TurboError(f"{PREFIX + name} has shape {list(e.dims)}, expected {list(shape)}")
        return e

    def w(name: str, shape: tuple[int, ...], as_dtype: torch.dtype | None = None):
        entry(name, shape)
        return index.load(PREFIX + name, as_dtype or dtype)

    def plain(e):
        """A matrix as ops.linear takes it: a tensor in `dtype`, or a packed QuantizedWeight."""
        if e.bits and (not on_cpu or quant.keep_packed(mode, e.bits, dtype)):
            qw = index.load_quantized(e.name, dtype)
            qw.use_kernel = mode != "packed" and on_cpu  # (on cuda: the quantized GEMV kernel)
            return qw
        return index.load(e.name, dtype)

    def matrix(parts: list[tuple[str, tuple[int, int]]], fmt: torch.dtype | int | None = None):
        """The parts' rows fused into one matrix: native: packed as read, in `fmt` (bits: read
        packed; a dtype: float panels; None: `storage`); else a tensor (or a packed
        QuantizedWeight) for ops.linear."""
        entries = [entry(name, shape) for name, shape in parts]
        if storage is None:
            return quant.fuse([plain(e) for e in entries])
        if isinstance(fmt, int):  # (quantized matrices are a fraction of the float size: fused whole)
            return native_pack.quantized_panels(quant.fuse([index.load_quantized(e.name, dtype) for e in entries]))
        into = fmt or storage
        dense = {e.name: index.load(e.name, dtype) for e in entries if e.bits}  # (dequantized once)

        def read(r0: int, r1: int) -> torch.Tensor:
            pieces, at = [], 0
            for j, e in enumerate(entries):
                lo, hi = max(r0, at), min(r1, at + e.dims[0])
                if lo < hi:  # (each part its own buffer: one slice may read two)
                    pieces.append(dense[e.name][lo - at:hi - at] if e.bits
                                  else index.rows(e.name, lo - at, hi - at, scratch.setdefault(j, {})))
                at += e.dims[0]
            # (a slice across two parts: rare, the fused parts' sizes are mostly whole panels)
            return torch.cat([p.to(into) for p in pieces]) if len(pieces) > 1 else pieces[0]

        layout = "panel_pairs" if into == torch.bfloat16 else "panels"  # (the same products, less widening)
        return native_pack.pack_rows(read, sum(e.dims[0] for e in entries), into, layout)

    def norm(name: str, n: int) -> torch.Tensor:
        return 1.0 + w(name, (n,), torch.float32)

    table = (a.vocab, a.hidden)
    formats = [fmt_of(f"layers.{i}.") for i in range(a.num_layers)]
    packed_bits = {f for f in formats if isinstance(f, int)}
    if a.tie_embeddings and packed_bits:
        # the layers read packed: so is the lm_head, a copy in their format (the widest, if they
        # differ; at real scale the head is a third of a step's bytes); the table stays exact
        entry(EMBED, table)
        embed = index.load(PREFIX + EMBED)  # (as stored: quantized a slice at a time)
        lm_head = native_pack.quantized_copy(embed, max(packed_bits))
        embed = embed.to(storage)
    elif a.tie_embeddings and storage is not None:  # the embedding rows read out of the packed lm_head: kept once
        lm_head = matrix([(EMBED, table)])
        embed = native_pack.PackedRows(lm_head)
    else:
        embed = w(EMBED, table)
        embed = embed.to(storage) if storage is not None else embed
        lm_head = embed if a.tie_embeddings else matrix([("lm_head.weight", table)], fmt_of("lm_head."))
    final_norm = norm("norm.weight", a.hidden)
    layers: list[LayerWeights] = []
    hd, nh, nkv = a.head_dim, a.num_heads, a.num_kv_heads
    kd, vd = a.lin_k_heads * a.lin_k_dim, a.lin_v_heads * a.lin_v_dim
    for i in range(a.num_layers):
        p, fmt = f"layers.{i}.", formats[i]
        if a.is_gdn(i):
            m = p + "linear_attn."
            conv = w(m + "conv1d.weight", (a.lin_conv_dim, 1, a.conv_kernel), torch.float32)[:, 0]
            mixer: AttnWeights | GdnWeights = GdnWeights(
                in_proj=matrix([(m + "in_proj_qkv.weight", (2 * kd + vd, a.hidden)),
                                (m + "in_proj_z.weight", (vd, a.hidden)),
                                (m + "in_proj_b.weight", (a.lin_v_heads, a.hidden)),
                                (m + "in_proj_a.weight", (a.lin_v_heads, a.hidden))], fmt),
                conv=conv.contiguous(),
                neg_a=-w(m + "A_log", (a.lin_v_heads,), torch.float32).exp(),
                dt_bias=w(m + "dt_bias", (a.lin_v_heads,), torch.float32),
                norm=w(m + "norm.weight", (a.lin_v_dim,), torch.float32),
                out=matrix([(m + "out_proj.weight", (a.hidden, vd))], fmt),
            )
        else:
            m = p + "self_attn."
            mixer = AttnWeights(
                qkv=matrix([(m + "q_proj.weight", (2 * nh * hd, a.hidden)),
                            (m + "k_proj.weight", (nkv * hd, a.hidden)),
                            (m + "v_proj.weight", (nkv * hd, a.hidden))], fmt),
                o=matrix([(m + "o_proj.weight", (a.hidden, nh * hd))], fmt),
                q_norm=norm(m + "q_norm.weight", hd),
                k_norm=norm(m + "k_norm.weight", hd),
            )
        moe = load_moe(matrix, index, PREFIX, p + "mlp.", a, expert_fmt) if a.is_moe(i) else None
        layers.append(LayerWeights(
            gdn=a.is_gdn(i),
            in_norm=norm(p + "input_layernorm.weight", a.hidden),
            post_norm=norm(p + "post_attention_layernorm.weight", a.hidden),
            mixer=mixer,
            gate_up=None if moe else matrix([(p + "mlp.gate_proj.weight", (a.intermediate, a.hidden)),
                                             (p + "mlp.up_proj.weight", (a.intermediate, a.hidden))], fmt),
            down=None if moe else matrix([(p + "mlp.down_proj.weight", (a.hidden, a.intermediate))], fmt),
            moe=moe,
        ))
    inv_freq = ops.rope_inv_freq(a.rotary_dim, a.rope_theta)
    if not on_cpu:  # once, at load: everything above was prepared on the host exactly as for the CPU
        embed = ops.to_device(embed, device)
        lm_head = embed if a.tie_embeddings else ops.to_device(lm_head, device)
        final_norm, inv_freq = ops.to_device(final_norm, device), ops.to_device(inv_freq, device)
        layers = [ops.to_device(layer, device) for layer in layers]
    weights = TrunkWeights(embed, lm_head, final_norm, layers, inv_freq)
    kv = kv_dtype(opts.kv_cache, device, dtype, {e.st_dtype for e in matrices.values()},
                  any(e.bits for e in matrices.values()))
    return Trunk(a, weights, dtype, device, kv, TorchTrunkStep if why else native_trunk.NativeTrunkStep, why)


def kv_dtype(choice: str, device: torch.device, dtype: torch.dtype, stored: set[str], quantized: bool) -> torch.dtype:
    """The attention layers' K/V cache dtype for OpenOptions.kv_cache. auto: on the CPU the
    checkpoint's own precision -- bf16 for bf16 matrices, a quantized install or bf16
    activations (transformers keeps its cache in the model's dtype, llama.cpp in f16), fp32
    for an fp32 checkpoint; fp32 on cuda (its step has not run a bf16 cache on a GPU)."""
    if choice != "auto":
        return getattr(torch, choice)
    own = torch.bfloat16 if dtype == torch.bfloat16 or quantized or stored == {"BF16"} else torch.float32
    return own if device.type == "cpu" else torch.float32


def moe_tensor_shapes(a: Arch, mlp: str) -> dict[str, tuple[int, ...]]:
    """Every tensor of the MoE block under `mlp` (e.g. "layers.3.mlp."), with the shape the
    config implies (the shared expert's only when it has a width)."""
    e_count, inter, shared, h = a.num_experts, a.moe_intermediate, a.shared_intermediate, a.hidden
    shapes = {mlp + "gate.weight": (e_count, h)}
    for e in range(e_count):
        x = f"{mlp}experts.{e}."
        shapes |= {x + "gate_proj.weight": (inter, h), x + "up_proj.weight": (inter, h),
                   x + "down_proj.weight": (h, inter)}
    if shared:
        x = mlp + "shared_expert."
        shapes |= {x + "gate_proj.weight": (shared, h), x + "up_proj.weight": (shared, h),
                   x + "down_proj.weight": (h, shared), mlp + "shared_expert_gate.weight": (1, h)}
    return shapes


def load_moe(matrix: Callable[..., object], index, prefix: str, mlp: str, a: Arch,
             expert_fmt: Callable[[list[str]], object]) -> MoeWeights:
    """One MoE block through `matrix(parts, fmt)` (the named tensors of the part under `prefix`,
    with their shapes, fused by rows into one matrix), the experts and the shared expert in the
    format `expert_fmt(names)` gives for all of them (int4 / int8 read packed where the native
    step can), the router and the shared expert's gate as floats; an expert past num_experts in
    the install is refused, as a missing one is by `matrix`."""
    extra = f"{prefix}{mlp}experts.{a.num_experts}.gate_proj.weight"
    if extra in index:
        raise TurboError(f"{extra}: the install has more experts than num_experts {a.num_experts} (config.json)")
    shapes = moe_tensor_shapes(a, mlp)

    fmt = expert_fmt([prefix + name for name in shapes if not _moe_gate(name)])

    def m(*names: str, gate: bool = False):
        return matrix([(mlp + n, shapes[mlp + n]) for n in names], None if gate else fmt)

    experts = range(a.num_experts)
    shared = a.shared_intermediate > 0
    return MoeWeights(
        router=m("gate.weight", gate=True),
        gate_up=[m(f"experts.{e}.gate_proj.weight", f"experts.{e}.up_proj.weight") for e in experts],
        down=[m(f"experts.{e}.down_proj.weight") for e in experts],
        shared_gate_up=m("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight") if shared else None,
        shared_down=m("shared_expert.down_proj.weight") if shared else None,
        shared_gate=m("shared_expert_gate.weight", gate=True) if shared else None,
    )


# ---- the drafters ---------------------------------------------------------------------------


def load_drafter(kind: str, install: Install, trunk: Trunk, window: int | None, opts: OpenOptions):
    """The install's own drafter of `kind` (dflash | mtp), ready for the engine (turbo.drafters.Drafter)."""
    if kind == "dflash":
        return load_dflash(install, trunk.embed, ops.dense(trunk.lm_head), window, opts, device=trunk.device)
    return load_mtp(install, trunk, opts.draft_products)


def _refuse_products(products: str, part: str, why: str) -> None:
    """Drafter-only products are the native pass's; the torch pass computes in fp32."""
    if products not in ("auto", "fp32"):
        raise TurboError(f"draft_products {products}: {part} is not in use ({why}); expected auto or fp32")


def load_dflash(install: Install, embed: torch.Tensor, lm_head: torch.Tensor, window: int | None = None,
                opts: OpenOptions = OpenOptions(), dtype: torch.dtype = torch.float32,
                scale: float = DFLASH_RESIDUAL_SCALE, device: torch.device | str = "cpu") -> DflashDrafter:
    """The install's DFlash drafter (DFlash2 or the published DFlash, as its config names)
    over the trunk's `embed` table and (dense) `lm_head`, in `dtype` activations on `device`;
    `window` its context (None: the trained sliding_window)."""
    if install.drafter_config is None:
        raise TurboError(f"{install.path}: no dflash/config.json (the install carries no DFlash drafter)")
    cfg = parse_drafter_config(install.drafter_config, install.arch, str(install.path / "dflash" / "config.json"))
    idx = install.index
    if cfg.has_conv:
        shape = derive_shape(idx, cfg.hidden, cfg.vocab, cfg.taps, cfg.group)
    else:
        shape = derive_published_shape(idx, cfg)
    for field, value, derived in (("num_attention_heads", cfg.heads, shape.num_heads),
                                  ("num_key_value_heads", cfg.kv_heads, shape.num_kv_heads),
                                  ("head_dim", cfg.head_dim, shape.head_dim),
                                  ("intermediate_size", cfg.intermediate, shape.inter)):
        if value != derived:
            raise TurboError(f"dflash/config.json: field {field!r} is {value}, the tensors' is {derived}")
    if shape.aux_count != len(cfg.target_layers):
        raise TurboError(f"dflash.fc.weight fuses {shape.aux_count} aux states, but field 'target_layer_ids' lists "
                         f"{len(cfg.target_layers)}")
    if cfg.has_selector and shape.rank != cfg.rank:
        raise TurboError(f"dflash/config.json: selector_rank is {cfg.rank}, the codebooks have rank {shape.rank}")
    if window is not None and not 1 <= window <= cfg.window:
        raise TurboError(f"window {window} is outside 1..{cfg.window} (the drafter's trained sliding_window)")
    device = torch.device(device)
    stored: set[str] = set()

    def t(name: str, as_dtype: torch.dtype = dtype) -> torch.Tensor:
        if as_dtype == dtype:
            stored.add(idx.need(name).st_dtype)
        return _to(idx.load(name, as_dtype), device)

    def norm(name: str) -> torch.Tensor:
        return _norm(idx, name, device)

    def conv(i: int, name: str) -> torch.Tensor | None:
        return t(dflash_layer_tensor(i, name)) if cfg.has_conv else None

    def selector(name: str) -> torch.Tensor | None:
        return t("dflash.candidate_selector." + name, torch.float32) if cfg.has_selector else None

    layers = []
    for i in range(shape.layers):
        def n(s: str) -> str:
            return dflash_layer_tensor(i, s)
        layers.append(DflashLayer(
            in_norm=norm(n("input_layernorm.weight")), post_norm=norm(n("post_attention_layernorm.weight")),
            q=t(n("self_attn.q_proj.weight")), k=t(n("self_attn.k_proj.weight")), v=t(n("self_attn.v_proj.weight")),
            o=t(n("self_attn.o_proj.weight")), q_norm=norm(n("self_attn.q_norm.weight")),
            k_norm=norm(n("self_attn.k_norm.weight")), gate=t(n("mlp.gate_proj.weight")),
            up=t(n("mlp.up_proj.weight")), down=t(n("mlp.down_proj.weight")),
            attn_proj=conv(i, "attention_conv.kernel_projection.weight"),
            attn_base=conv(i, "attention_conv.base_kernel"),
            mlp_proj=conv(i, "mlp_conv.kernel_projection.weight"), mlp_base=conv(i, "mlp_conv.base_kernel"),
        ))
    weights = DflashWeights(
        embed=embed, lm_head=lm_head.to(dtype), lm_head_bf16=lm_head.dtype == torch.bfloat16,
        fc=t("dflash.fc.weight"), hidden_norm=norm("dflash.hidden_norm.weight"), final_norm=norm("dflash.norm.weight"),
        hidden_projection=selector("hidden_projection.weight"), pred_codebook=selector("predecessor_codebook"),
        succ_codebook=selector("successor_codebook"),
        layers=layers, inv_freq=_to(ops.rope_inv_freq(cfg.head_dim, cfg.rope_theta), device), stored=stored)
    products = opts.draft_products
    why = _native_refusal(opts, native_dflash.dflash_refusal(device, dtype, embed))
    if why is None:
        layout = native_lib.draft_layout(products)

        def make_step(d: DflashDrafter) -> native_dflash.NativeDflashStep:
            return native_dflash.NativeDflashStep(d, layout)
    else:
        _refuse_products(products, "the drafter's native CPU pass", why)
        make_step = TorchDflashStep
    return DflashDrafter(cfg, shape, weights, window or cfg.window, dtype, scale, device, make_step, why)


def mtp_tensor_shapes(arch) -> dict[str, tuple[int, ...]]:
    """Every tensor the MTP head needs, with the shape the trunk's arch implies."""
    h, hd, nh, nkv, inter = arch.hidden, arch.head_dim, arch.num_heads, arch.num_kv_heads, arch.intermediate
    layer = MTP_PREFIX + "layers.0."
    return {
        MTP_PREFIX + "fc.weight": (h, 2 * h),
        MTP_PREFIX + "pre_fc_norm_embedding.weight": (h,),
        MTP_PREFIX + "pre_fc_norm_hidden.weight": (h,),
        MTP_PREFIX + "norm.weight": (h,),
        layer + "input_layernorm.weight": (h,),
        layer + "post_attention_layernorm.weight": (h,),
        layer + "self_attn.q_proj.weight": (2 * nh * hd, h),
        layer + "self_attn.k_proj.weight": (nkv * hd, h),
        layer + "self_attn.v_proj.weight": (nkv * hd, h),
        layer + "self_attn.o_proj.weight": (h, nh * hd),
        layer + "self_attn.q_norm.weight": (hd,),
        layer + "self_attn.k_norm.weight": (hd,),
    } | (moe_tensor_shapes(arch, layer + "mlp.") if arch.moe else {
        layer + "mlp.gate_proj.weight": (inter, h),
        layer + "mlp.up_proj.weight": (inter, h),
        layer + "mlp.down_proj.weight": (h, inter),
    })


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
    stored: set[str] = set()

    def w(name: str) -> torch.Tensor:
        stored.add(index.need(MTP_PREFIX + name).st_dtype)
        return _to(index.load(MTP_PREFIX + name, dtype), device)

    def norm(name: str) -> torch.Tensor:
        return _norm(index, MTP_PREFIX + name, device)

    p = "layers.0."
    a = p + "self_attn."
    weights = MtpWeights(
        fc=w("fc.weight"),
        norm_embedding=norm("pre_fc_norm_embedding.weight"),
        norm_hidden=norm("pre_fc_norm_hidden.weight"),
        final_norm=norm("norm.weight"),
        layer=LayerWeights(
            gdn=False,
            in_norm=norm(p + "input_layernorm.weight"),
            post_norm=norm(p + "post_attention_layernorm.weight"),
            mixer=AttnWeights(qkv=torch.cat([w(a + "q_proj.weight"), w(a + "k_proj.weight"), w(a + "v_proj.weight")]),
                              o=w(a + "o_proj.weight"), q_norm=norm(a + "q_norm.weight"),
                              k_norm=norm(a + "k_norm.weight")),
            gate_up=None if arch.moe else torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]),
            down=None if arch.moe else w(p + "mlp.down_proj.weight"),
            moe=load_moe(lambda parts, fmt: quant.fuse([w(name) for name, _ in parts]), index, MTP_PREFIX,
                         p + "mlp.", arch, lambda names: None) if arch.moe else None,
        ),
    )
    if trunk.step_name == "native":  # so is the head's layer (native.c's attn_layer + head)
        storage, layout = native_pack.storage_dtype(dtype, stored), native_lib.draft_layout(products)

        def make_step(head: MtpDrafter) -> native_trunk.NativeMtpStep:
            return native_trunk.NativeMtpStep(head, storage, layout)
    else:
        _refuse_products(products, "the MTP head's native CPU step", trunk.why_torch)
        make_step = TorchMtpStep
    return MtpDrafter(trunk, weights, make_step)
