"""Optional extras: a missing one is one line naming the pip install that brings it."""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import TurboError

# extra -> what it is for (pyproject.toml's optional-dependencies)
EXTRAS = {"tui": "the terminal UI", "cuda": "the CUDA backend", "sweeps": "sweeps and reports",
          "serve": "the OpenAI-compatible server", "ray": "Ray Serve replicas",
          "grammar": "constrained output (response_format)", "gguf": "reading GGUF checkpoints",
          "vision": "decoding images"}


def missing(extra: str, module: str) -> str:
    return f"{module} is not installed ({EXTRAS[extra]} needs it): pip install 'turbo[{extra}]'"


def require(module: str, extra: str) -> ModuleType:
    """import `module`, or a TurboError naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise TurboError(missing(extra, module)) from None
