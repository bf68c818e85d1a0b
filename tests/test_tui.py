"""The Textual TUI (docs/DESIGN.md 9): driven with App.run_test() and Pilot against small random installs.

Snapshots (pytest-textual-snapshot, tests/__snapshots__/test_tui/) hide wall-clock figures
(TurboApp(timing=False)); refresh them with `pytest tests/test_tui.py --snapshot-update`.
"""

from __future__ import annotations

import asyncio
import copy
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

torch.set_num_threads(1)

import turbo  # noqa: E402
from turbo import RoundEvent, Stats  # noqa: E402
from turbo.sequence.options import OpenOptions  # noqa: E402
from turbo.testing import make_install, make_spec_install  # noqa: E402
from tui import MODES, Settings, TurboApp, compose_settings  # noqa: E402
from tui.__main__ import main as tui_main  # noqa: E402
from tui.app import from_input, to_input  # noqa: E402
from tui.settings import next_mode  # noqa: E402
from tui.view import (ACCEPTED_STYLE, BONUS_STYLE, PROMPT_STYLE, TIMING_FIELDS, Transcript, bar,  # noqa: E402
                      counter_values, visible)  # noqa: E402

SIZE = (110, 32)
COUNTS = ("prompt_tokens", "generated_tokens", "rounds", "drafted", "accepted", "accepted_per_round",
          "mean_acceptance_length", "rollback_rate", "per_position_acceptance", "replayed_rows", "policy",
          "drafter", "block", "window", "rollback", "backend", "speculation_off_reason")


@pytest.fixture(scope="module")
def installs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tui")
    _, spec = make_spec_install(tmp, 0)  # random trunk + random DFlash2 drafter
    _, plain = make_install(tmp, 1)  # a trunk without a drafter
    return spec, plain


@pytest.fixture(scope="module")
def spec_rt(installs):
    return turbo.open(installs[0], backend="cpu")


def settings(install, **kw) -> Settings:
    base = Settings(install=str(install), opening=OpenOptions.from_env(backend="cpu"), prompt="",
                    presets=[("prose", "The quick\nbrown fox"), ("code", "def f(x):")])
    return base.with_(**{"max_new_tokens": 20, "policy": "auto", **kw})


async def settle(app, pilot, timeout: float = 30.0):
    """Wait until no load/generation is running and every call_from_thread has been applied."""
    deadline = time.monotonic() + timeout
    while app.busy or any(w.is_running for w in app.workers):
        assert time.monotonic() < deadline, "the app did not finish in time"
        # not pilot.pause: it waits for the process to go idle, which it is not while a worker decodes
        await asyncio.sleep(0.02)
    await app.workers.wait_for_complete()
    await pilot.pause()


async def type_prompt(pilot, text: str):
    box = pilot.app.query_one("#prompt")
    box.focus()
    box.value = ""
    await pilot.press(*[{" ": "space"}.get(c, c) for c in text])


def assert_matches(app, result):
    assert app.output_text == result.text
    assert app.transcript.tokens == result.tokens
    assert app.transcript.from_draft == result.from_draft
    shown, want = app.last_stats.as_dict(), result.stats.as_dict()
    assert {k: shown[k] for k in COUNTS} == {k: want[k] for k in COUNTS}
    shown = app.shown_counters()
    assert shown == counter_values(app.last_stats, app.timing)  # wall-clock figures: this run's own
    want = counter_values(result.stats, app.timing)
    assert {k: v for k, v in shown.items() if k not in TIMING_FIELDS} == \
        {k: v for k, v in want.items() if k not in TIMING_FIELDS}


# ---- pure helpers ------------------------------------------------------------------------------


def test_view_helpers():
    assert bar(0.0, 4) == "░░░░" and bar(1.0, 4) == "████" and bar(0.5, 4) == "██░░"
    assert visible("a\x1b[31m\tb\n\x7f") == "a\u241b[31m\tb\n\u2421"
    assert from_input(to_input("a\nb")) == "a\nb"
    assert next_mode("off", None) == ("auto", None) and next_mode("auto", None) == ("fixed", 1)
    assert next_mode("fixed", 8) == ("off", None) and next_mode("adaptive", None) == MODES[0]
    tr = Transcript(lambda ids: "".join(chr(97 + i) * (i + 1) for i in ids))
    tr.add([0, 1], [True, False])
    tr.add([2], [False])
    assert tr.text == "abbccc" and tr.spans() == [(0, 1, True), (1, 3, False), (3, 6, False)]
    assert tr.rich("p").plain == "pabbccc"


def test_hydra_overrides_compose_like_the_cli():
    s = compose_settings(["+policy=fixed", "block=4", "install.path=/some/install", "rollback=replay"])
    assert (s.policy, s.block, s.install, s.rollback) == ("fixed", 4, "/some/install", "replay")
    assert s.prompt == s.presets[0][1] and s.workload == "code"  # the default workload (conf/config.yaml)
    assert {w for w, _ in s.presets} >= {"prose", "code", "math"}
    assert compose_settings([]).policy == "auto"
    assert tui_main(["no_such_key=1"]) == 2  # a bad override: one line on stderr, exit 2
    assert tui_main(["max_new_tokens=abc"]) == 2


def test_open_options_from_the_overrides_reach_the_runtime(installs):
    """python -m tui draft_products=fp32: the app opens its runtime with the composed OpenOptions."""
    s = compose_settings([f"install.path={installs[0]}", "backend=cpu", "draft_products=fp32", "max_new_tokens=7"])
    assert s.opening.draft_products == "fp32" and s.generation.max_new_tokens == 7

    async def run():
        app = TurboApp(s)
        async with app.run_test(size=SIZE) as pilot:
            await settle(app, pilot)
            assert app.load_error is None and app.runtime.options.draft_products == "fp32"
            assert app.runtime.options.backend == "cpu"

    asyncio.run(run())



# ---- driving the app ---------------------------------------------------------------------------


@pytest.mark.parametrize("policy,block,rollback", [("auto", None, "checkpoint"), ("fixed", 3, "replay")])
def test_type_submit_matches_generate(installs, spec_rt, policy, block, rollback):
    s = settings(installs[0], policy=policy, block=block, rollback=rollback)

    async def run():
        app = TurboApp(s)  # opens the install itself, in a worker thread
        async with app.run_test(size=SIZE) as pilot:
            await settle(app, pilot)
            assert app.runtime is not None and app.load_error is None
            await type_prompt(pilot, "def f(x): return x")
            await pilot.press("enter")
            await settle(app, pilot)
            assert app.last_outcome == "done", app.last_error
            result = spec_rt.generate("def f(x): return x", s.generation)
            assert_matches(app, result)
            assert result.stats.drafter == "dflash" and result.stats.rounds > 0
            header = str(app.query_one("#header").content)
            for part in ("install0", "dflash", f"block {result.stats.block}", rollback, "cpu"):
                assert part in header
            assert app.query_one("#bars").content.plain.count("\n") == result.stats.block - 1

    asyncio.run(run())


class Paced:
    """A runtime whose rounds take at least 5 ms: a generation long enough to be stopped
    mid-way however fast the machine decodes."""

    def __init__(self, rt):
        self.rt = rt

    def __getattr__(self, name):
        return getattr(self.rt, name)

    def stream(self, *args, **kwargs):
        for event in self.rt.stream(*args, **kwargs):
            time.sleep(0.005)
            yield event


def test_stop_mid_generation_then_submit_again(installs, spec_rt):
    s = settings(installs[0], max_new_tokens=3000)

    async def run():
        app = TurboApp(s, runtime=Paced(spec_rt))
        async with app.run_test(size=SIZE) as pilot:
            await type_prompt(pilot, "hello")
            await pilot.press("enter")
            deadline = time.monotonic() + 30
            while app.last_stats is None or app.last_stats.rounds < 3:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            assert app.busy
            await pilot.press("ctrl+n")  # keys are answered while tokens stream
            assert app.settings.policy == "fixed" and app.busy
            await pilot.press("escape")
            await settle(app, pilot)
            assert app.last_outcome == "stopped"
            assert 3 <= app.last_stats.generated_tokens < 3000
            assert "stopped" in str(app.query_one("#status").content)
            # the runtime is ready: the next prompt runs to the end and matches the API
            app.settings = app.settings.with_(max_new_tokens=16)
            await type_prompt(pilot, "again")
            await pilot.press("enter")
            await settle(app, pilot)
            assert app.last_outcome == "done"
            assert_matches(app, spec_rt.generate("again", app.settings.generation))

    asyncio.run(run())


def test_block_key_changes_the_next_generation(installs, spec_rt):
    s = settings(installs[0], policy="auto")

    async def run():
        app = TurboApp(s, runtime=spec_rt)
        async with app.run_test(size=SIZE) as pilot:
            await type_prompt(pilot, "abc")
            await pilot.press("enter")
            await settle(app, pilot)
            assert app.last_stats.block == 2  # auto serves block 2
            for _ in range(4):  # auto -> fixed 1 -> 2 -> 3 -> 4
                await pilot.press("ctrl+n")
            assert (app.settings.policy, app.settings.block) == ("fixed", 4)
            assert "next generation: fixed 4" in str(app.query_one("#header").content)
            await pilot.press("enter")
            await settle(app, pilot)
            assert app.last_stats.block == 4 and app.last_stats.drafted == 4 * app.last_stats.rounds
            assert_matches(app, spec_rt.generate("abc", app.settings.generation))
            for _ in range(5):  # fixed 4 -> ... -> fixed 8 -> off
                await pilot.press("ctrl+n")
            await pilot.press("ctrl+r")
            assert (app.settings.policy, app.settings.rollback) == ("off", "replay")
            await pilot.press("enter")
            await settle(app, pilot)
            assert app.last_stats.drafter is None and app.last_stats.rounds == app.last_stats.generated_tokens
            assert "speculation off" in str(app.query_one("#header").content)
            assert_matches(app, spec_rt.generate("abc", app.settings.generation))

    asyncio.run(run())


def test_errors_are_messages_and_the_app_stays_usable(installs, tmp_path):
    spec, plain = installs

    async def run():
        # a refused block: fixed on an install without a drafter
        app = TurboApp(settings(plain, policy="fixed", block=4))
        async with app.run_test(size=SIZE) as pilot:
            await settle(app, pilot)
            await type_prompt(pilot, "hi")
            await pilot.press("enter")
            await settle(app, pilot)
            assert app.last_outcome == "error" and "no DFlash2 drafter" in app.last_error
            assert "no DFlash2 drafter" in str(app.query_one("#status").content)
            for _ in range(6):  # fixed 4 -> ... -> off -> auto
                await pilot.press("ctrl+n")
            assert app.settings.policy == "auto"
            await pilot.press("enter")
            await settle(app, pilot)
            assert app.last_outcome == "done" and app.last_stats.speculation_off_reason
            assert "speculation off" in str(app.query_one("#header").content)

        # a bad install: a message; /open PATH opens a good one
        app = TurboApp(settings(tmp_path / "missing"))
        async with app.run_test(size=SIZE) as pilot:
            await settle(app, pilot)
            assert app.runtime is None and "no such directory" in app.load_error
            assert "cannot open install" in str(app.query_one("#status").content)
            await pilot.press("enter")
            assert "no install loaded" in app.last_error
            app.query_one("#prompt").value = f"/open {spec}"
            await pilot.press("enter")
            await settle(app, pilot)
            assert app.runtime is not None and app.runtime.install.name == "install0"
            await type_prompt(pilot, "ok")
            await pilot.press("enter")
            await settle(app, pilot)
            assert app.last_outcome == "done" and app.output_text

    asyncio.run(run())


def test_presets_and_clear(installs, spec_rt):
    async def run():
        app = TurboApp(settings(installs[0]), runtime=spec_rt)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("ctrl+o")
            assert app.query_one("#prompt").value == to_input("The quick\nbrown fox")
            await pilot.press("ctrl+o")
            assert app.query_one("#prompt").value == "def f(x):"
            assert "code 1/1" in str(app.query_one("#status").content)
            await pilot.press("enter")
            await settle(app, pilot)
            assert app.prompt_shown == "def f(x):" and app.output_text
            await pilot.press("ctrl+l")
            assert app.output_text == "" and app.query_one("#prompt").value == ""
            assert set(app.shown_counters().values()) == {"–"}

    asyncio.run(run())


def test_temperature_key_samples_the_next_generation(installs, spec_rt):
    s = settings(installs[0], policy="fixed", block=3, top_p=0.9, seed=2)

    async def run():
        app = TurboApp(s, runtime=spec_rt)
        async with app.run_test(size=SIZE) as pilot:
            await settle(app, pilot)
            assert "T 0  " in str(app.query_one("#header").content)  # greedy: the other fields unused
            await pilot.press("ctrl+t")  # 0 -> 0.7
            assert app.settings.generation.temperature == 0.7
            assert "T 0.7 p 0.9 seed 2" in str(app.query_one("#header").content)
            await type_prompt(pilot, "abc")
            await pilot.press("enter")
            await settle(app, pilot)
            assert app.last_outcome == "done" and app.last_stats.seed == 2
            assert_matches(app, spec_rt.generate("abc", app.settings.generation))
            await pilot.press("ctrl+t", "ctrl+t")  # 0.7 -> 1.0 -> 0
            assert app.settings.generation.temperature == 0.0

    asyncio.run(run())


# ---- snapshots -----------------------------------------------------------------------------------


def test_snapshot_idle(installs, spec_rt, snap_compare):
    app = TurboApp(settings(installs[0], prompt="def f(x):"), runtime=spec_rt, timing=False)
    assert snap_compare(app, terminal_size=SIZE)


def test_snapshot_finished_generation(installs, spec_rt, snap_compare):
    app = TurboApp(settings(installs[0], policy="fixed", block=4, max_new_tokens=48), runtime=spec_rt, timing=False)

    async def run_before(pilot):
        await type_prompt(pilot, "def f(x):")
        await pilot.press("enter")
        await settle(pilot.app, pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


class _FakeRuntime:
    """Just the public surface the app uses, replaying a scripted stream whose drafter lands proposals
    (random installs' drafters almost never do): deterministic whatever the engine's numerics."""

    install = SimpleNamespace(name="scripted", path=Path("/scripted"))
    backend = SimpleNamespace(name="cpu", note="")
    WORDS = ["def", " fib", "(n", "):", "\n   ", " if", " n", " <", " 2", ":", " return", " n", "\n   ",
             " return", " fib", "(n", " -", " 1", ")", " +", " fib", "(n", " -", " 2", ")", "\n"]

    def __init__(self, plan=None, block=3):
        # per round: how many proposals were accepted (the bonus token follows)
        self.plan, self.block = plan or [2, 1, 0], block

    def decode(self, ids):
        return "".join(self.WORDS[i % len(self.WORDS)] for i in ids)

    def stream(self, prompt, opts=None, **kw):
        stats = Stats(prompt_tokens=1, policy="fixed", drafter="dflash", block=self.block, window=64, backend="cpu",
                      ttft_s=0.0123, prefill_tokens_per_s=81.3, decode_tokens_per_s=456.7)

        def events():
            pos = 0
            for i, n in enumerate(self.plan):
                toks, flags = list(range(pos, pos + n + 1)), [True] * n + [False]
                pos += n + 1
                stats.record_round(self.block, n, 0)
                stats.generated_tokens = pos
                yield RoundEvent(toks, flags, self.decode(toks), copy.deepcopy(stats), i == len(self.plan) - 1)

        return events()


def test_accepted_and_bonus_tokens_are_styled_differently():
    async def run():
        app = TurboApp(settings("fake"), runtime=_FakeRuntime(), timing=False)
        async with app.run_test(size=SIZE) as pilot:
            await type_prompt(pilot, "p")
            await pilot.press("enter")
            await settle(app, pilot)
            assert app.output_text == "def fib(n):\n    if"
            text = app.query_one("#output").content
            style = {i: str(s.style) for s in text.spans for i in range(s.start, s.end)}
            A, B = ACCEPTED_STYLE, BONUS_STYLE
            assert text.plain == "p" + app.output_text
            cuts = [0, 1, 4, 8, 10, 12, 16, 19]  # "p" "def" " fib" "(n" "):" "\n   " " if"
            want = [PROMPT_STYLE, A, A, B, A, B, B]
            for (a, b), w in zip(zip(cuts, cuts[1:]), want):
                assert {style[i] for i in range(a, b)} == {w}, (text.plain[a:b], w)
            assert app.accepted_history == [2.0, 1.0, 0.0]
            assert app.shown_counters()["accepted_drafted"] == "3/9" and app.shown_counters()["rounds"] == "3"
            assert "d1" in app.query_one("#bars").content.plain

    asyncio.run(run())


def test_snapshot_finished_generation_scripted(installs, snap_compare):
    """Accepted proposals and bonus tokens, bars and sparkline with a drafter that lands proposals."""
    rt = _FakeRuntime(plan=[3, 2, 0, 1, 3, 0, 2, 1, 3, 3, 0, 1], block=3)
    app = TurboApp(settings("scripted", policy="fixed", block=3, max_new_tokens=64), runtime=rt, timing=False)

    async def run_before(pilot):
        await type_prompt(pilot, "fib")
        await pilot.press("enter")
        await settle(pilot.app, pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
