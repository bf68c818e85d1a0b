"""The MTP head as a drafter: Qwen3.5's own multi-token-prediction layer (docs/DESIGN.md 2.3).

`MtpDrafter` proposes by chaining one head step per token and keeps the head's KV cache equal to
the committed prefix; its tensors are read and checked by turbo/load/loader.py, and the layer runs on
the step the loader chose (turbo/model/step.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch

from ..backends import ops
from ..model.step import MtpStep
from ..model.trunk import LayerWeights, Trunk
from . import DrafterBase, Sampler


def declared_layers(config: dict) -> int:
    """The MTP layers a checkpoint's config declares (`mtp_num_hidden_layers`, in the text
    config of the ConditionalGeneration layout); 0 where it declares none."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    n = text.get("mtp_num_hidden_layers", 0)
    return n if isinstance(n, int) and not isinstance(n, bool) else 0


def missing_head(where: str, declared: int) -> str:
    """The one line for a config that declares an MTP head whose tensors are not there."""
    return (f"{where} declares mtp_num_hidden_layers {declared}, but the checkpoint has no mtp.* tensors "
            f"(mtp.fc.weight is missing): there is no MTP head to draft with")


@dataclass
class MtpWeights:
    fc: torch.Tensor  # [H, 2H]
    norm_embedding: torch.Tensor  # 1 + w, fp32
    norm_hidden: torch.Tensor
    final_norm: torch.Tensor
    layer: LayerWeights  # one full-attention layer shaped like the trunk's


class MtpDrafter(DrafterBase):
    """Chained drafting with the MTP layer and its own KV cache (positions [start, filled))."""

    kind = "mtp"
    aux_layers: tuple[int, ...] = ()  # reads only the last layer's output (StepOut.hidden)
    window = None

    def __init__(self, trunk: Trunk, weights: MtpWeights, make_step: Callable[[MtpDrafter], MtpStep]):
        self.trunk, self.arch = trunk, trunk.arch
        self.eps = trunk.arch.rms_eps
        self.device = trunk.device
        self.fc, self.norm_embedding, self.norm_hidden = weights.fc, weights.norm_embedding, weights.norm_hidden
        self.final_norm, self.layer = weights.final_norm, weights.layer
        self.make_step = make_step
        self.stepper = make_step(self)  # (binds the weights as loaded: turbo/load/loader.py packs them)
        self.reset()

    def fork(self) -> MtpDrafter:
        twin = copy.copy(self)  # the weights shared; the K/V cache and the step its own
        twin.stepper = self.make_step(twin)
        twin.reset()
        return twin

    # ---- state -------------------------------------------------------------------------

    def reset(self, capacity: int = 256) -> None:
        a = self.arch
        kv = dict(dtype=self.trunk.kv_dtype, device=self.device)  # the trunk's cache dtype
        self.k = torch.zeros(a.num_kv_heads, capacity, a.head_dim, **kv)  # [kv_heads, capacity, head_dim]
        self.v = torch.zeros(a.num_kv_heads, capacity, a.head_dim, **kv)
        self.start = 0  # first cached position (later than 0 only when begin had no prompt tokens)
        self.filled = 0  # cached positions are [start, filled): every one from committed data
        self.last_x: torch.Tensor | None = None  # layer input of row filled-1 (the next draft's first step)
        self.last_token: int | None = None  # the token row filled-1 was paired with: the next anchor

    def reserve(self, end: int) -> None:
        cap = self.k.shape[1]
        if end > cap:
            cap = max(end, 2 * cap)
            k, v = self.k.new_zeros(self.k.shape[0], cap, self.k.shape[2]), self.v.new_zeros(self.v.shape[0], cap,
                                                                                                   self.v.shape[2])
            old = self.k.shape[1]  # scratch rows past `filled` may be live within a propose: copy all
            k[:, :old], v[:, :old] = self.k, self.v
            self.k, self.v = k, v

    # ---- the math ----------------------------------------------------------------------

    def trunk_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """StepOut.hidden (before the final norm) -> what the head reads: after it."""
        return ops.rms_norm(hidden, self.trunk.final_norm, self.eps)

    def fuse(self, hidden: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        """Rows' layer input: fc([norm_e(embed(token)) | norm_h(hidden)]); hidden [R, H] already normed."""
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        e = ops.rms_norm(self.trunk.embed[ids].float(), self.norm_embedding, self.eps)
        h = ops.rms_norm(hidden, self.norm_hidden, self.eps)
        return ops.linear(torch.cat([e, h], dim=-1), self.fc)

    def step_row(self, x: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One row through the layer at `pos`, attending to cached [start, pos] (its own K/V
        written at pos). Returns (out = norm(layer output) [1, H], logits [1, vocab])."""
        return self.stepper.row(x, pos)

    # ---- the engine's hooks ------------------------------------------------------------

    def _append(self, hidden: torch.Tensor, tokens: list[int]) -> None:
        """Committed positions filled.. : their trunk hidden (before the final norm) and the
        token after each. Their K/V go into the cache; the last row's input is kept for the
        next draft's first step."""
        x = self.fuse(self.trunk_hidden(hidden), tokens)
        self.stepper.write(x, self.filled)
        self.filled += len(tokens)
        self.last_x, self.last_token = x[-1:], tokens[-1]

    def begin(self, prompt_out, tokens: list[int] | None = None) -> None:
        """prompt_out: the trunk's prefill over the prompt minus its last token (or None);
        tokens: the prompt ids (the token after position p is tokens[p+1]). Without them the
        prompt's positions cannot be paired, and the first round is a plain step."""
        n = 0 if prompt_out is None else prompt_out.hidden.shape[0]
        self.reset(capacity=n + 256)
        if n == 0:
            return
        if tokens is None or len(tokens) < n + 1:
            self.start = self.filled = n
            return
        self._append(prompt_out.hidden, list(tokens[1:n + 1]))

    def propose(self, anchor: int, anchor_pos: int, block: int) -> list[int]:
        return self._chain(anchor, anchor_pos, block, lambda logits: ops.argmax(logits[0]))

    def propose_sampled(self, anchor: int, anchor_pos: int, block: int,
                        sampler: Sampler) -> tuple[list[int], torch.Tensor | None]:
        """Each chained step draws from the head's processed distribution (the sampler's
        temperature, top-k, top-p, min-p): that row is the proposal's q."""
        qs: list[torch.Tensor] = []

        def pick(logits: torch.Tensor) -> int:
            qs.append(sampler.probs(logits))
            return sampler.draw(qs[-1][0])

        proposals = self._chain(anchor, anchor_pos, block, pick)
        return proposals, torch.cat(qs) if qs else None

    def _chain(self, anchor: int, anchor_pos: int, block: int, pick: Callable[[torch.Tensor], int]) -> list[int]:
        """Up to `block` chained steps; pick(logits [1, vocab]) chooses each step's token."""
        if anchor_pos != self.filled:
            raise ValueError(f"MTP cache holds positions up to {self.filled}, the anchor sits at {anchor_pos}")
        if self.last_x is None:
            # No position before the anchor has been paired (a one-token prompt): there is no
            # hidden state to read, so this round is a plain step.
            return []
        if anchor != self.last_token:
            raise ValueError(f"the anchor {anchor} is not the token {self.last_token} the committed rows ended with")
        # Step 1 re-runs row a-1 (committed data: its K/V are rewritten unchanged) for its
        # output; steps 2.. are rows a.. built from the head's own outputs: scratch K/V that
        # the next commit overwrites before anything reads them.
        x, proposals = self.last_x, []
        for i in range(block):
            out, logits = self.step_row(x, anchor_pos - 1 + i)
            token = pick(logits)
            proposals.append(token)
            if i + 1 < block:
                x = self.fuse(out, [token])
        return proposals

    def snapshot(self) -> tuple:
        """The cache's committed rows [0, filled) and what the next draft starts from."""
        f = self.filled
        last_x = self.last_x.clone() if self.last_x is not None else None
        return self.k[:, :f].clone(), self.v[:, :f].clone(), self.start, f, last_x, self.last_token

    def restore(self, snap: tuple) -> None:
        k, v, self.start, self.filled, self.last_x, self.last_token = snap
        self.reserve(self.filled + 256)
        self.k[:, :self.filled], self.v[:, :self.filled] = k, v

    def commit(self, out, kept: int, tokens: list[int]) -> None:
        """out: a trunk step over rows [anchor, d_1..] at positions filled..; its first `kept`
        rows are committed, tokens[j] the token committed after kept row j (tokens[-1] the
        bonus, the next anchor), so this needs nothing from `propose` and follows plain
        rounds as well."""
        self._append(out.hidden[:kept], tokens)
