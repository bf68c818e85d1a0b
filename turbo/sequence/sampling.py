"""Sampling and lossless speculative sampling (docs/DESIGN.md 5, "Sampling").

`probabilities` is the one definition of the distribution a generation samples: the plain
path, the target side of a speculative round and the drafters' proposal distributions all
call it. `Sampler` draws from such distributions with the generation's own seeded generator;
`RejectionSampler` is the acceptance rule of a speculative round under sampling (the greedy
rule, temperature 0, is `turbo.sequence.rounds.accept_greedy`).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch

from .options import GenerationOptions, check_sampling, check_seed

TINY_TEMPERATURE = 1e-20  # below it a distribution is its limit, the argmax (logits / T would overflow)


@dataclass(frozen=True)
class SamplingParams:
    """How logits become a distribution: temperature, then top-k, then softmax, then top-p,
    then min-p, renormalised (the order of vLLM's and Hugging Face's samplers)."""

    temperature: float  # >= 0; 0 is the greedy path, which never processes logits
    top_k: int | None = None  # keep the k largest logits (None or 0: all); ties at the k-th are all kept
    top_p: float = 1.0  # keep the fewest most likely tokens whose mass reaches top_p (1: all)
    min_p: float = 0.0  # drop tokens below min_p times the most likely one's probability

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p, self.min_p)


def probabilities(logits: torch.Tensor, s: SamplingParams) -> torch.Tensor:
    """logits [n, V] -> each row's processed distribution [n, V] fp32 (zeros outside its support)."""
    x = logits.float() / s.temperature
    if s.temperature < TINY_TEMPERATURE:
        # logits / T overflows to inf (softmax: nan; T under fp32's range is 0): take the limit,
        # the row's argmax (equal maxima share); above it the plain division, unchanged
        x = logits.float()
        x = torch.where(x == x.amax(-1, keepdim=True), 0.0, -math.inf)
    if s.top_k and s.top_k < x.shape[-1]:
        kth = torch.topk(x, s.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, -math.inf)
    p = torch.softmax(x, dim=-1)
    if s.top_p < 1:
        # stable: among equal probabilities the lower id comes first, so the cut is deterministic
        sorted_p, order = torch.sort(p, dim=-1, descending=True, stable=True)
        drop_sorted = sorted_p.cumsum(-1) - sorted_p >= s.top_p  # the mass before it already reaches top_p
        p = p.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), 0.0)
    if s.min_p > 0:
        p = p.masked_fill(p < s.min_p * p.amax(-1, keepdim=True), 0.0)
    return p / p.sum(-1, keepdim=True)


class Sampler:
    """The processing and one generation's random stream: a CPU torch.Generator seeded once,
    so the same seed draws the same uniforms whatever device the logits live on."""

    def __init__(self, params: SamplingParams, seed: int):
        self.params, self.seed = params, seed
        self.generator = torch.Generator().manual_seed(seed)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return probabilities(logits, self.params)

    def uniform(self) -> float:
        """One uniform in [0, 1) from the generation's stream."""
        return float(torch.rand((), generator=self.generator, dtype=torch.float64))

    def draw(self, p: torch.Tensor) -> int:
        """A token from one distribution p [V] (any non-negative weights) by inverse CDF: the
        first id whose cumulative weight exceeds u * total."""
        cdf = p.detach().double().cpu().cumsum(0)
        i = int(torch.searchsorted(cdf, self.uniform() * float(cdf[-1]), right=True))
        if i >= cdf.shape[0]:  # u * total rounded up to the total: the last id with weight
            i = int(torch.nonzero(p.detach().cpu()).max())
        return i


class RejectionSampler:
    """The speculative acceptance rule that keeps the target distribution exactly.

    Proposal d_i was drawn from q_i (the drafter's distribution given the anchor and d_<i);
    p_i is the trunk's processed distribution after the verify's row i. d_i is accepted with
    probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the next token is drawn
    from the residual max(0, p_i - q_i), normalised, and the round ends; after a fully
    accepted block the bonus is drawn from p_B. Each committed token is then distributed as
    p given the tokens before it, whatever q was. A point mass q (q None: a deterministic
    drafter) accepts with probability p_i(d_i) and resamples from p_i without d_i."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def __call__(self, proposals: list[int], q: torch.Tensor | None, logits: torch.Tensor) -> tuple[int, int]:
        s = self.sampler
        p = s.probs(logits)  # [len(proposals) + 1, V]
        for i, d in enumerate(proposals):
            pd = float(p[i, d])
            qd = 1.0 if q is None else float(q[i, d])
            if s.uniform() * qd < pd:  # u < p/q without dividing (qd > 0: d was drawn from q)
                continue
            if q is None:
                residual = p[i].clone()
                residual[d] = 0.0
            else:
                residual = (p[i] - q[i].to(p.device, p.dtype)).clamp_min(0.0)
            if float(residual.sum()) <= 0.0:  # p == q to rounding: the rejection had probability 0
                residual = p[i]
            return i, s.draw(residual)
        return len(proposals), s.draw(p[len(proposals)])


def rejection_sampler(temperature: float, top_k: int | None, top_p: float, min_p: float,
                      seed: int | None) -> RejectionSampler | None:
    """The generation's acceptance rule: None at temperature 0 (greedy, the other fields
    unused); else a RejectionSampler with its generator seeded from `seed` (None: a fresh
    seed, reported in Stats.seed so the run can be repeated)."""
    params = SamplingParams(temperature, top_k, top_p, min_p)  # checked at temperature 0 too
    check_seed(seed)
    if temperature == 0:
        return None
    return RejectionSampler(Sampler(params, secrets.randbits(63) if seed is None else seed))


def sampling_label(g: GenerationOptions) -> str:
    """"T 0" (greedy), or e.g. "T 0.7 p 0.9 k 40 min_p 0.05 seed 1": the fields that cut."""
    parts = [f"T {g.temperature:g}"]
    if g.temperature:
        parts += [f"p {g.top_p:g}"] if g.top_p < 1 else []
        parts += [f"k {g.top_k}"] if g.top_k else []
        parts += [f"min_p {g.min_p:g}"] if g.min_p else []
        parts += [f"seed {g.seed}"] if g.seed is not None else []
    return " ".join(parts)
