"""turbo: a Qwen3.5 hybrid runtime with lossless speculative decoding.

The public names load on first use (PEP 562), so `python -m turbo` and `python -m tui` reach
their own error handling -- a Ctrl-C, a missing extra -- before torch is imported."""

from __future__ import annotations

import importlib

_WHERE = {"open": "engine", "Runtime": "engine", "GenerateResult": "engine", "RoundEvent": "engine",
          "Stats": "sequence.stats", "TurboError": "errors", "OpenOptions": "sequence.options",
          "GenerationOptions": "sequence.options"}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'turbo' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value
