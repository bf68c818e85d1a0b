"""What a sequence of the batch costs: the bytes its state holds (admission reserves them) and
the seconds its round takes of a shared step (the adaptive policy's clock under a batch)."""

from __future__ import annotations

from collections import deque

from ..model.trunk import Trunk


def sequence_bytes(trunk: Trunk, positions: int, block: int) -> int:
    """What a sequence holds: its K/V rows for `positions`, the GDN state and conv window, and a
    verify's per-row states (checkpoint rollback, two buffers: turbo/backends/native_trunk.spare)."""
    a, kv = trunk.arch, trunk.kv_dtype.itemsize
    attn = len(a.full_layers) * 2 * a.num_kv_heads * a.head_dim * positions * kv
    gdn_layers = sum(1 for i in range(a.num_layers) if a.is_gdn(i))
    state = a.lin_v_heads * a.lin_k_dim * a.lin_v_dim * 4
    window = (a.conv_kernel - 1 + block + 1) * a.lin_conv_dim * 4
    return attn + gdn_layers * (state * (3 + 2 * block) + window)


class StepCosts:
    """A step's seconds as a + b * rows over the recent steps (least squares): what a sequence's
    round costs the batch is its share of the fixed part, a / sequences, plus b for each of its
    rows. That is the clock the adaptive policy reads under a batch: alone, a round's extra
    proposal rows ride on the weights' read almost free; in a wide batch every row costs b, and
    a block pays only where its acceptance beats that."""

    def __init__(self, keep: int = 64):
        self.points: deque[tuple[int, float]] = deque(maxlen=keep)

    def add(self, rows: int, seconds: float) -> None:
        self.points.append((rows, seconds))

    def share(self, rows: int, total_rows: int, sequences: int, seconds: float) -> float:
        n = len(self.points)
        if n >= 8:
            mx = sum(r for r, _ in self.points) / n
            my = sum(t for _, t in self.points) / n
            var = sum((r - mx) ** 2 for r, _ in self.points)
            if var > 0:
                b = max(0.0, sum((r - mx) * (t - my) for r, t in self.points) / var)
                a = max(0.0, my - b * mx)
                return a / sequences + b * rows
        return seconds * rows / total_rows  # (too few or too alike steps to fit: a plain share)
