"""An answer's reasoning: the `<think>...</think>` it opens with, split from its content the way
vLLM's Qwen3 reasoning parser splits it -- whole (`split_reasoning`) or as it streams
(`ReasoningStream`, the same split piece by piece)."""

from __future__ import annotations

from ..sequence.stops import held_back

THINK, END_THINK = "<think>", "</think>"


def opens_think(prompt: str) -> bool:
    """The generation prompt left a `<think>` open (thinking templates): the answer starts inside it."""
    return prompt.rfind(THINK) > prompt.rfind(END_THINK)


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str]:
    """(reasoning, content) as vLLM's Qwen3 reasoning parser: a `<think>` the model wrote is
    dropped, what comes before the first `</think>` is the reasoning, the rest the content;
    without a `</think>` there is no reasoning -- unless the prompt opened the `<think>`
    (`opened`): then an answer cut before its `</think>` is all reasoning."""
    before, think, after = text.partition(THINK)
    text = after if think else before
    reasoning, end, content = text.partition(END_THINK)
    if end:
        return reasoning, content
    return (text, "") if opened else (None, text)


class _Pieces:
    """A streamed text as its pieces: appending is O(1), a slice near the end costs its length
    (a str grown by += is copied whole at every piece: quadratic over a long answer)."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.size = 0

    def append(self, piece: str) -> None:
        self.pieces.append(piece)
        self.size += len(piece)

    def slice(self, start: int, stop: int | None = None) -> str:
        """text[start:stop], walking back from the last piece."""
        stop = self.size if stop is None else stop
        if start >= stop:
            return ""
        parts, end = [], self.size
        for p in reversed(self.pieces):
            if end <= start:
                break
            begin = end - len(p)
            if begin < stop:
                parts.append(p[max(start - begin, 0):stop - begin])
            end = begin
        return "".join(reversed(parts))


TAG_BACK = len(END_THINK) - 1  # a tag may straddle pieces: each search starts this far before the new piece


class ReasoningStream:
    """`split_reasoning` as a streamed answer grows: what reasoning and content each gained since
    the last call. Inside a `<think>` not closed yet the text is reasoning (less what may begin
    its `</think>`); the final call splits exactly as a whole answer is split. Linear in the
    answer: the tags are searched for in each new piece only, and reasoning, content and what
    was sent of each are spans of the text, compared by their bounds."""

    def __init__(self, opened: bool):
        self.opened, self.text = opened, _Pieces()
        self.think = -1  # where the first <think> starts (-1: none yet)
        self.any_end = -1  # where the first </think> starts
        self.end = -1  # where the first </think> after the first <think> starts (split_reasoning's)
        self.sent = [(0, 0), (0, 0)]  # the spans of reasoning and content sent so far
        self.same: dict[tuple[int, int, int], bool] = {}  # text[a:a+n] == text[b:b+n], by (a, b, n)

    def feed(self, piece: str, final: bool) -> tuple[str, str]:
        text = self.text
        back = max(0, text.size - TAG_BACK)
        text.append(piece)
        tail = text.slice(back)  # the new piece, and what may begin a tag before it
        if self.think < 0 and (at := tail.find(THINK)) >= 0:
            self.think, self.end = back + at, -1  # (split_reasoning's </think> is the first after it)
        after = self.think + len(THINK) if self.think >= 0 else 0  # split_reasoning: what follows it
        if self.any_end < 0 and (at := tail.find(END_THINK)) >= 0:
            self.any_end = back + at
        if self.end < 0 and (at := tail.find(END_THINK, max(after - back, 0))) >= 0:
            self.end = back + at
        size = text.size
        if self.end >= 0:
            spans = [(after, self.end), (self.end + len(END_THINK), size)]
        else:
            spans = [(after, size), (size, size)] if self.opened else [(0, 0), (after, size)]
        if not final and self.any_end < 0 and (self.opened or self.think >= 0):
            cut = held_back(text.slice(max(after, size - len(END_THINK)), size), (END_THINK,))
            spans = [(after, size - cut), (size, size)]
        out = []
        for i, (a, b) in enumerate(spans):
            sa, sb = self.sent[i]
            grew = b - a >= sb - sa and self._same(a, sa, sb - sa)  # (what was sent stays sent)
            out.append(text.slice(a + sb - sa, b) if grew else "")
            self.sent[i] = (a, b) if grew else self.sent[i]
        return out[0], out[1]

    def _same(self, a: int, b: int, n: int) -> bool:
        if a == b or n == 0:
            return True
        if (a, b, n) not in self.same:  # (the text only grows: once compared, always the same answer)
            self.same[(a, b, n)] = self.text.slice(a, a + n) == self.text.slice(b, b + n)
        return self.same[(a, b, n)]
