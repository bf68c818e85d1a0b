"""python -m turbo.report DIR over stored probe metrics (tests/fixtures/probe_multirun)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from turbo.report import main

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "probe_multirun"


def test_report_table_and_png_from_fixtures(tmp_path, capsys):
    d = tmp_path / "sweep"
    shutil.copytree(FIXTURE, d)
    assert main([str(d)]) == 0
    text = (d / "report.md").read_text()
    said = capsys.readouterr()
    assert text == said.out and said.err.startswith("[report] wrote")
    assert "# Probe report (24 metrics.json)" in text
    assert "| workload | rollback | policy | block | accepted per round |" in text
    assert "| prose | replay | fixed | 8 | 1.84 | 96% |" in text
    assert "- prose, rollback replay: block 2 (" in text
    assert "- code, rollback checkpoint: block 4 (" in text
    assert "- math, any strategy: block 4 with rollback checkpoint" in text
    assert "prose, rollback checkpoint: 121.4 tok/s = 0.98x block 2" in text
    png = (d / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_report_errors_are_one_line_and_exit_2(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    bad = tmp_path / "bad" / "0"
    bad.mkdir(parents=True)
    (bad / "metrics.json").write_text("{not json")
    other = tmp_path / "other" / "0"
    other.mkdir(parents=True)
    (other / "metrics.json").write_text(json.dumps({"schema": "something/9", "runs": []}))
    short = tmp_path / "short" / "0"
    short.mkdir(parents=True)
    (short / "metrics.json").write_text(json.dumps({"schema": "turbo.probe/1", "runs": [{"workload": "prose"}]}))
    for d, msg in ((empty, "no metrics.json below it"), (bad.parent, "not readable JSON"),
                   (other.parent, "schema is 'something/9'"), (short.parent, "runs[0] lacks policy"),
                   (tmp_path / "missing", "not a directory")):
        assert main([str(d)]) == 2
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert out == "" and len(lines) == 1 and lines[0].startswith("error: ") and msg in lines[0], err
    # and through the module entry point
    p = subprocess.run([sys.executable, "-m", "turbo.report", str(empty)], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.mark.parametrize("key,values", [("drafter", ("dflash", "mtp")), ("draft_products", ("fp32", "int8"))])
def test_report_puts_two_jobs_side_by_side(tmp_path, capsys, key, values):
    """drafter=dflash,mtp or draft_products=fp32,int8: a row group for each."""
    fixture = Path(__file__).parent / "fixtures" / "probe_multirun"
    for value in values:
        data = json.loads((fixture / "0" / "metrics.json").read_text())
        data[key] = value
        (tmp_path / value).mkdir()
        (tmp_path / value / "metrics.json").write_text(json.dumps(data))
    assert main([str(tmp_path)]) == 0
    table = (tmp_path / "report.md").read_text()
    workload = data["runs"][0]["workload"]
    assert all(f"| {workload} [{value}] |" in table for value in values)
