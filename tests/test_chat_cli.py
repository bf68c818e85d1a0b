"""python -m turbo task=chat driven through a pipe: turns in, answers and one stats line per turn
out, each the same as the Python API's session gives; /reset, /system, /think and /retry; EOF
ends it (0); a template missing, not Jinja or raising refuses in one stderr line (2). Ctrl-C in a
turn (in-process) keeps the partial answer and the next turn is still exact."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import sys

import pytest

import turbo
from turbo.chat.template import encode
from turbo.chat_cli import THINKING, Repl
from turbo.errors import TurboError
from turbo.sequence.options import GenerationOptions
from turbo.store.install import open_install

# ChatML whose generation prompt opens <think>, or closes it empty under enable_thinking=false
TEMPLATE = """{% for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""
TURNS = ["def fib(n):", "Now in C.", "/reset", "def fib(n):", "/system You answer in French.", "Why?",
         "/think off", "Again.", "/retry"]
OPTS = dict(max_new_tokens=8, policy="auto")


def chat(tmp_path, *overrides, turns=()):
    cmd = [sys.executable, "-m", "turbo", "task=chat", "threads=1", "backend=cpu", "max_new_tokens=8", *overrides]
    return subprocess.run(cmd, input="".join(t + "\n" for t in turns), capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)


def prefilled(stderr):
    """The tokens each turn prefilled, from its stats line (standard error: standard output holds
    the answers alone)."""
    return list(map(int, re.findall(r"^\[stats\].* \| prefilled (\d+) tok", stderr, re.M)))


def expected(rt, turns, system=None, **template_kwargs):
    """What the API's session gives for the same turns: [(text, prefilled, thinking)]."""
    s, out = rt.session(system, template=TEMPLATE, **template_kwargs), []
    for t in turns:
        if t == "/reset":
            s.reset()
        elif t.startswith("/system "):
            s.system = t.removeprefix("/system ")
        elif t == "/think off":
            s.template_kwargs["enable_thinking"] = False
        else:
            thinking = s.template_kwargs.get("enable_thinking", True)
            events = s.retry(**OPTS) if t == "/retry" else s.send(t, **OPTS)
            text = "".join(e.text for e in events)
            out.append((text, s.last_turn.prefilled_tokens, thinking))
    return out


def shown(text, thinking):
    """How a turn's answer shows on a pipe (the answer has no tags of its own)."""
    assert "<think>" not in text and "</think>" not in text
    return (THINKING if thinking else "") + text + "\n"


@pytest.fixture(scope="module")
def tiny():
    return turbo.open("tiny", backend="cpu")


@pytest.fixture
def template(tmp_path):
    path = tmp_path / "chatml.jinja"
    path.write_text(TEMPLATE)
    return path


def test_turns_through_a_pipe_match_the_session_api(tiny, template, tmp_path):
    proc = chat(tmp_path, f"chat_template={template}", turns=TURNS + ["/nope"])
    assert proc.returncode == 0, proc.stderr  # EOF ends it
    got, want = prefilled(proc.stderr), expected(tiny, TURNS)
    assert got == [p for _, p, _ in want] and len(got) == 6  # one stats line per turn, none for commands
    assert proc.stdout == "".join(shown(text, thinking) for text, _, thinking in want)  # the answers alone
    # /reset: the turn prefills what a fresh conversation's first turn does; the others went on
    assert got[2] == got[0]
    assert "/nope: not a command" in proc.stderr
    assert "> " not in proc.stdout  # no prompt on a pipe


def test_system_and_think_keys(tiny, template, tmp_path):
    proc = chat(tmp_path, f"chat_template={template}", "system='Be brief.'", "think=false", turns=["def fib(n):"])
    assert proc.returncode == 0, proc.stderr
    (text, tokens, thinking), = expected(tiny, ["def fib(n):"], "Be brief.", enable_thinking=False)
    assert proc.stdout == shown(text, False) and prefilled(proc.stderr) == [tokens]


def one_line_refusal(proc, *needles):
    assert proc.returncode == 2 and proc.stdout == "", (proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and all(n in lines[0] for n in needles), proc.stderr


@pytest.mark.parametrize("source, why", [
    (None, "no chat template"),  # an install without one (tiny's own, its template left out)
    ("{% for m in messages %}{{ m.content }\n", "not a valid Jinja template"),
    ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
])
def test_a_template_missing_malformed_or_raising_refuses_in_one_line(tmp_path, source, why):
    path = tmp_path / "t.jinja"
    overrides = []
    if source is not None:
        path.write_text(source)
        overrides.append(f"chat_template={path}")
    else:
        shutil.copytree(open_install("tiny").path, tmp_path / "plain", ignore=shutil.ignore_patterns("*.jinja"))
        overrides.append(f"install.path={tmp_path / 'plain'}")
    proc = chat(tmp_path, *overrides, turns=["hello"])
    one_line_refusal(proc, why, str(path) if source is not None else "plain")


def test_ctrl_c_stops_a_turn_keeps_its_partial_answer_and_the_next_turn_is_exact(tiny):
    s = tiny.session(template=TEMPLATE)
    send = s.send

    def interrupted_send(text, opts=None, **kw):
        events = send(text, opts, **kw)
        if text != "stop me":
            return events

        def first_round_then_ctrl_c():
            first = next(events)
            events.close()
            shown_first.append(first.text)
            yield first
            raise KeyboardInterrupt
        return first_round_then_ctrl_c()

    s.send, shown_first = interrupted_send, []
    out, err = io.StringIO(), io.StringIO()
    opts = GenerationOptions(**OPTS)
    assert Repl(tiny, s, opts, out=out, err=err).run(["stop me\n", "go on\n"]) == 0
    stats = [line for line in err.getvalue().splitlines() if line.startswith("[stats]")]
    assert len(stats) == 2 and stats[0].endswith("| interrupted") and "interrupted" not in stats[1]
    assert [m["role"] for m in s.history] == ["user", "assistant", "user", "assistant"]
    assert s.history[1]["reasoning_content"] == shown_first[0]  # the prompt opened <think>
    assert out.getvalue().startswith(THINKING + shown_first[0] + "\n") and "[stats]" not in out.getvalue()
    # the turn after the interrupted one: a fresh generation over the whole conversation
    prompt = s.template.render(s.history[:-1], add_generation_prompt=True)
    fresh = tiny.generate(encode(tiny.tokenizer, prompt), opts, stop_token_ids=s.stop_ids)
    assert s.last_turn.tokens == fresh.tokens


def test_a_turn_the_template_refuses_ends_the_repl(tiny):
    """(The CLI prints the refusal as one line and exits 2: turbo.__main__.guarded.)"""
    one_turn = "{% if messages|length > 1 %}{{ raise_exception('one turn only') }}{% endif %}" + TEMPLATE
    s, err = tiny.session(template=one_turn), io.StringIO()
    with pytest.raises(TurboError, match="one turn only"):
        Repl(tiny, s, GenerationOptions(**OPTS), out=io.StringIO(), err=err).run(["hello\n", "again\n"])
    assert err.getvalue().count("[stats]") == 1
