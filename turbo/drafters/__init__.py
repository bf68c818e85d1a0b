"""Drafters propose a block of tokens for the trunk to verify.

The engine talks to a drafter only through `Drafter` below. The shipped ones are the
DFlash2 block drafter (`dflash.py`) and the model's MTP head (`mtp.py`); a caller can hand
`Runtime.generate` / `stream` a drafter object of its own (`drafter=obj`): the trunk
verifies every proposal, so any object honouring this protocol is lossless.

One generation calls, in order:
    begin(prompt_out, prompt)            once, after prefill
    propose(anchor, anchor_pos, block)   each speculative round -> up to `block` token ids
    commit(out, kept)                    after each round's verify (plain rounds too)
The adaptive policy decodes plainly for stretches and feeds the drafter lazily: for a plain
round it calls `defer(out, kept)` instead of `commit` and keeps what it returns; before the
next `propose` it hands the kept items to `commit_deferred` in one batch. The default
(`DrafterBase`) keeps the whole step output and commits each in turn.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Drafter(Protocol):
    kind: str  # a short name for stats and reports: "dflash", "mtp", or the caller's own
    aux_layers: tuple[int, ...]  # trunk layers whose outputs the drafter reads (StepOut.aux, in layer order)
    window: int | None  # the context window it keeps (None: unbounded / not applicable)

    def begin(self, prompt_out: Any, prompt: list[int]) -> None:
        """A new generation. prompt_out: the trunk's prefill StepOut over prompt[:-1] (None for
        a one-token prompt); prompt: the prompt's token ids."""

    def propose(self, anchor: int, anchor_pos: int, block: int) -> list[int]:
        """Up to `block` proposals to follow `anchor` (the last committed token, at position
        anchor_pos, not yet through the trunk). Fewer (even none) is allowed."""

    def commit(self, out: Any, kept: int) -> None:
        """The trunk's StepOut of the round's rows [anchor, proposals...]; its first `kept`
        rows are committed (kept - 1 proposals accepted)."""

    def defer(self, out: Any, kept: int) -> Any:
        """What `commit(out, kept)` needs, detached from `out` (kept across plain rounds)."""

    def commit_deferred(self, items: list[Any]) -> None:
        """The same as `commit` for each deferred item in order, in one batch if it can."""


class DrafterBase:
    """Defaults for the lazy-context hooks: keep the whole step output, commit each in turn."""

    kind = "custom"
    aux_layers: tuple[int, ...] = ()
    window: int | None = None

    def begin(self, prompt_out: Any, prompt: list[int]) -> None:
        pass

    def commit(self, out: Any, kept: int) -> None:
        pass

    def defer(self, out: Any, kept: int) -> Any:
        return out, kept

    def commit_deferred(self, items: list[Any]) -> None:
        for out, kept in items:
            self.commit(out, kept)


def is_drafter(obj: object) -> bool:
    return not isinstance(obj, str) and isinstance(obj, Drafter)
