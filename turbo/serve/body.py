"""A request body as JSON, parsed and checked before anything reads its fields: valid Unicode
everywhere, nesting bounded, and a prompt (or a message's text) no longer than the context could
hold. Torch-free, as limits.py and api_error.py are: the front process (front.py) refuses with
these before a request reaches the engine's process, and the engine's app checks the same."""

from __future__ import annotations

import json
from typing import Any

from .api_error import ApiError
from .limits import check_prompt_chars


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise ApiError(f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise ApiError(f"the request body is a JSON {type(body).__name__}, expected an object")
    _check_tree(body)
    return body


MAX_DEPTH = 64  # JSON nesting a body may have (tool schemas are the deepest honest part)
SCALARS = {int, float, bool, type(None)}


def _check_tree(body: dict) -> None:
    """Every string of the body (keys too) encodable as UTF-8, and nesting at most MAX_DEPTH: a
    lone surrogate (JSON's "\\udcff") would fail when echoed in an answer, and deep nesting would
    overflow the recursion of what renders or copies it, both as a 500 long after parsing. The
    walk is a loop, not a recursion, for the same reason."""
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ApiError(f"{where} is nested more than {MAX_DEPTH} levels deep", where)
        if isinstance(value, dict):
            for k, v in value.items():
                path = f"{where}.{k}" if where else k
                _utf8(k, path)
                stack.append((v, path, depth + 1))
        elif isinstance(value, list):  # (a prompt of ids is millions of ints: nothing of them to walk)
            if not set(map(type, value)) <= SCALARS:
                stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)
                             if isinstance(v, (dict, list, str)))
        elif isinstance(value, str):
            _utf8(value, where)


def _utf8(text: str, where: str) -> None:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ApiError(f"{ascii(where)[1:-1]}: not valid Unicode text (a lone surrogate at character {e.start})",
                           ascii(where)[1:-1]) from None


def check_text_lengths(prompt: Any, messages: Any, chat: bool, max_chars: int, max_positions: int) -> None:
    """A 400 for a prompt, or one message's text, longer than any prompt the context could hold,
    by its length alone (no tokenizer). Values of other types pass: the field checks refuse them."""
    if not chat:
        if isinstance(prompt, str):
            check_prompt_chars(prompt, max_chars, max_positions, "prompt")
        return
    for i, m in enumerate(messages if isinstance(messages, list) else ()):
        content = m.get("content") if isinstance(m, dict) else None
        texts = [content] if isinstance(content, str) else [
            p["text"] for p in content if isinstance(p, dict) and p.get("type") == "text"
            and isinstance(p.get("text"), str)] if isinstance(content, list) else []
        if sum(map(len, texts)) > max_chars:
            check_prompt_chars("".join(texts), max_chars, max_positions, f"messages[{i}].content")
