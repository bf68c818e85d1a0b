"""Token ids to text a piece at a time, as they are committed."""

from __future__ import annotations

from typing import Callable


class Detokenizer:
    """The text each push adds, decoding only a short tail of the tokens (prefix and read
    offsets, as Hugging Face's text-generation-inference does): decoding the whole list
    every time would cost time quadratic in its length. A tail that ends inside a
    character (U+FFFD) waits for the next tokens; `final` lets it out."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode, self.ids, self.prefix, self.read = decode, [], 0, 0

    def push(self, tokens: list[int], final: bool = False) -> str:
        self.ids += tokens
        done, text = self.decode(self.ids[self.prefix:self.read]), self.decode(self.ids[self.prefix:])
        if len(text) > len(done) and (final or not text.endswith("\ufffd")):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(done):]
        return ""

    def held(self) -> str:
        """What `push` holds back (the tail since its last release), decoded as it stands."""
        if self.read == len(self.ids):
            return ""
        return self.decode(self.ids[self.prefix:])[len(self.decode(self.ids[self.prefix:self.read])):]
