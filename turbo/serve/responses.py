"""OpenAI's response shapes, built from the engine's deltas: the response and chunk envelopes,
usage, and the logprobs objects of both routes, as OpenAI's API reference and vLLM's
entrypoints/openai/protocol.py spell them; server-sent events. The requests: protocol.py."""

from __future__ import annotations

import json
import time
import uuid
from typing import Callable

from ..sequence.logprobs import TokenLogprob

LOGPROB_FLOOR = -9999.0  # JSON has no -inf: vLLM's floor


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, cached_from: str | None) -> dict:
    """OpenAI's usage, and turbo's: `turbo.cached_from`, the kind of mark the prefix cache's state
    that served the cached tokens was kept at (system, tools, turn, chunk, prompt, answer; None: none)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}, "turbo": {"cached_from": cached_from}}


def _lp(x: float) -> float:
    return max(float(x), LOGPROB_FLOOR)


def completion_logprobs(lps: list[TokenLogprob], piece: Callable[[int], str], offset: int) -> dict:
    """The completions form: parallel lists; `offset` is where the first token's text starts."""
    tokens = [piece(t.token) for t in lps]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [_lp(t.logprob) for t in lps],
            "top_logprobs": [{piece(k): _lp(v) for k, v in t.top} for t in lps], "text_offset": offsets}


def chat_logprobs(lps: list[TokenLogprob], piece: Callable[[int], str]) -> dict:
    """The chat form: one entry per token, each with its bytes and its top alternatives."""
    def entry(token: int, lp: float) -> dict:
        text = piece(token)
        return {"token": text, "logprob": _lp(lp), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(k, v) for k, v in t.top]}
                        for t in lps]}


def envelope(rid: str, chat: bool, model: str, created: int, choices: list, chunk: bool) -> dict:
    kind = "chat.completion" if chat else "text_completion"
    return {"id": rid, "object": kind + (".chunk" if chat and chunk else ""), "created": created,
            "model": model, "choices": choices}


def now() -> int:
    return int(time.time())


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"
