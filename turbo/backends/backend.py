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


# 4 / 5 / 16 / 15: INT4 / INT8 / 2-bit / 1-bit affine (turbo/quant.py), through the native step's
# products (int4, int8) or ops.linear's row-stable path; 24 / 25: the group-32 int4 / int8 a GGUF's
# Q4_x / Q8_0 become (dequantized at load, or the int4 kernel where it probes row-stable)
CPU = Backend("cpu", (1, 2, 3, 4, 5, 16, 15, 24, 25))
