"""Backend choice: `cpu` (torch) or `cuda` (torch storage + precompiled PTX kernels)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import TurboError

BACKENDS = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class Backend:
    name: str
    # dtype codes the batched verify runs on (the verify-dtype speculation blocker reads this)
    verify_dtypes: tuple[int, ...]
    note: str = ""


# 4 / 5 / 16 / 15: INT4 / INT8 / 2-bit / 1-bit affine (turbo/quant.py), through the native step's
# products (int4, int8) or ops.linear's row-stable path
CPU = Backend("cpu", (1, 2, 3, 4, 5, 16, 15))


def cuda_missing() -> str | None:
    """Why the cuda backend cannot run here, or None."""
    from .cuda import cuda_unavailable_reason  # imports cuda-python lazily: it names the extra when absent

    return cuda_unavailable_reason()


def select_backend(name: str, ptx_dir: Path | None = None) -> Backend:
    """The backend `name` names (auto: cuda where it can run, else cpu); `ptx_dir` where
    backend cuda reads its kernels (None: the checkout's kernels_ptx/)."""
    if name not in BACKENDS:
        raise TurboError(f"backend {name!r} is not one of {', '.join(BACKENDS)}")
    if name == "cpu":
        return CPU
    from .cuda_kernels import use_ptx_dir  # (imports no cuda-python)

    use_ptx_dir(ptx_dir)
    missing = cuda_missing()
    if name == "cuda":
        if missing:
            raise TurboError(missing)
        from .cuda import CUDA
        return CUDA
    if missing:
        return Backend("cpu", CPU.verify_dtypes, f"backend auto picked cpu ({missing})")
    from .cuda import CUDA
    return Backend(CUDA.name, CUDA.verify_dtypes, "backend auto picked cuda")
