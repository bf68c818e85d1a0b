"""Penalties and logit_bias (turbo/sequence/penalties.py): applied at every committed position, so greedy
speculation is plain greedy decode token for token and the output equals a plain torch loop over
transformers' logits; sampled speculation keeps the penalised distribution (tests/test_sampling.py);
bad values are refused naming the field, in Python, on the command line and by the server."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest
import torch

import turbo
from turbo.drafters.ngram import NgramDrafter
from turbo.errors import TurboError
from turbo.sequence.penalties import Penalties, PenaltyState

PROMPT = "def fib(n):"
SETTINGS = [dict(repetition_penalty=1.3), dict(frequency_penalty=1.2), dict(presence_penalty=1.5),
            dict(logit_bias={309: -100, 15: 5.0}),
            dict(repetition_penalty=0.8, frequency_penalty=-0.5, presence_penalty=0.7, logit_bias={"267": 3})]
# blocks 1..8, every drafter (the install's DFlash2 and MTP head, the n-gram matcher, a caller's own
# object), both rollbacks
SPECULATION = [dict(policy="fixed", block=b, drafter=d, rollback=rb)
               for b, d, rb in [(1, "dflash", "replay"), (2, "mtp", "replay"), (3, "mtp", "checkpoint"),
                                (4, "dflash", "checkpoint"), (5, "ngram", "replay"), (6, "dflash", "replay"),
                                (7, NgramDrafter(), "checkpoint"), (8, "ngram", "checkpoint"), (8, "mtp", "replay")]]


def reference_row(row: torch.Tensor, prompt: list[int], output: list[int], p: Penalties) -> torch.Tensor:
    """One position's processing written out plainly: the definitions of turbo/sequence/penalties.py."""
    row = row.clone()
    for t in set(prompt) | set(output):
        row[t] = row[t] * p.repetition if row[t] < 0 else row[t] / p.repetition
    for t, n in Counter(output).items():
        row[t] -= p.frequency * n + p.presence
    for t, b in p.bias:
        row[t] += b
    return row


def test_a_verify_row_is_processed_after_the_proposals_before_it():
    p = Penalties(1.4, 0.6, 0.9, ((2, -3.0), (7, 1.5)))
    prompt, committed, proposals = [1, 2, 3], [4, 4, 5], [5, 6, 4]
    state = PenaltyState(p, prompt)
    state.commit(committed)
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(0))
    rows = state.rows(logits, proposals)
    for i in range(4):
        want = reference_row(logits[i], prompt, committed + proposals[:i], p)
        assert torch.allclose(rows[i], want), i
        if i:  # the row after a proposal is not the row without it (the check has teeth)
            assert not torch.allclose(rows[i], reference_row(logits[i], prompt, committed, p)), i
    assert torch.equal(logits, torch.randn(4, 10, generator=torch.Generator().manual_seed(0)))  # left as it was


@pytest.fixture(scope="module")
def tiny():
    return turbo.open("tiny", threads=1)


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "+".join(s))
def test_greedy_speculation_with_penalties_is_plain_greedy_decode(tiny, setting):
    plain = tiny.generate(PROMPT, max_new_tokens=24, policy="off", stop_at_eos=False, **setting).tokens
    assert plain != tiny.generate(PROMPT, max_new_tokens=24, policy="off", stop_at_eos=False).tokens
    for spec in SPECULATION:
        res = tiny.generate(PROMPT, max_new_tokens=24, stop_at_eos=False, **spec, **setting)
        assert res.tokens == plain, spec
        assert res.stats.drafted > 0 or spec["drafter"] == "ngram" or not isinstance(spec["drafter"], str)  # (n-grams: only where the text repeats)


def test_rows_processed_with_the_wrong_state_break_greedy_equality(tiny, monkeypatch):
    """The negative control: every row processed after the committed tokens alone (ignoring the
    proposals before it) commits other tokens than plain decode on some configuration."""
    setting = dict(frequency_penalty=2.0, presence_penalty=2.0)
    plain = tiny.generate(PROMPT, max_new_tokens=24, policy="off", stop_at_eos=False, **setting).tokens
    right = PenaltyState.rows
    monkeypatch.setattr(PenaltyState, "rows", lambda self, logits, proposals: right(self, logits, []))
    assert any(tiny.generate(PROMPT, max_new_tokens=24, stop_at_eos=False, **spec, **setting).tokens != plain
               for spec in SPECULATION)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A random Qwen3.5 trunk in transformers, and the same repacked with a random DFlash2 drafter."""
    from turbo.testing import make_spec_install

    model, path = make_spec_install(tmp_path_factory.mktemp("penalties"), seed=5)
    return model.float().eval(), turbo.open(path, backend="cpu")


def test_penalised_greedy_equals_a_torch_loop_over_transformers_logits(small):
    from transformers import RepetitionPenaltyLogitsProcessor

    model, rt = small
    p = Penalties(1.25, 0.4, 0.6, ((17, -100.0), (40, 2.5)))
    prompt, out = [5, 9, 17, 23, 9, 40, 41], []
    with torch.no_grad():
        for _ in range(20):
            ids = torch.tensor([prompt + out])
            logits = RepetitionPenaltyLogitsProcessor(p.repetition)(ids, model(ids).logits[:, -1].float())[0]
            for t, n in Counter(out).items():
                logits[t] -= p.frequency * n + p.presence
            for t, b in p.bias:
                logits[t] += b
            out.append(int(logits.argmax()))
    fields = dict(repetition_penalty=p.repetition, frequency_penalty=p.frequency, presence_penalty=p.presence,
                  logit_bias=dict(p.bias), max_new_tokens=20, stop_at_eos=False)
    assert 17 not in out and rt.generate(prompt, policy="off", **fields).tokens == out
    for block in (2, 4, 8):
        assert rt.generate(prompt, policy="fixed", block=block, drafter="dflash", **fields).tokens == out, block


@pytest.mark.parametrize("field, value, says", [
    ("repetition_penalty", 0, "repetition_penalty is 0, expected a finite number > 0"),
    ("frequency_penalty", 2.5, "frequency_penalty is 2.5, expected a number in [-2, 2]"),
    ("presence_penalty", "1", "presence_penalty is '1', expected a number in [-2, 2]"),
    ("logit_bias", {5: 101}, "logit_bias is {5: 101}, expected a map of token ids to biases in [-100, 100]"),
    ("logit_bias", {"x": 1}, "logit_bias is {'x': 1}, expected a map"),
])
def test_bad_values_are_refused_naming_the_field(tiny, field, value, says):
    with pytest.raises(TurboError) as e:
        tiny.generate(PROMPT, max_new_tokens=2, **{field: value})
    assert says in str(e.value) and e.value.field == field


def test_a_bias_past_the_vocabulary_is_refused(tiny):
    vocab = tiny.install.arch.vocab
    with pytest.raises(TurboError) as e:
        tiny.generate(PROMPT, max_new_tokens=2, logit_bias={vocab: -1})
    assert str(e.value) == f"logit_bias: {vocab} is not an id in 0..{vocab - 1}" and e.value.field == "logit_bias"


def test_the_command_line_takes_them_and_refuses_in_one_line(tiny, tmp_path):
    def run(*overrides):
        return subprocess.run([sys.executable, "-m", "turbo", "+policy=fixed", "block=3", "max_new_tokens=12",
                               "threads=1", *overrides], capture_output=True, text=True, cwd=tmp_path, timeout=300)

    ok = run("repetition_penalty=1.3", "+logit_bias={267: 4}")
    assert ok.returncode == 0, ok.stderr
    want = tiny.generate(_default_prompt(), policy="off", max_new_tokens=12, repetition_penalty=1.3,
                         logit_bias={267: 4})
    assert ok.stdout == want.text  # (stdout: the continuation alone)
    bad = run("presence_penalty=9")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "presence_penalty is 9" in bad.stderr


def _default_prompt() -> str:
    from turbo.__main__ import composed
    from turbo.config import run_config

    return run_config(composed([])[0]).prompt


def test_the_server_takes_them_and_answers_400_naming_the_field(tiny, tiny_server):
    engine, http, client = tiny_server.engine, tiny_server.http, tiny_server.client
    fields = dict(frequency_penalty=1.2, presence_penalty=0.5, logit_bias={"309": -100})
    r = client.completions.create(model=engine.model, prompt=PROMPT, max_tokens=16, temperature=0,
                                  extra_body={"repetition_penalty": 1.1, "turbo": {"policy": "fixed", "block": 4}},
                                  **fields)
    want = tiny.generate(PROMPT, max_new_tokens=16, policy="off", repetition_penalty=1.1,
                         **{**fields, "logit_bias": {309: -100}})
    assert r.choices[0].text == want.text
    for body, param in [({"presence_penalty": 3}, "presence_penalty"), ({"logit_bias": {"5": 500}}, "logit_bias"),
                        ({"logit_bias": {"999999": 1}}, "logit_bias"), ({"repetition_penalty": -1},
                                                                        "repetition_penalty"),
                        ({"n": 17}, "n"), ({"best_of": 3}, "best_of")]:
        resp = http.post("/v1/completions", json={"model": engine.model, "prompt": PROMPT, "max_tokens": 4, **body})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, (body, resp.json())
    assert client.completions.create(model=engine.model, prompt=PROMPT, max_tokens=16, temperature=0,
                                     extra_body={"repetition_penalty": 1.1}, **fields).choices[0].text == want.text


def test_the_openai_client_forces_and_bans_a_token_with_logit_bias(tiny, tiny_server):
    """+100 forces the token at every position; -100 keeps the greedy answer's first token out."""
    engine, client = tiny_server.engine, tiny_server.client
    forced = tiny.encode(" fib")[-1]
    r = client.completions.create(model=engine.model, prompt=PROMPT, max_tokens=6, temperature=0,
                                  logit_bias={str(forced): 100}, logprobs=0)
    assert r.choices[0].text == tiny.decode([forced] * 6)
    first = tiny.generate(PROMPT, max_new_tokens=1, policy="off").tokens[0]
    banned = client.completions.create(model=engine.model, prompt=PROMPT, max_tokens=6, temperature=0,
                                       logit_bias={str(first): -100}, extra_body={"turbo": {"policy": "fixed",
                                                                                          "block": 4}})
    want = tiny.generate(PROMPT, max_new_tokens=6, policy="off", logit_bias={first: -100})
    assert banned.choices[0].text == want.text and want.tokens[0] != first and first not in want.tokens
