"""A chat session on an install with a tower (Runtime.session): its turns keep their state past
images as turbo/chat/session.py's keep it past text. Each turn renders the conversation, expands every
image's placeholder to its tokens and goes on from the longest kept state whose rows begin it --
rows matched with each image's identity (runtime.image_key), so an edited turn with another image
in it is not taken for the old one -- prefilling only the new rows: new images through the image
prefill of just their rows, the text after an image at its index + the delta (positions.py)."""

from __future__ import annotations

from typing import Any, Iterator

from .template import encode
from .turn import Turn
from ..sequence.options import GenerationOptions
from .session import FRESH, Keeper, Session, common_prefix
from ..vision.positions import MmRows, rows_between
from ..vision.runtime import ImageStart, keyed_rows, vision_of


class VisionKeeper(Keeper):
    """A session's Keeper whose turn may hold images: `mm` the whole conversation's MmRows."""

    mm: MmRows | None = None
    _keyed: list | None = None  # the turn's expanded ids, image rows tagged

    def images(self, tokens: list[int], mm: MmRows | None, keyed: list | None) -> None:
        self.mm, self._keyed = mm, keyed
        self.fresh = ImageStart(tokens, mm) if mm is not None else FRESH

    def keyed(self, ids: list[int]) -> list:
        if self._keyed is None:
            return list(ids)
        return self._keyed + list(ids[len(self._keyed):])  # (settle: the answer after the prompt)

    def rows_mm(self, p: int, end: int) -> Any:
        return None if self.mm is None else rows_between(self.mm, p, end)


class VisionSession(Session):
    keeper_kind = VisionKeeper

    def _run(self, turn: Turn, ids: list[int], opts: GenerationOptions | None, fields: dict[str, Any]) -> Iterator:
        images = turn.images(self.rt, ids)
        if not images:
            self.keeper.images([], None, None)
            return super()._run(turn, ids, opts, fields)
        vis = vision_of(self.rt)
        prepared = vis.prepare(images)
        tokens, mm = vis.prompt(ids, prepared)
        # the start of the generation prompt, counted in expanded rows
        mark = common_prefix(ids, encode(self.rt.tokenizer, self.mark_render(turn)))
        before = prepared[:ids[:mark].count(vis.ids.image)]
        self.keeper.mark = mark + sum(p.tokens(vis.config.merge) - 1 for p in before)
        self.keeper.images(tokens, mm, keyed_rows(tokens, prepared, vis.ids.image))
        events = self.rt.stream(tokens, turn.options_of(opts, fields), start=self.keeper)
        return self._follow(turn, tokens, events)
