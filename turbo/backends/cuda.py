"""The cuda backend's checks (`cuda_unavailable_reason`, `CUDA`) and the kernel wrappers over torch
CUDA tensors.

backend=cuda runs the trunk through the CUDA step of its own (turbo/backends/cuda_step: raw driver
memory, matrices resident as stored, on cuda_kernels.kernels(0): a GPU, or the simulated device
under TURBO_CUDA_SIM=1), with the drafters and sampling on the host (turbo/load/loader.py). The
wrappers below -- each with the signature of the CPU function it replaces (`gdn_recurrence`,
`causal_conv_rows`, `gated_rms_norm`, `grouped_conv`, `select_candidates`, `affine_linear`, ...),
the hot ops the torch step swapped on CUDA tensors (turbo/backends/ops.py) -- are no longer on
backend cuda's path; they stay as the tested launch code of the DFlash2 kernels (grouped conv,
selector) for the drafters' device passes, and as gpu_check's per-kernel references.
"""

from __future__ import annotations

import torch

from .. import extras
from ..errors import TurboError
from . import cuda_kernels, cuda_sim
from .backend import Backend
from .cuda_kernels import MODULES, arch_for, f32, i32, ptr, ptx_dir, result_name

# the kernels cover fp weights and the three affine formats (turbo/store/quant.py codes 4, 16, 15); FP8 (26)
# is dequantized at load to the bf16 install's weights (load_plan: not kept), which the fp path verifies
CUDA = Backend("cuda", (1, 2, 3, 4, 16, 15, 26))

GDN_MAX_DK = 256  # gdn.cu: GDN_TI * GDN_MAX_PER
CONV_MAX_TAPS = 8  # conv.cu
SEL_MAX_K = 16  # dflash.cu
QUANT_KERNELS = {4: "affine_gemv_q4_f32", 2: "affine_gemv_q2_f32", 1: "affine_gemv_q1_f32"}
# bgemv.cu: the batch-invariant products (issue #44), DEVICE-UNVERIFIED: they have run only through
# tests/test_cuda.py's host-compiled emulation and scripts/gpu_check.py's `rows_products` section
# has not run yet; nothing in the engine calls them while ROWS_PRODUCTS is False
ROWS_PRODUCTS = False
# per format, per pass size (input rows per read of the weights): the wrapper takes the smallest
# pass that holds R (16 past that); the four compute every row bit for bit alike (bgemv.cu)
ROWS_PASSES = (1, 4, 8, 16)
ROWS_KERNELS = {fmt: {p: f"{fmt}_rows_gemv_r{p}_f32" for p in ROWS_PASSES} for fmt in ("bf16", "int8")}
ROWS_OUTPUTS_PER_WARP = {1: 1, 4: 4, 8: 2, 16: 2}  # bgemv.cu BG_OW; 8 warps a block


def rows_pass(rows: int) -> int:
    return next((p for p in ROWS_PASSES if rows <= p), ROWS_PASSES[-1])


def rows_kernel(fmt: str, rows: int) -> str:
    """The bgemv.cu entry a product of `rows` input rows launches."""
    return ROWS_KERNELS[fmt][rows_pass(rows)]


def rows_grid(rows: int, out_features: int) -> tuple[int]:
    return (-(-out_features // (8 * ROWS_OUTPUTS_PER_WARP[rows_pass(rows)])),)


def cuda_unavailable_reason() -> str | None:
    """None when the cuda backend can run here, else one line naming what is missing
    (cuda-python, the NVIDIA driver, a device, a CUDA build of torch, a supported GPU, the PTX).
    With TURBO_CUDA_SIM=1 the driver is the simulated device's (cuda_sim): it needs a host C++
    compiler and the PTX (each launch is checked against its entry), not torch CUDA -- backend
    cuda's step is the CUDA step of its own (turbo/backends/cuda_step), raw driver memory."""
    if cuda_sim.enabled():
        sim_missing = cuda_sim.unavailable_reason()
        if sim_missing:
            return sim_missing
        return _ptx_missing("sm_90")  # (the simulated device reports compute capability 9.0)
    try:
        driver = cuda_kernels._driver()
    except ImportError:
        return f"backend cuda needs cuda-python; {extras.missing('cuda', 'cuda.bindings')}"
    try:
        result = driver.cuInit(0)
    except Exception as e:  # noqa: BLE001 - cuda-python raises when libcuda cannot be loaded
        return f"backend cuda needs an NVIDIA driver: cuda-python could not load libcuda ({type(e).__name__})"
    err = result[0] if isinstance(result, tuple) else result
    if err == driver.CUresult.CUDA_ERROR_NO_DEVICE:
        return "backend cuda needs a CUDA device: the NVIDIA driver is loaded and reports none"
    if int(err) != 0:
        return f"backend cuda: cuInit failed: {result_name(driver, err)}"
    err, count = driver.cuDeviceGetCount()
    if int(err) != 0 or count == 0:
        return "backend cuda needs a CUDA device: the NVIDIA driver is loaded and reports none"
    # the device's capability from the driver (torch CUDA is not needed: the step is raw driver memory)
    err, dev = driver.cuDeviceGet(0)
    attr = driver.CUdevice_attribute
    err1, major = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
    err2, minor = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
    if int(err) or int(err1) or int(err2):
        return "backend cuda: the driver could not report device 0's compute capability"
    arch = arch_for(int(major), int(minor))
    if arch is None:
        return f"backend cuda needs compute capability 8.0 or newer; this device is {major}.{minor}"
    return _ptx_missing(arch)


def _ptx_missing(arch: str) -> str | None:
    missing = [m for m in MODULES if not (ptx_dir() / f"{m}.{arch}.ptx").is_file()]
    if missing:
        return f"backend cuda needs the PTX kernels: {', '.join(f'{m}.{arch}.ptx' for m in missing)} missing in {ptx_dir()}"
    return None


def _k(t: torch.Tensor):
    return cuda_kernels.kernels(t.device.index)


def _need_cuda(t: torch.Tensor, name: str) -> None:
    if not t.is_cuda:
        raise TurboError(f"backend cuda: {name} is on {t.device}, expected a CUDA tensor")


def _f32(t: torch.Tensor, name: str) -> torch.Tensor:
    _need_cuda(t, name)
    return t.float().contiguous()


def _out_buffer(t: torch.Tensor, shape, name: str) -> torch.Tensor:
    """A caller's output buffer: the kernels write fp32, densely, on the GPU."""
    _need_cuda(t, name)
    if t.dtype != torch.float32 or not t.is_contiguous() or tuple(t.shape) != tuple(shape):
        raise TurboError(f"backend cuda: {name} must be a contiguous float32 {list(shape)} tensor, "
                         f"got {t.dtype} {list(t.shape)}")
    return t


# ---- GDN recurrence ------------------------------------------------------------------------


def gdn_recurrence(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, keep_states: bool = False, out_state: torch.Tensor | None = None):
    """ops.gdn_recurrence on the GPU: state [H, dk, dv] fp32; q, k [R, H, dk]; v [R, H, dv];
    g, beta [R, H]. Returns (outputs [R, H, dv], final state, the state after every row when
    keep_states: views of one [R, H, dk, dv] tensor). `out_state` may be `state` (in place)."""
    state = _f32(state, "state")
    q, k, v, g, beta = (_f32(t, n) for t, n in ((q, "q"), (k, "k"), (v, "v"), (g, "g"), (beta, "beta")))
    rows, heads, dk = q.shape
    dv = v.shape[-1]
    if dk > GDN_MAX_DK:
        raise TurboError(f"backend cuda: the GDN kernel takes key heads up to {GDN_MAX_DK} wide, this one is {dk}")
    new_state = torch.empty_like(state) if out_state is None else _out_buffer(out_state, state.shape, "out_state")
    out = torch.empty(rows, heads, dv, device=q.device, dtype=torch.float32)
    states = torch.empty(rows, heads, dk, dv, device=q.device, dtype=torch.float32) if keep_states else None
    _k(q).launch("gdn", "gdn_recurrence_f32", (heads, -(-dv // 32)), (32, 8),
                 [ptr(state), ptr(new_state), ptr(states), ptr(out), ptr(q), ptr(k), ptr(v), ptr(g), ptr(beta),
                  i32(rows), i32(heads), i32(dk), i32(dv)])
    return out, new_state, (list(states.unbind(0)) if keep_states else None)


# ---- conv window + causal conv + silu ------------------------------------------------------


def conv_window_update(window: torch.Tensor, x: torch.Tensor, w: torch.Tensor, keep_ext: bool = True,
                       new_window: torch.Tensor | None = None):
    """window [K-1, C], x [R, C], w [C, K] -> (silu(conv) [R, C], ext [K-1+R, C] or None,
    new window [K-1, C] = ext[R:]). `new_window` may be `window` (updated in place)."""
    window, x, w = _f32(window, "window"), _f32(x, "x"), _f32(w, "w")
    rows, channels = x.shape
    taps = w.shape[1]
    if taps > CONV_MAX_TAPS:
        raise TurboError(f"backend cuda: the conv kernel takes up to {CONV_MAX_TAPS} taps, this one has {taps}")
    out = torch.empty(rows, channels, device=x.device, dtype=torch.float32)
    ext = torch.empty(taps - 1 + rows, channels, device=x.device, dtype=torch.float32) if keep_ext else None
    nw = torch.empty_like(window) if new_window is None else _out_buffer(new_window, window.shape, "new_window")
    _k(x).launch("conv", "conv_window_silu_f32", (-(-channels // 256),), (256,),
                 [ptr(window), ptr(x), ptr(w), ptr(out), ptr(ext), ptr(nw), i32(rows), i32(channels), i32(taps)])
    return out, ext, nw


def causal_conv_rows(ext: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """ops.causal_conv_rows on the GPU: ext [K-1+R, C] (window then rows), w [C, K] -> [R, C]."""
    taps = w.shape[1]
    out, _, _ = conv_window_update(ext[:taps - 1], ext[taps - 1:], w, keep_ext=False)
    return out


# ---- gated RMSNorm -------------------------------------------------------------------------


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """ops.gated_rms_norm on the GPU: o, z [..., d]; w [d]."""
    shape = o.shape
    d = shape[-1]
    o2, z2, w = _f32(o, "o").reshape(-1, d), _f32(z, "z").reshape(-1, d), _f32(w, "w")
    n = o2.shape[0]
    out = torch.empty(n, d, device=o.device, dtype=torch.float32)
    _k(o).launch("norm", "gated_rms_norm_f32", (-(-n // 4),), (128,),
                 [ptr(o2), ptr(z2), ptr(w), ptr(out), i32(n), i32(d), f32(eps)])
    return out.reshape(shape)


# ---- DFlash2 -------------------------------------------------------------------------------


def grouped_conv(h: torch.Tensor, base: torch.Tensor, dyn: torch.Tensor, group: int) -> torch.Tensor:
    """dflash_math.grouped_conv on the GPU: h [rows, H]; base [taps, H]; dyn [rows, taps, H/group]."""
    h, base, dyn = _f32(h, "h"), _f32(base, "base"), _f32(dyn, "dyn")
    rows, hidden = h.shape
    taps = base.shape[0]
    out = torch.empty_like(h)
    _k(h).launch("dflash", "grouped_conv_f32", (-(-hidden // 256), rows), (256,),
                 [ptr(h), ptr(base), ptr(dyn), ptr(out), i32(rows), i32(hidden), i32(taps), i32(group)])
    return out


class _SelectorWorkspace:
    """cand ids / values and the last-block ticket counter (zero between launches)."""

    def __init__(self):
        self.buffers: dict[int | None, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.retired: list = []  # outgrown buffers stay alive: a captured CUDA graph may still point at them

    def get(self, device: torch.device, rows: int, k: int):
        have = self.buffers.get(device.index)  # one per device: launches go to one stream at a time
        if have is None or have[0].numel() < rows * k:
            if have is not None:
                self.retired.append(have)
            n = max(rows * k, 64 * SEL_MAX_K)
            have = (torch.empty(n, dtype=torch.int32, device=device), torch.empty(n, dtype=torch.float32, device=device),
                    torch.zeros(1, dtype=torch.int32, device=device))
            self.buffers[device.index] = have
        return have


_workspace = _SelectorWorkspace()


def select_candidates_ids(logits: torch.Tensor, proj: torch.Tensor, anchor: int, pred_codebook: torch.Tensor,
                          succ_codebook: torch.Tensor, top_k: int) -> torch.Tensor:
    """The selector kernel: int32 [rows] drafted ids on the GPU (no host sync), given
    proj = final @ hidden_projection^T [rows, rank]."""
    logits, proj = _f32(logits, "logits"), _f32(proj, "proj")
    pred_codebook, succ_codebook = _f32(pred_codebook, "pred_codebook"), _f32(succ_codebook, "succ_codebook")
    rows, vocab = logits.shape
    rank = proj.shape[1]
    if not 1 <= top_k <= min(SEL_MAX_K, vocab):
        raise TurboError(f"backend cuda: the selector kernel takes top_k 1..{min(SEL_MAX_K, vocab)}, got {top_k}")
    if not 0 <= anchor < vocab:
        raise TurboError(f"backend cuda: anchor {anchor} is outside the vocab 0..{vocab - 1}")
    out = torch.empty(rows, dtype=torch.int32, device=logits.device)
    cand_id, cand_val, counter = _workspace.get(logits.device, rows, top_k)
    _k(logits).launch("dflash", "select_candidates_f32", (rows,), (256,),
                      [ptr(logits), ptr(proj), ptr(pred_codebook), ptr(succ_codebook), i32(anchor), i32(rows),
                       i32(vocab), i32(rank), i32(top_k), ptr(cand_id), ptr(cand_val), ptr(counter), ptr(out)])
    return out


def select_candidates(logits: torch.Tensor, final: torch.Tensor, anchor: int, hidden_projection: torch.Tensor,
                      pred_codebook: torch.Tensor, succ_codebook: torch.Tensor, top_k: int) -> list[int]:
    """dflash_math.select_candidates on the GPU (the projection is one torch GEMM; top-k and the
    greedy bigram rescoring are one kernel launch). Ties go to the lower token id."""
    proj = final.float() @ hidden_projection.float().T
    return select_candidates_ids(logits, proj, anchor, pred_codebook, succ_codebook, top_k).tolist()


# ---- affine-quantized GEMV -----------------------------------------------------------------


def _storage16(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    if t.dtype == torch.float16:
        return t.contiguous().view(torch.int16), 0
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16), 1
    raise TurboError(f"backend cuda: quantized scales / biases are {t.dtype}, expected float16 or bfloat16")


def affine_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int,
                  group: int) -> torch.Tensor:
    """x [R, in] @ w^T with w = scale * q + bias per group of `group` input columns, from the
    packed int32 [out, in*bits/32] (turbo/store/quant.py layout). Returns fp32 [R, out]."""
    if bits not in QUANT_KERNELS:
        raise TurboError(f"backend cuda: {bits}-bit weights have no kernel (expected 4, 2 or 1)")
    x = _f32(x, "x")
    rows, cols = x.shape
    out_features, words = packed.shape
    if words * 32 // bits != cols or cols % group or group % (32 // bits):
        raise TurboError(f"backend cuda: packed weight [{out_features}, {words}] ({bits}-bit, group {group}) "
                         f"does not take {cols} input columns")
    _need_cuda(packed, "packed weight")
    packed = packed.contiguous()
    s, kind = _storage16(scales)
    b, kind_b = _storage16(biases)
    if kind != kind_b:
        raise TurboError("backend cuda: scales and biases have different dtypes")
    y = torch.empty(rows, out_features, device=x.device, dtype=torch.float32)
    _k(x).launch("qgemv", QUANT_KERNELS[bits], (-(-out_features // 8),), (256,),
                 [ptr(x), ptr(packed), ptr(s), ptr(b), ptr(y), i32(rows), i32(cols), i32(out_features), i32(group),
                  i32(kind)])
    return y


# ---- batch-invariant products (bgemv.cu; DEVICE-UNVERIFIED, off: ROWS_PRODUCTS) ------------------


def _aligned16(t: torch.Tensor) -> torch.Tensor:
    """`t` contiguous with a 16-byte aligned start (the kernels' vector loads)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def bf16_rows_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [R, in] (cast to fp32) @ w^T for bf16 w [out, in] read as stored (bfloat16, or its raw
    int16 / uint16 bits): fp32 [R, out], fp32 accumulation. Row r of the result is bit-identical
    whatever the number of rows beside it (bgemv.cu: a fixed reduction order per row); the
    weights are read once per 16 rows. DEVICE-UNVERIFIED (see ROWS_PRODUCTS)."""
    x = _aligned16(_f32(x, "x"))
    _need_cuda(w, "w")
    if w.dtype not in (torch.bfloat16, torch.int16, torch.uint16):
        raise TurboError(f"backend cuda: bf16_rows_product takes bf16 weights (or their raw 16-bit storage), "
                         f"got {w.dtype}")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise TurboError(f"backend cuda: bf16_rows_product takes x [R, in] and w [out, in], "
                         f"got {list(x.shape)} and {list(w.shape)}")
    w = _aligned16(w.view(torch.int16))
    rows, cols = x.shape
    out_features = w.shape[0]
    y = torch.empty(rows, out_features, device=x.device, dtype=torch.float32)
    if rows and out_features:
        _k(x).launch("bgemv", rows_kernel("bf16", rows), rows_grid(rows, out_features), (256,),
                     [ptr(x), ptr(w), ptr(y), i32(rows), i32(cols), i32(out_features)])
    return y


def int8_rows_product(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor,
                      group: int = 64) -> torch.Tensor:
    """affine_linear for turbo/store/quant.py's int8 (uint8 levels, 4 per int32 word, bf16 scales /
    biases per `group` columns), batch-invariant like bf16_rows_product. DEVICE-UNVERIFIED."""
    x = _aligned16(_f32(x, "x"))
    rows, cols = x.shape
    out_features, words = packed.shape
    if words * 4 != cols or group <= 0 or cols % group:
        raise TurboError(f"backend cuda: int8 weight [{out_features}, {words}] (group {group}) "
                         f"does not take {cols} input columns")
    if scales.dtype != torch.bfloat16 or biases.dtype != torch.bfloat16:
        raise TurboError(f"backend cuda: int8 scales / biases are {scales.dtype} / {biases.dtype}, expected bfloat16")
    if tuple(scales.shape) != (out_features, cols // group) or tuple(biases.shape) != tuple(scales.shape):
        raise TurboError(f"backend cuda: int8 scales / biases must be [{out_features}, {cols // group}]")
    _need_cuda(packed, "packed weight")
    packed = _aligned16(packed)
    s, b = scales.contiguous().view(torch.int16), biases.contiguous().view(torch.int16)
    y = torch.empty(rows, out_features, device=x.device, dtype=torch.float32)
    if rows and out_features:
        _k(x).launch("bgemv", rows_kernel("int8", rows), rows_grid(rows, out_features), (256,),
                     [ptr(x), ptr(packed), ptr(s), ptr(b), ptr(y), i32(rows), i32(cols), i32(out_features),
                      i32(group)])
    return y
