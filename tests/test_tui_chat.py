"""The TUI's chat (tui/chat.py) driven with Pilot on tiny, through a ChatML template file given as
`chat_template=` (tiny ships its own; this one opens <think> that tiny never closes): turns, retry,
edit of an earlier turn, new chat, the reasoning collapsed, the per-turn counters equal to
Session.last_turn, and each turn's tokens those of a fresh generation over the rendered
conversation. Snapshot: tests/__snapshots__/test_tui_chat/ (`pytest tests/test_tui_chat.py --snapshot-update`).
"""

from __future__ import annotations

import asyncio
import shutil
import time

import pytest
import torch

torch.set_num_threads(1)

from test_tui import settle, type_prompt  # noqa: E402
from textual.widgets import Collapsible  # noqa: E402

import turbo  # noqa: E402
from tui import Settings, TurboApp, compose_settings  # noqa: E402
from tui.chat import STOPPED_NOTE, Answer, answer_texts, chat_counter_values  # noqa: E402
from tui.view import Transcript  # noqa: E402
from turbo.chat.template import encode  # noqa: E402
from turbo.sequence.options import OpenOptions  # noqa: E402
from turbo.store.install import open_install  # noqa: E402

SIZE = (130, 40)
# ChatML whose generation prompt opens <think>: tiny never closes it, so every answer is reasoning
THINKING_CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")


@pytest.fixture(scope="module")
def tiny():
    return turbo.open("tiny", backend="cpu")


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "chatml.jinja"
    path.write_text(THINKING_CHATML)
    return str(path)


def chat_settings(template: str | None, **kw) -> Settings:
    base = Settings(install="tiny", opening=OpenOptions.from_env(backend="cpu"), chat_template=template,
                    system="You are terse.")
    return base.with_(**{"max_new_tokens": 12, "policy": "fixed", "block": 3, **kw})


def shown(app, key: str) -> str:
    return str(app.query_one(f"#{key}").content)


def check_turn(app) -> None:
    """The turn's tokens are a fresh generation's over the rendered conversation; the counters
    shown are Session.last_turn's."""
    s = app.session
    assert app.last_outcome == "done", app.last_error
    assert s.history[-1]["role"] == "assistant"
    prompt = s.template.render(s.history[:-1], add_generation_prompt=True, **s.template_kwargs)
    fresh = s.rt.generate(encode(s.rt.tokenizer, prompt), app.settings.generation.but(stop_token_ids=s.stop_ids))
    r = s.last_turn
    assert r.tokens == fresh.tokens and r.prompt_tokens == fresh.stats.prompt_tokens
    assert shown(app, "turn-prefilled") == str(r.prefilled_tokens)
    assert shown(app, "turn-reused") == str(r.reused_tokens) and shown(app, "turn-resumed") == r.resumed_from
    assert shown(app, "turn-prompt") == str(r.prompt_tokens)
    assert f"prefilled {r.prefilled_tokens}, reused {r.reused_tokens}" in str(list(app.query(Answer))[-1].note.content)


def folds(app) -> list[Collapsible]:
    return [f for f in app.query(".reasoning").results(Collapsible) if f.display]


async def send(app, pilot, text: str) -> None:
    await type_prompt(pilot, text)
    await pilot.press("enter")
    await settle(app, pilot)


def test_chat_turns_retry_edit_new_chat(tiny, template):
    async def run():
        app = TurboApp(chat_settings(template), runtime=tiny)
        async with app.run_test(size=SIZE) as pilot:
            await settle(app, pilot)
            assert app.chat_on and app.session.system == "You are terse."
            assert app.query_one("#chat-pane").display and not app.query_one("#output-pane").display

            await send(app, pilot, "def fib(n):")  # turn 1: all reasoning (the prompt opened <think>)
            check_turn(app)
            s = app.session
            assert [m["role"] for m in s.history] == ["system", "user", "assistant"]
            assert s.history[-1]["content"] == "" and s.history[-1]["reasoning_content"]
            assert [f.collapsed for f in folds(app)] == [True]  # collapsed once the turn ended
            assert str(folds(app)[0].query_one(".reasoning-text").content) == s.history[-1]["reasoning_content"]
            await pilot.press("ctrl+b")
            assert [f.collapsed for f in folds(app)] == [False]
            await pilot.press("ctrl+b")
            assert [f.collapsed for f in folds(app)] == [True]

            await send(app, pilot, "Now in C.")  # turn 2 goes on from a kept state
            check_turn(app)
            assert len(s.history) == 5 and s.last_turn.reused_tokens > 0
            assert s.last_turn.prefilled_tokens < s.last_turn.prompt_tokens - 1
            assert len(folds(app)) == 2 and all(f.collapsed for f in folds(app))

            await pilot.press("ctrl+y")  # retry the last turn
            await settle(app, pilot)
            check_turn(app)
            assert len(s.history) == 5 and s.history[3]["content"] == "Now in C."
            assert shown(app, "session-turns") == "3"

            await pilot.press("ctrl+p", "ctrl+p")  # the last user message, then the first
            assert app.editing == 0 and app.query_one("#prompt").value == "def fib(n):"
            assert len(app.query(".user-turn.editing")) == 1
            app.query_one("#prompt").value = "class Stack:"
            await pilot.press("enter")
            await settle(app, pilot)
            check_turn(app)
            assert [m["role"] for m in s.history] == ["system", "user", "assistant"]
            assert s.history[1]["content"] == "class Stack:" and app.editing is None
            assert len(app.query(".user-turn")) == 1 and len(app.query(Answer)) == 1
            totals = app.totals
            assert shown(app, "session-turns") == "4" and totals.turns == 4
            assert chat_counter_values(s.last_turn, totals)["session-prefilled"] == str(totals.prefilled)

            await pilot.press("ctrl+l")  # new chat: the system prompt stays
            assert s.history == [{"role": "system", "content": "You are terse."}]
            assert len(app.query(".user-turn")) == 0 and shown(app, "session-turns") == "0"
            app.query_one("#system").value = "You answer in French."
            await send(app, pilot, "Encore ?")
            check_turn(app)
            assert s.history[0]["content"] == "You answer in French." and s.last_turn.resumed_from == "fresh"

            await pilot.press("ctrl+g")  # raw completion, one key away; the chat waits
            assert not app.chat_on and app.query_one("#output-pane").display
            await send(app, pilot, "def f(x):")
            assert app.output_text == tiny.generate("def f(x):", app.settings.generation).text
            await pilot.press("ctrl+g")
            assert app.chat_on and len(s.history) == 3 and len(app.query(".user-turn")) == 1

    asyncio.run(run())


def test_a_stopped_turn_is_replaced_by_the_next_message(tiny, template, monkeypatch):
    stream = tiny.stream

    def paced(*args, **kwargs):  # rounds of at least 20 ms: a turn long enough to be stopped mid-way
        for event in stream(*args, **kwargs):
            time.sleep(0.02)
            yield event

    monkeypatch.setattr(tiny, "stream", paced)  # what the session's turns run through

    async def run():
        app = TurboApp(chat_settings(template, max_new_tokens=400), runtime=tiny)
        async with app.run_test(size=SIZE) as pilot:
            await settle(app, pilot)
            await type_prompt(pilot, "Write a function that reverses a list.")  # (tiny loops on it)
            await pilot.press("enter")
            deadline = time.monotonic() + 30
            while app.last_stats is None or app.last_stats.rounds < 2:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            await pilot.press("escape")
            await settle(app, pilot)
            assert app.last_outcome == "stopped" and app.session.history[-1]["role"] == "user"
            assert STOPPED_NOTE in str(list(app.query(Answer))[-1].note.content)
            app.settings = app.settings.with_(max_new_tokens=8)
            await send(app, pilot, "Now in C.")
            check_turn(app)
            assert [m["content"] for m in app.session.history[1:2]] == ["Now in C."] and len(app.session.history) == 3

    asyncio.run(run())


def test_no_template_stays_raw_and_a_bad_one_is_a_message(template, tmp_path):
    # tiny without its own template (tiny ships one since its chat fine-tune)
    shutil.copytree(open_install("tiny").path, tmp_path / "plain", ignore=shutil.ignore_patterns("*.jinja"))
    plain = turbo.open(tmp_path / "plain", backend="cpu")

    async def run():
        app = TurboApp(chat_settings(None), runtime=plain)
        async with app.run_test(size=SIZE) as pilot:
            await settle(app, pilot)
            assert not app.chat_on and app.session is None
            assert app.check_action("toggle_chat", ()) is False and app.check_action("retry", ()) is False
            bad = tmp_path / "bad.jinja"
            bad.write_text("{% for m in messages %}")
            app.query_one("#prompt").value = f"/template {bad}"  # set, not typed: a long path types slowly
            await pilot.press("enter")
            assert not app.chat_on and "no chat" in app.last_error and "bad.jinja" in app.last_error
            app.query_one("#prompt").value = f"/template {tmp_path / 'missing.jinja'}"
            await pilot.press("enter")
            assert not app.chat_on and "no chat" in app.last_error
            app.query_one("#prompt").value = f"/template {template}"  # the app loads one: the chat opens
            await pilot.press("enter")
            assert app.chat_on and app.check_action("toggle_chat", ()) and app.template_where == "chatml.jinja"

    asyncio.run(run())


def test_answer_with_reasoning_and_content():
    """The reasoning and the content cut from the transcript, colours kept; a stranger text: the message's own."""
    words = ["ok", "</think>", " hi", "<|im_end|>"]
    t = Transcript(lambda ids: "".join(words[i] for i in ids))
    t.add([0, 1, 2, 3], [True, False, True, False])
    message = {"role": "assistant", "content": " hi", "reasoning_content": "ok"}
    reasoning, content = answer_texts(message, t, (3,))
    assert reasoning.plain == "ok" and content.plain == " hi"
    assert any("dim" in str(s.style) for s in reasoning.spans) and content.spans
    reasoning, content = answer_texts({"role": "assistant", "content": "else"}, t, (3,))
    assert reasoning is None and content.plain == "else" and not content.spans


def test_snapshot_chat(tiny, template, snap_compare):
    app = TurboApp(chat_settings(template), runtime=tiny, timing=False)

    async def run_before(pilot):
        await settle(pilot.app, pilot)
        await send(pilot.app, pilot, "def fib(n):")
        await send(pilot.app, pilot, "Now in C.")
        pilot.app.query_one("#prompt").value = ""
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_chat_keys_from_the_config():
    """chat_template, system, think are read where the composed config has them (++: added or overridden)."""
    s = compose_settings(["++chat_template=/x/chat.jinja", "++system=Be brief.", "++think=off"])
    assert (s.chat_template, s.system, s.think) == ("/x/chat.jinja", "Be brief.", False)
    assert compose_settings(["++think=true"]).think is True
