"""turbo: a Qwen3.5 hybrid runtime with lossless speculative decoding."""

from .engine import GenerateResult, RoundEvent, Runtime, open  # noqa: A004
from .errors import TurboError
from .options import GenerationOptions, OpenOptions
from .stats import Stats

__all__ = ["open", "Runtime", "GenerateResult", "RoundEvent", "Stats", "TurboError", "OpenOptions",
           "GenerationOptions"]
