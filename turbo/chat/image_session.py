"""A chat session on an install with a tower (Runtime.session): its turns keep their state past
images as turbo/chat/session.py's keep it past text. Each turn renders the conversation, expands every
image's placeholder to its tokens and goes on from the longest kept state whose rows begin it --
rows matched with each image's identity (runtime.image_key), so an edited turn with another image
in it is not taken for the old one -- prefilling only the new rows: new images through the image
prefill of just their rows, the text after an image at its index + the delta (positions.py)."""

from __future__ import annotations

from typing import Any, Iterator

from ..sequence.options import GenerationOptions
from ..vision.positions import expand_placeholders, expanded_row
from ..vision.runtime import prompt_images, vision_of
from .session import Session, common_prefix
from .template import encode
from .turn import Turn


class VisionSession(Session):
    def _run(self, turn: Turn, ids: list[int], opts: GenerationOptions | None, fields: dict[str, Any]) -> Iterator:
        images = turn.images(self.rt, ids)
        if not images:
            return super()._run(turn, ids, opts, fields)
        vis = vision_of(self.rt)
        prepared = vis.prepare(images)
        counts = [p.tokens(vis.config.merge) for p in prepared]
        tokens = expand_placeholders(ids, counts, vis.ids.image)
        # the start of the generation prompt, counted in expanded rows
        mark = common_prefix(ids, encode(self.rt.tokenizer, self.mark_render(turn)))
        self.keeper.marks = {expanded_row(ids, counts, vis.ids.image, mark): "turn"}
        events = self.rt.stream(tokens, turn.options_of(opts, fields), keeper=self.keeper,
                                images=prompt_images(self.rt, tokens, prepared))
        return self._follow(turn, tokens, events)
