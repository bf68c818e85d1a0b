"""One pipeline stage: its layers loaded from the install (only theirs: the open layout is mapped,
so a rank's resident memory is its own layers' pages), run on rows a previous stage left, and the
loop a rank other than 0 runs: rank 0's commands, one after another, on the states it mirrors.

A stage is a plain `Trunk` over a stage `Arch` (its layers renumbered from 0), so its states,
snapshots, restores and rollbacks are the single process's own code on its part of the layers:
the bits each layer computes do not depend on which process holds the layers before it.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

from ..backends import ops
from ..backends.native_trunk import PREFILL_CHUNK, NativeTrunkStep
from ..errors import TurboError
from ..load.load_plan import TrunkPlan, plan_trunk
from ..load.loader import host
from ..load.reader import Reader
from ..model.step import GdnTrace, StepOut, TrunkState
from ..model.trunk import PREFIX, RecurrentSnapshot, Trunk, TrunkWeights
from ..sequence.options import OpenOptions
from ..store import quant
from ..store.arch import Arch
from ..store.install import Install, open_install
from .group import Group, abort, share_threads
from .plan import Stage


def stage_arch(a: Arch, stage: Stage) -> Arch:
    """The arch of the stage's layers alone, renumbered from 0 (what Trunk.new_state sizes)."""
    return dataclasses.replace(a, num_layers=stage.hi - stage.lo, layer_types=a.layer_types[stage.lo:stage.hi],
                               moe_layers=tuple(i - stage.lo for i in a.moe_layers if stage.lo <= i < stage.hi))


def plan_for(install: Install, opts: OpenOptions) -> TrunkPlan:
    """The single process's trunk plan (every rank plans alike: the same formats, the same bits),
    refused where the native step does not run: a stage's rows start from the previous stage's
    residual stream, which only the native step takes in place of its embedding."""
    device = torch.device("cpu")
    quant.cpu_mode(opts.quant_cpu)
    plan = plan_trunk(install.index.entries, install.arch, opts, device, host(opts, device), install.index.packed)
    if plan.why_torch is not None:
        raise TurboError(f"parallel: the pipeline runs on the native CPU step, and this trunk takes the torch step "
                         f"({plan.why_torch})", field="parallel")
    return plan


def load_stage(install: Install, plan: TrunkPlan, stage: Stage, first: bool) -> Trunk:
    """The stage's layers as `plan` has them; the embedding and the head (and the final norm)
    only on the first stage (rank 0: it embeds the rows, runs the head, and lends both to the
    drafters), the others get empty stand-ins they never read."""
    a = install.arch
    r = Reader(install.index, plan.dtype)
    if first:
        embed, lm_head = r.embedding(plan.embed)
    else:
        embed = lm_head = torch.empty(0, a.hidden)
    final_norm = r.norm(PREFIX + "norm.weight", a.hidden)
    layers = [r.layer(plan.layers[i], a) for i in stage.layers]
    inv_freq = ops.rope_inv_freq(a.rotary_dim, a.rope_theta, a.rope_scaling)
    weights = TrunkWeights(embed, lm_head, final_norm, layers, inv_freq)
    return Trunk(stage_arch(a, stage), weights, plan.dtype, torch.device("cpu"), plan.kv, NativeTrunkStep, None)


def local_aux(aux_layers: tuple[int, ...], stage: Stage) -> tuple[int, ...]:
    """The stage's part of a sequence's aux layers (global indices), renumbered as the stage's."""
    return tuple(i - stage.lo for i in sorted(aux_layers) if stage.lo <= i < stage.hi)


@dataclass
class Rows:
    """What a stage leaves of one call: per sequence its residual rows [R, H] (a view of x),
    its aux columns [R, n_aux_here * H] (None: none here), its GDN traces (local indices)."""

    x: torch.Tensor  # [sum R, H]: every sequence's rows, in call order
    per: list[tuple[torch.Tensor, torch.Tensor | None, dict[int, GdnTrace]]] = field(default_factory=list)


def run_rows(trunk: Trunk, stage: Stage, kind: str, states: list[TrunkState], tokens: list[list[int]],
             aux_layers: list[tuple[int, ...]], rollback: list[str | None], x0: torch.Tensor | None) -> Rows:
    """The stage's layers over one command's rows. kind "step": every sequence in one pass per
    layer (NativeTrunkStep._rows, as step_many); "prefill" / "extend": one sequence in chunks of
    PREFILL_CHUNK rows, as NativeTrunkStep.prefill cuts them (its rows are its steps: any cut
    gives the same bits, this one gives the single process's working set). x0: the previous
    stage's rows (None on the first stage: embedded here)."""
    stepper: NativeTrunkStep = trunk.stepper
    aux = [local_aux(al, stage) for al in aux_layers]
    if kind == "step":
        per = stepper._rows(states, tokens, aux, rollback, x0=x0)
        x = torch.cat([p[0] for p in per]) if len(per) > 1 else per[0][0]
        return Rows(x, per)
    st, tk = states[0], tokens[0]
    trunk.reserve(st, st.pos + len(tk))
    parts = [stepper._rows([st], [tk[c:c + PREFILL_CHUNK]], aux, [None],
                           x0=None if x0 is None else x0[c:c + PREFILL_CHUNK])[0]
             for c in range(0, len(tk), PREFILL_CHUNK)]
    x = torch.cat([p[0] for p in parts])
    ax = torch.cat([p[1] for p in parts]) if parts[0][1] is not None else None
    return Rows(x, [(x, ax, {})])


@dataclass
class Command:
    """What rank 0 tells every other rank, one per trunk call.

    kind: "step" | "prefill" | "extend" (rows through every stage), "ping" (`rows` rows passed
    stage to stage untouched: a hop's cost), "snapshot" | "restore" |
    "rollback" (a state's recurrent part, on each stage for its layers), "stop".
    sids: the states (rank 0's ids); freed: ids of states and snapshots rank 0 no longer holds."""

    kind: str
    sids: list[int]
    tokens: list[list[int]] = field(default_factory=list)
    aux_layers: list[tuple[int, ...]] = field(default_factory=list)
    rollback: list[str | None] = field(default_factory=list)
    snap: int = 0  # "snapshot" / "restore": the snapshot's id
    rows: int = 0  # "rollback": the rows just stepped ...
    kept: int = 0  # ... and the first of them kept
    mode: str = ""  # "rollback": checkpoint | replay
    freed: list[tuple[str, int]] = field(default_factory=list)


def send_rows(group: Group, rows: Rows, stage: Stage, last: bool) -> None:
    """A stage's rows on to the next stage (the last: back to rank 0, which runs the head), then its
    aux columns to rank 0 (sequence by sequence, only those with aux layers here)."""
    group.send(rows.x, 0 if last else group.rank + 1)
    if group.rank:
        for _, ax, _ in rows.per:
            if ax is not None:
                group.send(ax, 0)


class StageWorker:
    """A rank other than 0: its stage's trunk and the states rank 0's ids name."""

    def __init__(self, group: Group, stage: Stage, trunk: Trunk, last: bool):
        self.group, self.stage, self.trunk, self.last = group, stage, trunk, last
        self.states: dict[int, TrunkState] = {}  # rank 0's state id -> this stage's part of it
        # rank 0's snapshot id -> this stage's part: the recurrent snapshot and its K/V rows below its
        # position, layer -> K, V [Hkv, pos, d]. Rank 0's prefix cache copies its own layers' K/V into
        # and out of a state around a snapshot (state_cache.keep_copy / restore); a stage keeps its
        # layers' with the snapshot, and a restore puts them back (where they are already, the same rows)
        self.snaps: dict[int, tuple[RecurrentSnapshot, dict[int, tuple[torch.Tensor, torch.Tensor]]]] = {}
        self.traces: dict[int, dict[int, GdnTrace]] = {}  # state id -> its last step's traces (a rollback's)

    def state(self, sid: int) -> TrunkState:
        """The stage's part of state `sid`, made empty on first use (rank 0's new_state says
        nothing: a state's first command makes it; the caches grow as Trunk.reserve grows them)."""
        if sid not in self.states:
            self.states[sid] = self.trunk.new_state(1)
        return self.states[sid]

    def serve(self) -> None:
        """Commands until "stop"."""
        while True:
            cmd: Command = self.group.hear()
            for what, i in cmd.freed:
                (self.states if what == "state" else self.snaps).pop(i, None)
                if what == "state":
                    self.traces.pop(i, None)
            if cmd.kind == "stop":
                self.group.store.set(f"stopped{self.group.rank}", "1")  # (rank 0 leaves after every rank)
                return
            self.run(cmd)

    def run(self, cmd: Command) -> None:
        t = self.trunk
        if cmd.kind in ("step", "prefill", "extend"):
            states = [self.state(s) for s in cmd.sids]
            total = sum(len(tk) for tk in cmd.tokens)
            x0 = self.group.recv((total, t.arch.hidden), self.group.rank - 1)
            rows = run_rows(t, self.stage, cmd.kind, states, cmd.tokens, cmd.aux_layers,
                            cmd.rollback or [None] * len(states), x0)
            if cmd.kind == "step":
                for sid, (_, _, tr) in zip(cmd.sids, rows.per):
                    self.traces[sid] = tr
            send_rows(self.group, rows, self.stage, self.last)
        elif cmd.kind == "ping":  # (scripts/bench_parallel.py: a hop's cost, rows passed on untouched)
            x = self.group.recv((cmd.rows, t.arch.hidden), self.group.rank - 1)
            self.group.send(x, 0 if self.last else self.group.rank + 1)
        elif cmd.kind == "snapshot":
            st = self.state(cmd.sids[0])
            kv = {i: (k[:, :st.pos].clone(), v[:, :st.pos].clone()) for i, (k, v) in st.kv.items()}
            self.snaps[cmd.snap] = (t.snapshot(st), kv)
        elif cmd.kind == "restore":
            st = self.state(cmd.sids[0])
            snap, kv = self.snaps[cmd.snap]
            t.reserve(st, snap.pos)
            for i, (k, v) in kv.items():
                st.kv[i][0][:, :k.shape[1]], st.kv[i][1][:, :v.shape[1]] = k, v
            t.restore(st, snap)
        elif cmd.kind == "rollback":
            st = self.state(cmd.sids[0])
            t.rollback(st, StepOut(None, None, None, self.traces.get(cmd.sids[0], {})), cmd.rows, cmd.kept, cmd.mode)
        else:
            raise RuntimeError(f"unknown command {cmd.kind!r}")


def watch_parent(rank: int) -> None:
    """Ends this rank when rank 0's process is gone (re-parented): its sockets may stay open in a
    stuck process, and a rank must never outlive it."""
    parent = os.getppid()

    def loop() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                abort(f"rank {rank}: rank 0 is gone; ending")

    threading.Thread(target=loop, daemon=True, name="turbo-parallel-parent").start()


def worker_main(rank: int, world: int, port: int, install_path: str, opts: OpenOptions, threads: int,
                stages: list[Stage]) -> None:
    """A spawned rank: threads shared, the group joined, its stage loaded, rank 0's commands run.
    Any failure is one line naming this rank, and the process ends."""
    torch.set_num_threads(share_threads(threads, world) if threads else 1)
    watch_parent(rank)
    try:
        group = Group(rank, world, "127.0.0.1", port)
    except Exception as e:  # (rank 0 gone before the rendezvous)
        abort(f"rank {rank}: could not join the group ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
    serve_rank(group, open_install(install_path), opts, stages)


def serve_rank(group: Group, install: Install, opts: OpenOptions, stages: list[Stage]) -> None:
    """A rank other than 0, joined: its stage loaded, then rank 0's commands until "stop"; this
    process ends there (it exists for this). Any failure is one line naming the rank."""
    rank = group.rank
    try:
        stage = stages[rank]
        trunk = load_stage(install, plan_for(install, opts), stage, first=False)
        group.store.set(f"ready{rank}", "1")  # rank 0 waits for every stage before its first step
        StageWorker(group, stage, trunk, last=rank == group.world - 1).serve()
    except Exception as e:
        what = str(e).splitlines()[0] if str(e) else type(e).__name__
        abort(f"rank {rank}: {what} (a peer rank ended, or this stage failed)")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
