"""turbo's Textual TUI: `python -m tui [Hydra overrides]` (the same conf/ as `python -m turbo`)."""

from .app import TurboApp
from .settings import MODES, Settings, compose_settings

__all__ = ["TurboApp", "Settings", "compose_settings", "MODES"]
