"""`n` > 1: a request's choices are sequences of the running batch that share its prompt's prefill
(the followers start from the leader's prompt state in the prefix cache); choice i samples with
seed + i and equals that request alone, streamed or not. The same through Runtime.choices and
task=generate's n=."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from turbo.errors import TurboError
from turbo.sequence.options import GenerationOptions
from turbo.serve.scheduler import Request, Scheduler

PROMPT = "def fib(n):"


def test_choices_equal_their_requests_alone_streamed_or_not(tiny_server):
    engine, client, rt = tiny_server.engine, tiny_server.client, tiny_server.engine.rt
    kw = dict(model=engine.model, prompt=PROMPT, max_tokens=20, temperature=0.9, seed=11,
              extra_body={"turbo": {"policy": "fixed", "block": 3}})
    whole = client.completions.create(n=4, **kw)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    alone = [rt.generate(PROMPT, max_new_tokens=20, temperature=0.9, seed=11 + i, policy="fixed", block=3)
             for i in range(4)]
    assert [c.text for c in whole.choices] == [a.text for a in alone]
    assert len({a.text for a in alone}) > 1  # the seeds differ: so do the choices
    assert whole.usage.completion_tokens == sum(len(a.tokens) for a in alone)
    parts: dict[int, str] = {}
    for chunk in client.completions.create(n=4, stream=True, **kw):
        for c in chunk.choices:
            parts[c.index] = parts.get(c.index, "") + c.text
    assert [parts[i] for i in range(4)] == [a.text for a in alone]
    chat = client.chat.completions.create(model=engine.model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=8, temperature=0, n=2)
    assert len(chat.choices) == 2 and chat.choices[0].message == chat.choices[1].message  # greedy: the same


def test_a_whole_answer_longer_than_the_disconnect_poll_is_answered(tiny_server, monkeypatch):
    """A non-streaming answer looks every DISCONNECT_POLL_S whether its client left: through the
    HTTP request, which a choice's scheduler Request once shadowed (a 500 for any answer that took
    longer than the poll: on a slow machine, every one)."""
    from turbo.serve import app

    monkeypatch.setattr(app, "DISCONNECT_POLL_S", 0.001)
    engine, rt = tiny_server.engine, tiny_server.engine.rt
    for n in (1, 2):
        r = tiny_server.http.post("/v1/completions", json={"model": engine.model, "prompt": PROMPT, "max_tokens": 12,
                                                           "temperature": 0, "n": n})
        assert r.status_code == 200, r.text
        assert [c["text"] for c in r.json()["choices"]] == [rt.generate(PROMPT, max_new_tokens=12).text] * n


def test_followers_start_from_the_leaders_prefill(tiny_server):
    rt = tiny_server.engine.rt
    sched = Scheduler(rt)
    ids = rt.encode("class Stack:\n    def push(self, x):")
    got: dict[int, list] = {}

    def sink(i):
        return lambda d: got.setdefault(i, []).append(d)

    opts = GenerationOptions(max_new_tokens=8, temperature=0.8, seed=1, policy="off")
    lead = sched.submit(Request(ids, opts), sink(0))
    for i in (1, 2, 3):
        sched.submit(Request(ids, opts.but(seed=1 + i)), sink(i), after=lead)
    sched.step()  # admits the leader alone: the followers wait for its prompt
    assert len(sched.running) == 1 and len(sched.waiting) == 3
    for _ in range(200):
        if all(i in got and got[i][-1].finish is not None for i in range(4)):
            break
        sched.step()
    for i in range(4):
        assert not isinstance(got[i][-1], Exception)
        want = rt.generate(ids, opts.but(seed=1 + i))
        assert [t for d in got[i] for t in d.tokens] == want.tokens
        # the leader prefilled; each follower started from its state in the prefix cache
        assert got[i][-1].cached_tokens == (0 if i == 0 else len(ids) - 1)


def test_n_past_the_limit_is_refused(tiny_server):
    from turbo.serve.protocol import MAX_N

    resp = tiny_server.http.post("/v1/completions", json={"model": tiny_server.engine.model, "prompt": PROMPT,
                                                           "max_tokens": 2, "n": MAX_N + 1})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "n"
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError, match="best_of"):
        tiny_server.client.completions.create(model=tiny_server.engine.model, prompt=PROMPT, max_tokens=2, best_of=3)


def test_runtime_choices_prefill_once_and_equal_each_alone(tiny_server, monkeypatch):
    """Runtime.choices: the prompt through the trunk once, choice i that of seed + i alone, every
    drafter and rollback; greedy choices are one."""
    rt = tiny_server.engine.rt
    prefilled, prefill = [], rt.trunk.prefill
    monkeypatch.setattr(rt.trunk, "prefill", lambda st, ids, *a, **k: prefilled.append(len(ids)) or prefill(
        st, ids, *a, **k))
    for spec in (dict(policy="off"), dict(policy="fixed", block=3, drafter="dflash", rollback="replay"),
                 dict(policy="fixed", block=5, drafter="mtp", rollback="checkpoint")):
        prefilled.clear()
        got = rt.choices(PROMPT, 4, max_new_tokens=16, temperature=0.9, seed=7, **spec)
        assert len(prefilled) == 1  # one prefill for the four
        alone = [rt.generate(PROMPT, max_new_tokens=16, temperature=0.9, seed=7 + i, **spec) for i in range(4)]
        assert [c.tokens for c in got] == [a.tokens for a in alone] and len({tuple(a.tokens) for a in alone}) > 1
    greedy = rt.choices(PROMPT, 3, max_new_tokens=12, policy="fixed", block=4)
    assert all(c.tokens == rt.generate(PROMPT, max_new_tokens=12).tokens for c in greedy)


@pytest.mark.parametrize("n", [0, 17, True, "2", 2.0])
def test_n_out_of_range_is_refused_naming_it(tiny_server, n):
    with pytest.raises(TurboError) as e:
        tiny_server.engine.rt.choices(PROMPT, n, max_new_tokens=4)
    assert e.value.field == "n"


def test_the_command_line_writes_n_choices(tmp_path):
    cmd = [sys.executable, "-m", "turbo", "threads=1", "max_new_tokens=6", "temperature=0.8", "seed=3"]
    run = subprocess.run(cmd + ["n=3"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert run.returncode == 0, run.stderr
    assert re.findall(r"^\[choice (\d)\]$", run.stdout, re.M) == ["0", "1", "2"]
    assert re.findall(r"^\[choice \d\] \[stats\].* seed (\d+)", run.stderr, re.M) == ["3", "4", "5"]
    bad = subprocess.run(cmd + ["n=17"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.count("\n") == 1 and "n is 17" in bad.stderr
