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


def run(tmp: Path | None, **env) -> list[str]:
    """The probe's lines, with a cache of its own under `tmp` (None: the usual one)."""
    full = dict(os.environ, OMP_NUM_THREADS="1", **env)
    if tmp is not None:
        full["TURBO_CACHE"] = str(tmp / "cache")
    p = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=full, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.splitlines()


def test_builds_and_falls_back_without_a_compiler(tmp_path):
    # (the usual cache: the suite's first runtime built it there, from a fresh cache on a clean
    # machine; tests/test_first_run.py checks what a first build says and leaves)
    built = run(None)
    assert built[0] == "native | None"
    broken = run(tmp_path / "other", CC="false")  # a "compiler" that always fails
    assert broken[0].startswith("torch | false could not build native")
    off = run(tmp_path / "off", TURBO_NATIVE="0")
    assert off[0] == "torch | TURBO_NATIVE=0"
    # each step is lossless against its own plain decode; the two agree on tiny's greedy text here
    assert built[1] == broken[1] == off[1]
