"""Where the files shipped beside the code are: the Hydra configs (`conf/`) and the PTX kernels
(`kernels_ptx/`). A wheel carries them inside the package (pyproject's force-include puts them at
turbo/conf and turbo/kernels_ptx); an editable checkout has them at its top level."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def shipped(name: str) -> Path:
    """The directory `name` as the wheel lays it out, else as the checkout does."""
    inside = PACKAGE / name
    return inside if inside.is_dir() else PACKAGE.parent / name


CONF_DIR = shipped("conf")
PTX_DIR = shipped("kernels_ptx")
