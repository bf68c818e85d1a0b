"""The engine's checks on a drafter at the seam (turbo/sequence/rounds.py, played by turbo/sequence/driver.py): the trunk verifies every
proposal, but what is not a proposal at all (a float, None, an id off the vocabulary), a q that is
not a distribution, or a drafter's own exception stops here as a TurboError naming the drafter,
not as an IndexError deep in a kernel or a sampler that a bad q quietly steers.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import TurboError
from .adaptive import LazyContext
from .options import integer
from .sampling import Sampler

Q_SUM_TOLERANCE = 1e-3  # how far a row of q may sum from one (fp32 over a 248K vocabulary drifts ~1e-5)


def drafter_name(d: Any) -> str:
    inner = d.inner if isinstance(d, LazyContext) else d  # the adaptive loop's wrapper is not the caller's
    kind = getattr(inner, "kind", None)
    return type(inner).__name__ + (f" (kind {kind!r})" if isinstance(kind, str) else "")


def shown(value: Any) -> str:
    """`value` on one short line, for a message."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 80 else text[:77] + "..."


def refused(d: Any, what: str) -> TurboError:
    return TurboError(f"drafter {drafter_name(d)}: {what}")


def check_drafter_object(d: Any, num_layers: int) -> None:
    """A caller's drafter object's attributes, at a stream's start."""
    if not isinstance(d.kind, str) or not d.kind:
        raise refused(d, f"kind is {shown(d.kind)}, expected a non-empty str")
    layers = d.aux_layers
    if not isinstance(layers, (tuple, list)) or any(integer(i) is None or not 0 <= i < num_layers for i in layers):
        raise refused(d, f"aux_layers is {shown(layers)}, expected a tuple of trunk layers in 0..{num_layers - 1}")
    if d.window is not None and (integer(d.window) is None or d.window < 1):
        raise refused(d, f"window is {shown(d.window)}, expected a positive integer or None")


def call(d: Any, what: str, f: Callable, *args: Any) -> Any:
    """f(*args), a drafter's own method: its exception comes out as a TurboError naming it."""
    try:
        return f(*args)
    except TurboError:
        raise
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise refused(d, f"{what} raised {type(e).__name__}: {first}") from e


def checked_proposals(d: Any, got: Any, block: int, vocab: int | None,
                      what: str = "propose returned") -> list[int]:
    """A list of at most `block` ids in the vocabulary (Python or numpy integers; no bools)."""
    top = vocab if vocab is not None else float("inf")
    expected = f"expected a list of at most {block} ints in " + (f"0..{vocab - 1}" if vocab is not None else "0..")
    if type(got) is not list:
        raise refused(d, f"{what} {shown(got)} ({type(got).__name__}), {expected}")
    ids = [integer(t) for t in got]
    if len(got) > block or any(i is None or not 0 <= i < top for i in ids):
        raise refused(d, f"{what} {shown(got)}, {expected}")
    return ids


def checked_q(d: Any, q: Any, proposals: list[int], vocab: int | None) -> torch.Tensor | None:
    """None, or q [len(proposals), vocab]: finite, non-negative, rows summing to one, positive at
    each proposal (a proposal drawn from q cannot be where q is zero)."""
    if q is None:
        return None
    n = len(proposals)
    width = vocab if vocab is not None else q.shape[-1] if isinstance(q, torch.Tensor) and q.dim() else -1
    if not isinstance(q, torch.Tensor) or not q.is_floating_point() or tuple(q.shape) != (n, width):
        got = f"a tensor of shape {list(q.shape)} ({q.dtype})" if isinstance(q, torch.Tensor) else shown(q)
        raise refused(d, f"propose_sampled returned q {got}, expected a float tensor of shape [{n}, {width}] or None")
    qf = q.detach().float()
    at = qf[torch.arange(n, device=qf.device), torch.tensor(proposals, dtype=torch.long, device=qf.device)]
    off = (qf.sum(-1) - 1).abs()
    flags = torch.stack([~torch.isfinite(qf).all(), (qf < 0).any(), (off > Q_SUM_TOLERANCE).any(),
                         (at <= 0).any()]).tolist()  # one transfer
    if any(flags):  # (the first problem found, in this order)
        i, j = int((off > Q_SUM_TOLERANCE).int().argmax()), int((at <= 0).int().argmax())
        what = ["values that are not finite", "negative values", f"row {i} summing to {float(qf[i].sum()):g}, not 1",
                f"zero at the proposal of row {j}"][flags.index(True)]
        raise refused(d, f"propose_sampled returned a q with {what}, expected each row a distribution "
                         "positive at its proposal")
    return q


def propose(d: Any, anchor: int, pos: int, block: int, sampler: Sampler | None,
            vocab: int | None) -> tuple[list[int], torch.Tensor | None]:
    """The drafter's proposals and q (None: greedy, or point masses), checked."""
    if sampler is None:
        return checked_proposals(d, call(d, "propose", d.propose, anchor, pos, block), block, vocab), None
    got = call(d, "propose_sampled", d.propose_sampled, anchor, pos, block, sampler)
    if not isinstance(got, tuple) or len(got) != 2:
        raise refused(d, f"propose_sampled returned {shown(got)}, expected a tuple (proposals, q)")
    proposals = checked_proposals(d, got[0], block, vocab, "propose_sampled returned proposals")
    return proposals, checked_q(d, got[1], proposals, vocab)
