"""The Textual app: prompt in, tokens streaming out coloured by origin, counters moving per round.

The runtime loads once (in a worker thread); each generation runs in a worker thread that iterates
`Runtime.stream(...)` (or a chat session's turn: tui/chat.py) and hands every round to the UI with
`call_from_thread`. Stopping sets an event the worker checks between rounds; it then closes the
stream, which leaves the runtime ready.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Callable, Iterator

from rich.text import Text
from textual import on, work
from textual.actions import SkipAction
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import Footer, Input, Sparkline, Static
from textual.worker import get_current_worker

import turbo
from turbo.backends import native_build
from turbo.sequence.sampling import sampling_label

from .chat import ChatMode, PromptInput, chat_pane, chat_rows
from .settings import Settings, mode_label, next_mode, next_temperature
from .view import (ACCEPTED_STYLE, BONUS_STYLE, COUNTER_ROWS, Transcript, counter_values, from_input, header_info,
    header_text, position_bars, to_input, visible)
from .view import error_text as _message

HANDOFF_S = 1 / 15  # the worker hands rounds to the UI at most this often (and at the end)
RENDER_S = 1 / 10  # the widgets repaint at most this often while tokens stream


class TurboApp(ChatMode, App):
    """`TurboApp(settings)` opens settings.install itself; pass `runtime=` to reuse an open one.
    `timing=False` hides wall-clock figures (snapshot tests)."""

    TITLE = "turbo"
    ENABLE_COMMAND_PALETTE = False
    CSS = """
    Screen { layout: vertical; }
    #header { height: auto; max-height: 5; background: $panel; padding: 0 0; }
    #main { height: 1fr; }
    #output-pane { width: 1fr; border: round $primary 60%; padding: 0 1; }
    #output-pane:focus { border: round $primary; }
    #stats-panel { width: 36; border: round $secondary 60%; padding: 0 1; }
    .row { height: 1; }
    .row-label { width: 17; color: $text-muted; }
    .row-value { width: 1fr; text-align: right; text-style: bold; }
    .section { color: $text-muted; text-style: underline; }
    #bars { height: auto; }
    #spark { height: 2; margin: 0 0; }
    #status { height: auto; max-height: 4; padding: 0 1; background: $boost; }
    #status.error { color: $error; text-style: bold; }
    #prompt { margin: 0 0; }
    #chat-pane, #chat-stats { display: none; height: auto; }
    #chat-pane { width: 1fr; height: 1fr; border: round $primary 60%; }
    #turns { height: 1fr; padding: 0 1; }
    .user-turn { margin: 1 0 0 0; }
    .user-turn.editing { background: $warning 20%; }
    .answer { height: auto; }
    .answer .note { color: $text-muted; }
    """
    BINDINGS = [
        Binding("enter", "submit", "Submit", show=False),  # when the focus is off the prompt
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+c", "interrupt", show=False, priority=True),  # over the prompt's copy: ends a generation
        Binding("ctrl+n", "cycle_mode", "Policy/block"),
        Binding("ctrl+r", "cycle_rollback", "Rollback"),
        Binding("ctrl+t", "cycle_temperature", "Temperature"),
        Binding("ctrl+o", "preset", "Preset"),
        Binding("ctrl+l", "clear", "Clear"),
        Binding("ctrl+l", "new_chat", "New chat"),  # chat and raw: tui/chat.py's check_action picks
        Binding("ctrl+y", "retry", "Retry"),
        Binding("ctrl+p", "edit", "Edit"),
        Binding("ctrl+g", "toggle_chat", "Chat/raw"),
        Binding("ctrl+b", "reasoning", "Reasoning", show=False),  # a click on one opens it too
        Binding("ctrl+q", "quit", "Quit"),
    ]

    def __init__(self, settings: Settings, runtime=None, timing: bool = True):
        super().__init__()
        self.settings = settings
        self.runtime = runtime
        self.timing = timing
        self.load_error: str | None = None
        self.busy = False  # a generation (or a load) is running
        self.stopping = False
        self.last_stats = None  # Stats of the latest round shown
        self.last_error: str | None = None
        self.last_outcome: str | None = None  # "done" | "stopped" | "error"
        self.transcript: Transcript | None = None
        self.accepted_history: list[float] = []
        self.prompt_shown = ""
        self._stop = threading.Event()
        self._gen = 0  # generation id; stale callbacks are dropped
        self._preset = -1
        self._ran_with: tuple | None = None  # (policy, block, rollback) of the last generation
        self._started = 0.0
        self._dirty = False
        self._shown: dict[str, str] = {}
        self.raw_placeholder = "type a prompt, ⏎ to generate (⏎ inside the prompt is a newline; ctrl+o: workload presets)"
        self.chat_init()

    # ---- layout ------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Static(id="header")
        with Horizontal(id="main"):
            with VerticalScroll(id="output-pane"):
                yield Static(Text(), id="output")
            yield from chat_pane(self.settings.system or "")
            with VerticalScroll(id="stats-panel"):
                for key, label in COUNTER_ROWS:
                    with Horizontal(classes="row"):
                        yield Static(label, classes="row-label")
                        yield Static("–", id=f"stat-{key}", classes="row-value")
                yield from chat_rows()
                yield Static("accepted per round", id="spark-label", classes="section")
                yield Sparkline([], id="spark")
                yield Static("per-position acceptance", classes="section")
                yield Static(position_bars([]), id="bars")
        yield Static("", id="status")
        yield PromptInput(value=to_input(self.settings.prompt), placeholder=self.raw_placeholder, id="prompt")
        yield Footer()

    def on_mount(self) -> None:
        pane = self.query_one("#output-pane")
        pane.border_title = "output"
        legend = Text()
        legend.append("accepted proposal", style=ACCEPTED_STYLE)
        legend.append(" ")
        legend.append("trunk bonus token", style=BONUS_STYLE)
        pane.border_subtitle = legend
        self.query_one("#stats-panel").border_title = "stats"
        prompt = self.query_one("#prompt", PromptInput)
        if not self.timing:
            prompt.cursor_blink = False
        prompt.focus()
        self._refresh_header()
        self.set_interval(RENDER_S, self._tick)
        if self.runtime is None:
            self.load(self.settings.install)
        else:
            self._set_status(f"ready: {self.runtime.install.name} on {self.runtime.backend.name}")
            self.open_chat()

    # ---- status and header -------------------------------------------------------------------

    def _set_status(self, message: str, error: bool = False) -> None:
        status = self.query_one("#status", Static)
        status.set_class(error, "error")
        status.update(Text(visible(message)))
        if error:
            self.last_error = message

    def _refresh_header(self) -> None:
        rt = self.runtime
        where = (rt.install.name, rt.backend.name) if rt is not None else None
        self._put("#header", header_text(header_info(self.settings, self.last_stats, where, self._ran_with)))

    # ---- loading -----------------------------------------------------------------------------

    def load(self, install: str) -> None:
        if self.busy:
            self._set_status("busy: stop the generation first (esc)", error=True)
            return
        self.busy = True
        self._set_status(f"loading {install} …")
        self._load(install)

    @work(thread=True, exit_on_error=False, group="load")
    def _load(self, install: str) -> None:
        def building(message: str) -> None:  # the native library's first build (a minute or so)
            self._from_thread(self._set_status, f"loading {install}: {message}")

        try:
            with native_build.announcing(building):
                rt = turbo.open(install, self.settings.opening)
        except Exception as e:  # noqa: BLE001 - TurboError or anything else: shown, never raised
            self._from_thread(self._loaded, None, install, _message(e))
            return
        self._from_thread(self._loaded, rt, install, None)

    def _loaded(self, rt, install: str, error: str | None) -> None:
        self.busy = False
        if error is not None:
            self.load_error = error
            self._set_status(f"cannot open install {install}: {error}  (type /open PATH to try another)", error=True)
        else:
            if self.runtime is None:
                # A full collection walks every tracked object (~180k once torch is imported, ~100 ms)
                # and would land in the middle of some decode step. What exists once the first runtime
                # is open (modules, the model) lives as long as the session: moved out of reach.
                gc.freeze()
            self.runtime, self.load_error = rt, None
            self.settings = self.settings.with_(install=install)
            note = rt.backend.note if rt.options.verbose else ""  # (verbose=true: how auto chose)
            self._set_status(f"ready: {rt.install.name} on {rt.backend.name}" + (f" ({note})" if note else ""))
            self.open_chat()
        self._refresh_header()

    # ---- generation --------------------------------------------------------------------------

    @on(Input.Submitted, "#prompt")
    def _submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.action_submit()

    @on(Input.Submitted, "#system")
    def _system_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.system_submitted()

    def action_submit(self) -> None:
        value = self.query_one("#prompt", PromptInput).value
        if value.startswith("/open "):
            self.load(value[len("/open "):].strip())
            return
        if value.startswith("/template "):  # a chat template file: the chat opens on it
            self.settings = self.settings.with_(chat_template=value[len("/template "):].strip())
            self.open_chat()
            return
        self.submit(from_input(value))

    def submit(self, prompt: str) -> bool:
        """Start a generation of `prompt` with the current settings (in chat: send it as the next
        message); False (and a message) if it cannot."""
        if self.chat_on:
            return self.send_message(prompt)
        if not self._can_generate():
            return False
        if not prompt:
            self._set_status("the prompt is empty", error=True)
            return False
        self.prompt_shown = prompt
        opts = self.settings.generation
        self._start(lambda: self.runtime.stream(prompt, opts))
        return True

    def _can_generate(self) -> bool:
        if self.busy:
            self._set_status("a generation is running: esc stops it", error=True)
            return False
        if self.runtime is None:
            self._set_status(f"no install loaded ({self.load_error or 'loading'}); /open PATH opens one", error=True)
            return False
        return True

    def _start(self, begin: Callable[[], Iterator]) -> None:
        """Run `begin()`'s round events in the worker (`begin` runs there too: it may refuse)."""
        self._gen += 1
        self._stop.clear()
        self.busy, self.stopping, self.last_error, self.last_outcome = True, False, None, None
        self.transcript = Transcript(self.runtime.decode)
        self.accepted_history = []
        self.last_stats = None
        self._ran_with = (self.settings.policy, self.settings.block, self.settings.rollback)
        self._render_round()
        self._started = time.perf_counter()
        self._set_status(f"generating ({mode_label(self.settings.policy, self.settings.block)}) … esc stops")
        self._generate(self._gen, begin)

    @work(thread=True, exit_on_error=False, group="generate")
    def _generate(self, gen: int, begin: Callable[[], Iterator]) -> None:
        worker = get_current_worker()
        try:
            events = begin()
        except Exception as e:  # noqa: BLE001 - a refused block, a bad prompt: a message in the app
            self._from_thread(self._finished, gen, "error", _message(e))
            return
        outcome, error, batch, handed = "done", None, [], 0.0
        try:
            for event in events:
                # Rounds are handed to the UI in batches at most every HANDOFF_S (and at the end), so a
                # busy UI thread does not slow the decode it is measuring.
                batch.append(event)
                now = time.monotonic()
                if event.done or self._stop.is_set() or now - handed >= HANDOFF_S:
                    if not self._from_thread(self._rounds, gen, batch):
                        outcome = "stopped"
                        break
                    batch, handed = [], now
                if event.done:
                    break
                if self._stop.is_set() or worker.is_cancelled:
                    outcome = "stopped"
                    break
        except Exception as e:  # noqa: BLE001
            outcome, error = "error", _message(e)
        finally:
            events.close()  # stopping = closing the stream; the runtime is ready for the next call
        if batch:
            self._from_thread(self._rounds, gen, batch)
        self._from_thread(self._finished, gen, outcome, error)

    def _from_thread(self, fn, *args) -> bool:
        """call_from_thread that tolerates an app already shutting down (returns False then)."""
        try:
            self.call_from_thread(fn, *args)
            return True
        except RuntimeError:
            return False

    def _rounds(self, gen: int, events: list) -> None:
        """UI thread: take a batch of rounds into the model; the widgets repaint on the next tick."""
        if gen != self._gen or self.transcript is None:
            return
        for event in events:
            self.transcript.add(event.tokens, event.from_draft)
            if event.stats.drafter:
                self.accepted_history.append(float(sum(event.from_draft)))
        self.last_stats = events[-1].stats
        self._dirty = True
        if not self.stopping:
            st = self.last_stats
            self._set_status(f"generating … {st.generated_tokens}/{self.settings.generation.max_new_tokens} tokens,"
                             f" round {st.rounds}  (esc stops)")

    def _tick(self) -> None:
        if self._dirty:
            self._render_round()

    def _put(self, selector: str, value) -> None:
        """Update a Static only when its content changed (each update re-lays out the screen)."""
        if self._shown.get(selector) != value:
            self._shown[selector] = value
            self.query_one(selector, Static).update(value)

    def _render_round(self) -> None:
        self._dirty = False
        t = self.transcript
        if self.chat_on:
            self.render_chat()
        else:
            self._put("#output", t.rich(self.prompt_shown) if t is not None else Text())
            self.query_one("#output-pane", VerticalScroll).scroll_end(animate=False)
        for key, value in counter_values(self.last_stats, self.timing).items():
            self._put(f"#stat-{key}", value)
        st = self.last_stats
        self._put("#bars", position_bars(st.per_position_acceptance if st else []))
        h = self.accepted_history
        spark = self.query_one("#spark", Sparkline)
        if list(spark.data or []) != h:
            spark.data = list(h)
        self._put("#spark-label", f"accepted/round (last {h[-1]:.0f}, max {max(h):.0f})" if h
                  else "accepted per round")
        self._refresh_header()

    def _finished(self, gen: int, outcome: str, error: str | None) -> None:
        if gen != self._gen:
            return
        self.busy, self.stopping, self.last_outcome = False, False, outcome
        if self.chat_on:
            self.chat_finished(outcome)
        self._render_round()
        st = self.last_stats
        n = st.generated_tokens if st else 0
        took = f" in {time.perf_counter() - self._started:.2f} s" if self.timing else ""
        if outcome == "error":
            self._set_status(f"error: {error}", error=True)
        elif outcome == "stopped":
            self._set_status(f"stopped after {n} tokens{took}; ready for the next prompt")
        else:
            self._set_status(f"done: {n} tokens, {st.rounds if st else 0} rounds{took}")
        self._refresh_header()

    # ---- keys --------------------------------------------------------------------------------

    def action_stop(self) -> None:
        if not self.busy and self.editing is not None:
            self.cancel_edit()
            return
        if not self.busy or self.transcript is None or self.stopping:
            return
        self.stopping = True
        self._stop.set()
        self._set_status("stopping …")

    def action_interrupt(self) -> None:
        """Ctrl-C: stops a running generation like esc (its tokens and counters stay); otherwise
        the key goes on (the prompt's copy, Textual's hint that ctrl+q quits)."""
        if not self.busy or self.transcript is None:
            raise SkipAction()
        self.action_stop()

    def action_cycle_mode(self) -> None:
        policy, block = next_mode(self.settings.policy, self.settings.block)
        self.settings = self.settings.with_(policy=policy, block=block)
        self._refresh_header()
        when = "the next generation" if self.busy else "the next prompt"
        self._set_status(f"policy/block: {mode_label(policy, block)} (for {when})")

    def action_cycle_rollback(self) -> None:
        rollback = "replay" if self.settings.rollback == "checkpoint" else "checkpoint"
        self.settings = self.settings.with_(rollback=rollback)
        self._refresh_header()
        self._set_status(f"rollback: {rollback} (for the next prompt)")

    def action_cycle_temperature(self) -> None:
        t = next_temperature(self.settings.generation.temperature)
        self.settings = self.settings.with_(temperature=t)
        self._refresh_header()
        self._set_status(f"sampling: {sampling_label(self.settings.generation)} (for the next prompt)")

    def action_preset(self) -> None:
        presets = self.settings.presets
        if not presets:
            self._set_status("no workload presets in the config", error=True)
            return
        self._preset = (self._preset + 1) % len(presets)
        workload, prompt = presets[self._preset]
        box = self.query_one("#prompt", PromptInput)
        box.value = to_input(prompt)
        box.cursor_position = len(box.value)
        box.focus()
        same = [i for i, (w, _) in enumerate(presets) if w == workload]
        self._set_status(f"preset: {workload} {same.index(self._preset) + 1}/{len(same)} (⏎ generates)")

    def action_clear(self) -> None:
        if self.busy and self.transcript is not None:
            self.action_stop()
        self.transcript, self.last_stats, self.accepted_history, self.prompt_shown = None, None, [], ""
        box = self.query_one("#prompt", PromptInput)
        box.value = ""
        box.focus()
        self._render_round()
        if not self.busy:
            self._set_status("cleared")

    # ---- what the tests read -----------------------------------------------------------------

    @property
    def output_text(self) -> str:
        return self.transcript.text if self.transcript is not None else ""

    def shown_counters(self) -> dict[str, str]:
        """The counters as the stats panel shows them, read back from its widgets."""
        return {key: str(self.query_one(f"#stat-{key}", Static).content) for key, _ in COUNTER_ROWS}

