"""The DFlash block-diffusion drafters (docs/DESIGN.md 2.2): their weights, context ring and
math; the pass itself runs on the step the loader chose (turbo/model/step.py).
Their config and shapes are checked in dflash_config.py, their tensors read in turbo/load/loader.py.
One class runs both architectures: DFlash2, and the published DFlash, which is DFlash2
without the grouped conv (its sublayers read their input as is) and without the candidate
selector (a row proposes its logits' argmax).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch

from ..backends.packed import Packed
from ..model.step import DflashStep
from . import DrafterBase, Sampler
from .dflash_config import DflashConfig, DflashShape

DFLASH_RESIDUAL_SCALE = 8.0  # the draft pass divides its residual stream by this so it fits fp16
DFLASH_RING_SLACK = 128


@dataclass
class DflashLayer:
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    q: torch.Tensor | Packed  # matrices: Packed on the native step (load_plan.DFLASH_LAYER, DFLASH_CONV)
    k: torch.Tensor | Packed
    v: torch.Tensor | Packed
    o: torch.Tensor | Packed
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    gate: torch.Tensor | Packed
    up: torch.Tensor | Packed
    down: torch.Tensor | Packed
    attn_proj: torch.Tensor | Packed | None  # the conv's [2 * taps * groups, H] (None: no conv)
    attn_base: torch.Tensor | None  # [2, taps, H]
    mlp_proj: torch.Tensor | Packed | None
    mlp_base: torch.Tensor | None


@dataclass
class DflashWeights:
    embed: torch.Tensor  # [vocab, H]: the trunk's table
    lm_head: torch.Tensor | Packed  # [vocab, H]: the trunk's, in the drafter's dtype (native: packed, a bf16 one bf16)
    fc: torch.Tensor | Packed  # [H, aux_count * H]
    hidden_norm: torch.Tensor  # 1 + w, fp32
    final_norm: torch.Tensor
    hidden_projection: torch.Tensor | None  # [rank, H] fp32 (None: no candidate selector)
    pred_codebook: torch.Tensor | None  # [vocab, rank] fp32
    succ_codebook: torch.Tensor | None
    layers: list[DflashLayer]
    inv_freq: torch.Tensor  # [head_dim / 2]


class DflashDrafter(DrafterBase):
    """Proposes B tokens in one pass from the trunk's aux-layer context.

    `scale` = DFLASH_RESIDUAL_SCALE runs the fp16-safe scaled residual stream
    (identical to scale 1 in exact arithmetic); `dtype` is the activation dtype; `device`
    where the weights (moved once, at load), the ring and the draft pass live -- on cuda the
    grouped conv and the candidate selector run the PTX kernels. On the CPU in fp32 the pass
    and the context rows run in native_dflash.c where it is in use, with the matrix products
    `draft_products` picks (native_lib.draft_layout): "fp32" computes the torch pass's function
    (to rounding); "int8" (weights per output, inputs per row) and "bf16" read fewer bytes
    and do more multiply-adds per instruction; "auto" the fastest the CPU has. The trunk
    checks every proposal: the drafter's precision moves acceptance, never the output.
    Both architectures are kind "dflash" (stats, policy); `architecture` says which."""

    kind = "dflash"

    def __init__(self, cfg: DflashConfig, shape: DflashShape, weights: DflashWeights, window: int,
                 dtype: torch.dtype, scale: float, device: torch.device,
                 make_step: Callable[[DflashDrafter], DflashStep], why_torch: str | None = None):
        self.cfg, self.shape = cfg, shape
        self.architecture = cfg.architecture
        self.window = window
        self.block_size = cfg.block_size
        self.aux_layers = tuple(cfg.target_layers)
        self.dtype, self.scale, self.device = dtype, scale, device
        w = weights
        self.embed, self.lm_head, self.fc = w.embed, w.lm_head, w.fc
        self.hidden_norm, self.final_norm = w.hidden_norm, w.final_norm
        self.hidden_projection, self.pred_codebook, self.succ_codebook = (w.hidden_projection, w.pred_codebook,
                                                                          w.succ_codebook)
        self.layers, self.inv_freq = w.layers, w.inv_freq
        self.make_step = make_step
        self.stepper = make_step(self)  # (binds the weights as loaded: turbo/load/loader.py packs them)
        self.why_torch = why_torch  # why the native pass is not the one in use (None: it is)
        self.reset()

    def fork(self) -> DflashDrafter:
        twin = copy.copy(self)  # the weights shared; the ring and the step's bindings its own
        twin.stepper = self.make_step(twin)
        twin.reset(self.capacity)
        return twin

    @property
    def step_name(self) -> str:
        return self.stepper.name

    # ---- context ring ------------------------------------------------------------------

    def reset(self, capacity: int | None = None) -> None:
        cap = capacity or self.window + DFLASH_RING_SLACK
        kv, d = self.shape.num_kv_heads, self.shape.head_dim
        self.capacity = cap
        # per layer [capacity, kv_heads, head_dim]: position p at slot p % capacity
        self.ring_k = [torch.zeros(cap, kv, d, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.ring_v = [torch.zeros(cap, kv, d, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.context = 0  # context positions added so far (positions 0..context-1)
        self.stepper.bind()

    def add_context(self, aux: torch.Tensor) -> None:
        """Committed rows' fused aux states, in position order from `self.context`."""
        n = aux.shape[0]
        if n == 0:
            return
        self.stepper.add_context(aux)
        self.context += n

    # ---- the draft pass ----------------------------------------------------------------

    def forward_block(self, anchor: int, anchor_pos: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [block, vocab] and final hidden [block, H] of the proposal rows."""
        if anchor_pos != self.context:
            raise ValueError(f"drafter context has {self.context} positions, the anchor sits at {anchor_pos}")
        return self.stepper.forward(anchor, anchor_pos, block)

    def propose(self, anchor: int, anchor_pos: int, block: int) -> list[int]:
        logits, final = self.forward_block(anchor, anchor_pos, block)
        if not self.cfg.has_selector:
            return logits.argmax(dim=-1).tolist()  # ties: the lower id, as the selector's
        top_k = min(self.cfg.top_k, logits.shape[-1])
        return self.stepper.select(logits, final, anchor, top_k)

    def propose_sampled(self, anchor: int, anchor_pos: int, block: int,
                        sampler: Sampler) -> tuple[list[int], torch.Tensor]:
        """The selector's sampling path (docs/DESIGN.md 5, "Sampling"), torch-side from the
        pass's logits and final hidden. Row i's candidates are its top-k logits, scored as
        the greedy selector scores them given the predecessor (the anchor, then the token
        row i-1 drew); q_i = the sampler's processing of those scores (temperature, then
        top-k / top-p / min-p within the candidates), zero off the candidates; the token is
        drawn from q_i by inverse CDF over the candidates in top-k order. Without a selector (the
        published DFlash) the rows do not read each other's tokens: q_i is the sampler's
        processing of row i's logits, and each row draws from its own."""
        logits, final = self.forward_block(anchor, anchor_pos, block)
        logits, final = logits.float(), final.float()
        if not self.cfg.has_selector:
            q = sampler.probs(logits)
            return [sampler.draw(row) for row in q], q
        cand = torch.topk(logits, min(self.cfg.top_k, logits.shape[-1]), dim=-1).indices
        proj = final @ self.hidden_projection.float().T
        q = torch.zeros_like(logits)
        pred, out = anchor, []
        for i in range(logits.shape[0]):
            c = cand[i]
            score = logits[i, c] + (self.succ_codebook[c].float() @ (self.pred_codebook[pred].float() * proj[i]))
            qc = sampler.probs(score[None])[0]
            q[i, c] = qc
            pred = int(c[sampler.draw(qc)])
            out.append(pred)
        return out, q

    # ---- the engine's hooks ------------------------------------------------------------

    def begin(self, prompt_out, tokens: list[int] | None = None) -> None:
        """A new generation: the prompt's aux states (all but the last token) become the context."""
        self.reset(self.capacity)
        if prompt_out is not None:
            self.add_context(prompt_out.aux)

    def commit(self, out, kept: int, tokens: list[int]) -> None:
        self.add_context(out.aux[:kept])  # the aux rows carry everything (tokens unused)

    def defer(self, out, kept: int, tokens: list[int]) -> torch.Tensor:
        # the aux rows are all it reads: holding a plain round's whole output (its logits)
        # through a plain stretch costs a plain round ~8% (fresh memory every step)
        return out.aux[:kept].clone()

    def commit_deferred(self, items: list[torch.Tensor]) -> None:
        if items:
            self.add_context(torch.cat(items))

    def snapshot(self) -> tuple[int, list[torch.Tensor], list[torch.Tensor]]:
        """The ring as it is (window + slack rows a layer): its context rows are all a pass reads."""
        return self.context, [k.clone() for k in self.ring_k], [v.clone() for v in self.ring_v]

    def restore(self, snap: tuple[int, list[torch.Tensor], list[torch.Tensor]]) -> None:
        context, ks, vs = snap
        if ks[0].shape[0] != self.capacity:
            self.reset(ks[0].shape[0])
        for ring, saved in zip(self.ring_k + self.ring_v, ks + vs):
            ring.copy_(saved)  # in place: the step holds the rings' addresses (bind)
        self.context = context
