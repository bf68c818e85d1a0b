"""The CUDA step's cost plan (issue #55): what one step of CudaTrunkStep launches and reads on the
simulated device (turbo/backends/cuda_sim records), against the floor a step cannot go under (the
weights as stored, the recurrent state, the K/V before the rows), and the step time those imply at a
stated bandwidth and per-launch cost. Computed from counts, never timed. Used by
scripts/gpu_plan.py (the table in docs/benchmarks.md) and tests/test_cuda_plan.py (the rules).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import cuda_sim
from .step import CudaTrunkStep, Matrix

CARDS = {"H100": 3.35e12, "H200": 4.8e12}  # bytes / s: the cards' specified HBM bandwidth
NODE_SECONDS = 2e-6  # what one graph node (a small dependent kernel) is taken to cost


def matrix_bytes(m: Matrix) -> int:
    """Bytes of a matrix as resident: bf16 2 a value; int8 / int4 packed plus bf16 scales and biases."""
    if m.fmt == "bf16":
        return 2 * m.n * m.k
    bits = 8 if m.fmt == "int8" else 4
    return m.n * m.k * bits // 8 + 2 * 2 * m.n * (m.k // m.group)


@dataclass
class Floor:
    """The bytes a step must read: weights (matrices as stored and the small vectors), the GDN
    state and conv window, the K/V of the positions before the rows."""
    weights: int
    state: int
    kv: int
    head: int  # of `weights`: the final norm, lm_head and the embedding rows

    @property
    def total(self) -> int:
        return self.weights + self.state + self.kv


def floor(cs: CudaTrunkStep, pos: int, rows: int, logit_rows: int) -> Floor:
    """The floor of a step of `rows` rows at position `pos` (experts: rows * top_k of them, the
    most a step can touch)."""
    a = cs.arch
    vec = ("in_norm", "post_norm", "conv", "neg_a", "dt_bias", "gnorm", "q_norm", "k_norm")
    weights = state = kv = 0
    for L in cs.layers:
        weights += sum(cs.sizes[L[v]] for v in vec if v in L)
        mats = [L["proj"], L["out"]]
        if L["moe"] is None:
            mats += [L["gate_up"], L["down"]]
        else:
            M = L["moe"]
            mats.append(M["router"])
            if M["shared"] is not None:
                mats += list(M["shared"])
            experts = min(a.num_experts, rows * a.experts_per_token)
            weights += experts * 2 * 3 * a.moe_intermediate * a.hidden  # bf16 gate | up, down
        weights += sum(matrix_bytes(m) for m in mats)
        if L["gdn"]:
            state += 4 * a.lin_v_heads * a.lin_k_dim * a.lin_v_dim + 4 * (a.conv_kernel - 1) * a.lin_conv_dim
        else:
            kv += 2 * 4 * a.num_kv_heads * a.head_dim * pos
            weights += rows * 4 * a.rotary_dim  # RoPE's cos, sin of the rows' positions
    head = cs.sizes[cs.final_norm] + rows * 2 * a.hidden + (matrix_bytes(cs.lm_head) if logit_rows else 0)
    return Floor(weights + head, state, kv, head)


@dataclass
class Part:
    """Launches and kernels' unique bytes of one part of a step (a layer, or the head)."""
    launches: int = 0
    read: int = 0
    written: int = 0
    kernels: list[str] = field(default_factory=list)

    def add(self, r: cuda_sim.Record) -> None:
        self.launches += 1
        self.read += r.bytes_read
        self.written += r.bytes_written
        self.kernels.append(r.name)


@dataclass
class StepCost:
    """One step on the simulated device: per layer, the head (embed, final norm, lm_head), the
    copies (ids and seq block up, logits and hidden rows down)."""
    layers: list[Part]
    head: Part
    copies: int
    copy_bytes: int

    @property
    def launches(self) -> int:
        return self.head.launches + sum(p.launches for p in self.layers)

    @property
    def read(self) -> int:
        return self.head.read + sum(p.read for p in self.layers)

    @property
    def written(self) -> int:
        return self.head.written + sum(p.written for p in self.layers)


def split(records: list[cuda_sim.Record], n_layers: int) -> StepCost:
    """A step's records by layer: each layer's launches open with its input norm and hold one more
    norm (post-attention); the norm after the last layer's is the final norm (no aux layers)."""
    layers = [Part() for _ in range(n_layers)]
    head = Part()
    norms = 0
    copies = copy_bytes = 0
    for r in records:
        if r.kind != "launch":
            copies += 1
            copy_bytes += r.params[2] * (4 if r.name == "D32" else 1)
            continue
        if r.name == "add_rms_norm_f32":
            norms += 1
        layer = (norms - 1) // 2
        (layers[layer] if norms and layer < n_layers else head).add(r)
    return StepCost(layers, head, copies, copy_bytes)


def measure(cs: CudaTrunkStep, st, tokens: list[int], rollback: str | None = None) -> StepCost:
    """Run one step of `tokens` on the simulated device and split its records."""
    cuda_sim.reset_records()
    cs.step(st, tokens, (), rollback)
    return split(cuda_sim.records(), len(cs.layers))


def step_seconds(nbytes: int, nodes: int, bandwidth: float, node_seconds: float = NODE_SECONDS) -> float:
    """The time `nbytes` moved and `nodes` launches imply: bytes at the bandwidth, plus each node's
    cost in series (the layers' launches depend on one another: none hides behind another)."""
    return nbytes / bandwidth + nodes * node_seconds
