"""The Qwen3.5 trunk: embedding, hybrid layers, head (docs/DESIGN.md 2.1), on the CPU or a GPU.

`Trunk` holds the weights (read and checked by turbo/load/loader.py) and a sequence's state, and hands
the math to the step the loader chose (turbo/model/step.py: native*.c, or torch_step.py, which
also runs the PTX kernels on cuda): `prefill` a whole prompt; `step` R rows (1: a decode step,
B + 1: a verify, each row equal to its decode step bit for bit), leaving what `rollback` needs;
`step_many` the steps of many sequences in one pass (a continuous batch), each its solo bits.
`extend` runs more prompt rows on a state that holds some (a chat session's next turn);
`snapshot` / `restore` keep and put back a state's position and recurrent state.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from ..store.arch import Arch
from .step import StepOut, TrunkState, TrunkStep

PREFIX = "trunk."
# positions a generation's state reserves past its prompt; the cache grows (Trunk.reserve) as the
# sequence does, so max_new_tokens is a limit, not an allocation
KV_CHUNK = 256
# rows a step of `extend`: a step's logits cover every row ([64, vocab] fp32: 64 MB at a 248K vocabulary)



@dataclasses.dataclass
class DynamicNtk:
    """transformers' dynamic NTK RoPE (_compute_dynamic_ntk_parameters with dynamic_rope_update):
    a sequence of length s past the `window` (max_position_embeddings) rotates with the
    frequencies of base theta * (factor * s / window - (factor - 1)) ** (dim / (dim - 2)), in
    fp32 as there; up to the window, with the plain ones (`base`). transformers recomputes them at
    each forward for its positions' end, and its cache keeps every key as rotated then: a prompt
    run from position 0 rotates all its rows for its own length, and a row after it (a decode
    step) for its position + 1. rope_cos_sin does the same row by row, so a verify row equals its
    decode step. Runs on the torch step only (load_plan: the native one keeps one table)."""
    base: torch.Tensor  # [dim / 2]
    theta: float
    factor: float
    window: int
    cache: dict = dataclasses.field(default_factory=dict, init=False, repr=False)

    def at(self, length: int) -> torch.Tensor:
        """The frequencies of a sequence of `length`."""
        if length <= self.window:
            return self.base
        if length not in self.cache:
            if len(self.cache) > 4096:
                self.cache.clear()
            dim = 2 * self.base.shape[0]
            s = torch.tensor(length, dtype=torch.int64)  # (a tensor in transformers' forward: fp32 math)
            theta = self.theta * ((self.factor * s / self.window) - (self.factor - 1)) ** (dim / (dim - 2))
            exps = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
            self.cache[length] = (1.0 / (theta ** exps)).to(self.base.device)
        return self.cache[length]

    def rows(self, positions: torch.Tensor) -> torch.Tensor:
        """[R, dim / 2]: each row's frequencies (above)."""
        pos = positions.tolist()
        lengths = [len(pos)] * len(pos) if pos and pos[0] == 0 else [p + 1 for p in pos]
        return torch.stack([self.at(n) for n in lengths])


@dataclass
class RecurrentSnapshot:
    pos: int
    gdn: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> GDN state, conv window (copies)
    rope_delta: int = 0  # TrunkState.rope_delta then

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes + w.nbytes for s, w in self.gdn.values())


@dataclass
class AttnWeights:
    qkv: torch.Tensor  # [2*H*d (query|gate per head) + 2*Hkv*d, hidden]
    o: torch.Tensor
    q_norm: torch.Tensor  # 1 + w, fp32
    k_norm: torch.Tensor


@dataclass
class GdnWeights:
    in_proj: torch.Tensor  # [qkv | z | b | a] rows fused
    conv: torch.Tensor  # [C, K] fp32
    neg_a: torch.Tensor  # -exp(A_log), fp32
    dt_bias: torch.Tensor
    norm: torch.Tensor  # plain weight, fp32
    out: torch.Tensor


@dataclass
class MoeWeights:
    """One layer's mixture of experts: the router, every expert, the gated shared expert."""

    router: torch.Tensor  # [E, hidden]
    gate_up: list[torch.Tensor]  # E x [2*I, hidden] (gate rows | up rows)
    down: list[torch.Tensor]  # E x [hidden, I]
    shared_gate_up: torch.Tensor | None  # [2*S, hidden]; None: no shared expert (S = 0)
    shared_down: torch.Tensor | None  # [hidden, S]
    shared_gate: torch.Tensor | None  # [1, hidden]: sigmoid of it scales the shared expert

    def matrices(self) -> list[torch.Tensor]:
        shared = [self.shared_gate_up, self.shared_down, self.shared_gate] if self.shared_gate_up is not None else []
        return [self.router, *self.gate_up, *self.down, *shared]


@dataclass
class LayerWeights:
    gdn: bool  # a Gated DeltaNet layer (else gated attention)
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    mixer: AttnWeights | GdnWeights
    gate_up: torch.Tensor | None  # the dense MLP (None in an MoE layer)
    down: torch.Tensor | None
    moe: MoeWeights | None = None  # the MoE block, in place of the dense MLP

    def mlp_matrices(self) -> list[torch.Tensor]:
        return self.moe.matrices() if self.moe is not None else [self.gate_up, self.down]


@dataclass
class TrunkWeights:
    embed: torch.Tensor  # [vocab, hidden]
    lm_head: torch.Tensor  # [vocab, hidden] (the embedding itself when tied)
    final_norm: torch.Tensor  # 1 + w, fp32
    layers: list[LayerWeights]
    inv_freq: torch.Tensor | DynamicNtk  # [rotary_dim / 2], or by the sequence's length (dynamic RoPE)


def trunk_matrices(w: TrunkWeights | Trunk) -> list[torch.Tensor]:
    """Every weight the decode/verify path multiplies by."""
    mats = [w.lm_head]
    for layer in w.layers:
        m = layer.mixer
        mats += [m.in_proj, m.out] if layer.gdn else [m.qkv, m.o]
        mats += layer.mlp_matrices()
    return mats


class Trunk:
    def __init__(self, arch: Arch, weights: TrunkWeights, dtype: torch.dtype, device: torch.device,
                 kv_dtype: torch.dtype, make_step: Callable[[Trunk], TrunkStep], why_torch: str | None = None):
        self.arch, self.dtype, self.device = arch, dtype, device
        self.kv_dtype = kv_dtype  # the attention layers' K/V caches (turbo.load.loader.kv_dtype)
        self.embed, self.lm_head, self.final_norm = weights.embed, weights.lm_head, weights.final_norm
        self.layers, self.inv_freq = weights.layers, weights.inv_freq
        self.stepper = make_step(self)  # (may repack the matrices for its own products)
        self.why_torch = why_torch  # why the native step is not the one in use (None: it is)

    @property
    def step_name(self) -> str:
        return self.stepper.name

    def matrices(self) -> list[torch.Tensor]:
        return trunk_matrices(self)

    # ---- state -------------------------------------------------------------------------

    def new_state(self, capacity: int = 256) -> TrunkState:
        a, dev = self.arch, self.device
        kv = {i: (torch.zeros(a.num_kv_heads, capacity, a.head_dim, dtype=self.kv_dtype, device=dev),
                  torch.zeros(a.num_kv_heads, capacity, a.head_dim, dtype=self.kv_dtype, device=dev))
              for i in a.full_layers}  # K, V [kv_heads, capacity, head_dim] per full-attention layer
        gdn = {i: (torch.zeros(a.lin_v_heads, a.lin_k_dim, a.lin_v_dim, device=dev),
                   torch.zeros(a.conv_kernel - 1, a.lin_conv_dim, device=dev))
               for i in range(a.num_layers) if a.is_gdn(i)}
        return TrunkState(0, kv, gdn)

    def reserve(self, st: TrunkState, end: int) -> None:
        """Room for positions [0, end): a cache short of it is replaced by one twice as long (no
        longer than the context allows, unless `end` is past it), its rows copied. Every step
        calls this before writing K/V and reads the buffers' addresses after it."""
        for i, (k, v) in st.kv.items():
            old = k.shape[1]
            if old < end:
                cap = max(end, min(2 * old, self.arch.max_positions))
                k2, v2 = k.new_zeros(k.shape[0], cap, k.shape[2]), v.new_zeros(v.shape[0], cap, v.shape[2])
                # every row (a restored snapshot's K/V may lie past st.pos after a rollback)
                k2[:, :old], v2[:, :old] = k, v
                st.kv[i] = (k2, v2)

    def snapshot(self, st: TrunkState) -> RecurrentSnapshot:
        """What cannot be cut back: the GDN and conv states (K/V needs only its length)."""
        return RecurrentSnapshot(st.pos, {i: (s.clone(), w.clone()) for i, (s, w) in st.gdn.items()}, st.rope_delta)

    def restore(self, st: TrunkState, snap: RecurrentSnapshot) -> None:
        """Back to the snapshot's position. Its K/V rows below that position must still be the
        ones written then (the caller's to keep: later rows only ever overwrite later positions)."""
        st.pos, st.rope_delta = snap.pos, snap.rope_delta
        st.gdn = {i: (s.clone(), w.clone()) for i, (s, w) in snap.gdn.items()}

    # ---- prefill -----------------------------------------------------------------------

    def prefill(self, st: TrunkState, tokens: list[int], aux_layers: tuple[int, ...] = (),
                want_logits: bool = False, mm=None) -> StepOut:
        """The prompt at once, from an empty state (logits: the last row's, or every row's).
        mm (turbo.vision.positions.MmRows): a prompt with images, its image rows' embeddings and
        multimodal positions; the rows stepped after it rotate at index + mm.delta."""
        if st.pos != 0:
            raise ValueError("prefill starts from an empty state")
        self.reserve(st, len(tokens))
        if mm is None:
            return self.stepper.prefill(st, tokens, aux_layers, want_logits)
        return self.stepper.prefill(st, tokens, aux_layers, want_logits, mm)

    def extend(self, st: TrunkState, tokens: list[int], aux_layers: tuple[int, ...] = (), mm=None) -> StepOut:
        """Prompt rows after the `st.pos` the state holds (a chat session's next turn), run as the
        step's prefill runs them: only where its prefill rows are its decode steps bit for bit
        (the native step), so two pieces give the bits one prefill gives; the logits are the
        last row's. mm: as prefill's, for these rows (turbo.vision.positions.rows_between)."""
        if not self.stepper.prefill_rows_are_steps:
            raise ValueError(f"the {self.stepper.name} step's prefill is not its steps: prefill afresh")
        self.reserve(st, st.pos + len(tokens))
        if mm is None:
            return self.stepper.prefill(st, tokens, aux_layers, False)
        return self.stepper.prefill(st, tokens, aux_layers, False, mm)

    # ---- decode / verify ---------------------------------------------------------------

    def step(self, st: TrunkState, tokens: list[int], aux_layers: tuple[int, ...] = (),
             rollback: str | None = None) -> StepOut:
        """R rows at positions pos..pos+R-1; leaves the state after the last row.

        rollback: None (no rollback possible), "checkpoint" (keep the state after every row)
        or "replay" (keep the rows' recurrence inputs to replay from the snapshot)."""
        return self.stepper.step(st, tokens, aux_layers, rollback)

    def step_many(self, states: list[TrunkState], tokens: list[list[int]], aux_layers: list[tuple[int, ...]],
                  rollback: list[str | None], logit_rows: list[int]) -> list[StepOut]:
        """`step` for many sequences in one pass (a continuous batch): sequence i's tokens[i] rows
        at its positions, its aux_layers[i], its rollback[i] mode; logits only for its last
        logit_rows[i] rows (0 for a prefill chunk that does not end the prompt, 1 for the one
        that does, R for a decode step or a verify). Each StepOut equals, bit for bit, what
        `step` gives the sequence alone (its logits those rows'); empty lists: []."""
        check_step_many(self, states, tokens, aux_layers, rollback, logit_rows)
        return self.stepper.step_many(states, tokens, aux_layers, rollback, logit_rows)

    def rollback(self, st: TrunkState, out: StepOut, rows: int, kept: int, rollback: str) -> int:
        """Keep the first `kept` of the `rows` just stepped. Returns the rows replayed."""
        if kept == rows:
            return 0
        taps = self.arch.conv_kernel
        st.pos -= rows - kept  # attention: positions past the kept rows are simply overwritten later
        replayed = 0
        for i, tr in out.traces.items():
            window = tr.ext[kept:kept + taps - 1]
            if rollback == "checkpoint":
                state = tr.states[kept - 1] if kept else tr.snapshot
            else:
                state = self.stepper.replay(tr, kept)  # the recurrence code the verify ran
                replayed = kept
            st.gdn[i] = (state, window)
        return replayed


def check_step_many(trunk, states: list[TrunkState], tokens: list[list[int]], aux_layers: list[tuple[int, ...]],
                    rollback: list[str | None], logit_rows: list[int]) -> None:
    """step_many's arguments checked (one entry of each per state, no state twice, each sequence's
    rows, logit rows and rollback in range) and each state's K/V reserved for its rows (`trunk`:
    a Trunk, or a trunk over several processes: turbo/parallel)."""
    if not len(states) == len(tokens) == len(aux_layers) == len(rollback) == len(logit_rows):
        raise ValueError("step_many takes one tokens, aux_layers, rollback and logit_rows entry per state")
    if len({id(st) for st in states}) != len(states):
        raise ValueError("step_many got one state twice")
    for st, tk, k, rb in zip(states, tokens, logit_rows, rollback):
        if not tk or not 0 <= k <= len(tk) or rb not in (None, "checkpoint", "replay"):
            raise ValueError(f"step_many: {len(tk)} tokens, {k} logit rows, rollback {rb!r}")
        trunk.reserve(st, st.pos + len(tk))
