"""Opening an install holds about its own size: the native step's matrices are packed as
they are read, a slice at a time, and nothing is kept twice (a tied embedding once).

Measured from a fresh process (its peak resident set, /proc/self/status VmHWM), on a
checkpoint of the published 0.8B layer shapes cut to 4 layers and a 64k vocab (~300 MB).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from turbo.backends import native_lib
from turbo.repack import repack
from turbo.testing.shapes import FULL_EVERY_4, SHAPES, write_checkpoint

ROOT = Path(__file__).resolve().parent.parent

SHAPE = dict(SHAPES["qwen3.5-0.8b"], vocab_size=65536, num_hidden_layers=4, layer_types=FULL_EVERY_4(4))
# What opening may add to the process beyond the weights: one slice of rows being packed,
# the tokenizer, the library, the allocator's slack.
SLACK = 64 << 20

PROBE = """
import json, sys
import torch
import turbo

def status(key):
    return 1024 * int(next(line for line in open("/proc/self/status") if line.startswith(key)).split()[1])

before = status("VmRSS")
rt = turbo.open(sys.argv[1], threads=1)
print(json.dumps({"before": before, "peak": status("VmHWM"), "step": rt.trunk.step_name}))
"""


@pytest.fixture(scope="module")
def install(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("scale")
    write_checkpoint(tmp / "hf", SHAPE)
    return repack(tmp / "hf", tmp / "install", quiet=True)


def test_open_holds_the_weights_once(install):
    if native_lib.library() is None:
        pytest.skip(f"native step unavailable: {native_lib.why_not()}")
    weights = sum(f.stat().st_size for f in install.glob("*.safetensors"))
    assert weights > 250 << 20  # (the bound below means something only at a real size)
    env = dict(os.environ, PYTHONPATH=str(ROOT), TURBO_NATIVE="1")
    done = subprocess.run([sys.executable, "-c", PROBE, str(install)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["step"] == "native"
    grown = got["peak"] - got["before"]
    assert grown <= 1.1 * weights + SLACK, f"opening grew the process by {grown / weights:.2f}x the weights"
