"""A GGUF's tensor table checked before repack writes anything (repack/gguf.py): each tensor's
data offset aligned to general.alignment, its bytes inside the data section and overlapping no
other tensor's, the tensors tiling the section exactly (each padded to the alignment), rows whole
blocks, 1-D tensors F32, no zero dimension; and, against the config rebuilt from the metadata,
every tensor the architecture needs present with the shape it implies. The gguf package's reader takes all of
these as they come (a misaligned or overlapping table reads other tensors' bytes as weights: the
install generates garbage; a missing block fails only when the install opens)."""

from __future__ import annotations

from pathlib import Path

from ..errors import TurboError
from ..store.arch import Arch
from ..store.tensor_shapes import moe_tensor_shapes, mtp_tensor_shapes

DEFAULT_ALIGNMENT = 32  # GGUF's, when general.alignment is absent


def check_table(path: Path, reader, size: int) -> None:
    """Offsets aligned, byte ranges inside the data section and disjoint, no zero dimension."""
    from gguf import GGML_QUANT_SIZES  # (the optional package _open has already imported)

    field = reader.fields.get("general.alignment")
    align = int(field.contents()) if field is not None else DEFAULT_ALIGNMENT
    if align <= 0 or align & (align - 1):
        raise TurboError(f"{path}: general.alignment is {align}, expected a power of two")
    start = int(reader.data_offset)
    spans = []
    for t in reader.tensors:
        dims = [int(n) for n in t.shape.tolist()]
        if not dims or any(n <= 0 for n in dims):
            raise TurboError(f"{path}: tensor {t.name} has shape {dims[::-1]}, expected every dimension >= 1")
        block = GGML_QUANT_SIZES.get(t.tensor_type, (1, 0))[0]
        if dims[0] % block:  # (ggml's own rule: a row is whole blocks)
            raise TurboError(f"{path}: tensor {t.name} is {t.tensor_type.name} with rows of {dims[0]} values, "
                             f"expected whole blocks of {block}")
        if len(dims) == 1 and t.tensor_type.name != "F32":
            # llama.cpp's converter writes every 1-D tensor as F32 and llama-quantize leaves them so;
            # a small one retyped would still fit its padded slot, and be read as other numbers
            raise TurboError(f"{path}: tensor {t.name} is a 1-D {t.tensor_type.name} tensor, expected F32 (as "
                             "llama.cpp writes every 1-D tensor)")
        begin, end = int(t.data_offset), int(t.data_offset) + int(t.n_bytes)
        if (begin - start) % align:
            raise TurboError(f"{path}: tensor {t.name} starts at data offset {begin - start}, expected a multiple of "
                             f"general.alignment {align}")
        if begin < start or end > size:
            raise TurboError(f"{path}: tensor {t.name} spans bytes {begin}..{end}, outside the data section "
                             f"{start}..{size}")
        spans.append((begin, end, t.name))
    spans.sort()
    for (_, end, name), (begin, _, other) in zip(spans, spans[1:]):
        if begin < end:
            raise TurboError(f"{path}: tensors {name} and {other} overlap (bytes {begin}..{end}), expected each "
                             "tensor's bytes its own")
        # writers (gguf-py's, llama.cpp's) lay tensors end to end, each padded to the alignment: any
        # other gap is a table that does not describe its data (a tensor retyped to a smaller type)
        if begin != -(-(end - start) // align) * align + start:
            raise TurboError(f"{path}: {begin - end} bytes unaccounted for between tensors {name} and {other}, "
                             f"expected the tensors to tile the data section (each padded to {align} bytes)")
    if spans and spans[0][0] - start >= align:
        raise TurboError(f"{path}: the first tensor {spans[0][2]} starts {spans[0][0] - start} bytes into the data "
                         "section, expected at its start")


def expected_shapes(a: Arch, mtp_layers: int) -> dict[str, tuple[int, ...]]:
    """Every install tensor a GGUF's plan must produce, with the shape the config implies (the
    logical [out, in] of a quantized matrix). The output head only when untied."""
    h, hd, nh, nkv = a.hidden, a.head_dim, a.num_heads, a.num_kv_heads
    nk, nv, dk, dv = a.lin_k_heads, a.lin_v_heads, a.lin_k_dim, a.lin_v_dim
    conv = 2 * nk * dk + nv * dv
    out = {"trunk.embed_tokens.weight": (a.vocab, h), "trunk.norm.weight": (h,)}
    if not a.tie_embeddings:
        out["trunk.lm_head.weight"] = (a.vocab, h)
    for i in range(a.num_layers):
        p = f"trunk.layers.{i}."
        out |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        if a.is_gdn(i):
            x = p + "linear_attn."
            out |= {x + "in_proj_qkv.weight": (conv, h), x + "in_proj_z.weight": (nv * dv, h),
                    x + "in_proj_a.weight": (nv, h), x + "in_proj_b.weight": (nv, h), x + "A_log": (nv,),
                    x + "dt_bias": (nv,), x + "conv1d.weight": (conv, 1, a.conv_kernel), x + "norm.weight": (dv,),
                    x + "out_proj.weight": (h, nv * dv)}
        else:
            x = p + "self_attn."
            out |= {x + "q_proj.weight": (2 * nh * hd, h), x + "k_proj.weight": (nkv * hd, h),
                    x + "v_proj.weight": (nkv * hd, h), x + "o_proj.weight": (h, nh * hd),
                    x + "q_norm.weight": (hd,), x + "k_norm.weight": (hd,)}
        if a.is_moe(i):
            out |= moe_tensor_shapes(a, p + "mlp.")
        else:
            out |= {p + "mlp.gate_proj.weight": (a.intermediate, h), p + "mlp.up_proj.weight": (a.intermediate, h),
                    p + "mlp.down_proj.weight": (h, a.intermediate)}
    if mtp_layers:
        out |= mtp_tensor_shapes(a)
    return out


def check_planned(where: str, shapes: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> None:
    """The plan's tensors (install name -> logical shape) against `expected`: none missing, none
    of another shape (an extra one is refused where it is planned, by its GGUF name)."""
    missing = [n for n in expected if n not in shapes]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise TurboError(f"{where}: no tensor for {missing[0]}{more}, which the metadata's config needs (a block "
                         "count larger than the tensors present?)")
    for name, shape in shapes.items():
        want = expected.get(name)
        if want is not None and tuple(shape) != want:
            raise TurboError(f"{where}: {name} has shape {list(shape)}, expected {list(want)} from the metadata's "
                             "config")
