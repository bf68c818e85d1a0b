"""The native library's build, and the torch code when it cannot be built."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import turbo
rt = turbo.open("tiny")
print(rt.trunk.step_name, "|", rt.trunk.why_torch)
print(rt.generate("def f(x):", max_new_tokens=12, policy="off").tokens)
"""


def start(tmp: Path | None, **env) -> subprocess.Popen:
    """The probe in a process of its own, with a cache of its own under `tmp` (None: the usual one)."""
    full = dict(os.environ, OMP_NUM_THREADS="1", **env)
    if tmp is not None:
        full["TURBO_CACHE"] = str(tmp / "cache")
    return subprocess.Popen([sys.executable, "-c", PROBE], cwd=ROOT, env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def lines(p: subprocess.Popen) -> list[str]:
    """The probe's lines, once it has exited."""
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-2000:]
    return out.splitlines()


def test_builds_and_falls_back_without_a_compiler(tmp_path):
    # (the usual cache: the suite's first runtime built it there, from a fresh cache on a clean
    # machine; tests/test_first_run.py checks what a first build says and leaves)
    # (the three at once: each mostly imports and waits on its own work)
    procs = [start(None), start(tmp_path / "other", CC="false"), start(tmp_path / "off", TURBO_NATIVE="0")]
    built, broken, off = map(lines, procs)
    assert built[0] == "native | None"
    assert broken[0].startswith("torch | false could not build native")  # a "compiler" that always fails
    assert off[0] == "torch | TURBO_NATIVE=0"
    # each step is lossless against its own plain decode; the two agree on tiny's greedy text here
    assert built[1] == broken[1] == off[1]
