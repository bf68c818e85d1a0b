"""The continuous-batching engine: requests join a running batch, and each step runs every running
sequence's rows (its anchor and its drafter's proposals, or a chunk of its prompt) through one
trunk pass (`Trunk.step_many`); acceptance, rollback and the drafter's commit are per sequence.

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

import torch

from ..adaptive import AdaptiveChooser, LazyContext
from ..backends.step import StepOut
from ..drafters import Drafter
from ..drafters.ngram import NgramDrafter
from ..errors import TurboError
from ..options import GenerationOptions
from ..rounds import close_round, draft_block, judge
from ..stats import Stats, TokenClock
from ..stops import Finish, Stopper
from ..trunk import TrunkState
from ..vision.runtime import ImageStart
from .costs import StepCosts, sequence_bytes
from .images import cache_key, prefill_request
from .prefix_cache import DraftKey, PrefixCache

if TYPE_CHECKING:
    from ..engine import Job, Runtime


class Overloaded(TurboError):
    """The waiting queue is full (the server answers 429)."""


@dataclass(frozen=True)
class ServeLimits:
    max_running: int = 16  # sequences in the running batch
    max_waiting: int = 64  # requests queued beyond it; more are refused (Overloaded)
    memory_gb: float = 4.0  # K/V caches and recurrent states of the running sequences, reserved at admission
    cache_gb: float = 1.0  # the prefix cache's snapshots (LRU)
    prefill_chunk: int = 256  # prompt rows a sequence runs per step (long prompts do not stall the batch)


@dataclass
class Request:
    ids: list[int]  # the prompt's token ids (a chat's rendered by its template)
    options: GenerationOptions = field(default_factory=GenerationOptions)
    logprobs: int | None = None  # None: none; k >= 0: each generated token's logprob and the top k
    images: list | None = None  # turbo.vision PreparedImage, one per image in ids (turbo/serve/images.py)


@dataclass
class TokenLogprob:
    token: int
    logprob: float  # the trunk's log-softmax at the token (raw logits: before temperature)
    top: list[tuple[int, float]]  # the k most likely (token, logprob), most likely first


@dataclass
class Delta:
    """What one engine step committed for one request."""

    tokens: list[int]
    text: str  # the text released (what may begin a stop string waits: turbo.stops)
    logprobs: list[TokenLogprob] | None = None  # one per token when the request asked
    finish: Finish | None = None  # on the last delta: why it ended
    stats: Stats | None = None  # on the last delta: the request's counters
    cached_tokens: int = 0  # prompt tokens the prefix cache served (no prefill)


Sink = Callable[[Delta | TurboError], None]


class Ticket:
    """A submitted request's handle: `cancel` frees its sequence at the next step."""

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class Gauges:
    running: int
    waiting: int
    reserved_bytes: int  # what the running sequences hold of ServeLimits.memory_gb
    cache_bytes: int  # the prefix cache's


@dataclass(eq=False)
class Sequence:
    """One request in the running batch."""

    req: Request
    job: Job
    sink: Sink
    ticket: Ticket
    need: int  # bytes reserved at admission
    stopper: Stopper
    draft: Drafter | None = None  # its own drafter (a fork), maybe wrapped for the adaptive policy
    own: Drafter | None = None  # the fork itself (back to the pool when the sequence ends)
    pool_key: DraftKey | None = None
    draft_key: DraftKey | None = None  # whose context the prefix cache keeps for it (None: none)
    chooser: AdaptiveChooser | None = None
    st: TrunkState | None = None
    done_rows: int = 0  # prompt rows (of ids[:-1]) through the trunk
    resumed_at: int | None = None  # where a prefix-cache state took over (None: a cold prefill)
    parts: list[StepOut] = field(default_factory=list)  # the prefill's rows, for the drafter
    anchor: int = 0
    generated: list[int] = field(default_factory=list)
    clock: TokenClock = field(default_factory=TokenClock)  # from submission
    # this step's round
    proposals: list[int] = field(default_factory=list)
    q: torch.Tensor | None = None
    block: int = 0
    draft_s: float = 0.0

    @property
    def prefilling(self) -> bool:
        return self.done_rows < len(self.job.ids) - 1


@dataclass
class Work:
    seq: Sequence
    rows: list[int]
    rollback: str | None
    logit_rows: int


class Scheduler:
    """Requests in, deltas out; one engine thread runs `step` while there is work."""

    def __init__(self, rt: Runtime, limits: ServeLimits = ServeLimits()):
        self.rt, self.trunk, self.limits = rt, rt.trunk, limits
        self.cache = PrefixCache(int(limits.cache_gb * 2**30))
        self.budget = int(limits.memory_gb * 2**30)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.reserved = 0
        self.pool: dict[DraftKey, list[Drafter]] = {}  # free drafter forks per (kind, window / config)
        self.lock = threading.Condition()
        self.thread: threading.Thread | None = None
        self.stopping = False
        # prompt rows run in pieces only where a state prefilled in pieces is the one prefill gives
        self.chunked = self.trunk.stepper.prefill_rows_are_steps
        self.costs = StepCosts()

    # ---- the callers' side --------------------------------------------------------------------

    def submit(self, req: Request, sink: Sink) -> Ticket:
        """Checks the request (TurboError naming the field), queues it (Overloaded when the queue is
        full) and returns its ticket; `sink` gets its deltas on the engine's thread."""
        o = req.options
        if not isinstance(o.drafter, str):
            raise TurboError("drafter: a served request names a drafter (auto, dflash, mtp, ngram), not an object")
        if req.logprobs is not None and (not isinstance(req.logprobs, int) or not 0 <= req.logprobs <= 20):
            raise TurboError(f"logprobs {req.logprobs!r}: expected an integer in 0..20")
        job = self.rt.prepare(req.ids, o, ImageStart(req.ids, None)) if req.images else self.rt.prepare(req.ids, o)
        if job.plan.drafter is not None:
            self.rt.drafter(job.plan.drafter, o.window, o.ngram)  # loads it once; refuses a bad window
        block = job.plan.block or 0
        need = sequence_bytes(self.trunk, len(job.ids) + o.max_new_tokens + block + 1, block)
        if need > self.budget:
            raise TurboError(f"max_tokens: the request needs {need / 2**30:.2f} GiB of state (prompt "
                             f"{len(job.ids)} + {o.max_new_tokens} new tokens), over the server's "
                             f"serve.memory_gb {self.limits.memory_gb:g}")
        eos = set(self.rt.install.arch.eos_token_ids) if o.stop_at_eos else set()
        stopper = Stopper(self.rt.decode, o.stop or (), eos | set(o.stop_token_ids or ()), o.max_new_tokens)
        seq = Sequence(req, job, sink, Ticket(), need, stopper)
        with self.lock:
            if len(self.waiting) >= self.limits.max_waiting:
                raise Overloaded(f"the server is at capacity: {len(self.running)} running, "
                                 f"{len(self.waiting)} waiting (serve.max_waiting); retry later")
            self.waiting.append(seq)
            self.lock.notify()
        return seq.ticket

    def gauges(self) -> Gauges:
        with self.lock:
            return Gauges(len(self.running), len(self.waiting), self.reserved, self.cache.nbytes)

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
        work: list[Work] = []
        prefill_rows = 0
        for s in list(self.running):
            if s.ticket.cancelled:
                self._end(s)
                continue
            try:
                w = self._work(s, self.limits.prefill_chunk - prefill_rows)
            except Exception as e:  # noqa: BLE001 -- one request's failure ends it, not the server
                self._fail(s, e)
                continue
            if w is not None:
                work.append(w)
                prefill_rows += len(w.rows) if s.prefilling else 0
        if not work:
            return
        t0 = time.perf_counter()
        try:
            outs = self.trunk.step_many([w.seq.st for w in work], [w.rows for w in work],
                                        [w.seq.draft.aux_layers if w.seq.draft is not None else () for w in work],
                                        [w.rollback for w in work], [w.logit_rows for w in work])
        except Exception as e:  # noqa: BLE001 -- the batch's states are unknown now: end them all
            for w in work:
                self._fail(w.seq, e)
            return
        seconds, rows = time.perf_counter() - t0, sum(len(w.rows) for w in work)
        self.costs.add(rows, seconds)
        for w, out in zip(work, outs):
            try:
                self._settle(w, out, self.costs.share(len(w.rows), rows, len(work), seconds))
            except Exception as e:  # noqa: BLE001
                self._fail(w.seq, e)

    def _admit(self) -> None:
        with self.lock:
            while self.waiting and len(self.running) < self.limits.max_running:
                s = self.waiting[0]
                if s.ticket.cancelled:
                    self.waiting.popleft()
                    continue
                if self.reserved + s.need > self.budget:
                    return  # it waits for memory (it fits alone: submit checked)
                self.waiting.popleft()
                self.reserved += s.need
                self.running.append(s)
                admitted = s
                try:
                    self._start(admitted)
                except Exception as e:  # noqa: BLE001
                    self._fail(admitted, e)

    def _start(self, s: Sequence) -> None:
        """The sequence's state (from the prefix cache where it holds a prefix), drafter, chooser."""
        job, o = s.job, s.job.options
        # (the budget counts the whole request; the K/V rows are allocated as it grows: Trunk.reserve)
        capacity = len(job.ids) + min(o.max_new_tokens, 256) + 16
        if job.plan.drafter is not None:
            s.pool_key = (job.plan.drafter, o.ngram if job.plan.drafter == "ngram" else o.window)
            free = self.pool.setdefault(s.pool_key, [])
            s.own = free.pop() if free else self.rt.drafter(job.plan.drafter, o.window, o.ngram).fork()
            s.draft = s.own
            job.stats.window = s.own.window
            # the n-gram drafter's context is the token ids alone: begin rebuilds it from the prompt
            s.draft_key = None if isinstance(s.own, NgramDrafter) else s.pool_key
        hit = self.cache.lookup(cache_key(self.rt, job.ids, s.req.images), s.draft_key) if self._cached(s) else None
        if hit is not None:
            s.st = self.cache.restore(self.trunk, hit, capacity)
            s.done_rows = s.resumed_at = len(hit.tokens) - 1
            if s.draft_key is not None:
                s.draft.restore(hit.drafts[s.draft_key])
        else:
            s.st = self.trunk.new_state(capacity)
        if job.plan.policy == "adaptive" and s.draft is not None:
            sampled = job.sampler is not None
            s.chooser = AdaptiveChooser(job.plan.block, memory=(s.own, o.rollback) if not sampled else None,
                                        counted=sampled)
        aux = s.draft.aux_layers if s.draft is not None else ()
        if s.req.images:  # the prompt's rest at once, with its images' rows (turbo/serve/images.py)
            out = prefill_request(self.rt, s.st, job.ids, s.req.images, aux, s.done_rows)
            s.parts = [out] if out is not None else []
            s.done_rows = len(job.ids) - 1
        elif not self.chunked and len(job.ids) > 1:  # the whole prompt at once (the torch step's prefill)
            s.parts = [self.trunk.prefill(s.st, job.ids[:-1], aux)]
            s.done_rows = len(job.ids) - 1
        if not s.prefilling:
            self._begin(s)

    def _work(self, s: Sequence, prefill_room: int) -> Work | None:
        if s.prefilling:
            if prefill_room <= 0:
                return None  # the step's prompt rows are spent: it goes on next step
            n = min(self.limits.prefill_chunk, prefill_room, len(s.job.ids) - 1 - s.done_rows)
            return Work(s, s.job.ids[s.done_rows:s.done_rows + n], None, 0)
        job = s.job
        s.block = s.chooser.next_block() if s.chooser is not None else job.plan.block or 0
        t0 = time.perf_counter()
        s.proposals, s.q = draft_block(s.draft, s.anchor, s.st.pos, s.block, job.sampler, self.rt.install.arch.vocab)
        s.draft_s = time.perf_counter() - t0
        rows = [s.anchor] + s.proposals
        return Work(s, rows, job.options.rollback if s.proposals else None, len(rows))

    def _begin(self, s: Sequence) -> None:
        """The prompt is through the trunk: the drafter takes its context, the cache keeps the state."""
        ids = s.job.ids
        out = None
        if s.parts:
            hidden = torch.cat([p.hidden for p in s.parts])
            aux = torch.cat([p.aux for p in s.parts]) if s.parts[0].aux is not None else None
            out = StepOut(torch.empty(0), hidden, aux)
        s.parts = []
        if s.draft is not None:
            if s.resumed_at is None or s.draft_key is None:
                s.draft.begin(out, ids)
            elif out is not None:
                s.draft.resume(out, ids, s.resumed_at)
        if s.chooser is not None:
            s.draft = LazyContext(s.own, s.chooser)
        s.anchor = ids[-1]
        if self._cached(s):
            self.cache.keep(self.trunk, s.st, cache_key(self.rt, ids, s.req.images), s.draft_key,
                            s.own.snapshot() if s.draft_key else None)

    def _settle(self, w: Work, out: StepOut, share_s: float) -> None:
        s = w.seq
        if w.logit_rows == 0:  # a chunk of its prompt
            if s.draft is not None:
                s.parts.append(out)
            s.done_rows += len(w.rows)
            if not s.prefilling:
                self._begin(s)
            return
        job, o = s.job, s.job.options
        t0 = time.perf_counter()
        accepted, bonus, landed = judge(s.proposals, s.q, out.logits, job.sampler, s.stopper.cut)
        committed = s.proposals[:accepted] + [bonus]
        logprobs = token_logprobs(out.logits, committed, s.req.logprobs) if s.req.logprobs is not None else None
        t1 = time.perf_counter()
        replayed = close_round(self.trunk, s.st, s.draft, out, s.proposals, accepted, bonus, o.rollback)
        if s.chooser is not None:
            s.chooser.observe(s.block, landed, s.draft_s, share_s + t1 - t0, time.perf_counter() - t1)
        stats = job.stats
        stats.record_round(len(s.proposals), landed, replayed)
        committed = committed[:o.max_new_tokens - len(s.generated)]
        s.generated += committed
        stats.record_tokens(len(s.generated), s.clock)
        done = s.stopper.finish is not None
        delta = Delta(committed, s.stopper.text(done), logprobs[:len(committed)] if logprobs else logprobs,
                      s.stopper.finish, stats.snapshot() if done else None, s.resumed_at or 0)
        s.anchor = bonus
        if done:
            self._keep_end(s)
            self._end(s)
        self._send(s, delta)

    def _keep_end(self, s: Sequence) -> None:
        """The state after the answer goes into the cache when it holds exactly prompt + answer
        (a chat client's next turn resends both)."""
        tokens = s.job.ids + s.generated
        if self._cached(s) and s.st.pos == len(tokens) - 1:
            flush = getattr(s.draft, "flush", None)  # the adaptive wrapper keeps commits pending
            if flush is not None:
                flush()
            self.cache.keep(self.trunk, s.st, cache_key(self.rt, tokens, s.req.images), s.draft_key,
                            s.own.snapshot() if s.draft_key else None)

    def _cached(self, s: Sequence) -> bool:
        """The prefix cache serves and keeps this sequence's states (an image request's keyed with
        its images' identity: turbo/serve/images.py)."""
        return self.chunked

    def _send(self, s: Sequence, item: Delta | TurboError) -> None:
        try:
            s.sink(item)
        except Exception:  # noqa: BLE001 -- a caller's sink failing is that caller's loss
            s.ticket.cancel()

    def _fail(self, s: Sequence, e: Exception) -> None:
        self._end(s)
        self._send(s, e if isinstance(e, TurboError) else TurboError(f"the request failed: {e}"))

    def _end(self, s: Sequence) -> None:
        with self.lock:
            if s in self.running:
                self.running.remove(s)
                self.reserved -= s.need
        s.st = None
        if s.own is not None:
            self.pool[s.pool_key].append(s.own)
            s.own = None


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each token's log-probability under the row before it (row i holds token i's), and the top."""
    lp = torch.log_softmax(logits[:len(tokens)].float(), dim=-1)
    out = []
    for i, t in enumerate(tokens):
        best = torch.topk(lp[i], top) if top else None
        pairs = list(zip(best.indices.tolist(), best.values.tolist())) if best is not None else []
        out.append(TokenLogprob(t, float(lp[i, t]), pairs))
    return out
