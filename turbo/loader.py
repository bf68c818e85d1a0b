"""Loading apart from running: an install's tensors read, checked and prepared for a step.

`load_trunk` and `load_drafter` are what the engine calls; everything that reads the
resident index for the forward lives behind them.
"""

from __future__ import annotations

import torch

from . import ops
from .install import Install
from .options import OpenOptions
from .trunk import Trunk


def load_trunk(install: Install, opts: OpenOptions, device: torch.device) -> Trunk:
    return Trunk(install, getattr(torch, opts.dtype), device)


def load_drafter(kind: str, install: Install, trunk: Trunk, window: int | None, opts: OpenOptions):
    """The install's own drafter of `kind` (dflash | mtp), ready for the engine (turbo.drafters.Drafter)."""
    if kind == "dflash":
        from .drafters.dflash import DflashDrafter
        return DflashDrafter(install, trunk.embed, ops.dense(trunk.lm_head), window, device=trunk.device,
                             products=opts.draft_products)
    from .drafters.mtp import MtpDrafter
    return MtpDrafter(install, trunk, opts.draft_products)
