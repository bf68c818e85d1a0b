"""Sampling at its edges (issue #33): a temperature down to the smallest positive float is the
argmax, a seed outside 64 bits is refused in one line, and a seed repeats adaptive's text whatever
the clock says (under sampling adaptive chooses its blocks from counts)."""

from __future__ import annotations

import itertools

import pytest
import torch

import turbo
from turbo import TurboError
from turbo.sequence.sampling import SamplingParams, probabilities

PROMPT = "def f(x):"


@pytest.fixture(scope="module")
def rt(spec_install):
    return turbo.open(spec_install[1], backend="cpu")


@pytest.mark.parametrize("temperature", [5e-324, 1e-40, 1e-38, 1e-21])
def test_a_tiny_temperature_is_the_argmax(temperature):
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)) * 20
    p = probabilities(logits, SamplingParams(temperature, top_k=5, top_p=0.9, min_p=0.1))
    assert torch.isfinite(p).all()
    assert torch.equal(p, torch.nn.functional.one_hot(logits.argmax(-1), 300).float())


@pytest.mark.parametrize("policy", [dict(policy="off"), dict(policy="fixed", block=3)])
def test_a_tiny_temperature_generates_the_greedy_text(rt, policy):
    greedy = rt.generate(PROMPT, max_new_tokens=16, policy="off").tokens
    assert rt.generate(PROMPT, max_new_tokens=16, temperature=1e-40, seed=1, **policy).tokens == greedy


@pytest.mark.parametrize("seed", [2**64, -1, 10**30])
def test_a_seed_outside_64_bits_is_refused_in_one_line(rt, seed):
    with pytest.raises(TurboError, match=rf"^seed is {seed}, expected a non-negative integer or null "
                                         r"\(a fresh seed\), below 2\*\*64$"):
        rt.generate(PROMPT, max_new_tokens=2, temperature=0.7, seed=seed)


def test_the_largest_seed_works(rt):
    a = rt.generate(PROMPT, max_new_tokens=8, temperature=0.7, seed=2**64 - 1)
    assert a.stats.seed == 2**64 - 1 and a.tokens == rt.generate(PROMPT, max_new_tokens=8, temperature=0.7,
                                                                 seed=2**64 - 1).tokens


def clock(step: float):
    """A perf_counter whose seconds grow by `step` times a repeating pattern: a machine of its own."""
    ticks = itertools.accumulate(itertools.cycle([step, 3 * step, step / 7, 11 * step]))
    return lambda: next(ticks)


def test_a_seed_repeats_adaptive_whatever_the_clock(rt, monkeypatch):
    texts = []
    for step in (1e-4, 0.5, 7.0):
        monkeypatch.setattr("turbo.sequence.driver.time.perf_counter", clock(step))  # (the time module: every clock)
        res = rt.generate(PROMPT, max_new_tokens=40, policy="adaptive", block=4, temperature=0.7, seed=123)
        texts.append(res.tokens)
    assert texts[0] == texts[1] == texts[2]
    monkeypatch.undo()
    assert rt.generate(PROMPT, max_new_tokens=40, policy="adaptive", block=4, temperature=0.7,
                       seed=123).tokens == texts[0]
