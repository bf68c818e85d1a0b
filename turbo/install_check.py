"""An install's parts checked against each other when it opens: the config's layer count
against the trunk's tensors, the drafter's config against the trunk's, and the tokenizer's
ids against the model's vocab."""

from __future__ import annotations

import re

from tokenizers import Tokenizer

from .arch import Arch
from .drafters.dflash_config import DflashConfig, parse_drafter_config
from .errors import TurboError
from .install import DRAFTER_DIR, Install
from .drafters.mtp import MTP_PREFIX, declared_layers
from .trunk import PREFIX

_LAYER = re.compile(r"(trunk|mtp)\.layers\.(\d+)\.")


def check_tokenizer(tokenizer: Tokenizer, vocab: int, where: str) -> None:
    """Refuse a tokenizer that can produce an id the embedding has no row for. A smaller one
    is normal: real checkpoints pad the model's vocab past the tokenizer's (Qwen3.5: 248320
    rows for about 248k tokens)."""
    top = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)
    if top >= vocab:
        raise TurboError(f"{where}: the tokenizer's ids reach {top} (a vocabulary of {top + 1}), expected ids below "
                         f"the model's vocab_size {vocab}")


def load_tokenizer(path, vocab: int) -> Tokenizer:
    """`path` (a tokenizer.json) loaded by `tokenizers` and its ids checked against `vocab`, as an
    install's is when it opens: repack refuses a malformed one before writing anything, rather
    than copying it into an install that then fails to open."""
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        why = " ".join(str(e).split())
        raise TurboError(f"{path}: not a tokenizers file ({why[:200]})") from None
    check_tokenizer(tokenizer, vocab, str(path))
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
    check_tokenizer(tokenizer, arch.vocab, str(root / "tokenizer.json"))
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
