"""The DFlash drafters' config and tensor shapes, checked before anything is built
(docs/DESIGN.md 2.2): every field the forward needs is required, and the tensors' recorded
shapes are derived and cross-checked the way the Rust original's `DflashShape::derive`
does, with its messages (every shape compared in full).

Two architectures, named by the drafter config's `architectures`: DFlash2 (grouped conv
around every sublayer, candidate selector) and the published DFlash the Qwen3.5 drafters
ship as (`DFlashDraftModel`: neither; proposals are the argmax of the trunk's lm_head).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import TurboError
from ..store.arch import Arch, need_eps, need_field, need_positive, need_rope_theta, show
from ..store.install import ResidentIndex

DFLASH_PREFIX = "dflash"
DFLASH_LAYERS = 5
DFLASH_TAPS = 2
DFLASH_GROUP_SIZE = 16
DFLASH2_ARCH = "DFlash2DraftModel"
PUBLISHED_ARCH = "DFlashDraftModel"
ARCHITECTURES = (DFLASH2_ARCH, PUBLISHED_ARCH)
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
    architecture: str = DFLASH2_ARCH

    @property
    def has_conv(self) -> bool:
        """The grouped conv around every sublayer (DFlash2); without it the sublayers read their input as is."""
        return self.architecture == DFLASH2_ARCH

    @property
    def has_selector(self) -> bool:
        """The candidate selector (DFlash2); without it a row proposes its logits' argmax."""
        return self.architecture == DFLASH2_ARCH


def parse_drafter_config(cfg: dict, arch: Arch, where: str = "dflash/config.json") -> DflashConfig:
    """The config of whichever DFlash architecture `architectures` names."""
    names = cfg.get("architectures")
    if names == [PUBLISHED_ARCH]:
        return parse_published_config(cfg, arch, where)
    if names == [DFLASH2_ARCH]:
        return parse_config(cfg, arch, where)
    raise TurboError(f"{where}: field 'architectures' is {show(names)}, expected one of "
                     f"{', '.join(repr([a]) for a in ARCHITECTURES)}")


def shared_fields(cfg: dict, arch: Arch, where: str) -> tuple[dict, str, dict]:
    """(dflash_config, its `where`, the DflashConfig fields both architectures read alike),
    each of its type and in its range."""
    d = need_field(cfg, "dflash_config", dict, where)
    dw = f"{where} dflash_config"
    rope = need_field(cfg, "rope_parameters", dict, where)
    return d, dw, dict(
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
        rope_theta=need_rope_theta(rope, f"{where} rope_parameters"),
    )


def parse_config(cfg: dict, arch: Arch, where: str = "dflash/config.json") -> DflashConfig:
    """The DFlash2 drafter's config, refused by field name when missing, of another type, out of
    range or inconsistent with itself or the trunk."""
    if cfg.get("architectures") != [DFLASH2_ARCH]:
        raise TurboError(f"{where}: field 'architectures' is {show(cfg.get('architectures'))}, "
                         f"expected [{DFLASH2_ARCH!r}]")
    d, dw, shared = shared_fields(cfg, arch, where)
    c = DflashConfig(
        **shared,
        taps=need_field(d, "conv_kernel_size", int, dw),
        group=need_field(d, "conv_group_size", int, dw),
        rank=need_positive(d, "selector_rank", dw),
        top_k=need_field(d, "selector_top_k", int, dw),
        is_causal=need_field(cfg, "is_causal", bool, where),
    )
    layer_types = need_field(cfg, "layer_types", list, where)
    if len(layer_types) != c.layers or any(t != "sliding_attention" for t in layer_types):
        raise TurboError(f"{where}: field 'layer_types' is {show(layer_types)}, expected {c.layers} x 'sliding_attention'")
    if c.layers != DFLASH_LAYERS:
        raise TurboError(f"{where}: field 'num_hidden_layers' is {c.layers}, expected {DFLASH_LAYERS} (the layers "
                         "this port runs)")
    if c.taps != DFLASH_TAPS:
        raise TurboError(f"{dw}: field 'conv_kernel_size' is {c.taps}, expected {DFLASH_TAPS} (the taps this port runs)")
    if c.group <= 0 or c.hidden % c.group:
        raise TurboError(f"{dw}: field 'conv_group_size' is {c.group}, expected a divisor of hidden_size {c.hidden}")
    if not 2 <= c.top_k <= c.vocab:
        raise TurboError(f"{dw}: field 'selector_top_k' is {c.top_k}, expected 2..{c.vocab} (the vocab)")
    check_shared_fields(c, arch, where)
    return c


def parse_published_config(cfg: dict, arch: Arch, where: str = "dflash/config.json") -> DflashConfig:
    """The published DFlash drafter's config (z-lab's `DFlashDraftModel`, as the Qwen3.5
    drafters ship it: `dflash_config {block_size, mask_token_id, target_layer_ids}`), refused
    by field name when missing or not honourable. Its block is bidirectional (z-lab's forward
    runs it unmasked); its context is the last `sliding_window` positions."""
    if cfg.get("architectures") != [PUBLISHED_ARCH]:
        raise TurboError(f"{where}: field 'architectures' is {show(cfg.get('architectures'))}, expected "
                         f"[{PUBLISHED_ARCH!r}]")
    d, dw, shared = shared_fields(cfg, arch, where)
    c = DflashConfig(**shared, taps=0, group=0, rank=0, top_k=0, is_causal=False, architecture=PUBLISHED_ARCH)
    rope = cfg["rope_parameters"]
    if cfg.get("is_causal", False) is not False:
        raise TurboError(f"{where}: field 'is_causal' is {cfg['is_causal']!r}, expected false (the published "
                         f"DFlash block is bidirectional)")
    if rope.get("rope_type", "default") != "default":
        raise TurboError(f"{where} rope_parameters: field 'rope_type' is {rope['rope_type']!r}, expected 'default' "
                         f"(the rotation this port runs)")
    for fields, at in ((cfg, where), (d, dw)):  # what some forks add: only the published forward's values run
        for key in ("input_embedding_scale", "output_multiplier"):
            if fields.get(key, 1.0) != 1.0:
                raise TurboError(f"{at}: field {key!r} is {fields[key]!r}, expected 1.0 (the published DFlash forward)")
        if fields.get("final_logit_softcapping") not in (None, 0):
            raise TurboError(f"{at}: field 'final_logit_softcapping' is {fields['final_logit_softcapping']!r}, "
                             f"expected none (the published DFlash forward)")
    layer_types = cfg.get("layer_types", ["sliding_attention"] * c.layers)
    if (not isinstance(layer_types, list) or len(layer_types) != c.layers
            or any(t not in ("sliding_attention", "full_attention") for t in layer_types)):
        raise TurboError(f"{where}: field 'layer_types' is {layer_types!r}, expected num_hidden_layers ({c.layers}) "
                         f"entries of 'sliding_attention' / 'full_attention'")
    targets = cfg.get("num_target_layers", arch.num_layers)
    if targets != arch.num_layers:
        raise TurboError(f"{where}: field 'num_target_layers' is {targets!r}, expected the trunk's {arch.num_layers}")
    check_shared_fields(c, arch, where)
    return c


def check_shared_fields(c: DflashConfig, arch: Arch, where: str) -> None:
    """What both architectures' fields must satisfy to fuse into this trunk and run (their types
    and ranges are shared_fields')."""
    dw = f"{where} dflash_config"
    for key, field, trunk in (("hidden", "hidden_size", arch.hidden), ("vocab", "vocab_size", arch.vocab)):
        if getattr(c, key) != trunk:
            raise TurboError(f"{where}: field {field!r} is {getattr(c, key)}, expected the trunk's {trunk}")
    if c.heads % c.kv_heads:
        raise TurboError(f"{where}: num_attention_heads {c.heads} is not a multiple of num_key_value_heads "
                         f"{c.kv_heads}")
    if c.head_dim % 2:
        raise TurboError(f"{where}: field 'head_dim' is {c.head_dim}, expected an even number (RoPE rotates pairs)")
    if c.block_size < 2:
        raise TurboError(f"{dw}: field 'block_size' is {c.block_size}, expected at least 2")
    if not c.target_layers:
        raise TurboError(f"{dw}: field 'target_layer_ids' is empty, expected trunk layer ids")
    bad = [t for t in c.target_layers if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < arch.num_layers]
    if bad:
        raise TurboError(f"{dw}: field 'target_layer_ids' has {show(bad[0])}, expected ids in 0..{arch.num_layers - 1} "
                         f"(the trunk's layers)")
    if len(set(c.target_layers)) != len(c.target_layers):
        raise TurboError(f"{dw}: field 'target_layer_ids' is {list(c.target_layers)}, expected distinct layer ids")
    if not 0 <= c.mask_token < arch.vocab:
        raise TurboError(f"{dw}: field 'mask_token_id' is {c.mask_token}, expected an id below vocab {arch.vocab}")


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


def _first_widths(index: ResidentIndex, name: str) -> tuple[int, int]:
    """The first two widths (0 where the tensor has fewer), to derive from: every tensor is
    then compared in full (`_expect`), so no extra or missing dim slips by."""
    d = index.need(name).dims + (0, 0)
    return d[0], d[1]


def _expect(index: ResidentIndex, name: str, *want: int) -> None:
    got = index.need(name).dims
    if got != want:
        vector = f"a [{want[0]}] vector" if len(want) == 1 else str(list(want))
        raise TurboError(f"{name} has shape {list(got)}, expected {vector}")


def _expect_layers(index: ResidentIndex, layers: int, hidden: int, head_dim: int, q_rows: int, k_rows: int,
                   gate_rows: int) -> None:
    """Every decoder layer's norms, attention and MLP, as both architectures have them."""
    for layer in range(layers):
        def name(suffix: str) -> str:
            return dflash_layer_tensor(layer, suffix)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            _expect(index, name(f"{norm}.weight"), hidden)
        for norm in ("q_norm", "k_norm"):
            _expect(index, name(f"self_attn.{norm}.weight"), head_dim)
        _expect(index, name("self_attn.q_proj.weight"), q_rows, hidden)
        _expect(index, name("self_attn.k_proj.weight"), k_rows, hidden)
        _expect(index, name("self_attn.v_proj.weight"), k_rows, hidden)
        _expect(index, name("self_attn.o_proj.weight"), hidden, q_rows)
        _expect(index, name("mlp.gate_proj.weight"), gate_rows, hidden)
        _expect(index, name("mlp.up_proj.weight"), gate_rows, hidden)
        _expect(index, name("mlp.down_proj.weight"), hidden, gate_rows)


def derive_shape(index: ResidentIndex, hidden: int, vocab: int, taps: int = DFLASH_TAPS,
                 group: int = DFLASH_GROUP_SIZE) -> DflashShape:
    """The Rust original's `DflashShape::derive`: the same checks and messages."""
    head_dim = _first_widths(index, dflash_layer_tensor(0, "self_attn.q_norm.weight"))[0]
    q_rows, _ = _first_widths(index, dflash_layer_tensor(0, "self_attn.q_proj.weight"))
    k_rows, _ = _first_widths(index, dflash_layer_tensor(0, "self_attn.k_proj.weight"))
    gate_rows, _ = _first_widths(index, dflash_layer_tensor(0, "mlp.gate_proj.weight"))
    pred_rows, rank = _first_widths(index, "dflash.candidate_selector.predecessor_codebook")
    succ_rows, succ_rank = _first_widths(index, "dflash.candidate_selector.successor_codebook")
    if rank == 0 or rank > hidden or pred_rows != vocab or succ_rows != vocab or succ_rank != rank:
        raise TurboError(f"dflash candidate selector codebook shape mismatch: pred [{pred_rows}, {rank}], "
                         f"succ [{succ_rows}, {succ_rank}], expected [{vocab}, {rank}]")
    _expect(index, "dflash.candidate_selector.predecessor_codebook", vocab, rank)
    _expect(index, "dflash.candidate_selector.successor_codebook", vocab, rank)
    fc_rows, fc_cols = _first_widths(index, "dflash.fc.weight")
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
    _expect(index, "dflash.fc.weight", hidden, aux_count * hidden)
    _expect(index, "dflash.hidden_norm.weight", hidden)
    _expect(index, "dflash.norm.weight", hidden)
    _expect(index, "dflash.candidate_selector.hidden_projection.weight", rank, hidden)
    _expect_layers(index, layers, hidden, head_dim, q_rows, k_rows, gate_rows)
    conv_rows = 2 * taps * (hidden // group)
    proj_rows, _ = _first_widths(index, dflash_layer_tensor(0, "attention_conv.kernel_projection.weight"))
    if proj_rows != conv_rows:
        raise TurboError(f"attention_conv.kernel_projection.weight has {proj_rows} rows against the {conv_rows} this "
                         f"port's conv dispatches (2 sides x {taps} taps x {hidden}/{group} groups); this drafter's "
                         f"conv shape is not the published one")
    for layer in range(layers):
        for stem in ("attention_conv", "mlp_conv"):
            _expect(index, dflash_layer_tensor(layer, f"{stem}.kernel_projection.weight"), conv_rows, hidden)
            _expect(index, dflash_layer_tensor(layer, f"{stem}.base_kernel"), 2, taps, hidden)
    return DflashShape(layers, hidden, head_dim, q_rows // head_dim, k_rows // head_dim, gate_rows, conv_rows,
                       rank, aux_count)


def derive_published_shape(index: ResidentIndex, cfg: DflashConfig) -> DflashShape:
    """The published DFlash drafter's widths from the index, every tensor checked in full
    against them and the config; DFlash2's conv and selector tensors are refused (the
    config names the other architecture)."""
    for name in index.entries:
        if name.startswith(DFLASH_PREFIX + ".") and ("_conv." in name or ".candidate_selector." in name):
            raise TurboError(f"{name}: a DFlash2 tensor, but dflash/config.json names {PUBLISHED_ARCH} "
                             f"(expected {DFLASH2_ARCH!r} for a drafter with a conv and a candidate selector)")
    layers = 0
    while dflash_layer_tensor(layers, "input_layernorm.weight") in index:
        layers += 1
    if layers != cfg.layers:
        raise TurboError(f"the DFlash drafter has {layers} contiguous layers, expected num_hidden_layers "
                         f"{cfg.layers}")
    hidden, head_dim = cfg.hidden, _first_widths(index, dflash_layer_tensor(0, "self_attn.q_norm.weight"))[0]
    q_rows = _first_widths(index, dflash_layer_tensor(0, "self_attn.q_proj.weight"))[0]
    k_rows = _first_widths(index, dflash_layer_tensor(0, "self_attn.k_proj.weight"))[0]
    gate_rows = _first_widths(index, dflash_layer_tensor(0, "mlp.gate_proj.weight"))[0]
    if head_dim == 0 or q_rows % head_dim or k_rows % head_dim:
        raise TurboError(f"the DFlash drafter's shapes do not divide: q {q_rows}, k {k_rows}, head_dim {head_dim}")
    fc_cols = _first_widths(index, "dflash.fc.weight")[1]
    aux = fc_cols // hidden  # (the loader holds it against target_layer_ids)
    if aux == 0 or aux * hidden != fc_cols:
        raise TurboError(f"dflash.fc.weight has {fc_cols} columns, not a whole number of {hidden}-wide aux states")
    _expect(index, "dflash.fc.weight", hidden, aux * hidden)
    _expect(index, "dflash.hidden_norm.weight", hidden)
    _expect(index, "dflash.norm.weight", hidden)
    _expect_layers(index, layers, hidden, head_dim, q_rows, k_rows, gate_rows)
    return DflashShape(layers, hidden, head_dim, q_rows // head_dim, k_rows // head_dim, gate_rows, 0, 0, aux)
