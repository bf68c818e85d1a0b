"""An install's parts checked against each other when it opens: the config's layer count
against the trunk's tensors, the drafter's config against the trunk's, and the tokenizer's
ids against the model's vocab."""

from __future__ import annotations

from tokenizers import Tokenizer

from .drafters.dflash_config import DflashConfig, parse_drafter_config
from .errors import TurboError
from .install import DRAFTER_DIR, Install
from .trunk import PREFIX


def check_tokenizer(tokenizer: Tokenizer, vocab: int, where: str) -> None:
    """Refuse a tokenizer that can produce an id the embedding has no row for. A smaller one
    is normal: real checkpoints pad the model's vocab past the tokenizer's (Qwen3.5: 248320
    rows for about 248k tokens)."""
    top = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)
    if top >= vocab:
        raise TurboError(f"{where}: the tokenizer's ids reach {top} (a vocabulary of {top + 1}), expected ids below "
                         f"the model's vocab_size {vocab}")


def check_install(install: Install, tokenizer: Tokenizer) -> DflashConfig | None:
    """Refuse parts that disagree; returns the drafter's parsed config (None without one)."""
    arch, root = install.arch, install.path
    if install.index.has_prefix(f"{PREFIX}layers.{arch.num_layers}."):
        raise TurboError(f"{root / 'config.json'}: field 'num_hidden_layers' is {arch.num_layers}, but the install "
                         f"carries {PREFIX}layers.{arch.num_layers}.* tensors (expected every trunk layer declared)")
    drafter = None
    if install.drafter_config is not None:  # before a plan reads it
        drafter = parse_drafter_config(install.drafter_config, arch, str(root / DRAFTER_DIR / "config.json"))
    check_tokenizer(tokenizer, arch.vocab, str(root / "tokenizer.json"))
    return drafter
