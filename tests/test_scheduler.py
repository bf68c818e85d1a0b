"""The continuous-batching scheduler (turbo/serve/scheduler.py): every request's tokens equal its
solo run whatever runs beside it, the prefix cache is exact, admission keeps to its bounds."""

from __future__ import annotations

import pytest

import turbo
from turbo.errors import TurboError
from turbo.sequence.options import GenerationOptions as G
from turbo.serve.costs import StepCosts, sequence_bytes
from turbo.serve.scheduler import Overloaded, Request, Scheduler, ServeLimits
from turbo.testing.checks import Collect

MIXES = [dict(policy="off"), dict(policy="fixed", block=4, drafter="dflash"),
         dict(policy="fixed", block=3, drafter="mtp", rollback="replay"), dict(policy="fixed", block=8, drafter="ngram"),
         dict(policy="adaptive", block=8), dict(policy="fixed", block=1, drafter="dflash", rollback="replay"),
         dict(temperature=0.8, seed=7, policy="fixed", block=4), dict(temperature=1.0, top_p=0.9, seed=3, drafter="mtp",
                                                                     policy="fixed", block=2)]


@pytest.fixture(scope="module")
def tiny():
    return turbo.open("tiny", threads=1)


def drain(sched: Scheduler, sinks: list[Collect], limit: int = 5000) -> int:
    steps = 0
    while not all(s.done for s in sinks):
        sched.step()
        steps += 1
        assert steps < limit
    return steps


def prompt_of(tiny, n: int, seed: int) -> list[int]:
    text = tiny.decode(list(range(200, 4000, 7)))
    ids = tiny.encode(text * 3)
    return ids[seed:seed + n]


def test_each_request_equals_its_solo_run(tiny):
    """16+ concurrent mixed requests (prompt lengths 1..1500, blocks 0..8, every drafter, greedy and
    seeded sampling), admitted while others run, prefilled in chunks: each equal to its solo run."""
    lengths = [1, 2, 5, 17, 64, 129, 300, 700, 3, 40, 257, 90, 11, 1500, 8, 33, 150, 1]
    reqs = [Request(prompt_of(tiny, n, i * 13), G(max_new_tokens=24, **MIXES[i % len(MIXES)]))
            for i, n in enumerate(lengths)]
    solo = [tiny.generate(r.ids, r.options).tokens for r in reqs]
    sched = Scheduler(tiny, ServeLimits(max_running=12, prefill_chunk=96))
    sinks = [Collect() for _ in reqs]
    for r, s in zip(reqs[:6], sinks):
        sched.submit(r, s)
    for _ in range(5):
        sched.step()
    for r, s in zip(reqs[6:], sinks[6:]):
        sched.submit(r, s)
    drain(sched, sinks)
    for i, s in enumerate(sinks):
        assert s.error is None
        assert s.tokens == solo[i], (i, reqs[i].options)
        assert s.deltas[-1].stats.generated_tokens == len(solo[i])


def test_a_long_prompt_does_not_stall_running_streams(tiny):
    sched = Scheduler(tiny, ServeLimits(prefill_chunk=64))
    short, long_ = Collect(), Collect()
    sched.submit(Request(tiny.encode("def fib(n):"), G(max_new_tokens=15, policy="off")), short)
    sched.step()
    sched.submit(Request(prompt_of(tiny, 1200, 0), G(max_new_tokens=4, policy="off")), long_)
    assert drain(sched, [short]) == 15  # (its first step was its prompt) a token every step ...
    assert not long_.deltas  # ... while the long prompt prefills (1200 rows, 64 a step)
    drain(sched, [long_])


def test_the_prefix_cache_is_exact_over_a_replayed_chat(tiny):
    """A chat replayed as independent requests (each resending the whole conversation): every
    turn's tokens equal a cold run, and it reports the prompt tokens the cache held."""
    sched = Scheduler(tiny, ServeLimits())
    conversation = tiny.encode("Q: What does os.path.join do?\nA:")
    # a client keeps its drafter (a cached state serves a drafter whose context it kept, or none)
    for turn, opts in enumerate([dict(policy="fixed", block=4, drafter="dflash"), dict(policy="off"),
                                 dict(policy="fixed", block=2, drafter="dflash", rollback="replay"),
                                 dict(temperature=0.7, seed=5, drafter="dflash"), dict(policy="adaptive", block=8)]):
        o = G(max_new_tokens=20, **opts)
        cold = tiny.generate(conversation, o).tokens
        sink = Collect()
        sched.submit(Request(list(conversation), o), sink)
        drain(sched, [sink])
        assert sink.tokens == cold, turn
        if turn:
            assert sink.deltas[-1].cached_tokens > 0
        conversation = conversation + sink.tokens + tiny.encode(f"\nQ: and then {turn}?\nA:")
    assert sched.cache.nbytes <= sched.cache.budget


def test_queue_bound_memory_budget_and_cancel(tiny):
    ids = tiny.encode("import os\n")
    small = Scheduler(tiny, ServeLimits(max_running=2, max_waiting=2, memory_gb=1.0))
    sinks = [Collect() for _ in range(4)]
    for s in sinks[:2]:
        small.submit(Request(ids, G(max_new_tokens=8, policy="off")), s)
    with pytest.raises(Overloaded):  # 2 waiting already: the queue's bound
        small.submit(Request(ids, G(max_new_tokens=8)), Collect())
    small.step()  # both admitted: the queue has room again
    for s in sinks[2:]:
        small.submit(Request(ids, G(max_new_tokens=8, policy="off")), s)
    assert small.gauges().running == 2 and small.gauges().waiting == 2
    with pytest.raises(TurboError, match="max_tokens"):  # more state than the whole budget
        Scheduler(tiny, ServeLimits(memory_gb=1e-6)).submit(Request(ids, G(max_new_tokens=8)), Collect())
    drain(small, sinks)
    assert all(s.tokens == tiny.generate(ids, G(max_new_tokens=8, policy="off")).tokens for s in sinks)
    # a budget one sequence's state fits in (1.5 of its need): the second waits for the first
    need = sequence_bytes(tiny.trunk, len(ids) + 8 + 1, 0)
    tight = Scheduler(tiny, ServeLimits(memory_gb=1.5 * need / 2**30))
    pair = [Collect(), Collect()]
    for s in pair:
        tight.submit(Request(ids, G(max_new_tokens=8, policy="off")), s)
    tight.step()
    assert tight.gauges().running == 1 and tight.gauges().waiting == 1
    drain(tight, pair)
    assert pair[0].tokens == pair[1].tokens == sinks[0].tokens
    gone = Collect()
    ticket = small.submit(Request(ids, G(max_new_tokens=200, policy="off")), gone)
    small.step()
    small.step()
    ticket.cancel()
    small.step()
    assert small.gauges().running == 0 and small.gauges().reserved_bytes == 0
    assert not gone.done  # freed without a last delta: the client is gone


def test_logprobs_are_the_trunks(tiny):
    import torch

    ids = tiny.encode("def add(a, b):")
    sink = Collect()
    sched = Scheduler(tiny)
    sched.submit(Request(ids, G(max_new_tokens=6, policy="fixed", block=4, drafter="ngram"), logprobs=3), sink)
    drain(sched, [sink])
    lps = [lp for d in sink.deltas for lp in d.logprobs]
    assert [lp.token for lp in lps] == sink.tokens
    st = tiny.trunk.new_state(64)
    logits = tiny.trunk.prefill(st, ids, want_logits=True).logits[-1]
    first = torch.log_softmax(logits.float(), -1)
    assert abs(lps[0].logprob - float(first[sink.tokens[0]])) < 1e-4
    assert lps[0].top[0][0] == sink.tokens[0] and len(lps[0].top) == 3  # greedy: the most likely


def test_a_rounds_cost_in_a_batch_is_its_share_of_the_fixed_part_plus_its_rows():
    """The adaptive policy's clock under a batch: steps of a + b * rows seconds (here 50 ms to
    read the weights, 1 ms a row): alone, 8 proposals cost a verify 8 ms over a plain step's 51;
    among 16 sequences each row costs its 1 ms and the fixed part is shared."""
    costs = StepCosts()
    for rows in (1, 5, 9, 16, 40, 80, 3, 20, 60, 144):
        costs.add(rows, 0.050 + 0.001 * rows)
    assert costs.share(1, 1, 1, 0.051) == pytest.approx(0.051)
    assert costs.share(9, 9, 1, 0.059) == pytest.approx(0.059)
    assert costs.share(9, 144, 16, 0.194) == pytest.approx(0.050 / 16 + 0.009)
    assert costs.share(1, 16, 16, 0.066) == pytest.approx(0.050 / 16 + 0.001)
    fresh = StepCosts()  # too few steps to fit: the rows' share of the step
    assert fresh.share(3, 12, 4, 0.060) == pytest.approx(0.015)
