"""The continuous-batching engine: requests join a running batch, and each step runs every running
sequence's rows (its anchor and its drafter's proposals, or a chunk of its prompt) through one
trunk pass (`Trunk.step_many`). Each sequence is a turbo/sequence/driver.py `Driver`, the one that
`Runtime.generate` runs alone: drafting, acceptance, rollback, stops and counters are its; the
scheduler admits, batches and delivers; each driver starts from the prefix cache and ends in it
(Driver.start / end, turbo/sequence/state_cache.py's Keeper): a start keeps the state at each of
its request's marks (the chat template's boundaries, every serve.snapshot_every rows, the prompt's
end), so that requests sharing a system prompt or earlier turns share their prefill.

    sched = Scheduler(rt, ServeLimits())
    sched.start()
    ticket = sched.submit(Request(ids, GenerationOptions(max_new_tokens=64)), sink)
    # sink(delta) is called on the engine's thread for every step that commits tokens of this
    # request; the last delta has .finish set (or sink receives a TurboError: the request failed)
    ticket.cancel()  # the client went away: its sequence is freed at the next step
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from ..errors import TurboError
from ..sequence.driver import DraftKey, Driver, Job, RoundEvent, Work
from ..sequence.options import GenerationOptions, check_logprobs
from ..sequence.state_cache import Keeper, Marks
from ..vision.runtime import prompt_images
from .costs import StepCosts, sequence_bytes
from .settings import ServeLimits

if TYPE_CHECKING:
    from ..engine import Runtime


class Overloaded(TurboError):
    """The waiting queue is full (the server answers 429)."""


@dataclass
class Request:
    ids: list[int]  # the prompt's token ids (a chat's rendered by its template)
    options: GenerationOptions = field(default_factory=GenerationOptions)
    logprobs: int | None = None  # None: none; k >= 0: each generated token's logprob and the top k
    images: list | None = None  # turbo.vision PreparedImage, one per image in ids (turbo/serve/images.py)
    marks: Marks = field(default_factory=dict)  # prompt row -> kind: where the prefix cache keeps the state on the way


# What one engine step committed for one request: the driver's round event (its logprobs when the
# request asked; cached_tokens: the prompt tokens the prefix cache served).
Delta = RoundEvent

Sink = Callable[[Delta | TurboError], None]


class Ticket:
    """A submitted request's handle: `cancel` frees its sequence at the next step."""

    def __init__(self) -> None:
        self.cancelled = False
        self.begun = False  # its prompt is through the trunk (and in the prefix cache where there is one)

    def cancel(self) -> None:
        self.cancelled = True

    @property
    def settled(self) -> bool:
        """A sequence submitted `after` this one may start: this one's prompt state is there to share."""
        return self.begun or self.cancelled


@dataclass
class Gauges:
    running: int
    waiting: int
    reserved_bytes: int  # what the running sequences hold of ServeLimits.memory_gb
    cache_bytes: int  # the prefix cache's
    cache_entries: int  # the prefix cache's snapshots
    kept_bytes: dict[str, int]  # mark kind -> bytes the snapshots kept at such marks added since the start


@dataclass(eq=False)
class Sequence:
    """One request in the running batch: its driver, and what the batch keeps around it."""

    req: Request
    job: Job
    sink: Sink
    ticket: Ticket
    need: int  # bytes reserved at admission
    after: Ticket | None = None  # admitted once that one's prompt is through (it shares the prefill: n > 1)
    driver: Driver | None = None  # made at admission, with the drafter fork it takes then
    pool_key: DraftKey | None = None  # the drafter fork it holds (back to the pool when it ends)


class Scheduler:
    """Requests in, deltas out; one engine thread runs `step` while there is work."""

    def __init__(self, rt: Runtime, limits: ServeLimits = ServeLimits()):
        self.rt, self.trunk, self.limits = rt, rt.trunk, limits
        self.keeper = Keeper.prefix_cache(int(limits.cache_gb * 2**30))  # what every sequence starts from
        self.cache = self.keeper.kept  # the prefix cache (LRU in bytes)
        self.budget = int(limits.memory_gb * 2**30)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.reserved = 0
        self.lock = threading.Condition()
        self.thread: threading.Thread | None = None
        self.stopping = False
        # prompt rows run in pieces only where a state prefilled in pieces is the one prefill gives
        self.chunked = self.trunk.stepper.prefill_rows_are_steps
        # states kept on a prompt's way (its marks) only where a later prompt can go on from them:
        # a prefix cache with room, on a step whose prefill rows are its steps
        self.keeps_prefixes = self.chunked and self.cache.budget > 0
        self.costs = StepCosts()

    # ---- the callers' side --------------------------------------------------------------------

    def submit(self, req: Request, sink: Sink, after: Ticket | None = None) -> Ticket:
        """Checks the request (TurboError naming the field), queues it (Overloaded when the queue is
        full) and returns its ticket; `sink` gets its deltas on the engine's thread. `after`: a
        ticket whose prompt this one begins with (a choice of the same request): it is admitted
        once that prompt is through, and starts from its state in the prefix cache."""
        o = req.options
        if not isinstance(o.drafter, str):
            raise TurboError("drafter: a served request names a drafter (auto, dflash, mtp, ngram), not an object",
                             field="drafter")
        check_logprobs(req.logprobs)
        job = self.rt.prepare(req.ids, o, images=bool(req.images))
        block = job.plan.block or 0
        need = sequence_bytes(self.trunk, len(job.ids) + o.max_new_tokens + block + 1, block)
        if need > self.budget:
            raise TurboError(f"max_tokens: the request needs {need / 2**30:.2f} GiB of state (prompt "
                             f"{len(job.ids)} + {o.max_new_tokens} new tokens), over the server's "
                             f"serve.memory_gb {self.limits.memory_gb:g}", field="max_tokens")
        seq = Sequence(req, job, sink, Ticket(), need, after)
        with self.lock:
            if len(self.waiting) >= self.limits.max_waiting:
                raise Overloaded(f"the server is at capacity: {len(self.running)} running, "
                                 f"{len(self.waiting)} waiting (serve.max_waiting); retry later")
            self.waiting.append(seq)
            self.lock.notify()
        return seq.ticket

    def gauges(self) -> Gauges:
        with self.lock:
            return Gauges(len(self.running), len(self.waiting), self.reserved, self.cache.nbytes, len(self.cache),
                          dict(self.keeper.kept_bytes))

    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="turbo-engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            self.lock.notify()
        if self.thread is not None:
            self.thread.join()

    def _loop(self) -> None:
        while True:
            with self.lock:
                while not self.stopping and not self.waiting and not self.running:
                    self.lock.wait()
                if self.stopping:
                    return
            self.step()

    # ---- the engine's side ---------------------------------------------------------------------

    def step(self) -> None:
        """Admit what fits, then one trunk pass over every running sequence's rows."""
        self._admit()
        work: list[tuple[Sequence, Work]] = []
        prefill_rows = 0
        for s in list(self.running):
            if s.ticket.cancelled:
                self._end(s)
                continue
            try:
                w = s.driver.work(self.limits.prefill_chunk - prefill_rows)
            except Exception as e:  # noqa: BLE001 -- one request's failure ends it, not the server
                self._fail(s, e)
                continue
            if w is not None:
                work.append((s, w))
                prefill_rows += len(w.rows) if not w.logit_rows else 0
        if not work:
            return
        t0 = time.perf_counter()
        try:
            outs = self.trunk.step_many([s.driver.st for s, _ in work], [w.rows for _, w in work],
                                        [s.driver.aux_layers for s, _ in work], [w.rollback for _, w in work],
                                        [w.logit_rows for _, w in work])
        except Exception as e:  # noqa: BLE001 -- the batch's states are unknown now: end them all
            for s, _ in work:
                self._fail(s, e)
            return
        seconds, rows = time.perf_counter() - t0, sum(len(w.rows) for _, w in work)
        self.costs.add(rows, seconds)
        for (s, w), out in zip(work, outs):
            try:
                self._settle(s, w, out, self.costs.share(len(w.rows), rows, len(work), seconds))
            except Exception as e:  # noqa: BLE001
                self._fail(s, e)

    def _admit(self) -> None:
        with self.lock:
            for s in list(self.waiting):
                if len(self.running) >= self.limits.max_running:
                    return
                if s.ticket.cancelled:
                    self.waiting.remove(s)
                    continue
                if s.after is not None and not s.after.settled:
                    continue  # it shares a prefill still running: the ones behind it go first
                if self.reserved + s.need > self.budget:
                    return  # it waits for memory (it fits alone: submit checked)
                self.waiting.remove(s)
                self.reserved += s.need
                self.running.append(s)
                admitted = s
                try:
                    self._start(admitted)
                except Exception as e:  # noqa: BLE001
                    self._fail(admitted, e)

    def _start(self, s: Sequence) -> None:
        """The sequence's drafter (a fork) and its driver, started from the prefix cache (its
        prompt's rest left to the steps as chunks where they can run so)."""
        job, o = s.job, s.job.options
        s.pool_key = job.draft_key()
        own = self.rt.drafters.acquire(s.pool_key, o.ngram) if s.pool_key is not None else None
        s.driver = d = self.rt.driver(job, own, logprobs=s.req.logprobs, live_stats=False)
        self.keeper.marks = self._marks(s.req, job.ids)  # (read by this start alone)
        d.start(self.keeper, prompt_images(self.rt, job.ids, s.req.images) if s.req.images else None,
                chunked=self.chunked)
        if not d.prefilling:
            s.ticket.begun = True

    def _marks(self, req: Request, ids: list[int]) -> Marks:
        """Where the start of a request over prompt `ids` (as fitted to the context) keeps its
        state: the request's own marks (its template's boundaries: where the ids are the
        request's), every serve.snapshot_every rows (at the same rows in every prompt, so that
        long prompts sharing a prefix share these), and the prompt's end. An image request's own
        marks (counted in its expanded rows) and its end, no chunk marks: a chunk's end could split
        an image's rows, which the image prefill takes whole."""
        n, every = len(ids) - 1, self.limits.snapshot_every
        if not self.keeps_prefixes:
            return {None: "prompt"}
        chunks = {m: "chunk" for m in range(every, n, every)} if every and not req.images else {}
        own = {m: kind for m, kind in req.marks.items() if 0 < m < n} if ids == req.ids else {}
        return {**chunks, **own, None: "prompt"}

    def _settle(self, s: Sequence, w: Work, out, share_s: float) -> None:
        d = s.driver
        was_prefilling = d.prefilling
        event = d.settle(w, out, share_s)
        if event is None:
            if was_prefilling and not d.prefilling:  # the prompt's last chunk: its state is in the cache
                s.ticket.begun = True  # (what waits on it may start)
            return
        if event.done:
            d.end()  # the answer's state into the cache (a chat client's next turn resends both)
            self._end(s)
        self._send(s, event)

    def _send(self, s: Sequence, item: Delta | TurboError) -> None:
        try:
            s.sink(item)
        except Exception:  # noqa: BLE001 -- a caller's sink failing is that caller's loss
            s.ticket.cancel()

    def _fail(self, s: Sequence, e: Exception) -> None:
        self._end(s)
        self._send(s, e if isinstance(e, TurboError) else TurboError(f"the request failed: {e}"))

    def _end(self, s: Sequence) -> None:
        s.ticket.begun = True  # (whatever waits on it goes on without it)
        with self.lock:
            if s in self.running:
                self.running.remove(s)
                self.reserved -= s.need
        d, s.driver = s.driver, None
        if d is not None and s.pool_key is not None and d.inner is not None:
            self.rt.drafters.release(s.pool_key, d.inner)
