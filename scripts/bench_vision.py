"""Time to encode an image with the vision tower at the Qwen3.5-0.8B shape's published
vision_config (random weights), turbo's (turbo/vision/tower.py) against transformers'
Qwen3_5VisionModel, interleaved; and, with --install, the trunk's prefill of the image's tokens
(turbo's multimodal prefill of those rows). Prints a markdown table (docs/benchmarks.md).

    python scripts/bench_vision.py [--sizes 448x448,1024x768] [--reps 5] [--install DIR] [--tiny]

--tiny: a tiny tower and one small image (checks the script runs; the figures mean nothing).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from PIL import Image

from turbo.vision.config import vision_config
from turbo.vision.image import ImageSpec, prepare
from turbo.vision.tower import encode, tower_from_state_dict

# config.json's vision_config of Qwen/Qwen3.5-0.8B (its text hidden size is 1024)
VISION_0_8B = dict(depth=12, hidden_size=768, hidden_act="gelu_pytorch_tanh", intermediate_size=3072, num_heads=12,
                   in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=1024,
                   num_position_embeddings=2304)
TINY = dict(VISION_0_8B, depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
            num_position_embeddings=16, patch_size=4)


def best(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="448x448,1024x768")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--install", help="an install with a tower of this shape: also time the prefill of the image")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    from transformers import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    vc = TINY if args.tiny else VISION_0_8B
    sizes = ["40x56"] if args.tiny else args.sizes.split(",")
    torch.manual_seed(0)
    ref = Qwen3_5VisionModel(Qwen3_5VisionConfig(**vc)).float().eval()
    c = vision_config({"vision_config": vc}, vc["out_hidden_size"])
    ours = tower_from_state_dict({"model.visual." + k: v for k, v in ref.state_dict().items()}, c)
    spec = ImageSpec(patch=c.patch, merge=c.merge, temporal=c.temporal, min_pixels=64 if args.tiny else 65536)
    print("| image | patches | tokens | turbo encode s | transformers encode s | max abs diff |")
    print("| --- | --- | --- | --- | --- | --- |")
    for size in sizes:
        w, h = (int(x) for x in size.split("x"))
        img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (h, w, 3), dtype=np.uint8))
        p = prepare(img, spec)
        grid = [p.grid]
        with torch.inference_mode():
            a, b = encode(c, ours, p.pixels, grid), ref(p.pixels, grid_thw=torch.tensor(grid)).pooler_output
            t_ours = t_ref = float("inf")
            for _ in range(args.reps):  # interleaved: the machine's drift hits both alike
                t_ours = min(t_ours, best(lambda: encode(c, ours, p.pixels, grid), 1))
                t_ref = min(t_ref, best(lambda: ref(p.pixels, grid_thw=torch.tensor(grid)), 1))
        print(f"| {size} | {p.pixels.shape[0]} | {p.tokens(c.merge)} | {t_ours:.4f} | {t_ref:.4f} | "
              f"{(a - b).abs().max().item():.1e} |")
        if args.install:
            prefill(args.install, img, args.reps)


def prefill(install: str, img, reps: int) -> None:
    """The trunk's prefill of one image's prompt (the tower's rows and the text around them)."""
    import turbo
    from turbo.vision.runtime import vision_of

    rt = turbo.open(install, backend="cpu")
    vis = vision_of(rt)
    ids = [vis.ids.vision_start, vis.ids.image, vis.ids.vision_end] + rt.encode("Describe the picture.")
    tokens, mm = vis.prompt(ids, [img])
    t = best(lambda: rt.trunk.prefill(rt.trunk.new_state(len(tokens) + 8), tokens, mm=mm), reps)
    print(f"|   prefill of {len(tokens)} rows ({rt.trunk.step_name} step) | | | {t:.4f} | | |")


if __name__ == "__main__":
    main()
