"""CUDA backend: placeholder until the PTX kernels land (issue 7). It names what is missing."""

from __future__ import annotations


def cuda_unavailable_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "backend cuda needs torch"
    if not torch.cuda.is_available():
        return "backend cuda needs an NVIDIA driver and a CUDA device, and this machine has none"
    return "backend cuda: the PTX kernels are not built yet"
