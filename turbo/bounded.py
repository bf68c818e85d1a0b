"""Bounds on what a model writes or a caller hands us, checked before a reader that recurses or
reads whole sees it: JSON text's nesting measured by a linear scan before `json.loads` (which
recurses, and whose result every later walk -- json.dumps, the template's data, repr -- recurses
over again), Python values' nesting by a loop, small files read at most so many bytes. Python's
recursion limit is not a bound: past it a RecursionError escapes as a traceback or a 500."""

from __future__ import annotations

import json
import math
import os
import re
import stat
from itertools import accumulate
from pathlib import Path
from typing import Any, Mapping

from .errors import TurboError

# JSON nesting a value may have: the server's body limit (serve/body.py MAX_DEPTH); tool schemas
# and arguments are the deepest honest values, a few levels
MAX_NESTING = 64
# a string (unterminated ones run to the end), or a bracket: what a nesting scan looks at
_STRING = re.compile(r'"(?:[^"\\]|\\[\s\S])*(?:"|\\?\Z)')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def text_nesting(text: str) -> int:
    """How deep JSON text nests (brackets outside strings), in linear time whatever the text."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


class NotStrictJson(ValueError):
    """JSON text refused by `strict_loads`: nested past MAX_NESTING, or holding a non-finite number."""


def strict_loads(text: str) -> Any:
    """`json.loads` of text a model or a client wrote, as strict JSON: nesting at most MAX_NESTING
    (measured first: json.loads itself recurses), no NaN / Infinity / 1e999 (Python's reader takes
    them, no other JSON reader does). A ValueError otherwise (NotStrictJson for these two; text
    that is not JSON at all, "Infinity and beyond", is the reader's own ValueError)."""
    depth = text_nesting(text)
    if depth > MAX_NESTING:
        raise NotStrictJson(f"it nests {depth} levels deep, over the limit of {MAX_NESTING}")
    non_finite: list[str] = []

    def number(literal: str) -> float:
        value = float(literal)
        if not math.isfinite(value):
            non_finite.append(literal)
        return value

    def constant(name: str) -> float:
        non_finite.append(name)
        return math.nan

    value = json.loads(text, parse_constant=constant, parse_float=number)
    if non_finite:  # (after the whole text read: only JSON with a non-finite number is refused for it)
        raise NotStrictJson(f"it holds {non_finite[0]}, not a finite number: JSON has no form for it")
    return value


_LEAVES = (str, int, float, type(None))
_CONTAINERS = (dict, list, tuple, Mapping)


def check_nesting(value: Any, what: str, field: str | None = None, limit: int = MAX_NESTING) -> None:
    """`value` (dicts, lists, tuples of anything) nested at most `limit` levels, else a TurboError
    naming `what`. A loop, not a recursion: the check must hold where recursion fails."""
    stack = [(value, 0)] if isinstance(value, _CONTAINERS) else []
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            raise TurboError(f"{what} is nested more than {limit} levels deep", field=field)
        items = item.values() if isinstance(item, Mapping) else item
        # (text and numbers skipped first: most of a conversation, and an ABC's isinstance is slow)
        stack.extend((v, depth + 1) for v in items if not isinstance(v, _LEAVES) and isinstance(v, _CONTAINERS))


SMALL_FILE_BYTES = 16 << 20  # a tools list or a chat template (real ones: kilobytes)


def read_small_text(path: str | Path, what: str, field: str | None = None, limit: int = SMALL_FILE_BYTES) -> str:
    """A regular file's UTF-8 text, at most `limit` bytes, else a TurboError naming `what`: a
    device or a pipe (/dev/zero never ends) is refused before a byte is read."""
    try:  # opened without blocking: opening a named pipe nobody writes would wait for ever
        fd = os.open(Path(path).expanduser(), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise TurboError(f"{what}: cannot be read ({e.strerror or e})", field=field) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise TurboError(f"{what}: not a regular file", field=field)
        chunks, size = [], 0
        while size <= limit and (chunk := os.read(fd, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise TurboError(f"{what}: over the {limit >> 20} MiB limit", field=field)
        return b"".join(chunks).decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TurboError(f"{what}: cannot be read ({getattr(e, 'strerror', None) or e})", field=field) from None
    finally:
        os.close(fd)
