"""The ranks' process group (torch.distributed's gloo, on a private TCP store: no global default
group, so a process may hold several parallel runtimes) and the few messages the pipeline sends:
a command object to every rank, tensors rank to rank.

A lost rank ends everything: a gloo call that fails (the peer's socket closed) or a watchdog that
sees a rank's process gone prints one line naming the rank and ends this process (`abort`), so
that no rank waits for ever on one that is gone.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

# How long one gloo call may wait on a rank that is alive but does not answer. Rank 0 between
# requests sends nothing, and the ranks wait for its next command without a timeout of their own
# (gloo's applies per call): a server idle for longer than this is fine, the wait is re-armed.
CALL_TIMEOUT = timedelta(minutes=30)
LINE_PREFIX = "error: turbo parallel"


def free_port() -> int:
    """A TCP port free on localhost now (the store rank 0 serves the rendezvous on)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def abort(line: str, code: int = 1) -> None:
    """One line on stderr, then this process ends at once (os._exit: a thread blocked in a gloo
    call would keep a normal exit waiting)."""
    try:
        print(f"{LINE_PREFIX}: {line}", file=sys.stderr, flush=True)
    finally:
        os._exit(code)


class Group:
    """This rank's view of the world: its rank, the world size and the gloo group."""

    def __init__(self, rank: int, world: int, host: str, port: int, timeout: timedelta = CALL_TIMEOUT,
                 hosted: bool | None = None):
        """hosted: this rank serves the TCP store (None: rank 0 does). Under torchrun the agent
        already serves one on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE): every rank is its client."""
        self.rank, self.world = rank, world
        serve = rank == 0 if hosted is None else hosted
        # (wait_for_workers on every rank: a client that does not wait is not counted, and the one
        # serving the store would wait for it for ever)
        store = dist.TCPStore(host, port, world, serve, timeout=timeout, wait_for_workers=True)
        self.store = dist.PrefixStore("turbo.parallel/", store)  # (beside torchrun's own keys)
        self.pg = dist.ProcessGroupGloo(self.store, rank, world, timeout)
        self.from0 = dist.BroadcastOptions()
        self.from0.rootRank, self.from0.rootTensor = 0, 0

    # ---- tensors, point to point --------------------------------------------------------

    def send(self, t: torch.Tensor, dst: int) -> None:
        self.pg.send([t.contiguous()], dst, 0).wait()

    def recv(self, shape: tuple[int, ...], src: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        self.pg.recv([t], src, 0).wait()
        return t

    # ---- a command object from rank 0 to every rank -------------------------------------

    def tell(self, obj: object) -> None:
        """Rank 0: `obj` to every other rank (its length, then its pickle)."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        size = torch.tensor([len(data)], dtype=torch.int64)
        self.pg.broadcast([size], self.from0).wait()
        self.pg.broadcast([torch.frombuffer(bytearray(data), dtype=torch.uint8)], self.from0).wait()

    def hear(self) -> object:
        """Another rank: the next object rank 0 tells."""
        size = torch.zeros(1, dtype=torch.int64)
        self.pg.broadcast([size], self.from0).wait()
        data = torch.empty(int(size[0]), dtype=torch.uint8)
        self.pg.broadcast([data], self.from0).wait()
        return pickle.loads(data.numpy().tobytes())


def share_threads(total: int, world: int) -> int:
    """Each rank's torch / OpenMP threads when `world` ranks share `total` cores' threads (at least
    one): the ranks run at once, so one rank with all of them would oversubscribe the cores."""
    return max(1, total // world)
