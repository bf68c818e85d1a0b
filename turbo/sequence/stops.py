"""Where a generation stops and what text it may emit: stop token ids (the eos ids with
stop_at_eos, plus GenerationOptions.stop_token_ids) and stop strings, found in the text across
token boundaries and never emitted, not even partly (as vLLM does). After each round's
acceptance the engine asks `Stopper.cut` how many of its tokens to commit (turbo.sequence.rounds.judge
then plays the round as if fewer proposals had landed), and `Stopper.text` what to emit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .detokenizer import Detokenizer

STOP, LENGTH = "stop", "length"  # the finish reasons, vLLM's names


@dataclass(frozen=True)
class Finish:
    """Why a generation ended: `reason` STOP (a stop string, a stop token id or eos) or LENGTH
    (max_new_tokens); `matched` the stop string or token id that ended it (None for LENGTH)."""

    reason: str
    matched: str | int | None = None


def stop_token_set(eos_ids: tuple[int, ...], stop_at_eos: bool, stop_token_ids: tuple[int, ...] | None) -> set[int]:
    """The token ids that end a generation: the eos ids (with stop_at_eos) and the caller's."""
    return (set(eos_ids) if stop_at_eos else set()) | set(stop_token_ids or ())


def held_back(text: str, strings: tuple[str, ...]) -> int:
    """How many characters at the end of `text` may still begin a stop string."""
    most = 0
    for s in strings:
        for k in range(min(len(s) - 1, len(text)), most, -1):
            if text.endswith(s[:k]):
                most = k
                break
    return most


class Stopper:
    """One generation's stops. `cut` takes tokens in commit order, pushing each into the text
    until a stop completes or `room` (max_new_tokens) is spent; the committed text then ends
    right before the stop string, and a stop token's text is never emitted (it stays in the
    tokens)."""

    def __init__(self, decode: Callable[[list[int]], str], strings: tuple[str, ...], token_ids: set[int],
                 room: int):
        self.detok, self.strings, self.ids, self.room = Detokenizer(decode), strings, token_ids, room
        self.pending = ""  # decoded, not emitted yet: a stop string may still begin in it
        self.finish: Finish | None = None  # set when a stop completes or the room is spent

    def cut(self, tokens: list[int]) -> int | None:
        """How many of `tokens` (the round's, as it would commit them) to commit because a stop
        completes at the last of them; None when none does. Past the room, tokens are not looked
        at: the caller drops them (the state keeps them, the generation ends there)."""
        if not self.strings:  # stop ids alone: no text to search, the round's tokens decode at once
            return self._cut_ids(tokens[:self.room])
        for i, t in enumerate(tokens[:self.room]):
            self.room -= 1
            if t in self.ids:
                self.finish = Finish(STOP, t)
                return i + 1
            piece = self.detok.push([t])
            self.pending += piece
            if piece and self._match(len(piece)):
                return i + 1
        if not self.room:
            self.finish = Finish(LENGTH)
        return None

    def _cut_ids(self, tokens: list[int]) -> int | None:
        hit = next((i for i, t in enumerate(tokens) if t in self.ids), None)
        kept = tokens if hit is None else tokens[:hit + 1]
        self.room -= len(kept)
        self.pending += self.detok.push(kept if hit is None else kept[:-1])  # a stop token's text is not emitted
        if hit is not None:
            self.finish = Finish(STOP, kept[-1])
            return hit + 1
        if not self.room:
            self.finish = Finish(LENGTH)
        return None

    def _match(self, added: int) -> bool:
        """The stop string that completes earliest in the text the last `added` characters
        completed: the pending text is cut right before it."""
        found = None
        for s in self.strings:
            at = self.pending.find(s, max(0, len(self.pending) - added - len(s) + 1))
            if at >= 0 and (found is None or at < found[0]):
                found = (at, s)
        if found is None:
            return False
        self.pending, self.finish = self.pending[:found[0]], Finish(STOP, found[1])
        return True

    def text(self, final: bool) -> str:
        """The text to emit now: all that is pending at the end (what the detokenizer still
        holds too, unless a stop string cut it off), else all but what may begin a stop string."""
        if final and not (self.finish is not None and isinstance(self.finish.matched, str)):
            self.pending += self.detok.push([], final=True)
        keep = 0 if final else held_back(self.pending, self.strings)
        out, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return out
