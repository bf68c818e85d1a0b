"""Rank 0's trunk over a pipeline: `PipelineTrunk` is a `Trunk` to the driver, the scheduler and the
drafters (the same calls, the same StepOut), whose layers after the first stage's run on other
ranks. Rank 0 embeds the rows and runs stage 0's layers, the rows go stage to stage, the last
stage hands them back and rank 0 runs the head: every row's bits are the single process's.

A state is rank 0's part (stage 0's K/V and GDN state) plus, on each other rank, that stage's
part under the same id; snapshot, restore and rollback go to every stage, each for its layers.
"""

from __future__ import annotations

import atexit
import itertools
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.multiprocessing as mp

from ..errors import TurboError
from ..model.step import StepOut, TrunkState
from ..model.trunk import RecurrentSnapshot, Trunk, check_step_many
from ..sequence.options import OpenOptions
from ..store.install import Install
from .group import Group, abort, free_port, share_threads
from .plan import Stage, check_plan, layer_bytes, rank0_bytes, stages
from .stage import (
    Command,
    load_stage,
    local_aux,
    plan_for,
    run_rows,
    send_rows,
    serve_rank,
    worker_main,
)

SID = "parallel.sid"  # a TrunkState's scratch key: its id on every rank
READY_TIMEOUT_S = 600.0  # every stage loaded (a large install maps in seconds; the spawn imports torch)


@dataclass
class PipeSnapshot(RecurrentSnapshot):
    """Stage 0's part of a snapshot (the RecurrentSnapshot fields); the other stages keep theirs
    under `remote`, freed when this one is."""

    remote: int = 0


class Ranks:
    """The spawned ranks' processes, watched: one that ends while the pipeline runs ends all."""

    def __init__(self, procs: list, group: Group):
        self.procs, self.group = procs, group
        self.stopping = False
        threading.Thread(target=self._watch, daemon=True, name="turbo-parallel-watch").start()

    def _watch(self) -> None:
        while not self.stopping:
            for r, p in enumerate(self.procs, start=1):
                if p.exitcode is not None and not self.stopping:
                    self.lost(r, f"exit code {p.exitcode}")
            time.sleep(0.2)

    def lost(self, rank: int | None, why: str) -> None:
        """A rank is gone: every other rank ended, one line here, this process ends (the ranks
        torchrun started end as their sockets to this one close)."""
        self.stopping = True
        for p in self.procs:
            if p.exitcode is None:
                p.kill()
        who = f"rank {rank}" if rank is not None else "a rank"
        abort(f"{who} ended ({why}); every rank stopped")

    def first_lost(self) -> int | None:
        return next((r for r, p in enumerate(self.procs, start=1) if p.exitcode is not None), None)

    def stop(self) -> None:
        """The ranks told to stop and joined (killed past a few seconds)."""
        if self.stopping:
            return
        self.stopping = True
        try:
            if self.first_lost() is None:
                self.group.tell(Command("stop", []))
                # every rank has left its loop before this one goes on to exit: no rank is still
                # inside a gloo call on a socket this process's exit closes
                self.group.store.wait([f"stopped{r}" for r in range(1, self.group.world)], timedelta(seconds=10))
        except Exception:
            pass
        for p in self.procs:
            p.join(5)
            if p.exitcode is None:
                p.kill()
                p.join(1)


class PipelineTrunk(Trunk):
    """The trunk over `stages` (stage 0's layers here, `local`), the other ranks in `ranks`."""

    def __init__(self, arch, local: Trunk, stages_: list[Stage], group: Group, ranks: Ranks):
        # (Trunk's own __init__ builds a step over every layer: here the step is stage 0's)
        self.arch, self.dtype, self.device, self.kv_dtype = arch, local.dtype, local.device, local.kv_dtype
        self.embed, self.lm_head, self.final_norm = local.embed, local.lm_head, local.final_norm
        self.layers, self.inv_freq = local.layers, local.inv_freq  # (matrices(): stage 0's, the ones held here)
        self.stepper, self.why_torch = local.stepper, None  # (its name and prefill_rows_are_steps are the trunk's)
        self.local, self.stages, self.group, self.ranks = local, stages_, group, ranks
        self.ids = itertools.count(1)
        self.freed: list[tuple[str, int]] = []  # told to the ranks with the next command
        self.lock = threading.Lock()  # one command at a time (a finalizer may run on any thread)

    # ---- talking to the ranks -----------------------------------------------------------

    def _tell(self, cmd: Command) -> None:
        cmd.freed, self.freed = self.freed, []
        self._comm(lambda: self.group.tell(cmd))

    def _comm(self, fn):
        """A gloo call; its failure is a lost rank (the watchdog's line, or this one)."""
        try:
            return fn()
        except Exception as e:
            time.sleep(0.5)  # (the watchdog names the rank whose process ended, where one did)
            self.ranks.lost(self.ranks.first_lost(), str(e).splitlines()[0] if str(e) else type(e).__name__)

    def _sid(self, st: TrunkState) -> int:
        sid = st.scratch.get(SID)
        if sid is None:  # (a state made by Trunk.new_state of another trunk: named here once)
            sid = st.scratch[SID] = next(self.ids)
            weakref.finalize(st, self.freed.append, ("state", sid))
        return sid

    # ---- state --------------------------------------------------------------------------

    def new_state(self, capacity: int = 256) -> TrunkState:
        """Stage 0's part; the other stages make theirs on the state's first command."""
        st = self.local.new_state(capacity)
        self._sid(st)
        return st

    def reserve(self, st: TrunkState, end: int) -> None:
        self.local.reserve(st, end)  # (each other stage reserves as it steps)

    def snapshot(self, st: TrunkState) -> RecurrentSnapshot:
        with self.lock:
            snap = self.local.snapshot(st)
            remote = next(self.ids)
            self._tell(Command("snapshot", [self._sid(st)], snap=remote))
            kept = PipeSnapshot(snap.pos, snap.gdn, snap.rope_delta, remote)
            weakref.finalize(kept, self.freed.append, ("snap", remote))
            return kept

    def restore(self, st: TrunkState, snap: RecurrentSnapshot) -> None:
        if not isinstance(snap, PipeSnapshot):
            raise TurboError("parallel: a snapshot taken on another trunk cannot be restored on a pipeline")
        with self.lock:
            self.local.restore(st, snap)
            self._tell(Command("restore", [self._sid(st)], snap=snap.remote))

    def rollback(self, st: TrunkState, out: StepOut, rows: int, kept: int, rollback: str) -> int:
        if kept == rows:
            return 0
        with self.lock:
            replayed = self.local.rollback(st, out, rows, kept, rollback)
            self._tell(Command("rollback", [self._sid(st)], rows=rows, kept=kept, mode=rollback))
            return replayed

    # ---- rows through the stages --------------------------------------------------------

    def _run(self, kind: str, states: list[TrunkState], tokens: list[list[int]], aux_layers: list[tuple[int, ...]],
             rollback: list[str | None]) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor | None], list]:
        """Rows through every stage: (the last stage's rows [sum R, H], per sequence its rows,
        its aux columns in layer order, stage 0's traces)."""
        g = self.group
        with self.lock:
            self._tell(Command(kind, [self._sid(st) for st in states], tokens, aux_layers, rollback))
            mine = run_rows(self.local, self.stages[0], kind, states, tokens, aux_layers, rollback, None)
            self._comm(lambda: send_rows(g, mine, self.stages[0], g.world == 1))
            total, h = mine.x.shape[0], self.arch.hidden
            x = self._comm(lambda: g.recv((total, h), g.world - 1))
            # each sequence's aux columns: stage 0's, then each later stage's (stages are in layer order)
            aux = []
            for s, ((_, ax0, _), al, tk) in enumerate(zip(mine.per, aux_layers, tokens)):
                cols = [ax0] if ax0 is not None else []
                for stage in self.stages[1:]:
                    n = len(local_aux(al, stage))
                    if n:
                        shape = (len(tk), n * h)
                        cols.append(self._comm(lambda shape=shape, src=stage.rank: g.recv(shape, src)))
                aux.append(torch.cat(cols, dim=1) if cols else None)
        offs = list(itertools.accumulate([len(tk) for tk in tokens], initial=0))
        return x, [x[offs[s]:offs[s + 1]] for s in range(len(tokens))], aux, [p[2] for p in mine.per]

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        return self.local.stepper._head(x)

    def prefill(self, st: TrunkState, tokens: list[int], aux_layers: tuple[int, ...] = (),
                want_logits: bool = False, mm=None) -> StepOut:
        if st.pos != 0:
            raise ValueError("prefill starts from an empty state")
        return self._prompt("prefill", st, tokens, aux_layers, want_logits, mm)

    def extend(self, st: TrunkState, tokens: list[int], aux_layers: tuple[int, ...] = (), mm=None) -> StepOut:
        return self._prompt("extend", st, tokens, aux_layers, False, mm)

    def _prompt(self, kind: str, st: TrunkState, tokens: list[int], aux_layers: tuple[int, ...],
                want_logits: bool, mm) -> StepOut:
        if mm is not None:
            raise TurboError("parallel: a prompt with images is not run over a pipeline in this version",
                             field="parallel")
        self.reserve(st, st.pos + len(tokens))
        x, _, aux, _ = self._run(kind, [st], [list(tokens)], [tuple(aux_layers)], [None])
        return StepOut(self._head(x if want_logits else x[-1:]), x, aux[0])

    def step(self, st: TrunkState, tokens: list[int], aux_layers: tuple[int, ...] = (),
             rollback: str | None = None) -> StepOut:
        return self.step_many([st], [tokens], [aux_layers], [rollback], [len(tokens)])[0]

    def step_many(self, states: list[TrunkState], tokens: list[list[int]], aux_layers: list[tuple[int, ...]],
                  rollback: list[str | None], logit_rows: list[int]) -> list[StepOut]:
        """Trunk.step_many's contract: each sequence's StepOut its `step` alone gives, bit for bit."""
        check_step_many(self, states, tokens, aux_layers, rollback, logit_rows)
        if not states:
            return []
        _, xs, aux, traces = self._run("step", states, [list(t) for t in tokens], [tuple(a) for a in aux_layers],
                                       list(rollback))
        asked = torch.cat([xi[xi.shape[0] - k:] for xi, k in zip(xs, logit_rows)])
        logits = self._head(asked).split(logit_rows)
        return [StepOut(lg, xi, ax, tr) for lg, xi, ax, tr in zip(logits, xs, aux, traces)]

    def ping(self, rows: int) -> float:
        """Seconds for `rows` hidden rows [rows, H] to go round every stage untouched (the hops' cost
        alone: scripts/bench_parallel.py)."""
        g = self.group
        with self.lock:
            x = torch.zeros(rows, self.arch.hidden)
            t = time.perf_counter()
            self._tell(Command("ping", [], rows=rows))
            self._comm(lambda: g.send(x, 1))
            self._comm(lambda: g.recv((rows, self.arch.hidden), g.world - 1))
            return time.perf_counter() - t

    def pids(self) -> list[int]:
        """The spawned ranks' process ids (rank 1 on; none under torchrun)."""
        return [p.pid for p in self.ranks.procs]

    def close(self) -> None:
        self.ranks.stop()


def launched(environ=None) -> dict[str, str] | None:
    """torchrun's variables where it started this process (env:// rendezvous), else None."""
    env = os.environ if environ is None else environ
    keys = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {k: env[k] for k in keys + ("LOCAL_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE") if k in env} \
        if all(env.get(k) for k in keys) else None


def open_pipeline(install: Install, opts: OpenOptions) -> PipelineTrunk:
    """The plan checked (one line, before any rank starts), the ranks started, each loading its
    stage, rank 0 loading stage 0; the threads shared among a machine's ranks (threads // ranks).

    Started here (torch.multiprocessing, spawn: a fork would copy this process's threads and
    locks), or by torchrun (env:// rendezvous: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), where
    every process runs the same command: rank 0 goes on as the runtime, every other rank serves
    its stage and its process ends with the pipeline (it never returns here)."""
    par = opts.parallel
    check_plan(install.arch, par)
    plan = plan_for(install, opts)  # (refuses the torch step; builds the native library once, here)
    world = par.world
    entries = install.index.entries
    cut = stages(layer_bytes(entries, install.arch.num_layers), par.pipeline, rank0_bytes(entries))
    threads = opts.threads or torch.get_num_threads()
    env = launched()
    if env is not None:  # (check_plan held WORLD_SIZE to the plan's world)
        torch.set_num_threads(share_threads(threads, int(env.get("LOCAL_WORLD_SIZE", "1"))))
        group = Group(int(env["RANK"]), world, env["MASTER_ADDR"], int(env["MASTER_PORT"]),
                      hosted=False if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else None)
        if group.rank:
            serve_rank(group, install, opts, cut)  # (ends the process)
        procs = []
    else:
        torch.set_num_threads(share_threads(threads, world))
        port = free_port()
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=worker_main, args=(r, world, port, str(install.path), opts, threads, cut),
                             daemon=True, name=f"turbo-rank{r}") for r in range(1, world)]
        for p in procs:
            p.start()
        group = Group(0, world, "127.0.0.1", port)
    ranks = Ranks(procs, group)
    atexit.register(ranks.stop)
    local = load_stage(install, plan, cut[0], first=True)
    deadline = time.monotonic() + READY_TIMEOUT_S
    for r in range(1, world):  # every stage loaded before the first step (a failed load ends it: Ranks)
        while not group.store.check([f"ready{r}"]):
            if time.monotonic() > deadline:
                ranks.lost(r, "did not load its stage in time")
            time.sleep(0.05)
    trunk = PipelineTrunk(install.arch, local, cut, group, ranks)
    if opts.verbose:
        print("parallel: stages " + ", ".join(f"rank {s.rank} layers {s.lo}..{s.hi - 1}" for s in cut),
              file=sys.stderr)
    return trunk
