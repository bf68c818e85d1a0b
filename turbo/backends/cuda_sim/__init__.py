"""The simulated device: `backend=cuda`'s driver calls on the host, for CI (issue #55).

With `TURBO_CUDA_SIM=1` in the environment, cuda_kernels._driver() returns `driver` (this
package's stand-in for `cuda.bindings.driver`) instead of cuda-python's, and everything that goes
through it runs here: memory is host memory (an arena), each launch is checked against its PTX
entry's parameter list and runs the kernel's own CUDA C compiled for the host (shim.h,
runtime.cpp), and is recorded (records()).

    from turbo.backends import cuda_sim
    d = cuda_sim.driver                     # same calls and returns as cuda.bindings.driver
    cuda_sim.reset_records()
    ...                                     # launches through cuda_kernels.Kernels or d directly
    for r in cuda_sim.launches():           # Record: name, grid, block, shared, params, touches
        r.bytes_read, r.bytes_written       # exact unique bytes per launch, summed over allocations

Other knobs: TURBO_CUDA_SIM_MEMORY_GB (arena size, default 80), TURBO_CUDA_SIM_SOURCES (extra
directories of .cu sources, os.pathsep-separated; add_source_dir() does the same in-process),
TURBO_CUDA_SIM_CACHE (build cache, default ~/.cache/turbo/cuda_sim), TURBO_CUDA_SIM_TIMEOUT
(seconds one launch may run, default 300; set_timeout() in-process).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from . import driver
from .build import compiler_missing
from .driver import (
    accept_host_memory,
    add_source_dir,
    last_error,
    set_timeout,
    source_dirs,
)
from .records import Record, Summary, Touch, launches, records, reset_records, summarize

ENV = "TURBO_CUDA_SIM"

__all__ = ["ENV", "Record", "Summary", "Touch", "accept_host_memory", "add_source_dir", "driver", "enabled",
           "host_memory", "last_error", "launches", "records", "reset_records", "set_timeout", "source_dirs",
           "summarize", "unavailable_reason"]


def enabled() -> bool:
    """Whether this process runs backend cuda on the simulated device."""
    return os.environ.get(ENV, "") not in ("", "0")


def unavailable_reason() -> str | None:
    """None when the simulated device can run here, else one line on what it lacks."""
    missing = compiler_missing()
    return f"backend cuda on the simulated device ({ENV}=1): {missing}" if missing else None


@contextmanager
def host_memory() -> Iterator[None]:
    """Within: kernels may use any host address (CPU tensors' memory) as device memory."""
    accept_host_memory(True)
    try:
        yield
    finally:
        accept_host_memory(False)
