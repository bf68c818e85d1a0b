"""Chat sessions that keep their state: each turn prefills only what the conversation adds.

Every turn renders the whole conversation (turbo/chat/turn.py) and generates over it, with the tokens
a fresh generation over that render gives. A session is a live `Keeper` (turbo/sequence/state_cache.py)
marked at each turn's generation prompt: the turn's driver goes on from the longest kept state whose
tokens begin the render -- the state the last turn left, or a snapshot taken at the start of an
assistant turn's generation prompt, where a re-render can diverge (a template that drops earlier
reasoning, an edited system prompt, a retried or edited turn) -- and prefills the rest
(Driver.start); the answer's state is kept at its end (Driver.end). K/V only needs its length cut
back; the GDN and conv states and the drafter's context come from the snapshot.
"""

from __future__ import annotations

import copy
import json
import numbers
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from ..errors import TurboError
from ..sequence.options import GENERATION_FIELDS, GenerationOptions
from ..sequence.state_cache import DEFAULT_SNAPSHOTS, Keeper, TurnReport
from ..sequence.state_files import Kept, StateFileError, put, read_states, stamp_of, write_states
from ..store.arch import show
from .runtime import ChatRuntime
from .template import ChatTemplate, encode
from .tool_calls import ToolCall, tool_messages
from .turn import Turn, check_template_kwargs, check_tool_choice, turn_stop_ids

if TYPE_CHECKING:
    from ..sequence.driver import RoundEvent

def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


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

    def __init__(self, rt: ChatRuntime, template: ChatTemplate, system: str | None = None, tools: list | None = None,
                 template_kwargs: dict[str, Any] | None = None, snapshots: int = DEFAULT_SNAPSHOTS,
                 tool_choice: str = "auto"):
        check_tool_choice(tools, tool_choice, template)
        self.rt, self.template, self.tools = rt, template, tools
        self.tool_choice = tool_choice  # every turn's, unless the turn gives its own
        self._choice = tool_choice  # the turn's
        self.template_kwargs = dict(template_kwargs or {})
        check_template_kwargs(self.template_kwargs, template)  # (a typo must not vanish into the template)
        self.keeper = Keeper.session(snapshots)  # its state, kept states and mark
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
        self.keeper = Keeper.session(self.keeper.limit)
        self.system = system

    def save(self, path: str | Path) -> list[str]:
        """The conversation (`history`) and its kept states written to one file, whole
        (turbo/sequence/state_files.py), as llama-server's slot save: `load` goes on from it in
        another session, another process, with the same tokens. Returns a line for each
        drafter context left out (a caller's own drafter's: that drafter begins afresh)."""
        try:
            messages = json.dumps(self.history)
        except (TypeError, ValueError) as e:
            raise TurboError(f"session history: {e}; expected messages of JSON values to save") from None
        trunk, st = self.rt.trunk, self.keeper.st
        entries = list(self.keeper.kept.entries.values())
        # the live entry is the state as the last turn left it (a snapshot of it now); every entry's
        # K/V rows are the live state's below its position (later rows only overwrite later ones)
        kept = [Kept(e.tokens, e.trunk if e.trunk is not None else trunk.snapshot(st), dict(e.drafts))
                for e in entries]
        live = next((i for i, e in enumerate(entries) if e.trunk is None), None)
        kv = st.kv if st is not None else {}
        return write_states(Path(path), stamp_of(self.rt.install, trunk, self.rt.options), kept, kv,
                            {"messages": messages, "live": json.dumps(live)})

    def load(self, path: str | Path) -> Session:
        """This session goes on from a file `save` wrote (its history and kept states replace
        this session's); a file that is damaged, or was written by another install or under
        other numerics, is refused in one line (StateFileError) and this session is left as it
        was. The template, tools and keywords are this session's."""
        trunk = self.rt.trunk
        f = read_states(Path(path), stamp_of(self.rt.install, trunk, self.rt.options), trunk.device)
        try:
            history, live = json.loads(f.extra["messages"]), json.loads(f.extra["live"])
        except (KeyError, ValueError):
            raise StateFileError(f"{path}: not a session's state file (no messages)") from None
        if not isinstance(history, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                     for m in history):
            raise StateFileError(f"{path}: its messages are not a list of messages with roles")
        keeper = Keeper.session(self.keeper.limit)
        rows = max((k.trunk.pos for k in f.kept), default=0)
        keeper.st = st = trunk.new_state(max(rows, 1))
        for i, (k, v) in f.kv.items():
            st.kv[i][0][:, :rows], st.kv[i][1][:, :rows] = k[:, :rows], v[:, :rows]
        for n, k in enumerate(f.kept):
            if n == live:
                trunk.restore(st, k.trunk)  # (the live state: as the last turn left it)
            put(keeper.kept, k, None, live=n == live)
        self.history, self.keeper, self.last_turn, self.turn = history, keeper, None, None
        return self

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
        self.keeper.marks = {common_prefix(ids, encode(self.rt.tokenizer, self.mark_render(turn))): "turn"}
        options = turn.options_of(opts, fields)
        events = self.rt.stream(ids, options, keeper=self.keeper)  # refuses here, before a turn starts
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
            if event.done:  # (the driver kept the answer's state: Driver.end)
                self.history.append(turn.answer_of(self.rt.tokenizer, generated)[0])
                self.last_turn = self.keeper.report
                self.last_turn.tokens, self.last_turn.stats = generated, event.stats
            yield event
