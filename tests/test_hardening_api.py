"""The API refuses nonsense by name, and one runtime stays correct when several threads use it."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

import turbo
from turbo import TurboError
from turbo.sequence.options import OpenOptions

PROMPT = "def f(x):"


@pytest.fixture(scope="module")
def rt(spec_install):
    return turbo.open(spec_install[1], backend="cpu")


@pytest.fixture(scope="module")
def plain(rt):
    """The plain-decode tokens of PROMPT: what every lossless generation of it must give."""
    return rt.generate(PROMPT, max_new_tokens=24, policy="off").tokens


def test_bools_are_not_token_ids(rt):
    with pytest.raises(TurboError, match=r"^prompt token True is not an id in 0\.\.319$"):
        rt.generate([True, False], max_new_tokens=2)


def test_numpy_token_ids_are_ids(rt, plain):
    ids = rt.encode(PROMPT)
    assert rt.generate(np.array(ids), max_new_tokens=24, policy="off").tokens == plain
    assert rt.generate([np.int32(i) for i in ids], max_new_tokens=24, policy="off").tokens == plain
    assert rt.generate(tuple(ids), max_new_tokens=24, policy="off").tokens == plain


def test_a_str_prompt_is_the_tokenizer_path(rt, plain):
    assert rt.encode(PROMPT) == rt.tokenizer.encode(PROMPT).ids
    assert rt.generate(rt.tokenizer.encode(PROMPT).ids, max_new_tokens=24, policy="off").tokens == plain


@pytest.mark.parametrize("prompt, message", [
    (np.array([[1, 2]]), r"^prompt array of shape \[1, 2\]: expected a 1-D array of token ids$"),
    (np.array([1.0, 2.0]), r"^prompt token np\.float64\(1\.0\) is not an id in 0\.\.319$"),
    (np.array([True]), r"^prompt token np\.True_ is not an id"),
    ({1, 2}, r"^prompt of type set: expected a str, or token ids as a list, a tuple or a 1-D numpy integer array$"),
    (b"hi", r"^prompt of type bytes: expected a str"),
])
def test_other_prompts_are_refused_by_name(rt, prompt, message):
    with pytest.raises(TurboError, match=message):
        rt.generate(prompt, max_new_tokens=2)


@pytest.mark.parametrize("field, extra", [("max_new_tokens", {}), ("block", {"policy": "fixed"}), ("window", {})])
def test_bools_are_not_integer_options(rt, field, extra):
    with pytest.raises(TurboError, match=rf"^{field} is True, expected an integer$"):
        rt.generate(PROMPT, **({"max_new_tokens": 4} | extra | {field: True}))


def test_numpy_integer_options_are_integers(rt, plain):
    result = rt.generate(PROMPT, max_new_tokens=np.int64(24), policy="fixed", block=np.int8(3), window=np.int16(32))
    assert result.tokens == plain and result.stats.block == 3 and result.stats.window == 32


def test_numpy_integer_sampling_options_are_integers(rt):
    sampled = dict(max_new_tokens=12, policy="fixed", block=2, temperature=0.7)
    a = rt.generate(PROMPT, top_k=np.int64(8), seed=np.int32(5), **sampled)
    b = rt.generate(PROMPT, top_k=8, seed=5, **sampled)
    assert a.tokens == b.tokens and a.stats.seed == 5 and type(a.stats.seed) is int


@pytest.mark.parametrize("threads", [100000, -1, 0])
def test_threads_outside_the_machine_are_refused(spec_install, threads):
    with pytest.raises(TurboError, match=rf"^threads {threads} is outside 1\.\.\d+ \(up to 4x this machine's \d+ cores\)$"):
        turbo.open(spec_install[1], backend="cpu", threads=threads)
    with pytest.raises(TurboError, match=r"^threads is True, expected an integer$"):
        OpenOptions(threads=True)


def test_two_threads_on_one_runtime_both_get_the_plain_tokens(rt, plain):
    results, errors = {}, []

    def generate(name, block):
        try:
            results[name] = rt.generate(PROMPT, max_new_tokens=24, policy="fixed", block=block).tokens
        except Exception as e:  # noqa: BLE001 - the assertion below shows it
            errors.append(e)

    threads = [threading.Thread(target=generate, args=(n, b)) for n, b in (("a", 2), ("b", 5), ("c", 8))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and results == {"a": plain, "b": plain, "c": plain}


def test_resuming_an_abandoned_stream_is_refused(rt, plain):
    stream = rt.stream(PROMPT, max_new_tokens=24, policy="fixed", block=2)
    first = next(stream)
    assert rt.generate(PROMPT, max_new_tokens=24, policy="fixed", block=4).tokens == plain
    with pytest.raises(TurboError, match=r"^this stream was abandoned: another generation has run on the runtime "
                                         r"since; start a new stream$"):
        next(stream)
    assert first.tokens == plain[:len(first.tokens)]


def test_an_open_stream_blocks_no_other_thread(rt, plain):
    stream = rt.stream(PROMPT, max_new_tokens=24, policy="fixed", block=3)
    next(stream)  # held open, never closed
    out = []
    t = threading.Thread(target=lambda: out.append(rt.generate(PROMPT, max_new_tokens=24, policy="off").tokens))
    t.start()
    t.join(60)
    assert out == [plain]
    with pytest.raises(TurboError, match="this stream was abandoned"):
        next(stream)


def test_a_stream_closed_mid_way_leaves_the_runtime_ready(rt, plain):
    stream = rt.stream(PROMPT, max_new_tokens=24, policy="fixed", block=2)
    next(stream)
    stream.close()
    assert rt.generate(PROMPT, max_new_tokens=24, policy="fixed", block=6).tokens == plain


def test_ctrl_c_in_the_tui_stops_the_generation(spec_install, rt):
    from test_tui import SIZE, Paced, settings, settle, type_prompt

    from tui import TurboApp

    async def run():
        app = TurboApp(settings(spec_install[1], max_new_tokens=3000), runtime=Paced(rt))
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("ctrl+c")  # nothing running: the key goes on, the app stays
            assert not app.busy and app.is_running
            await type_prompt(pilot, "hello")
            await pilot.press("enter")
            for _ in range(3000):  # until 3 rounds are shown (30 s at most)
                if app.last_stats is not None and app.last_stats.rounds >= 3:
                    break
                await asyncio.sleep(0.01)
            await pilot.press("ctrl+c")
            await settle(app, pilot)
            assert app.last_outcome == "stopped" and 3 <= app.last_stats.generated_tokens < 3000

    asyncio.run(run())
