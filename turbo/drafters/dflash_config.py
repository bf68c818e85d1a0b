"""The DFlash2 drafter's config and tensor shapes, checked before anything is built
(docs/DESIGN.md 2.2): every field the forward needs is required, and the tensors' recorded
shapes are derived and cross-checked the way the Rust original's `DflashShape::derive`
does, with its messages (every shape compared in full).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..arch import Arch, need_eps, need_field, need_positive, need_rope_theta, show
from ..errors import TurboError
from ..install import ResidentIndex

DFLASH_PREFIX = "dflash"
DFLASH_LAYERS = 5
DFLASH_TAPS = 2
DFLASH_GROUP_SIZE = 16
# The context ring is allocated whole when the drafter loads (window rows per layer, K and V):
# published drafters train a few thousand rows; past this a typo would allocate gigabytes.
DFLASH_MAX_WINDOW = 1 << 16
# A diffusion block is a handful of positions (published drafters train 8 or 16).
DFLASH_MAX_BLOCK = 1 << 10


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


def parse_config(cfg: dict, arch: Arch, where: str = "dflash/config.json") -> DflashConfig:
    """The drafter config, refused by field name when missing, of another type, out of range or
    inconsistent with itself or the trunk."""
    if cfg.get("architectures") != ["DFlash2DraftModel"]:
        raise TurboError(f"{where}: field 'architectures' is {show(cfg.get('architectures'))}, "
                         "expected ['DFlash2DraftModel']")
    d = need_field(cfg, "dflash_config", dict, where)
    dw = f"{where} dflash_config"
    rope = need_field(cfg, "rope_parameters", dict, where)
    c = DflashConfig(
        hidden=need_positive(cfg, "hidden_size", where),
        layers=need_positive(cfg, "num_hidden_layers", where),
        heads=need_positive(cfg, "num_attention_heads", where),
        kv_heads=need_positive(cfg, "num_key_value_heads", where),
        head_dim=need_positive(cfg, "head_dim", where),
        intermediate=need_positive(cfg, "intermediate_size", where),
        eps=need_eps(cfg, "rms_norm_eps", where),
        vocab=need_positive(cfg, "vocab_size", where),
        window=need_positive(cfg, "sliding_window", where, min(arch.max_positions, DFLASH_MAX_WINDOW),
                             " (the trunk's max_position_embeddings, or the context ring's cap "
                             f"{DFLASH_MAX_WINDOW})"),
        block_size=need_positive(d, "block_size", dw, DFLASH_MAX_BLOCK, " (no drafter trains a wider block)"),
        mask_token=need_field(d, "mask_token_id", int, dw),
        target_layers=tuple(need_field(d, "target_layer_ids", list, dw)),
        taps=need_field(d, "conv_kernel_size", int, dw),
        group=need_field(d, "conv_group_size", int, dw),
        rank=need_positive(d, "selector_rank", dw),
        top_k=need_field(d, "selector_top_k", int, dw),
        rope_theta=need_rope_theta(rope, f"{where} rope_parameters"),
        is_causal=need_field(cfg, "is_causal", bool, where),
    )
    layer_types = need_field(cfg, "layer_types", list, where)
    if len(layer_types) != c.layers or any(t != "sliding_attention" for t in layer_types):
        raise TurboError(f"{where}: field 'layer_types' is {show(layer_types)}, expected {c.layers} x 'sliding_attention'")
    if c.layers != DFLASH_LAYERS:
        raise TurboError(f"{where}: field 'num_hidden_layers' is {c.layers}, expected {DFLASH_LAYERS} (the layers "
                         "this port runs)")
    if c.hidden != arch.hidden:
        raise TurboError(f"{where}: field 'hidden_size' is {c.hidden}, expected the trunk's {arch.hidden}")
    if c.vocab != arch.vocab:
        raise TurboError(f"{where}: field 'vocab_size' is {c.vocab}, expected the trunk's {arch.vocab}")
    if c.heads % c.kv_heads:
        raise TurboError(f"{where}: num_attention_heads {c.heads} is not a multiple of num_key_value_heads "
                         f"{c.kv_heads}")
    if c.head_dim % 2:
        raise TurboError(f"{where}: field 'head_dim' is {c.head_dim}, expected an even number (RoPE rotates pairs)")
    if c.taps != DFLASH_TAPS:
        raise TurboError(f"{dw}: field 'conv_kernel_size' is {c.taps}, expected {DFLASH_TAPS} (the taps this port runs)")
    if c.group <= 0 or c.hidden % c.group:
        raise TurboError(f"{dw}: field 'conv_group_size' is {c.group}, expected a divisor of hidden_size {c.hidden}")
    if not 2 <= c.top_k <= c.vocab:
        raise TurboError(f"{dw}: field 'selector_top_k' is {c.top_k}, expected 2..{c.vocab} (the vocab)")
    if c.block_size < 2:
        raise TurboError(f"{dw}: field 'block_size' is {c.block_size}, expected at least 2")
    if not c.target_layers:
        raise TurboError(f"{dw}: field 'target_layer_ids' is empty, expected trunk layer ids")
    for t in c.target_layers:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < arch.num_layers:
            raise TurboError(f"{dw}: field 'target_layer_ids' has {show(t)}, expected ids in 0..{arch.num_layers - 1} "
                             f"(the trunk's layers)")
    if len(set(c.target_layers)) != len(c.target_layers):
        raise TurboError(f"{dw}: field 'target_layer_ids' is {list(c.target_layers)}, expected distinct layer ids")
    if not 0 <= c.mask_token < arch.vocab:
        raise TurboError(f"{dw}: field 'mask_token_id' is {c.mask_token}, expected an id below vocab {arch.vocab}")
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
    """The Rust original's `DflashShape::derive`: the same checks and messages."""

    def dims(name: str) -> tuple[int, ...]:
        return index.need(name).dims

    def shape_of(name: str) -> tuple[int, int]:
        """The first two widths (0 where the tensor has fewer), to derive from: every
        tensor is then compared in full (`expect`), so no extra or missing dim slips by."""
        d = dims(name) + (0, 0)
        return d[0], d[1]

    def expect(name: str, *want: int) -> None:
        got = dims(name)
        if got != want:
            raise TurboError(f"{name} has shape {list(got)}, expected {list(want)}")

    def expect_vector(name: str, rows: int) -> None:
        got = dims(name)
        if got != (rows,):
            raise TurboError(f"{name} has shape {list(got)}, expected a [{rows}] vector")

    head_dim = shape_of(dflash_layer_tensor(0, "self_attn.q_norm.weight"))[0]
    q_rows, _ = shape_of(dflash_layer_tensor(0, "self_attn.q_proj.weight"))
    k_rows, _ = shape_of(dflash_layer_tensor(0, "self_attn.k_proj.weight"))
    gate_rows, _ = shape_of(dflash_layer_tensor(0, "mlp.gate_proj.weight"))
    pred_rows, rank = shape_of("dflash.candidate_selector.predecessor_codebook")
    succ_rows, succ_rank = shape_of("dflash.candidate_selector.successor_codebook")
    if rank == 0 or rank > hidden or pred_rows != vocab or succ_rows != vocab or succ_rank != rank:
        raise TurboError(f"dflash candidate selector codebook shape mismatch: pred [{pred_rows}, {rank}], "
                         f"succ [{succ_rows}, {succ_rank}], expected [{vocab}, {rank}]")
    expect("dflash.candidate_selector.predecessor_codebook", vocab, rank)
    expect("dflash.candidate_selector.successor_codebook", vocab, rank)
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
            expect(dflash_layer_tensor(layer, f"{stem}.base_kernel"), 2, taps, hidden)
    return DflashShape(layers, hidden, head_dim, q_rows // head_dim, k_rows // head_dim, gate_rows, conv_rows,
                       rank, aux_count)
