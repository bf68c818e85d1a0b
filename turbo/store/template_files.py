"""What a checkpoint or an install carries beside its weights for chat: the chat template's
text (chat_template.jinja, or tokenizer_config.json's chat_template), its special tokens, and
the ids a generation stops at (config.json's eos ids, then generation_config.json's). Read, not
compiled: turbo/chat/template.py compiles and renders it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..errors import TurboError, one_line
from .arch import _token_ids, read_config_json, show

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclasses.dataclass(frozen=True)
class TemplateFiles:
    """A directory's chat template (None: it has none), where it was found, its special tokens."""

    source: str | None
    where: str
    special_tokens: dict[str, str]


def read_template(directory: Path) -> TemplateFiles:
    """`chat_template.jinja` if present, else tokenizer_config.json's `chat_template` (its text,
    or Hugging Face's list of {name, template}: the one named "default"). Read, not compiled."""
    config_path = directory / TOKENIZER_CONFIG
    config = read_config_json(config_path) if config_path.is_file() else {}
    special = {}
    for name in SPECIAL_TOKEN_NAMES:  # a string, or an AddedToken written as {"content": ...}
        token = config.get(name)
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str):
            special[name] = token
    path = directory / TEMPLATE_FILE
    if path.is_file():
        try:
            return TemplateFiles(path.read_text(encoding="utf-8"), str(path), special)
        except (OSError, UnicodeDecodeError) as e:
            raise TurboError(f"{path}: not readable UTF-8 text ({one_line(e)})") from None
    where = f"{config_path} (chat_template)"
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return TemplateFiles(value, where, special)
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in value):
        named = {t["name"]: t.get("template") for t in value}
        if isinstance(named.get("default"), str):
            return TemplateFiles(named["default"], f"{config_path} (chat_template 'default')", special)
        raise TurboError(f"{where}: named templates {', '.join(map(repr, named))} but no text named 'default'")
    raise TurboError(f"{where}: expected the template's text or a list of {{name, template}}, got {show(value)}")


def generation_eos_ids(directory: Path, vocab: int) -> tuple[int, ...]:
    """generation_config.json's eos_token_id (one id or a list), each below `vocab`; () without one."""
    path = directory / GENERATION_CONFIG
    if not path.is_file():
        return ()
    return _token_ids(read_config_json(path).get("eos_token_id"), vocab, str(path))


def end_of_generation_ids(config_ids: tuple[int, ...], directory: Path, vocab: int) -> tuple[int, ...]:
    """Every id a generation stops at: config.json's eos ids (`config_ids`), then generation_config.json's
    that are not among them (transformers' generate and llama.cpp stop at all of them, in any mode)."""
    return tuple(dict.fromkeys(config_ids + generation_eos_ids(directory, vocab)))
