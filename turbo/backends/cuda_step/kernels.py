"""The CUDA step's launches (kernels_ptx/step.cu, bgemv.cu), one function a kernel: each takes a
launcher (cuda_kernels.Kernels: on a GPU or on the simulated device, TURBO_CUDA_SIM) and raw
device pointers (ints; 0 is null), and fixes the kernel's grid and block. Nothing here owns
memory or synchronises: the step (turbo/backends/cuda_step/step.py) allocates every buffer at
open and calls these in its fixed order.
"""

from __future__ import annotations

import ctypes

ROWS_PASSES = (1, 4, 8, 16)  # bgemv.cu's pass sizes (entries ..._r<MAXR>_f32)
ROWS_OUTPUTS_PER_WARP = {1: 1, 4: 4, 8: 2, 16: 2}  # bgemv.cu BG_OW; BG_WARPS = 8 warps a block
MAX_ROWS = 16  # the step's rows a launch (step.cu GDN_MAXR): verify blocks and prefill chunks
GDN_THREADS, GDN_MAXD, GDN_MAXK = 128, 128, 8  # step.cu
ATT_THREADS, ATT_MAXD = 128, 256  # step.cu


def _p(v: int | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(int(v or 0))


def _i(v: int) -> ctypes.c_int32:
    return ctypes.c_int32(int(v))


def _f(v: float) -> ctypes.c_float:
    return ctypes.c_float(float(v))


def rows_pass(rows: int) -> int:
    return next((p for p in ROWS_PASSES if rows <= p), ROWS_PASSES[-1])


def rows_kernel(fmt: str, rows: int) -> str:
    """bgemv.cu's entry for `rows` rows of a `fmt` ("bf16", "int8", "int4") matrix."""
    return f"{fmt}_rows_gemv_r{rows_pass(rows)}_f32"


def rows_grid(rows: int, out: int) -> tuple[int]:
    return (-(-out // (8 * ROWS_OUTPUTS_PER_WARP[rows_pass(rows)])),)


def rows_product(k, fmt: str, x: int, w: int, y: int, rows: int, n_in: int, n_out: int,
                 scales: int = 0, biases: int = 0, group: int = 64) -> None:
    """y [rows, n_out] = x [rows, n_in] @ w^T, w as stored: bf16 [n_out, n_in], or int8 / int4
    affine (packed words [n_out, n_in * bits / 32], bf16 scales / biases [n_out, n_in / group])."""
    if fmt == "bf16":
        args = [_p(x), _p(w), _p(y), _i(rows), _i(n_in), _i(n_out)]
    else:
        args = [_p(x), _p(w), _p(scales), _p(biases), _p(y), _i(rows), _i(n_in), _i(n_out), _i(group)]
    k.launch("bgemv", rows_kernel(fmt, rows), rows_grid(rows, n_out), (256,), args)


def add_rms_norm(k, x: int, y: int, w: int, h: int, rows: int, width: int, eps: float) -> None:
    """x += y (y 0: none), h = rms_norm(x) * w, one block a row."""
    k.launch("step", "add_rms_norm_f32", (rows,), (256,), [_p(x), _p(y), _p(w), _p(h), _i(rows), _i(width), _f(eps)])


def silu_mul(k, gu: int, act: int, rows: int, inter: int) -> None:
    n = rows * inter
    k.launch("step", "silu_mul_f32", (max(1, min(1024, -(-n // 256))),), (256,), [_p(gu), _p(act), _i(rows), _i(inter)])


def embed_rows(k, table: int, ids: int, x: int, rows: int, width: int) -> None:
    k.launch("step", "embed_rows_bf16_f32", (rows,), (256,), [_p(table), _p(ids), _p(x), _i(rows), _i(width)])


def gdn_step(k, proj: int, window_in: int, window_out: int, ext: int, conv: int, neg_a: int, dt_bias: int,
             gnorm: int, state_in: int, state_out: int, states: int, out: int, rows: int, kheads: int, kdim: int,
             vheads: int, vdim: int, taps: int, eps: float) -> None:
    """The fused Gated DeltaNet tail of `rows` rows (step.cu gdn_step_f32), one block a value head."""
    if not (kdim <= GDN_MAXD and vdim <= GDN_MAXD and rows <= MAX_ROWS and taps <= GDN_MAXK):
        raise ValueError(f"gdn_step takes dk, dv <= {GDN_MAXD}, rows <= {MAX_ROWS}, taps <= {GDN_MAXK}")
    k.launch("step", "gdn_step_f32", (vheads,), (GDN_THREADS,),
             [_p(proj), _p(window_in), _p(window_out), _p(ext), _p(conv), _p(neg_a), _p(dt_bias), _p(gnorm),
              _p(state_in), _p(state_out), _p(states), _p(out), _i(rows), _i(kheads), _i(kdim), _i(vheads),
              _i(vdim), _i(taps), _f(eps)])


def attn_rows(k, proj: int, kc: int, vc: int, q_norm: int, k_norm: int, rope_cs: int, scores: int, att: int,
              rows: int, p0: int, cap: int, heads: int, kv_heads: int, head_dim: int, rot: int, eps: float) -> None:
    """Gated attention of `rows` query rows at p0.. (step.cu attn_rows_f32), one block a (kv head, row)."""
    if head_dim > ATT_MAXD or p0 + rows > cap:
        raise ValueError(f"attn_rows takes head_dim <= {ATT_MAXD} and p0 + rows <= cap")
    k.launch("step", "attn_rows_f32", (kv_heads, rows), (ATT_THREADS,),
             [_p(proj), _p(kc), _p(vc), _p(q_norm), _p(k_norm), _p(rope_cs), _p(scores), _p(att), _i(rows), _i(p0),
              _i(cap), _i(heads), _i(kv_heads), _i(head_dim), _i(rot), _f(eps)])


def moe_route(k, probs: int, ids: int, weights: int, rows: int, experts: int, top_k: int, norm_topk: bool) -> None:
    """Router logits [rows, E] -> each row's top_k experts (ascending) and weights (step.cu moe_route_f32)."""
    if experts > 512:
        raise ValueError("moe_route takes at most 512 experts")
    k.launch("step", "moe_route_f32", (-(-rows // 32),), (32,),
             [_p(probs), _p(ids), _p(weights), _i(rows), _i(experts), _i(top_k), _i(int(bool(norm_topk)))])


def experts_product(k, x: int, ids: int, table: int, y: int, pairs: int, n_in: int, n_out: int, row_div: int) -> None:
    """y [pairs, n_out]: pair p's row p // row_div of x times expert ids[p]'s bf16 matrix (its
    pointer from the device table), one-row products (bgemv.cu bf16_experts_gemv_f32)."""
    k.launch("bgemv", "bf16_experts_gemv_f32", (-(-n_out // 8), pairs), (256,),
             [_p(x), _p(ids), _p(table), _p(y), _i(pairs), _i(n_in), _i(n_out), _i(row_div)])


def moe_combine(k, ye: int, weights: int, shared: int, gate: int, y: int, rows: int, top_k: int, width: int) -> None:
    k.launch("step", "moe_combine_f32", (rows,), (256,),
             [_p(ye), _p(weights), _p(shared), _p(gate), _p(y), _i(rows), _i(top_k), _i(width)])


GDN_SEQ_SLOTS = 6  # gdn_step_ind_f32's seq block: window_in, window_out, ext, state_in, state_out, states
ATT_SEQ_SLOTS = 3  # attn_rows_ind_f32's: kc, vc, p0


def gdn_step_ind(k, proj: int, seq: int, conv: int, neg_a: int, dt_bias: int, gnorm: int, out: int, rows: int,
                 kheads: int, kdim: int, vheads: int, vdim: int, taps: int, eps: float) -> None:
    """gdn_step with the sequence's windows, ext, states and checkpoints read from `seq` [6] int64
    on the device (step.cu gdn_step_ind_f32): its arguments stay the same step after step, so a
    captured graph replays it for any sequence."""
    if not (kdim <= GDN_MAXD and vdim <= GDN_MAXD and rows <= MAX_ROWS and taps <= GDN_MAXK):
        raise ValueError(f"gdn_step takes dk, dv <= {GDN_MAXD}, rows <= {MAX_ROWS}, taps <= {GDN_MAXK}")
    k.launch("step", "gdn_step_ind_f32", (vheads,), (GDN_THREADS,),
             [_p(proj), _p(seq), _p(conv), _p(neg_a), _p(dt_bias), _p(gnorm), _p(out), _i(rows), _i(kheads),
              _i(kdim), _i(vheads), _i(vdim), _i(taps), _f(eps)])


def attn_rows_ind(k, proj: int, seq: int, q_norm: int, k_norm: int, rope_cs: int, scores: int, att: int,
                  rows: int, cap: int, heads: int, kv_heads: int, head_dim: int, rot: int, eps: float) -> None:
    """attn_rows with the K/V caches and the position p0 read from `seq` [3] int64 on the device
    (step.cu attn_rows_ind_f32; the caller checks p0 + rows <= cap before it writes the block)."""
    if head_dim > ATT_MAXD:
        raise ValueError(f"attn_rows takes head_dim <= {ATT_MAXD}")
    k.launch("step", "attn_rows_ind_f32", (kv_heads, rows), (ATT_THREADS,),
             [_p(proj), _p(seq), _p(q_norm), _p(k_norm), _p(rope_cs), _p(scores), _p(att), _i(rows), _i(cap),
              _i(heads), _i(kv_heads), _i(head_dim), _i(rot), _f(eps)])
