"""Leftovers of the last pass (issue 48), each one line on stderr, exit 2, nothing written: a
hydra.run.dir that cannot be created even where access() says it could (root, /proc), training
data that is not a regular file (/dev/zero), a DFlash2 block wider than an example."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def one_line(args: list[str], cwd: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc")
def test_an_uncreatable_hydra_run_dir(tmp_path):
    err = one_line(["turbo", "task=probe", "hydra.run.dir=/proc/turbo-nope"], tmp_path)
    assert "hydra.run.dir /proc/turbo-nope: cannot create it" in err


@pytest.mark.parametrize("extra, says", [
    (["--data", "/dev/zero"], "/dev/zero: not a regular file or a directory"),
    (["--data", str(ROOT / "README.md"), "--block", "1000"], "--block 1000: expected fewer than --seq-len 256"),
])
def test_train_refuses_endless_data_and_oversized_blocks(tmp_path, extra, says):
    err = one_line(["turbo.train", "tiny", "--kind", "dflash2", "--out", str(tmp_path / "out"), "--steps", "1",
                    *extra], tmp_path)
    assert says in err and not (tmp_path / "out").exists()


def test_multirun_flag_among_the_overrides_is_a_sweep(tmp_path):
    """-m / --multirun anywhere among the overrides means a sweep, as at the front (Hydra's
    argparse took the overrides after it for unrecognized arguments: a usage page)."""
    for flag_at in (0, 2, 4):
        args = ["task=generate", "threads=1", "backend=cpu", "prompt=hi", "max_new_tokens=1,2",
                f"hydra.sweep.dir={tmp_path}/sweep{flag_at}"]
        args.insert(flag_at, "-m" if flag_at != 4 else "--multirun")
        proc = subprocess.run([sys.executable, "-m", "turbo", *args], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0 and "Launching 2 jobs" in out and "max_new_tokens=2" in out, out[-2000:]


@pytest.mark.parametrize("args, says", [
    (["task=probe", "threads=1", "-x"], "-x: not a flag turbo or Hydra knows"),
    (["task=probe", "--cfg"], "argument --cfg/-c: expected one argument"),
    (["task=probe", "-m", "threads=1", "--cfg", "job"], "--multirun and --cfg: expected one of"),
])
def test_unknown_or_clashing_flags_are_one_line(tmp_path, args, says):
    assert says in one_line(["turbo", *args], tmp_path)
