"""Backend choice: `cpu` (torch and the native step) or `cuda` (the trunk's CUDA step of its own over
precompiled PTX, turbo/backends/cuda_step; TURBO_CUDA_SIM=1: on the simulated device)."""

from __future__ import annotations

from pathlib import Path

from ..errors import TurboError
from .backend import BACKENDS, CPU, Backend
from .cuda import CUDA, cuda_unavailable_reason  # cuda.py imports cuda-python only when asked
from .cuda_kernels import use_ptx_dir

__all__ = ["BACKENDS", "CPU", "CUDA", "Backend", "select_backend"]


def select_backend(name: str, ptx_dir: Path | None = None) -> Backend:
    """The backend `name` names (auto: cuda where it can run, else cpu); `ptx_dir` where
    backend cuda reads its kernels (None: the checkout's kernels_ptx/)."""
    if name not in BACKENDS:
        raise TurboError(f"backend {name!r} is not one of {', '.join(BACKENDS)}")
    if name == "cpu":
        return CPU
    use_ptx_dir(ptx_dir)
    missing = cuda_unavailable_reason()
    if name == "cuda":
        if missing:
            raise TurboError(missing)
        return CUDA
    if missing:
        return Backend("cpu", CPU.verify_dtypes, f"backend auto picked cpu ({missing})")
    return Backend(CUDA.name, CUDA.verify_dtypes, "backend auto picked cuda")
