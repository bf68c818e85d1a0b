"""The load plan: the format each matrix of each part takes (trunk layers, embedding, head, MoE
experts, the MTP head, the DFlash drafter), decided from the install's index entries (header
data: names, shapes, stored dtypes, quantized formats), the arch, the options and what the host
can run, before any tensor's bytes are read. turbo/load/loader.py reads and packs as planned;
tests/test_load_plan.py checks plans on their own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import groupby
from typing import Mapping

import torch

from ..backends import native_dflash, native_exact, native_lib, native_pack, native_trunk
from ..backends.packed import LAYOUT_OF_BITS, QUANTIZED
from ..drafters.dflash_config import dflash_layer_tensor
from ..errors import TurboError
from ..model.trunk import PREFIX
from ..sequence.options import OpenOptions
from ..store import layout_file, quant
from ..store.arch import Arch
from ..store.install import Entry
from ..store.tensor_shapes import MTP_PREFIX, moe_tensor_shapes, mtp_tensor_shapes  # noqa: F401  (imported from here too)

NATIVE_OFF = "TURBO_NATIVE=0"  # why_torch when OpenOptions.native is False
# why_torch under dynamic NTK RoPE: native.c rotates every row with one table (model.trunk.DynamicNtk: one per length)
DYNAMIC_ROPE = "rope_type dynamic: the native step rotates with one frequency table"
EMBED = "embed_tokens.weight"

# A matrix's form (Matrix.form):
TENSOR = "tensor"  # torch step: a tensor in `dtype` (quantized sources dequantized, unless a Source keeps them)
PANELS = "panels"  # native step: float panels of `dtype` ("panel_pairs" for bf16), packed a slice at a time
PACKED = "packed"  # native step: int4 / int8 read as stored (`bits`), native_pack.quantized_panels
COPY = "copy"  # native step: a float table quantized to `bits` (a tied lm_head; native_pack.quantized_copy, or mapped)
EXACT = "exact"  # native step: fp32-scaled int4 / int8 or FP8 read as stored (native_exact.exact_panels)
SEGMENTS = "segments"  # native step: `parts` (each EXACT, PACKED or PANELS) stacked by rows (native_exact.segments)
MIXED = "mixed"  # packed_format: every matrix of the part in SEGMENTS (one wtype, formats of their own)
DRAFT = "draft"  # a drafter's native step: read as a TENSOR in its dtype, packed for its products (`dtype`, `draft`)

DRAFT_HEAD = "the trunk's lm_head"  # a DFlash drafter's lm_head source: the dense head the loader is given


@dataclass(frozen=True)
class Host:
    """What the plan needs of the machine: why the native library is not to be had here
    (None: it is; "not asked": the trunk is not on the CPU or the options turn it off), and
    its dot products (native_lib.dot_layouts)."""
    library: str | None = "not asked"
    layouts: tuple[str, ...] = ()


@dataclass(frozen=True)
class Source:
    """One tensor of a fused matrix: its full name, the shape the arch implies (refused
    otherwise when read), and whether the torch step keeps it quantized (quant.QuantizedWeight)."""
    name: str
    shape: tuple[int, ...] | None  # None: checked elsewhere (a drafter's derived shape)
    keep: bool = False


@dataclass(frozen=True)
class Matrix:
    """One matrix as a step multiplies by it: `sources` fused by rows, in `form` (above)."""
    sources: tuple[Source, ...]
    form: str
    dtype: torch.dtype | None = None  # TENSOR: the tensors'; PANELS: the panels'
    bits: int = 0  # PACKED, COPY
    kernel: bool = False  # TENSOR: kept sources run quant's CPU kernel (QuantizedWeight.use_kernel)
    draft: str | None = None  # DRAFT: the drafter's products' layout (native_lib.draft_layout)
    parts: tuple[Matrix, ...] = ()  # SEGMENTS
    mapped: str | None = None  # PANELS, PACKED, COPY, SEGMENTS: the install's packed tensor it is, read as is (layout_file)

    @property
    def layout(self) -> str:  # PANELS: bf16 in pairs (the same products, less widening)
        if self.draft is not None:
            return self.draft
        return "panel_pairs" if self.dtype == torch.bfloat16 else "panels"


@dataclass(frozen=True)
class MoePlan:
    """An MoE block: the router and shared expert's gate as floats, the experts in one format."""
    extra: str  # the first expert past num_experts: refused if the install has it
    router: Matrix
    gate_up: tuple[Matrix, ...]
    down: tuple[Matrix, ...]
    shared_gate_up: Matrix | None
    shared_down: Matrix | None
    shared_gate: Matrix | None


@dataclass(frozen=True)
class LayerPlan:
    """A trunk-shaped layer (the trunk's, the MTP head's) under `prefix` ("trunk.layers.3.")."""
    prefix: str
    gdn: bool
    mixer: dict[str, Matrix]  # GDN: in_proj, out; attention: qkv, o
    gate_up: Matrix | None  # None (and down): an MoE layer
    down: Matrix | None
    moe: MoePlan | None


@dataclass(frozen=True)
class EmbedPlan:
    """The embedding table and the lm_head. `rows_of_head`: the table is read out of the packed
    (tied) head, kept once; else the table is read in `read_as` (None: as stored), then kept in
    `table` (None: as read). `head` None: the table itself is the head (tied, torch step)."""
    source: Source  # the table
    rows_of_head: bool
    read_as: torch.dtype | None
    table: torch.dtype | None
    head: Matrix | None


@dataclass(frozen=True)
class TrunkPlan:
    dtype: torch.dtype  # the activations'
    why_torch: str | None  # None: the native step
    storage: torch.dtype | None  # the native step's float matrices (None: the torch step)
    kv: torch.dtype  # the attention layers' K/V cache
    embed: EmbedPlan
    layers: tuple[LayerPlan, ...]


@dataclass(frozen=True)
class DrafterPlan:
    """A drafter's matrices by name (MTP: "fc"; DFlash: "fc", "layers.{i}.q" ... as
    DFLASH_LAYER and DFLASH_CONV), the MTP head's layer, the DFlash lm_head (`head`, from the
    trunk's: DRAFT_HEAD), and which step runs it: on the native step (`why_torch` None) every
    matrix is DRAFT, packed in `storage` and `layout` as read, so the step binds them as given;
    on the torch step they are TENSORs in the drafter's dtype."""
    matrices: dict[str, Matrix]
    layer: LayerPlan | None
    head: Matrix | None
    stored: frozenset[str]  # the stored dtypes of the tensors read in the drafter's dtype
    storage: torch.dtype
    why_torch: str | None
    layout: str | None  # the native step's products' (native_lib.draft_layout)


def in_moe_block(name: str) -> bool:
    # (planned per block by plan_moe, not per layer part with the layer's other products)
    return any(part in name for part in (".mlp.experts.", ".mlp.shared_expert", ".mlp.gate."))


def moe_gate(name: str) -> bool:
    # the router and the shared expert's gate: [experts, hidden] and [1, hidden], read as floats
    # (native_moe.c: one wtype for them, one for the experts)
    return any(part in name for part in (".mlp.gate.", ".mlp.shared_expert_gate."))


def kv_dtype(choice: str, device: torch.device, dtype: torch.dtype, stored: set[str], quantized: bool) -> torch.dtype:
    """The attention layers' K/V cache dtype for OpenOptions.kv_cache. auto: on the CPU the
    checkpoint's own precision -- bf16 for bf16 matrices, a quantized install or bf16
    activations (transformers keeps its cache in the model's dtype, llama.cpp in f16), fp32
    for an fp32 checkpoint; fp32 on cuda (its step has not run a bf16 cache on a GPU)."""
    if choice != "auto":
        return getattr(torch, choice)
    own = torch.bfloat16 if dtype == torch.bfloat16 or quantized or stored == {"BF16"} else torch.float32
    return own if device.type == "cpu" else torch.float32


@dataclass(frozen=True)
class _Rules:
    """The part-wide facts each matrix's form follows from (`storage` None: the torch step's tensors)."""
    entries: Mapping[str, Entry]
    dtype: torch.dtype
    on_cpu: bool
    mode: str  # quant.cpu_mode
    native_here: bool  # the native step can run on this host
    int8: bool  # its products read int4 / int8 packed (native_pack.reads_packed)
    storage: torch.dtype | None = None
    keep_quantized: bool = True  # the torch step may keep quantized sources packed (drafters: dequantized)
    draft: str | None = None  # a drafter's native step: every matrix DRAFT in `storage`, this layout
    layouts: tuple[str, ...] = ()  # the host's (Host.layouts): "exact", "fp8" read those formats as stored
    packed: Mapping[str, Entry] | None = None  # the open layout's tensors (ResidentIndex.packed): read as is

    def read_packed(self, name: str, e: Entry) -> bool:
        """The native step's products read this quantized matrix as stored (turbo/store/quant.py: native)."""
        return self.read_turbo(name, e) or self.read_exact(name, e)

    def read_turbo(self, name: str, e: Entry) -> bool:
        """... as turbo's own int4 / int8 (groups of 64, bf16 scales: the products of int8 inputs)."""
        return (self.native_here and bool(e.bits) and e.bits in QUANTIZED.values() and e.group == quant.GROUP
                and e.scale_st_dtype == "BF16" and self.int8 and quant.native_reads(self.mode, e.bits, self.dtype)
                and not moe_gate(name))

    def read_exact(self, name: str, e: Entry) -> bool:
        """... as an exact format (fp32-scaled int4gG / int8g32, FP8: float products, native_exact.py)."""
        return (self.native_here and bool(e.bits) and native_exact.reads_format(e.dtype, self.layouts)
                and quant.native_reads(self.mode, e.bits, self.dtype) and not moe_gate(name))

    def present(self, names: list[str]) -> list[tuple[str, Entry]]:
        """The names' entries that are in the install as matrices (a missing one is refused when read)."""
        return [(n, e) for n in names if (e := self.entries.get(n)) is not None and len(e.dims) == 2]

    def packed_format(self, es: list[tuple[str, Entry]]) -> torch.dtype | int | None:
        """How the native step packs matrices that share one wtype (a layer's products; an MoE
        block's experts): the bits of the one packed format they are all read in, else fp32 if
        any is quantized (dequantized exactly), else `storage`."""
        kinds = {e.bits if self.read_packed(n, e) else None for n, e in es}
        if self.storage is None or not any(e.bits for _, e in es):
            return self.storage
        if any(self.read_exact(n, e) for n, e in es):  # (each matrix then in its own format: SEGMENTS)
            return MIXED
        return kinds.pop() if len(kinds) == 1 and None not in kinds else torch.float32

    def keeps(self, name: str) -> bool:
        e = self.entries.get(name)
        return (self.keep_quantized and e is not None and bool(e.bits)  # (FP8 off the CPU: dequantized, no kernel)
                and (quant.keep_packed(self.mode, e.bits, self.dtype) if self.on_cpu else e.dtype not in quant.FLOAT8_CODES))

    def matrix(self, sources: list[tuple[str, tuple[int, ...] | None]], fmt: torch.dtype | int | None) -> Matrix:
        """The sources fused by rows, in `fmt` on the native step (bits: read packed; a dtype:
        float panels; None: `storage`), else a tensor in `dtype` (a drafter's native step: DRAFT)."""
        if self.draft is not None:
            return Matrix(tuple(Source(n, s) for n, s in sources), DRAFT, self.storage, draft=self.draft)
        if self.storage is None:
            return Matrix(tuple(Source(n, s, self.keeps(n)) for n, s in sources), TENSOR, self.dtype,
                          kernel=self.mode != "packed" and self.on_cpu)  # (on cuda: the quantized GEMV kernel)
        srcs = tuple(Source(n, s) for n, s in sources)
        if fmt == MIXED:  # (runs of sources read alike fused into one segment)
            return self.mapped(Matrix(srcs, SEGMENTS, parts=tuple(self._segment(kind, tuple(run))
                                                                  for kind, run in groupby(srcs, key=self._kind))))
        return self.mapped(Matrix(srcs, PACKED, bits=fmt) if isinstance(fmt, int)
                           else Matrix(srcs, PANELS, fmt or self.storage))

    def mapped(self, m: Matrix) -> Matrix:
        """`m` read as is out of the install's packed file, where that holds it (packed_target) as planned."""
        want = packed_target(self.entries, m)
        packed = (self.packed or {}).get(want[0]) if want is not None else None
        fits = packed is not None and packed.st_dtype == want[1] and packed.dims == (want[2] or packed.dims[:1])  # (None: 1-D)
        return replace(m, mapped=packed.name) if fits else m

    def _kind(self, s: Source) -> tuple:
        """How a source of a SEGMENTS matrix is read: its exact format, turbo's int4 / int8, or floats."""
        e = self.entries.get(s.name)
        if e is None or not e.bits:
            return ("float",)
        if self.read_exact(s.name, e):
            return (EXACT, e.dtype)
        return (PACKED, e.bits) if self.read_turbo(s.name, e) else ("float", "dequantized")

    def _segment(self, kind: tuple, run: tuple[Source, ...]) -> Matrix:
        if kind[0] in (EXACT, PACKED):
            return Matrix(run, kind[0], bits=kind[1] if kind[0] == PACKED else 0)
        return Matrix(run, PANELS, torch.float32 if len(kind) > 1 else self.storage)  # (dequantized: fp32, exact)


def packed_layout(entries: Mapping[str, Entry], m: Matrix) -> str | None:
    """The packed.Packed layout `m` is packed in (an EXACT one's: its first source's format's)."""
    return (native_exact.exact_layout(entries[m.sources[0].name].dtype in quant.FLOAT8_CODES) if m.form == EXACT
            else "segments" if m.form == SEGMENTS else LAYOUT_OF_BITS.get(m.bits) if m.bits else m.layout)


def packed_target(entries: Mapping[str, Entry], m: Matrix) -> tuple[str, str, tuple[int, ...] | None] | None:
    """Where the open layout keeps `m` (layout_file.target): a PANELS, PACKED, COPY or SEGMENTS matrix (native_exact.
    segments()' bytes, as many as its exact parts' data make: shape None, one dimension; named by its parts)."""
    if m.form == SEGMENTS:
        if any(p.form != EXACT and packed_target(entries, p) is None for p in m.parts):  # (EXACT: its sources are there)
            return None  # (a part dequantized: not written, as no dequantized matrix is)
        kinds = "-".join(f"{packed_layout(entries, p)}x{len(p.sources)}" for p in m.parts)
        return layout_file.packed_name(f"segments-{kinds}", m.sources[0].name), "U8", None
    return None if m.form not in (PANELS, PACKED, COPY) else layout_file.target(
        entries, packed_layout(entries, m), [s.name for s in m.sources], m.form == PANELS,
        "BF16" if m.dtype == torch.bfloat16 else "F32")


def _by_part(matrices: Mapping[str, Entry]) -> dict[str, list[tuple[str, Entry]]]:
    """The matrices outside MoE blocks by part ("layers.3.", "lm_head."), grouped once: an MoE
    install has tens of thousands of expert matrices, too many to rescan for every layer."""
    parts: dict[str, list[tuple[str, Entry]]] = {}
    for name, e in matrices.items():
        if not in_moe_block(name):
            rest = name[len(PREFIX):]
            cut = rest.index(".", len("layers.")) if rest.startswith("layers.") else rest.index(".")
            parts.setdefault(rest[:cut + 1], []).append((name, e))
    return parts


def plan_trunk(entries: Mapping[str, Entry], a: Arch, opts: OpenOptions, device: torch.device,
               host: Host, packed: Mapping[str, Entry] | None = None) -> TrunkPlan:
    """The trunk's plan in `opts.dtype` on `device`: which step runs it, and every matrix's form
    (float panels, int4 / int8 read packed, or the torch step's tensors); a matrix the open
    layout's `packed` tensors hold as planned is read as is (Matrix.mapped)."""
    dtype, on_cpu = getattr(torch, opts.dtype), device.type == "cpu"
    if a.tie_embeddings and PREFIX + "lm_head.weight" in entries:  # which of the two would be the head?
        raise TurboError(f"{PREFIX}lm_head.weight: a separate lm_head, but the config's tie_word_embeddings is true "
                         "(the embedding is the head): set it false, or drop the tensor")
    mode = quant.cpu_mode(opts.quant_cpu)  # how quantized matrices run on the CPU (turbo/store/quant.py; measured)
    rules = _Rules(entries, dtype, on_cpu, mode, on_cpu and opts.native and host.library is None,
                   "int8" in host.layouts, layouts=host.layouts, packed=packed)
    # every 2-D `trunk.*.weight` (a quantized one's logical dims)
    matrices = {name: e for name, e in entries.items()
                if name.startswith(PREFIX) and name.endswith(".weight") and len(e.dims) == 2}
    kept = on_cpu and any(e.bits and quant.keep_packed(mode, e.bits, dtype) and not rules.read_packed(name, e)
                          for name, e in matrices.items() if name != PREFIX + EMBED)
    why = NATIVE_OFF if not opts.native else (DYNAMIC_ROPE if a.rope_scaling is not None and a.rope_scaling.kind == "dynamic"
                                              else native_trunk.trunk_refusal(device, dtype, kept) or host.library)
    # the float matrices packed, the embedding kept, in it (None: the torch step's plain tensors)
    rules = replace(rules, storage=native_pack.storage_dtype(
        dtype, {e.st_dtype for name, e in matrices.items() if not rules.read_packed(name, e)}) if why is None else None)
    parts = _by_part(matrices)
    formats = [rules.packed_format(parts.get(f"layers.{i}.", [])) for i in range(a.num_layers)]
    layers = tuple(_plan_layer(rules, a, f"{PREFIX}layers.{i}.", a.is_gdn(i), a.is_moe(i), formats[i])
                   for i in range(a.num_layers))
    # (an FP8 matrix counts as the bf16 one it is read as: the cache of the bf16 install of its source)
    fp8 = {name for name, e in matrices.items() if e.dtype in quant.FLOAT8_CODES}
    kv = kv_dtype(opts.kv_cache, device, dtype, {"BF16" if n in fp8 else e.st_dtype for n, e in matrices.items()},
                  any(e.bits for n, e in matrices.items() if n not in fp8))
    return TrunkPlan(dtype, why, rules.storage, kv, _plan_embed(rules, a, formats, parts), layers)


def _plan_embed(r: _Rules, a: Arch, formats: list, parts: dict[str, list[tuple[str, Entry]]]) -> EmbedPlan:
    table = Source(PREFIX + EMBED, (a.vocab, a.hidden))
    packed_bits = {f for f in formats if isinstance(f, int)}
    e = r.entries.get(table.name)
    # repack --float-quant recorded the head's format (install.HEAD_COPY_KEY): the layers may mix exact formats
    recorded = e.head_bits if (e is not None and e.head_bits and r.storage is not None and r.native_here and r.int8
                               and quant.native_reads(r.mode, e.head_bits, r.dtype)) else 0
    if a.tie_embeddings and (recorded or packed_bits):
        # the layers read packed: so is the lm_head, a copy in their format (the widest, if they
        # differ; at real scale the head is a third of a step's bytes); the table stays exact
        bits = recorded or max(packed_bits)
        return EmbedPlan(table, False, None, r.storage, r.mapped(Matrix((table,), COPY, bits=bits)))
    if a.tie_embeddings and r.storage is not None and r.packed_format(r.present([table.name])) == MIXED:  # GGUF codes
        return EmbedPlan(table, False, r.dtype, r.storage, r.matrix([(table.name, table.shape)], MIXED))  # read as stored
    if a.tie_embeddings and r.storage is not None:  # the embedding rows read out of the packed lm_head: kept once
        return EmbedPlan(table, True, None, None, r.matrix([(table.name, table.shape)], None))
    head = None if a.tie_embeddings else r.matrix([(PREFIX + "lm_head.weight", table.shape)],
                                                  r.packed_format(parts.get("lm_head.", [])))
    return EmbedPlan(table, False, r.dtype, r.storage, head)


def _plan_layer(r: _Rules, a: Arch, p: str, gdn: bool, moe: bool, fmt: torch.dtype | int | None) -> LayerPlan:
    h, hd, nh, nkv = a.hidden, a.head_dim, a.num_heads, a.num_kv_heads
    if gdn:
        m, kd, vd = p + "linear_attn.", a.lin_k_heads * a.lin_k_dim, a.lin_v_heads * a.lin_v_dim
        mixer = {"in_proj": r.matrix([(m + "in_proj_qkv.weight", (2 * kd + vd, h)), (m + "in_proj_z.weight", (vd, h)),
                                      (m + "in_proj_b.weight", (a.lin_v_heads, h)),
                                      (m + "in_proj_a.weight", (a.lin_v_heads, h))], fmt),
                 "out": r.matrix([(m + "out_proj.weight", (h, vd))], fmt)}
    else:
        m = p + "self_attn."
        mixer = {"qkv": r.matrix([(m + "q_proj.weight", (2 * nh * hd, h)), (m + "k_proj.weight", (nkv * hd, h)),
                                  (m + "v_proj.weight", (nkv * hd, h))], fmt),
                 "o": r.matrix([(m + "o_proj.weight", (h, nh * hd))], fmt)}
    if moe:
        return LayerPlan(p, gdn, mixer, None, None, _plan_moe(r, a, p + "mlp."))
    return LayerPlan(p, gdn, mixer, r.matrix([(p + "mlp.gate_proj.weight", (a.intermediate, h)),
                                              (p + "mlp.up_proj.weight", (a.intermediate, h))], fmt),
                     r.matrix([(p + "mlp.down_proj.weight", (h, a.intermediate))], fmt), None)


def _plan_moe(r: _Rules, a: Arch, mlp: str) -> MoePlan:
    """The block under `mlp` (full name): the experts and shared expert in the one format all
    of them take (int4 / int8 read packed where the native step can), the gates as floats."""
    shapes = moe_tensor_shapes(a, mlp)
    fmt = r.packed_format(r.present([name for name in shapes if not moe_gate(name)]))

    def m(*names: str, gate: bool = False) -> Matrix:
        return r.matrix([(mlp + n, shapes[mlp + n]) for n in names], None if gate else fmt)

    experts, shared = range(a.num_experts), a.shared_intermediate > 0
    return MoePlan(
        extra=f"{mlp}experts.{a.num_experts}.gate_proj.weight",
        router=m("gate.weight", gate=True),
        gate_up=tuple(m(f"experts.{e}.gate_proj.weight", f"experts.{e}.up_proj.weight") for e in experts),
        down=tuple(m(f"experts.{e}.down_proj.weight") for e in experts),
        shared_gate_up=m("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight") if shared else None,
        shared_down=m("shared_expert.down_proj.weight") if shared else None,
        shared_gate=m("shared_expert_gate.weight", gate=True) if shared else None,
    )


# The DFlash layer matrices native_dflash.c reads packed, and their tensors; the conv's only with a conv.
DFLASH_LAYER = {"q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
                "o": "self_attn.o_proj.weight", "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight",
                "down": "mlp.down_proj.weight"}
DFLASH_CONV = {"attn_proj": "attention_conv.kernel_projection.weight",
               "mlp_proj": "mlp_conv.kernel_projection.weight"}
DFLASH_BASES = ("attention_conv.base_kernel", "mlp_conv.base_kernel")
DFLASH_SELECTOR = "dflash.candidate_selector."
SELECTOR_TENSORS = ("hidden_projection.weight", "predecessor_codebook", "successor_codebook")


def _drafter_rules(entries: Mapping[str, Entry], dtype: torch.dtype) -> _Rules:
    # a drafter's matrices are read as tensors in its dtype, a quantized one dequantized (nothing kept packed)
    return _Rules(entries, dtype, on_cpu=False, mode="auto", native_here=False, int8=False, keep_quantized=False)


def layer_matrices(layer: LayerPlan) -> list[Matrix]:
    """Every matrix of a planned layer, its MoE block's included."""
    out = [*layer.mixer.values(), *(m for m in (layer.gate_up, layer.down) if m is not None)]
    if layer.moe is not None:
        e = layer.moe
        out += [e.router, *e.gate_up, *e.down, *(m for m in (e.shared_gate_up, e.shared_down, e.shared_gate) if m)]
    return out


def _stored(entries: Mapping[str, Entry], names: list[str]) -> frozenset[str]:
    return frozenset(entries[n].st_dtype for n in names if n in entries)


def _draft_step(why: str | None, products: str, host: Host, part: str) -> str | None:
    """The native step's layout for `products` (why None), else None: drafter-only products are
    the native step's, the torch step computes in fp32."""
    if why is None:
        return native_lib.draft_layout(products, host.layouts)
    if products not in ("auto", "fp32"):
        raise TurboError(f"draft_products {products}: {part} is not in use ({why}); expected auto or fp32")
    return None


def plan_mtp(entries: Mapping[str, Entry], arch: Arch, dtype: torch.dtype, why_torch: str | None,
             products: str, host: Host) -> DrafterPlan:
    """The MTP head's matrices (its layer is trunk-shaped, attention), in the trunk's `dtype`, on
    the trunk's step (`why_torch` the trunk's: native.c's attn_layer and head on the native one)."""
    layout = _draft_step(why_torch, products, host, "the MTP head's native CPU step")

    def planned(r: _Rules) -> tuple[LayerPlan, Matrix]:
        return (_plan_layer(r, arch, MTP_PREFIX + "layers.0.", False, arch.moe, None),
                r.matrix([(MTP_PREFIX + "fc.weight", (arch.hidden, 2 * arch.hidden))], None))

    r = _drafter_rules(entries, dtype)
    layer, fc = planned(r)
    stored = _stored(entries, [s.name for m in (fc, *layer_matrices(layer)) for s in m.sources])
    storage = native_pack.storage_dtype(dtype, set(stored))
    if layout is not None:
        layer, fc = planned(replace(r, storage=storage, draft=layout))
    return DrafterPlan({"fc": fc}, layer, None, stored, storage, why_torch, layout)


def plan_dflash(entries: Mapping[str, Entry], layers: int, conv: bool, selector: bool, dtype: torch.dtype, *,
                opts: OpenOptions, device: torch.device, host: Host, embed, head: torch.dtype) -> DrafterPlan:
    """The DFlash drafter's matrices (shapes derived and checked by dflash_config), in `dtype`,
    over the trunk's `embed` table and its lm_head (dense, in `head`): on native_dflash.c where it
    can run (dflash_refusal), else the torch step. A bf16 head stays bf16 on the native step."""
    why = NATIVE_OFF if not opts.native else native_dflash.dflash_refusal(device, dtype, embed) or host.library
    layout = _draft_step(why, opts.draft_products, host, "the drafter's native CPU pass")
    names = {"fc": "dflash.fc.weight"} | {f"layers.{i}.{key}": dflash_layer_tensor(i, tensor) for i in range(layers)
                                          for key, tensor in (DFLASH_LAYER | (DFLASH_CONV if conv else {})).items()}
    # the drafter's `stored`: every tensor read in its dtype (its conv's bases; the selector's under fp32)
    also = [dflash_layer_tensor(i, b) for i in range(layers) for b in DFLASH_BASES] if conv else []
    also += [DFLASH_SELECTOR + n for n in SELECTOR_TENSORS] if selector and dtype == torch.float32 else []
    stored = _stored(entries, [*names.values(), *also])
    storage = native_pack.storage_dtype(dtype, set(stored))
    r = _drafter_rules(entries, dtype)
    if layout is not None:
        r = replace(r, storage=storage, draft=layout)
    lm_head = r.matrix([(DRAFT_HEAD, None)], None)
    if layout is not None:
        lm_head = replace(lm_head, dtype=torch.bfloat16 if head == torch.bfloat16 else torch.float32)
    return DrafterPlan({key: r.matrix([(name, None)], None) for key, name in names.items()}, None, lm_head, stored,
                       storage, why, layout)
