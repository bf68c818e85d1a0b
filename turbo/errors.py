"""The one error type a user can cause: it ends the CLI in one line, exit status 2; the check
that text is text (`checked_text`) and the number a field's ASCII digits spell (`ascii_decimal`);
the argument parser of the argparse CLIs (repack, train), whose usage errors end the same way."""

import argparse
import json
import sys
from typing import NoReturn


class TurboError(Exception):
    """A problem with what the user gave us (install, config, prompt, block), not a bug.

    The message names the thing (file, tensor, field, value) and what was expected; `field` is
    the option it concerns, where one does (the server names it as the request's field).
    """

    def __init__(self, message: str = "", field: str | None = None):
        super().__init__(message)
        self.field = field


def json_shown(value: object) -> str:
    """A request value as an error message quotes it: its JSON (repr where it has none), 200 characters at most."""
    try:
        return json.dumps(value)[:200]
    except (TypeError, ValueError):
        return repr(value)[:200]


def ascii_decimal(text: str | bytes, max_digits: int) -> int | None:
    """`text` as the non-negative integer its 1..max_digits ASCII digits spell, else None (a
    sign, a space, anything else). str.isdigit() alone also takes "²", which int() refuses, and
    "٣" (Arabic-Indic three), which int() reads as 3; and int() of thousands of digits is slow,
    then refused."""
    if 0 < len(text) <= max_digits and text.isascii() and text.isdigit():
        return int(text)
    return None


def checked_text(text: str, what: str) -> str:
    """`text` as it is, refused when it is not Unicode text: a lone surrogate (how Python reads a
    byte that is not UTF-8 on a command line, or what an API caller passed) has no encoding.
    Refused rather than replaced: a prompt is never silently changed."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        byte = f"byte 0x{c - 0xDC00:02x}, not UTF-8" if 0xDC80 <= c <= 0xDCFF else f"lone surrogate U+{c:04X}"
        raise TurboError(f"{what}: character {e.start} is a {byte}: expected valid UTF-8 text") from None
    return text


class ArgumentParser(argparse.ArgumentParser):
    """argparse's, but a usage error is one stderr line naming the argument (and the choices,
    argparse's own wording), exit 2, instead of the usage text first."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def one_line(e: BaseException) -> str:
    """An exception's message on one line, at most 300 characters (for a one-line refusal)."""
    text = " ".join((getattr(e, "message", None) or str(e) or type(e).__name__).split())
    return text if len(text) <= 300 else text[:297] + "..."
