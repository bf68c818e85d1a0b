"""An install's parts checked against each other when it opens: the config's layer count
against the trunk's tensors, the drafter's config against the trunk's, and the tokenizer's
ids against the model's vocab and eos ids."""

from __future__ import annotations

import re

from tokenizers import Tokenizer

from ..drafters.dflash_config import DflashConfig, parse_drafter_config
from ..drafters.mtp import declared_layers
from ..errors import TurboError
from ..model.trunk import PREFIX
from ..store.arch import Arch
from ..store.install import DRAFTER_DIR, Install
from ..store.tensor_shapes import MTP_PREFIX

_LAYER = re.compile(r"(trunk|mtp)\.layers\.(\d+)\.")


# Rows past the tokenizer's last id are padding: a checkpoint rounds its embedding up to a multiple
# of 128 x its tensor-parallel ranks (Megatron's make-vocab-size-divisible-by, up to 8 ranks), fewer
# than this many rows. Qwen3.5: 248,077 ids (with the added tokens) in 248,320 rows, 243 of padding;
# Qwen2.5 / Qwen3: 151,665 / 151,669 in 151,936. A tokenizer shorter by more belongs to another model:
# the ids past it, which the model does produce, would decode to nothing.
PADDING_ROWS = 1024


def top_id(tokenizer: Tokenizer) -> int:
    """The tokenizer's largest id (-1: none). Its model's ids are 0..size-1 and its added tokens
    carry their own: read from those two, not from the whole vocabulary as a dict (0.2 s for
    Qwen3.5's 248k tokens, on every open); where id size-1 is missing the ids have gaps, and the
    whole vocabulary is read."""
    size = tokenizer.get_vocab_size(with_added_tokens=False)
    added = max(tokenizer.get_added_tokens_decoder(), default=-1)
    if size and tokenizer.id_to_token(size - 1) is None:
        return max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)
    return max(size - 1, added)


def check_tokenizer(tokenizer: Tokenizer, vocab: int, where: str, eos_ids: tuple[int, ...]) -> None:
    """Refuse a tokenizer that does not match the model's vocab: one that can produce an id the
    embedding has no row for, one that ends more than padding before the model's rows, or one
    without a token for an id generation stops at (`eos_ids`: config.json's and generation_config.json's)."""
    top = top_id(tokenizer)
    if top >= vocab:
        raise TurboError(f"{where}: the tokenizer's ids reach {top} (a vocabulary of {top + 1}), expected ids below "
                         f"the model's vocab_size {vocab}")
    if vocab - (top + 1) >= PADDING_ROWS:
        raise TurboError(f"{where}: the tokenizer's ids end at {top} (a vocabulary of {top + 1}) for the model's "
                         f"vocab_size {vocab}, expected at least {vocab - PADDING_ROWS + 1} (a checkpoint pads its "
                         f"rows past its tokenizer's by fewer than {PADDING_ROWS}: is it another model's tokenizer?)")
    missing = next((i for i in eos_ids if tokenizer.id_to_token(i) is None), None)
    if missing is not None:
        raise TurboError(f"{where}: the tokenizer has no token {missing}, an eos_token_id of config.json or "
                         f"generation_config.json (expected every id generation stops at)")


def load_tokenizer(path, vocab: int, eos_ids: tuple[int, ...]) -> Tokenizer:
    """`path` (a tokenizer.json) loaded by `tokenizers` and checked against `vocab` and `eos_ids`, as
    an install's is when it opens: repack refuses a malformed one before writing anything, rather
    than copying it into an install that then fails to open."""
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        why = " ".join(str(e).split())
        raise TurboError(f"{path}: not a tokenizers file ({why[:200]})") from None
    check_tokenizer(tokenizer, vocab, str(path), eos_ids)
    return tokenizer


def check_install(install: Install, tokenizer: Tokenizer) -> DflashConfig | None:
    """Refuse parts that disagree; returns the drafter's parsed config (None without one)."""
    arch, root = install.arch, install.path
    if install.index.has_prefix(f"{PREFIX}layers.{arch.num_layers}."):
        raise TurboError(f"{root / 'config.json'}: field 'num_hidden_layers' is {arch.num_layers}, but the install "
                         f"carries {PREFIX}layers.{arch.num_layers}.* tensors (expected every trunk layer declared)")
    check_tensor_names(sorted(install.index.entries), arch, install.config, str(root / "config.json"))
    drafter = None
    if install.drafter_config is not None:  # before a plan reads it
        drafter = parse_drafter_config(install.drafter_config, arch, str(root / DRAFTER_DIR / "config.json"))
    check_tokenizer(tokenizer, arch.vocab, str(root / "tokenizer.json"), install.eos_ids)
    return drafter


def check_tensor_names(names: list[str], arch: Arch, config: dict, where: str) -> None:
    """Refuse tensors the architecture does not have, naming the first: a trunk layer past
    num_hidden_layers, a linear's bias (turbo's layers have none: attention_bias false), MTP
    layers other than the count the config declares."""
    mtp_layers = 0
    for name in names:
        m = _LAYER.match(name)
        if name.endswith(".bias") and name.startswith((PREFIX, MTP_PREFIX)):
            raise TurboError(f"{name}: a bias tensor, which this architecture does not have (turbo's projections "
                             "carry no biases; attention_bias must be false)")
        if m and m[1] == "trunk" and int(m[2]) >= arch.num_layers:
            raise TurboError(f"{name}: a tensor of trunk layer {m[2]}, but {where} declares num_hidden_layers "
                             f"{arch.num_layers} (layers 0..{arch.num_layers - 1})")
        if m and m[1] == "mtp":
            mtp_layers = max(mtp_layers, int(m[2]) + 1)
    declared = declared_layers(config)
    if mtp_layers and declared and declared != mtp_layers:
        raise TurboError(f"{where}: field 'mtp_num_hidden_layers' is {declared}, but the install carries "
                         f"{mtp_layers} MTP layer(s) (mtp.layers.*)")
