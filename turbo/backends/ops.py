"""The trunk's and drafter's math as plain torch functions (docs/DESIGN.md 2.1, 2.2): the CPU
torch step's kernels and the references the CUDA kernels are tested against.
Functions on the decode/verify path are row-stable (`calibrate_rows`, `rowwise`; docs/DESIGN.md
2.1, "Row stability"); on CUDA tensors the hot ops run turbo/backends/cuda.py (docs/DESIGN.md 7).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from ..model.trunk import DynamicNtk
from ..store.arch import RopeScaling
from ..store.quant import QuantizedWeight, rows_stand_alone
from . import cuda, native_lib, native_pack
from .packed import Packed

# BLAS GEMM kernels work in row blocks, and a row in a partial block (or in a 1-row
# GEMV) is summed in a different order than a row in a full block. Padding every
# decode/verify call to whole blocks puts each row on the same micro-kernel; the block
# that achieves this is measured per machine and weight shape by `calibrate_rows`
# (0 means none did, and rows are then computed one call each: slower, still exact).
ROW_BLOCK_CANDIDATES = (1, 2, 4, 8, 16, 32)
_row_block: dict[tuple[int, int, torch.dtype, int, str], int] = {}

# On CUDA tensors the hot ops run turbo/backends/cuda.py's PTX kernels (docs/DESIGN.md 7).
CUDA_KERNELS = True


def cuda_kernels(t: torch.Tensor):
    """turbo.backends.cuda when `t` is a CUDA tensor and CUDA_KERNELS is on, else None."""
    if t.is_cuda and CUDA_KERNELS:
        return cuda
    return None


def _device(w) -> torch.device:
    return w.packed.device if isinstance(w, QuantizedWeight) else w.device


def _key(w) -> tuple[int, int, torch.dtype, int, str]:
    return (w.shape[0], w.shape[1], w.dtype, torch.get_num_threads(), _device(w).type)


def to_device(obj, device: torch.device):
    """A weight, a QuantizedWeight or a dataclass or list of them (recursively) moved to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, list):  # (an MoE block's experts)
        return [to_device(x, device) for x in obj]
    if isinstance(obj, QuantizedWeight):
        return dataclasses.replace(obj, packed=obj.packed.to(device), scales=obj.scales.to(device),
                                   biases=obj.biases.to(device), _kernel=None, _dense=None)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: to_device(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def dense(w):
    """A matrix as a plain [out, in] tensor, whatever form a product keeps it in."""
    return w.dense() if isinstance(w, (Packed, QuantizedWeight)) else w


def _padded(x: torch.Tensor, block: int) -> torch.Tensor:
    rows = x.shape[0]
    target = max(block, -(-rows // block) * block)
    return x if target == rows else torch.cat([x, x.new_zeros(target - rows, x.shape[1])])


def calibrate_rows(w: torch.Tensor, max_rows: int = 9, seed: int = 0) -> int:
    """The smallest row block under which every row of a 1..max_rows-row call equals the
    same row computed alone (at row 0), for this weight's shape and dtype, on its device
    (on CUDA the question is cuBLAS's kernel choice; the measurement is the same)."""
    key = _key(w)
    if key in _row_block:
        return _row_block[key]
    dev = _device(w)
    g = torch.Generator(device=dev).manual_seed(seed)
    xs = torch.randn(max_rows, w.shape[1], generator=g, device=dev).to(w.dtype)
    probe = torch.randn(w.shape, generator=g, device=dev).to(w.dtype)
    chosen = next((block for block in ROW_BLOCK_CANDIDATES
                   if rows_stand_alone(lambda x: F.linear(_padded(x, block), probe), xs)), 0)
    _row_block[key] = chosen
    return chosen


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [R, in] @ w[out, in]^T in w's dtype, returned as fp32; row-stable for the
    shapes `calibrate_rows` has seen (prefill-sized calls are not padded). A packed
    QuantizedWeight is dequantized first (deterministically), then takes the same path."""
    if isinstance(w, Packed):  # the native step's layout: native.c at every size (prefill too)
        return native_pack.linear_packed(x, w)
    if isinstance(w, QuantizedWeight):
        cb = cuda_kernels(x)
        if cb is not None:  # qgemv.cu: one warp per output, every input row on its own
            return cb.affine_linear(x, w.packed, w.scales, w.biases, w.bits, w.group)
        kernel = w.kernel() if w.use_kernel else None
        if kernel is not None:  # probed row-stable: each row is computed on its own
            return kernel(x)
        w = w.dense()
    xw = x.to(w.dtype)
    block = _row_block.get(_key(w))
    if block is None or x.shape[0] > 4 * ROW_BLOCK_CANDIDATES[-1]:
        return F.linear(xw, w).float()
    if block == 0:
        return torch.cat([F.linear(xw[i:i + 1], w) for i in range(xw.shape[0])]).float()
    return F.linear(_padded(xw, block), w)[:x.shape[0]].float()


# Transcendental elementwise kernels (exp, sigmoid, silu, cos, ...) give the last ulp
# differently in their vectorised body and their scalar tail, so an element's result
# would depend on where its row sits in the call. `rowwise` pads rows to whole vector
# blocks and keeps each call under ATen's parallel grain, so no element ever lands in a
# tail or at a thread split.
VECTOR_ALIGN = 64
PARALLEL_GRAIN = 32768


def argmax(row: torch.Tensor) -> int:
    """The index of the largest value of a row [n], the first of equals (torch.argmax's answer):
    native.c's pass where it can read the row (torch's takes ~0.5 ms a 248K row: 3 ms for a
    9-row verify, an eighth of an int4 decode step at 0.8B)."""
    if row.device.type == "cpu" and row.dtype == torch.float32 and row.is_contiguous() and native_lib.library():
        return native_lib.argmax(row)
    return int(row.argmax())


def rowwise(fn, x: torch.Tensor) -> torch.Tensor:
    """fn applied to x [R, w] so that row i's result does not depend on R."""
    rows, width = x.shape
    padded = -(-width // VECTOR_ALIGN) * VECTOR_ALIGN
    xp = F.pad(x, (0, padded - width)) if padded != width else x.contiguous()
    per_call = max(1, PARALLEL_GRAIN // padded)
    if rows <= per_call:
        return fn(xp)[:, :width]
    return torch.cat([fn(xp[i:i + per_call]) for i in range(0, rows, per_call)])[:, :width]


def silu(x: torch.Tensor) -> torch.Tensor:
    return rowwise(F.silu, x.reshape(x.shape[0], -1)).reshape(x.shape)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return rowwise(torch.sigmoid, x.reshape(x.shape[0], -1)).reshape(x.shape)


# On the GPU a reduction's launch configuration -- and with it each row's summation order --
# depends on how many rows share the call (ATen sizes its blocks from the output count). So
# decode/verify-sized reductions on CUDA run in whole blocks of CUDA_ROW_BLOCK rows: every
# call has the same shape, and a row's result does not depend on R. (CPU: unchanged.)
CUDA_ROW_BLOCK = 16


def row_blocks(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for a row-wise fn; on CUDA, decode/verify-sized calls run in fixed-size row blocks."""
    rows = x.shape[0]
    if not x.is_cuda or rows > 4 * ROW_BLOCK_CANDIDATES[-1]:
        return fn(x)
    b = CUDA_ROW_BLOCK
    target = -(-rows // b) * b
    if target != rows:
        x = torch.cat([x, x.new_zeros(target - rows, *x.shape[1:])])
    if target == b:
        return fn(x)[:rows]
    return torch.cat([fn(x[i:i + b]) for i in range(0, target, b)])[:rows]


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm; `scale` is the precomputed fp32 (1 + w)."""
    x = x.float()
    if x.is_cuda:
        return row_blocks(lambda t: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * scale, x)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * scale


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNormGated: plain weight w (not 1 + w) times silu(z), fp32."""
    cb = cuda_kernels(o)
    if cb is not None:  # norm.cu: one warp per (row, head)
        return cb.gated_rms_norm(o, z, w, eps)
    o = o.float()
    return w * (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps)) * silu(z.float())


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    if x.is_cuda:
        return row_blocks(lambda t: t * torch.rsqrt((t * t).sum(-1, keepdim=True) + eps), x)
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def rope_inv_freq(rotary_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor | DynamicNtk:
    """The inverse frequencies, scaled as transformers' modeling_rope_utils does (linear: all
    divided by factor; yarn: a ramp between the interpolated and the original ones; dynamic:
    DynamicNtk, by the sequence's length). yarn's attention factor scales cos/sin there: the
    loader folds it into q_norm/k_norm's rotary part."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    if scaling is None:
        return inv_freq
    if scaling.kind == "dynamic":
        return DynamicNtk(inv_freq, theta, scaling.factor, scaling.original_max_positions)
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    low, high = _yarn_range(scaling, rotary_dim, theta)
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of the original (extrapolated) frequency
    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    return 1.0 / (scaling.factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep


def _yarn_range(s: RopeScaling, dim: int, theta: float) -> tuple[float, float]:
    """transformers' find_correction_range (and its guard against a zero-width ramp)."""
    def corr(rotations: float) -> float:
        return dim * math.log(s.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = corr(s.beta_fast), corr(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    return low, high + 0.001 if low == high else high


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor | DynamicNtk) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [R] (a row's one position), or [R, rot/2] (a position per frequency: the
    multimodal rotation, turbo/vision/positions.py; equal ones give the [R] form's bits)."""
    pos = positions.float()
    if isinstance(inv_freq, DynamicNtk):
        if pos.ndim == 2:
            raise ValueError("dynamic RoPE scaling with multimodal positions is not implemented")
        freqs = pos[:, None] * inv_freq.rows(positions)
    else:
        freqs = (pos if pos.ndim == 2 else pos[:, None]) * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return rowwise(torch.cos, emb), rowwise(torch.sin, emb)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotate_half on the first cos.shape[-1] dims of x [..., heads, d]; cos [..., rot] (x's
    leading dims). Differentiable: turbo/train's modules rotate with it too."""
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    out = xr * cos[..., None, :] + rotated * sin[..., None, :]
    return torch.cat([out, xp], dim=-1) if xp.shape[-1] else out


def causal_conv_rows(ext: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv over rows: ext [K-1+R, C] (window then rows), w [C, K].

    Row t = sum_j w[:, j] * ext[t + j], as separate multiplies and adds so each element
    is computed the same way whatever R is. Returns silu(conv) [R, C].
    """
    cb = cuda_kernels(ext)
    if cb is not None:  # conv.cu: one thread per channel, the same taps order
        return cb.causal_conv_rows(ext, w)
    taps = w.shape[1]
    rows = ext.shape[0] - (taps - 1)
    acc = ext[0:rows] * w[:, 0]
    for j in range(1, taps):
        acc = acc + ext[j:j + rows] * w[:, j]
    return silu(acc)


def gdn_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule for all heads: state [H, dk, dv] fp32; q, k [H, dk];
    v [H, dv]; g, beta [H]. Returns (new state, output [H, dv]). Functional: `state` is untouched."""
    cb = cuda_kernels(q)
    if cb is not None:  # the recurrence kernel over one row: the arithmetic of each of its rows
        out, state, _ = cb.gdn_recurrence(state, q[None], k[None], v[None], g[None], beta[None])
        return state, out[0]
    state = state * g.exp()[:, None, None]
    kv = torch.bmm(k[:, None, :], state)[:, 0]
    u = (v - kv) * beta[:, None]
    state = state + k[:, :, None] * u[:, None, :]
    return state, torch.bmm(q[:, None, :], state)[:, 0]


def gdn_recurrence(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, keep_states: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor] | None]:
    """The recurrence over R rows (q [R, H, dk] ...). Returns (outputs [R, H, dv], final
    state, the state after every row when keep_states)."""
    cb = cuda_kernels(q)
    if cb is not None:  # gdn.cu: all R rows in one launch, the state in registers, checkpoints written
        return cb.gdn_recurrence(state, q, k, v, g, beta, keep_states=keep_states)
    outs, states = [], [] if keep_states else None
    for t in range(q.shape[0]):
        state, o = gdn_step(state, q[t], k[t], v[t], g[t], beta[t])
        outs.append(o)
        if states is not None:
            states.append(state)
    return torch.stack(outs), state, states


def gdn_chunked(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule over a long prompt, a chunk at a time (WY form): within a chunk the
    delta corrections solve one unit-lower-triangular system instead of T sequential
    steps. q, k [T, H, dk], v [T, H, dv], g, beta [T, H]. Returns (outputs, final state)."""
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    g, beta = g.transpose(0, 1), beta.transpose(0, 1)
    total = q.shape[1]
    out = torch.empty_like(v)
    for s in range(0, total, chunk):
        e = min(s + chunk, total)
        n = e - s
        qc, kc, vc, bc = q[:, s:e], k[:, s:e], v[:, s:e], beta[:, s:e]
        cum = g[:, s:e].cumsum(-1)
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~lower, float("-inf")).exp()
        a = (bc[:, :, None] * decay * (kc @ kc.transpose(-1, -2))).tril(-1)
        system = a + torch.eye(n, device=q.device)
        tv = torch.linalg.solve_triangular(system, bc[..., None] * vc, upper=False, unitriangular=True)
        tk = torch.linalg.solve_triangular(system, (bc * cum.exp())[..., None] * kc, upper=False, unitriangular=True)
        u = tv - tk @ state
        out[:, s:e] = (cum.exp()[..., None] * qc) @ state + ((qc @ kc.transpose(-1, -2)) * decay) @ u
        tail = (cum[:, -1:] - cum).exp()[..., None]
        state = cum[:, -1].exp()[:, None, None] * state + (kc * tail).transpose(-1, -2) @ u
    return out.transpose(0, 1), state
