"""What a chat needs of a runtime: its install, its tokenizer and its two ways to generate. The
chat package is written against this (turbo.engine's Runtime is one) so that it never imports
the engine, which imports it."""

from __future__ import annotations

from typing import Iterator, Protocol

from tokenizers import Tokenizer

from ..model.trunk import Trunk
from ..sequence.driver import RoundEvent
from ..sequence.options import GenerationOptions, OpenOptions
from ..sequence.state_cache import Keeper
from ..sequence.stats import Stats
from ..store.install import Install
from ..vision.positions import PromptImages


class Generated(Protocol):
    """A whole generation's result (turbo.engine's GenerateResult)."""

    tokens: list[int]
    text: str
    stats: Stats


class ChatRuntime(Protocol):
    """The runtime a chat turn runs on (turbo.engine.Runtime)."""

    install: Install
    tokenizer: Tokenizer
    trunk: Trunk  # (a session's saved states are its)
    options: OpenOptions  # how it was opened (the numerics a saved state is checked against)

    def generate(self, prompt: list[int], opts: GenerationOptions | None = None, *, keeper: Keeper | None = None,
                 images: list | PromptImages | None = None) -> Generated: ...

    def stream(self, prompt: list[int], opts: GenerationOptions | None = None, *, keeper: Keeper | None = None,
               images: list | PromptImages | None = None) -> Iterator[RoundEvent]: ...
