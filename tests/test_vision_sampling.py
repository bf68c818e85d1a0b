"""Speculative sampling with an image in the context keeps the target distribution: the first
two committed tokens of seeded generations (ngram drafts, blocks 1..8, both rollbacks) against
the exact target from the trunk's logits after the multimodal prompt (test_sampling's check)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from test_sampling import fits

import turbo
from turbo.sequence.sampling import SamplingParams, probabilities
from turbo.testing.vision import make_vl_install, marker_ids
from turbo.vision.runtime import vision_of

VOCAB = 12
START, IMAGE, END = marker_ids(VOCAB)
PROMPT = [3, 5, START, IMAGE, END, 7, 2, 3, 5]  # ends with a repeat: the n-gram drafter proposes
SAMPLING = dict(temperature=0.8, top_p=0.95, stop_at_eos=False)
CONFIGS = [(b, rb) for b in (1, 2, 4, 8) for rb in ("checkpoint", "replay")]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    _, out = make_vl_install(tmp_path_factory.mktemp("vl-sampling"), seed=6, vocab_size=VOCAB)
    rt = turbo.open(out, backend="cpu")
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 56, 3), dtype=np.uint8))
    return rt, vision_of(rt).prepare([image])


def target(rt, images) -> dict[tuple[int, int], float]:
    tokens, mm = vision_of(rt).prompt(PROMPT, images)
    params = SamplingParams(SAMPLING["temperature"], top_p=SAMPLING["top_p"])
    trunk = rt.trunk

    def after(extra: list[int]):
        st = trunk.new_state()
        out = trunk.prefill(st, tokens, mm=mm)
        return probabilities((trunk.step(st, extra).logits if extra else out.logits)[-1:], params)[0]

    first = after([])
    return {(a, b): float(first[a] * pb) for a in range(VOCAB) for b, pb in enumerate(after([a]))}


def test_speculative_sampling_after_an_image_keeps_the_distribution(small):
    rt, images = small
    samples = []
    for seed in range(400):
        block, rollback = CONFIGS[seed % len(CONFIGS)]
        out = rt.generate(PROMPT, images=images, max_new_tokens=2, seed=seed, policy="fixed", block=block,
                          rollback=rollback, drafter="ngram", **SAMPLING)
        samples.append(tuple(out.tokens[:2]))
    assert fits(samples, target(rt, images))
