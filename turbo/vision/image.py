"""Image preprocessing as transformers' Qwen2-VL-style processor (Qwen2VLImageProcessorPil, the
one Qwen3.5 checkpoints name) does it: RGB (alpha composited on white), a bicubic resize to a
multiple of patch * merge within min/max pixels (`smart_resize`), rescale and normalise, the
still image repeated over the temporal patch, patches in merge-block order -> pixel_values
[patches, C*T*P*P] and its grid (1, h, w) in patches.

Inputs: a path (or file:// URL), bytes, a PIL image, or a `data:` URL; remote URLs are refused. Refused in one line, before anything is
decoded where the header tells: an unreadable / truncated / corrupt file, an animated image, a
side under MIN_SIDE, more than MAX_PIXELS pixels, an aspect ratio over MAX_RATIO, a file over
MAX_BYTES."""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np
import torch

from ..errors import TurboError
from ..extras import require

MAX_PIXELS = 40_000_000  # the decode budget, read off the header: a 100,000 x 100,000 PNG never decodes
MAX_BYTES = 64 << 20  # an image file or data: URL payload
MIN_SIDE = 8  # pixels: a smaller image (a 1x1 tracking pixel) carries nothing to read
MAX_RATIO = 200  # transformers' smart_resize refuses a longer side over 200 x the shorter

ImageInput = Union[str, Path, bytes, "PIL.Image.Image"]  # noqa: F821


@dataclass(frozen=True)
class ImageSpec:
    """The processor's settings (the install's preprocessor_config.json; Qwen3.5's published ones)."""

    patch: int = 16
    merge: int = 2
    temporal: int = 2
    min_pixels: int = 65536
    max_pixels: int = 16777216
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @property
    def factor(self) -> int:
        return self.patch * self.merge


@dataclass
class PreparedImage:
    pixels: torch.Tensor  # [t*h*w, C*T*P*P] fp32
    grid: tuple[int, int, int]  # (t, h, w) in patches

    def tokens(self, merge: int) -> int:
        t, h, w = self.grid
        return t * h * w // (merge * merge)


def spec_from_files(directory: Path, patch: int, merge: int, temporal: int) -> ImageSpec:
    """The install's preprocessor_config.json over the defaults; the tower's own patch, merge and
    temporal sizes win (the processor must cut what the tower reads)."""
    base = ImageSpec(patch=patch, merge=merge, temporal=temporal)
    path = directory / "preprocessor_config.json"
    if not path.is_file():
        return base
    try:
        cfg = json.loads(path.read_text())
        size = cfg.get("size") or {}
        lo = int(cfg.get("min_pixels") or size.get("shortest_edge") or base.min_pixels)
        hi = int(cfg.get("max_pixels") or size.get("longest_edge") or base.max_pixels)
        mean = tuple(float(x) for x in cfg.get("image_mean", base.mean))
        std = tuple(float(x) for x in cfg.get("image_std", base.std))
    except (ValueError, TypeError, AttributeError, OSError) as e:
        raise TurboError(f"{path}: not a readable preprocessor config ({e})") from None
    if not (0 < lo <= hi) or len(mean) != 3 or len(std) != 3 or not all(s > 0 for s in std):
        raise TurboError(f"{path}: min/max pixels {lo}/{hi}, mean {mean}, std {std}: expected 0 < min <= max and three positive stds")
    return ImageSpec(patch, merge, temporal, lo, hi, mean, std)  # type: ignore[arg-type]


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' smart_resize: both sides multiples of `factor`, the area within bounds, the
    aspect ratio kept as closely as that allows."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _bytes_of(source: str | Path | bytes) -> tuple[bytes, str]:
    """The encoded image and what to call it in a message."""
    if isinstance(source, bytes):
        if len(source) > MAX_BYTES:
            raise TurboError(f"image bytes: {len(source)} bytes, over the {MAX_BYTES >> 20} MiB limit")
        return source, "image bytes"
    if isinstance(source, str) and source.startswith("data:"):
        head, sep, payload = source.partition(",")
        if not sep or not head.endswith(";base64") or not head[5:].startswith("image/"):
            raise TurboError(f"data URL {head[:40]!r}: expected data:image/...;base64,<payload>")
        if len(payload) > MAX_BYTES * 4 // 3 + 4:
            raise TurboError(f"data URL: over the {MAX_BYTES >> 20} MiB image limit")
        try:
            return base64.b64decode(payload, validate=True), "data URL"
        except (binascii.Error, ValueError):
            raise TurboError("data URL: its payload is not valid base64") from None
    if isinstance(source, str) and source.split("://", 1)[0].lower() in ("http", "https", "ftp"):
        raise TurboError(f"image {source[:60]!r}: remote URLs are not fetched (give a path, bytes or a data: URL)")
    path = Path(source[len("file://"):] if isinstance(source, str) and source.startswith("file://") else source)
    try:
        if not path.is_file():
            raise TurboError(f"{path}: no such image file")
        if path.stat().st_size > MAX_BYTES:
            raise TurboError(f"{path}: {path.stat().st_size} bytes, over the {MAX_BYTES >> 20} MiB image limit")
        return path.read_bytes(), str(path)
    except OSError as e:
        raise TurboError(f"{path}: not readable ({e.strerror or e})") from None


def decode(source: ImageInput):
    """An RGB PIL image from any accepted input, every limit checked (the header's first)."""
    Image = require("PIL.Image", "vision")  # an optional dependency (the `vision` extra): only images need it

    if not isinstance(source, (str, Path, bytes, Image.Image)):
        raise TurboError(f"image of type {type(source).__name__}: expected a path, bytes, a PIL image or a data: URL")
    if isinstance(source, Image.Image):
        img, name = source, "PIL image"
    else:
        data, name = _bytes_of(source)
        try:
            img = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError:
            raise TurboError(f"{name}: over the {MAX_PIXELS:,} pixel budget (a decompression bomb?)") from None
        except Exception as e:  # PIL raises many kinds on a corrupt header: every one is the user's file
            raise TurboError(f"{name}: not a readable image ({type(e).__name__}: {str(e)[:80]})") from None
    w, h = img.size
    if w * h > MAX_PIXELS:
        raise TurboError(f"{name}: {w} x {h} pixels, over the {MAX_PIXELS:,} pixel budget")
    if min(w, h) < MIN_SIDE:
        raise TurboError(f"{name}: {w} x {h} pixels, under the {MIN_SIDE}-pixel minimum side")
    if max(w, h) / min(w, h) > MAX_RATIO:
        raise TurboError(f"{name}: {w} x {h} pixels, an aspect ratio over {MAX_RATIO}")
    if getattr(img, "is_animated", False) or getattr(img, "n_frames", 1) > 1:
        raise TurboError(f"{name}: an animated image ({getattr(img, 'n_frames', '?')} frames): send one frame")
    try:
        img.load()
        if "A" in img.getbands() or img.info.get("transparency") is not None:  # onto white, as transformers does
            rgba = img.convert("RGBA")
            return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
        return img.convert("RGB")
    except Exception as e:  # a truncated or corrupt body
        raise TurboError(f"{name}: not a readable image ({type(e).__name__}: {str(e)[:80]})") from None


def prepare(source: ImageInput, spec: ImageSpec) -> PreparedImage:
    """The tensors transformers' processor gives for one image (pixel_values, image_grid_thw)."""
    Image = require("PIL.Image", "vision")  # (as in decode: the `vision` extra)

    rgb = decode(source)
    h, w = smart_resize(rgb.height, rgb.width, spec.factor, spec.min_pixels, spec.max_pixels)
    arr = np.array(rgb.resize((w, h), resample=Image.BICUBIC))  # [h, w, 3] uint8
    x = (arr.astype(np.float64) * (1 / 255)).astype(np.float32)
    x = ((x - np.array(spec.mean, dtype=np.float32)) / np.array(spec.std, dtype=np.float32)).transpose(2, 0, 1)
    p, m, gh, gw = spec.patch, spec.merge, h // spec.patch, w // spec.patch
    x = x.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # (bh, bw, mh, mw, C, ph, pw)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], spec.temporal, p, p))
    return PreparedImage(torch.from_numpy(np.ascontiguousarray(x).reshape(gh * gw, -1)), (1, gh, gw))
