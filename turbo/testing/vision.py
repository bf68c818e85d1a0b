"""Small random Qwen3_5ForConditionalGeneration checkpoints (a trunk and a vision tower) in the
HF layout, and installs made from them by the real repack (tests/test_vision_*.py).
transformers is an optional test dependency: imported inside the functions."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from ..repack import repack
from .checkpoints import MOE_BASE, hf_config, randomize_, tiny_tokenizer

START_ID, IMAGE_ID, END_ID = 317, 318, 319  # the tiny vocabulary's last three ids: special tokens
MARKERS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")


def marker_ids(vocab: int) -> tuple[int, int, int]:
    """(vision_start, image, vision_end): the vocabulary's last three ids."""
    return vocab - 3, vocab - 2, vocab - 1


def word_level(vocab: int):
    """A tokenizer of words t0..t{vocab-1} (a small vocabulary: the sampling tests')."""
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def vl_tokenizer(vocab: int):
    """The tiny BPE with the three vision markers as its last ids (added as special tokens)."""
    tok = tiny_tokenizer(vocab - len(MARKERS))
    tok.add_special_tokens(list(MARKERS))
    assert [tok.token_to_id(m) for m in MARKERS] == [START_ID, IMAGE_ID, END_ID] and tok.get_vocab_size() == vocab
    return tok


def vision_dict(patch: int = 4, merge: int = 2, depth: int = 2, out_hidden: int = 64, hidden: int = 32) -> dict:
    return dict(depth=depth, hidden_size=hidden, intermediate_size=48 if hidden == 32 else 2 * hidden, num_heads=2,
                patch_size=patch,
                spatial_merge_size=merge, temporal_patch_size=2, out_hidden_size=out_hidden, num_position_embeddings=16)


def make_vl_checkpoint(directory: Path, seed: int = 0, patch: int = 4, merge: int = 2, depth: int = 2,
                       vision_hidden: int = 32, moe: bool = False, **over):
    """A Qwen3_5ForConditionalGeneration (moe: Qwen3_5MoeForConditionalGeneration) with random
    weights saved as an HF checkpoint: the tiny trunk with a rotary of 8 dims in mrope sections
    (2, 1, 1); returns the model."""
    import transformers  # an optional test dependency

    torch.manual_seed(seed)
    text = hf_config(**({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                             "mrope_section": [2, 1, 1], "mrope_interleaved": True}} | over)).to_dict()
    if moe:
        text = {k: v for k, v in text.items() if k not in ("intermediate_size", "model_type")} | MOE_BASE
    kind = "Qwen3_5Moe" if moe else "Qwen3_5"
    cfg = getattr(transformers, kind + "Config")(
        text_config=text, vision_config=vision_dict(patch, merge, depth, text["hidden_size"], vision_hidden),
        **dict(zip(("vision_start_token_id", "image_token_id", "vision_end_token_id", "video_token_id"),
                   marker_ids(text["vocab_size"]) + (text["vocab_size"] - 4,))),
        tie_word_embeddings=False)
    model = getattr(transformers, kind + "ForConditionalGeneration")(cfg).float().eval()
    randomize_(model, seed)
    with torch.no_grad():  # the tower's LayerNorms centred on 1 (randomize_ centres RMSNorms' 1 + w on 0)
        for name, p in model.model.visual.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.add_(1.0)
    model.save_pretrained(directory)
    vocab = text["vocab_size"]
    (vl_tokenizer(vocab) if vocab == 320 else word_level(vocab)).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    (directory / "preprocessor_config.json").write_text(json.dumps(
        {"patch_size": patch, "merge_size": merge, "temporal_patch_size": 2, "image_mean": [0.5] * 3,
         "image_std": [0.5] * 3, "size": {"shortest_edge": 64, "longest_edge": 64 * 64}}))
    return model


def make_vl_install(tmp: Path, seed: int = 0, **over):
    src = tmp / f"vl{seed}"
    model = make_vl_checkpoint(src, seed, **over)
    return model, repack(src, tmp / f"vl-install{seed}", quiet=True)
