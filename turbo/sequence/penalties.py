"""Penalties and logit_bias, applied to the trunk's logits at every position a round commits.

Row i of a verify predicts the token after the committed history and the round's proposals
before it, so it is processed as if those proposals were already committed: exactly what plain
decoding would have seen at that position. Greedy output is then the unspeculated output token
for token, and the sampled output follows the processed distribution exactly (the acceptance
rule takes any target). The definitions are the APIs' own:

- `repetition_penalty` (transformers' RepetitionPenaltyLogitsProcessor, vLLM's): over every token
  of the prompt and the output, a positive logit is divided by it, a negative one multiplied.
- `frequency_penalty`, `presence_penalty` (OpenAI's): over the output's tokens, subtract
  frequency x count and presence x (count > 0).
- `logit_bias` (OpenAI's): a bias added to the named tokens' logits.

In that order (vLLM's), before the sampler's temperature / top-k / top-p / min-p.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

BIAS_RANGE = 100.0  # OpenAI's bound on a logit_bias value
PENALTY_RANGE = 2.0  # OpenAI's bound on presence / frequency penalties


@dataclass(frozen=True)
class Penalties:
    repetition: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0
    bias: tuple[tuple[int, float], ...] = ()  # (token, bias), token ascending

    @property
    def active(self) -> bool:
        return self.repetition != 1.0 or self.frequency != 0.0 or self.presence != 0.0 or bool(self.bias)


class PenaltyState:
    """One sequence's penalties and what they count: the tokens seen (prompt and output) and the
    output's counts, as committed so far."""

    def __init__(self, penalties: Penalties, prompt: list[int]):
        self.p = penalties
        self.seen: set[int] = set(prompt)  # repetition_penalty's tokens
        self.counts: Counter[int] = Counter()  # the output's, for frequency / presence
        self._bias_ids = torch.tensor([t for t, _ in penalties.bias], dtype=torch.long)
        self._bias = torch.tensor([b for _, b in penalties.bias], dtype=torch.float32)

    def commit(self, tokens: list[int]) -> None:
        self.seen.update(tokens)
        self.counts.update(tokens)

    def rows(self, logits: torch.Tensor, proposals: list[int]) -> torch.Tensor:
        """The processed logits of a round's rows [R, V] (R <= len(proposals) + 1), row i as if
        proposals[:i] were committed; a new tensor (the raw logits stay for logprobs)."""
        out = logits.float().clone()
        for i in range(out.shape[0]):
            self._row(out[i], proposals[:i])
        return out

    def _row(self, row: torch.Tensor, ahead: list[int]) -> None:
        p, dev = self.p, row.device
        if p.repetition != 1.0:
            idx = torch.tensor(sorted(self.seen.union(ahead)), dtype=torch.long, device=dev)
            vals = row[idx]
            row[idx] = torch.where(vals < 0, vals * p.repetition, vals / p.repetition)
        if p.frequency != 0.0 or p.presence != 0.0:
            counts = self.counts + Counter(ahead) if ahead else self.counts
            if counts:
                idx = torch.tensor(list(counts), dtype=torch.long, device=dev)
                n = torch.tensor(list(counts.values()), dtype=row.dtype, device=dev)
                row[idx] -= p.frequency * n + p.presence * (n > 0).to(row.dtype)
        if p.bias:
            row[self._bias_ids.to(dev)] += self._bias.to(dev)
