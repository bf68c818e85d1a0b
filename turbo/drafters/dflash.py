"""The DFlash2 block-diffusion drafter (DESIGN 2.2), ported from the reference module.

Config and shapes are checked before anything is built: every field the forward needs
is required, and the tensors' recorded shapes are derived and cross-checked the way the
reference's `DflashShape::derive` does, with its messages.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import ops
from ..backends import native
from ..arch import Arch
from . import DrafterBase
from ..errors import TurboError
from ..install import Install, ResidentIndex

DFLASH_PREFIX = "dflash"
DFLASH_LAYERS = 5
DFLASH_AUX_LAYERS = (5, 19, 33, 47, 61)  # the published checkpoint's target layers (ours read the config)
DFLASH_RESIDUAL_SCALE = 8.0  # the draft pass divides its residual stream by this so it fits fp16
DFLASH_WINDOW = 2048
DFLASH_RING_SLACK = 128
DFLASH_MASK_TOKEN = 248_070  # the published drafter's; an install names its own in dflash_config
DFLASH_TOP_K = 16
DFLASH_TAPS = 2
DFLASH_GROUP_SIZE = 16


def dflash_layer_tensor(layer: int, suffix: str) -> str:
    return f"{DFLASH_PREFIX}.layers.{layer}.{suffix}"


@dataclass(frozen=True)
class DflashConfig:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    vocab: int
    window: int
    block_size: int
    mask_token: int
    target_layers: tuple[int, ...]
    taps: int
    group: int
    rank: int
    top_k: int
    rope_theta: float
    is_causal: bool


def _field(cfg: dict, key: str, kind, where: str):
    if key not in cfg or cfg[key] is None:
        raise TurboError(f"{where}: missing required field '{key}'")
    v = cfg[key]
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if not isinstance(v, kind) or (kind in (int, float) and isinstance(v, bool)):
        raise TurboError(f"{where}: field '{key}' is {v!r}, expected {kind.__name__}")
    return v


def parse_config(cfg: dict, arch: Arch, where: str = "dflash/config.json") -> DflashConfig:
    """The drafter config, refused by field name when missing or not honourable."""
    if cfg.get("architectures") != ["DFlash2DraftModel"]:
        raise TurboError(f"{where}: field 'architectures' is {cfg.get('architectures')!r}, expected ['DFlash2DraftModel']")
    d = _field(cfg, "dflash_config", dict, where)
    dw = f"{where} dflash_config"
    rope = _field(cfg, "rope_parameters", dict, where)
    c = DflashConfig(
        hidden=_field(cfg, "hidden_size", int, where),
        layers=_field(cfg, "num_hidden_layers", int, where),
        heads=_field(cfg, "num_attention_heads", int, where),
        kv_heads=_field(cfg, "num_key_value_heads", int, where),
        head_dim=_field(cfg, "head_dim", int, where),
        intermediate=_field(cfg, "intermediate_size", int, where),
        eps=_field(cfg, "rms_norm_eps", float, where),
        vocab=_field(cfg, "vocab_size", int, where),
        window=_field(cfg, "sliding_window", int, where),
        block_size=_field(d, "block_size", int, dw),
        mask_token=_field(d, "mask_token_id", int, dw),
        target_layers=tuple(_field(d, "target_layer_ids", list, dw)),
        taps=_field(d, "conv_kernel_size", int, dw),
        group=_field(d, "conv_group_size", int, dw),
        rank=_field(d, "selector_rank", int, dw),
        top_k=_field(d, "selector_top_k", int, dw),
        rope_theta=_field(rope, "rope_theta", float, f"{where} rope_parameters"),
        is_causal=_field(cfg, "is_causal", bool, where),
    )
    layer_types = _field(cfg, "layer_types", list, where)
    if len(layer_types) != c.layers or any(t != "sliding_attention" for t in layer_types):
        raise TurboError(f"{where}: field 'layer_types' is {layer_types!r}, expected {c.layers} x 'sliding_attention'")
    if c.hidden != arch.hidden:
        raise TurboError(f"{where}: field 'hidden_size' is {c.hidden}, expected the trunk's {arch.hidden}")
    if c.vocab != arch.vocab:
        raise TurboError(f"{where}: field 'vocab_size' is {c.vocab}, expected the trunk's {arch.vocab}")
    if c.taps != DFLASH_TAPS:
        raise TurboError(f"{dw}: field 'conv_kernel_size' is {c.taps}, expected {DFLASH_TAPS} (the taps this port runs)")
    if c.group <= 0 or c.hidden % c.group:
        raise TurboError(f"{dw}: field 'conv_group_size' is {c.group}, expected a divisor of hidden_size {c.hidden}")
    if c.top_k < 2:
        raise TurboError(f"{dw}: field 'selector_top_k' is {c.top_k}, expected at least 2")
    if c.block_size < 2:
        raise TurboError(f"{dw}: field 'block_size' is {c.block_size}, expected at least 2")
    if not c.target_layers:
        raise TurboError(f"{dw}: field 'target_layer_ids' is empty, expected trunk layer ids")
    for t in c.target_layers:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < arch.num_layers:
            raise TurboError(f"{dw}: field 'target_layer_ids' has {t!r}, expected ids in 0..{arch.num_layers - 1} "
                             f"(the trunk's layers)")
    if not 0 <= c.mask_token < arch.vocab:
        raise TurboError(f"{dw}: field 'mask_token_id' is {c.mask_token}, expected an id below vocab {arch.vocab}")
    if c.window <= 0:
        raise TurboError(f"{where}: field 'sliding_window' is {c.window}, expected a positive integer")
    for key in ("heads", "kv_heads", "head_dim", "intermediate", "rank"):
        if getattr(c, key) <= 0:
            raise TurboError(f"{where}: {key} is {getattr(c, key)}, expected a positive integer")
    return c


@dataclass(frozen=True)
class DflashShape:
    """The drafter's widths, derived from the recorded tensor shapes."""

    layers: int
    hidden: int
    head_dim: int
    num_heads: int
    num_kv_heads: int
    inter: int
    conv_rows: int
    rank: int
    aux_count: int


def derive_shape(index: ResidentIndex, hidden: int, vocab: int, taps: int = DFLASH_TAPS,
                 group: int = DFLASH_GROUP_SIZE) -> DflashShape:
    """Port of the reference's `DflashShape::derive`: same checks, same messages."""

    def shape_of(name: str) -> tuple[int, int]:
        e = index.need(name)
        return e.shape[0], e.shape[1]

    def expect(name: str, rows: int, cols: int) -> None:
        got = shape_of(name)
        if got != (rows, cols):
            raise TurboError(f"{name} has shape [{got[0]}, {got[1]}], expected [{rows}, {cols}]")

    def expect_vector(name: str, rows: int) -> None:
        # A rank-1 tensor is recorded as (n, 0): 0 is the only legal second width.
        got = shape_of(name)
        if got[0] != rows or got[1] != 0:
            raise TurboError(f"{name} has shape [{got[0]}, {got[1]}], expected a [{rows}] vector")

    head_dim = shape_of(dflash_layer_tensor(0, "self_attn.q_norm.weight"))[0]
    q_rows, _ = shape_of(dflash_layer_tensor(0, "self_attn.q_proj.weight"))
    k_rows, _ = shape_of(dflash_layer_tensor(0, "self_attn.k_proj.weight"))
    gate_rows, _ = shape_of(dflash_layer_tensor(0, "mlp.gate_proj.weight"))
    pred_rows, rank = shape_of("dflash.candidate_selector.predecessor_codebook")
    succ_rows, succ_rank = shape_of("dflash.candidate_selector.successor_codebook")
    if rank == 0 or rank > hidden or pred_rows != vocab or succ_rows != vocab or succ_rank != rank:
        raise TurboError(f"dflash candidate selector codebook shape mismatch: pred [{pred_rows}, {rank}], "
                         f"succ [{succ_rows}, {succ_rank}], expected [{vocab}, {rank}]")
    fc_rows, fc_cols = shape_of("dflash.fc.weight")
    layers = 0
    while dflash_layer_tensor(layers, "input_layernorm.weight") in index:
        layers += 1
    if layers != DFLASH_LAYERS or dflash_layer_tensor(layers, "input_layernorm.weight") in index:
        raise TurboError(f"the DFlash2 drafter has {layers} contiguous layers, expected {DFLASH_LAYERS}")
    if head_dim == 0 or q_rows % head_dim or k_rows % head_dim:
        raise TurboError(f"the DFlash2 drafter's shapes do not divide: q {q_rows}, k {k_rows}, head_dim {head_dim}")
    aux_count = fc_cols // hidden
    if aux_count * hidden != fc_cols or aux_count == 0:
        raise TurboError(f"dflash.fc.weight is [{fc_rows}, {fc_cols}], not a whole number of {hidden}-wide aux states")
    if q_rows > hidden or k_rows > hidden or gate_rows > 4 * hidden:
        raise TurboError(f"the DFlash2 drafter widths exceed their allocation bounds: q {q_rows}, k {k_rows}, "
                         f"ffn {gate_rows}, hidden {hidden}")
    expect("dflash.fc.weight", hidden, aux_count * hidden)
    expect_vector("dflash.hidden_norm.weight", hidden)
    expect_vector("dflash.norm.weight", hidden)
    expect("dflash.candidate_selector.hidden_projection.weight", rank, hidden)
    for layer in range(layers):
        def name(suffix: str) -> str:
            return dflash_layer_tensor(layer, suffix)
        expect_vector(name("input_layernorm.weight"), hidden)
        expect_vector(name("post_attention_layernorm.weight"), hidden)
        expect_vector(name("self_attn.q_norm.weight"), head_dim)
        expect_vector(name("self_attn.k_norm.weight"), head_dim)
        expect(name("self_attn.q_proj.weight"), q_rows, hidden)
        expect(name("self_attn.k_proj.weight"), k_rows, hidden)
        expect(name("self_attn.v_proj.weight"), k_rows, hidden)
        expect(name("self_attn.o_proj.weight"), hidden, q_rows)
        expect(name("mlp.gate_proj.weight"), gate_rows, hidden)
        expect(name("mlp.up_proj.weight"), gate_rows, hidden)
        expect(name("mlp.down_proj.weight"), hidden, gate_rows)
    conv_rows = 2 * taps * (hidden // group)
    proj_rows, _ = shape_of(dflash_layer_tensor(0, "attention_conv.kernel_projection.weight"))
    if proj_rows != conv_rows:
        raise TurboError(f"attention_conv.kernel_projection.weight has {proj_rows} rows against the {conv_rows} this "
                         f"port's conv dispatches (2 sides x {taps} taps x {hidden}/{group} groups); this drafter's "
                         f"conv shape is not the published one")
    for layer in range(layers):
        for stem in ("attention_conv", "mlp_conv"):
            expect(dflash_layer_tensor(layer, f"{stem}.kernel_projection.weight"), conv_rows, hidden)
            base = index.need(dflash_layer_tensor(layer, f"{stem}.base_kernel"))
            if base.shape != (2, taps, hidden, 0):
                raise TurboError(f"{DFLASH_PREFIX}.layers.{layer}.{stem}.base_kernel has shape {list(base.shape)}, "
                                 f"expected [2, {taps}, {hidden}]")
    return DflashShape(layers, hidden, head_dim, q_rows // head_dim, k_rows // head_dim, gate_rows, conv_rows,
                       rank, aux_count)


# ---- the math (the CPU kernels; the CUDA ones are tested against these) -------------------


def grouped_conv(h: torch.Tensor, base: torch.Tensor, dyn: torch.Tensor, group: int) -> torch.Tensor:
    """out[t, c] = sum_o (base[o, c] + dyn[t, o, c // group]) * h[t - o, c], h[<0] = 0.
    h [rows, H]; base [taps, H]; dyn [rows, taps, groups]."""
    kernel = base[None] + dyn.repeat_interleave(group, dim=-1)
    out = kernel[:, 0] * h
    for o in range(1, base.shape[0]):
        out = out + F.pad(kernel[o:, o] * h[:h.shape[0] - o], (0, 0, o, 0))
    return out


def select_candidates(logits: torch.Tensor, final: torch.Tensor, anchor: int, hidden_projection: torch.Tensor,
                      pred_codebook: torch.Tensor, succ_codebook: torch.Tensor, top_k: int) -> list[int]:
    """Greedy bigram rescoring of each row's top-k (fp32); ties go to the lower token id."""
    logits, final = logits.float(), final.float()
    cand = torch.topk(logits, top_k, dim=-1).indices
    proj = final @ hidden_projection.float().T
    pred, out = anchor, []
    for i in range(logits.shape[0]):
        c = cand[i]
        score = logits[i, c] + (succ_codebook[c].float() @ (pred_codebook[pred].float() * proj[i]))
        best = score.max()
        pred = int(c[score == best].min())
        out.append(pred)
    return out


# native_dflash.c's dflash_select keeps at most this many candidates per row.
SELECT_MAX_K = 64

# The layer matrices native_dflash.c reads packed.
NATIVE_MATRICES = ("q", "k", "v", "o", "gate", "up", "down", "attn_proj", "mlp_proj")


@dataclass
class DflashLayer:
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    q: torch.Tensor | native.Packed  # matrices: Packed when the native pass runs (NATIVE_MATRICES)
    k: torch.Tensor | native.Packed
    v: torch.Tensor | native.Packed
    o: torch.Tensor | native.Packed
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    gate: torch.Tensor | native.Packed
    up: torch.Tensor | native.Packed
    down: torch.Tensor | native.Packed
    attn_proj: torch.Tensor | native.Packed
    attn_base: torch.Tensor  # [2, taps, H]
    mlp_proj: torch.Tensor | native.Packed
    mlp_base: torch.Tensor


class NativeLayer(ctypes.Structure):
    """native_dflash.c's DfLayer: one layer's fp32 weights and its context ring (pointers)."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "in_norm", "post_norm", "q_norm", "k_norm", "q", "k", "v", "o", "gate", "up", "down",
        "attn_proj", "mlp_proj", "attn_base", "mlp_base", "ring_k", "ring_v")]


class NativeDrafter(ctypes.Structure):
    """native_dflash.c's Dflash: the drafter's sizes, scaling and fp32 weights (pointers)."""

    _fields_ = [(name, ctypes.c_int) for name in (
        "hidden", "heads", "kv_heads", "head_dim", "inter", "taps", "group", "aux_width", "vocab", "layers",
        "window", "capacity", "causal", "mask_token", "embed_wtype", "embed_panels", "wtype", "lm_wtype")] + [
        ("eps", ctypes.c_float), ("res_eps", ctypes.c_float), ("scale", ctypes.c_float)] + [
        (name, ctypes.c_void_p) for name in ("embed", "fc", "lm_head", "hidden_norm", "final_norm", "inv_freq")] + [
        ("layer", ctypes.POINTER(NativeLayer))]


class DflashDrafter(DrafterBase):
    """Proposes B tokens in one pass from the trunk's aux-layer context.

    `scale` = DFLASH_RESIDUAL_SCALE runs the reference's fp16-safe scaled residual stream
    (identical to scale 1 in exact arithmetic); `dtype` is the activation dtype; `device`
    where the weights (moved once, at load), the ring and the draft pass live -- on cuda the
    grouped conv and the candidate selector run the PTX kernels. On the CPU in fp32 the pass
    and the context rows run in native_dflash.c when the native library is in use; the torch
    code below is the reference it is tested against and the fallback. `products` picks
    the native pass's matrix products (native.draft_layout): "fp32" computes the torch
    pass's function (to rounding); "int8" (weights per output, inputs per row) and "bf16"
    read fewer bytes and do more multiply-adds per instruction; "auto" the fastest the CPU
    has. The trunk checks every proposal: the drafter's precision moves acceptance, never
    the output."""

    kind = "dflash"

    def __init__(self, install: Install, embed: torch.Tensor, lm_head: torch.Tensor, window: int | None = None,
                 dtype: torch.dtype = torch.float32, scale: float = DFLASH_RESIDUAL_SCALE,
                 device: torch.device | str = "cpu", products: str = "auto"):
        if install.drafter_config is None:
            raise TurboError(f"{install.path}: no dflash/config.json (the install carries no DFlash2 drafter)")
        cfg = parse_config(install.drafter_config, install.arch, str(install.path / "dflash" / "config.json"))
        shape = derive_shape(install.index, cfg.hidden, cfg.vocab, cfg.taps, cfg.group)
        if (shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.inter) != (
                cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.intermediate):
            raise TurboError(f"dflash/config.json: heads {cfg.heads}, kv heads {cfg.kv_heads}, head_dim {cfg.head_dim}, "
                             f"intermediate {cfg.intermediate} disagree with the tensors' {shape.num_heads}, "
                             f"{shape.num_kv_heads}, {shape.head_dim}, {shape.inter}")
        if shape.aux_count != len(cfg.target_layers):
            raise TurboError(f"dflash.fc.weight fuses {shape.aux_count} aux states, but target_layer_ids lists "
                             f"{len(cfg.target_layers)}")
        if shape.rank != cfg.rank:
            raise TurboError(f"dflash/config.json: selector_rank is {cfg.rank}, the codebooks have rank {shape.rank}")
        if window is not None and not 1 <= window <= cfg.window:
            raise TurboError(f"window {window} is outside 1..{cfg.window} (the drafter's trained sliding_window)")
        self.cfg, self.shape = cfg, shape
        self.window = window or cfg.window
        self.block_size = cfg.block_size
        self.aux_layers = tuple(cfg.target_layers)
        self.dtype, self.scale = dtype, scale
        self.device = dev = torch.device(device)
        self.products = products
        idx = install.index

        self.stored: set[str] = set()  # how the weights loaded in `dtype` are stored (_native_drafter)

        def t(name: str, as_dtype: torch.dtype = dtype) -> torch.Tensor:
            if as_dtype == dtype:
                self.stored.add(idx.need(name).st_dtype)
            w = idx.load(name, as_dtype)
            return w if dev.type == "cpu" else w.to(dev)

        def norm(name: str) -> torch.Tensor:
            w = 1.0 + idx.load(name, torch.float32)  # computed on the host, as on the CPU
            return w if dev.type == "cpu" else w.to(dev)

        self.embed, self.lm_head = embed, lm_head.to(dtype)  # rows enter scaled, then in dtype (the trunk's device)
        self.lm_head_bf16 = lm_head.dtype == torch.bfloat16  # (the trunk keeps a bf16 checkpoint's)
        self.fc = t("dflash.fc.weight")
        self.hidden_norm = norm("dflash.hidden_norm.weight")
        self.final_norm = norm("dflash.norm.weight")
        self.hidden_projection = t("dflash.candidate_selector.hidden_projection.weight", torch.float32)
        self.pred_codebook = t("dflash.candidate_selector.predecessor_codebook", torch.float32)
        self.succ_codebook = t("dflash.candidate_selector.successor_codebook", torch.float32)
        self.layers = []
        for l in range(shape.layers):
            def n(s: str) -> str:
                return dflash_layer_tensor(l, s)
            self.layers.append(DflashLayer(
                in_norm=norm(n("input_layernorm.weight")), post_norm=norm(n("post_attention_layernorm.weight")),
                q=t(n("self_attn.q_proj.weight")), k=t(n("self_attn.k_proj.weight")), v=t(n("self_attn.v_proj.weight")),
                o=t(n("self_attn.o_proj.weight")), q_norm=norm(n("self_attn.q_norm.weight")),
                k_norm=norm(n("self_attn.k_norm.weight")), gate=t(n("mlp.gate_proj.weight")),
                up=t(n("mlp.up_proj.weight")), down=t(n("mlp.down_proj.weight")),
                attn_proj=t(n("attention_conv.kernel_projection.weight")), attn_base=t(n("attention_conv.base_kernel")),
                mlp_proj=t(n("mlp_conv.kernel_projection.weight")), mlp_base=t(n("mlp_conv.base_kernel")),
            ))
        self.inv_freq = ops.rope_inv_freq(cfg.head_dim, cfg.rope_theta)
        if dev.type != "cpu":
            self.inv_freq = self.inv_freq.to(dev)
        self.native, self.native_layers = self._native_drafter()
        self.reset()

    def _native_drafter(self) -> tuple[NativeDrafter | None, ctypes.Array | None]:
        """native_dflash.c's structs (the rings are bound by `reset`), when the pass can run
        there: on the CPU, fp32 activations, a plain fp32 or bf16 embedding table."""
        plain_table = isinstance(self.embed, torch.Tensor) and self.embed.is_contiguous()
        if (self.device.type != "cpu" or self.dtype != torch.float32 or native.library() is None
                or not (plain_table or isinstance(self.embed, native.PackedRows))
                or self.embed.dtype not in native.WTYPES):
            if self.products not in ("auto", "fp32"):
                why = native.why_not() or (f"the drafter runs on {self.device.type}" if self.device.type != "cpu"
                                           else f"activations are {str(self.dtype).removeprefix('torch.')}")
                raise TurboError(f"draft_products {self.products}: the drafter's native CPU pass is not in use "
                                 f"({why}); expected auto or fp32")
            return None, None
        # native_dflash.c multiplies by packed matrices (native.c's layout); packed in place,
        # as the trunk's are: from here on the torch pass is not used, and memory is not doubled.
        # A bf16 drafter's stay bf16 (widened exactly in the product: the same values, half the bytes).
        storage = native.storage_dtype(self.dtype, self.stored)
        lm_storage = torch.bfloat16 if self.lm_head_bf16 else torch.float32
        layout = native.draft_layout(self.products)
        for l in self.layers:
            for name in NATIVE_MATRICES:
                setattr(l, name, native.pack_as(getattr(l, name), storage, layout))
        self.fc = native.pack_as(self.fc, storage, layout)
        self.lm_head = native.pack_as(self.lm_head, lm_storage, layout)
        cfg, shape, ptr = self.cfg, self.shape, native.ptr
        embed, embed_wtype, embed_panels = native.table_of(self.embed)
        layers = (NativeLayer * len(self.layers))(*(NativeLayer(
            in_norm=ptr(l.in_norm), post_norm=ptr(l.post_norm), q_norm=ptr(l.q_norm), k_norm=ptr(l.k_norm),
            q=ptr(l.q), k=ptr(l.k), v=ptr(l.v), o=ptr(l.o), gate=ptr(l.gate), up=ptr(l.up), down=ptr(l.down),
            attn_proj=ptr(l.attn_proj), mlp_proj=ptr(l.mlp_proj), attn_base=ptr(l.attn_base),
            mlp_base=ptr(l.mlp_base)) for l in self.layers))
        d = NativeDrafter(
            hidden=shape.hidden, heads=shape.num_heads, kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
            inter=shape.inter, taps=cfg.taps, group=cfg.group, aux_width=self.fc.shape[1], vocab=cfg.vocab,
            layers=len(self.layers), window=self.window, causal=cfg.is_causal, mask_token=cfg.mask_token,
            embed_wtype=embed_wtype, embed_panels=embed_panels, wtype=self.fc.wtype, lm_wtype=self.lm_head.wtype,
            eps=cfg.eps, res_eps=cfg.eps / (self.scale * self.scale),
            scale=self.scale, embed=embed, fc=ptr(self.fc), hidden_norm=ptr(self.hidden_norm),
            final_norm=ptr(self.final_norm), lm_head=ptr(self.lm_head), inv_freq=ptr(self.inv_freq),
            layer=layers)
        return d, layers

    # ---- context ring ------------------------------------------------------------------

    def reset(self, capacity: int | None = None) -> None:
        cap = capacity or self.window + DFLASH_RING_SLACK
        kv, d = self.shape.num_kv_heads, self.shape.head_dim
        self.capacity = cap
        self.ring_k = [torch.zeros(cap, kv, d, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.ring_v = [torch.zeros(cap, kv, d, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.context = 0  # context positions added so far (positions 0..context-1)
        if self.native is not None:
            self.native.capacity = cap
            for layer, rk, rv in zip(self.native_layers, self.ring_k, self.ring_v):
                layer.ring_k, layer.ring_v = native.ptr(rk), native.ptr(rv)

    def add_context(self, aux: torch.Tensor) -> None:
        """Committed rows' fused aux states, in position order from `self.context`."""
        n = aux.shape[0]
        if n == 0:
            return
        if self.native is not None:
            if aux.shape[1:] != (self.native.aux_width,):  # C reads what it is given: shapes are checked here
                raise ValueError(f"aux rows are {list(aux.shape[1:])} wide, the drafter fuses {self.native.aux_width}")
            aux = aux.float().contiguous()
            native.threaded().dflash_add_context(ctypes.addressof(self.native), aux.data_ptr(), n, self.context)
            self.context += n
            return
        ctx = ops.rms_norm(self._lin(aux, self.fc), self.hidden_norm, self.cfg.eps).to(self.dtype)
        positions = torch.arange(self.context, self.context + n, device=self.device)
        cos, sin = ops.rope_cos_sin(positions, self.inv_freq)
        slots = positions % self.capacity
        kv, d = self.shape.num_kv_heads, self.shape.head_dim
        for layer, rk, rv in zip(self.layers, self.ring_k, self.ring_v):
            k = ops.rms_norm(self._lin(ctx, layer.k).reshape(n, kv, d), layer.k_norm, self.cfg.eps)
            rk[slots] = ops.apply_rope(k, cos, sin).to(self.dtype)
            rv[slots] = self._lin(ctx, layer.v).reshape(n, kv, d).to(self.dtype)
        self.context += n

    def _lin(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(w.dtype), w)

    # ---- the draft pass ----------------------------------------------------------------

    def _conv_prepare(self, x: torch.Tensor, proj: torch.Tensor, base: torch.Tensor):
        rows = x.shape[0]
        groups = self.shape.hidden // self.cfg.group
        dyn = self._lin(x, proj).reshape(rows, 2, self.cfg.taps, groups)
        return self._grouped_conv(x, base[0], dyn[:, 0]), dyn[:, 1]

    def _conv_finish(self, y: torch.Tensor, dyn: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        return self._grouped_conv(y, base[1], dyn)

    def _grouped_conv(self, h: torch.Tensor, base: torch.Tensor, dyn: torch.Tensor) -> torch.Tensor:
        cb = ops.cuda_kernels(h)
        if cb is not None:  # dflash.cu (fp32), back in the activation dtype
            return cb.grouped_conv(h, base, dyn, self.cfg.group).to(h.dtype)
        return grouped_conv(h, base, dyn, self.cfg.group)

    def _attention(self, li: int, u: torch.Tensor, anchor_pos: int) -> torch.Tensor:
        layer = self.layers[li]
        rows = u.shape[0]
        h, kv, d = self.shape.num_heads, self.shape.num_kv_heads, self.shape.head_dim
        cos, sin = ops.rope_cos_sin(torch.arange(anchor_pos, anchor_pos + rows, device=self.device), self.inv_freq)
        q = ops.apply_rope(ops.rms_norm(self._lin(u, layer.q).reshape(rows, h, d), layer.q_norm, self.cfg.eps), cos, sin)
        k = ops.apply_rope(ops.rms_norm(self._lin(u, layer.k).reshape(rows, kv, d), layer.k_norm, self.cfg.eps), cos, sin)
        v = self._lin(u, layer.v).reshape(rows, kv, d).float()
        lo = max(0, anchor_pos - self.window)
        slots = torch.arange(lo, anchor_pos, device=self.device) % self.capacity
        keys = torch.cat([self.ring_k[li][slots].float(), k])  # [ctx + rows, kv, d]
        values = torch.cat([self.ring_v[li][slots].float(), v])
        rep = h // kv
        keys, values = keys.repeat_interleave(rep, 1).transpose(0, 1), values.repeat_interleave(rep, 1).transpose(0, 1)
        mask = None
        if self.cfg.is_causal:
            ctx = slots.shape[0]
            mask = torch.ones(rows, ctx + rows, dtype=torch.bool, device=self.device).tril(ctx)
        att = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask)
        return self._lin(att.transpose(0, 1).reshape(rows, h * d), layer.o)

    def forward_block(self, anchor: int, anchor_pos: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [block, vocab] and final hidden [block, H] of the proposal rows."""
        if anchor_pos != self.context:
            raise ValueError(f"drafter context has {self.context} positions, the anchor sits at {anchor_pos}")
        if self.native is not None:
            if not 0 <= anchor < self.cfg.vocab:
                raise ValueError(f"anchor {anchor} is not a token id in 0..{self.cfg.vocab - 1}")
            logits, final = torch.empty(block, self.cfg.vocab), torch.empty(block, self.shape.hidden)
            native.threaded().dflash_forward(ctypes.addressof(self.native), anchor, anchor_pos, block,
                                             logits.data_ptr(), final.data_ptr())
            return logits, final
        s = self.scale
        eps = self.cfg.eps / (s * s)  # norms reading the scaled stream compute the unscaled norm
        tokens = torch.tensor([anchor] + [self.cfg.mask_token] * block, device=self.device)
        x = (self.embed[tokens].float() / s).to(self.dtype)
        for li, layer in enumerate(self.layers):
            xn = ops.rms_norm(x, layer.in_norm, eps).to(self.dtype)
            u, dyn = self._conv_prepare(xn, layer.attn_proj, layer.attn_base)
            y = self._conv_finish(self._attention(li, u, anchor_pos).to(self.dtype), dyn, layer.attn_base)
            x = x + y / s
            xn = ops.rms_norm(x, layer.post_norm, eps).to(self.dtype)
            u, dyn = self._conv_prepare(xn, layer.mlp_proj, layer.mlp_base)
            y = self._lin(F.silu(self._lin(u, layer.gate)) * self._lin(u, layer.up), layer.down)
            x = x + self._conv_finish(y, dyn, layer.mlp_base) / s
        final = ops.rms_norm(x, self.final_norm, eps)[1:]
        return self._lin(final, self.lm_head).float(), final

    def propose(self, anchor: int, anchor_pos: int, block: int) -> list[int]:
        logits, final = self.forward_block(anchor, anchor_pos, block)
        top_k = min(self.cfg.top_k, logits.shape[-1])
        if self.native is not None and top_k <= SELECT_MAX_K:  # native_dflash.c: the same selection, one call
            out = (ctypes.c_int * block)()
            native.threaded().dflash_select(
                logits.data_ptr(), final.data_ptr(), block, logits.shape[1], final.shape[1],
                self.hidden_projection.data_ptr(), self.hidden_projection.shape[0], self.pred_codebook.data_ptr(),
                self.succ_codebook.data_ptr(), top_k, anchor, out)
            return list(out)
        cb = ops.cuda_kernels(logits)
        select = cb.select_candidates if cb is not None and top_k <= cb.SEL_MAX_K else select_candidates
        return select(logits, final, anchor, self.hidden_projection, self.pred_codebook, self.succ_codebook, top_k)

    # ---- the engine's hooks ------------------------------------------------------------

    def begin(self, prompt_out, tokens: list[int] | None = None) -> None:
        """A new generation: the prompt's aux states (all but the last token) become the context."""
        self.reset(self.capacity)
        if prompt_out is not None:
            self.add_context(prompt_out.aux)

    def commit(self, out, kept: int) -> None:
        self.add_context(out.aux[:kept])

    def defer(self, out, kept: int) -> torch.Tensor:
        # the aux rows are all it reads: holding a plain round's whole output (its logits)
        # through a plain stretch costs a plain round ~8% (fresh memory every step)
        return out.aux[:kept].clone()

    def commit_deferred(self, items: list[torch.Tensor]) -> None:
        if items:
            self.add_context(torch.cat(items))
