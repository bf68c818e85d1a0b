"""A chat session on an install with a tower (Runtime.session): turns with no image in the
conversation keep their state as turbo/session.py's do; once an image is in it, every turn
prefills the whole conversation afresh with its images (exact: a fresh generation over it; the
state reuse past an image is left for later, docs/vision.md)."""

from __future__ import annotations

from typing import Any, Iterator

from ..chat import turn_options
from ..chat_template import encode
from ..options import GenerationOptions
from ..session import Keeper, Session
from .runtime import check_placed, message_images


class VisionSession(Session):
    def _turn(self, opts: GenerationOptions | None, fields: dict[str, Any]) -> Iterator:
        images = message_images(self.history)
        if not images:
            return super()._turn(opts, fields)
        prompt = self.render()
        ids = encode(self.rt.tokenizer, prompt)
        check_placed(self.rt, ids, images)
        self.keeper = Keeper(self.keeper.limit)  # its states hold none of this conversation's images
        events = self.rt.stream(ids, turn_options(opts, fields, self.stop_ids), images=images)
        return self._follow(ids, prompt, events)
