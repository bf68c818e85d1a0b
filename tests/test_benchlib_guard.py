"""The benchmarks' quiet-machine guard (scripts/benchlib.py, Guard) against a fake machine: a
clock, busy CPU-seconds that advance by what this tree and the others use, a load average; and
where results are written (results_path)."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import pytest

from scripts import benchlib
from scripts.benchlib import Counters, Guard


class FakeMachine:
    """`others` CPUs busy from time `t` on as `plan` says ([(from_t, others, load1)], the last
    entry whose from_t <= now applies); the benchmark's own tree uses `own` CPUs while `running`."""

    def __init__(self, plan: list[tuple[float, float, float]]):
        self.plan, self.t, self.busy, self.own = plan, 0.0, 0.0, 0.0
        self.running, self.own_cpus = False, 2.0
        self.slept: list[float] = []

    def state(self) -> tuple[float, float]:
        return next((o, ld) for since, o, ld in reversed(self.plan) if since <= self.t)

    def counters(self) -> Counters:
        return Counters(self.t, self.busy, self.own, self.state()[1])

    def advance(self, dt: float) -> None:
        mine = self.own_cpus if self.running else 0.0
        for _ in range(round(dt / 0.1)):  # in 0.1 s steps, so a change of plan mid-way counts
            self.busy += (self.state()[0] + mine) * 0.1
            self.own += mine * 0.1
            self.t += 0.1

    def sleep(self, dt: float) -> None:
        self.slept.append(dt)
        self.advance(dt)


def guard(m: FakeMachine, **kw) -> Guard:
    return Guard(threads=2, counters=m.counters, sleep=m.sleep, **kw)


def timed_rep(g: Guard, m: FakeMachine, seconds: float = 10.0) -> benchlib.RepGuard:
    with g.rep() as r:
        m.running = True
        m.advance(seconds)
        m.running = False
    return r


def test_quiet_machine_runs_at_once_and_keeps_the_rep():
    m = FakeMachine([(0, 0.02, 0.3)])
    r = timed_rep(guard(m), m)
    assert m.slept == [0.5]  # one sample window, no wait
    assert r.quiet_before and not r.disturbed and r.waited_s == pytest.approx(0.5)
    assert r.others_before == pytest.approx(0.02) and r.load1_before == 0.3
    # the rep's own 2 CPUs are this tree's: others during it are the 0.02 background, not 2.02
    assert r.others_during == pytest.approx(0.02)


def test_waits_out_a_co_tenant_then_keeps_the_rep():
    m = FakeMachine([(0, 1.0, 3.2), (20, 0.0, 3.2), (40, 0.0, 2.0)])  # busy, then the load average decays
    r = timed_rep(guard(m), m)
    assert r.quiet_before and not r.disturbed
    assert 40 <= r.waited_s < 43  # past the busy spell and the lagging load average, no longer
    assert r.load1_before == 2.0 and r.others_before == 0.0


def test_load_average_alone_holds_the_rep():
    # nothing busy in the short window, but someone's recent work is still in the load average
    m = FakeMachine([(0, 0.0, 3.0), (10, 0.0, 1.0)])
    r = timed_rep(guard(m), m)
    assert r.quiet_before and r.waited_s >= 10


def test_own_threads_lagging_load_is_allowed():
    # the benchmark's previous 2-thread rep keeps load1 near 2: below threads + 0.5, no wait
    m = FakeMachine([(0, 0.0, 2.3)])
    g = guard(m)
    assert g.max_load == 2.5
    assert timed_rep(g, m).waited_s == pytest.approx(0.5)


def test_bounded_wait_marks_the_rep_disturbed():
    m = FakeMachine([(0, 1.5, 4.0)])
    r = timed_rep(guard(m, max_wait=30), m)
    assert not r.quiet_before and r.disturbed
    assert 30 <= r.waited_s < 33  # gave up at the bound, then ran it anyway
    assert r.others_during == pytest.approx(1.5)


def test_co_tenant_during_the_rep_marks_it_disturbed():
    m = FakeMachine([(0, 0.0, 0.5), (5, 1.0, 0.5)])  # starts mid-rep: the sample before saw nothing
    r = timed_rep(guard(m), m, seconds=10)
    assert r.quiet_before and r.disturbed
    assert r.others_during == pytest.approx(0.55, abs=0.02)  # 1 CPU from t=5 of the rep from 0.5 to 10.5


def test_guard_off_never_waits_and_keeps_everything():
    m = FakeMachine([(0, 1.5, 4.0)])
    r = timed_rep(guard(m, enabled=False), m)
    assert m.slept == [0.5] and not r.quiet_before and not r.disturbed and not r.guard_on
    assert r.others_during == pytest.approx(1.5)  # still measured and recorded
    assert benchlib.guard_summary([{"guard": asdict(r)}]).startswith("guard OFF")


def test_from_env_overrides(monkeypatch):
    monkeypatch.setenv("TURBO_BENCH_MAX_OTHERS", "0.3")
    monkeypatch.setenv("TURBO_BENCH_MAX_WAIT", "7")
    monkeypatch.setenv("TURBO_BENCH_GUARD", "off")
    g = Guard.from_env(4)
    assert (g.max_others, g.max_wait, g.max_load, g.enabled) == (0.3, 7.0, 4.5, False)
    monkeypatch.setenv("TURBO_BENCH_MAX_LOAD", "1.5")
    monkeypatch.delenv("TURBO_BENCH_GUARD")
    g = Guard.from_env(2)
    assert g.max_load == 1.5 and g.enabled


def test_kept_and_summary():
    def rec(disturbed: bool, load: float, others: float) -> dict:
        return {"guard": asdict(benchlib.RepGuard(disturbed=disturbed, load1_before=load, load1_after=load + 0.5,
                                                  others_during=others, waited_s=3.0))}

    records = [rec(False, 0.2, 0.01), rec(True, 3.0, 1.2), rec(False, 0.4, 0.03), {"old": 1}]
    assert benchlib.kept(records) == [records[0], records[2], records[3]]
    line = benchlib.guard_summary(records[:3])
    assert line.startswith("guard: ") and "kept 2 of 3" in line and "dropped 1" in line
    assert "0.20-3.50" in line and "<= 1.20" in line  # the load average's range, the most others used
    run = line.splitlines()[1]  # then when, on which commit, by which command
    assert run.startswith("run: ") and " UTC, commit " in run and "python " in run


def test_real_counters_see_this_process_as_own():
    # the real /proc reader: a busy loop in this process is own time, not others'
    a = benchlib.read_counters()
    cpu = time.process_time()
    x = 0
    while time.process_time() - cpu < 0.3:  # CPU time, not wall: the machine may be shared
        x += 1
    b = benchlib.read_counters()
    assert b.own - a.own >= 0.25  # (/proc's ticks: 10 ms)
    assert benchlib.others_cpus(a, b) < (b.busy - a.busy) / (b.t - a.t)


def test_controlled_cotenant_is_own_cpu_and_ends_with_the_block():
    a = benchlib.read_counters()
    with benchlib.cotenant(1) as procs:
        pid = procs[0].pid
        deadline = time.monotonic() + 30  # (a shared machine may give the spin loop little CPU)
        while benchlib.read_counters().own - a.own < 0.05 and time.monotonic() < deadline:
            time.sleep(0.1)
        b = benchlib.read_counters()
        assert procs[0].poll() is None  # spinning while the block runs
    assert b.own - a.own >= 0.05  # its CPU is this tree's: the guard does not call it someone else
    assert not Path(f"/proc/{pid}").exists()  # killed and reaped on the way out


def test_results_path_is_dated_under_docs_results(tmp_path, monkeypatch):
    assert benchlib.RESULTS == Path(__file__).resolve().parents[1] / "docs" / "results"
    monkeypatch.setattr(benchlib, "RESULTS", tmp_path / "results")
    day = time.strftime("%Y-%m-%d", time.gmtime())
    first = benchlib.results_path("scale")
    assert first == tmp_path / "results" / f"scale-{day}.jsonl" and first.parent.is_dir()
    first.write_text("{}\n")
    assert benchlib.results_path("scale") == first  # JSON lines: appended to the day's file
    assert benchlib.results_path("serve", ".json", day="2026-12-04") == tmp_path / "results" / "serve-2026-12-04.json"
    (tmp_path / "results" / "serve-2026-12-04.json").write_text("{}")
    assert benchlib.results_path("serve", ".json", fresh=True, day="2026-12-04").name == "serve-2026-12-04b.json"
