"""python -m turbo task=chat: a conversation read from standard input, one turn per line, over
`Runtime.session` (turbo/chat/session.py), which keeps the state between turns.

Each line is a user turn, or a command: /reset, /system [TEXT], /think on|off, /retry, /image
PATH (attaches an image to the next turn: an install with a vision tower; a refused image is one
line on stderr and the conversation goes on). With tools=FILE.json (OpenAI's tools list) the
template offers them and an answer's calls are shown as `[tool call ID] NAME ARGUMENTS` lines;
the next lines typed are their results, one a call in order, and the answer to them follows
(tool_choice=auto | required | none | a tool's name, every turn's). The
answer streams to stdout -- reasoning marked (dim on a terminal, `[thinking] ` before it
otherwise) -- then one `[stats]` line on stderr (as task=generate's, plus what the turn prefilled
and the state it went on from). EOF ends it (0). Ctrl-C in a turn stops that turn and keeps its partial
answer as the assistant's message (/retry redoes it); Ctrl-C at the prompt ends it (130, the
CLI's). A template that is missing, not Jinja or raises, and any refused turn, end it: one line, 2.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, TextIO

from .bounded import read_small_text, strict_loads
from .chat.session import Session, TurnReport
from .chat.template import ChatTemplate, compile_template
from .chat.tool_calls import ToolCall
from .config import ChatConfig, RunConfig
from .errors import TurboError
from .sequence.options import GenerationOptions
from .sequence.stats import Stats
from .vision.runtime import vision_of

if TYPE_CHECKING:
    from .engine import RoundEvent, Runtime

DIM, PLAIN = "\x1b[2m", "\x1b[0m"
THINKING = "[thinking] "  # what marks reasoning where stdout is not a terminal
COMMANDS = "/reset, /system [TEXT], /think on|off, /retry, /image PATH"


def chat_template(rt: Runtime, chat: ChatConfig) -> ChatTemplate | None:
    """The chat_template= file as a template (None: the install's own), checked to compile."""
    if chat.template is None:
        return None
    path = Path(chat.template).expanduser()
    where = f"chat template {path}"
    source = read_small_text(path, where, "chat_template")
    compile_template(source, where)
    return ChatTemplate(source, where, rt.install.template_files.special_tokens)


def load_tools(path: str | None) -> list | None:
    """tools=FILE.json: OpenAI's tools list (checked when the session takes it), read at most
    SMALL_FILE_BYTES from a regular file and nested at most MAX_NESTING (turbo/bounded.py)."""
    if path is None:
        return None
    where = f"tools file {Path(path).expanduser()}"
    text = read_small_text(path, where, "tools")
    try:
        return strict_loads(text)
    except ValueError as e:
        raise TurboError(f"{where}: not JSON ({e}); expected OpenAI's tools list", field="tools") from None


def open_session(rt: Runtime, chat: ChatConfig) -> Session:
    """The session, its template checked by rendering a first turn (a refusal comes before any
    output, not at the first answer)."""
    kwargs = {"enable_thinking": chat.think} if chat.think is not None else {}
    try:
        s = rt.session(chat.system, template=chat_template(rt, chat), tools=load_tools(chat.tools),
                       tool_choice=chat.tool_choice, **kwargs)
    except TurboError as e:
        if chat.template is None:  # the install has none: say how to give one
            raise TurboError(f"{e}; give one with chat_template=FILE.jinja") from None
        raise
    s.new_turn().render(s.history + [{"role": "user", "content": "Hello."}], s.template_kwargs)
    return s


class Display:
    """A turn's answer as it streams, as its Turn reads it (Turn.stream: the reasoning split off as
    the session's message splits it, a call's text held back): reasoning written marked, content
    plain; the tags themselves are not written. `thinking`: the answer opens inside a `<think>`
    (marked from the start)."""

    def __init__(self, out: TextIO, tty: bool, thinking: bool):
        self.out, self.tty, self.thinking = out, tty, False
        if thinking:
            self._switch()

    def push(self, think: str, content: str, final: bool = False) -> None:
        for text, marked in ((think, True), (content, False)):
            if text:
                if self.thinking != marked:
                    self._switch()
                self.out.write(text)
        if final and self.thinking and self.tty:
            self.out.write(PLAIN)
        self.out.flush()

    def _switch(self) -> None:
        self.thinking = not self.thinking
        if self.tty:
            self.out.write(DIM if self.thinking else PLAIN)
        else:
            self.out.write(THINKING if self.thinking else "\n")


def stats_line(stats: Stats, report: TurnReport, interrupted: bool = False) -> str:
    """task=generate's stats line, with what the turn prefilled and the state it went on from."""
    line = (f"{stats.line()} | prefilled {report.prefilled_tokens} tok ({report.resumed_from}, "
            f"{report.reused_tokens} reused) | snapshots {report.snapshots} "
            f"({report.snapshot_bytes / 2**20:.1f} MiB)")
    return line + (" | interrupted" if interrupted else "")


@dataclass
class Repl:
    rt: Runtime
    session: Session
    opts: GenerationOptions  # every turn's
    out: TextIO = sys.stdout
    err: TextIO = sys.stderr
    tty: bool = False  # stdout is a terminal: dim reasoning
    noted: bool = False  # the backend's note and why speculation is off, said once
    images: list = field(default_factory=list)  # /image's, for the next turn (turbo.vision PreparedImage)
    results: list = field(default_factory=list)  # typed results of the last answer's calls, so far

    def run(self, lines: Iterable[str]) -> int:
        for line in lines:
            text = line.rstrip("\n")
            if text.startswith("/"):
                self.command(*text.partition(" ")[::2])
            elif self.session.pending_calls:  # a line is a call's result
                self.results.append(text)
                if len(self.results) == len(self.session.pending_calls):
                    results, self.results = self.results, []
                    self.turn(lambda: self.session.send_tool_results(results, self.opts))
                else:
                    self.ask_result()
            elif text.strip():
                content = [{"type": "image", "image": im} for im in self.images] + [{"type": "text", "text": text}]
                self.images = []
                self.turn(lambda: self.session.send(content if len(content) > 1 else text, self.opts))
        return 0

    def command(self, name: str, arg: str) -> None:
        s, arg = self.session, arg.strip()
        if name == "/reset":
            s.reset()
            self.images, self.results = [], []
        elif name == "/image" and arg:
            self.attach(arg)
        elif name == "/system":
            s.system = arg or None
        elif name == "/think" and arg in ("on", "off"):
            s.template_kwargs["enable_thinking"] = arg == "on"
        elif name == "/retry" and any(m["role"] in ("user", "tool") for m in s.history[-2:]):
            self.turn(lambda: s.retry(self.opts))
        else:
            print(f"{name} {arg}".strip() + f": not a command here ({COMMANDS})", file=self.err, flush=True)

    def attach(self, path: str) -> None:
        """/image PATH: the image read and checked now (a refusal is one line, the REPL goes on)."""
        try:
            image = vision_of(self.rt).prepare([Path(path).expanduser()])[0]
        except TurboError as e:
            print(f"/image: {e}", file=self.err, flush=True)
            return
        self.images.append(image)
        print(f"[image] {path} ({image.tokens(vision_of(self.rt).config.merge)} tokens) goes with the next turn",
              file=self.err, flush=True)

    def turn(self, start: Callable[[], Iterator[RoundEvent]]) -> None:
        """One turn: its answer streamed, then its stats line. Ctrl-C stops it; what it had
        generated stays in the history as the assistant's message."""
        s = self.session
        generated: list[int] = []
        stats, events, display, answer, interrupted = None, None, None, None, False
        self.results = []
        try:
            events = start()
            answer = s.turn.stream()  # (s.turn: the turn `start` began) its reasoning split off, a call held back
            display = Display(self.out, self.tty, s.turn.opened)
            for event in events:
                if not self.noted:
                    self._note(event.stats)
                generated += event.tokens
                stats = event.stats
                think, content, _ = answer.feed(event.text, event.done)  # (the calls: the session reads them)
                display.push(think, content, final=event.done)
        except KeyboardInterrupt:
            interrupted = True
            getattr(events, "close", lambda: None)()
            if display is not None:
                think, content, _ = answer.feed("", True)
                display.push(think, content, final=True)
            if events is not None and s.history and s.history[-1]["role"] == "user":
                s.history.append(s.turn.answer_of(self.rt.tokenizer, generated)[0])
        print(file=self.out, flush=True)  # each answer a line of its own in the transcript
        last = s.history[-1] if s.history else {}
        for call in s.pending_calls:
            print(f"[tool call {call.id}] {call.name} {call.arguments}", file=self.out, flush=True)
        if last.get("tool_call_error"):
            print(f"[tool call not read] {last['tool_call_error']}", file=self.err, flush=True)
        if stats is not None:  # a report: standard error (standard output holds the answers alone)
            print(stats_line(stats, s.keeper.report, interrupted), file=self.err, flush=True)
        if s.pending_calls:
            self.ask_result()

    def ask_result(self) -> None:
        """Which call's result the next line is (standard error: stdout holds the answers alone)."""
        call: ToolCall = self.session.pending_calls[len(self.results)]
        print(f"[tool result for {call.id} ({call.name})? one line]", file=self.err, flush=True)

    def _note(self, stats: Stats) -> None:
        self.noted = True
        if self.rt.backend.note and self.rt.options.verbose:
            print(self.rt.backend.note, file=self.err)
        if stats.speculation_off_reason and self.opts.policy != "off":
            print(f"[turbo] speculation off: {stats.speculation_off_reason}", file=self.err)


def read_lines(stdin: TextIO, tty: bool) -> Iterator[str]:
    """The lines typed: with a `> ` prompt (and line editing) only where stdin and stdout are a
    terminal, so that piped output holds the answers alone."""
    if not tty:
        yield from stdin
        return
    while True:
        try:
            yield input("> ")
        except EOFError:
            print()
            return


def run_chat_cli(rc: RunConfig, rt: Runtime) -> int:
    session = open_session(rt, rc.chat)
    repl = Repl(rt, session, rc.generation, tty=sys.stdout.isatty())
    return repl.run(read_lines(sys.stdin, sys.stdin.isatty() and sys.stdout.isatty()))
