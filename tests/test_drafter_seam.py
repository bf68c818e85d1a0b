"""A drafter object's output is checked at the seam (issue #33): what is not a list of ids in the
vocabulary, a q that is not a distribution, a drafter's own exception, a drafter calling the
runtime back and a stream iterated from two threads are each a TurboError naming what went wrong."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import turbo
from turbo import TurboError
from turbo.drafters import DrafterBase

PROMPT = "def f(x):"
VOCAB = 320
HEAD = r"^drafter Mine \(kind 'mine'\): "


@pytest.fixture(scope="module")
def rt(spec_install):
    return turbo.open(spec_install[1], backend="cpu")


class Mine(DrafterBase):
    """Proposes what `make()` returns; under sampling q is `q` (a callable of the proposals)."""

    kind = "mine"

    def __init__(self, make=lambda: [1, 2, 3], q=None):
        self.make, self.q = make, q

    def propose(self, anchor, anchor_pos, block):
        return self.make()

    def propose_sampled(self, anchor, anchor_pos, block, sampler):
        proposals = self.propose(anchor, anchor_pos, block)
        return proposals, self.q(proposals) if self.q is not None else None


def run(rt, drafter, **kw):
    return rt.generate(PROMPT, max_new_tokens=6, policy="fixed", block=3, drafter=drafter, **kw)


@pytest.mark.parametrize("make", [
    lambda: [1.5], lambda: None, lambda: "ab", lambda: (1, 2), lambda: (i for i in [1, 2]),
    lambda: np.array([1, 2]), lambda: torch.tensor([1, 2]), lambda: [-1], lambda: [True], lambda: [VOCAB],
    lambda: [1, 2, 3, 4], lambda: [None], lambda: ["1"],
], ids=["float", "None", "str", "tuple", "generator", "numpy", "tensor", "negative", "bool", "past-vocab",
        "too-many", "None-id", "str-id"])
@pytest.mark.parametrize("sampled", [{}, dict(temperature=0.8, seed=1)], ids=["greedy", "sampled"])
def test_what_is_not_a_list_of_ids_is_refused_naming_the_drafter(rt, make, sampled):
    with pytest.raises(TurboError, match=HEAD + r"propose(_sampled)? returned (proposals )?.*, expected a list "
                                              r"of at most 3 ints in 0\.\.319$"):
        run(rt, Mine(make), **sampled)


def test_numpy_integers_in_a_list_are_ids(rt):
    assert run(rt, Mine(lambda: [np.int64(1), np.int32(2)])).tokens == run(rt, Mine(lambda: [1, 2])).tokens


def one_hot(proposals, at=None):
    q = torch.zeros(len(proposals), VOCAB)
    q[torch.arange(len(proposals)), torch.tensor(proposals) if at is None else at] = 1.0
    return q


@pytest.mark.parametrize("q, what", [
    (lambda p: torch.zeros(len(p), VOCAB), r"a q with row 0 summing to 0, not 1"),
    (lambda p: torch.full((len(p), VOCAB), float("nan")), r"a q with values that are not finite"),
    (lambda p: one_hot(p) * 2 - one_hot(p, 7), r"a q with negative values"),
    (lambda p: one_hot(p) * 1.01, r"a q with row 0 summing to 1.01, not 1"),
    (lambda p: one_hot(p, 7), r"a q with zero at the proposal of row 0"),
    (lambda p: torch.ones(2, 5) / 5, r"q a tensor of shape \[2, 5\] \(torch.float32\), expected a float "
                                     r"tensor of shape \[3, 320\] or None"),
    (lambda p: [[1.0]], r"q \[\[1.0\]\], expected a float tensor of shape \[3, 320\] or None"),
])
def test_a_q_that_is_not_a_distribution_is_refused(rt, q, what):
    with pytest.raises(TurboError, match=HEAD + r"propose_sampled returned " + what):
        run(rt, Mine(q=q), temperature=0.8, seed=1)


def test_a_valid_q_is_used(rt):
    assert len(run(rt, Mine(q=one_hot), temperature=0.8, seed=1).tokens) == 6


def test_propose_sampled_must_return_a_pair(rt):
    class Single(Mine):
        def propose_sampled(self, anchor, anchor_pos, block, sampler):
            return [1, 2]
    with pytest.raises(TurboError, match=r"^drafter Single \(kind 'mine'\): propose_sampled returned \[1, 2\], "
                                         r"expected a tuple \(proposals, q\)$"):
        run(rt, Single(), temperature=0.8, seed=1)


def test_a_drafters_own_exception_is_wrapped_with_its_name(rt):
    def boom():
        raise KeyError("x")
    with pytest.raises(TurboError, match=HEAD + r"propose raised KeyError: 'x'$") as e:
        run(rt, Mine(boom))
    assert isinstance(e.value.__cause__, KeyError)


@pytest.mark.parametrize("field, value, message", [
    ("kind", None, r"kind is None, expected a non-empty str"),
    ("aux_layers", None, r"aux_layers is None, expected a tuple of trunk layers in 0\.\.3"),
    ("aux_layers", (9,), r"aux_layers is \(9,\), expected a tuple of trunk layers in 0\.\.3"),
    ("window", 0, r"window is 0, expected a positive integer or None"),
])
def test_bad_attributes_are_refused_at_the_streams_start(rt, field, value, message):
    d = Mine()
    setattr(d, field, value)
    with pytest.raises(TurboError, match=r"^drafter Mine.*: " + message + "$"):
        rt.stream(PROMPT, max_new_tokens=4, policy="fixed", block=3, drafter=d)


def in_thread(f, timeout=60):
    """f() on a thread; its exception, or a failure when it hangs."""
    box = []

    def body():
        try:
            f()
        except BaseException as e:  # noqa: BLE001  (handed back to the test)
            box.append(e)
    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "deadlocked"
    return box[0] if box else None


def test_a_drafter_calling_the_runtime_back_is_refused_not_deadlocked(rt):
    class Reenters(Mine):
        def propose(self, anchor, anchor_pos, block):
            rt.generate(PROMPT, max_new_tokens=2)
            return [1]
    err = in_thread(lambda: run(rt, Reenters()))
    assert isinstance(err, TurboError) and str(err).startswith("a generation was started on this runtime from "
                                                               "inside its own round")
    assert len(rt.generate(PROMPT, max_new_tokens=4).tokens) == 4  # the runtime is free again


def test_one_stream_from_two_threads_is_a_turbo_error(rt):
    entered, release = threading.Event(), threading.Event()

    class Waits(Mine):
        def propose(self, anchor, anchor_pos, block):
            entered.set()
            release.wait(30)
            return [1]
    events = rt.stream(PROMPT, max_new_tokens=4, policy="fixed", block=3, drafter=Waits())
    first = threading.Thread(target=lambda: next(events), daemon=True)
    first.start()
    assert entered.wait(30)
    with pytest.raises(TurboError, match="^this stream is being iterated on another thread already"):
        next(events)
    release.set()
    first.join(30)
    assert sum(len(e.tokens) for e in events) > 0  # the first thread's stream goes on
