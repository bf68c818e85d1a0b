"""What a step reads and leaves, and the three steps a backend provides.

A Runtime picks one step per part when it loads (turbo/load/loader.py): the native CPU step
(turbo/backends/native_trunk.py, native_dflash.py: native.c and native_dflash.c) where it can
run, else the torch step (turbo/backends/torch_step.py: the CPU reference, whose ops run the
CUDA kernels on backend=cuda). The trunk and the drafters hold the weights and call their step; they never
ask which one it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class TrunkState:
    """Everything one sequence has cached: `pos` positions are committed."""

    pos: int
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> K, V [Hkv, capacity, d] in the trunk's kv_dtype
    gdn: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> state [Hv, dk, dv] fp32, conv window [K-1, C]
    # rows at index i >= pos rotate at position i + rope_delta (< 0 after an image: turbo/vision/positions.py)
    rope_delta: int = 0
    # a step's buffers kept for this sequence (the native step's states: `NativeTrunkStep.spare`)
    scratch: dict = field(default_factory=dict, repr=False, compare=False)


@dataclass
class GdnTrace:
    """What one GDN layer's verify leaves behind for a rollback."""

    snapshot: torch.Tensor  # [Hv, dk, dv]: the state before the verify (never mutated: the recurrence is functional)
    ext: torch.Tensor  # [K-1+R, C]: the conv window before the verify, then the rows' conv inputs
    inputs: tuple[torch.Tensor, ...] | None  # per-row q, k, v [R, Hv, d], g, beta [R, Hv] (replay)
    states: list[torch.Tensor] | None  # R x [Hv, dk, dv]: the state after every row (checkpoint)


@dataclass
class StepOut:
    logits: torch.Tensor  # [R, vocab] fp32
    hidden: torch.Tensor  # [R, hidden]: the last layer's output, before the final norm
    aux: torch.Tensor | None  # [R, n_aux * hidden]: the requested layers' outputs, concatenated
    traces: dict[int, GdnTrace] = field(default_factory=dict)


class TrunkStep(Protocol):
    """R rows through the trunk one after another's state (R = 1 a decode step, R = B + 1 a
    verify), row-stable: a verify row equals the decode step it stands for, bit for bit."""

    name: str  # "native" | "torch"
    # every prefill row equals the decode step it stands for, bit for bit (so a state prefilled in
    # two pieces is the one prefill would give: a chat session may go on from it)
    prefill_rows_are_steps: bool

    def step(self, st: TrunkState, tokens: list[int], aux_layers: tuple[int, ...],
             rollback: str | None) -> StepOut:
        """rollback: None (none possible), "checkpoint" (keep the state after every row) or
        "replay" (keep the rows' recurrence inputs)."""

    def step_many(self, states: list[TrunkState], tokens: list[list[int]], aux_layers: list[tuple[int, ...]],
                  rollback: list[str | None], logit_rows: list[int]) -> list[StepOut]:
        """`step` for several sequences (distinct states; each at least one row) in one pass:
        per sequence the StepOut its `step` gives, bit for bit whatever the other sequences
        (batch invariance), but logits only for its last logit_rows[i] rows (0: a prefill
        chunk that does not end the prompt). Every state advances as its `step` advances it."""

    def replay(self, trace: GdnTrace, kept: int) -> torch.Tensor:
        """The state after the first `kept` rows, recomputed from the snapshot by the same
        recurrence code the verify ran."""

    def prefill(self, st: TrunkState, tokens: list[int], aux_layers: tuple[int, ...], want_logits: bool,
                mm=None) -> StepOut:
        """The prompt from an empty state whose caches hold it: logits the last row's (every
        row's with want_logits); it may compute differently from `step` (within the parity
        tests' tolerance), never with a working set that grows past the caches and a chunk.
        mm (turbo.vision.positions.MmRows): the image rows' embeddings and every row's rotary
        positions; the state keeps its delta."""


class MtpStep(Protocol):
    """The MTP head's decoder layer and head over its own K/V cache."""

    name: str

    def write(self, x: torch.Tensor, p0: int) -> None:
        """Rows x [R, H] at p0..: their K/V into the cache (committed rows)."""

    def row(self, x: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One row [1, H] at `pos`, attending to the cache [start, pos]: (norm(layer out) [1, H], logits [1, vocab])."""


class DflashStep(Protocol):
    """A DFlash drafter's context rows, block pass and (DFlash2's) candidate selection."""

    name: str

    def bind(self) -> None:
        """The drafter's rings were (re)allocated."""

    def add_context(self, aux: torch.Tensor) -> None:
        """Committed rows' fused aux states [n, aux_width], at positions context..context+n-1."""

    def forward(self, anchor: int, anchor_pos: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [block, vocab] and final hidden [block, H] of the proposal rows."""

    def select(self, logits: torch.Tensor, final: torch.Tensor, anchor: int, top_k: int) -> list[int]:
        """Each row's token: its top-k rescored by the bigram selector (DFlash2 only: the
        published DFlash has no selector, and its drafter takes the argmax without a call)."""
