"""The public API (docs/DESIGN.md 5a): `Runtime` over one trunk and the install's drafters: open,
generate, stream, choices, chat, session. Each generation is one Driver (turbo/sequence/driver.py)
run with `Trunk.step`, a batch of one; the speculative round is turbo/sequence/rounds.py's.

    rt = turbo.open("tiny")
    result = rt.generate("def fib(n):", max_new_tokens=64, policy="fixed", block=4)
    for event in rt.stream("def fib(n):"):  # one event per committed round
        print(event.text, end="")
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any, Iterator

import numpy as np
import torch
from tokenizers import Tokenizer

from .backends import Backend, native_lib, select_backend
from .chat.image_session import VisionSession
from .chat.session import Session
from .chat.template import ChatTemplate
from .chat.turn import ChatResult, run_chat, template_for
from .drafters import Drafter
from .drafters.ngram import NgramConfig, NgramDrafter
from .errors import TurboError, checked_text
from .load.install_check import check_install
from .load.loader import load_drafter, load_trunk
from .parallel import open_pipeline
from .sequence.driver import DrafterPool, Driver, Job, RoundEvent, choice_options
from .sequence.grammar import Grammars
from .sequence.options import GenerationOptions, OpenOptions, check_n, fit_context, integer
from .sequence.policy import DraftPolicy, Plan, decide
from .sequence.sampling import rejection_sampler
from .sequence.seam import check_drafter_object
from .sequence.state_cache import DEFAULT_SNAPSHOTS, Keeper
from .sequence.stats import Stats
from .sequence.stops import Finish, stop_token_set
from .store.install import Install, bundled_names, open_install
from .vision.positions import PromptImages
from .vision.runtime import image_prompt, refuse_unplaced

DEFAULT_GENERATION = GenerationOptions()
ABANDONED = ("this stream was abandoned: another generation has run on the runtime since; "
             "start a new stream")
REENTERED = ("a generation was started on this runtime from inside its own round (a drafter's propose or "
             "commit): a runtime runs one generation at a time; open another runtime for that")
TWO_THREADS = "this stream is being iterated on another thread already: iterate a stream from one thread at a time"
Prompt = str | list[int] | tuple[int, ...] | np.ndarray  # text, or token ids


@dataclass
class GenerateResult:
    tokens: list[int]
    text: str
    stats: Stats
    from_draft: list[bool] = field(default_factory=list)
    finish: Finish | None = None  # why it ended: reason "stop" or "length", and the stop matched


# ---- the runtime ---------------------------------------------------------------------------


class Runtime:
    """An open install: its trunk, its tokenizer and its own drafters (built on first use)."""

    def __init__(self, install: Install, opts: OpenOptions):
        self.options = opts
        self.backend: Backend = select_backend(opts.backend, opts.ptx_dir)
        self.install = install
        # the host's tensors: the weights as read, drafters, sampling. backend cuda runs the trunk's step
        # on the device (turbo/backends/cuda_step: its matrices uploaded at open, logits back once a step)
        self.device = torch.device("cpu")
        tok = install.path / "tokenizer.json"
        if not tok.is_file():
            raise TurboError(f"{tok}: missing (expected the install's tokenizer)")
        try:
            self.tokenizer = Tokenizer.from_file(str(tok))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise TurboError(f"{tok}: not a tokenizers file ({e})") from None
        # the parts' agreement is read off the configs and the index: checked before any weight loads
        self.drafter_config = check_install(install, self.tokenizer)  # the DFlash drafter's, parsed (or None)
        # the policy a generation that names none takes, per drafter (the environment's, read at open)
        self.draft_defaults = {kind: DraftPolicy(name, block) for kind, name, block in opts.draft_defaults}
        # one model over several processes (turbo/parallel): the plan refused in one line before any rank loads
        self.trunk = open_pipeline(install, opts) if opts.parallel.world > 1 else \
            load_trunk(install, opts, self.device, on_cuda=self.backend.name == "cuda")
        self.grammars = Grammars(tok.read_text(encoding="utf-8"), install.arch.vocab)  # response_format's
        # the install's drafters (built on first use) and their forks for the server's batches
        self.drafters = DrafterPool(lambda kind, window, ngram: NgramDrafter(ngram) if kind == "ngram"
                                    else load_drafter(kind, self.install, self.trunk, window, self.options))
        # One generation at a time (the drafters and the trunk's caches are the runtime's own):
        # `generate` holds _serial for its whole call, a stream only while it starts; each prefill
        # and round holds _step, and a round of a stream that a later generation took over refuses.
        self._serial = threading.RLock()
        self._step = threading.Lock()
        self._generation = 0  # the latest generation started; only its stream may run rounds
        self._local = threading.local()  # .inside: this thread is in a round (a drafter calling back in)

    @contextmanager
    def _round(self) -> Iterator[None]:
        """Marks this thread as inside a round: a generation started from there (a drafter calling
        the runtime) would wait on the round's own lock for ever, so `stream` refuses it."""
        self._local.inside = True
        try:
            yield
        finally:
            self._local.inside = False

    # ---- helpers -----------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        """A str goes through the tokenizer. Token ids: a list or tuple of Python or numpy integers,
        or a 1-D numpy integer array (bools are not ids)."""
        if isinstance(prompt, str):
            return self._checked_ids(self.tokenizer.encode(checked_text(prompt, "prompt")).ids)
        if isinstance(prompt, np.ndarray) and prompt.ndim != 1:
            raise TurboError(f"prompt array of shape {list(prompt.shape)}: expected a 1-D array of token ids")
        if not isinstance(prompt, (list, tuple, np.ndarray)):
            raise TurboError(f"prompt of type {type(prompt).__name__}: expected a str, or token ids as a list, "
                             "a tuple or a 1-D numpy integer array")
        return self._checked_ids(prompt)

    def _checked_ids(self, tokens) -> list[int]:
        ids, vocab = [integer(t) for t in tokens], self.install.arch.vocab
        if not ids:
            raise TurboError("prompt is empty (expected at least one token)")
        bad = next((t for t, i in zip(tokens, ids) if i is None or not 0 <= i < vocab), None)
        if bad is not None:
            raise TurboError(f"prompt token {bad!r} is not an id in 0..{vocab - 1}")
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def drafter(self, kind: str, window: int | None, ngram: NgramConfig = NgramConfig()) -> Drafter:
        """The install's own drafter of `kind` (dflash | mtp) with that context window, or the
        n-gram drafter with that config (one per config: its begin() starts a generation afresh)."""
        return self.drafters.base((kind, ngram if kind == "ngram" else window), ngram)

    def plan(self, policy: str | None, block: int | None, drafter: str | Drafter, window: int | None = None) -> Plan:
        """What a generation with these options will do on this install (turbo/sequence/policy.py decides)."""
        return decide(self.install, policy, block, drafter, window, self.draft_defaults, self.backend.verify_dtypes,
                      self.drafter_config)

    # ---- the API -----------------------------------------------------------------------

    def generate(self, prompt: Prompt, opts: GenerationOptions | None = None, *, keeper: Keeper | None = None,
                 images: list | PromptImages | None = None, **fields) -> GenerateResult:
        """The whole generation at once; the same options as `stream`. Calls from several threads
        run one after another."""
        tokens, flags, text, event = [], [], [], None
        with self._serial:
            for event in self.stream(prompt, opts, keeper=keeper, images=images, **fields):
                tokens += event.tokens
                flags += event.from_draft
                text.append(event.text)
        return GenerateResult(tokens, "".join(text), event.stats, flags, event.finish)

    def choices(self, prompt: Prompt, n: int, opts: GenerationOptions | None = None, *,
                images: list | None = None, **fields) -> list[GenerateResult]:
        """n generations of one prompt (OpenAI's `n`): the prompt prefilled once, each choice
        going on from the state a keeper kept at the prompt's end, as the server's choices go on
        from its prefix cache; choice i samples as `choice_options` says (greedy choices are all one).
        Each choice's tokens are those `generate` gives it alone."""
        n = check_n(n)
        o = self.prepare(prompt, opts, **fields).options  # refused here, before any choice runs
        if images is not None:  # (an image prompt's rows are expanded per generation: each its own prefill)
            return [self.generate(prompt, c, images=images) for c in choice_options(o, n)]
        ids, shared = self.encode(prompt), Keeper.session(1)
        shared.marks = {None: "prompt"}  # the snapshot: the prompt's state, its last token the first anchor
        return [self.generate(ids, c, keeper=shared) for c in choice_options(o, n)]

    def chat(self, messages: list, opts: GenerationOptions | None = None, *, tools: list | None = None,
             tool_choice: str = "auto", documents: list | None = None, template: str | ChatTemplate | None = None,
             **kw: Any) -> ChatResult:
        """The assistant's answer to `messages`, rendered by the install's chat template (or
        `template`). Keywords that are GenerationOptions fields are generation options, the
        others go to the template (enable_thinking=False). With `tools`, the answer's calls are
        read into message["tool_calls"] (OpenAI's shape); `tool_choice` "required" or a tool's
        name makes it call one (turbo/chat/tool_calls.py). turbo/chat/turn.py."""
        return run_chat(self, messages, opts, tools, documents, template, kw, tool_choice)

    def session(self, system: str | None = None, *, tools: list | None = None, tool_choice: str = "auto",
                template: str | ChatTemplate | None = None, snapshots: int = DEFAULT_SNAPSHOTS,
                **template_kwargs: Any) -> Session:
        """A conversation that keeps its state between turns (turbo/chat/session.py); keywords go to
        the template. `snapshots`: how many assistant turns' starting states it keeps. With
        `tools`, answers' calls are read (Session.pending_calls) and answered with
        Session.send_tool_results; `tool_choice` is every turn's unless a turn gives its own."""
        kind = VisionSession if self.install.has_vision else Session  # (turbo/chat/image_session.py: image parts)
        return kind(self, template_for(self.install, template), system, tools, template_kwargs, snapshots,
                    tool_choice)

    def stream(self, prompt: Prompt, opts: GenerationOptions | None = None, *, keeper: Keeper | None = None,
               images: list | PromptImages | None = None, **fields) -> Iterator[RoundEvent]:
        """Yields one event per committed round. `opts` (turbo.sequence.options.GenerationOptions), or its
        fields as keywords (over `opts` when both). Validation happens before the first yield.
        Another generation started before this stream ends takes the runtime over: this stream's
        next round then raises TurboError. `keeper`: the states it may go on from and keeps its
        answer's in (a chat session's resumes its conversation; turbo/sequence/state_cache.py).
        `images`: paths, bytes, PIL images or data: URLs, one per image placeholder of the prompt
        (turbo/vision), or the prompt's images as the trunk takes them (a session's)."""
        if getattr(self._local, "inside", False):
            raise TurboError(REENTERED)
        if images is not None and not isinstance(images, PromptImages) and \
                (not isinstance(images, (list, tuple)) or images):
            prompt, images = image_prompt(self, prompt, images, keeper is not None and keeper.live)
        rows = images if isinstance(images, PromptImages) else None
        with self._serial:  # waits for a `generate` running on another thread
            return OneThread(self._stream(prompt, opts, keeper, rows, **fields))

    def _stream(self, prompt: Prompt, opts: GenerationOptions | None, keeper: Keeper | None,
                images: PromptImages | None, **fields) -> Iterator[RoundEvent]:
        job = self.prepare(prompt, opts, keeper, images is not None, **fields)
        key = job.draft_key()
        draft = job.options.drafter if job.own else self.drafters.base(key, job.options.ngram) if key else None
        return self._rounds(self.driver(job, draft), keeper, images)

    def driver(self, job: Job, draft: Drafter | None, *, logprobs: int | None = None,
               live_stats: bool = True) -> Driver:
        """A driver for `job` with `draft` (turbo/sequence/driver.py): this runtime's trunk and tokenizer."""
        return Driver(self.trunk, self.decode, self.install.eos_ids, self.install.arch.vocab, job, draft,
                      logprobs=logprobs, live_stats=live_stats)

    def prepare(self, prompt: Prompt, opts: GenerationOptions | None, keeper: Keeper | None = None,
                images: bool = False, **fields) -> Job:
        """A generation's request checked against this install, and what it will run: every
        refusal a stream (or the server's scheduler) can give before its first round. `keeper`:
        the one it will start from; `images`: its prompt's image rows are given."""
        o = opts if opts is not None else DEFAULT_GENERATION
        if not isinstance(o, GenerationOptions):
            raise TurboError(f"options of type {type(o).__name__}: expected a GenerationOptions, or its fields as "
                             "keywords (generate(prompt, max_new_tokens=64))")
        if fields:
            o = o.but(**fields)  # GenerationOptions checks each field; what needs the install is here
        whole = self.encode(prompt)
        whole_kept = keeper is not None and keeper.live  # a live state holds its conversation: never cut
        refuse_unplaced(self.install, whole, images, whole_kept)
        ids = self._fitted(whole, o, whole_kept)
        vocab = self.install.arch.vocab
        bad = next((t for t in o.stop_token_ids or () if not 0 <= t < vocab), None)
        if bad is not None:
            raise TurboError(f"stop_token_ids: {bad} is not an id in 0..{vocab - 1}", field="stop_token_ids")
        bad = next((t for t, _ in o.logit_bias or () if t >= vocab), None)
        if bad is not None:
            raise TurboError(f"logit_bias: {bad} is not an id in 0..{vocab - 1}", field="logit_bias")
        own = not isinstance(o.drafter, str)  # the caller's drafter object
        if own:
            check_drafter_object(o.drafter, self.install.arch.num_layers)
        p = self.plan(o.policy, o.block, o.drafter, o.window)
        sampler = rejection_sampler(o.temperature, o.top_k, o.top_p, o.min_p, o.seed)  # None: greedy
        stats = Stats(prompt_tokens=len(ids), prompt_truncated_from=len(whole) if len(ids) < len(whole) else None,
                      policy=p.policy, drafter=p.drafter, block=p.block, rollback=o.rollback,
                      backend=self.backend.name, speculation_off_reason=p.off_reason,
                      seed=sampler.sampler.seed if sampler is not None else None)
        grammar = None
        if o.response_format is not None:  # compiled (once per format) and checked before the first round
            stops = stop_token_set(self.install.eos_ids, o.stop_at_eos, o.stop_token_ids)
            grammar = self.grammars.state(o.response_format, tuple(sorted(stops)))  # (the grammar's end lets these)
        return Job(ids, o, p, own, sampler, stats, grammar)

    def _fitted(self, ids: list[int], o: GenerationOptions, whole_kept: bool) -> list[int]:
        """`ids` fitted to the context with max_new_tokens (the one check: options.fit_context; a
        session's whole kept conversation is never cut)."""
        return fit_context(ids, o, self.install.arch.max_positions, whole_kept)

    def _rounds(self, d: Driver, keeper: Keeper | None, images: PromptImages | None) -> Iterator[RoundEvent]:
        """The sequence as a batch of one: its driver's rounds, each through `Trunk.step` (the
        scheduler's are through `Trunk.step_many`; the rest is the same)."""
        trunk = self.trunk
        with self._serial, self._step, self._round():  # this generation takes the runtime over
            self._generation += 1
            me = self._generation
            d.start(keeper, images)
        while not d.done:
            with self._step, self._round():
                if self._generation != me:
                    raise TurboError(ABANDONED)
                w = d.work()
                t = time.perf_counter()
                out = trunk.step(d.st, w.rows, d.aux_layers, w.rollback)
                event = d.settle(w, out, time.perf_counter() - t)
                if event.done:
                    d.end()
            yield event


class OneThread:
    """A stream's events, refused (TurboError) to a second thread while one is inside a round,
    where a bare generator would raise "generator already executing"."""

    def __init__(self, events: Iterator[RoundEvent]):
        self.events, self.busy = events, threading.Lock()

    def __iter__(self) -> OneThread:
        return self

    def __next__(self) -> RoundEvent:
        if not self.busy.acquire(blocking=False):
            raise TurboError(TWO_THREADS)
        try:
            return next(self.events)
        finally:
            self.busy.release()

    def close(self) -> None:
        self.events.close()


def open(path_or_name: str | Path = "tiny", opts: OpenOptions | None = None, **fields) -> Runtime:  # noqa: A001
    """Open an install: a directory, or the name of one shipped in the package ("tiny").
    `opts` (turbo.sequence.options.OpenOptions), or its fields as keywords (backend=, dtype=,
    draft_products=, ...) with the environment's say on the rest (OpenOptions.from_env)."""
    if not isinstance(path_or_name, (str, PurePath)):
        raise TurboError(f"install of type {type(path_or_name).__name__}: expected a directory (a str or a Path) "
                         f"or a shipped install's name ({', '.join(bundled_names())})")
    if opts is not None and not isinstance(opts, OpenOptions):
        raise TurboError(f"options of type {type(opts).__name__}: expected an OpenOptions, or its fields as keywords")
    if opts is None:
        opts = OpenOptions.from_env(**fields)
    elif fields:
        opts = opts.but(**fields)
    native_lib.check_draft_products(opts.draft_products)  # before the install loads
    if opts.threads is not None:  # checked in range by OpenOptions: torch crashes far past the cores
        torch.set_num_threads(opts.threads)
    return Runtime(open_install(path_or_name), opts)
