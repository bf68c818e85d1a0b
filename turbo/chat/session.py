"""Chat sessions that keep their state: each turn prefills only what the conversation adds.

Every turn renders the whole conversation (turbo/chat/turn.py) and generates over it, with the tokens
a fresh generation over that render gives. `Keeper` is how the stream's state comes to hold the
prompt (the engine's `Start`): it goes on from the longest kept state whose tokens begin the
render -- the state the last turn left, or a snapshot taken at the start of an assistant turn's
generation prompt, where a re-render can diverge (a template that drops earlier reasoning, an
edited system prompt, a retried or edited turn) -- and prefills the rest. K/V only needs its
length cut back; the GDN and conv states and the drafter's context come from the snapshot.
`FreshStart` is the plain prefill every other generation uses.
"""

from __future__ import annotations

import copy
import math
import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

from ..store.arch import show
from .runtime import ChatRuntime
from .turn import Turn, check_template_kwargs, check_tool_choice, turn_stop_ids
from .template import ChatTemplate, encode
from ..drafters import Drafter, keeps_context
from ..sequence.seam import call
from ..errors import TurboError
from ..sequence.options import GENERATION_FIELDS, GenerationOptions
from ..sequence.state_cache import StateCache, tensor_bytes
from ..sequence.stats import Stats
from .tool_calls import ToolCall, tool_messages
from ..model.trunk import Trunk, TrunkState

if TYPE_CHECKING:
    from ..sequence.driver import Driver, RoundEvent, Start

# Snapshots a session keeps: one per assistant turn (the newest). At the 0.8B shape one is the
# 18 GDN layers' state and conv window, 18 x (16*128*128 + 3*6144) x 4 bytes = 19.3 MiB,
# plus the drafter's context (turbo.drafters: snapshot).
DEFAULT_SNAPSHOTS = 4


class FreshStart:
    keeps_state = False

    def prime(self, trunk: Trunk, draft: Drafter | None, ids: list[int], capacity: int) -> TrunkState:
        st = trunk.new_state(capacity)
        aux_layers = draft.aux_layers if draft is not None else ()
        prompt_out = trunk.prefill(st, ids[:-1], aux_layers) if len(ids) > 1 else None
        if draft is not None:
            call(draft, "begin", draft.begin, prompt_out, ids)  # its exception: a TurboError naming it
        return st

    def finish(self, driver: Driver) -> None:
        pass


FRESH = FreshStart()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class ByIdentity:
    """A drafter as the cache's key for its context: the object itself (kept alive), compared by
    identity (a caller's drafter need not be hashable, nor equal only to itself)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Drafter):
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ByIdentity) and other.obj is self.obj


@dataclass
class TurnReport:
    prompt_tokens: int  # the rendered conversation's
    reused_tokens: int  # of them, held by the state the turn went on from
    prefilled_tokens: int  # run through the trunk before the first round
    resumed_from: str  # "last turn" | "snapshot" | "fresh"
    snapshots: int  # kept after the turn started
    snapshot_bytes: int  # what they and the last turn's drafter context hold
    tokens: list[int] = field(default_factory=list)  # generated
    stats: Stats | None = None


class Keeper:
    """A session's trunk state and the states kept in it (a `Start`): the live one, as the last
    complete turn left it, and a snapshot at the start of each of the last `limit` assistant
    turns' generation prompts (turbo/sequence/state_cache.py; their K/V rows are the state's own)."""

    keeps_state = True

    def __init__(self, limit: int = DEFAULT_SNAPSHOTS):
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise TurboError(f"snapshots {limit!r}: expected a non-negative integer")
        self.limit = limit
        self.st: TrunkState | None = None
        self.kept = self.emptied()  # each entry's tokens begin the state's
        self.mark = 0  # where this turn's snapshot goes: the start of its generation prompt
        self.fresh: Start = FRESH  # how a turn that cannot go on from a kept state prefills
        self.report = TurnReport(0, 0, 0, "fresh", 0, 0)
        self._draft: Drafter | None = None
        self._end_draft: Any = None

    def prime(self, trunk: Trunk, draft: Drafter | None, ids: list[int], capacity: int) -> TrunkState:
        # every turn afresh where a state prefilled in pieces would not be the one prefill gives (the
        # torch step), or where the drafter cannot snapshot its context (a caller's object)
        if not trunk.stepper.prefill_rows_are_steps or (draft is not None and not keeps_context(draft)):
            self.kept, self._draft = self.emptied(), None
            self.st = self.fresh.prime(trunk, draft, ids, capacity)
            self.report = TurnReport(len(ids), 0, len(ids) - 1, "fresh", 0, 0)
            return self.st
        key, dkey = self.keyed(ids), ByIdentity(draft) if draft is not None else None
        base = self.kept.lookup(key, dkey)
        self._draft, self._end_draft = draft, None
        if base is None:
            st = self.st = trunk.new_state(capacity)
            self.kept, p, how = self.emptied(), 0, "fresh"
            if draft is not None:
                call(draft, "begin", draft.begin, None, ids[:1])
        else:
            st, p, how = self.st, base.pos, "last turn" if base.trunk is None else "snapshot"
            if base.trunk is not None:
                trunk.restore(st, base.trunk)
                self.kept.drop_past(p)  # later ones hold K/V this turn overwrites
            if draft is not None:
                draft.restore(base.drafts[dkey])
        self.kept.drop_live()  # the state moves on from here
        trunk.reserve(st, capacity)
        mark = min(self.mark, len(ids) - 1)
        if p <= mark and tuple(key[:mark + 1]) not in self.kept.entries:
            self._run(trunk, st, draft, ids, p, mark)
            p = mark
            if self.limit:
                self.kept.keep(key[:mark + 1], trunk.snapshot(st), None, dkey,
                               draft.snapshot() if draft is not None else None)
        self._run(trunk, st, draft, ids, p, len(ids) - 1)
        held = base.pos if base is not None else 0
        self.report = TurnReport(len(ids), held, len(ids) - 1 - held, how, len(self.kept), self.kept.nbytes)
        return st

    def emptied(self) -> StateCache:
        """No kept state: the live one and `limit` snapshots, bounded in entries, not bytes."""
        return StateCache(math.inf, max_entries=self.limit)

    def keyed(self, ids: list[int]) -> list:
        """What a kept state is matched by: the ids (a session with images tags their rows with
        each image's identity, turbo/chat/image_session.py)."""
        return list(ids)

    def rows_mm(self, p: int, end: int) -> Any:
        """The MmRows of rows p..end (turbo/vision/positions.py), or None: text rows."""
        return None

    def _run(self, trunk: Trunk, st: TrunkState, draft: Drafter | None, ids: list[int], p: int, end: int) -> None:
        """The state holds ids[:p] (the drafter ids[:p + 1]): run ids[p:end] through both."""
        if end <= p:
            return
        aux, mm = draft.aux_layers if draft is not None else (), self.rows_mm(p, end)
        out = trunk.prefill(st, ids[p:end], aux, mm=mm) if st.pos == 0 else trunk.extend(st, ids[p:end], aux, mm)
        if draft is not None:
            call(draft, "resume", draft.resume, out, ids[:end + 1], p)

    def finish(self, driver: Driver) -> None:
        draft = driver.context()
        self._end_draft = draft.snapshot() if draft is not None else None

    def settle(self, ids: list[int], generated: list[int]) -> None:
        """The turn ended: the state goes on from here if it holds exactly ids + generated (a
        last round cut short by max_new_tokens or a stop ran the trunk past the answer)."""
        st = self.st
        if st is not None and st.pos == len(ids) - 1 + len(generated):
            dkey = ByIdentity(self._draft) if self._draft is not None else None
            self.kept.keep(self.keyed(ids) + list(generated), None, None, dkey, self._end_draft)
        self.report.snapshot_bytes += tensor_bytes(self._end_draft)


PART_FIELDS = {"text": "text", "image": "image", "image_url": "image_url"}  # a part's type -> the field it needs


def check_content(content: Any) -> str | list:
    """A user message's content: a str, or a non-empty list of content parts ({"type": "text",
    "text": str}, {"type": "image", "image": ...}, {"type": "image_url", "image_url": {"url": str}});
    anything else (bytes, a set, None) would render as "<bytes>" or nothing."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise TurboError(f"message content of type {type(content).__name__}: expected a str or a non-empty list of "
                         "content parts (text, image, image_url)")
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        value = part.get(PART_FIELDS[kind]) if kind in PART_FIELDS else None
        if kind == "image_url":
            value = value.get("url") if isinstance(value, dict) else value
        if value is None or kind in ("text", "image_url") and not isinstance(value, str):
            raise TurboError(f"message content part {j} is {show(part)}: expected {{\"type\": \"text\", \"text\": "
                             "str}, {\"type\": \"image\", \"image\": PATH}, or {\"type\": \"image_url\", "
                             "\"image_url\": {\"url\": str}}")
    return list(content)


class Session:
    """A conversation with the runtime (Runtime.session): `send`, `retry` and `edit` stream a
    turn's round events and append the assistant's message to `history` when it completes. With
    `tools`, an answer's calls are read into that message's "tool_calls" (`pending_calls` gives them
    as objects) and `send_tool_results` answers them and streams the next turn."""

    keeper_kind = Keeper

    def __init__(self, rt: ChatRuntime, template: ChatTemplate, system: str | None = None, tools: list | None = None,
                 template_kwargs: dict[str, Any] | None = None, snapshots: int = DEFAULT_SNAPSHOTS,
                 tool_choice: str = "auto"):
        check_tool_choice(tools, tool_choice, template)
        self.rt, self.template, self.tools = rt, template, tools
        self.tool_choice = tool_choice  # every turn's, unless the turn gives its own
        self._choice = tool_choice  # the turn's
        self.template_kwargs = dict(template_kwargs or {})
        check_template_kwargs(self.template_kwargs, template)  # (a typo must not vanish into the template)
        self.keeper = self.keeper_kind(snapshots)
        # what ends a turn, besides the caller's stop_token_ids (turbo.chat.turn.turn_stop_ids)
        self.stop_ids = turn_stop_ids(rt.install, rt.tokenizer)
        self.history: list[dict[str, Any]] = []
        self.last_turn: TurnReport | None = None
        self.turn: Turn | None = None  # the last turn started
        self.system = system

    @property
    def system(self) -> str | None:
        return self.history[0]["content"] if self.history and self.history[0]["role"] == "system" else None

    @system.setter
    def system(self, text: str | None) -> None:
        if text is not None and not isinstance(text, str):  # (bytes would render as "<bytes>")
            raise TurboError(f"system prompt of type {type(text).__name__}: expected a str or None", field="system")
        if self.system is not None:
            self.history.pop(0)
        if text is not None:
            self.history.insert(0, {"role": "system", "content": text})

    def reset(self) -> None:
        """A new conversation with the same system prompt; the kept states are dropped."""
        system = self.system
        self.history, self.last_turn = [], None
        self.keeper = self.keeper_kind(self.keeper.limit)
        self.system = system

    def send(self, text: str | list, opts: GenerationOptions | None = None, *, tool_choice: str | None = None,
             **fields) -> Iterator[RoundEvent]:
        """A user message (a str, or content parts: text and images) and the assistant's answer."""
        return self._attempt(self.history + [{"role": "user", "content": check_content(text)}], opts, fields,
                             tool_choice)

    @property
    def pending_calls(self) -> list[ToolCall]:
        """The last answer's tool calls, while they wait for their results (send_tool_results)."""
        last = self.history[-1] if self.history else None
        if last is None or last["role"] != "assistant" or not last.get("tool_calls"):
            return []
        return [ToolCall(c["function"]["name"], c["function"]["arguments"], c["id"]) for c in last["tool_calls"]]

    def send_tool_results(self, results: dict[str, Any] | list, opts: GenerationOptions | None = None, *,
                          tool_choice: str | None = None, **fields) -> Iterator[RoundEvent]:
        """The results of the last answer's tool calls (a dict: call id -> result, or a list in
        the calls' order; each a str or a JSON value) as `tool` messages, and the answer to them."""
        calls = self.pending_calls
        if not calls:
            raise TurboError("no tool calls to answer: the last turn made none")
        return self._attempt(self.history + tool_messages(calls, results), opts, fields, tool_choice)

    def retry(self, opts: GenerationOptions | None = None, *, tool_choice: str | None = None,
              **fields) -> Iterator[RoundEvent]:
        """The last assistant turn again (a sampled one draws anew, with a fresh or given seed)."""
        history = self.history[:-1] if self.history and self.history[-1]["role"] == "assistant" else self.history
        if not history or history[-1]["role"] not in ("user", "tool"):
            raise TurboError("nothing to retry: the conversation does not end with a user message or tool results")
        return self._attempt(list(history), opts, fields, tool_choice)

    def edit(self, index: int, text: str | list, opts: GenerationOptions | None = None, *,
             tool_choice: str | None = None, **fields) -> Iterator[RoundEvent]:
        """history[index] (a user message) becomes `text`; the turns after it are dropped."""
        if isinstance(index, bool) or not isinstance(index, numbers.Integral):  # (True is not history[1])
            raise TurboError(f"edit index {index!r}: expected an integer index into history")
        index = int(index)
        if not -len(self.history) <= index < len(self.history) or self.history[index]["role"] != "user":
            raise TurboError(f"history[{index}] is not a user message of this session")
        cut = self.history[:index % len(self.history)]
        return self._attempt(cut + [{"role": "user", "content": check_content(text)}], opts, fields,
                             tool_choice)

    def _attempt(self, history: list[dict[str, Any]], opts: GenerationOptions | None,
                 fields: dict[str, Any], tool_choice: str | None = None) -> Iterator[RoundEvent]:
        """The turn over `history`, which becomes the session's only once everything a turn can
        refuse before its first round has passed (the options, the render, the length, the
        images): a refused turn leaves the history and the keeper exactly as they were."""
        unknown = next((k for k in fields if k not in GENERATION_FIELDS), None)
        if unknown is not None:
            raise TurboError(f"{unknown} is not a generation option (expected GenerationOptions fields: "
                             f"{', '.join(GENERATION_FIELDS)}); template keywords are given to Runtime.session")
        # a shallow copy of the keeper: what a refused _turn sets (the mark, an image turn's rows) it
        # sets as new attributes, the kept states themselves are untouched until the first round
        before, kept, choice = self.history, copy.copy(self.keeper), self._choice
        self.history, self._choice = history, self.tool_choice if tool_choice is None else tool_choice
        try:
            return self._turn(opts, fields)  # (its Turn checks the tool_choice)
        except BaseException:
            self.history, self.keeper, self._choice = before, kept, choice
            raise

    def new_turn(self) -> Turn:
        """A turn over the history with the session's template and tools and the turn's tool_choice."""
        return Turn(self.template, self.stop_ids, self.tools, self._choice)

    def render(self, add_generation_prompt: bool = True) -> str:
        return self.new_turn().render(self.history, self.template_kwargs, add_generation_prompt=add_generation_prompt)

    def _turn(self, opts: GenerationOptions | None, fields: dict[str, Any]) -> Iterator[RoundEvent]:
        turn = self.new_turn()
        turn.prepare(self.history, self.template_kwargs)
        return self._run(turn, turn.ids(self.rt.tokenizer), opts, fields)

    def _run(self, turn: Turn, ids: list[int], opts: GenerationOptions | None,
             fields: dict[str, Any]) -> Iterator[RoundEvent]:
        """The prepared turn's generation over `ids`, from the keeper's longest kept state."""
        self.keeper.mark = common_prefix(ids, encode(self.rt.tokenizer, self.mark_render(turn)))
        options = turn.options_of(opts, fields)
        events = self.rt.stream(ids, options, start=self.keeper)  # refuses here, before a turn starts
        return self._follow(turn, ids, events)

    def mark_render(self, turn: Turn) -> str:
        """The history without the generation prompt: where the assistant turn starts (the keeper's mark)."""
        return turn.render(self.history, self.template_kwargs, add_generation_prompt=False)

    def _follow(self, turn: Turn, ids: list[int], events: Iterator[RoundEvent]) -> Iterator[RoundEvent]:
        self.turn = turn  # (the running turn: a front reads its answer as it streams)
        return self._read(turn, ids, events)

    def _read(self, turn: Turn, ids: list[int], events: Iterator[RoundEvent]) -> Iterator[RoundEvent]:
        generated: list[int] = []
        for event in events:
            generated += event.tokens
            if event.done:
                self.keeper.settle(ids, generated)
                self.history.append(turn.answer_of(self.rt.tokenizer, generated)[0])
                self.last_turn = self.keeper.report
                self.last_turn.tokens, self.last_turn.stats = generated, event.stats
            yield event
