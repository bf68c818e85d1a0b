"""The TUI's chat: a conversation built on `Runtime.session` (turbo/chat/session.py).

`ChatView` shows the turns: the user's messages, the assistant's answers with their reasoning
dimmed in a collapsible (open while it streams, collapsed once the turn ends) and each answer's
counters under it. `ChatMode` is the chat half of TurboApp (tui/app.py): the session, its keys
(new chat, retry, edit an earlier message, reasoning, chat/raw) and the counters per turn and
per session, among them the tokens each turn prefilled and reused (Session.last_turn).
`PromptInput` is the box both the chat and the raw completion type into (multi-line).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widget import Widget
from textual.widgets import Collapsible, Input, Static

from turbo.chat.reasoning import END_THINK
from turbo.chat.session import Session, TurnReport
from turbo.chat.template import ChatTemplate
from turbo.chat.turn import Turn
from turbo.sequence.options import GenerationOptions

from .images import ImageAttach, text_of, user_turn
from .view import Transcript, error_text, to_input, visible

REASONING_STYLE = "dim italic"
NOTE_STYLE = "dim"
CHAT_PLACEHOLDER = "type a message, ⏎ sends (ctrl+p: edit an earlier one · ctrl+g: raw completion)"
STOPPED_NOTE = "stopped: not in the conversation (ctrl+y runs it again; a new message replaces it)"
TURN_ROWS = (("turn-prompt", "prompt tokens"), ("turn-prefilled", "prefilled"), ("turn-reused", "reused"),
             ("turn-resumed", "resumed from"))
SESSION_ROWS = (("session-turns", "turns"), ("session-generated", "generated"), ("session-prefilled", "prefilled"),
                ("session-reused", "reused"), ("session-accepted", "accepted/drafted"),
                ("session-snapshots", "snapshots"))


class PromptInput(Input):
    """The prompt box (the chat's message box too): one line where a newline shows as ⏎ (tui/view.py).
    shift+enter (where the terminal reports it) and ctrl+j (always: it is the newline byte) insert
    one; a paste keeps its newlines; enter submits."""

    BINDINGS = [Binding("enter", "submit", "Submit", key_display="⏎"),
                Binding("shift+enter,ctrl+j", "newline", "Newline", show=False)]

    def action_newline(self) -> None:
        self.replace(to_input("\n"), *sorted(self.selection))

    def _on_paste(self, event: events.Paste) -> None:  # Input's keeps the first line only
        if event.text:
            self.replace(to_input(event.text.replace("\r\n", "\n")), *sorted(self.selection))
        event.stop()
        event.prevent_default()  # the handlers up the class chain (Input's) run otherwise


@dataclass
class Totals:
    """The session's counters: the sums over every turn it ran (retried and edited ones too)."""

    turns: int = 0
    generated: int = 0
    prefilled: int = 0
    reused: int = 0
    accepted: int = 0
    drafted: int = 0

    def add(self, r: TurnReport) -> None:
        st = r.stats
        self.turns += 1
        self.generated += len(r.tokens)
        self.prefilled += r.prefilled_tokens
        self.reused += r.reused_tokens
        self.accepted += st.accepted if st is not None else 0
        self.drafted += st.drafted if st is not None else 0


def chat_counter_values(report: TurnReport | None, totals: Totals) -> dict[str, str]:
    """The chat rows of the stats panel (row id -> text): the last turn's report, the session's sums."""
    v = {key: "–" for key, _ in TURN_ROWS}
    if report is not None:
        v = {"turn-prompt": str(report.prompt_tokens), "turn-prefilled": str(report.prefilled_tokens),
             "turn-reused": str(report.reused_tokens), "turn-resumed": report.resumed_from}
    snapshots = "–" if report is None else f"{report.snapshots} · {report.snapshot_bytes / 2**20:.1f} MiB"
    return v | {"session-turns": str(totals.turns), "session-generated": str(totals.generated),
                "session-prefilled": str(totals.prefilled), "session-reused": str(totals.reused),
                "session-accepted": f"{totals.accepted}/{totals.drafted}", "session-snapshots": snapshots}


def turn_note(r: TurnReport) -> str:
    """The line under an answer: what the turn generated and what it prefilled."""
    st = r.stats
    spec = f" · accepted {st.accepted}/{st.drafted}" if st is not None and st.drafter else ""
    rounds = f" · {st.rounds} rounds" if st is not None else ""
    return (f"{len(r.tokens)} tokens{rounds}{spec} · prompt {r.prompt_tokens}: prefilled {r.prefilled_tokens}, "
            f"reused {r.reused_tokens} ({r.resumed_from})")


def answer_end(t: Transcript, stop_ids: tuple[int, ...]) -> int:
    """Where the answer's text ends in t.text: before the end-of-turn tokens that close it."""
    n = len(t.tokens)
    while n and t.tokens[n - 1] in stop_ids:
        n -= 1
    return t.starts[n] if n < len(t.tokens) else len(t.text)


def live_message(t: Transcript, turn: Turn) -> dict[str, Any]:
    """The answer so far as the session will read it (turbo.chat.turn.Turn.answer)."""
    return turn.answer(t.text[:answer_end(t, turn.stop_ids)])[0]


def answer_texts(message: dict[str, Any], t: Transcript | None, stop_ids: tuple[int, ...]) -> tuple[Text | None, Text]:
    """(reasoning, content) as shown: cut from the transcript's text coloured by origin where it
    spells the message, else the message's own text."""
    content, reasoning = message.get("content") or "", message.get("reasoning_content")
    plain = (None if reasoning is None else Text(visible(reasoning), style=REASONING_STYLE)), Text(visible(content))
    if t is None:
        return plain
    text = t.text[:answer_end(t, stop_ids)]
    c0 = len(text) - len(content)
    if not text.endswith(content):
        return plain
    full = t.rich()
    if reasoning is None:
        return None, full[c0:len(text)]
    r1 = c0 - len(END_THINK) if text[:c0].endswith(END_THINK) else c0
    r0 = r1 - len(reasoning)
    if r0 < 0 or text[r0:r1] != reasoning:
        return plain
    shown = full[r0:r1]
    shown.stylize(REASONING_STYLE)
    return shown, full[c0:len(text)]


class Answer(Vertical):
    """An assistant turn: its reasoning (a collapsible), its content, and a note with its counters."""

    def __init__(self, collapsed: bool):
        super().__init__(classes="answer")
        self.reasoning = Static(Text(), classes="reasoning-text")
        self.fold = Collapsible(self.reasoning, title="reasoning", collapsed=collapsed, classes="reasoning")
        self.content = Static(Text(), classes="content")
        self.note = Static("", classes="note")

    def compose(self) -> ComposeResult:
        yield self.fold
        yield self.content
        yield self.note

    def show(self, message: dict[str, Any], t: Transcript | None, stop_ids: tuple[int, ...], note: str = "") -> None:
        reasoning, content = answer_texts(message, t, stop_ids)
        self.fold.display = reasoning is not None
        self.reasoning.update(reasoning if reasoning is not None else Text())
        self.fold.title = f"reasoning ({len(reasoning.plain)} chars)" if reasoning is not None else "reasoning"
        self.content.display = bool(content.plain)
        self.content.update(content)
        self.note.display = bool(note)
        self.note.update(Text(note, style=NOTE_STYLE))


class ChatView(VerticalScroll):
    """The transcript of turns, rebuilt from the session's history at each turn's start and end."""

    def show(self, conversation: list[dict[str, Any]], notes: dict[int, str], t: Transcript | None,
             stop_ids: tuple[int, ...], editing: int | None = None, live: bool = False, turn: Turn | None = None,
             tail_note: str = "") -> Answer | None:
        """The conversation's turns (the system prompt is the field above); the last answer coloured from
        `t`. A conversation that ends with a user message gets an answer from `t` under it (the
        one streaming when `live`, else a stopped one; `turn` the running one). Returns that answer."""
        self.remove_children()
        widgets: list[Widget] = []
        tail: Answer | None = None
        for i, m in enumerate(conversation):
            if m["role"] == "user":
                widgets.append(user_turn(m.get("content"), i == editing))
            elif m["role"] == "assistant":
                a = Answer(collapsed=True)
                a.show(m, t if i == len(conversation) - 1 else None, stop_ids, notes.get(i, ""))
                widgets.append(a)
        if conversation and conversation[-1]["role"] == "user" and (live or t is not None):
            tail = Answer(collapsed=not live)
            message = live_message(t, turn) if t is not None and turn is not None else {"content": ""}
            tail.show(message, t, stop_ids, tail_note)
            widgets.append(tail)
        self.mount_all(widgets)
        self.scroll_end(animate=False)
        return tail


def chat_pane(system: str) -> ComposeResult:
    with Vertical(id="chat-pane"):
        yield Static("system prompt", classes="section")
        yield Input(system, placeholder="none (⏎ sets it)", id="system")
        yield ChatView(id="turns")


def chat_rows() -> ComposeResult:
    with Vertical(id="chat-stats"):
        for title, rows in (("this turn", TURN_ROWS), ("session", SESSION_ROWS)):
            yield Static(title, classes="section")
            for key, label in rows:
                with Horizontal(classes="row"):
                    yield Static(label, classes="row-label")
                    yield Static("–", id=key, classes="row-value")


def user_message(content: str | list) -> dict[str, Any]:
    return {"role": "user", "content": content}


class ChatMode(ImageAttach):
    """The chat half of TurboApp, mixed into it: the app's generation machinery (`_can_generate`,
    `_start`, `_put`, `_set_status`, the Transcript of the running turn) drives a session turn
    as it drives a raw completion. Indices into the conversation (`notes`, `editing`) leave the
    system message out: it is the field above the turns."""

    CHAT_ACTIONS = frozenset({"new_chat", "retry", "edit", "reasoning"})

    def chat_init(self) -> None:
        self.session: Session | None = None
        self.chat_on = False
        self.template_where = ""
        self.totals = Totals()
        self.notes: dict[int, str] = {}  # conversation index of an answer -> its counters
        self.editing: int | None = None  # conversation index of the user message being edited
        self.turn_report: TurnReport | None = None
        self._turn: Turn | None = None  # the running turn (its answer read as the session reads it)
        self._live: Answer | None = None
        self.attached = []  # /image's parts for the next message (tui/images.py)

    # ---- the session -----------------------------------------------------------------------------

    def template_available(self) -> bool:
        rt = self.runtime
        return rt is not None and (self.settings.chat_template is not None or
                                   bool(getattr(rt.install, "chat_template", None)))

    def open_chat(self) -> None:
        """A runtime opened (or a template was given): a chat when there is a template, else raw."""
        was, self.session, self.chat_on = self.chat_on, None, False
        if not self.template_available():
            if was:
                self._apply_mode()
            return
        path = self.settings.chat_template
        kw = {} if self.settings.think is None else {"enable_thinking": self.settings.think}
        try:
            rt = self.runtime
            # the file's path names it in a refusal; the install's special tokens go to it as to its own
            template = None if path is None else ChatTemplate(Path(path).expanduser().read_text(), path,
                                                              rt.install.template_files.special_tokens)
            s = rt.session(self.query_one("#system", Input).value or None, template=template, **kw)
            # a template that is not valid Jinja (or raises for a plain turn) is refused now, not at the first turn
            s.new_turn().render([user_message("hi")], s.template_kwargs)
        except Exception as e:  # noqa: BLE001 - a missing file, a bad template: a message, raw completion stays
            self._apply_mode()
            self._set_status(f"no chat: {error_text(e)} (raw completion only)", error=True)
            return
        self.session, self.chat_on, self.template_where = s, True, Path(path).name if path else s.template.where
        self.totals, self.notes, self.editing, self.turn_report = Totals(), {}, None, None
        self._apply_mode()
        self._show_chat()
        self._set_status(f"chat ({self.template_where}): ⏎ sends · ctrl+g raw completion")

    def conversation(self) -> list[dict[str, Any]]:
        return [m for m in self.session.history if m["role"] != "system"] if self.session is not None else []

    def _offset(self) -> int:
        return 1 if self.session.system is not None else 0

    def _sync_system(self) -> None:
        value = self.query_one("#system", Input).value or None
        if value != self.session.system:
            self.session.system = value

    def system_submitted(self) -> None:
        if self.session is None:
            return
        self._sync_system()
        self.query_one("#prompt").focus()
        self._set_status("system prompt set (from the next turn)" if self.session.system else "no system prompt")

    # ---- layout and counters ---------------------------------------------------------------------

    def _apply_mode(self) -> None:
        chat = self.chat_on
        self.query_one("#output-pane").display = not chat
        self.query_one("#chat-pane").display = chat
        self.query_one("#chat-stats").display = chat
        self.query_one("#prompt", Input).placeholder = CHAT_PLACEHOLDER if chat else self.raw_placeholder
        self.query_one("#chat-pane").border_title = f"chat · {self.template_where}" if chat else ""
        self.refresh_bindings()

    def _show_chat(self, live: bool = False, shown: list[dict[str, Any]] | None = None, tail_note: str = "") -> None:
        self._live = self.query_one("#turns", ChatView).show(
            self.conversation() if shown is None else shown, self.notes, self.transcript, self.session.stop_ids,
            self.editing, live, self._turn, tail_note)

    def render_chat(self) -> None:
        """The running turn's answer and the chat counters (the app's repaint tick)."""
        t, s = self.transcript, self.session
        if self.busy and self._live is not None and t is not None and s is not None and self._turn is not None:
            self._live.show(live_message(t, self._turn), t, s.stop_ids)
            self.query_one("#turns", ChatView).scroll_end(animate=False)
        for key, value in chat_counter_values(self.turn_report, self.totals).items():
            self._put(f"#{key}", value)

    # ---- turns -------------------------------------------------------------------------------------

    def _chat_turn(self, begin: Callable[[Session, GenerationOptions], Iterator], shown: list[dict[str, Any]]) -> bool:
        """Start a turn: `begin(session, options)` (run in the worker) gives its round events;
        `shown` is the conversation as the turn will see it."""
        s = self.session
        self.notes = {i: n for i, n in self.notes.items() if i < len(shown)}
        self.editing, self.turn_report, self.prompt_shown, self._turn, self._live = None, None, "", None, None

        def start() -> Iterator:
            events = begin(s, self.settings.generation)
            self._turn = s.turn  # the turn it runs
            return events

        self._start(start)
        self._show_chat(live=True, shown=shown)
        return True

    def send_message(self, text: str) -> bool:
        if self.attach_command(text):
            return True
        if not self._can_generate():
            return False
        if not text.strip():
            self._set_status("the message is empty", error=True)
            return False
        self._sync_system()
        conv, offset, content = self.conversation(), self._offset(), self.take_content(text)
        if self.editing is not None:
            i = self.editing
            return self._chat_turn(lambda s, o: s.edit(i + offset, content, o), conv[:i] + [user_message(content)])
        if conv and conv[-1]["role"] == "user":  # a stopped or failed turn: the new message replaces it
            self.session.history.pop()
            conv.pop()
        return self._chat_turn(lambda s, o: s.send(content, o), conv + [user_message(content)])

    def chat_finished(self, outcome: str) -> None:
        """The app's end of a generation, for a chat turn: its counters, the transcript rebuilt."""
        s, conv = self.session, self.conversation()
        if outcome == "done" and conv and conv[-1]["role"] == "assistant" and s.last_turn is not None:
            self.turn_report = s.last_turn
            self.totals.add(s.last_turn)
            self.notes[len(conv) - 1] = turn_note(s.last_turn)
        note = STOPPED_NOTE if outcome == "stopped" else "failed: not in the conversation (ctrl+y runs it again)"
        self._show_chat(tail_note=note)

    # ---- keys ----------------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Chat keys show in chat only; ctrl+l is clear in raw, new chat in chat; ctrl+g where a template is."""
        if action in self.CHAT_ACTIONS:
            return self.chat_on
        if action == "clear":
            return not self.chat_on
        if action == "toggle_chat":
            return self.chat_on or self.template_available()
        return True

    def action_toggle_chat(self) -> None:
        if self.busy:
            self._set_status("busy: stop the generation first (esc)", error=True)
            return
        self.transcript, self.last_stats, self.accepted_history, self.prompt_shown = None, None, [], ""
        self.editing = None
        if self.session is None:
            self.open_chat()
        else:
            self.chat_on = not self.chat_on
            self._apply_mode()
            if self.chat_on:
                self._show_chat()
            self._set_status(f"chat ({self.template_where})" if self.chat_on
                             else "raw completion: ⏎ continues the text · ctrl+g back to the chat")
        self._render_round()

    def action_new_chat(self) -> None:
        if self.busy:
            self._set_status("a turn is running: esc stops it", error=True)
            return
        self._sync_system()
        self.session.reset()
        self.totals, self.notes, self.editing, self.turn_report, self.attached = Totals(), {}, None, None, []
        self.transcript, self.last_stats, self.accepted_history = None, None, []
        self.query_one("#prompt", Input).value = ""
        self._show_chat()
        self._render_round()
        self._set_status("new chat (the system prompt stays)")

    def action_retry(self) -> None:
        if not self._can_generate():
            return
        self._sync_system()
        conv = self.conversation()
        shown = conv[:-1] if conv and conv[-1]["role"] == "assistant" else conv
        if not shown or shown[-1]["role"] != "user":
            self._set_status("nothing to retry yet", error=True)
            return
        self._chat_turn(lambda s, o: s.retry(o), shown)

    def action_edit(self) -> None:
        """Picks the last user message, then each press an earlier one, into the box: ⏎ resends it."""
        if self.busy:
            self._set_status("a turn is running: esc stops it", error=True)
            return
        conv = self.conversation()
        users = [i for i, m in enumerate(conv) if m["role"] == "user"]
        if not users:
            self._set_status("no message to edit yet", error=True)
            return
        k = users[-1] if self.editing not in users else users[(users.index(self.editing) - 1) % len(users)]
        self.editing = k
        box = self.query_one("#prompt", Input)
        box.value = to_input(text_of(conv[k].get("content")))
        box.cursor_position = len(box.value)
        box.focus()
        self._show_chat()
        self._set_status(f"editing message {users.index(k) + 1} of {len(users)}: ⏎ resends it (the turns after it "
                         "are dropped) · esc cancels · ctrl+p an earlier one")

    def cancel_edit(self) -> None:
        self.editing = None
        self.query_one("#prompt", Input).value = ""
        self._show_chat()
        self._set_status("edit cancelled")

    def action_reasoning(self) -> None:
        folds = list(self.query(".reasoning").results(Collapsible))
        collapse = any(not f.collapsed for f in folds)
        for f in folds:
            f.collapsed = collapse
