"""The CUDA kernels for tests without a GPU: their own CUDA C on the simulated device
(turbo/backends/cuda_sim: compiled for the host, fmul / fadd separately rounded, run over the grid
and block as fibers with __syncthreads, warp shuffles and __shared__, each launch checked against
the PTX entry's parameters; a barrier or shuffle not every thread reaches is a launch error naming
the kernel, not a hang).

`HostDevice` is a cuda_kernels.Kernels on that device, every launch also recorded by name: the
CUDA step (turbo/backends/cuda_step) allocates, copies and launches through it as through a GPU's,
and a launch may also name CPU tensors' memory (cuda_sim.host_memory), as tests/test_cuda.py's
wrappers and the kernel tests do.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
from typing import Iterator

from turbo.backends import cuda_kernels as ck
from turbo.backends import cuda_sim

PTX_TYPES = {ctypes.c_void_p: ".u64", ctypes.c_int32: ".u32", ctypes.c_float: ".f32"}


def ptx_params(module: str, kernel: str) -> list[str]:
    """The PTX types of `kernel`'s parameters, in order (from the checked-in sm_90 PTX)."""
    text = (ck.ptx_dir() / f"{module}.sm_90.ptx").read_text()
    body = re.search(rf"\.entry {kernel}\((.*?)\)", text, re.S).group(1)
    return re.findall(r"\.param (\.\w+) ", body)


def ptx_entries(module: str) -> list[str]:
    """Every kernel entry of a module's PTX."""
    return re.findall(r"\.visible \.entry (\w+)\(", (ck.ptx_dir() / f"{module}.sm_90.ptx").read_text())


@contextlib.contextmanager
def _simulated() -> Iterator[None]:
    """TURBO_CUDA_SIM set while a Kernels opens (it keeps the driver it opened with)."""
    before = os.environ.get(cuda_sim.ENV)
    os.environ[cuda_sim.ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[cuda_sim.ENV]
        else:
            os.environ[cuda_sim.ENV] = before


class HostDevice(ck.Kernels):
    """cuda_kernels.Kernels on the simulated device, its launches' kernel names kept in
    `launches` and the bytes it holds in `allocated` (the step allocates at open)."""

    def __init__(self):
        with _simulated():
            super().__init__(0)
        self.launches: list[str] = []
        self.allocated = 0
        self._sizes: dict[int, int] = {}

    def launch(self, module, kernel, grid, block, args, shared=0, stream=None) -> None:
        got = [PTX_TYPES[type(a)] for a in args]
        want = ptx_params(module, kernel)
        if got != want:
            raise AssertionError(f"{kernel}: arguments {got} against the PTX entry's {want}")
        self.launches.append(kernel)
        with cuda_sim.host_memory():
            super().launch(module, kernel, grid, block, args, shared, stream=0 if stream is None else stream)

    def alloc(self, nbytes: int) -> int:
        ptr = super().alloc(nbytes)
        self._sizes[ptr] = max(1, int(nbytes))
        self.allocated += self._sizes[ptr]
        return ptr

    def free(self, ptr: int) -> None:
        super().free(ptr)
        self.allocated -= self._sizes.pop(int(ptr))
