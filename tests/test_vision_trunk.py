"""The trunk's multimodal prompt (turbo/vision/positions.py, the torch step's prefill and the
rows after it at index + delta) against transformers' Qwen3_5ForConditionalGeneration on a
random tiny install carrying a tower: logits with one and with two images within 1e-4, and
64 greedy tokens identical."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from turbo.errors import TurboError
from turbo.load.loader import load_trunk
from turbo.sequence.options import OpenOptions
from turbo.store.install import open_install
from turbo.testing.vision import END_ID, IMAGE_ID, START_ID, make_vl_install
from turbo.vision.runtime import Vision

ONE = [5, 6, START_ID, IMAGE_ID, END_ID, 7, 8, 9]
TWO = [5, 6, START_ID, IMAGE_ID, END_ID, 7, 8, 9, START_ID, IMAGE_ID, END_ID, 10, 11]


def images(seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, shape, dtype=np.uint8)) for shape in ((40, 56, 3), (30, 20, 3))]


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    model, out = make_vl_install(tmp_path_factory.mktemp("vl"))
    install = open_install(out)
    return model, install, load_trunk(install, OpenOptions(native=False), "cpu"), Vision.from_install(install)


@pytest.fixture(scope="module")
def native(vl):
    trunk = load_trunk(vl[1], OpenOptions(), "cpu")
    assert trunk.step_name == "native"
    return trunk


def reference(model, vis: Vision, tokens: list[int], imgs, new: int = 0):
    prep = vis.prepare(imgs)
    ids = torch.tensor([tokens])
    kw = dict(input_ids=ids, pixel_values=torch.cat([p.pixels for p in prep]),
              image_grid_thw=torch.tensor([p.grid for p in prep]), mm_token_type_ids=(ids == IMAGE_ID).int())
    with torch.no_grad():
        if new:
            return model.generate(**kw, max_new_tokens=new, min_new_tokens=new, do_sample=False)[0, len(tokens):].tolist()
        return model(**kw).logits[0]


@pytest.mark.parametrize("prompt,count", [(ONE, 1), (TWO, 2)])
def test_logits_equal_transformers(vl, prompt, count):
    model, _, trunk, vis = vl
    imgs = images()[:count]
    tokens, mm = vis.prompt(prompt, imgs)
    assert mm.delta < 0 and len(tokens) > len(prompt)
    out = trunk.prefill(trunk.new_state(), tokens, want_logits=True, mm=mm)
    assert (out.logits - reference(model, vis, tokens, imgs)).abs().max().item() < 1e-4


def test_64_greedy_tokens_equal_transformers(vl, native):
    model, _, torch_trunk, vis = vl
    tokens, mm = vis.prompt(TWO, images())
    ref = reference(model, vis, tokens, images(), new=64)
    for trunk in (torch_trunk, native):
        st = trunk.new_state()
        ours = [int(trunk.prefill(st, tokens, mm=mm).logits[-1].argmax())]
        for _ in range(63):
            ours.append(int(trunk.step(st, [ours[-1]]).logits[-1].argmax()))
        assert st.rope_delta == mm.delta and ours == ref, trunk.step_name


def test_native_step_logits_equal_transformers(vl, native):
    model, _, _, vis = vl
    tokens, mm = vis.prompt(TWO, images())
    out = native.prefill(native.new_state(), tokens, want_logits=True, mm=mm)
    assert (out.logits - reference(model, vis, tokens, images())).abs().max().item() < 1e-4


def test_placeholders_and_images_must_agree(vl):
    _, _, _, vis = vl
    with pytest.raises(TurboError, match="more image placeholders than the 1 images given"):
        vis.prompt(TWO, images()[:1])
    with pytest.raises(TurboError, match="2 images given, and the prompt places 1"):
        vis.prompt(ONE, images())


def test_moe_checkpoint_64_greedy_tokens(tmp_path):
    """A Qwen3_5MoeForConditionalGeneration repacked with its tower: the routed trunk after images."""
    import turbo

    model, out = make_vl_install(tmp_path, seed=5, moe=True)
    rt = turbo.open(out, backend="cpu")
    vis = Vision.from_install(rt.install)
    tokens, _ = vis.prompt(TWO, images())
    ours = rt.generate(TWO, images=images(), max_new_tokens=64, policy="off").tokens
    assert ours == reference(model, vis, tokens, images(), new=64)
