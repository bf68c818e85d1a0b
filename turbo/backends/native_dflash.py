"""The DFlash drafters' pass (either architecture) through native_dflash.c: NativeDflashStep and
when it can run (dflash_refusal).
"""

from __future__ import annotations

import ctypes

import torch

from ..store import quant
from .dflash_math import select_candidates
from .native_lib import WTYPES, Dflash, DfLayer, threaded
from .packed import PackedRows, ptr, table_of

# native_dflash.c's dflash_select keeps at most this many candidates per row.
SELECT_MAX_K = 64


def dflash_refusal(device: torch.device, dtype: torch.dtype, embed) -> str | None:
    """Why the DFlash pass (either architecture) cannot run in native_dflash.c (None: it can, the library built):
    on the CPU, fp32 activations, a plain fp32 or bf16 embedding table."""
    if device.type != "cpu":
        return f"the drafter runs on {device.type}"
    if dtype != torch.float32:
        return f"activations are {str(dtype).removeprefix('torch.')}"
    plain_table = isinstance(embed, torch.Tensor) and embed.is_contiguous()
    # (a quantized table: dequantized whole for it, packed.table_of)
    if not (plain_table or isinstance(embed, (PackedRows, quant.QuantizedRows))) or embed.dtype not in WTYPES:
        return "the embedding table is not a plain fp32 or bf16 one"
    return None


class NativeDflashStep:
    """The DFlash pass and context rows in native_dflash.c (one call each). The drafter's
    matrices and lm_head arrive packed for its products (turbo/load/loader.py, load_plan.plan_dflash;
    a bf16 drafter's stay bf16, widened exactly in the product)."""

    name = "native"

    def __init__(self, d):
        self.d = d
        cfg, shape = d.cfg, d.shape
        embed, embed_wtype, embed_panels = table_of(d.embed)
        self.layers = (DfLayer * len(d.layers))(*(DfLayer(
            in_norm=ptr(l.in_norm), post_norm=ptr(l.post_norm), q_norm=ptr(l.q_norm), k_norm=ptr(l.k_norm),
            q=ptr(l.q), k=ptr(l.k), v=ptr(l.v), o=ptr(l.o), gate=ptr(l.gate), up=ptr(l.up), down=ptr(l.down),
            attn_proj=ptr(l.attn_proj), mlp_proj=ptr(l.mlp_proj), attn_base=ptr(l.attn_base),
            mlp_base=ptr(l.mlp_base)) for l in d.layers))
        self.struct = Dflash(
            hidden=shape.hidden, heads=shape.num_heads, kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
            inter=shape.inter, taps=cfg.taps, group=cfg.group, aux_width=d.fc.shape[1], vocab=cfg.vocab,
            layers=len(d.layers), window=d.window, causal=cfg.is_causal, conv=cfg.has_conv,
            mask_token=cfg.mask_token, embed_wtype=embed_wtype, embed_panels=embed_panels, wtype=d.fc.wtype, lm_wtype=d.lm_head.wtype,
            eps=cfg.eps, res_eps=cfg.eps / (d.scale * d.scale),
            scale=d.scale, embed=embed, fc=ptr(d.fc), hidden_norm=ptr(d.hidden_norm),
            final_norm=ptr(d.final_norm), lm_head=ptr(d.lm_head), inv_freq=ptr(d.inv_freq),
            layer=self.layers)
        self.address = ctypes.addressof(self.struct)

    def bind(self) -> None:
        d = self.d
        self.struct.capacity = d.capacity
        for layer, rk, rv in zip(self.layers, d.ring_k, d.ring_v):
            layer.ring_k, layer.ring_v = ptr(rk), ptr(rv)

    def add_context(self, aux: torch.Tensor) -> None:
        width = self.struct.aux_width
        if aux.shape[1:] != (width,):  # C reads what it is given: shapes are checked here
            raise ValueError(f"aux rows are {list(aux.shape[1:])} wide, the drafter fuses {width}")
        aux = aux.float().contiguous()
        threaded().dflash_add_context(self.address, aux.data_ptr(), aux.shape[0], self.d.context)

    def forward(self, anchor: int, anchor_pos: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        vocab, hidden = self.struct.vocab, self.struct.hidden
        if not 0 <= anchor < vocab:
            raise ValueError(f"anchor {anchor} is not a token id in 0..{vocab - 1}")
        logits, final = torch.empty(block, vocab), torch.empty(block, hidden)
        threaded().dflash_forward(self.address, anchor, anchor_pos, block, logits.data_ptr(), final.data_ptr())
        return logits, final

    def select(self, logits: torch.Tensor, final: torch.Tensor, anchor: int, top_k: int) -> list[int]:
        d, block = self.d, logits.shape[0]
        if top_k > SELECT_MAX_K:
            return select_candidates(logits, final, anchor, d.hidden_projection, d.pred_codebook,
                                     d.succ_codebook, top_k)
        out = (ctypes.c_int * block)()
        threaded().dflash_select(logits.data_ptr(), final.data_ptr(), block, logits.shape[1], final.shape[1],
                                 d.hidden_projection.data_ptr(), d.hidden_projection.shape[0],
                                 d.pred_codebook.data_ptr(), d.succ_codebook.data_ptr(), top_k, anchor, out)
        return list(out)
