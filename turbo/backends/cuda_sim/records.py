"""Launch records of the simulated device: every kernel launch, memcpy and memset, in the order
it ran, with the bytes it read and wrote per allocation (for tests and scripts/gpu_plan.py)."""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Touch:
    """One allocation an operation touched: exact unique bytes read / written by it (a byte read
    twice by one launch counts once; the same byte read by two launches counts in each)."""
    base: int
    size: int
    read: int
    written: int
    args: tuple[int, ...]  # the kernel parameters (indices) that point into it; () when none does


@dataclass(frozen=True)
class Record:
    kind: str  # "launch", "memcpy" or "memset"
    name: str  # the kernel; "HtoD" / "DtoH" / "DtoD"; "D8" / "D32"
    module: str  # the kernel's source (kernels_ptx/<module>.cu); "" for copies and memsets
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared: int  # dynamic shared bytes
    params: tuple  # the parameter values as the kernel read them; (dst, src, n) / (dst, value, n)
    touches: tuple[Touch, ...]
    raw_read: int  # bytes the launch's loads read, repeats included
    raw_written: int
    stream: int
    graph: int | None  # the graph exec that replayed it (None: issued directly)
    checked: bool  # parameters checked against the PTX (False: passed as a bare void** address)
    seconds: float  # host time the simulation took

    @property
    def bytes_read(self) -> int:
        return sum(t.read for t in self.touches)

    @property
    def bytes_written(self) -> int:
        return sum(t.written for t in self.touches)

    def signature(self) -> tuple:
        """What a replay must repeat: the operation, its shape and its parameters."""
        return (self.kind, self.name, self.grid, self.block, self.shared, self.params)


_records: list[Record] = []
_lock = threading.Lock()


def append(r: Record) -> None:
    with _lock:
        _records.append(r)


def records() -> list[Record]:
    """Every operation since the last reset_records(), oldest first."""
    with _lock:
        return list(_records)


def launches() -> list[Record]:
    return [r for r in records() if r.kind == "launch"]


def reset_records() -> None:
    with _lock:
        _records.clear()


@dataclass(frozen=True)
class Summary:
    """What a run of operations cost the device, for a cost plan (scripts/gpu_plan.py)."""
    launches: int
    by_kernel: dict[str, int]  # launches per kernel, in first-launch order
    bytes_read: int  # kernels' unique bytes per launch, summed over launches
    bytes_written: int
    copies: int  # memcpy / memset operations
    copy_bytes: int


def summarize(rs: list[Record]) -> Summary:
    ks = [r for r in rs if r.kind == "launch"]
    by_kernel: dict[str, int] = {}
    for r in ks:
        by_kernel[r.name] = by_kernel.get(r.name, 0) + 1
    others = [r for r in rs if r.kind != "launch"]
    return Summary(len(ks), by_kernel, sum(r.bytes_read for r in ks), sum(r.bytes_written for r in ks), len(others),
                   sum(r.params[2] * (4 if r.name == "D32" else 1) for r in others))
