"""Image preprocessing (turbo/vision/image.py): the tensors equal transformers' Qwen2-VL PIL
processor's, from every kind of input; malformed and hostile images refused in one line."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from turbo.errors import TurboError
from turbo.vision.image import ImageSpec, prepare

CLIP = dict(mean=(0.48145466, 0.4578275, 0.40821073), std=(0.26862954, 0.26130258, 0.27577711))
CASES = [((50, 37), "RGB", ImageSpec(patch=4, merge=2, min_pixels=64, max_pixels=4096)),
         ((300, 90), "RGBA", ImageSpec(patch=16, merge=2, min_pixels=32 * 32, max_pixels=128 * 128, **CLIP)),
         ((20, 64), "L", ImageSpec(patch=3, merge=1, temporal=1, min_pixels=100, max_pixels=2000)),
         ((33, 33), "P", ImageSpec()),
         ((640, 480), "RGB", ImageSpec(patch=14, merge=2, min_pixels=56 * 56, max_pixels=200 * 200))]


def png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def random_image(w: int, h: int, mode: str, seed: int = 0) -> Image.Image:
    arr = np.random.default_rng(seed).integers(0, 255, (h, w, 4 if mode == "RGBA" else 3), dtype=np.uint8)
    return Image.fromarray(arr).convert(mode)


@pytest.mark.parametrize("size,mode,spec", CASES)
def test_equals_transformers_processor(tmp_path, size, mode, spec):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    img = random_image(*size, mode)
    proc = Qwen2VLImageProcessorPil(patch_size=spec.patch, merge_size=spec.merge, temporal_patch_size=spec.temporal,
                                    size={"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels},
                                    image_mean=list(spec.mean), image_std=list(spec.std))
    ref = proc(images=[img], return_tensors="pt")
    data = png(img)
    (tmp_path / "a.png").write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    for source in (img, data, tmp_path / "a.png", str(tmp_path / "a.png"), url):
        ours = prepare(source, spec)
        assert torch.equal(ours.pixels, ref["pixel_values"])
        assert [list(ours.grid)] == ref["image_grid_thw"].tolist()


def huge_header_png(w: int, h: int) -> bytes:
    """A valid PNG signature and IHDR claiming w x h, with one tiny IDAT: only the header is real."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


def gif(frames: int) -> bytes:
    imgs = [random_image(16, 16, "RGB", s).convert("P") for s in range(frames)]
    buf = io.BytesIO()
    imgs[0].save(buf, "GIF", save_all=True, append_images=imgs[1:])
    return buf.getvalue()


@pytest.mark.parametrize("source,needle", [
    (huge_header_png(100_000, 100_000), "pixel budget"),  # PIL's own bomb check, read off the header
    (huge_header_png(8_000, 8_000), "8000 x 8000 pixels, over the 40,000,000 pixel budget"),  # turbo's
    (png(random_image(64, 64, "RGB"))[:200], "not a readable image"),
    (png(Image.new("RGB", (1, 1))), "minimum side"),
    (b"not an image at all", "not a readable image"),
    (gif(3), "animated"),
    (png(Image.new("RGB", (4000, 10))), "aspect ratio"),
    ("data:image/png;base64,!!!", "base64"),
    ("data:text/plain,hello", "expected data:image"),
    ("/nonexistent/x.png", "no such image file"),
])
def test_refused_in_one_line(source, needle):
    with pytest.raises(TurboError) as e:
        prepare(source, ImageSpec())
    assert needle in str(e.value) and "\n" not in str(e.value)
