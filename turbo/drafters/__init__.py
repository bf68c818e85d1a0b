"""Drafters propose a block of tokens for the trunk to verify. The whole API is declared here:

- `Drafter`: what every drafter has, a caller's own object too (the trunk verifies every
  proposal). A generation calls begin, then per round propose (propose_sampled under sampling)
  and commit, or defer / commit_deferred through the adaptive policy's plain rounds
  (docs/DESIGN.md 5; turbo/sequence/driver.py is the one caller).
- `KeepsContext`: a drafter whose context outlives a generation: snapshot / restore / resume (a
  chat session's next turn and the server's prefix cache go on from a kept state), and fork (one
  context per sequence of a batch). `keeps_context` says whether a drafter has it.

`DrafterBase` holds defaults only; the shipped drafters: `dflash` (DFlash2 or the published
DFlash), `mtp` (the model's MTP head), `ngram` (no weights).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


class Sampler(Protocol):
    """What a drafter's sampling path may ask of the generation's sampler (turbo.sequence.sampling.Sampler):
    a drafter proposes from its own distribution q and the round accepts against the target, so it
    needs the same processing (temperature, top-k / top-p / min-p) and the same random stream."""

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The processed distribution of each row of `logits` [..., vocab]."""
        ...

    def draw(self, p: torch.Tensor) -> int:
        """One token from the weights p [vocab], by the generation's next uniform."""
        ...


@runtime_checkable
class Drafter(Protocol):
    kind: str  # a short name for stats and reports: "dflash", "mtp", "ngram", or the caller's own
    aux_layers: tuple[int, ...]  # trunk layers whose outputs the drafter reads (StepOut.aux, in layer order)
    window: int | None  # the context window it keeps (None: unbounded / not applicable)

    def begin(self, prompt_out: Any, prompt: list[int]) -> None:
        """A new generation. prompt_out: the trunk's prefill StepOut over prompt[:-1] (None for
        a one-token prompt); prompt: the prompt's token ids."""

    def propose(self, anchor: int, anchor_pos: int, block: int) -> list[int]:
        """Up to `block` proposals to follow `anchor` (the last committed token, at position
        anchor_pos, not yet through the trunk). Fewer (even none) is allowed."""

    def propose_sampled(self, anchor: int, anchor_pos: int, block: int,
                        sampler: Sampler) -> tuple[list[int], torch.Tensor | None]:
        """`propose` under sampling: the proposals and q [n, vocab], row i the distribution
        proposal i was drawn from (given the anchor and the proposals before it), or None
        when every proposal is a point mass (a deterministic drafter). Random draws come
        from `sampler` (its generator), so a seed repeats the generation."""

    def commit(self, out: Any, kept: int, tokens: list[int]) -> None:
        """The trunk's StepOut of the round's rows [anchor, proposals...]; its first `kept`
        rows are committed (kept - 1 proposals accepted). tokens: the committed token after
        each kept row (the accepted proposals, then the round's bonus: the next anchor)."""

    def defer(self, out: Any, kept: int, tokens: list[int]) -> Any:
        """What `commit(out, kept, tokens)` needs, detached from `out` (kept across plain rounds)."""

    def commit_deferred(self, items: list[Any]) -> None:
        """The same as `commit` for each deferred item in order, in one batch if it can."""


@runtime_checkable
class KeepsContext(Drafter, Protocol):
    def snapshot(self) -> Any:
        """The context, detached: what `restore` takes back, unchanged by later rounds (None:
        this drafter cannot be snapshotted, and `keeps_context` is False)."""

    def restore(self, snap: Any) -> None:
        """The context as `snapshot` returned it (from this drafter or a fork of it)."""

    def resume(self, out: Any, prompt: list[int], start: int) -> None:
        """The context holds prompt[:start + 1] (the trunk rows before `start`, and prompt[start]
        as the anchor); out: the trunk's rows over prompt[start:-1]. Leaves what
        begin(prefill over prompt[:-1], prompt) leaves: those rows committed, each followed by
        the next prompt token."""

    def fork(self) -> KeepsContext | None:
        """Another drafter of the same weights with a context of its own, for another sequence
        of a batch (turbo/sequence/driver.py's DrafterPool); None: this one cannot."""


def keeps_context(d: Drafter) -> bool:
    """Whether `d` can snapshot, restore and resume its context (DrafterBase's snapshot, which
    returns None, does not count)."""
    snapshot = getattr(type(d), "snapshot", DrafterBase.snapshot)
    return snapshot is not DrafterBase.snapshot and isinstance(d, KeepsContext)


class DrafterBase:
    """Defaults for both protocols: the lazy-context hooks keep the whole step output and commit
    each in turn; no snapshot (a session prefills every turn afresh), no fork."""

    kind = "custom"
    aux_layers: tuple[int, ...] = ()
    window: int | None = None

    def begin(self, prompt_out: Any, prompt: list[int]) -> None:
        pass

    def propose_sampled(self, anchor: int, anchor_pos: int, block: int,
                        sampler: Sampler) -> tuple[list[int], torch.Tensor | None]:
        return self.propose(anchor, anchor_pos, block), None

    def commit(self, out: Any, kept: int, tokens: list[int]) -> None:
        pass

    def defer(self, out: Any, kept: int, tokens: list[int]) -> Any:
        return out, kept, tokens

    def commit_deferred(self, items: list[Any]) -> None:
        for out, kept, tokens in items:
            self.commit(out, kept, tokens)

    def snapshot(self) -> Any:
        return None

    def fork(self) -> DrafterBase | None:
        return None

    def restore(self, snap: Any) -> None:
        raise NotImplementedError(f"{self.kind} drafter keeps no snapshots")

    def resume(self, out: Any, prompt: list[int], start: int) -> None:
        self.commit(out, out.hidden.shape[0], list(prompt[start + 1:]))


def is_drafter(obj: object) -> bool:
    return not isinstance(obj, str) and isinstance(obj, Drafter)
