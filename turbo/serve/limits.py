"""What bounds a request before the model sees it: the body's size (read with a cap, whatever
the client's Content-Length says: 413) and the prompt's length in characters against what the
context could hold (a 400 before the tokenizer runs: tokenizing megabytes costs gigabytes); and
the context check's refusal (turbo.sequence.options.ContextTooLong) in OpenAI's words."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, AsyncIterator, Iterator

from ..errors import ascii_decimal
from .api_error import ApiError

if TYPE_CHECKING:  # (types only: this module stays torch-free for the front process)
    from tokenizers import Tokenizer

    from ..sequence.options import ContextTooLong

MIB = 1 << 20
# A normalizer can make one token of several input characters: NFC composes at most 3 into one
# (a base letter and two marks, a Hangul L+V+T syllable); 4 leaves room.
NORMALIZED_CHARS_PER_CHAR = 4


def too_large(limit: int) -> ApiError:
    return ApiError(f"the request body is over this server's {limit / MIB:g} MiB limit (serve.max_body_mb)",
                    None, 413, code="request_too_large")


LENGTH_DIGITS = 19  # a Content-Length's most digits (2**63 has 19): a longer one is over any limit


def declared_length(declared: str | bytes | None) -> int:
    """A Content-Length header's bytes: its ASCII digits (around them, spaces) as a number; past
    LENGTH_DIGITS of them, more than any limit; else 0 (none, or not a number: the body is read
    with the cap, whatever it says). Never int() of "²" (a ValueError) or of thousands of digits."""
    if declared is None:
        return 0
    digits = declared.strip()
    if len(digits) > LENGTH_DIGITS and digits.isascii() and digits.isdigit():
        return 1 << 63
    return ascii_decimal(digits, LENGTH_DIGITS) or 0


async def read_body(chunks: AsyncIterator[bytes], limit: int, declared: str | None) -> bytes:
    """The body, refused (413) as soon as it is known to pass `limit` bytes: at once from a
    Content-Length over it, else when the bytes read pass it (nothing more is buffered)."""
    if declared_length(declared) > limit:
        raise too_large(limit)
    parts, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        parts.append(chunk)
    return b"".join(parts)


def max_token_chars(tokenizer: Tokenizer) -> int:
    """The most input characters one token can stand for: the longest vocab entry (a byte-level
    entry's characters are bytes, and an input character is at least one byte), times the most a
    normalizer can shrink the input. A prompt longer than max_positions times this cannot fit."""
    longest = max((len(k) for k in tokenizer.get_vocab(with_added_tokens=True)), default=1)
    return max(1, longest) * (1 if tokenizer.normalizer is None else NORMALIZED_CHARS_PER_CHAR)


def context_error(e: ContextTooLong, prompt_param: str, max_tokens_param: str | None) -> ApiError:
    """The context check's refusal as OpenAI words it: a 400 naming max_tokens (as the client spelled
    it) where the request gave one, else the prompt (`prompt_param`: prompt or messages)."""
    return ApiError(f"This model's maximum context length is {e.limit} tokens. However, you requested "
                    f"{e.prompt_tokens + e.max_new_tokens} tokens ({e.prompt_tokens} in the {prompt_param}, "
                    f"{e.max_new_tokens} for the completion). Please reduce the length of the prompt or the "
                    "completion.", max_tokens_param or prompt_param)


def check_prompt_chars(text: str, max_chars: int, max_positions: int, param: str) -> None:
    """A 400 naming `param` when `text` is longer than any prompt that fits the context."""
    if len(text) > max_chars:
        raise ApiError(f"{param} is {len(text)} characters: more than this model's context of {max_positions} "
                       f"tokens can hold (at most {max_chars} characters). Please reduce the length of the "
                       f"{param}.", param)


# Tokenizing a long text whole costs about 400 bytes a character (4 MB of prompt: 1.5 GB); past
# COUNT_FROM characters a prompt is counted a piece at a time first, stopping once it is over.
COUNT_FROM, PIECE = 1 << 18, 1 << 16
# Where a text is cut: a space between two letters, which a byte-level pre-tokenizer splits at
# anyway (the word before, " word" after): the pieces' counts add up to the whole's. For other
# tokenizers, or where no such space is near, a cut may move the count by a token or two.
CUT = re.compile(r"(?<=[^\W\d_]) (?=[^\W\d_])")
CUT_SLACK = 4  # tokens a cut may add to the count, allowed for


def pieces(text: str) -> Iterator[str]:
    start = 0
    while start < len(text):
        end = min(len(text), start + PIECE)
        if end < len(text):
            m = CUT.search(text, end, min(len(text), end + 4096))
            end = m.start() if m else end
        yield text[start:end]
        start = end


def check_prompt_tokens(tokenizer: Tokenizer, text: str, max_positions: int, param: str) -> None:
    """A 400 naming `param` when a long `text` holds more tokens than the context, counted a piece
    at a time (memory bounded by a piece) and stopped as soon as it is over: a prompt that fits
    is tokenized whole afterwards, one that does not never is."""
    if len(text) <= COUNT_FROM:
        return
    count = 0
    for n, piece in enumerate(pieces(text)):
        count += len(tokenizer.encode(piece, add_special_tokens=False).ids)
        if count - CUT_SLACK * (n + 1) > max_positions:
            raise ApiError(f"This model's maximum context length is {max_positions} tokens. However, the {param} "
                           f"holds more than {max_positions} tokens (counted before reading the rest of its "
                           f"{len(text)} characters). Please reduce the length of the {param}.", param)
