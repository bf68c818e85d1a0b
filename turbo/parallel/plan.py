"""What a parallel plan asks of the model, checked at open before any rank loads a weight, and the
pipeline's stages: contiguous layer ranges balanced by the bytes their tensors hold.

Every refusal is one line (TurboError: the CLI's exit 2), so that a plan the model cannot take
ends before processes are spawned or weights mapped.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import TurboError
from ..model.trunk import PREFIX
from ..sequence.options import Parallel
from ..store.arch import Arch
from ..store.install import Entry

WORLD_ENV = "WORLD_SIZE"  # torchrun's (env:// rendezvous): the processes it started


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: layers [lo, hi) of the trunk, on rank `rank`."""

    rank: int
    lo: int
    hi: int

    @property
    def layers(self) -> range:
        return range(self.lo, self.hi)


def check_plan(arch: Arch, plan: Parallel, environ: Mapping[str, str] | None = None) -> None:
    """Refuses, in one line, a plan this model cannot take: more stages than layers, a tensor split
    the heads do not allow, more expert ranks than experts (or any on a dense model), a world
    that differs from the one torchrun started; and the splits not built yet (tensor, experts)."""
    env = os.environ if environ is None else environ
    p, t, e = plan.pipeline, plan.tensor, plan.experts
    if p > arch.num_layers:
        raise TurboError(f"parallel.pipeline={p}: the model has only {arch.num_layers} layers (one stage holds at "
                         "least one)", field="parallel.pipeline")
    if t > 1:
        # attention splits by K/V heads (each rank whole query groups); GDN by key-head groups,
        # their value heads following (a rank with fewer groups pads: T may not exceed them)
        if arch.num_kv_heads % t:
            raise TurboError(f"parallel.tensor={t} does not divide the model's {arch.num_kv_heads} K/V heads "
                             "(attention splits by whole K/V heads)", field="parallel.tensor")
        if t > arch.lin_k_heads:
            raise TurboError(f"parallel.tensor={t} is more than the model's {arch.lin_k_heads} Gated DeltaNet key "
                             "heads (each rank holds at least one key-head group)", field="parallel.tensor")
    if e > 1:
        if not arch.moe_layers:
            raise TurboError(f"parallel.experts={e}: the model is dense (no MoE layer to spread)",
                             field="parallel.experts")
        if e > arch.num_experts:
            raise TurboError(f"parallel.experts={e} is more than the model's {arch.num_experts} routed experts",
                             field="parallel.experts")
    given = env.get(WORLD_ENV)
    if given is not None and given.strip() and given.strip() != str(plan.world):
        raise TurboError(f"parallel: pipeline {p} x tensor {t} x experts {e} is {plan.world} processes, but "
                         f"{WORLD_ENV} is {given.strip()} (torchrun's --nnodes x --nproc-per-node)",
                         field="parallel")
    if t > 1 or e > 1:
        raise TurboError(f"parallel.tensor={t} parallel.experts={e}: only the pipeline split is built in this "
                         "version (tensor=1 experts=1)", field="parallel")


def layer_bytes(entries: Mapping[str, Entry], layers: int) -> list[int]:
    """Each layer's bytes in the install (its tensors' payloads, scales and biases)."""
    sizes = [0] * layers
    head = PREFIX + "layers."
    for name, e in entries.items():
        if name.startswith(head):
            i = int(name[len(head):].split(".", 1)[0])
            if i < layers:
                sizes[i] += e.size_bytes + e.scale_size + e.bias_size
    return sizes


def rank0_bytes(entries: Mapping[str, Entry]) -> int:
    """What rank 0 holds beside its layers: the embedding and the head (trunk tensors not in a layer)."""
    head = PREFIX + "layers."
    return sum(e.size_bytes + e.scale_size + e.bias_size for name, e in entries.items()
               if name.startswith(PREFIX) and not name.startswith(head))


def stages(sizes: list[int], count: int, first_extra: int = 0) -> list[Stage]:
    """`count` contiguous ranges of the layers whose `sizes` are given, each at least one layer,
    the largest stage's bytes as small as can be (a stage's memory and time are about its bytes:
    the slowest stage sets the pipeline's pace); the first stage also holds `first_extra` bytes
    (rank 0's embedding and head). Exact by dynamic programming: n x count is small."""
    n = len(sizes)
    if not 1 <= count <= n:
        raise ValueError(f"{count} stages over {n} layers")
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    # best[k][j]: the least largest stage over the first j layers in k stages; cut[k][j] its last cut
    best = [[inf] * (n + 1) for _ in range(count + 1)]
    cut = [[0] * (n + 1) for _ in range(count + 1)]
    best[0][0] = 0
    for k in range(1, count + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                worst = max(best[k - 1][i], prefix[j] - prefix[i] + (first_extra if k == 1 else 0))
                if worst < best[k][j]:  # (strict: ties keep the earlier cut, so the plan is stable)
                    best[k][j], cut[k][j] = worst, i
    bounds, j = [], n
    for k in range(count, 0, -1):
        bounds.append((cut[k][j], j))
        j = cut[k][j]
    return [Stage(r, lo, hi) for r, (lo, hi) in enumerate(reversed(bounds))]
