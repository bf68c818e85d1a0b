"""The simulated device (turbo/backends/cuda_sim, issue #55): the stand-in for cuda.bindings.driver
that `TURBO_CUDA_SIM=1` puts behind cuda_kernels.

- the checked-in kernels (kernels_ptx/*.cu), loaded from their PTX and launched through
  cuda_kernels.Kernels on driver-API memory, against the CPU functions tests/test_cuda.py
  compares them with;
- batch invariance of bgemv's rows products (each row of a 1..16-row product bit-identical to
  that row alone), and a negative control (a test-only kernel whose reduction order depends on
  R) failing the same check;
- launch parameters checked against the PTX entry; illegal addresses, divergent barriers and
  warp ops reported, not hung or crashed;
- stream capture: a host sync inside a capture is refused and invalidates it; a graph replays
  the eager launch list;
- launch records: exact unique bytes read and written per allocation.
"""

from __future__ import annotations

import ctypes
import inspect
import shutil
from pathlib import Path

import pytest
import torch
from test_cuda import (
    dequantized_linear,
    gdn_inputs,
    int8_inputs,
    quant_inputs,
    selector_inputs,
)

from turbo.backends import cuda as cb
from turbo.backends import cuda_kernels as ck
from turbo.backends import cuda_sim, ops
from turbo.backends import dflash_math as dflash

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the simulated device builds kernels with g++")

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "cuda_sim"
d = cuda_sim.driver
R = d.CUresult


def ok(result):
    assert int(result[0]) == 0, (result, cuda_sim.last_error())
    return None if len(result) == 1 else result[1] if len(result) == 2 else result[1:]


@pytest.fixture(scope="module")
def k():
    """cuda_kernels' loader on the simulated device (TURBO_CUDA_SIM=1 for this module)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(cuda_sim.ENV, "1")
        mp.setattr(ck, "_kernels", {})
        cuda_sim.add_source_dir(FIXTURES)
        loader = ck.kernels()
        assert loader.simulated and loader.arch == "sm_90"
        yield loader


class Mem:
    """Driver-API buffers for one test, freed at its end."""

    def __init__(self):
        self.ptrs = []

    def put(self, t: torch.Tensor):
        t = t.contiguous()
        n = t.numel() * t.element_size()
        p = ok(d.cuMemAlloc(max(n, 4)))
        self.ptrs.append(p)
        if n:
            ok(d.cuMemcpyHtoD(p, t.data_ptr(), n))
        return p

    def empty(self, shape, dtype=torch.float32):
        n = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        p = ok(d.cuMemAlloc(max(n, 4)))
        self.ptrs.append(p)
        return p

    @staticmethod
    def get(p, shape, dtype=torch.float32) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        ok(d.cuMemcpyDtoH(t.data_ptr(), p, t.numel() * t.element_size()))
        return t

    def free(self):
        for p in self.ptrs:
            ok(d.cuMemFree(p))


@pytest.fixture
def mem(k):
    m = Mem()
    yield m
    m.free()


P, I, F = ck.ptr, ck.i32, ck.f32


# ---- the checked-in kernels against the CPU functions ----------------------------------------------


def test_gdn_recurrence(k, mem):
    rows, heads, dk, dv = 3, 2, 40, 36  # two column tiles, the second partial
    state, q, kk, v, g, beta = gdn_inputs(rows, heads, dk, dv, seed=5)
    outs, final, states = ops.gdn_recurrence(state, q, kk, v, g, beta, keep_states=True)
    ps = [mem.put(t) for t in (state, q, kk, v, g, beta)]
    new_state, pstates, pout = mem.empty(state.shape), mem.empty((rows, heads, dk, dv)), mem.empty((rows, heads, dv))
    k.launch("gdn", "gdn_recurrence_f32", (heads, -(-dv // 32)), (32, 8),
             [P(ps[0]), P(new_state), P(pstates), P(pout), *map(P, ps[1:]), I(rows), I(heads), I(dk), I(dv)])
    torch.testing.assert_close(mem.get(pout, outs.shape), outs)
    torch.testing.assert_close(mem.get(new_state, final.shape), final)
    torch.testing.assert_close(mem.get(pstates, (rows, heads, dk, dv)), torch.stack(states))


def test_conv_window_silu(k, mem):
    gen = torch.Generator().manual_seed(7)
    rows, channels, taps = 2, 300, 4
    window, x, w = (torch.randn(taps - 1, channels, generator=gen), torch.randn(rows, channels, generator=gen),
                    torch.randn(channels, taps, generator=gen))
    ext = torch.cat([window, x])
    pw, px, pk = mem.put(window), mem.put(x), mem.put(w)
    pout, pext = mem.empty((rows, channels)), mem.empty(ext.shape)
    k.launch("conv", "conv_window_silu_f32", (-(-channels // 256),), (256,),
             [P(pw), P(px), P(pk), P(pout), P(pext), P(pw), I(rows), I(channels), I(taps)])  # window in place
    torch.testing.assert_close(mem.get(pout, (rows, channels)), ops.causal_conv_rows(ext, w))
    assert torch.equal(mem.get(pext, ext.shape), ext) and torch.equal(mem.get(pw, window.shape), ext[rows:])


def test_gated_rms_norm(k, mem):
    gen = torch.Generator().manual_seed(8)
    n, dim = 6, 100
    o, z, w = torch.randn(n, dim, generator=gen), torch.randn(n, dim, generator=gen), torch.randn(dim, generator=gen)
    pout = mem.empty((n, dim))
    k.launch("norm", "gated_rms_norm_f32", (-(-n // 4),), (128,),
             [P(mem.put(o)), P(mem.put(z)), P(mem.put(w)), P(pout), I(n), I(dim), F(1e-6)])
    torch.testing.assert_close(mem.get(pout, (n, dim)), ops.gated_rms_norm(o, z, w, 1e-6))


def test_grouped_conv(k, mem):
    gen = torch.Generator().manual_seed(9)
    rows, hidden, taps, group = 3, 300, 2, 15
    h, base = torch.randn(rows, hidden, generator=gen), torch.randn(taps, hidden, generator=gen)
    dyn = torch.randn(rows, taps, hidden // group, generator=gen)
    pout = mem.empty((rows, hidden))
    k.launch("dflash", "grouped_conv_f32", (-(-hidden // 256), rows), (256,),
             [P(mem.put(h)), P(mem.put(base)), P(mem.put(dyn)), P(pout), I(rows), I(hidden), I(taps), I(group)])
    assert torch.equal(mem.get(pout, (rows, hidden)), dflash.grouped_conv(h, base, dyn, group))


def test_select_candidates(k, mem):
    rows, vocab, top_k = 3, 600, 16
    logits, final, hp, pred_cb, succ_cb = selector_inputs(rows, vocab, 16, 8, seed=10)
    logits[1, 5::256] += 20.0  # one thread's slice holds the row's top-k
    want = dflash.select_candidates(logits, final, 11, hp, pred_cb, succ_cb, top_k)
    proj = final @ hp.T
    ids, vals = mem.empty((rows, top_k), torch.int32), mem.empty((rows, top_k))
    counter, out = mem.put(torch.zeros(1, dtype=torch.int32)), mem.empty((rows,), torch.int32)
    args = [P(mem.put(logits)), P(mem.put(proj)), P(mem.put(pred_cb)), P(mem.put(succ_cb)), I(11), I(rows), I(vocab),
            I(8), I(top_k), P(ids), P(vals), P(counter), P(out)]
    for _ in range(2):  # the last block resets the ticket counter for the next launch
        k.launch("dflash", "select_candidates_f32", (rows,), (256,), args)
        assert mem.get(out, (rows,), torch.int32).tolist() == want
        assert int(mem.get(counter, (1,), torch.int32)) == 0


@pytest.mark.parametrize("bits,group", [(4, 64), (2, 128)])
def test_affine_gemv(k, mem, bits, group):
    out_features, cols, rows = 13, 256, 3
    _, (packed, scales, biases) = quant_inputs(out_features, cols, bits, group, seed=bits)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(bits))
    py = mem.empty((rows, out_features))
    k.launch("qgemv", cb.QUANT_KERNELS[bits], (-(-out_features // 8),), (256,),
             [P(mem.put(x)), P(mem.put(packed)), P(mem.put(scales.view(torch.int16))),
              P(mem.put(biases.view(torch.int16))), P(py), I(rows), I(cols), I(out_features), I(group),
              I(1 if scales.dtype == torch.bfloat16 else 0)])
    torch.testing.assert_close(mem.get(py, (rows, out_features)), dequantized_linear(x, packed, scales, biases, bits, group),
                               rtol=1e-4, atol=1e-4)


# ---- batch invariance ---------------------------------------------------------------------------------


def bf16_rows(k, mem, w: torch.Tensor):
    """x [R, in] -> x @ w^T through a rows kernel on the device (w bf16 [out, in])."""
    out_features, cols = w.shape
    pw = mem.put(w.view(torch.int16))

    def fn(x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        py = mem.empty((rows, out_features))
        k.launch("bgemv", cb.rows_kernel("bf16", rows), cb.rows_grid(rows, out_features), (256,),
                 [P(mem.put(x)), P(pw), P(py), I(rows), I(cols), I(out_features)])
        return mem.get(py, (rows, out_features))
    return fn


def rows_invariant(fn, x: torch.Tensor, max_rows: int = 16) -> bool:
    """Each row of every 1..max_rows-row product is bit-identical to that row alone."""
    alone = torch.cat([fn(x[r:r + 1]) for r in range(max_rows)])
    return all(torch.equal(fn(x[:rows]), alone[:rows]) for rows in range(2, max_rows + 1))


SIMTEST_PTX = """.version 8.0
.target sm_90
.address_size 64
.visible .entry rdep_rows_f32(.param .u64 a, .param .u64 b, .param .u64 c, .param .u32 d, .param .u32 e, .param .u32 f)
.maxntid 256, 1, 1
{ ret; }
.visible .entry touch_f32(.param .u64 a, .param .u64 b, .param .u32 c, .param .u32 d)
.maxntid 256, 1, 1
{ ret; }
.visible .entry fill_f32(.param .u64 a, .param .f32 b)
.maxntid 256, 1, 1
{ ret; }
.visible .entry split_barrier(.param .u64 a, .param .u32 b)
.maxntid 256, 1, 1
{ ret; }
.visible .entry warp_ops(.param .u64 a, .param .u64 b)
.maxntid 128, 1, 1
{ ret; }
.visible .entry spin(.param .u64 a)
.maxntid 32, 1, 1
{ ret; }
"""


@pytest.fixture(scope="module")
def simtest(k):
    """tests/fixtures/cuda_sim/simtest.cu's entries, loaded through the driver from a PTX text
    that declares them (as nvcc would)."""
    mod = ok(d.cuModuleLoadData(SIMTEST_PTX.encode() + b"\0"))
    names = ("rdep_rows_f32", "touch_f32", "fill_f32", "split_barrier", "warp_ops", "spin")
    return {n: ok(d.cuModuleGetFunction(mod, n.encode())) for n in names}


def launch(fn, grid, block, args, shared=0, stream=0):
    """cuLaunchKernel with the (values, types) parameters; the CUresult."""
    g, b = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
    return d.cuLaunchKernel(fn, *g, *b, shared, d.CUstream(stream), (tuple(args), tuple(type(a) for a in args)), 0)[0]


def test_bf16_rows_products_are_batch_invariant(k, mem):
    gen = torch.Generator().manual_seed(44)
    w = torch.randn(13, 552, generator=gen).to(torch.bfloat16)  # 13 outputs: a partial block; a lone last chunk
    x = torch.randn(16, 552, generator=gen) * torch.logspace(-3, 3, 552)  # cancellation: the order shows
    fn = bf16_rows(k, mem, w)
    assert rows_invariant(fn, x)
    torch.testing.assert_close(fn(x), x @ w.float().T, rtol=1e-3, atol=1e-2)


def test_int8_rows_products_are_batch_invariant(k, mem):
    packed, scales, biases = int8_inputs(11, 320, 64, seed=320)
    pq, ps, pb = mem.put(packed), mem.put(scales.view(torch.int16)), mem.put(biases.view(torch.int16))
    x = torch.randn(16, 320, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 3, 320)

    def fn(rows_x):
        rows = rows_x.shape[0]
        py = mem.empty((rows, 11))
        k.launch("bgemv", cb.rows_kernel("int8", rows), cb.rows_grid(rows, 11), (256,),
                 [P(mem.put(rows_x)), P(pq), P(ps), P(pb), P(py), I(rows), I(320), I(11), I(64)])
        return mem.get(py, (rows, 11))
    assert rows_invariant(fn, x)
    torch.testing.assert_close(fn(x[:3]), dequantized_linear(x[:3], packed, scales, biases, 8, 64), rtol=1e-4, atol=1e-3)


def test_batch_invariance_check_fails_an_R_dependent_kernel(k, mem, simtest):
    """Negative control: the same check on a kernel that sums in chunks of R elements fails."""
    gen = torch.Generator().manual_seed(44)
    w = torch.randn(13, 552, generator=gen).to(torch.bfloat16)
    x = torch.randn(16, 552, generator=gen) * torch.logspace(-3, 3, 552)
    pw = mem.put(w.view(torch.int16))

    def fn(rows_x):
        rows = rows_x.shape[0]
        py = mem.empty((rows, 13))
        assert launch(simtest["rdep_rows_f32"], (1,), (256,), [P(mem.put(rows_x)), P(pw), P(py), I(rows), I(552), I(13)]) == 0
        return mem.get(py, (rows, 13))
    torch.testing.assert_close(fn(x), x @ w.float().T, rtol=1e-3, atol=1e-2)  # right, up to rounding
    assert not rows_invariant(fn, x)


# ---- parameters, addresses, barriers ---------------------------------------------------------------


def test_launch_parameters_are_checked_against_the_ptx(k, mem, simtest):
    y = mem.empty((4,))
    fn = simtest["touch_f32"]
    assert launch(fn, (1,), (32,), [P(y), P(y), I(4)]) == R.CUDA_ERROR_INVALID_VALUE  # one short
    assert "touch_f32 takes 4 parameters (.u64, .u64, .u32, .u32), got 3" in cuda_sim.last_error()
    assert launch(fn, (1,), (32,), [P(y), P(y), I(4), ctypes.c_int64(1)]) == R.CUDA_ERROR_INVALID_VALUE
    assert "parameter 3 is .u32 (4 bytes), got 8 bytes" in cuda_sim.last_error()
    assert launch(fn, (1,), (32,), [P(y), P(y), I(4), F(1.0)]) == R.CUDA_ERROR_INVALID_VALUE
    assert "parameter 3 is .u32, got a float value" in cuda_sim.last_error()
    assert launch(fn, (1,), (512,), [P(y), P(y), I(4), I(1)]) == R.CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES  # over 256
    # through the loader: the CudaError names the call, the kernel and what the simulation saw
    with pytest.raises(ck.CudaError, match=r"cuLaunchKernel failed for kernel gated_rms_norm_f32: "
                                           r"CUDA_ERROR_INVALID_VALUE.*takes 7 parameters.*got 6"):
        k.launch("norm", "gated_rms_norm_f32", (1,), (128,), [P(y), P(y), P(y), P(y), I(1), I(4)])
    # a bare void** address: read as the PTX says, recorded as unchecked
    cuda_sim.reset_records()
    vals = [P(y), P(y), I(0), I(1)]
    arr = (ctypes.c_void_p * 4)(*[ctypes.addressof(v) for v in vals])
    ok(d.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, d.CUstream(0), ctypes.addressof(arr), 0))
    assert cuda_sim.launches()[-1].checked is False


def test_illegal_addresses_are_errors_not_crashes(k, mem, simtest):
    y = ok(d.cuMemAlloc(16 * 4))  # 16 floats; 32 threads write 32
    assert launch(simtest["fill_f32"], (1,), (32,), [P(y), F(1.0)]) == R.CUDA_ERROR_ILLEGAL_ADDRESS
    assert "write of 4 bytes" in cuda_sim.last_error() and "past its allocation's end" in cuda_sim.last_error()
    assert "kernel fill_f32, block (0,0,0), thread (16,0,0)" in cuda_sim.last_error()
    assert launch(simtest["fill_f32"], (1,), (16,), [P(y), F(2.0)]) == 0
    assert mem.get(y, (16,)).tolist() == [2.0] * 16
    ok(d.cuMemFree(y))
    assert launch(simtest["fill_f32"], (1,), (16,), [P(y), F(3.0)]) == R.CUDA_ERROR_ILLEGAL_ADDRESS
    assert "no live allocation" in cuda_sim.last_error()
    assert launch(simtest["fill_f32"], (1,), (16,), [P(None), F(3.0)]) == R.CUDA_ERROR_ILLEGAL_ADDRESS
    assert "a null pointer" in cuda_sim.last_error()
    host = torch.zeros(16)  # host memory the device was not given
    assert launch(simtest["fill_f32"], (1,), (16,), [ctypes.c_void_p(host.data_ptr()), F(3.0)]) \
        == R.CUDA_ERROR_ILLEGAL_ADDRESS and "not device memory" in cuda_sim.last_error()
    ok(d.cuMemHostRegister(host.data_ptr(), 64, 0))  # registered: device-accessible
    assert launch(simtest["fill_f32"], (1,), (16,), [ctypes.c_void_p(host.data_ptr()), F(3.0)]) == 0
    ok(d.cuMemHostUnregister(host.data_ptr()))
    assert host.tolist() == [3.0] * 16
    assert d.cuMemFree(y)[0] == R.CUDA_ERROR_INVALID_VALUE  # twice
    z = mem.empty((4,))
    assert d.cuMemcpyHtoD(z, host.data_ptr(), 32)[0] == R.CUDA_ERROR_INVALID_VALUE  # past its end


@pytest.mark.parametrize("mode,threads,why", [(0, 64, "not reached by all threads"), (1, 64, "divergent __syncthreads"),
                                              (2, 32, ("deadlock in kernel split_barrier, block (0,0,0): 16 threads "
                                                       "wait at __syncthreads (line 49), 16 at warp ops, 0 exited"))])
def test_a_barrier_not_all_threads_reach_is_an_error_naming_the_kernel(k, mem, simtest, mode, threads, why):
    y = mem.empty((64,))
    assert launch(simtest["split_barrier"], (2,), (threads,), [P(y), I(mode)]) == R.CUDA_ERROR_LAUNCH_FAILED
    assert why in cuda_sim.last_error() and "split_barrier" in cuda_sim.last_error()


def test_warp_ops_shared_memory_and_atomics(k, mem, simtest):
    out, counter = mem.empty((128, 8), torch.int32), mem.put(torch.zeros(2, dtype=torch.int32))
    assert launch(simtest["warp_ops"], (3,), (128,), [P(out), P(counter)], shared=128 * 4) == 0
    got = mem.get(out, (128, 8), torch.int32)
    for t in range(128):
        lane, warp0 = t % 32, t - t % 32
        seg = t - t % 8
        want = [t + 1 if lane < 31 else t, warp0 + 5, t ^ 16,
                ctypes.c_int32(sum(1 << i for i in range(32) if i % 3 == 0)).value,
                (127 - t) * 3 + (t + 1) % 128 + 1000, t - 2 if t - 2 >= seg else t, sum(range(warp0, warp0 + 32)), 1]
        assert got[t].tolist() == want, t
    assert mem.get(counter, (2,), torch.int32).tolist() == [3 * 128, 43 * 4 + 2 + 1]  # __syncthreads_count/and/or
    assert launch(simtest["warp_ops"], (1,), (128,), [P(out), P(counter)], shared=100 * 1024) == R.CUDA_ERROR_INVALID_VALUE


def test_a_launch_that_never_ends_times_out(k, mem, simtest):
    flag = mem.put(torch.zeros(1, dtype=torch.int32))
    cuda_sim.set_timeout(0.2)
    try:
        assert launch(simtest["spin"], (1,), (32,), [P(flag)]) == R.CUDA_ERROR_LAUNCH_TIMEOUT
    finally:
        cuda_sim.set_timeout(300)
    assert "ran past 0.2 s" in cuda_sim.last_error() and "kernel spin" in cuda_sim.last_error()


# ---- capture and graphs -------------------------------------------------------------------------------


def test_a_host_sync_inside_a_capture_is_refused(k, mem, simtest):
    stream = ok(d.cuStreamCreate(0))
    x, y = mem.put(torch.arange(8.0)), mem.empty((8,))
    host = torch.empty(8)
    for sync in (lambda: d.cuStreamSynchronize(stream), d.cuCtxSynchronize,
                 lambda: d.cuMemcpyDtoH(host.data_ptr(), y, 32), lambda: d.cuMemAlloc(64)):
        ok(d.cuStreamBeginCapture(stream, d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
        assert launch(simtest["touch_f32"], (1,), (32,), [P(x), P(y), I(8), I(1)], stream=int(stream)) == 0
        assert sync()[0] == R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
        assert ok(d.cuStreamIsCapturing(stream)) == d.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_INVALIDATED
        err, graph = d.cuStreamEndCapture(stream)
        assert err == R.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED and int(graph) == 0
    # the legacy stream during a capture is an implicit sync too
    ok(d.cuStreamBeginCapture(stream, d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
    assert launch(simtest["touch_f32"], (1,), (32,), [P(x), P(y), I(8), I(1)], stream=0) \
        == R.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
    assert d.cuStreamEndCapture(stream)[0] == R.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    ok(d.cuStreamDestroy(stream))


def test_a_graph_replays_the_eager_launch_list(k, mem):
    """Three kernels and a memset, eager on a stream, then captured, instantiated and replayed:
    the same operations with the same parameters, in the same order, and the same bits."""
    stream = ok(d.cuStreamCreate(0))
    gen = torch.Generator().manual_seed(1)
    o, z, w = torch.randn(8, 64, generator=gen), torch.randn(8, 64, generator=gen), torch.randn(64, generator=gen)
    wb = torch.randn(10, 64, generator=gen).to(torch.bfloat16)
    po, pz, pw, pwb = mem.put(o), mem.put(z), mem.put(w), mem.put(wb.view(torch.int16))
    pn, py, pc = mem.empty((8, 64)), mem.empty((8, 10)), mem.empty((8, 64))
    window = mem.put(torch.zeros(3, 64))
    kw = mem.put(torch.randn(64, 4, generator=gen))

    def step():
        ok(d.cuMemsetD32Async(py, 0, 80, stream))
        k.launch("norm", "gated_rms_norm_f32", (2,), (128,), [P(po), P(pz), P(pw), P(pn), I(8), I(64), F(1e-6)],
                 stream=int(stream))
        k.launch("bgemv", cb.rows_kernel("bf16", 8), cb.rows_grid(8, 10), (256,),
                 [P(pn), P(pwb), P(py), I(8), I(64), I(10)], stream=int(stream))
        k.launch("conv", "conv_window_silu_f32", (1,), (256,), [P(window), P(pn), P(kw), P(pc), P(None), P(None),
                                                                I(8), I(64), I(4)], stream=int(stream))

    cuda_sim.reset_records()
    step()
    ok(d.cuStreamSynchronize(stream))
    eager = cuda_sim.records()
    want = mem.get(py, (8, 10)), mem.get(pc, (8, 64))
    ok(d.cuMemsetD8(py, 0xFF, 320))
    ok(d.cuMemsetD8(pc, 0xFF, 2048))
    ok(d.cuStreamBeginCapture(stream, d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
    cuda_sim.reset_records()
    step()
    assert cuda_sim.records() == []  # captured, not run
    graph = ok(d.cuStreamEndCapture(stream))
    exe = ok(d.cuGraphInstantiate(graph, 0))
    ok(d.cuGraphUpload(exe, stream))
    for _ in range(2):
        cuda_sim.reset_records()
        ok(d.cuGraphLaunch(exe, stream))
        ok(d.cuStreamSynchronize(stream))
        replay = cuda_sim.records()
        assert [r.signature() for r in replay] == [r.signature() for r in eager]
        assert [r.touches for r in replay] == [r.touches for r in eager]
        assert all(r.graph == int(exe) for r in replay) and all(r.graph is None for r in eager)
        assert torch.equal(mem.get(py, (8, 10)), want[0]) and torch.equal(mem.get(pc, (8, 64)), want[1])
    ok(d.cuGraphExecDestroy(exe))
    ok(d.cuGraphDestroy(graph))
    ok(d.cuStreamDestroy(stream))


# ---- launch records -------------------------------------------------------------------------------------


def test_records_count_the_bytes_a_launch_reads_and_writes(k, mem, simtest):
    n, stride = 100, 3
    x, y = mem.put(torch.arange(400.0)), mem.empty((n,))
    cuda_sim.reset_records()
    assert launch(simtest["touch_f32"], (1,), (128,), [P(x), P(y), I(n), I(stride)]) == 0
    (r,) = cuda_sim.launches()
    assert (r.name, r.grid, r.block, r.shared, r.params) == ("touch_f32", (1, 1, 1), (128, 1, 1), 0, (int(x), int(y), n, stride))
    tx, ty = r.touches
    assert (tx.base, tx.size, tx.read, tx.written, tx.args) == (int(x), 1600, 4 * n, 0, (0,))  # each x once
    assert (ty.base, ty.size, ty.read, ty.written, ty.args) == (int(y), 400, 0, 4 * n, (1,))
    assert (r.bytes_read, r.bytes_written) == (4 * n, 4 * n)
    assert (r.raw_read, r.raw_written) == (8 * n, 4 * n)  # two loads of each x element
    assert torch.equal(mem.get(y, (n,)), torch.arange(0.0, 3 * n, 3) * 2)
    ok(d.cuMemcpyDtoD(y, x, 40))
    assert cuda_sim.records()[-1].kind == "memcpy" and cuda_sim.records()[-1].bytes_read == 40
    s = cuda_sim.summarize(cuda_sim.records())
    assert (s.launches, s.by_kernel, s.bytes_read, s.bytes_written, s.copies, s.copy_bytes) == \
        (1, {"touch_f32": 1}, 4 * n, 4 * n, 2, 4 * n + 40)  # the DtoH of y, the DtoD


def test_the_records_of_a_rows_product_read_the_weights_once(k, mem):
    """What the cost plan reads: one launch of bgemv over R rows reads each weight byte once."""
    w = torch.randn(40, 256).to(torch.bfloat16)
    pw = mem.put(w.view(torch.int16))
    for rows in (1, 9):
        px, py = mem.put(torch.randn(rows, 256)), mem.empty((rows, 40))
        cuda_sim.reset_records()
        k.launch("bgemv", cb.rows_kernel("bf16", rows), cb.rows_grid(rows, 40), (256,),
                 [P(px), P(pw), P(py), I(rows), I(256), I(40)])
        (r,) = cuda_sim.launches()
        assert [(t.args, t.read, t.written) for t in r.touches] == [((0,), rows * 1024, 0), ((1,), 40 * 512, 0),
                                                                     ((2,), 0, rows * 160)]


def test_cuda_backend_checks_on_the_simulated_device(k, monkeypatch):
    """cuda_unavailable_reason accepts the simulated device (g++ and the PTX at hand): backend cuda's
    step allocates through the driver API, so torch CUDA is not needed."""
    monkeypatch.setenv(cuda_sim.ENV, "1")
    assert ck._driver() is cuda_sim.driver
    assert cb.cuda_unavailable_reason() is None
    assert ok(d.cuDeviceGetAttribute(d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, ok(d.cuDeviceGet(0)))) == 9
    assert d.cuModuleGetFunction(k.module("norm"), b"nope")[0] == R.CUDA_ERROR_NOT_FOUND
    monkeypatch.setenv(cuda_sim.ENV, "0")
    assert not cuda_sim.enabled()


def test_driver_calls_mirror_cuda_python(k, mem):
    """Signatures, (CUresult, value...) returns, enum values and handle behaviour of the calls
    beside launches; the enums' numbers are cuda-python's where it is installed."""
    dev = ok(d.cuDeviceGet(0))
    assert ok(d.cuDeviceGetCount()) == 1 and d.cuDeviceGet(1)[0] == R.CUDA_ERROR_INVALID_DEVICE
    assert ok(d.cuDeviceGetName(64, dev)).startswith(b"turbo simulated device")
    assert ok(d.cuDeviceTotalMem(dev)) > 2 ** 30 and ok(d.cuDriverGetVersion()) == 13000
    ctx = ok(d.cuCtxCreate(None, 0, dev))
    assert int(ok(d.cuCtxGetCurrent())) == int(ctx)
    ok(d.cuCtxSynchronize())
    ok(d.cuCtxDestroy(ctx))
    assert int(ok(d.cuCtxGetCurrent())) == 0 and d.cuMemAlloc(4)[0] == R.CUDA_ERROR_INVALID_CONTEXT
    ok(d.cuCtxSetCurrent(k.context))
    p = ok(d.cuMemAlloc(64))
    with pytest.raises(TypeError):
        p + 4
    ok(d.cuMemsetD32(p, 0x3F800000, 16))
    assert mem.get(p, (16,)).tolist() == [1.0] * 16
    q = ok(d.cuMemAlloc(64))
    ok(d.cuMemsetD8(q, 0, 64))
    ok(d.cuMemcpyDtoD(int(q) + 8, p, 16))
    host = bytearray(64)
    ok(d.cuMemcpyDtoH(host, q, 64))
    assert torch.frombuffer(host, dtype=torch.float32).tolist() == [0, 0, 1, 1, 1, 1] + [0] * 10
    assert d.cuMemsetD32(int(p) + 2, 0, 1)[0] == R.CUDA_ERROR_INVALID_VALUE  # unaligned
    base, size = ok(d.cuMemGetAddressRange(int(p) + 10))
    assert (int(base), size) == (int(p), 64)
    h = ok(d.cuMemAllocHost(32))  # pinned host memory: device-accessible
    ok(d.cuMemcpyHtoD(h, b"\1" * 32, 32))
    ok(d.cuMemcpyDtoD(p, h, 32))
    ok(d.cuMemFreeHost(h))
    start, end = ok(d.cuEventCreate(0)), ok(d.cuEventCreate(0))
    ok(d.cuEventRecord(start, 0))
    ok(d.cuEventRecord(end, 0))
    ok(d.cuEventSynchronize(end))
    assert ok(d.cuEventElapsedTime(start, end)) >= 0.0
    ok(d.cuMemFree(p))
    ok(d.cuMemFree(q))
    assert ok(d.cuGetErrorName(R.CUDA_ERROR_ILLEGAL_ADDRESS)) == b"CUDA_ERROR_ILLEGAL_ADDRESS"
    try:
        from cuda.bindings import driver as real
    except ImportError:
        return
    for enum_name in ("CUresult", "CUdevice_attribute", "CUfunction_attribute", "CUstreamCaptureStatus",
                      "CUstreamCaptureMode"):
        for member in getattr(d, enum_name):
            assert int(getattr(getattr(real, enum_name), member.name)) == int(member), (enum_name, member.name)
    for name in [n for n in dir(d) if n.startswith("cu") and callable(getattr(d, n))]:
        first = getattr(real, name).__doc__.strip().splitlines()[0]  # "cuMemcpyHtoD(dstDevice, srcHost, ...)"
        want = [a.split(":")[0].split()[-1].lstrip("*").split("=")[0] for a in first[len(name) + 1:-1].split(",") if a.strip()]
        assert list(inspect.signature(getattr(d, name)).parameters) == want, name
