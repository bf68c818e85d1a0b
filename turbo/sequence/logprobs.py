"""Each committed token's log-probability under the trunk (a served request's `logprobs`): the
type the driver fills and the server's protocol writes out, in a module of its own so that both
import it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP = 20  # OpenAI's bound on top_logprobs


@dataclass
class TokenLogprob:
    token: int
    logprob: float  # the trunk's log-softmax at the token (raw logits: before temperature)
    top: list[tuple[int, float]]  # the k most likely (token, logprob), most likely first


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each token's log-probability under the row before it (row i holds token i's), and the top."""
    lp = torch.log_softmax(logits[:len(tokens)].float(), dim=-1)
    out = []
    for i, t in enumerate(tokens):
        best = torch.topk(lp[i], top) if top else None
        pairs = list(zip(best.indices.tolist(), best.values.tolist())) if best is not None else []
        out.append(TokenLogprob(t, float(lp[i, t]), pairs))
    return out
