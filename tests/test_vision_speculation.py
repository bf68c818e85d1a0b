"""Speculation with images in the context (turbo/vision): the verify rows after an image rotate
at index + delta on the native and the torch step, so fixed blocks 1..8 under both rollbacks
commit exactly plain decode's tokens, with ngram and a scripted drafter (every accepted count),
images before and between text; and `generate(images=)` equals the trunk driven by hand."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

import turbo
from turbo.errors import TurboError
from turbo.testing import ScriptedDrafter
from turbo.testing.vision import END_ID, IMAGE_ID, START_ID, make_vl_install

PROMPT = [5, 6, START_ID, IMAGE_ID, END_ID, 7, 8, 9, START_ID, IMAGE_ID, END_ID, 10, 11, 12, 7, 8]
NEW = 40


def images() -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 255, shape, dtype=np.uint8)) for shape in ((40, 56, 3), (30, 20, 3))]


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    _, out = make_vl_install(tmp_path_factory.mktemp("vl"), seed=1)
    return out


@pytest.mark.parametrize("native", [True, False])
def test_lossless_after_images(vl, native):
    rt = turbo.open(vl, backend="cpu", native=native)
    assert rt.trunk.step_name == ("native" if native else "torch")
    imgs = images()
    base = rt.generate(PROMPT, images=imgs, max_new_tokens=NEW + 8, policy="off").tokens
    full = rt.generate(PROMPT, images=imgs, max_new_tokens=1, policy="off")  # the expanded prompt's length
    expanded = full.stats.prompt_tokens
    assert expanded > len(PROMPT)
    reference = [0] * expanded + base  # the scripted drafter reads the reference by position
    for block in range(1, 9) if native else (1, 3, 8):
        for rollback in ("checkpoint", "replay"):
            for drafter in ("ngram", ScriptedDrafter(reference, [block, 0, 1, block // 2], 320)):
                out = rt.generate(PROMPT, images=imgs, max_new_tokens=NEW, policy="fixed", block=block,
                                  rollback=rollback, drafter=drafter)
                assert out.tokens == base[:NEW], (block, rollback, drafter)
    assert out.stats.accepted > 0


def test_speculation_is_not_blocked_and_prompts_are_checked(vl):
    rt = turbo.open(vl, backend="cpu")
    assert rt.plan("fixed", 2, "ngram").off_reason is None
    text_first = rt.generate([5, 6, 7], images=images()[:1], max_new_tokens=4, policy="off").tokens
    placed = rt.generate([START_ID, IMAGE_ID, END_ID, 5, 6, 7], images=images()[:1], max_new_tokens=4, policy="off")
    assert text_first == placed.tokens  # no placeholder: each image goes before the prompt
    with pytest.raises(TurboError, match="cannot end in an image"):
        rt.generate([5, START_ID, IMAGE_ID], images=images()[:1], max_new_tokens=4)
    with pytest.raises(TurboError, match="pixel budget|not a readable image"):
        rt.generate(PROMPT, images=[b"\x89PNG\r\n\x1a\n", images()[1]], max_new_tokens=4)


@pytest.fixture(scope="module")
def own_drafters(tmp_path_factory):
    """The tiny VL checkpoint with a random MTP head and a random DFlash drafter, repacked together."""
    from test_mtp import add_mtp, mtp_tensors

    from turbo.repack import repack
    from turbo.testing.checkpoints import make_drafter
    from turbo.testing.vision import make_vl_checkpoint

    tmp = tmp_path_factory.mktemp("vl-spec")
    model = make_vl_checkpoint(tmp / "src", seed=3)
    text = model.config.text_config
    add_mtp(tmp / "src", mtp_tensors(text, 3))
    drafter = make_drafter(tmp / "d", text.hidden_size, text.vocab_size, [0, text.num_hidden_layers - 2], seed=3)
    return turbo.open(repack(tmp / "src", tmp / "inst", drafter=drafter, quiet=True), backend="cpu")


@pytest.mark.parametrize("kind", ["dflash", "mtp"])
def test_own_drafters_lossless_after_images(own_drafters, kind):
    rt, imgs = own_drafters, images()
    base = rt.generate(PROMPT, images=imgs, max_new_tokens=24, policy="off").tokens
    for block in (1, 2, 5, 8):
        for rollback in ("checkpoint", "replay"):
            out = rt.generate(PROMPT, images=imgs, max_new_tokens=24, policy="fixed", block=block,
                              rollback=rollback, drafter=kind)
            assert out.tokens == base and out.stats.drafter == kind, (block, rollback)
