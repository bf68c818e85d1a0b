"""The whole engine with backend=cuda on the simulated device (TURBO_CUDA_SIM=1, issue #55): the
trunk's step is the CUDA step of its own (turbo/backends/cuda_step) running its kernels' CUDA C
built for the host (turbo/backends/cuda_sim); the drafters and sampling run on the host. On the
shipped install `tiny`:

- plain greedy decode equals the CPU backend's tokens (the products sum in another order and the
  K/V is fp32 here, bf16 on the CPU: where a near-tie flips a token, the test shows both logits and
  asserts the flip is a near tie);
- lossless on its own numerics: speculation (blocks 1..8, both rollbacks, the dflash / mtp / ngram
  drafters) commits exactly its plain decode; seeded sampling, speculative or not, its plain seeded run;
- a server batch of 4 (turbo/serve/scheduler.py in process): each answer its request's alone;
- a session's second turn goes on from its kept state and commits a fresh generation's tokens.

Generation lengths are small: every launch runs as host fibers (tiny's 64 greedy tokens take
~12 s: `TURBO_CUDA_SIM=1 python -m turbo backend=cuda install=tiny policy=off max_new_tokens=64 ...`)."""

from __future__ import annotations

import shutil

import pytest
import torch

import turbo
from turbo.backends import cuda_sim
from turbo.backends.cuda import cuda_unavailable_reason
from turbo.backends.cuda_step.step import CudaTrunkStep
from turbo.sequence.options import GenerationOptions as G
from turbo.serve.scheduler import Request, Scheduler, ServeLimits
from turbo.testing.checks import Collect

torch.set_num_threads(1)

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the simulated device builds its kernels with g++")

PROMPTS = ["def fibonacci(n):\n    ", "The history of the city begins"]
NEW = 12
SPEC_NEW = 4
# blocks 1..8 over the three drafters, each block once (every launch runs as host fibers: CI-sized)
BLOCKS = {"dflash": (1, 4, 7), "mtp": (2, 5, 8), "ngram": (3, 6)}
ROLLBACKS = ("checkpoint", "replay")
NEAR_TIE = 1e-3  # |logit difference| of the two tokens a flip swaps, at most (fp32 sums in another order)


@pytest.fixture(scope="module")
def sim():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(cuda_sim.ENV, "1")
        yield


@pytest.fixture(scope="module")
def cuda(sim):
    return turbo.open("tiny", backend="cuda", threads=1)


@pytest.fixture(scope="module")
def cpu():
    return turbo.open("tiny", backend="cpu", threads=1)


def plain(rt, prompt, new: int = NEW, **kw) -> list[int]:
    return rt.generate(prompt, max_new_tokens=new, policy="off", stop_at_eos=False, **kw).tokens


def test_the_sim_is_a_cuda_device_without_torch_cuda(sim):
    assert cuda_unavailable_reason() is None
    assert not torch.cuda.is_available()  # (the CI host: the step allocates through the driver API only)


def test_backend_cuda_runs_the_cuda_step_on_the_sim(cuda):
    assert cuda.backend.name == "cuda" and cuda.trunk.step_name == "cuda"
    assert isinstance(cuda.trunk.stepper, CudaTrunkStep) and cuda.trunk.stepper.dev._dev.simulated
    cuda_sim.reset_records()
    out = cuda.generate(PROMPTS[0], max_new_tokens=2, policy="off", stop_at_eos=False)
    assert out.stats.backend == "cuda"
    names = {r.name for r in cuda_sim.records()}
    assert {"gdn_step_ind_f32", "attn_rows_ind_f32", "embed_rows_bf16_f32"} <= names


def _flip_is_near_tie(cuda, cpu, prompt, got: list[int], want: list[int]) -> None:
    """At the first differing token, both backends' logits of the two tokens (the prefix they share
    decoded again): the flip must be a near tie on each side."""
    i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    ids = cpu.encode(prompt) + want[:i]
    rows = {}
    for name, rt in (("cuda", cuda), ("cpu", cpu)):
        st = rt.trunk.new_state(len(ids) + 1)
        lg = rt.trunk.prefill(st, ids).logits[-1]
        rows[name] = (float(lg[got[i]]), float(lg[want[i]]))
    shown = f"token {i}: cuda {got[i]} vs cpu {want[i]}; logits (cuda-token, cpu-token): {rows}"
    print(shown)
    assert all(abs(a - b) <= NEAR_TIE for a, b in rows.values()), shown


def test_plain_greedy_decode_equals_the_cpu_backends_tokens(cuda, cpu):
    for prompt in PROMPTS:
        got, want = plain(cuda, prompt, NEW), plain(cpu, prompt, NEW)
        if got != want:
            _flip_is_near_tie(cuda, cpu, prompt, got, want)


@pytest.mark.parametrize("drafter", list(BLOCKS))
def test_speculation_equals_its_own_plain_decode(cuda, drafter):
    """Blocks 1..8 over the three drafters (BLOCKS), the two rollbacks taking turns: each run commits
    its plain decode's tokens."""
    prompt = PROMPTS[0]
    want = plain(cuda, prompt, SPEC_NEW)
    for block in BLOCKS[drafter]:
        rollback = ROLLBACKS[block % 2]
        out = cuda.generate(prompt, max_new_tokens=SPEC_NEW, policy="fixed", block=block, drafter=drafter,
                            rollback=rollback, stop_at_eos=False)
        assert out.stats.block == block
        assert out.tokens == want, (drafter, rollback, block)


def test_seeded_sampling_equals_its_own_plain_seeded_run(cuda, cpu):
    """A seed repeats a run, plain or speculative (speculative sampling keeps the distribution, not
    the draws: each config against itself); the plain seeded run draws the CPU backend's tokens."""
    prompt = PROMPTS[1]
    sampled = dict(temperature=0.9, top_p=0.95, seed=5)
    want = plain(cuda, prompt, SPEC_NEW, **sampled)
    assert want == plain(cuda, prompt, SPEC_NEW, **sampled) == plain(cpu, prompt, SPEC_NEW, **sampled)
    runs = [cuda.generate(prompt, max_new_tokens=SPEC_NEW, policy="fixed", block=4, drafter="dflash",
                          stop_at_eos=False, **sampled) for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens and runs[0].stats.seed == 5


def test_a_server_batch_of_four_each_equal_its_request_alone(cuda):
    reqs = [Request(cuda.encode(p), G(max_new_tokens=4, stop_at_eos=False, **o)) for p, o in (
        (PROMPTS[0], dict(policy="off")), (PROMPTS[1], dict(policy="fixed", block=4, drafter="dflash")),
        ("import os\n", dict(policy="fixed", block=3, drafter="mtp", rollback="replay")),
        ("class Stack:", dict(temperature=0.8, seed=7, policy="fixed", block=2, drafter="ngram")))]
    solo = [cuda.generate(r.ids, r.options).tokens for r in reqs]
    sched = Scheduler(cuda, ServeLimits(max_running=4, prefill_chunk=16))
    sinks = [Collect() for _ in reqs]
    for r, s in zip(reqs, sinks):
        sched.submit(r, s)
    steps = 0
    while not all(s.done for s in sinks):
        sched.step()
        steps += 1
        assert steps < 500
    for i, s in enumerate(sinks):
        assert s.error is None
        assert s.tokens == solo[i], (i, reqs[i].options)
    # the prefix cache kept the prompts' states (their K/V mirrored to the host): a request again hits it
    again = Collect()
    sched.submit(reqs[0], again)
    while not again.done:
        sched.step()
    assert again.error is None and again.tokens == solo[0] and again.deltas[-1].cached_tokens > 0


def test_a_sessions_second_turn_goes_on_from_its_kept_state(cuda):
    s = cuda.session("You are terse.")
    opts = dict(max_new_tokens=4, policy="fixed", block=3, drafter="dflash")
    for text in ("def fib(n):", "Now in C."):
        tokens = [t for e in s.send(text, **opts) for t in e.tokens]
        prompt = s.template.render(s.history[:-1], add_generation_prompt=True, tools=s.tools, **s.template_kwargs)
        fresh = cuda.generate(cuda.tokenizer.encode(prompt).ids, stop_token_ids=s.stop_ids, **opts)
        assert tokens == fresh.tokens == s.last_turn.tokens
    assert s.last_turn.reused_tokens > 0 and s.last_turn.resumed_from != "fresh"
