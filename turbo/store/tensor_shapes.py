"""The tensors a trunk-shaped part must hold, by name, with the shapes its config implies: an MoE
block's (`moe_tensor_shapes`) and the MTP head's (`mtp_tensor_shapes`). turbo/load/load_plan.py plans
them; the loader checks the MTP head against them."""

from __future__ import annotations

from .arch import Arch

MTP_PREFIX = "mtp."  # the MTP head's tensors, in the checkpoint's names


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


def mtp_tensor_shapes(arch: Arch) -> dict[str, tuple[int, ...]]:
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
