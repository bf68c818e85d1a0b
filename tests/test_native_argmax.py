"""The native step's greedy pick (native.c's argmax_row, per tier) is torch.argmax's: the first of
equal maxima, the first NaN where there is one, for every length and position (the vector loops'
lanes and the scalar tail)."""

import pytest
import torch

from turbo.backends import native_lib

pytestmark = pytest.mark.skipif(native_lib.why_not() is not None, reason="no native library here")


def rows() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n in (1, 7, 8, 9, 15, 16, 17, 33, 100, 1000, 248320):
        out.append(torch.randn(n, generator=g))
        tied = torch.randint(0, 3, (n,), generator=g).float()  # many equal maxima in every lane
        out.append(tied)
        out.append(torch.full((n,), -float("inf")))
    for n, at in ((40, 0), (40, 13), (40, 39), (1000, 517), (17, 16)):
        for fill in (float("nan"), float("inf")):
            r = torch.randn(n, generator=g)
            r[at] = fill
            r[(at + 5) % n] = fill  # a second one later (or earlier): the first counts
            out.append(r)
    out.append(torch.tensor([0.0, -0.0, 0.0] * 11))  # -0.0 equals 0.0: the first index
    return out


def test_the_native_argmax_is_torchs():
    for row in rows():
        assert native_lib.argmax(row) == int(row.argmax()), row
