"""The continuous-batching engine: requests join a running batch, and each step runs every running
sequence's rows (its anchor and its drafter's proposals, or a chunk of its prompt) through one
trunk pass (`Trunk.step_many`); acceptance, rollback and the drafter's commit are per sequence.

    sched = Scheduler(rt, ServeLimits())
    sched.start()
    ticket = sched.submit(Request(ids, GenerationOptions(max_new_tokens=64)), sink)
    # sink(delta) is called on the engine's thread for every step that commits tokens of this
    # request; the last delta has .finish set (or sink receives a TurboError: the request failed)
    ticket.cancel()  # the client went away: its sequence is freed at the next step
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..errors import TurboError
from ..options import GenerationOptions
from ..stats import Stats
from ..stops import Finish


class Overloaded(TurboError):
    """The waiting queue is full (the server answers 429)."""


@dataclass(frozen=True)
class ServeLimits:
    max_running: int = 16  # sequences in the running batch
    max_waiting: int = 64  # requests queued beyond it; more are refused (Overloaded)
    memory_gb: float = 4.0  # K/V caches and recurrent states of the running sequences, reserved at admission
    cache_gb: float = 1.0  # the prefix cache's snapshots (LRU)
    prefill_chunk: int = 256  # prompt rows a sequence runs per step (long prompts do not stall the batch)


@dataclass
class Request:
    ids: list[int]  # the prompt's token ids (a chat's rendered by its template)
    options: GenerationOptions = field(default_factory=GenerationOptions)
    logprobs: int | None = None  # None: none; k >= 0: each generated token's logprob and the top k


@dataclass
class TokenLogprob:
    token: int
    logprob: float  # the trunk's log-softmax at the token (raw logits: before temperature)
    top: list[tuple[int, float]]  # the k most likely (token, logprob), most likely first


@dataclass
class Delta:
    """What one engine step committed for one request."""

    tokens: list[int]
    text: str  # the text released (what may begin a stop string waits: turbo.stops)
    logprobs: list[TokenLogprob] | None = None  # one per token when the request asked
    finish: Finish | None = None  # on the last delta: why it ended
    stats: Stats | None = None  # on the last delta: the request's counters
    cached_tokens: int = 0  # prompt tokens the prefix cache served (no prefill)


Sink = Callable[[Delta | TurboError], None]
