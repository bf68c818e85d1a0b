"""python -m turbo.train: both kinds trained for a few steps on a small random install, written,
repacked and speculating losslessly; resume continues the run it left; bad input is one line."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file

import turbo
from turbo.testing import assert_lossless
from turbo.repack import repack
from turbo.train.__main__ import main
from turbo.train.dflash2 import spread_target_layers

SMALL = ["--examples", "12", "--new-tokens", "12", "--batch", "4", "--eval-tokens", "12", "--threads", "1",
         "--heldout-count", "4"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("text")
    rng = random.Random(0)
    qa = [json.dumps(f"Q: {rng.randint(1, 60)} + {rng.randint(1, 60)}?\nA:") for _ in range(30)]
    (d / "qa.jsonl").write_text("\n".join(qa) + "\n")
    (d / "code").mkdir()
    for i in range(12):
        (d / "code" / f"f{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + {i + 1}\n" * 3)
    return [str(d / "qa.jsonl"), str(d / "code")]


@pytest.fixture(scope="module")
def trained(plain_install, data, tmp_path_factory):
    _, install = plain_install
    out = tmp_path_factory.mktemp("trained")
    assert main([str(install), "--kind", "dflash2", "--data", *data, "--out", str(out / "d"), "--steps", "4",
                 "--block", "4", *SMALL]) == 0
    assert main([str(install), "--kind", "mtp", "--data", *data, "--out", str(out / "m"), "--steps", "4",
                 *SMALL]) == 0
    return install, out / "d", out / "m"


def test_target_layers_spread_as_published():
    # z-lab's DFlash drafters for Qwen3-8B (36 layers) and Qwen3-4B (36) read [1, 9, 17, 25, 33]
    assert spread_target_layers(36, 5) == [1, 9, 17, 25, 33]
    assert spread_target_layers(8, 5) == [1, 2, 3, 4, 5]
    assert spread_target_layers(4, 5) == [2]  # too shallow for more: the middle layer


def test_writes_the_published_layouts_and_the_evaluation(trained):
    _, d, m = trained
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["dflash_config"]["block_size"] == 4
    assert cfg["dflash_config"]["target_layer_ids"] == [2]
    assert "fc.weight" in load_file(str(d / "model.safetensors"))
    assert all(k.startswith("mtp.") for k in load_file(str(m / "model.safetensors")))
    for path, blocks in ((d, ["2", "4"]), (m, ["2", "4", "8"])):
        ev = json.loads((path / "eval.json").read_text())
        assert ev["lossless"] is True and ev["stop_at_eos"] is True
        assert set(ev["groups"]) == {"qa", "code"}
        assert all(list(g["blocks"]) == blocks and g["prompts"] == 4 for g in ev["groups"].values())


def test_repacked_drafters_speculate_losslessly(trained, tmp_path):
    install, d, m = trained
    filed = repack(install, tmp_path / "install", drafter=d, quiet=True, mtp_head=m)
    rt = turbo.open(filed, backend="cpu")
    assert rt.install.has_mtp and rt.drafter_config.block_size == 4
    for prompt in ("Q: 3 + 4?\nA:", "def f(x):\n"):
        ref = rt.generate(prompt, max_new_tokens=20, policy="off", stop_at_eos=False).tokens
        for drafter in ("dflash", "mtp"):
            for block in (2, 4):
                assert_lossless(rt, prompt, ref, block, drafter=drafter, max_new_tokens=20, stop_at_eos=False)


def losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "train" / "log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("kind", ["dflash2", "mtp"])
def test_resume_continues_the_run(plain_install, data, tmp_path, kind):
    _, install = plain_install
    run = [str(install), "--kind", kind, "--data", *data, "--steps", "6", "--checkpoint-every", "2", *SMALL]
    assert main(run + ["--out", str(tmp_path / "whole")]) == 0
    # a budget that ends after the first step, then the rest from its checkpoint
    assert main(run + ["--out", str(tmp_path / "parts"), "--minutes", "1e-9"]) == 0
    assert len(losses(tmp_path / "parts")) == 1
    assert main(run + ["--out", str(tmp_path / "parts"), "--resume"]) == 0
    whole, parts = losses(tmp_path / "whole"), losses(tmp_path / "parts")
    assert len(parts) == 6
    assert parts == pytest.approx(whole, rel=1e-4)
    a = load_file(str(tmp_path / "whole" / "model.safetensors"))
    b = load_file(str(tmp_path / "parts" / "model.safetensors"))
    assert all(torch.allclose(a[k].float(), b[k].float(), atol=1e-2) for k in a)


@pytest.mark.parametrize("extra, message", [
    (["--data", "/nonexistent/text", "--steps", "2"], "/nonexistent/text: no such file or directory"),
    (["--data", "DATA"], "expected --steps or --minutes"),
    (["--data", "DATA", "--steps", "2", "--block", "1"], "--block 1 is below 2"),
    (["--data", "DATA", "DATA", "--steps", "2"], "a second group named 'qa'"),
])
def test_bad_input_is_one_line(plain_install, data, tmp_path, capsys, extra, message):
    _, install = plain_install
    extra = [data[0] if a == "DATA" else a for a in extra]
    assert main([str(install), "--kind", "dflash2", "--out", str(tmp_path / "o"), *extra, *SMALL]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_from_install_starts_from_the_drafters_it_carries(trained, data, tmp_path):
    install, d, m = trained
    filed = repack(install, tmp_path / "install", drafter=d, quiet=True, mtp_head=m)
    for kind, own in (("dflash2", d), ("mtp", m)):
        out = tmp_path / kind
        # one step at a learning rate that moves nothing bf16 can show: the export is the start
        assert main([str(filed), "--kind", kind, "--from-install", "--data", *data, "--out", str(out), "--steps", "1",
                     "--lr", "1e-12", "--heldout-count", "0", *SMALL[:-2]]) == 0
        want, got = load_file(str(own / "model.safetensors")), load_file(str(out / "model.safetensors"))
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    cfg = json.loads((tmp_path / "dflash2" / "config.json").read_text())
    assert cfg["dflash_config"]["block_size"] == 4  # the install's drafter's shape, not the defaults
