"""The trunk's multimodal rotary positions (transformers' Qwen3.5 get_rope_index and the text
rotary embedding's interleaved mrope): text rows count on from the position before them; an
image's merged patches at (t, h, w) take positions (start + t, start + h, start + w), and the
text after it continues at start + max(h, w) patches, so every later row rotates at its index
plus a (negative) delta the sequence keeps (TrunkState.rope_delta).

A row's rotation is given per frequency: frequency j rotates by the height position where
j % 3 == 1 and j < 3 * sections[1], the width position where j % 3 == 2 and j < 3 *
sections[2], the time position otherwise; a text row's three are equal, so its rotation is
the plain one's, bit for bit."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import TurboError


@dataclass
class MmRows:
    """What a prompt with images adds to the trunk's prefill: the image rows' embeddings, and
    every row's rotary position per frequency."""

    rows: torch.Tensor  # [k] long: the prompt rows of the image tokens, in order
    embeds: torch.Tensor  # [k, hidden] fp32: the tower's output for them
    freq_positions: torch.Tensor  # [n, rot/2] long: each row's position at each rotary frequency
    delta: int  # position - index of every row after the prompt (<= 0)


def axes(sections: tuple[int, int, int], rot_half: int) -> torch.Tensor:
    """Which of (t, h, w) each rotary frequency reads."""
    out = torch.zeros(rot_half, dtype=torch.long)
    for j in range(rot_half):
        if j % 3 == 1 and j < 3 * sections[1]:
            out[j] = 1
        elif j % 3 == 2 and j < 3 * sections[2]:
            out[j] = 2
    return out


def positions3(tokens: list[int], grids: list[tuple[int, int, int]], merge: int, image_id: int,
               start: int = 0) -> tuple[torch.Tensor, int]:
    """(t, h, w) positions [3, n] of `tokens` (their image tokens in runs, one per grid, in
    order) counted on from `start`, and the next row's position (the delta: that minus the
    index after the last row)."""
    pos = torch.empty(3, len(tokens), dtype=torch.long)
    cur, i, images = start, 0, iter(grids)
    while i < len(tokens):
        if tokens[i] != image_id:
            pos[:, i] = cur
            cur, i = cur + 1, i + 1
            continue
        j = i
        while j < len(tokens) and tokens[j] == image_id:
            j += 1
        grid = next(images, None)
        if grid is None:
            raise TurboError(f"the prompt has more image placeholders than the {len(grids)} images given")
        t, h, w = grid[0], grid[1] // merge, grid[2] // merge
        if j - i != t * h * w:
            raise TurboError(f"an image's {t * h * w} tokens meet a run of {j - i} image placeholders in the prompt")
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        pos[:, i:j] = torch.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)]) + cur
        cur, i = cur + max(h, w), j
    if next(images, None) is not None:
        raise TurboError(f"{len(grids)} images given, and the prompt places fewer")
    return pos, cur


def mm_rows(tokens: list[int], grids: list[tuple[int, int, int]], embeds: torch.Tensor, merge: int,
            image_id: int, sections: tuple[int, int, int], rot_half: int) -> MmRows:
    pos, end = positions3(tokens, grids, merge, image_id)
    rows = torch.tensor([i for i, t in enumerate(tokens) if t == image_id], dtype=torch.long)
    if rows.shape[0] != embeds.shape[0]:
        raise TurboError(f"{embeds.shape[0]} image embeddings for {rows.shape[0]} image placeholders")
    return MmRows(rows, embeds, pos[axes(sections, rot_half)].T.contiguous(), end - len(tokens))


def rows_between(mm: MmRows, r0: int, r1: int) -> MmRows:
    """Prompt rows r0..r1 of `mm` as a prefill of just them takes them (a state holding rows
    [:r0] goes on with them: a chat session's next turn, a prefix-cached request): their image
    rows counted from r0, their rotations, and the delta of row r1 (a text row, or the end)."""
    inside = (mm.rows >= r0) & (mm.rows < r1)
    n = mm.freq_positions.shape[0]
    delta = mm.delta if r1 >= n else int(mm.freq_positions[r1, 0]) - r1
    return MmRows(mm.rows[inside] - r0, mm.embeds[inside], mm.freq_positions[r0:r1], delta)


def expand_placeholders(tokens: list[int], counts: list[int], image_id: int) -> list[int]:
    """Each single image placeholder (the chat template writes one per image) repeated as many
    times as its image has tokens, as transformers' processor expands <|image_pad|>."""
    out, k = [], 0
    for t in tokens:
        if t == image_id:
            if k >= len(counts):
                raise TurboError(f"the prompt has more image placeholders than the {len(counts)} images given")
            out += [image_id] * counts[k]
            k += 1
        else:
            out.append(t)
    if k != len(counts):
        raise TurboError(f"{len(counts)} images given, and the prompt places {k}")
    return out


def expanded_row(tokens: list[int], counts: list[int], image_id: int, n: int) -> int:
    """Where row `n` of `tokens` (one placeholder per image) lands once expand_placeholders has
    expanded each image's placeholder to its `counts` rows (a mark counted in the prompt's ids
    before expansion, as the chat template's boundaries are)."""
    return n + sum(c - 1 for c in counts[:tokens[:n].count(image_id)])


@dataclass
class PromptImages:
    """A prompt's images as the trunk takes them (turbo/vision: the API's images=, a session's image
    parts, a served request's image_url parts)."""

    tokens: list[int]  # the prompt's ids, each image's placeholder expanded to its rows
    mm: MmRows  # the image rows' embeddings and multimodal positions
    keyed: list  # `tokens` with each image row tagged by its image's identity: what a kept state is matched by
