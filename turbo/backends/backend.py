"""What a backend is: its name and the dtype codes its batched verify runs on."""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class Backend:
    name: str
    # dtype codes the batched verify runs on (the verify-dtype speculation blocker reads this)
    verify_dtypes: tuple[int, ...]
    note: str = ""


# 4 / 5 / 16 / 15: INT4 / INT8 / 2-bit / 1-bit affine (turbo/store/quant.py), through the native step's
# products (int4, int8) or ops.linear's row-stable path; 17-19: quant.EXACT_INT4 (the torch step;
# 17 also a GGUF's Q4_x), 25: a GGUF's Q8_0 (17-19, 25 read as stored by the native step), 26: quant.FP8
CPU = Backend("cpu", (1, 2, 3, 4, 5, 16, 15, 17, 18, 19, 25, 26))
