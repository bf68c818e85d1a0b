"""Pure rendering helpers: the styled transcript, the counters as shown, the acceptance bars."""

from __future__ import annotations

from typing import Callable

from rich.text import Text

from turbo.errors import TurboError
from turbo.sequence.detokenizer import Detokenizer
from turbo.sequence.sampling import sampling_label
from turbo.sequence.stats import Stats

from .settings import Settings, mode_label

ACCEPTED_STYLE = "bold #7ee787 on #12351f"  # an accepted draft proposal
BONUS_STYLE = "#e6edf3"  # the trunk's bonus token (or any token when not speculating)
PROMPT_STYLE = "dim italic"
HIDDEN = "·"  # wall-clock figures when timing is hidden (snapshot mode)
NEWLINE = "⏎"  # how a newline shows in the one-line prompt input (typed or from a preset)


def to_input(prompt: str) -> str:
    return prompt.replace("\n", NEWLINE)


def from_input(value: str) -> str:
    return value.replace(NEWLINE, "\n")


def error_text(e: BaseException) -> str:
    """An exception as the app shows it: a TurboError's own line, else its type and message."""
    if isinstance(e, TurboError):
        return str(e)
    return f"{type(e).__name__}: {e}"


def visible(s: str) -> str:
    """Control characters as their Unicode pictures (keeps newlines and tabs): a random model's
    bytes must not reach the terminal as escape sequences."""
    out = []
    for ch in s:
        o = ord(ch)
        if ch in "\n\t":
            out.append(ch)
        elif o < 32:
            out.append(chr(0x2400 + o))
        elif o == 0x7F:
            out.append("\u2421")
        elif 0x80 <= o < 0xA0:
            out.append("\ufffd")
        else:
            out.append(ch)
    return "".join(out)


class Transcript:
    """The generated tokens, where each came from, and the text they decode to.

    `text` is decode(all tokens), the same string `Runtime.generate` returns, kept by the engine's
    Detokenizer a token at a time (a short tail decoded per token, not the whole list): what it
    has let out plus the tail it holds back, as that decodes now. Each token's span in it is the
    growth of decode(tokens[:k]) (clamped: byte-level pieces of one character may not split cleanly)."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.detokenizer = Detokenizer(decode)
        self.tokens: list[int] = []
        self.from_draft: list[bool] = []
        self.starts: list[int] = []
        self.released = ""  # the text the detokenizer has let out
        self.text = ""

    def add(self, tokens: list[int], from_draft: list[bool]) -> None:
        for t, f in zip(tokens, from_draft):
            self.starts.append(len(self.text))  # == len(decode(tokens so far))
            self.tokens.append(t)
            self.from_draft.append(bool(f))
            self.released += self.detokenizer.push([t])
            self.text = self.released + self.detokenizer.held()

    def spans(self) -> list[tuple[int, int, bool]]:
        n, out, prev = len(self.text), [], 0
        for k, flag in enumerate(self.from_draft):
            start = max(prev, min(self.starts[k], n))
            end = n if k + 1 == len(self.starts) else max(start, min(self.starts[k + 1], n))
            out.append((start, end, flag))
            prev = end
        return out

    def rich(self, prompt: str = "") -> Text:
        t = Text()
        if prompt:
            t.append(visible(prompt), style=PROMPT_STYLE)
        for start, end, flag in self.spans():
            if end > start:
                t.append(visible(self.text[start:end]), style=ACCEPTED_STYLE if flag else BONUS_STYLE)
        return t


def bar(p: float, width: int) -> str:
    """A horizontal bar of `width` cells for a fraction p in [0, 1], with eighth-cell resolution."""
    p = min(max(p, 0.0), 1.0)
    eighths = round(p * width * 8)
    full, part = divmod(eighths, 8)
    s = "█" * full + ("" if part == 0 else " ▏▎▍▌▋▊▉"[part])
    return s.ljust(width, "░") if len(s) < width else s[:width]


def position_bars(per_position: list[float], width: int = 16) -> Text:
    if not per_position:
        return Text("(no draft positions: not speculating)", style="dim")
    t = Text()
    for i, p in enumerate(per_position):
        if i:
            t.append("\n")
        t.append(f"d{i + 1:<2}", style="bold")
        t.append(bar(p, width), style="#7ee787")
        t.append(f" {p:5.2f}")
    return t


def fmt_seconds(s: float) -> str:
    return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.2f} s"


# (id, label) of the counter rows of the stats panel, in order.
COUNTER_ROWS = (
    ("decode_tokens_per_s", "decode tok/s"),
    ("prefill_tokens_per_s", "prefill tok/s"),
    ("ttft_s", "ttft"),
    ("generated_tokens", "generated"),
    ("rounds", "rounds"),
    ("accepted_drafted", "accepted/drafted"),
    ("accepted_per_round", "accepted/round"),
    ("mean_acceptance_length", "mean accept len"),
    ("rollback_rate", "rollback rate"),
    ("replayed_rows", "replayed rows"),
)
TIMING_FIELDS = {"decode_tokens_per_s", "prefill_tokens_per_s", "ttft_s"}


def counter_values(stats, timing: bool = True) -> dict[str, str]:
    """The counters exactly as the stats panel shows them (field name -> text)."""
    if stats is None:
        return {key: "–" for key, _ in COUNTER_ROWS}
    v = {
        "decode_tokens_per_s": f"{stats.decode_tokens_per_s:.1f}",
        "prefill_tokens_per_s": f"{stats.prefill_tokens_per_s:.1f}",
        "ttft_s": fmt_seconds(stats.ttft_s),
        "generated_tokens": str(stats.generated_tokens),
        "rounds": str(stats.rounds),
        "accepted_drafted": f"{stats.accepted}/{stats.drafted}",
        "accepted_per_round": f"{stats.accepted_per_round:.3f}",
        "mean_acceptance_length": f"{stats.mean_acceptance_length:.3f}",
        "rollback_rate": f"{stats.rollback_rate:.1%}",
        "replayed_rows": str(stats.replayed_rows),
    }
    if not timing:
        for k in TIMING_FIELDS:
            v[k] = HIDDEN
    return v


def header_text(info: dict) -> Text:
    """The header: install, backend, drafter, policy, block, window, rollback, sampling, and why speculation is off."""
    t = Text()
    t.append(" turbo ", style="bold reverse")
    t.append("  ")  # separate segments: leading spaces of a styled run get trimmed by some SVG viewers
    t.append(str(info.get("install")), style="bold")
    t.append(" ")
    t.append("on", style="dim")
    t.append(" ")
    t.append(str(info.get("backend")), style="bold")
    parts = [("drafter", info.get("drafter")), ("policy", info.get("policy")), ("block", info.get("block")),
             ("window", info.get("window")), ("rollback", info.get("rollback"))]
    for name, value in parts:
        t.append("  ")
        t.append(name, style="dim")
        t.append(" ")
        t.append("–" if value is None else str(value), style="bold")
    t.append("\n")
    if info.get("max_new_tokens") is not None:
        t.append(" ")
        t.append("max new tokens ", style="dim")
        t.append(str(info["max_new_tokens"]), style="bold")
        t.append("  ")
    if info.get("sampling"):
        t.append(info["sampling"], style="bold")
        t.append("  ")
    off = info.get("off_reason")
    if info.get("pending"):
        t.append(f"next generation: {info['pending']}", style="italic #d29922")
    elif off:
        t.append("speculation off: ", style="bold #f0883e")
        t.append(visible(off), style="#f0883e")
    elif info.get("speculating"):
        t.append(f"speculating: {info['speculating']}", style="#7ee787")
    else:
        t.append("(no generation yet)", style="dim")
    return t


def header_info(s: Settings, st: Stats | None, where: tuple[str, str] | None, ran_with: tuple | None) -> dict:
    """What the header shows (header_text): the last generation's stats, or what the settings
    ask of the next one when they changed since (`ran_with`: its policy, block, rollback);
    `where`: the open runtime's install and backend names."""
    request = (s.policy, s.block, s.rollback)
    pending = ran_with is not None and request != ran_with
    g = s.generation
    info = {
        "install": where[0] if where is not None else s.install,
        "backend": where[1] if where is not None else s.opening.backend,
        "max_new_tokens": g.max_new_tokens,
        "sampling": sampling_label(g),  # the settings': what the next generation samples with
    }
    if st is not None and not pending:
        info |= {"drafter": st.drafter or "none", "policy": st.policy, "block": st.block if st.drafter else "–",
                 "window": st.window if st.window is not None else "–", "rollback": st.rollback,
                 "off_reason": st.speculation_off_reason,
                 "speculating": f"{st.drafter} block {st.block}" if st.drafter else None}
    else:
        info |= {"drafter": g.drafter, "policy": s.policy,
                 "block": s.block if s.block is not None else ("–" if s.policy == "off" else s.policy),
                 "window": g.window if g.window is not None else "default", "rollback": s.rollback}
        if pending:
            info["pending"] = f"{mode_label(s.policy, s.block)} · rollback {s.rollback}"
            if st is not None and st.drafter and s.policy != "off":  # the drafter stays the same
                info |= {"drafter": st.drafter, "window": st.window if st.window is not None else "–"}
    return info
