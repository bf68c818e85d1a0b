"""One sequence's generation, whoever runs it: `Runtime.generate` / `stream` / `chat`, sessions and
the probe drive one `Driver` with `Trunk.step` (a batch of one); the server's scheduler drives one
per request with `Trunk.step_many` (turbo/serve/scheduler.py). The driver owns what makes a
sequence's tokens: its drafter (the install's own, or a fork of it for a batch: `DrafterPool`),
the block chooser of the adaptive policy, the stopper, the counters, the commit of each round,
and the state it starts from and ends in. Whoever runs it supplies only the trunk passes:

    d = Driver(trunk, decode, eos_ids, vocab, job, drafter)
    d.start(keeper, images)                # the longest kept prefix restored, the drafter on it
    while not d.done:
        w = d.work()                       # prompt rows left, or the anchor + proposals (drafted here)
        event = d.settle(w, trunk.step(d.st, w.rows, d.aux_layers, w.rollback), step_s)
    d.end()                                # the answer's state into the keeper

A round (docs/DESIGN.md 5) is turbo/sequence/rounds.py's three parts: draft_block in `work`, judge and
close_round in `settle`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Hashable

import torch

from ..drafters import Drafter, KeepsContext, keeps_context
from ..drafters.ngram import NgramConfig, NgramDrafter
from ..errors import TurboError
from ..model.step import StepOut
from ..model.trunk import KV_CHUNK, Trunk, TrunkState
from ..vision.positions import PromptImages, rows_between
from .adaptive import AdaptiveChooser, LazyContext
from .grammar import GrammarState
from .logprobs import TokenLogprob, token_logprobs
from .penalties import PenaltyState
from .policy import Plan
from .rounds import close_round, draft_block, judge
from .sampling import RejectionSampler
from .seam import call
from .state_cache import ByIdentity, Keeper, TurnReport, tensor_bytes
from .stats import Stats, TokenClock
from .stops import Finish, Stopper, stop_token_set

if TYPE_CHECKING:
    from .options import GenerationOptions

DraftKey = tuple  # (kind, window or ngram config): which of the install's drafters, and its context
ROUND_ROWS = 16  # K/V rows a state holds past its answer's first KV_CHUNK tokens: a round's rows past them


def kv_capacity(prompt: int, max_new_tokens: int) -> int:
    """The K/V rows a sequence's state starts with: its prompt and a first chunk of its answer
    (Trunk.reserve grows it as the answer goes on: a huge max_new_tokens reserves nothing)."""
    return prompt + min(max_new_tokens, KV_CHUNK) + ROUND_ROWS


def choice_options(o: GenerationOptions, n: int) -> list[GenerationOptions]:
    """The options of n choices of one request (OpenAI's `n`; `Runtime.choices` and the server's):
    choice i samples with seed + i where a seed is given (greedy choices are all one)."""
    return [o if i == 0 or o.seed is None else o.but(seed=(o.seed + i) % 2**64) for i in range(n)]


@dataclass
class RoundEvent:
    tokens: list[int]  # committed this round
    from_draft: list[bool]  # per token: True = an accepted proposal, False = the trunk's bonus token
    text: str  # the text released this round (what may begin a stop string waits: turbo.sequence.stops)
    stats: Stats | None  # the counters so far (a copy; a batched request's: on its last event only)
    done: bool = False
    finish: Finish | None = None  # on the last event: why it ended (turbo.sequence.stops)
    logprobs: list[TokenLogprob] | None = None  # one per token when the request asked
    cached_tokens: int = 0  # prompt tokens a kept state served (no prefill)
    cached_from: str | None = None  # the kind of mark that kept state was kept at (state_cache.MARK_KINDS)


@dataclass
class Job:
    """A checked generation request (Runtime.prepare): what its driver runs."""

    ids: list[int]  # the prompt's token ids, as fitted to the context
    options: GenerationOptions
    plan: Plan
    own: bool  # the drafter is the caller's object
    sampler: RejectionSampler | None  # None: greedy
    stats: Stats  # the counters, started
    grammar: GrammarState | None = None  # the output's constraint (response_format), at its start

    def draft_key(self) -> DraftKey | None:
        """Which of the install's drafters this job drafts with (None: none, or the caller's own)."""
        kind, o = self.plan.drafter, self.options
        if kind is None or self.own:
            return None
        return kind, o.ngram if kind == "ngram" else o.window


@dataclass(slots=True)
class Work:
    """The rows a sequence runs in the next trunk pass."""

    rows: list[int]
    rollback: str | None  # how a rejected round restores the state (None: nothing to reject)
    logit_rows: int  # 0: a chunk of the prompt; else the round's rows (anchor + proposals)


class DrafterPool:
    """The install's drafters: one per (kind, window or n-gram config), built on first use by
    `build`, and the free forks of each (a batch runs one per sequence; a fork goes back here
    when its sequence ends)."""

    def __init__(self, build: Callable[[str, int | None, NgramConfig], Drafter]):
        self.build = build
        self.bases: dict[DraftKey, Drafter] = {}
        self.free: dict[DraftKey, list[Drafter]] = {}

    def base(self, key: DraftKey, ngram: NgramConfig = NgramConfig()) -> Drafter:
        if key not in self.bases:
            kind, window = key
            self.bases[key] = self.build(kind, None if kind == "ngram" else window, ngram)
        return self.bases[key]

    def acquire(self, key: DraftKey, ngram: NgramConfig = NgramConfig()) -> KeepsContext | None:
        free = self.free.setdefault(key, [])
        return free.pop() if free else self.base(key, ngram).fork()

    def release(self, key: DraftKey, drafter: Drafter) -> None:
        self.free.setdefault(key, []).append(drafter)


class Driver:
    """One sequence: its state, drafter, chooser, stopper and counters, round after round."""

    def __init__(self, trunk: Trunk, decode: Callable[[list[int]], str], eos_ids: tuple[int, ...], vocab: int,
                 job: Job, drafter: Drafter | None, *, logprobs: int | None = None, live_stats: bool = True):
        o = job.options
        self.trunk, self.vocab, self.job, self.logprobs = trunk, vocab, job, logprobs
        self.inner = drafter  # the drafter itself; `draft` may wrap it for the adaptive policy
        self.draft: Drafter | LazyContext | None = drafter
        self.aux_layers: tuple[int, ...] = tuple(drafter.aux_layers) if drafter is not None else ()
        job.stats.window = drafter.window if drafter is not None else None
        self.stopper = Stopper(decode, o.stop or (), stop_token_set(eos_ids, o.stop_at_eos, o.stop_token_ids),
                               o.max_new_tokens)
        # a stop inside a round cuts the round there (the state ends at the stop) where the state
        # outlives the generation (a keeper's: start); else the round is played whole
        self.cut_in_round = False
        # every event carries a copy of the counters (a stream's reader shows them live), or the
        # last one only (a batch's: a copy a round per sequence is a step's cost at small shapes)
        self.live_stats = live_stats
        self.chooser: AdaptiveChooser | None = None
        if job.plan.policy == "adaptive" and drafter is not None:
            # under sampling the blocks are chosen from counts (the seed repeats the text), and
            # the seconds other generations measured are not read
            sampled = job.sampler is not None
            self.chooser = AdaptiveChooser(job.plan.block, memory=(drafter, o.rollback) if not sampled else None,
                                           counted=sampled)
        # repetition / frequency / presence penalties and logit_bias, at every committed position
        self.penalties = PenaltyState(o.penalties, job.ids) if o.penalties.active else None
        self.grammar = job.grammar  # response_format: the mask, at every committed position too
        self.clock = TokenClock()
        self.st: TrunkState | None = None
        self.anchor = job.ids[-1]
        self.generated: list[int] = []
        self.done = False
        # where it starts from and ends in (start)
        self.keeper: Keeper | None = None
        self.images: PromptImages | None = None
        self.key: list = list(job.ids)  # what a kept state of it is matched by (image rows tagged)
        # whose context a kept state holds for the drafter (None: none; the n-gram drafter's is the
        # ids alone, which its begin rebuilds), and whether a kept state can serve it at all: only
        # where a state prefilled in pieces is the one prefill gives (the native step), and the
        # drafter's context can be snapshotted (not a caller's object without snapshot)
        self.context_key: Hashable | None = None
        self.resumes = trunk.stepper.prefill_rows_are_steps
        if drafter is not None and not isinstance(drafter, NgramDrafter):
            self.context_key = job.draft_key() or ByIdentity(drafter)
            self.resumes = self.resumes and keeps_context(drafter)
        self.chunked = False  # the prompt's rows left to `work` (else run at once in start)
        self.marks: dict[int, str] = {}  # the prompt rows where the keeper keeps the state -> their kinds
        self.held = 0  # prompt rows a kept state served
        self.held_from: str | None = None  # the kind of mark the kept state was kept at (None: no kept state)
        self.context_at = 0  # the drafter's context holds ids[:context_at + 1]
        self.context_held = False  # ... once it has begun (or was restored from the kept state)
        self.done_rows = 0  # prompt rows (of ids[:-1]) through the trunk
        self.parts: list[StepOut] = []  # the prompt's rows since context_at, for the drafter's context
        # this round's
        self.proposals: list[int] = []
        self.q: torch.Tensor | None = None
        # the first proposal the grammar refused and its q row [1, V], under sampling (see work)
        self.refused: tuple[list[int], torch.Tensor] | None = None
        self.block = 0
        self.draft_s = 0.0

    # ---- the start -----------------------------------------------------------------------

    def start(self, keeper: Keeper | None = None, images: PromptImages | None = None, *,
              chunked: bool = False) -> None:
        """The only start of a sequence: the longest prefix of the prompt `keeper` holds (None:
        none, a plain generation) restored, the drafter's context with it, and the prompt's rest
        (with its images' rows) run through the trunk -- at once here, or left to `work` as
        chunks (`chunked`: a batch's, where a state prefilled in pieces is the one prefill
        gives; never with images). The state is kept at each of the keeper's marks on the way
        (at or past the restored prefix: a chunk ends at each, so the state there holds exactly
        the prompt's prefix)."""
        trunk, ids, n = self.trunk, self.job.ids, len(self.job.ids) - 1  # ids[-1]: the first anchor
        if images is not None:
            if images.tokens != ids:
                raise TurboError("a prompt with images is never truncated: shorten it, or lower max_new_tokens")
            if images.mm.rows.numel() and int(images.mm.rows[-1]) == n:
                raise TurboError("a prompt cannot end in an image: end it with text (the chat template does)")
            self.key = list(images.keyed)
        self.keeper, self.images = keeper, images
        self.cut_in_round = keeper is not None
        capacity = kv_capacity(len(ids), self.job.options.max_new_tokens)
        hit = keeper.kept.lookup(self.key, self.context_key) if keeper is not None and self.resumes else None
        if hit is None:
            if keeper is not None:
                keeper.forget()
            self.st = keeper.fresh(trunk, capacity) if keeper is not None else trunk.new_state(capacity)
        else:
            self.st = keeper.restore(trunk, hit, capacity)
            if self.context_key is not None:
                self.inner.restore(hit.drafts[self.context_key])
            self.held = self.done_rows = self.context_at = hit.pos
            self.held_from = hit.kind
            self.context_held = self.context_key is not None
        if keeper is not None and self.resumes:
            for m, kind in keeper.marks.items():
                m = n if m is None else min(m, n)
                if m >= self.held:
                    self.marks.setdefault(m, kind)  # (a boundary's kind over the prompt's end at the same row)
            self.marks = dict(sorted(self.marks.items()))
        self.chunked = chunked and self.resumes and images is None
        if not self.chunked:
            for m in self.marks:
                if m < n:
                    self._prefill(m)
            self._prefill(n)
        elif self.held in self.marks or not self.prefilling:  # (settle reaches the marks and the end past them)
            self._reached(self.held)
        if keeper is not None:
            how = "fresh" if hit is None else "last turn" if hit.trunk is None else "snapshot"
            keeper.report = TurnReport(len(ids), self.held, n - self.held, how, len(keeper.kept), keeper.kept.nbytes)

    def _prefill(self, end: int) -> None:
        """The prompt's rows done_rows..end through the trunk at once (a prefill from the empty
        state, else an extension), with their images' rows."""
        p, st = self.done_rows, self.st
        if end > p:
            rows = self.job.ids[p:end]
            mm = rows_between(self.images.mm, p, end) if self.images is not None else None
            out = self.trunk.prefill(st, rows, self.aux_layers, mm=mm) if st.pos == 0 else \
                self.trunk.extend(st, rows, self.aux_layers, mm)
            if self.inner is not None:
                self.parts.append(out)
            self.done_rows = end
        self._reached(end)

    def _reached(self, end: int) -> None:
        """The prompt's rows before `end` are through the trunk: the drafter takes them (begun
        afresh on them, or resumed from the kept state's context), the state is kept where it is
        one of the marks, and at the prompt's end the rounds start."""
        ids, d = self.job.ids, self.inner
        out = None
        if self.parts:
            hidden = torch.cat([p.hidden for p in self.parts])
            aux = torch.cat([p.aux for p in self.parts]) if self.parts[0].aux is not None else None
            out = StepOut(torch.empty(0), hidden, aux)
        self.parts = []
        if d is not None:
            if not self.context_held:
                call(d, "begin", d.begin, out, ids[:end + 1])
            elif out is not None:
                call(d, "resume", d.resume, out, ids[:end + 1], self.context_at)
        self.context_held, self.context_at = True, end
        if end in self.marks:
            self.keeper.keep(self.trunk, self.st, self.key[:end + 1], self.context_key,
                             d.snapshot() if self.context_key is not None else None, self.marks[end])
        if end == len(ids) - 1:
            if self.images is not None:
                self.st.rope_delta = self.images.mm.delta  # the rows after the prompt rotate past its images
            if self.chooser is not None:
                self.draft = LazyContext(self.inner, self.chooser)  # plain rounds skip the drafter's work

    @property
    def prefilling(self) -> bool:
        return self.done_rows < len(self.job.ids) - 1

    # ---- the rounds ----------------------------------------------------------------------

    def work(self, prefill_room: int | None = None) -> Work | None:
        """The rows of this sequence's next pass: a chunk of its prompt (at most `prefill_room`
        rows; None: no chunk this pass), or a round's anchor and proposals (drafted here)."""
        if self.prefilling:
            if prefill_room is None or prefill_room <= 0:
                return None  # the pass's prompt rows are spent: it goes on next pass
            # a chunk ends at the next mark (the state kept there holds exactly the prompt's prefix)
            stop = next((m for m in self.marks if m > self.done_rows), len(self.job.ids) - 1)
            n = min(prefill_room, stop - self.done_rows)
            return Work(self.job.ids[self.done_rows:self.done_rows + n], None, 0)
        job = self.job
        self.block = self.chooser.next_block() if self.chooser is not None else job.plan.block  # adaptive: 0 = plain
        t0 = time.perf_counter()
        self.proposals, self.q = draft_block(self.draft, self.anchor, self.st.pos, self.block, job.sampler, self.vocab)
        self.refused = None
        if self.grammar is not None:  # what the grammar forbids could never be accepted: not verified
            n = self.grammar.allowed_prefix(self.proposals)
            if self.q is not None and n < len(self.proposals):
                # but the acceptance rule still judges the first refused one (p = 0 there: rejected
                # for sure), so that its row draws from the residual max(0, p - q) as the rule must;
                # drawing from p would not keep the target distribution (a point-mass drafter's
                # residual is p: q None needs nothing)
                self.refused = (self.proposals[n:n + 1], self.q[n:n + 1])
            self.proposals, self.q = self.proposals[:n], self.q[:n] if self.q is not None else None
        self.draft_s = time.perf_counter() - t0
        rows = [self.anchor] + self.proposals
        return Work(rows, job.options.rollback if self.proposals else None, len(rows))

    def settle(self, w: Work, out: StepOut, step_s: float) -> RoundEvent | None:
        """The pass's rows for `w` are through the trunk (`step_s`: this sequence's share of its
        time): a prompt chunk is kept for the drafter (None); a round is judged, rolled back to
        what it commits, and its event returned."""
        if w.logit_rows == 0:
            if self.inner is not None:
                self.parts.append(out)
            self.done_rows += len(w.rows)
            if self.done_rows in self.marks or self.done_rows == len(self.job.ids) - 1:
                self._reached(self.done_rows)
            return None
        job, o, stats, stops = self.job, self.job.options, self.job.stats, self.stopper
        t0 = time.perf_counter()
        # row i judged as plain decoding would see it: after the proposals before it
        logits = self.penalties.rows(out.logits, self.proposals) if self.penalties is not None else out.logits
        logits = self.grammar.rows(logits, self.proposals) if self.grammar is not None else logits
        judged, q = self.proposals, self.q
        if self.refused is not None:
            judged, q = judged + self.refused[0], torch.cat([q, self.refused[1].to(q.dtype)])
        accepted, bonus, landed = judge(judged, q, logits, job.sampler, stops.cut if self.cut_in_round else None)
        committed = self.proposals[:accepted] + [bonus]
        lps = token_logprobs(out.logits, committed, self.logprobs) if self.logprobs is not None else None
        t1 = time.perf_counter()
        replayed = close_round(self.trunk, self.st, self.draft, out, self.proposals, accepted, bonus, o.rollback)
        if self.chooser is not None:
            self.chooser.observe(self.block, landed, self.draft_s, step_s + t1 - t0, time.perf_counter() - t1)
        # the counters keep the trunk's verdict on the proposals: a stop decides what is
        # committed, not how well the drafter guessed
        stats.record_round(len(self.proposals), landed, replayed)
        if not self.cut_in_round:
            keep = stops.cut(committed)
            committed = committed[:keep] if keep is not None else committed
        committed = committed[:o.max_new_tokens - len(self.generated)]
        self.generated += committed
        if self.penalties is not None:
            self.penalties.commit(committed)
        if self.grammar is not None:
            self.grammar.commit(committed)
        stats.record_tokens(len(self.generated), self.clock)
        self.done = stops.finish is not None
        self.anchor = bonus
        return RoundEvent(committed, [i < landed for i in range(len(committed))], stops.text(self.done),
                          stats.snapshot() if self.live_stats or self.done else None, self.done, stops.finish,
                          lps[:len(committed)] if lps else lps, self.held, self.held_from)

    # ---- the end -------------------------------------------------------------------------

    def end(self) -> None:
        """The only end of a sequence: its answer's state into the keeper (where the state holds
        exactly prompt + answer, and a kept state can serve a later start), with the drafter's
        context there; a session's account of it."""
        k = self.keeper
        if k is None:
            return
        keep = self.trunk.stepper.prefill_rows_are_steps and self.ends_at_answer()
        # (the context as every round left it: the adaptive policy's plain rounds commit theirs now)
        snap = self.context().snapshot() if self.context_key is not None and (keep or k.live) else None
        if keep:
            k.keep(self.trunk, self.st, self.key + self.generated, self.context_key, snap, "answer")
        k.report.snapshot_bytes += tensor_bytes(snap)

    def context(self) -> Drafter | None:
        """The drafter with every round committed (the adaptive policy's plain rounds keep
        theirs pending until the next proposal): for a caller keeping its context."""
        if isinstance(self.draft, LazyContext):
            self.draft.flush()
        return self.inner

    def ends_at_answer(self) -> bool:
        """The state holds exactly prompt + answer (a last round cut short by max_new_tokens, or
        a stop outside the round, ran the trunk past it)."""
        return self.st is not None and self.st.pos == len(self.job.ids) - 1 + len(self.generated)

