"""task=probe, the Hydra multirun launchers and policy=adaptive (docs/DESIGN.md 3, 8)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from turbo.testing import make_spec_install

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parent.parent
COUNTS = ("prompt_tokens", "generated_tokens", "rounds", "drafted", "accepted", "rollbacks", "replayed_rows",
          "accepted_per_round", "mean_acceptance_length", "rollback_rate", "per_position_acceptance", "mean_block",
          "same_text_as_off", "mismatched_prompts")


@pytest.fixture(scope="module")
def install(tmp_path_factory):
    _, out = make_spec_install(tmp_path_factory.mktemp("probe"), seed=3)
    return out


def compose(overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return hydra_compose(config_name="config", overrides=overrides)


def probe(tmp: Path, overrides) -> dict:
    from turbo.config import run_config
    from turbo.probe import run_probe

    cfg = compose(["task=probe", "backend=cpu"] + overrides)
    assert run_probe(cfg, run_config(cfg), out_dir=tmp, quiet=True) == 0
    return json.loads((tmp / "metrics.json").read_text())


def test_probe_stops_at_end_of_text_unless_past_eos(tmp_path):
    # tiny answers a math prompt in a few dozen tokens and then ends the text
    ov = ["workload=math", "max_new_tokens=96", "probe.prompts_per_workload=1", "+policy=fixed", "block=4"]
    stopped = probe(tmp_path / "stopped", ov)
    past = probe(tmp_path / "past", ov + ["probe.past_eos=true"])
    assert stopped["stop_at_eos"] is True and past["stop_at_eos"] is False
    assert all(r["generated_tokens"] < 96 for r in stopped["runs"])
    assert all(r["generated_tokens"] == 96 for r in past["runs"])
    assert stopped["lossless"] and past["lossless"]


def test_probe_counts_deterministic_and_lossless(install, tmp_path):
    ov = [f"install.path={install}", "max_new_tokens=12", "probe.prompts_per_workload=2", "probe.blocks=[1,2,4]",
          "probe.adaptive=false", "probe.rollbacks=[replay,checkpoint]", "probe.past_eos=true"]
    a, b = probe(tmp_path / "a", ov), probe(tmp_path / "b", ov)
    assert a["schema"] == "turbo.probe/1" and a["lossless"]
    assert [(r["policy"], r["block"], r["rollback"]) for r in a["runs"]] == [
        ("off", 0, None), ("fixed", 1, "replay"), ("fixed", 2, "replay"), ("fixed", 4, "replay"),
        ("fixed", 1, "checkpoint"), ("fixed", 2, "checkpoint"), ("fixed", 4, "checkpoint")]
    for ra, rb in zip(a["runs"], b["runs"]):
        assert {k: ra[k] for k in COUNTS} == {k: rb[k] for k in COUNTS}
        assert ra["generated_tokens"] == 24 and ra["prompts"] == 2
        if ra["policy"] == "fixed":
            assert ra["drafted"] == ra["rounds"] * ra["block"]
            assert len(ra["per_position_acceptance"]) == ra["block"]
            assert ra["speedup_vs_off"] > 0


def test_probe_fixed_policy_measures_one_block(install, tmp_path):
    m = probe(tmp_path, [f"install.path={install}", "max_new_tokens=6", "probe.prompts_per_workload=1",
                         "+policy=fixed", "block=2", "rollback=replay"])
    assert m["blocks"] == [2] and not m["adaptive"] and m["rollbacks"] == ["replay"]
    assert [(r["policy"], r["block"]) for r in m["runs"]] == [("off", 0), ("fixed", 2)]


def test_probe_records_the_ngram_drafter_and_its_config(install, tmp_path):
    m = probe(tmp_path, [f"install.path={install}", "max_new_tokens=6", "probe.prompts_per_workload=1",
                         "+policy=fixed", "block=4", "drafter=ngram", "ngram.max_match=3"])
    assert m["lossless"] and m["drafter"] == "ngram"
    assert m["ngram"] == {"min_match": 2, "max_match": 3, "max_proposal": 8, "search": "all"}
    assert probe(tmp_path, [f"install.path={install}", "max_new_tokens=4", "probe.prompts_per_workload=1",
                            "+policy=fixed", "block=2"])["ngram"] is None


def test_probe_rejects_a_bad_block(install, tmp_path):
    from turbo.errors import TurboError

    with pytest.raises(TurboError, match="block 9 is outside"):
        probe(tmp_path, [f"install.path={install}", "max_new_tokens=4", "probe.blocks=[2,9]"])


def test_adaptive_lossless_against_off(install):
    import turbo

    rt = turbo.open(str(install), backend="cpu")
    prompt = "def f(x):\n    return x + 1\n"
    off = rt.generate(prompt, max_new_tokens=40, policy="off", stop_at_eos=False)
    for rb in ("replay", "checkpoint"):
        res = rt.generate(prompt, max_new_tokens=40, policy="adaptive", rollback=rb, stop_at_eos=False)
        assert res.tokens == off.tokens
        assert res.stats.policy == "adaptive" and res.stats.block == 8


def test_adaptive_loop_mixes_plain_and_speculative_rounds_losslessly(install, monkeypatch):
    """A scripted chooser drives every block, plain rounds (0) included, through the real loop."""
    import turbo
    import turbo.sequence.driver as driver
    from turbo.sequence.adaptive import AdaptiveChooser

    script = [0, 3, 1, 8, 0, 0, 2, 5, 0, 7, 4, 6]
    seen = []

    class Scripted(AdaptiveChooser):
        def next_block(self):
            b = script[len(self.chosen) % len(script)]
            self.chosen.append(b)
            return b

        def observe(self, block, accepted, draft_s, verify_s, rollback_s):
            assert draft_s >= 0 and verify_s > 0 and rollback_s >= 0
            seen.append((block, accepted))
            super().observe(block, accepted, draft_s, verify_s, rollback_s)

    monkeypatch.setattr(driver, "AdaptiveChooser", Scripted)
    rt = turbo.open(str(install), backend="cpu")
    ids = list(range(20, 60))
    off = rt.generate(ids, max_new_tokens=30, policy="off", stop_at_eos=False)
    for rb in ("replay", "checkpoint"):
        seen.clear()
        res = rt.generate(ids, max_new_tokens=30, policy="adaptive", rollback=rb, stop_at_eos=False)
        assert res.tokens == off.tokens
        assert res.stats.drafted == sum(b for b, _ in seen)
        assert res.stats.rounds == len(seen)


def test_adaptive_chooser_follows_acceptance_and_cost():
    from turbo.sequence.adaptive import AdaptiveChooser

    def play(p_accept, rounds=200):
        c = AdaptiveChooser(8)
        for i in range(rounds):
            b = c.next_block()
            # deterministic acceptance: proposals land while a fixed pattern says so
            n = 0
            while n < b and ((i * 7 + n * 3) % 100) < p_accept * 100:
                n += 1
            c.observe(b, n, 0.0004 + 0.0001 * b if b else 0.0, 0.001 + 0.0001 * b, 0.0002 if n < b else 0.0)
        return c

    bad = play(0.0)
    assert bad.chosen[-50:].count(0) >= 45  # speculation never pays: plain rounds, a rare probe
    good = play(0.95)
    assert 0 not in good.chosen[-50:] and max(good.chosen[-50:]) >= 3
    assert good.expected_tokens(4) > good.expected_tokens(1) > 1.0


def _multirun(tmp: Path, install: Path, launcher: list[str]) -> list[Path]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "turbo", "-m", "task=probe", "+policy=fixed", "block=1,2", f"install.path={install}",
           "max_new_tokens=8", "probe.prompts_per_workload=1", "threads=1", "backend=cpu",
           f"hydra.sweep.dir={tmp}"] + launcher
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return sorted(tmp.rglob("metrics.json"))


def test_multirun_joblib_two_jobs_and_report(install, tmp_path):
    files = _multirun(tmp_path / "sweep", install, ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"])
    assert len(files) == 2
    blocks = sorted(json.loads(f.read_text())["runs"][1]["block"] for f in files)
    assert blocks == [1, 2]
    from turbo.report import main

    assert main([str(tmp_path / "sweep")]) == 0
    assert (tmp_path / "sweep" / "report.png").stat().st_size > 1000


def test_multirun_submitit_local_two_jobs(install, tmp_path):
    files = _multirun(tmp_path / "sweep", install, ["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5"])
    assert len(files) == 2
    for f in files:
        m = json.loads(f.read_text())
        assert m["lossless"] and "+policy=fixed" in m["overrides"]
