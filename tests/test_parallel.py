"""One model over several processes (turbo/parallel, issue 56): the plan refused at open in one
line before any rank starts, and the pipeline (P=2, local gloo ranks) giving the single process's
greedy tokens bit for bit through every step kind the driver uses: chunked prefill, decode,
verify of a block (DFlash2 and n-gram drafters, blocks 1 / 4 / 8), both rollbacks, a session's
extend, a batch's step_many; and a rank that dies ends every process in one line."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import turbo
from turbo.errors import TurboError
from turbo.parallel import check_plan, stages
from turbo.parallel.plan import layer_bytes
from turbo.sequence.options import OpenOptions, Parallel
from turbo.store.install import open_install
from turbo.testing import make_moe_install

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "def fib(n):"


# ---- the plan: refused in one line, before any rank ----------------------------------------


def test_plans_the_model_cannot_take_are_refused_in_one_line(tmp_path):
    arch = open_install("tiny").arch  # 8 layers, 2 K/V heads, 2 GDN key heads, dense
    cases = {
        Parallel(pipeline=9): "parallel.pipeline=9: the model has only 8 layers",
        Parallel(tensor=3): "parallel.tensor=3 does not divide the model's 2 K/V heads",
        Parallel(experts=2): "parallel.experts=2: the model is dense",
    }
    for plan, said in cases.items():
        with pytest.raises(TurboError, match=said) as e:
            check_plan(arch, plan, {})
        assert "\n" not in str(e.value)
    with pytest.raises(TurboError, match="is 2 processes, but WORLD_SIZE is 3"):
        check_plan(arch, Parallel(pipeline=2), {"WORLD_SIZE": "3"})
    check_plan(arch, Parallel(pipeline=2), {"WORLD_SIZE": "2"})  # (torchrun's world agreeing)
    _, moe = make_moe_install(tmp_path, 0)
    moe_arch = open_install(moe).arch
    with pytest.raises(TurboError, match=f"more than the model's {moe_arch.num_experts} routed experts"):
        check_plan(moe_arch, Parallel(experts=moe_arch.num_experts + 1), {})
    for bad in (0, -1, "2", True, 1.5):
        with pytest.raises(TurboError, match="expected an integer in 1..4096"):
            OpenOptions(parallel={"pipeline": bad})
    with pytest.raises(TurboError, match="parallel.pipes is not one of pipeline, tensor, experts"):
        OpenOptions(parallel={"pipes": 2})


def test_the_cli_refuses_a_plan_in_one_line_without_starting_ranks(tmp_path):
    started = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "turbo", "prompt=hi", "max_new_tokens=2", "parallel.pipeline=99",
                        "backend=cpu"], capture_output=True, text=True, cwd=tmp_path, timeout=120, check=False)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == "error: parallel.pipeline=99: the model has only 8 layers (one stage holds at least one)"
    bad = subprocess.run([sys.executable, "-m", "turbo", "prompt=hi", "parallel.pipes=2"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120, check=False)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "parallel.pipeline" in bad.stderr
    assert time.monotonic() - started < 60


def test_stages_are_contiguous_and_balanced_by_bytes():
    assert [(s.lo, s.hi) for s in stages([1, 1, 1, 1], 2)] == [(0, 2), (2, 4)]
    assert [(s.lo, s.hi) for s in stages([6, 1, 1, 1, 1, 1, 1], 2)] == [(0, 1), (1, 7)]  # the largest stage least
    assert [(s.lo, s.hi) for s in stages([3, 3, 3], 3)] == [(0, 1), (1, 2), (2, 3)]
    assert [(s.lo, s.hi) for s in stages([1, 1, 1, 1, 1, 1], 2, first_extra=2)] == [(0, 2), (2, 6)]  # rank 0's head
    install = open_install("tiny")
    sizes = layer_bytes(install.index.entries, install.arch.num_layers)
    cut = stages(sizes, 2)
    assert cut[0].lo == 0 and cut[-1].hi == 8 and cut[0].hi == cut[1].lo and all(sizes)


# ---- the pipeline: the single process's tokens ---------------------------------------------


@pytest.fixture(scope="module")
def pair():
    """tiny in this process, and over a 2-stage pipeline (rank 1 a spawned process)."""
    one = turbo.open("tiny", backend="cpu", threads=1)
    two = turbo.open("tiny", backend="cpu", threads=2, parallel={"pipeline": 2})
    yield one, two
    two.trunk.close()


CASES = [{"policy": "off"},
         {"policy": "fixed", "block": 1, "drafter": "dflash"},
         {"policy": "fixed", "block": 4, "drafter": "dflash"},
         {"policy": "fixed", "block": 8, "drafter": "dflash", "rollback": "replay"},
         {"policy": "fixed", "block": 4, "drafter": "ngram"},
         {"policy": "fixed", "block": 8, "drafter": "ngram", "rollback": "replay"}]


def test_pipeline_greedy_tokens_equal_the_single_process(pair):
    one, two = pair
    assert two.trunk.stages[0].lo == 0 and two.trunk.stages[0].hi == two.trunk.stages[1].lo
    prompt = PROMPT + " return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 3
    rollbacks, replayed = 0, 0
    for kw in CASES:
        a = one.generate(prompt, max_new_tokens=48, stop_at_eos=False, **kw)
        b = two.generate(prompt, max_new_tokens=48, stop_at_eos=False, **kw)
        assert a.tokens == b.tokens, kw
        assert a.from_draft == b.from_draft, kw  # the same proposals accepted: the same verify bits
        rollbacks += b.stats.rollbacks
        replayed += b.stats.replayed_rows
    assert rollbacks > 0 and replayed > 0  # both rollbacks ran (their states on both stages)


def test_pipeline_keeps_adaptive_mtp_sampling_and_grammars_unchanged(pair):
    one, two = pair
    for kw in ({"policy": "adaptive", "drafter": "dflash"}, {"policy": "fixed", "block": 2, "drafter": "mtp"},
               {"temperature": 0.8, "seed": 3, "policy": "fixed", "block": 4, "drafter": "dflash"},
               {"response_format": {"type": "json_object"}, "policy": "fixed", "block": 4, "drafter": "ngram"}):
        assert one.generate(PROMPT, max_new_tokens=24, **kw).tokens == two.generate(PROMPT, max_new_tokens=24,
                                                                                    **kw).tokens, kw


def test_pipeline_long_prompt_is_chunked_and_a_session_extends(pair):
    one, two = pair
    ids = [(13 * i + 5) % one.install.arch.vocab for i in range(300)]  # past PREFILL_CHUNK (256): two chunks
    a = one.generate(ids, max_new_tokens=12, stop_at_eos=False, policy="fixed", block=4, drafter="dflash")
    b = two.generate(ids, max_new_tokens=12, stop_at_eos=False, policy="fixed", block=4, drafter="dflash")
    assert a.tokens == b.tokens
    turns = []
    for rt in (one, two):  # a session's second turn extends the kept state (Trunk.extend) on every stage
        s = rt.session("You are terse.")
        first = [tk for e in s.send("hi", max_new_tokens=6, policy="off") for tk in e.tokens]
        second = [tk for e in s.send("and again?", max_new_tokens=6, policy="fixed", block=4, drafter="ngram")
                  for tk in e.tokens]
        assert s.last_turn.resumed_from in ("last turn", "snapshot")  # (from the live state: restored, extended)
        turns.append([first, second])
    assert turns[0] == turns[1]
    n = 3  # choices: the prompt's state kept once (its K/V copied out and back: state_cache), each going on from it
    assert [c.tokens for c in one.choices(PROMPT, n, max_new_tokens=8, policy="fixed", block=4, drafter="dflash")] \
        == [c.tokens for c in two.choices(PROMPT, n, max_new_tokens=8, policy="fixed", block=4, drafter="dflash")]


def test_pipeline_step_many_equals_each_sequence_alone(pair):
    one, two = pair
    seqs = [[5, 9, 11], [7, 3], [2, 2, 2, 4]]
    outs = {}
    for name, rt in (("one", one), ("two", two)):
        t = rt.trunk
        states = [t.new_state(16) for _ in seqs]
        for st, s in zip(states, seqs):
            t.prefill(st, s)
        batch = t.step_many(states, [[1, 2], [3], [4, 5, 6]], [(), (1, 6), ()], ["checkpoint", None, "replay"],
                            [2, 1, 3])
        outs[name] = [(o.logits, o.hidden, o.aux) for o in batch]
    for (la, ha, xa), (lb, hb, xb) in zip(outs["one"], outs["two"]):
        assert la.equal(lb) and ha.equal(hb) and ((xa is None and xb is None) or xa.equal(xb))


# ---- faults -----------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(d))
    return found


def _rank(pid: int) -> int | None:
    """The spawned rank among a process's children (not multiprocessing's resource tracker)."""
    for c in _children(pid):
        try:
            cmd = Path(f"/proc/{c}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            return c
    return None


def test_a_rank_that_dies_ends_every_process_in_one_line(tmp_path):
    cmd = [sys.executable, "-m", "turbo", "prompt=hi", "max_new_tokens=1900", "stop_at_eos=false", "backend=cpu",
           "parallel.pipeline=2", "threads=2", "+policy=off"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        rank1 = None
        while rank1 is None and time.monotonic() < deadline and p.poll() is None:
            rank1 = _rank(p.pid)
            time.sleep(0.1)
        assert rank1 is not None, p.stderr.read().decode() if p.poll() is not None else "no rank 1"
        p.stdout.read(1)  # generating: the first token streamed
        os.kill(rank1, signal.SIGKILL)
        killed = time.monotonic()
        _, err = p.communicate(timeout=15)
        assert time.monotonic() - killed < 15
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode != 0
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1 and "rank 1 ended" in lines[0], lines
    time.sleep(0.5)
    assert not _children(p.pid) and not Path(f"/proc/{rank1}").exists() or \
        Path(f"/proc/{rank1}/stat").read_text().split(") ")[1].startswith("Z")


# ---- the server over a pipeline -----------------------------------------------------------


def test_the_server_over_a_pipeline_answers_concurrent_clients_as_each_alone(pair, tmp_path):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from turbo.testing.checks import served_address

    one, _ = pair
    cmd = [sys.executable, "-m", "turbo", "task=serve", "serve.port=0", "threads=2", "backend=cpu",
           "parallel.pipeline=2", "serve.max_running=4", "drafter=dflash", "+policy=fixed", "block=4"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = served_address(proc)
        assert line.startswith("serving on http://127.0.0.1:"), line
        client = openai.OpenAI(base_url=line.split()[-1] + "/v1", api_key="none", max_retries=0)
        prompts = [PROMPT, "class Stack:", "import numpy as np\n", "The capital of France"]
        with ThreadPoolExecutor(4) as pool:  # four requests in one running batch (step_many over the stages)
            got = list(pool.map(lambda p: client.completions.create(model="tiny", prompt=p, max_tokens=24,
                                                                     temperature=0).choices[0].text, prompts))
        want = [one.generate(p, max_new_tokens=24, drafter="dflash", policy="fixed", block=4).text for p in prompts]
        assert got == want
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


# ---- torchrun: two "machines" on this one ----------------------------------------------------


def test_two_torchrun_nodes_on_localhost_give_the_single_process_tokens(tmp_path):
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["-m", "turbo", f"prompt='{PROMPT}'", "max_new_tokens=24", "stop_at_eos=false", "backend=cpu",
            "threads=1", "drafter=ngram", "+policy=fixed", "block=4"]
    nodes = [subprocess.Popen([torchrun, "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1",
                               "--master-addr", "127.0.0.1", "--master-port", str(port), *args,
                               "parallel.pipeline=2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=tmp_path) for n in (1, 0)]
    alone = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=tmp_path, timeout=120, check=False)
    outs = [p.communicate(timeout=120) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], [o[1][-3000:] for o in outs]
    assert alone.returncode == 0 and alone.stdout.strip()
    assert outs[1][0] == alone.stdout and outs[0][0] == ""  # rank 0 prints; rank 1 serves its stage
