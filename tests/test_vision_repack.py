"""Repack keeps the tower of a Qwen3_5ForConditionalGeneration checkpoint (turbo/vision), with
its processor settings; --quant quantizes its matrices like the trunk's; --text-only drops it;
a tower that disagrees with its config is refused in one line where images are asked for."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

import turbo
from turbo.errors import TurboError
from turbo.repack import repack
from turbo.sequence.policy import VISION_SPECULATION_BLOCKER_MARKER, speculation_blocker
from turbo.store.install import open_install
from turbo.testing.vision import make_vl_checkpoint
from turbo.vision.runtime import Vision


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("vlq") / "src"
    make_vl_checkpoint(path, seed=4, vision_hidden=64)
    return path


def test_quant_quantizes_the_towers_matrices(src, tmp_path):
    plain = open_install(repack(src, tmp_path / "plain", quiet=True))
    packed = open_install(repack(src, tmp_path / "int8", quant="int8", quiet=True))
    assert (plain.path / "preprocessor_config.json").is_file()
    for name in ("vision.blocks.0.attn.qkv.weight", "vision.blocks.1.mlp.linear_fc2.weight", "vision.merger.linear_fc1.weight"):
        assert packed.index.need(name).bits == 8 and not plain.index.need(name).bits
    assert not packed.index.need("vision.patch_embed.proj.weight").bits  # a Conv3d stays float
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 56, 3), dtype=np.uint8))
    a, b = Vision.from_install(plain), Vision.from_install(packed)
    (ta, ma), (tb, mb) = a.prompt([a.ids.image], [image]), b.prompt([b.ids.image], [image])
    assert ta == tb and torch.equal(ma.freq_positions, mb.freq_positions)
    assert (ma.embeds - mb.embeds).abs().max().item() < 0.05 * ma.embeds.abs().max().item()
    text_only = open_install(repack(src, tmp_path / "text", text_only=True, quiet=True))
    assert not text_only.has_vision


def test_a_broken_tower_is_refused_in_one_line(src, tmp_path):
    out = repack(src, tmp_path / "broken", quiet=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg["vision_config"]["depth"] = 3  # the tensors hold 2 blocks
    (out / "config.json").write_text(json.dumps(cfg))
    inst = open_install(out)
    why = speculation_blocker(inst, "ngram", (0, 1, 2, 3))
    assert why.startswith(VISION_SPECULATION_BLOCKER_MARKER) and "missing tensor vision.blocks.2" in why
    rt = turbo.open(out, backend="cpu")
    assert rt.generate([5, 6], max_new_tokens=2, policy="off").tokens  # text still runs
    with pytest.raises(TurboError, match="missing tensor vision.blocks.2.norm1.weight") as e:
        rt.generate([5, 6], images=[np.zeros(1)], max_new_tokens=2)
    assert "\n" not in str(e.value)
    del cfg["vision_config"]["patch_size"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TurboError, match="missing required field 'patch_size'"):
        Vision.from_install(open_install(out))
