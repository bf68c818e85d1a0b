"""A GGUF's tokenizer.ggml.* metadata back into the files an install carries: tokenizer.json (the
byte-level BPE: tokens, merges, the pre-tokenizer `tokenizer.ggml.pre` names, control tokens as
special ones), tokenizer_config.json, chat_template.jinja and generation_config.json's eos ids.
The pre-tokenizer splits are transformers' (integrations/gguf/gguf_tokenizer_mapping.py)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from ..errors import TurboError

QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the split before the byte-level mapping (None: GPT-2's own regex) and
# whether text is NFC-normalised first (Qwen's tokenizers are)
# ("gpt-2" is llama.cpp's name for GPT-2's split, "gpt2" an older spelling of turbo's test writer)
PRE = {"qwen35": (QWEN35_SPLIT, True), "qwen2": (QWEN2_SPLIT, True), "gpt-2": (None, False), "gpt2": (None, False)}
CONTROL, USER_DEFINED, UNUSED = 3, 4, 5  # llama.cpp's token types


def build_tokenizer(src) -> Tokenizer:
    model, pre = src.value("tokenizer.ggml.model"), src.value("tokenizer.ggml.pre", False) or "gpt2"
    if model != "gpt2":
        raise TurboError(f"{src.path}: tokenizer.ggml.model is {model!r}, expected 'gpt2' (Qwen's byte-level BPE)")
    if pre not in PRE:
        raise TurboError(f"{src.path}: tokenizer.ggml.pre is {pre!r}, turbo rebuilds {', '.join(PRE)}")
    tokens = src.value("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in src.value("tokenizer.ggml.merges")]
    types = src.value("tokenizer.ggml.token_type", False) or [1] * len(tokens)
    if len(types) != len(tokens):
        raise TurboError(f"{src.path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    added = {i for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)}
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):  # every id in the model's vocabulary: added tokens then keep theirs
        if types[i] != UNUSED:  # the converter's [PAD{i}] rows: ids the tokenizer never had
            vocab.setdefault(t, i)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    split, nfc = PRE[pre]
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated"),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # added tokens keep their ids: add them in id order, each right after the ids before it
    for i in sorted(added):
        special = types[i] == CONTROL
        token = AddedToken(tokens[i], special=special, normalized=False)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
        if tok.token_to_id(tokens[i]) != i:
            raise TurboError(f"{src.path}: token {i} ({tokens[i]!r}) would not keep its id in the rebuilt tokenizer")
    return tok


def write_tokenizer(src, out: Path) -> None:
    tok = build_tokenizer(src)
    tok.save(str(out / "tokenizer.json"))
    tokens = src.value("tokenizer.ggml.tokens")
    config: dict = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for name in ("bos", "eos", "padding", "unknown"):
        i = src.value(f"tokenizer.ggml.{name}_token_id", False)
        if i is not None and 0 <= i < len(tokens):
            config[{"padding": "pad_token", "unknown": "unk_token"}.get(name, f"{name}_token")] = tokens[i]
    add_bos = src.value("tokenizer.ggml.add_bos_token", False)
    if add_bos is not None:
        config["add_bos_token"] = bool(add_bos)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    template = src.value("tokenizer.chat_template", False)
    if template is not None:
        (out / "chat_template.jinja").write_text(template)
    eos = src.value("tokenizer.ggml.eos_token_id", False)
    if eos is not None:
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [int(eos)]}, indent=2))
