"""The DFlash drafters' math that is not a layer: the grouped conv of DFlash2 and its candidate
selector, in torch (the CPU kernels; the CUDA ones in turbo/backends/cuda.py and the native
ones in native_dflash.c are tested against these). Used by the drafter's steps
(turbo/backends/torch_step.py, native_dflash.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_conv(h: torch.Tensor, base: torch.Tensor, dyn: torch.Tensor, group: int) -> torch.Tensor:
    """out[t, c] = sum_o (base[o, c] + dyn[t, o, c // group]) * h[t - o, c], h[<0] = 0.
    h [rows, H]; base [taps, H]; dyn [rows, taps, groups]."""
    kernel = base[None] + dyn.repeat_interleave(group, dim=-1)
    out = kernel[:, 0] * h
    for o in range(1, base.shape[0]):
        out = out + F.pad(kernel[o:, o] * h[:h.shape[0] - o], (0, 0, o, 0))
    return out


def select_candidates(logits: torch.Tensor, final: torch.Tensor, anchor: int, hidden_projection: torch.Tensor,
                      pred_codebook: torch.Tensor, succ_codebook: torch.Tensor, top_k: int) -> list[int]:
    """Greedy bigram rescoring of each row's top-k (fp32); ties go to the lower token id."""
    logits, final = logits.float(), final.float()
    cand = torch.topk(logits, top_k, dim=-1).indices
    proj = final @ hidden_projection.float().T
    pred, out = anchor, []
    for i in range(logits.shape[0]):
        c = cand[i]
        score = logits[i, c] + (succ_codebook[c].float() @ (pred_codebook[pred].float() * proj[i]))
        best = score.max()
        pred = int(c[score == best].min())
        out.append(pred)
    return out
