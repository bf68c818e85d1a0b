"""The re-measurement against llama.cpp and its report (scripts/measure_vs_llamacpp.py,
scripts/report_vs_llamacpp.py) on a made-up output
directory: a step recorded done is skipped, one over the budget is skipped, and the README row takes
the undisturbed repetitions' medians and counts the disturbed one as dropped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # (the scripts run as `python -m scripts.NAME` from it)


def guard(disturbed: bool, load: float) -> dict:
    return {"quiet_before": True, "waited_s": 0.0, "load1_before": load, "others_before": 0.0,
            "others_during": 0.0, "load1_after": load, "disturbed": disturbed, "guard_on": True}


def record(system: str, decode: float, disturbed: bool = False, load: float = 0.1) -> dict:
    fig = {"prefill_tps": 10 * decode, "prefill_peak": 1e9, "decode_tps": decode, "decode_peak": 1e9,
           "tokens": [1, 2], "gaps": [0.5, 0.5]}
    return {"system": system, "load_s": 0.5, "load_peak": 5e8, "load_rss": 5e8, "512": fig, "rep": 0, "threads": 2,
            "guard": guard(disturbed, load), "cotenants": 0}


def meta(d: Path, name: str, rc: int = 0) -> None:
    (d / f"{name}.meta.json").write_text(json.dumps(
        {"name": name, "cmd": f"python -m scripts.bench_{name}", "estimate_min": 1, "dry": False, "commit": "abc1234",
         "dirty": False, "start": "2026-12-05 00:00:00 UTC", "end": "2026-12-05 00:01:00 UTC", "seconds": 60.0,
         "rc": rc, "load_before": [0.1, 0.1, 0.1], "load_after": [0.2, 0.2, 0.2]}))


def test_report_takes_the_undisturbed_medians(tmp_path):
    recs = [record("turbo", 10.0), record("turbo", 12.0), record("turbo", 1.0, disturbed=True, load=3.0),
            record("llama.cpp", 5.0), record("llama.cpp", 6.0)]
    (tmp_path / "scale512.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (tmp_path / "scale512.log").write_text("| | turbo |\n| --- | ---: |\n| decode | 11 |\n")
    meta(tmp_path, "scale512")
    meta(tmp_path, "round", rc=1)  # failed: no rows, listed as not measured
    out = subprocess.run([sys.executable, "-m", "scripts.report_vs_llamacpp", str(tmp_path)], capture_output=True,
                         text=True, check=True, cwd=ROOT).stdout
    row = next(line for line in out.splitlines() if line.startswith("| bf16 decode tok/s at context 512"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # turbo: median of 10 and 12 (the disturbed 1.0 left out); llama.cpp: of 5 and 6; ratio 11 / 5.5
    assert cells[1:4] == ["11.0", "llama.cpp bf16 5.5", "2.00x"]
    assert cells[4] == "4 / 1" and cells[5] == "0.10-3.00"
    assert "| decode | 11 |" in out and "commit abc1234" in out
    assert "Not measured" in out and "round" in out.split("Not measured")[1]


def test_driver_resumes_and_keeps_to_the_budget(tmp_path):
    meta(tmp_path, "scale512")  # done before
    out = subprocess.run([sys.executable, "-m", "scripts.measure_vs_llamacpp", str(tmp_path), "--no-prepare",
                          "--force", "--budget-min", "0.01", "--only", "scale512", "scale4096"],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert "scale512: done before, skipped" in out
    assert "scale4096: ~9 min" in out and "skipped" in out.split("scale4096:")[1]
    assert not (tmp_path / "scale4096.meta.json").exists()
