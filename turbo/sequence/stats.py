"""The counters of docs/DESIGN.md 5, with their exact definitions (vLLM's names)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields, replace


def derived(rounds: int, accepted: int, rollbacks: int, reached: list[int], landed: list[int]) -> dict:
    """The figures docs/DESIGN.md 5 defines from the raw counts (one generation's, or summed over many)."""
    per_round = accepted / (rounds or 1)
    return {"accepted_per_round": per_round, "mean_acceptance_length": 1.0 + per_round,
            "rollback_rate": rollbacks / (rounds or 1),
            "per_position_acceptance": [l / r if r else 0.0 for l, r in zip(landed, reached)]}


def widen(reached: list, landed: list, width: int) -> None:
    """Grow both per-position count lists to at least `width` positions."""
    reached += [0] * (width - len(reached))
    landed += [0] * (width - len(landed))


def count_positions(reached: list, landed: list, drafted: int, accepted: int) -> None:
    """Add one round to the per-position counts (lists at least `drafted` long): proposal i+1
    was judged (reached) when the i before it were all accepted, and landed when it was too."""
    for i in range(min(drafted, accepted + 1)):
        reached[i] += 1
        if i < accepted:
            landed[i] += 1


@dataclass
class Counts:
    """The raw counts of docs/DESIGN.md 5: one generation's (Stats), or summed over many (the probe)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    # rounds played, proposals drafted, of them accepted; rounds that rolled back, rows they replayed
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    rollbacks: int = 0
    replayed_rows: int = 0
    # reached[i]: rounds in which proposal i+1 was judged (all before it accepted);
    # landed[i]: rounds in which it was accepted too.
    reached: list[int] = field(default_factory=list, repr=False)
    landed: list[int] = field(default_factory=list, repr=False)

    def add(self, other: Counts) -> None:
        """Sum another's counts into these."""
        for name in COUNT_FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        widen(self.reached, self.landed, len(other.reached))
        for i, (r, l) in enumerate(zip(other.reached, other.landed)):
            self.reached[i] += r
            self.landed[i] += l

    def derived(self) -> dict:
        return derived(self.rounds, self.accepted, self.rollbacks, self.reached, self.landed)


COUNT_FIELDS = tuple(f.name for f in fields(Counts) if f.name not in ("reached", "landed"))


@dataclass
class TokenClock:
    """A generation's clock: when it started, and when and after how many tokens its first round
    committed (Stats.record_tokens)."""

    start: float = field(default_factory=time.perf_counter)
    first: float | None = None
    first_count: int = 0


@dataclass
class Stats(Counts):
    """One generation's counts, the figures derived from them, its timings and what it ran."""

    accepted_per_round: float = 0.0
    mean_acceptance_length: float = 0.0
    rollback_rate: float = 0.0
    per_position_acceptance: list[float] = field(default_factory=list)
    ttft_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    policy: str = "off"
    drafter: str | None = None
    block: int = 0
    window: int | None = None
    rollback: str = "checkpoint"
    backend: str = "cpu"
    speculation_off_reason: str | None = None
    seed: int | None = None  # the sampling generator's seed (None: greedy, temperature 0)
    prompt_truncated_from: int | None = None  # truncate_prompt=left: the prompt's length before (None: whole)

    def record_round(self, block: int, accepted: int, replayed: int) -> None:
        self.rounds += 1
        self.drafted += block
        self.accepted += accepted
        self.replayed_rows += replayed
        if accepted < block:
            self.rollbacks += 1
        widen(self.reached, self.landed, block)
        count_positions(self.reached, self.landed, block, accepted)
        for name, value in self.derived().items():
            setattr(self, name, value)

    def record_tokens(self, generated: int, clock: TokenClock) -> None:
        """After a round committed tokens (`generated` in all): time to first token, the prefill
        rate, and the decode rate since the first round."""
        now = time.perf_counter()
        if clock.first is None:
            clock.first, clock.first_count = now, generated
            self.ttft_s = now - clock.start
            self.prefill_tokens_per_s = self.prompt_tokens / self.ttft_s
        elif now > clock.first:
            self.decode_tokens_per_s = (generated - clock.first_count) / (now - clock.first)
        self.generated_tokens = generated

    def snapshot(self) -> Stats:
        """A copy that later rounds do not change (the lists are the only mutable fields)."""
        return replace(self, per_position_acceptance=list(self.per_position_acceptance),
                       reached=list(self.reached), landed=list(self.landed))

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("reached")
        d.pop("landed")
        return d

    def line(self) -> str:
        """The one stats line the CLI ends with."""
        parts = [f"prompt {self.prompt_tokens} tok", f"generated {self.generated_tokens} tok",
                 f"ttft {self.ttft_s * 1000:.1f} ms", f"prefill {self.prefill_tokens_per_s:.1f} tok/s",
                 f"decode {self.decode_tokens_per_s:.1f} tok/s"]
        if self.prompt_truncated_from is not None:
            parts.insert(1, f"prompt truncated: kept the last {self.prompt_tokens} "
                            f"of {self.prompt_truncated_from} tokens")
        if self.seed is not None:
            parts.append(f"seed {self.seed}")
        if self.drafter:
            parts += [f"{self.drafter} block {self.block}", f"rounds {self.rounds}",
                      f"accepted/round {self.accepted_per_round:.2f}",
                      f"mean acceptance length {self.mean_acceptance_length:.2f}",
                      f"rollback rate {self.rollback_rate:.0%}", f"replayed rows {self.replayed_rows}",
                      "per-position " + " ".join(f"{p:.2f}" for p in self.per_position_acceptance)]
        else:
            parts.append(f"speculation off: {self.speculation_off_reason}")
        return "[stats] " + " | ".join(parts)
