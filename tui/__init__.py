"""turbo's Textual TUI: `python -m tui [Hydra overrides]` (the same conf/ as `python -m turbo`)."""

from .settings import MODES, Settings, compose_settings

__all__ = ["TurboApp", "Settings", "compose_settings", "MODES"]


def __getattr__(name: str):
    # TurboApp needs textual (the `tui` extra): imported on first use, so `python -m tui`
    # can name the extra to install when it is missing
    if name == "TurboApp":
        from .app import TurboApp

        return TurboApp
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
