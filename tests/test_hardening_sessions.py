"""Sessions that refuse atomically (issue 48): a turn refused for its options, its content, its
length or an unknown keyword leaves the session exactly as before -- its history, its kept
states, and so the next turn's tokens, which are those of a session that never saw the refusal;
`edit(True, ...)` is not `edit(1, ...)`; rt.chat's and rt.session's keywords are a generation
option or a variable the template reads, anything else refused by name."""

from __future__ import annotations

import numpy as np
import pytest

import turbo
from turbo.errors import TurboError


@pytest.fixture(scope="module")
def tiny():
    return turbo.open("tiny", backend="cpu", threads=1)


def drain(events) -> list[int]:
    return [t for e in events for t in e.tokens]


def kept(s) -> tuple:
    """What a refused turn must leave as it was: the history and the keeper's kept states."""
    k = s.keeper
    return ([dict(m) for m in s.history], id(k.st), id(k.kept), [(key, id(e)) for key, e in k.kept.entries.items()],
            k.marks, id(s.last_turn))


REFUSALS = {
    "negative max_new_tokens": lambda s: s.send("and then?", max_new_tokens=-1),
    "unknown option": lambda s: s.send("and then?", max_tokens=4),
    "bytes content": lambda s: s.send(b"and then?"),
    "set content": lambda s: s.send({"and then?"}),
    "None content": lambda s: s.send(None),
    "a bad part": lambda s: s.send([{"type": "text", "text": 3}]),
    "over-long message": lambda s: s.send("word " * 5000, max_new_tokens=4),
    "retry with bad options": lambda s: s.retry(temperature=-1.0),
    "edit with bad options": lambda s: s.edit(0, "Hi again.", max_new_tokens=0),
    "edit(True)": lambda s: s.edit(True, "Hi again."),
    "edit(1.0)": lambda s: s.edit(1.0, "Hi again."),
    "edit of an assistant message": lambda s: s.edit(1, "Hi again."),
}


@pytest.mark.parametrize("refusal", REFUSALS)
def test_a_refused_turn_leaves_the_session_as_it_was(tiny, refusal):
    s, clean = tiny.session(), tiny.session()
    for x in (s, clean):
        drain(x.send("Hello there.", max_new_tokens=6))
    before = kept(s)
    with pytest.raises(TurboError) as e:
        REFUSALS[refusal](s)
    assert "\n" not in str(e.value)
    assert kept(s) == before
    assert drain(s.send("And then?", max_new_tokens=6)) == drain(clean.send("And then?", max_new_tokens=6))
    assert s.history == clean.history


def test_edit_takes_integer_indices_only(tiny):
    s = tiny.session()
    drain(s.send("Hello there.", max_new_tokens=4))
    with pytest.raises(TurboError, match=r"^edit index True: expected an integer index into history$"):
        s.edit(True, "x")
    drain(s.edit(np.int64(0), "Hi.", max_new_tokens=4))  # a numpy integer is an index
    assert s.history[0] == {"role": "user", "content": "Hi."} and len(s.history) == 2


def test_chat_keywords_are_options_or_template_variables(tiny):
    messages = [{"role": "user", "content": "Hi."}]
    assert tiny.chat(messages, max_new_tokens=4, enable_thinking=False).tokens  # a variable the template reads
    with pytest.raises(TurboError, match=r"^max_tokens is neither a generation option nor a variable .* reads "
                                         r"\(nearest: max_new_tokens\)"):
        tiny.chat(messages, max_tokens=4)
    with pytest.raises(TurboError, match=r"^enable_thinkin is neither .*\(nearest: enable_thinking\)"):
        tiny.session(enable_thinkin=False)
    assert tiny.session(enable_thinking=False).template_kwargs == {"enable_thinking": False}
