"""A repack streams: it reads a tensor (or a slice of its rows), converts it, writes it and drops
it, so its peak resident set grows by about its largest tensor, not by the checkpoint's size nor
by the fp32 intermediates of quantizing a vocab-sized head whole (issue 36: 13.4 GB on 5.4 GB).

Measured from a fresh process (its peak resident set, /proc/self/status VmHWM), on a random MoE
checkpoint of the 35B-A3B layer shapes cut to 16 experts of width 512 and a 16k vocab (bf16, ~110
MB, 48 MB of experts), repacked to int4 with its open layout; and the slices' bytes equal the whole
matrix's.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from turbo.load import open_layout
from turbo.repack import repack
from turbo.repack import tensors as repack_tensors
from turbo.store.safetensors_format import read_header
from turbo.testing.checkpoints import make_moe_checkpoint
from turbo.testing.shapes import SHAPES, write_checkpoint

ROOT = Path(__file__).resolve().parent.parent

SHAPE = dict(SHAPES["qwen3.5-35b-a3b-2l"], vocab_size=16384, hidden_size=512, num_experts=16)
# What a repack may add beyond 1.5x its largest tensor: one slice being quantized (~40 bytes a
# weight of repack/tensors.QUANT_SLICE), the tokenizer, the plans, the allocator's slack.
SLACK = 64 << 20

PROBE = """
import json, sys
import torch
from turbo.repack import repack

def status(key):
    return 1024 * int(next(line for line in open("/proc/self/status") if line.startswith(key)).split()[1])

before = status("VmRSS")
repack(sys.argv[1], sys.argv[2], quiet=True, quant="int4")
print(json.dumps({"before": before, "peak": status("VmHWM")}))
"""


def repack_growth(probe: str, src: Path, out: Path) -> int:
    """Bytes the process running `probe` (a repack of src to out, open layout included) grew by."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", probe, str(src), str(out)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert (out / "packed.safetensors").is_file()
    return got["peak"] - got["before"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("moe") / "hf"
    write_checkpoint(src, SHAPE, moe=True)
    return src


def test_repack_peak_is_bounded_by_its_largest_tensor(checkpoint, tmp_path):
    sizes = {n: t.end - t.begin for n, t in read_header(checkpoint / "model.safetensors").tensors.items()}
    assert sum(s for n, s in sizes.items() if ".experts." in n) >= 45 << 20  # (a bound that means something)
    # the largest tensor it holds: the head (each expert is read out of its layer's stack on its own)
    largest = max(s for n, s in sizes.items() if ".experts." not in n)
    assert largest == SHAPE["vocab_size"] * SHAPE["hidden_size"] * 2
    grown = repack_growth(PROBE, checkpoint, tmp_path / "install")
    assert grown <= 1.5 * largest + SLACK, \
        f"the repack grew the process by {grown >> 20} MiB, its largest tensor is {largest >> 20} MiB"


def test_slices_write_the_whole_matrix_bytes(tmp_path, monkeypatch):
    """Quantizing and packing a few rows at a time writes the bytes of doing it whole: a small
    checkpoint repacked with slices of 16 rows and with every matrix at once (its tied head a
    quantized copy in the open layout, its experts cut out of fused stacks)."""
    make_moe_checkpoint(tmp_path / "hf", fused=True, tie_word_embeddings=True)
    out = {}
    for slice_ in (16 * 64, 1 << 30):
        monkeypatch.setattr(repack_tensors, "QUANT_SLICE", slice_)
        monkeypatch.setattr(open_layout, "QUANT_SLICE", slice_)
        out[slice_] = repack(tmp_path / "hf", tmp_path / f"install-{slice_}", quiet=True, quant="int4")
    for name in ("model.safetensors", "packed.safetensors"):
        assert (out[16 * 64] / name).read_bytes() == (out[1 << 30] / name).read_bytes(), name
    packed = read_header(out[16 * 64] / "packed.safetensors").tensors
    assert any(n.startswith("packed.q4.") for n in packed)


# anonymous memory (RssAnon, sampled): the GGUF's pages, mapped, are the page cache's
GGUF_PROBE = """
import json, sys, threading, time
from turbo.repack import repack

def anon():
    return 1024 * int(next(line for line in open("/proc/self/status") if line.startswith("RssAnon")).split()[1])

def watch():
    while True:
        high[0] = max(high[0], anon())
        time.sleep(0.002)

before = anon()
high = [before]
threading.Thread(target=watch, daemon=True).start()
repack(sys.argv[1], sys.argv[2], quiet=True)
time.sleep(0.01)
print(json.dumps({"before": before, "peak": high[0]}))
"""


def test_a_gguf_repack_holds_a_few_bytes_a_weight(tmp_path):
    """A GGUF's exact types are converted a tensor at a time, a few bytes a weight held (the
    levels, the packed words, the open layout's panels), never wider integers: its tied Q8_0
    token_embd, the largest tensor, 16k x 1024: 6.9 bytes a weight measured, with the imports the
    repack makes. (The packing once went through int64 levels: 21.4 here, and 5.2 GB of anonymous
    memory for the 0.8B shape's 0.9 GB Q8_0 GGUF, now 1.4 GB.)"""
    pytest.importorskip("gguf")
    from turbo.testing import make_checkpoint
    from turbo.testing.gguf_writer import write_gguf
    make_checkpoint(tmp_path / "hf", 0, vocab_size=16384, hidden_size=1024, intermediate_size=256, num_hidden_layers=2,
                    head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64)
    gguf_file = write_gguf(tmp_path / "hf", tmp_path / "m.gguf", "Q8_0", mtp="none")
    weights = 16384 * 1024
    grown = repack_growth(GGUF_PROBE, gguf_file, tmp_path / "install")
    assert grown <= 12 * weights, f"the repack grew by {grown >> 20} MiB for a {weights >> 20} M-weight table"
