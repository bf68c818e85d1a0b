"""The cuda backend (docs/DESIGN.md 7).

Everywhere (CI has no GPU): the checked-in PTX is what its .cu builds to with the pinned nvcc,
ptxas assembles it for sm_80 and sm_90, every kernel the wrappers launch is an entry of its
PTX, the loader checks every CUresult (against a fake driver), `backend=cuda` without a GPU
fails in one line, the kernels' semantics — written here as independent plain loops that
follow each kernel's algorithm — agree with the CPU backend's functions they are tested
against on a GPU, and the wrappers' launches run (a) a torch transcription of each kernel and
(b) the kernels' own CUDA C on the simulated device (turbo/backends/cuda_sim: built for the host
with g++, threads as fibers, barriers, warp shuffles), both checked against the CPU references.

On a GPU (skipped without one): each kernel against its CPU reference, in place and under
CUDA graph capture.
"""

from __future__ import annotations

import ctypes
import math
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import turbo
from scripts import build_ptx as bp
from scripts import gpu_check
from turbo.backends import cuda as cb
from turbo.backends import cuda_kernels as ck
from turbo.backends import cuda_sim
from turbo.backends import dflash_math as dflash
from turbo.backends import ops, select_backend
from turbo.errors import TurboError
from turbo.store import quant
from turbo.testing.host_cuda import PTX_TYPES, HostDevice, ptx_params

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parent.parent
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)")


# every (module, kernel) a wrapper in turbo/backends/cuda.py launches
LAUNCHED = [("gdn", "gdn_recurrence_f32"), ("conv", "conv_window_silu_f32"), ("norm", "gated_rms_norm_f32"),
            ("dflash", "grouped_conv_f32"), ("dflash", "select_candidates_f32"),
            *(("qgemv", name) for name in cb.QUANT_KERNELS.values()),
            *(("bgemv", name) for names in cb.ROWS_KERNELS.values() for name in names.values())]


# ---- the checked-in PTX ----------------------------------------------------------------------


def test_every_source_has_ptx_for_both_archs():
    sources = bp.sources()
    assert {s.stem for s in sources} == set(ck.MODULES)
    assert bp.ARCHS == ck.ARCHS == ("sm_80", "sm_90")
    for src in sources:
        for arch in bp.ARCHS:
            text = bp.ptx_path(src, arch).read_text()
            assert re.search(rf"^\.target {arch}$", text, re.M), (src.name, arch)
            assert f"V{bp.NVCC_VERSION}" in text  # built by the pinned nvcc


def test_launched_kernels_are_entries_of_their_ptx():
    for module, kernel in LAUNCHED:
        for arch in ck.ARCHS:
            text = (ck.ptx_dir() / f"{module}.{arch}.ptx").read_text()
            assert re.search(rf"\.visible \.entry {kernel}\(", text), (module, kernel, arch)


def test_ptx_is_what_the_sources_build_to():
    nvcc = bp.pinned_nvcc()
    if nvcc is None:
        pytest.skip(f"nvcc V{bp.NVCC_VERSION} not installed (pip install {' '.join(bp.PIP_PACKAGES)})")
    if bp.host_compiler() is None:
        pytest.skip("no gcc on PATH (nvcc preprocesses with the host compiler)")
    assert bp.check(nvcc) == []


def test_ptxas_assembles_every_ptx_for_sm80_and_sm90():
    ptxas = bp.find_tool("ptxas")
    if ptxas is None:
        pytest.skip("ptxas not installed")
    version = bp.tool_version(ptxas)
    if version is None or tuple(map(int, version.split(".")[:2])) < tuple(map(int, bp.NVCC_VERSION.split(".")[:2])):
        pytest.skip(f"ptxas {version} is older than the PTX's nvcc {bp.NVCC_VERSION}")
    for src in bp.sources():
        for arch in bp.ARCHS:
            assert bp.assemble(ptxas, bp.ptx_path(src, arch), arch) is None, (src.name, arch)


def test_ptx_assembles_at_the_loaders_lowest_isa(tmp_path):
    """The loader's fallback for pre-13.0 drivers rewrites `.version`; the kernels must not
    need anything newer than MIN_PTX_ISA."""
    ptxas = bp.find_tool("ptxas")
    if ptxas is None:
        pytest.skip("ptxas not installed")
    for src in bp.sources():
        for arch in bp.ARCHS:
            low = tmp_path / f"{src.stem}.{arch}.ptx"
            low.write_bytes(ck.with_isa(bp.ptx_path(src, arch).read_bytes(), ck.MIN_PTX_ISA))
            assert f".version {ck.MIN_PTX_ISA}\n".encode() in low.read_bytes()
            assert bp.assemble(ptxas, low, arch) is None, (src.name, arch)


# ---- backend choice without a GPU ------------------------------------------------------------

no_cuda_here = pytest.mark.skipif(cb.cuda_unavailable_reason() is None, reason="this machine can run backend cuda")


@pytest.fixture(scope="module")
def tiny_install(tmp_path_factory):
    from turbo.testing import make_install

    return make_install(tmp_path_factory.mktemp("cuda"), 0)[1]


@no_cuda_here
def test_backend_cuda_without_gpu_is_one_line(tiny_install):
    reason = cb.cuda_unavailable_reason()
    assert "\n" not in reason and reason.startswith("backend cuda needs")
    with pytest.raises(TurboError) as e:
        turbo.open(tiny_install, backend="cuda")
    assert str(e.value) == reason


@no_cuda_here
def test_backend_auto_picks_cpu_and_says_why():
    b = select_backend("auto")
    assert b.name == "cpu" and b.note.startswith("backend auto picked cpu (backend cuda needs")


@no_cuda_here
def test_cli_backend_cuda_exits_2_with_one_line(tiny_install, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "turbo", f"hydra.run.dir={tmp_path}/hydra", "threads=1",
                           "backend=cuda", f"install.path={tiny_install}", "prompt=hi", "max_new_tokens=2"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("error: backend cuda needs"), lines[0]


def _fake_bindings(monkeypatch, driver):
    cuda_pkg = types.ModuleType("cuda")
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = driver
    cuda_pkg.bindings = bindings
    monkeypatch.setitem(sys.modules, "cuda", cuda_pkg)
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", driver)


class _Result(int):
    """Stands in for a CUresult enum member."""


def _fake_driver(**over):
    d = types.SimpleNamespace()
    d.CUresult = types.SimpleNamespace(CUDA_SUCCESS=_Result(0), CUDA_ERROR_NO_DEVICE=_Result(100))
    d.CUdevice_attribute = types.SimpleNamespace(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR=75,
                                                 CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR=76)
    names = {0: b"CUDA_SUCCESS", 100: b"CUDA_ERROR_NO_DEVICE", 500: b"CUDA_ERROR_NOT_FOUND",
             701: b"CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"}
    d.cuGetErrorName = lambda e: (_Result(0), names.get(int(e), b"CUDA_ERROR_UNKNOWN"))
    d.cuGetErrorString = lambda e: (_Result(0), b"described")
    d.cuInit = lambda flags: (_Result(0),)
    d.cuDeviceGetCount = lambda: (_Result(0), 1)
    d.cuDeviceGet = lambda i: (_Result(0), 1000 + i)
    d.cuDeviceGetAttribute = lambda a, dev: (_Result(0), 9 if a == 75 else 0)
    d.cuDevicePrimaryCtxRetain = lambda dev: (_Result(0), "ctx")
    d.cuCtxSetCurrent = lambda ctx: (_Result(0),)
    d.cuModuleLoadData = lambda image: (_Result(0), ("module", bytes(image[:40])))
    d.cuModuleGetFunction = lambda mod, name: (_Result(0), ("fn", name))
    d.cuDriverGetVersion = lambda: (_Result(0), 13000)
    d.CUstream = lambda s: ("stream", s)
    d.launches = []

    def launch(fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        d.launches.append((fn, (gx, gy, gz), (bx, by, bz), shared, stream, params))
        return (_Result(0),)

    d.cuLaunchKernel = launch
    for k, v in over.items():
        setattr(d, k, v)
    return d


def test_reason_names_missing_cuda_python(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)
    assert "needs cuda-python" in cb.cuda_unavailable_reason()


def test_reason_names_missing_driver(monkeypatch):
    def no_lib(flags):
        raise OSError("libcuda.so.1: cannot open shared object file")
    _fake_bindings(monkeypatch, _fake_driver(cuInit=no_lib))
    assert cb.cuda_unavailable_reason() == \
        "backend cuda needs an NVIDIA driver: cuda-python could not load libcuda (OSError)"


def test_reason_names_missing_device(monkeypatch):
    _fake_bindings(monkeypatch, _fake_driver(cuInit=lambda f: (_Result(100),)))
    assert "needs a CUDA device" in cb.cuda_unavailable_reason()
    _fake_bindings(monkeypatch, _fake_driver(cuDeviceGetCount=lambda: (_Result(0), 0)))
    assert "needs a CUDA device" in cb.cuda_unavailable_reason()


def test_reason_needs_no_torch_cuda(monkeypatch):
    """backend cuda's step allocates through the driver API: a torch without CUDA is no reason; the
    capability comes from the driver."""
    _fake_bindings(monkeypatch, _fake_driver())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cb.cuda_unavailable_reason() is None


def test_reason_names_an_old_device(monkeypatch):
    attrs = {75: 7, 76: 5}
    _fake_bindings(monkeypatch, _fake_driver(cuDeviceGetAttribute=lambda a, dev: (_Result(0), attrs[int(a)])))
    assert cb.cuda_unavailable_reason() == "backend cuda needs compute capability 8.0 or newer; this device is 7.5"


# ---- the loader, against a fake driver -----------------------------------------------------


def test_loader_loads_once_caches_and_packs_params(monkeypatch):
    d = _fake_driver()
    loads, gets = [], []
    d.cuModuleLoadData = lambda image: (loads.append(bytes(image)) or (_Result(0), "mod"))
    d.cuModuleGetFunction = lambda mod, name: (gets.append(name) or (_Result(0), ("fn", name)))
    monkeypatch.setattr(ck, "_driver", lambda: d)
    k = ck.Kernels(0)
    assert k.arch == "sm_90" and k.capability == (9, 0)
    a, b = torch.zeros(3), torch.zeros(5)
    for _ in range(3):
        k.launch("norm", "gated_rms_norm_f32", (2,), (128,),
                 [ck.ptr(a), ck.ptr(b), ck.ptr(None), ck.i32(-7), ck.f32(1e-6)], stream=1234)
    assert len(loads) == 1 and loads[0].endswith(b"\0") and b".target sm_90" in loads[0]
    assert gets == [b"gated_rms_norm_f32"]
    fn, grid, block, shared, stream, params = d.launches[-1]
    assert grid == (2, 1, 1) and block == (128, 1, 1) and stream == ("stream", 1234)
    # (the argument objects are gone after launch returns: that is what the driver allows,
    # it copies them during cuLaunchKernel; this checks the array was a void*[5])
    assert isinstance(params, int) and params != 0


def test_loader_params_point_at_the_values(monkeypatch):
    d = _fake_driver()
    seen = {}

    def launch(fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        arr = (ctypes.c_void_p * 4).from_address(params)
        seen["ptr"] = ctypes.c_void_p.from_address(arr[0]).value
        seen["null"] = ctypes.c_void_p.from_address(arr[1]).value
        seen["int"] = ctypes.c_int32.from_address(arr[2]).value
        seen["float"] = ctypes.c_float.from_address(arr[3]).value
        return (_Result(0),)

    d.cuLaunchKernel = launch
    monkeypatch.setattr(ck, "_driver", lambda: d)
    t = torch.zeros(4)
    ck.Kernels(0).launch("conv", "conv_window_silu_f32", (1,), (32,),
                         [ck.ptr(t), ck.ptr(None), ck.i32(-3), ck.f32(0.5)], stream=0)
    assert seen == {"ptr": t.data_ptr(), "null": None, "int": -3, "float": 0.5}


@pytest.mark.parametrize("call", ["cuInit", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent", "cuModuleLoadData",
                                  "cuModuleGetFunction", "cuLaunchKernel"])
def test_loader_names_the_failed_call_and_kernel(monkeypatch, call):
    fail = lambda *a: (_Result(701),)  # noqa: E731
    d = _fake_driver(**{call: fail})
    monkeypatch.setattr(ck, "_driver", lambda: d)
    with pytest.raises(ck.CudaError) as e:
        ck.Kernels(0).launch("dflash", "grouped_conv_f32", (1,), (256,), [], stream=0)
    msg = str(e.value)
    assert msg.startswith(f"{call} failed") and "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES" in msg and "\n" not in msg
    if call == "cuLaunchKernel" or call == "cuModuleGetFunction":
        assert "grouped_conv_f32" in msg
    if call == "cuModuleLoadData":
        assert "dflash.sm_90.ptx" in msg


def test_loader_retries_older_drivers_at_their_ptx_isa(monkeypatch):
    loads = []

    def load(image):
        loads.append(bytes(image))
        return (_Result(222),) if b".version 9.0" in image else (_Result(0), "mod")

    names = {222: b"CUDA_ERROR_UNSUPPORTED_PTX_VERSION"}
    d = _fake_driver(cuModuleLoadData=load, cuDriverGetVersion=lambda: (_Result(0), 12040),
                     cuGetErrorName=lambda e: (_Result(0), names.get(int(e), b"CUDA_ERROR_UNKNOWN")))
    monkeypatch.setattr(ck, "_driver", lambda: d)
    ck.Kernels(0).launch("gdn", "gdn_recurrence_f32", (1,), (32, 8), [], stream=0)
    assert len(loads) == 2 and b"\n.version 8.4\n.target sm_90\n" in loads[1]
    d.cuDriverGetVersion = lambda: (_Result(0), 11040)
    with pytest.raises(ck.CudaError, match=r"UNSUPPORTED_PTX_VERSION.*CUDA 11.4.*PTX ISA 7.8"):
        ck.Kernels(0).module("conv")


def test_loader_refuses_old_gpus(monkeypatch):
    d = _fake_driver(cuDeviceGetAttribute=lambda a, dev: (_Result(0), 7 if a == 75 else 5))
    monkeypatch.setattr(ck, "_driver", lambda: d)
    with pytest.raises(ck.CudaError, match=r"compute capability 8.0 or newer \(PTX for sm_80, sm_90\); device 0 is 7.5"):
        ck.Kernels(0)


def test_arch_for_capabilities():
    assert [ck.arch_for(*c) for c in [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]] == \
        [None, "sm_80", "sm_80", "sm_80", "sm_90", "sm_90", "sm_90"]


# ---- the kernels' semantics as plain loops, against the CPU backend ---------------------------


def loop_gdn(state, q, k, v, g, beta):
    """gdn.cu's per-(head, column) algorithm in float64 loops."""
    rows, heads, dk = q.shape
    dv = v.shape[-1]
    s = state.double().clone()
    outs, states = torch.zeros(rows, heads, dv, dtype=torch.float64), []
    for t in range(rows):
        for h in range(heads):
            decay = math.exp(float(g[t, h]))
            for j in range(dv):
                kv = 0.0
                for i in range(dk):
                    s[h, i, j] *= decay
                    kv += float(k[t, h, i]) * float(s[h, i, j])
                u = (float(v[t, h, j]) - kv) * float(beta[t, h])
                o = 0.0
                for i in range(dk):
                    s[h, i, j] += float(k[t, h, i]) * u
                    o += float(q[t, h, i]) * float(s[h, i, j])
                outs[t, h, j] = o
        states.append(s.clone())
    return outs, s, states


def gdn_inputs(rows, heads, dk, dv, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    state = r(heads, dk, dv) * 0.3
    q, k = ops.l2norm(r(rows, heads, dk)) * dk ** -0.5, ops.l2norm(r(rows, heads, dk))
    v = r(rows, heads, dv)
    g = -torch.rand(rows, heads, generator=gen) * 2
    beta = torch.sigmoid(r(rows, heads))
    return [t.to(device) for t in (state, q, k, v, g, beta)]


def test_gdn_loop_matches_cpu_recurrence():
    args = gdn_inputs(3, 2, 4, 3)
    outs, final, states = ops.gdn_recurrence(*args, keep_states=True)
    l_outs, l_final, l_states = loop_gdn(*args)
    torch.testing.assert_close(outs.double(), l_outs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(final.double(), l_final, rtol=1e-5, atol=1e-6)
    for a, b in zip(states, l_states):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)


def loop_conv_window(window, x, w):
    """conv.cu: one channel at a time, a register ring of the last K-1 inputs, separate
    multiplies and adds in tap order; returns (out, ext, new window)."""
    taps = w.shape[1]
    rows, channels = x.shape
    out = torch.zeros(rows, channels)
    ext = torch.cat([window, x])
    new_window = torch.zeros(taps - 1, channels)
    for c in range(channels):
        vals = [window[j, c] for j in range(taps - 1)]
        for t in range(rows):
            vals.append(x[t, c])
            acc = vals[0] * w[c, 0]
            for j in range(1, taps):
                acc = acc + vals[j] * w[c, j]
            out[t, c] = acc / (1 + torch.exp(-acc))
            vals.pop(0)
        for j in range(taps - 1):
            new_window[j, c] = vals[j]
    return out, ext, new_window


def test_conv_window_loop_matches_cpu_conv_and_trunk_window():
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 4):
        window, x, w = torch.randn(3, 6, generator=gen), torch.randn(rows, 6, generator=gen), torch.randn(6, 4, generator=gen)
        out, ext, new_window = loop_conv_window(window, x, w)
        ref_ext = torch.cat([window, x])
        torch.testing.assert_close(out, ops.causal_conv_rows(ref_ext, w), rtol=1e-6, atol=1e-6)
        assert torch.equal(ext, ref_ext)
        assert torch.equal(new_window, ref_ext[rows:])  # what the trunk keeps as its next window


def test_gated_rms_norm_loop_matches_cpu():
    gen = torch.Generator().manual_seed(2)
    o, z, w = torch.randn(5, 8, generator=gen), torch.randn(5, 8, generator=gen), torch.randn(8, generator=gen)
    out = torch.zeros(5, 8, dtype=torch.float64)
    for n in range(5):
        r = 1 / math.sqrt(sum(float(o[n, i]) ** 2 for i in range(8)) / 8 + 1e-6)
        for i in range(8):
            zv = float(z[n, i])
            out[n, i] = float(w[i]) * float(o[n, i]) * r * zv / (1 + math.exp(-zv))
    torch.testing.assert_close(ops.gated_rms_norm(o, z, w, 1e-6).double(), out, rtol=1e-5, atol=1e-6)


def test_grouped_conv_loop_matches_cpu():
    gen = torch.Generator().manual_seed(3)
    rows, hidden, taps, group = 5, 32, 2, 16
    h, base = torch.randn(rows, hidden, generator=gen), torch.randn(taps, hidden, generator=gen)
    dyn = torch.randn(rows, taps, hidden // group, generator=gen)
    out = torch.zeros(rows, hidden)
    for t in range(rows):
        for c in range(hidden):
            acc = (base[0, c] + dyn[t, 0, c // group]) * h[t, c]
            for o in range(1, taps):
                if o <= t:
                    acc = acc + (base[o, c] + dyn[t, o, c // group]) * h[t - o, c]
            out[t, c] = acc
    assert torch.equal(dflash.grouped_conv(h, base, dyn, group), out)


def loop_selector(logits, proj, anchor, pred_cb, succ_cb, top_k, threads=256, per_thread=16):
    """dflash.cu's selector: per-thread sorted lists over a strided slice, a top_k-round merge
    of the lists' heads (order: value descending, id ascending), then greedy rescoring."""
    def key(vi):
        return (-vi[0], vi[1])
    rows, vocab = logits.shape
    cands = []
    for b in range(rows):
        lists = []
        for tid in range(threads):
            mine = sorted(((float(logits[b, c]), c) for c in range(tid, vocab, threads)), key=key)[:per_thread]
            lists.append(mine)
        heads, picked = [0] * threads, []
        for _ in range(top_k):
            _, t = min((key(lists[t][heads[t]]), t) for t in range(threads) if heads[t] < len(lists[t]))
            picked.append(lists[t][heads[t]])
            heads[t] += 1
        cands.append(picked)
    pred, out = anchor, []
    for i in range(rows):
        best = None
        for value, c in cands[i]:
            s = value + float((succ_cb[c] * (pred_cb[pred] * proj[i])).sum())
            if best is None or s > best[0] or (s == best[0] and c < best[1]):
                best = (s, c)
        pred = best[1]
        out.append(pred)
    return out


def selector_inputs(rows, vocab, hidden, rank, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    final, hp = torch.randn(rows, hidden, generator=gen), torch.randn(rank, hidden, generator=gen) * 0.3
    pred_cb, succ_cb = torch.randn(vocab, rank, generator=gen), torch.randn(vocab, rank, generator=gen)
    return [t.to(device) for t in (logits, final, hp, pred_cb, succ_cb)]


def test_selector_loop_matches_cpu_selector():
    logits, final, hp, pred_cb, succ_cb = selector_inputs(3, 700, 16, 8, seed=4)
    # crowd one thread's slice (ids = 5 mod 256) with the row's best values: the merge must
    # take several heads from one list
    logits[1, 5::256] += 20.0
    proj = final @ hp.T
    want = dflash.select_candidates(logits, final, 17, hp, pred_cb, succ_cb, 16)
    assert loop_selector(logits, proj, 17, pred_cb, succ_cb, 16) == want


def test_selector_ties_go_to_the_lower_id():
    vocab, rank = 300, 4
    logits = torch.zeros(2, vocab)
    logits[:, [40, 7, 290]] = 5.0  # a three-way tie on the best score (codebooks are zero)
    zeros = torch.zeros(vocab, rank)
    proj = torch.zeros(2, rank)
    assert loop_selector(logits, proj, 0, zeros, zeros, 4) == [7, 7]
    assert dflash.select_candidates(logits, torch.zeros(2, 3), 0, torch.zeros(rank, 3), zeros, zeros, 4) == [7, 7]


def quant_inputs(out, cols, bits, group, seed=5, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, cols, generator=gen)
    scale_dtype = torch.bfloat16 if bits == 4 else torch.float16
    g = w.reshape(out, cols // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scales = ((hi - lo) / ((1 << bits) - 1)).to(scale_dtype)
    biases = lo.to(scale_dtype)
    q = torch.randint(0, 1 << bits, (out, cols), generator=gen)
    return q, [t.to(device) for t in (quant.pack(q, bits), scales, biases)]


def dequantized_linear(x, packed, scales, biases, bits, group):
    """What qgemv.cu computes: x @ w^T with w the dequantized matrix."""
    return quant.linear_dequant(x, quant.QuantizedWeight(packed, scales, biases, bits, group))


@pytest.mark.parametrize("bits,group", [(4, 64), (2, 128), (1, 128)])
def test_packing_and_dequantize_are_the_documented_layout(bits, group):
    """The layout qgemv.cu reads: quant.pack's words and quant.dequantize's matrix."""
    out, cols = 3, 256
    q, (packed, scales, biases) = quant_inputs(out, cols, bits, group)
    per = 32 // bits
    for o in range(out):  # element j of a row at bits (j % per) * bits of word j // per
        for j in range(0, cols, 37):
            word = int(packed[o, j // per]) & 0xFFFFFFFF
            assert (word >> ((j % per) * bits)) & ((1 << bits) - 1) == int(q[o, j])
    want = q.float() * scales.float().repeat_interleave(group, 1) + biases.float().repeat_interleave(group, 1)
    assert torch.equal(quant.dequantize(packed, scales, biases, bits, group), want)
    assert quant.format_for(bits=bits, group=group).scale_dtype == scales.dtype


# ---- the wrappers, launched into a CPU emulation of each kernel ----------------------------------
#
# Without a GPU the launches go to `Emulator`: it checks each launch's arguments against the
# kernel's parameter list in the PTX (count and .u64 / .u32 / .f32 types) and its grid against
# the problem size, then runs a transcription of the kernel's indexing on the host memory
# behind the pointers. This proves the wrappers pass what the kernels read, where they read it.

def mem(arg, n, dtype=torch.float32):
    """The n elements of host memory a pointer argument points at (shared, writable)."""
    if arg.value is None:
        return None
    size = torch.empty(0, dtype=dtype).element_size()
    return torch.frombuffer((ctypes.c_char * (n * size)).from_address(arg.value), dtype=dtype, count=n)


class Emulator:
    def __init__(self):
        self.launches = []

    def launch(self, module, kernel, grid, block, args, shared=0, stream=None):
        assert [PTX_TYPES[type(a)] for a in args] == ptx_params(module, kernel), kernel
        vals = [a.value for a in args]
        self.launches.append(kernel)
        name = re.sub(r"_r\d+$", "", kernel.removesuffix("_f32"))  # bgemv's pass sizes: one semantics
        getattr(self, "gemv" if name.startswith("affine_gemv_q") else name)(grid, block, args, vals)

    def gdn_recurrence(self, grid, block, a, v):
        R, H, dk, dv = v[9:13]
        assert grid == (H, -(-dv // 32)) and block == (32, 8)
        S = mem(a[0], H * dk * dv).reshape(H, dk, dv).clone()
        q, k = mem(a[4], R * H * dk).reshape(R, H, dk), mem(a[5], R * H * dk).reshape(R, H, dk)
        vv = mem(a[6], R * H * dv).reshape(R, H, dv)
        g, beta = mem(a[7], R * H).reshape(R, H), mem(a[8], R * H).reshape(R, H)
        out, states = mem(a[3], R * H * dv).reshape(R, H, dv), mem(a[2], R * H * dk * dv)
        for t in range(R):
            S = S * torch.exp(g[t])[:, None, None]
            u = (vv[t] - torch.einsum("hi,hij->hj", k[t], S)) * beta[t][:, None]
            S = S + k[t][:, :, None] * u[:, None, :]
            out[t] = torch.einsum("hi,hij->hj", q[t], S)
            if states is not None:
                states.reshape(R, H, dk, dv)[t] = S
        mem(a[1], H * dk * dv).copy_(S.reshape(-1))

    def conv_window_silu(self, grid, block, a, v):
        R, C, K = v[6:9]
        assert grid[0] * block[0] >= C and K <= cb.CONV_MAX_TAPS
        window = mem(a[0], (K - 1) * C).reshape(K - 1, C).clone()
        x, w = mem(a[1], R * C).reshape(R, C), mem(a[2], C * K).reshape(C, K)
        ext = torch.cat([window, x])
        acc = ext[0:R] * w[:, 0]
        for j in range(1, K):
            acc = acc + ext[j:j + R] * w[:, j]
        mem(a[3], R * C).copy_((acc / (1 + torch.exp(-acc))).reshape(-1))
        if a[4].value is not None:
            mem(a[4], (K - 1 + R) * C).copy_(ext.reshape(-1))
        if a[5].value is not None:
            mem(a[5], (K - 1) * C).copy_(ext[R:].reshape(-1))

    def gated_rms_norm(self, grid, block, a, v):
        N, d, eps = v[4], v[5], v[6]
        assert grid[0] * (block[0] // 32) >= N
        o, z, w = mem(a[0], N * d).reshape(N, d), mem(a[1], N * d).reshape(N, d), mem(a[2], d)
        r = torch.rsqrt((o * o).sum(-1, keepdim=True) / d + eps)
        mem(a[3], N * d).copy_((w * (o * r) * (z / (1 + torch.exp(-z)))).reshape(-1))

    def grouped_conv(self, grid, block, a, v):
        rows, H, taps, group = v[4:8]
        assert grid == (-(-H // 256), rows)
        h, base = mem(a[0], rows * H).reshape(rows, H), mem(a[1], taps * H).reshape(taps, H)
        dyn = mem(a[2], rows * taps * (H // group)).reshape(rows, taps, H // group)
        out = mem(a[3], rows * H).reshape(rows, H)
        for t in range(rows):
            for c in range(H):
                acc = (base[0, c] + dyn[t, 0, c // group]) * h[t, c]
                for o in range(1, min(taps, t + 1)):
                    acc = acc + (base[o, c] + dyn[t, o, c // group]) * h[t - o, c]
                out[t, c] = acc

    def select_candidates(self, grid, block, a, v):
        anchor, rows, V, rank, top_k = v[4:9]
        assert grid == (rows,) and top_k <= cb.SEL_MAX_K
        counter = mem(a[11], 1, torch.int32)
        assert int(counter) == 0  # zero between launches
        logits, proj = mem(a[0], rows * V).reshape(rows, V), mem(a[1], rows * rank).reshape(rows, rank)
        pred_cb, succ_cb = mem(a[2], V * rank).reshape(V, rank), mem(a[3], V * rank).reshape(V, rank)
        ids = loop_selector(logits, proj, anchor, pred_cb, succ_cb, top_k)
        mem(a[12], rows, torch.int32).copy_(torch.tensor(ids, dtype=torch.int32))

    def gemv(self, grid, block, a, v):
        R, cols, out, group, kind = v[5:10]
        assert grid[0] * (block[0] // 32) >= out
        bits = {"affine_gemv_q4_f32": 4, "affine_gemv_q2_f32": 2, "affine_gemv_q1_f32": 1}[self.launches[-1]]
        per = 32 // bits
        x = mem(a[0], R * cols).reshape(R, cols)
        words = mem(a[1], out * cols // per, torch.int32).reshape(out, cols // per).long() & 0xFFFFFFFF
        raw_s, raw_b = (mem(a[i], out * (cols // group), torch.int16).reshape(out, -1) for i in (2, 3))
        half = (lambda r: (r.int() << 16).view(torch.float32)) if kind == 1 else (lambda r: r.view(torch.float16).float())
        s, b = half(raw_s), half(raw_b)
        col = torch.arange(cols)
        q = ((words[:, col // per] >> ((col % per) * bits)) & ((1 << bits) - 1)).float()
        w = q * s[:, col // group] + b[:, col // group]
        mem(a[4], R * out).copy_((x @ w.T).reshape(-1))

    def bf16_rows_gemv(self, grid, block, a, v):
        R, cols, out = v[3:6]
        assert self.launches[-1] == cb.rows_kernel(self.launches[-1][:4], R)
        assert grid == cb.rows_grid(R, out) and block == (256,)
        assert all(p % 16 == 0 for p in v[:3])  # the vector loads' alignment
        x = mem(a[0], R * cols).reshape(R, cols)
        w = (mem(a[1], out * cols, torch.int16).reshape(out, cols).int() << 16).view(torch.float32)
        mem(a[2], R * out).copy_((x @ w.T).reshape(-1))

    def int8_rows_gemv(self, grid, block, a, v):
        R, cols, out, group = v[5:9]
        assert self.launches[-1] == cb.rows_kernel(self.launches[-1][:4], R)
        assert grid == cb.rows_grid(R, out) and block == (256,)
        assert v[0] % 16 == 0 and v[1] % 16 == 0
        x = mem(a[0], R * cols).reshape(R, cols)
        levels = mem(a[1], out * cols, torch.uint8).reshape(out, cols).float()  # little-endian words
        s, b = ((mem(a[i], out * (cols // group), torch.int16).reshape(out, -1).int() << 16).view(torch.float32)
                for i in (2, 3))
        w = levels * s.repeat_interleave(group, 1) + b.repeat_interleave(group, 1)
        mem(a[4], R * out).copy_((x @ w.T).reshape(-1))


# The kernels' own CUDA C on the simulated device (turbo/backends/cuda_sim): compiled for the
# host with g++ against its shim (-ffp-contract=off: fmul / fadd separately rounded), run over the
# grid and block as fibers (__syncthreads, warp shuffles, __shared__), each launch checked against
# the PTX entry's parameters. The wrappers' arguments point at CPU tensors, which the simulated
# device is told to take as device memory (cuda_sim.host_memory). A barrier or shuffle not every
# thread reaches is a launch error naming the kernel, not a hang.


@pytest.fixture(scope="module")
def host_compiled():
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("g++ not installed")
    return HostDevice()


@pytest.fixture(params=["transcribed", "host_compiled_cuda_c"])
def emulated(request, monkeypatch):
    emu = Emulator() if request.param == "transcribed" else request.getfixturevalue("host_compiled")
    monkeypatch.setattr(ck, "kernels", lambda device=None: emu)
    monkeypatch.setattr(cb, "_need_cuda", lambda t, name: None)
    return emu


def test_wrapped_gdn_recurrence(emulated):
    args = gdn_inputs(4, 3, 8, 5)
    outs, final, states = ops.gdn_recurrence(*args, keep_states=True)
    g_outs, g_final, g_states = cb.gdn_recurrence(*args, keep_states=True)
    torch.testing.assert_close(g_outs, outs)
    torch.testing.assert_close(g_final, final)
    for x, y in zip(g_states, states):
        torch.testing.assert_close(x, y)
    state = args[0].clone()
    _, same, none = cb.gdn_recurrence(state, *args[1:], out_state=state)
    assert none is None and same is state
    torch.testing.assert_close(state, final)


def test_wrapped_conv_window_update(emulated):
    gen = torch.Generator().manual_seed(7)
    window, x, w = torch.randn(3, 20, generator=gen), torch.randn(2, 20, generator=gen), torch.randn(20, 4, generator=gen)
    ext = torch.cat([window, x])
    out, g_ext, new_window = cb.conv_window_update(window, x, w)
    torch.testing.assert_close(out, ops.causal_conv_rows(ext, w))
    assert torch.equal(g_ext, ext) and torch.equal(new_window, ext[2:])
    torch.testing.assert_close(cb.causal_conv_rows(ext, w), ops.causal_conv_rows(ext, w))


def test_wrapped_gated_rms_norm(emulated):
    gen = torch.Generator().manual_seed(8)
    o, z, w = torch.randn(6, 2, 8, generator=gen), torch.randn(6, 2, 8, generator=gen), torch.randn(8, generator=gen)
    torch.testing.assert_close(cb.gated_rms_norm(o, z, w, 1e-6), ops.gated_rms_norm(o, z, w, 1e-6))


def test_wrapped_grouped_conv(emulated):
    gen = torch.Generator().manual_seed(9)
    h, base = torch.randn(3, 32, generator=gen), torch.randn(2, 32, generator=gen)
    dyn = torch.randn(3, 2, 2, 2, generator=gen)[:, 0]  # the drafter passes a strided view
    assert torch.equal(cb.grouped_conv(h, base, dyn, 16), dflash.grouped_conv(h, base, dyn, 16))


def test_wrapped_select_candidates(emulated):
    logits, final, hp, pred_cb, succ_cb = selector_inputs(3, 600, 16, 8, seed=10)
    want = dflash.select_candidates(logits, final, 11, hp, pred_cb, succ_cb, 16)
    assert cb.select_candidates(logits, final, 11, hp, pred_cb, succ_cb, 16) == want
    with pytest.raises(TurboError, match="top_k 1..16"):
        cb.select_candidates(logits, final, 11, hp, pred_cb, succ_cb, 17)


@pytest.mark.parametrize("bits,group", [(4, 64), (2, 128), (1, 128)])
def test_wrapped_affine_linear(emulated, bits, group):
    _, (packed, scales, biases) = quant_inputs(5, 256, bits, group, seed=bits)
    x = torch.randn(3, 256)
    got = cb.affine_linear(x, packed, scales, biases, bits, group)
    # fp32 sums of 256 products in another order
    torch.testing.assert_close(got, dequantized_linear(x, packed, scales, biases, bits, group), rtol=1e-4, atol=1e-4)
    assert emulated.launches[-1] == cb.QUANT_KERNELS[bits]


@pytest.fixture
def host(host_compiled, monkeypatch):
    monkeypatch.setattr(ck, "kernels", lambda device=None: host_compiled)
    monkeypatch.setattr(cb, "_need_cuda", lambda t, name: None)
    return host_compiled


def test_host_compiled_edges(host):
    """Partial tiles, several tiles, row chunks, formats and the selector's counter reset,
    through the kernels' own C."""
    args = gdn_inputs(2, 2, 200, 40, seed=3)  # 2 column tiles, the second partial; 25 rows per thread
    outs, final, states = ops.gdn_recurrence(*args, keep_states=True)
    g_outs, g_final, g_states = cb.gdn_recurrence(*args, keep_states=True)
    torch.testing.assert_close(g_outs, outs)
    torch.testing.assert_close(g_final, final)
    torch.testing.assert_close(torch.stack(g_states), torch.stack(states))

    gen = torch.Generator().manual_seed(12)
    for taps in (2, 4):
        window, x = torch.randn(taps - 1, 300, generator=gen), torch.randn(3, 300, generator=gen)
        w = torch.randn(300, taps, generator=gen)
        out, ext, nw = cb.conv_window_update(window, x, w)
        torch.testing.assert_close(out, ops.causal_conv_rows(torch.cat([window, x]), w))
        assert torch.equal(nw, torch.cat([window, x])[3:])

    o, z, w = torch.randn(5, 100, generator=gen), torch.randn(5, 100, generator=gen), torch.randn(100, generator=gen)
    torch.testing.assert_close(cb.gated_rms_norm(o, z, w, 1e-5), ops.gated_rms_norm(o, z, w, 1e-5))

    logits, final_h, hp, pred_cb, succ_cb = selector_inputs(4, 1000, 16, 8, seed=13)
    logits[2, 7::256] += 30.0  # one thread's slice holds the row's whole top-k
    for top_k in (16, 5):
        want = dflash.select_candidates(logits, final_h, 999, hp, pred_cb, succ_cb, top_k)
        assert cb.select_candidates(logits, final_h, 999, hp, pred_cb, succ_cb, top_k) == want
        assert int(cb._workspace.get(logits.device, 4, top_k)[2]) == 0  # the ticket counter is reset
    tie = torch.zeros(2, 1000)
    tie[:, [900, 300, 517]] = 4.0
    zeros = torch.zeros(1000, 8)
    assert cb.select_candidates_ids(tie, torch.zeros(2, 8), 0, zeros, zeros, 3).tolist() == [300, 300]

    for bits, group in ((4, 64), (2, 128), (1, 128)):
        _, (packed, scales, biases) = quant_inputs(13, 512, bits, group, seed=bits + 20)
        for rows in (9, 17):  # past the kernel's 8-row chunk
            x = torch.randn(rows, 512, generator=gen)
            torch.testing.assert_close(cb.affine_linear(x, packed, scales, biases, bits, group),
                                       dequantized_linear(x, packed, scales, biases, bits, group),
                                       rtol=1e-4, atol=1e-4)


# ---- batch-invariant products (bgemv.cu; device-unverified) ------------------------------------


def int8_inputs(out, cols, group=64, seed=31):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (out, cols), generator=gen)
    scales = (torch.rand(out, cols // group, generator=gen) * 0.02 + 1e-3).to(torch.bfloat16)
    biases = (-128 * scales.float()).to(torch.bfloat16)
    return quant.pack(q, 8), scales, biases


@pytest.mark.parametrize("cols", [1024, 552, 300])  # paired chunks; a lone last chunk; the scalar path
def test_wrapped_bf16_rows_product(emulated, cols):
    gen = torch.Generator().manual_seed(cols)
    w = torch.randn(13, cols, generator=gen).to(torch.bfloat16)  # 13 outputs: a partial block
    x = torch.randn(5, cols, generator=gen)
    got = cb.bf16_rows_product(x, w)
    assert emulated.launches[-1] == "bf16_rows_gemv_r8_f32" and got.dtype == torch.float32
    torch.testing.assert_close(got, x @ w.float().T, rtol=1e-4, atol=1e-4)
    assert torch.equal(cb.bf16_rows_product(x, w.view(torch.int16)), got)  # the raw storage, as installed


@pytest.mark.parametrize("cols,group", [(1024, 64), (320, 64), (96, 32)])  # vector, odd chunks, group 32
def test_wrapped_int8_rows_product(emulated, cols, group):
    packed, scales, biases = int8_inputs(11, cols, group)
    x = torch.randn(3, cols)
    got = cb.int8_rows_product(x, packed, scales, biases, group)
    assert emulated.launches[-1] == "int8_rows_gemv_r4_f32"
    torch.testing.assert_close(got, dequantized_linear(x, packed, scales, biases, 8, group), rtol=1e-4, atol=1e-4)


def test_rows_products_refuse_what_the_kernels_do_not_take(emulated):
    x = torch.randn(2, 64)
    with pytest.raises(TurboError, match="bf16 weights"):
        cb.bf16_rows_product(x, torch.randn(4, 64))
    with pytest.raises(TurboError, match=r"x \[R, in\] and w \[out, in\]"):
        cb.bf16_rows_product(x, torch.randn(4, 32).to(torch.bfloat16))
    packed, scales, biases = int8_inputs(4, 64)
    with pytest.raises(TurboError, match="does not take 128"):
        cb.int8_rows_product(torch.randn(2, 128), packed, scales, biases)
    with pytest.raises(TurboError, match="expected bfloat16"):
        cb.int8_rows_product(x, packed, scales.half(), biases.half())
    assert cb.ROWS_PRODUCTS is False  # device-unverified: the engine does not call them yet


def test_rows_products_launch_nothing_for_zero_rows(emulated):
    n = len(emulated.launches)
    assert cb.bf16_rows_product(torch.empty(0, 64), torch.zeros(4, 64, dtype=torch.bfloat16)).shape == (0, 4)
    assert len(emulated.launches) == n


def test_rows_kernel_takes_the_smallest_pass_that_holds_the_rows():
    assert [cb.rows_kernel("bf16", r) for r in (1, 2, 4, 5, 8, 9, 16, 17, 40)] == [
        f"bf16_rows_gemv_r{p}_f32" for p in (1, 4, 4, 8, 8, 16, 16, 16, 16)]
    assert cb.rows_kernel("int8", 3) == "int8_rows_gemv_r4_f32"
    # the outputs a warp computes (bgemv.cu BG_OW), so the grid covers every output
    text = (ck.ptx_dir() / "bgemv.cu").read_text()
    assert "#define BG_OW(MAXR) ((MAXR) == 1 ? 1 : (MAXR) == 4 ? 4 : 2)" in text
    assert cb.ROWS_OUTPUTS_PER_WARP == {1: 1, 4: 4, 8: 2, 16: 2}
    assert cb.rows_grid(1, 13) == (2,) and cb.rows_grid(3, 33) == (2,) and cb.rows_grid(9, 17) == (2,)


def _rows_alone(fn, x):
    return torch.cat([fn(x[r:r + 1]) for r in range(x.shape[0])])


@pytest.mark.parametrize("cols", [1024, 552, 300])
def test_bf16_rows_product_row_is_independent_of_the_rows_beside_it(host, cols):
    """Through the kernel's own C: row r of a 1- to 17-row product (every pass size: r1 alone, r4,
    r8, r16; 17: two passes of r16) is bit for bit the product of row r alone, and so whatever
    rows share its pass and whichever entry runs it."""
    gen = torch.Generator().manual_seed(100 + cols)
    w = torch.randn(13, cols, generator=gen).to(torch.bfloat16)
    x = torch.randn(17, cols, generator=gen) * torch.logspace(-3, 3, cols)  # cancellation: order shows
    fn = lambda rows: cb.bf16_rows_product(rows, w)  # noqa: E731
    alone = _rows_alone(fn, x)
    torch.testing.assert_close(alone, x @ w.float().T, rtol=1e-3, atol=1e-2)
    for rows in (1, 3, 6, 9, 16, 17):
        assert torch.equal(fn(x[:rows]), alone[:rows]), rows
    perm = torch.randperm(17, generator=gen)  # other neighbours, same rows
    assert torch.equal(fn(x[perm]), alone[perm])


@pytest.mark.parametrize("cols,group", [(1024, 64), (320, 64)])
def test_int8_rows_product_row_is_independent_of_the_rows_beside_it(host, cols, group):
    packed, scales, biases = int8_inputs(13, cols, group, seed=cols)
    gen = torch.Generator().manual_seed(cols)
    x = torch.randn(17, cols, generator=gen) * torch.logspace(-3, 3, cols)
    fn = lambda rows: cb.int8_rows_product(rows, packed, scales, biases, group)  # noqa: E731
    alone = _rows_alone(fn, x)
    for rows in (1, 3, 6, 9, 16, 17):
        assert torch.equal(fn(x[:rows]), alone[:rows]), rows
    perm = torch.randperm(17, generator=gen)
    assert torch.equal(fn(x[perm]), alone[perm])


def test_row_independence_check_catches_a_shape_dependent_order(host):
    """Negative control: the same check on a product whose order depends on the row count
    (summing the halves of `in` in an order chosen by R) fails."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(13, 1024, generator=gen).to(torch.bfloat16)
    x = torch.randn(9, 1024, generator=gen) * torch.logspace(-3, 3, 1024)

    def shape_dependent(rows):
        lo = cb.bf16_rows_product(rows[:, :512], w[:, :512])
        hi = cb.bf16_rows_product(rows[:, 512:], w[:, 512:])
        return (hi + lo) if rows.shape[0] > 1 else (lo + hi) * 1.0000001

    assert not torch.equal(shape_dependent(x)[:1], _rows_alone(shape_dependent, x)[:1])


def test_gpu_check_rows_products_section_runs(host, monkeypatch, tmp_path):
    """scripts/gpu_check.py's rows_products section, on the host-compiled kernels at a small shape:
    it runs and reports the fields a device session reads."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    res = gpu_check.rows_products(tmp_path, dev="cpu", shapes={"small_40x128": (40, 128)}, copy_bytes=1 << 16, iters=1)
    for fmt in ("bf16", "int8"):
        r = res[f"{fmt}.small_40x128"]
        assert r["batch_invariant"] is True
        assert r["max_abs_err_vs_fp64"] < 1e-3 * r["max_abs_ref"]
        assert {"rows1_weight_GBps", "rows9_of_copy", "rows16_us"} <= set(r)
    assert res["d2d_copy_GBps"] > 0 and (tmp_path / "rows_products.json").is_file()


# ---- on a GPU: each kernel against its CPU reference --------------------------------------------


def close(got, want, rtol=1e-4, atol=1e-5):
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=rtol, atol=atol)


@gpu
def test_gpu_backend_auto_picks_cuda():
    assert cb.cuda_unavailable_reason() is None
    b = select_backend("auto")
    assert (b.name, b.note) == ("cuda", "backend auto picked cuda")
    assert select_backend("cuda") is cb.CUDA


@gpu
@pytest.mark.parametrize("rows,heads,dk,dv", [(1, 4, 16, 16), (9, 32, 128, 128), (3, 6, 200, 40)])
def test_gpu_gdn_recurrence(rows, heads, dk, dv):
    args = gdn_inputs(rows, heads, dk, dv, seed=rows)
    outs, final, states = ops.gdn_recurrence(*args, keep_states=True)
    g_outs, g_final, g_states = cb.gdn_recurrence(*(a.cuda() for a in args), keep_states=True)
    close(g_outs, outs)
    close(g_final, final)
    assert len(g_states) == rows
    for a, b in zip(g_states, states):
        close(a, b)
    state = args[0].cuda()  # in place, without checkpoints
    o2, s2, none = cb.gdn_recurrence(state, *(a.cuda() for a in args[1:]), out_state=state)
    assert none is None and s2.data_ptr() == state.data_ptr()
    close(o2, outs)
    close(state, final)


@gpu
@pytest.mark.parametrize("rows,channels,taps", [(1, 8192, 4), (9, 1000, 4), (3, 33, 2)])
def test_gpu_conv_window_update(rows, channels, taps):
    gen = torch.Generator().manual_seed(rows)
    window, x = torch.randn(taps - 1, channels, generator=gen), torch.randn(rows, channels, generator=gen)
    w = torch.randn(channels, taps, generator=gen)
    ext = torch.cat([window, x])
    want = ops.causal_conv_rows(ext, w)
    out, g_ext, new_window = cb.conv_window_update(window.cuda(), x.cuda(), w.cuda())
    close(out, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(g_ext.cpu(), ext) and torch.equal(new_window.cpu(), ext[rows:])
    close(cb.causal_conv_rows(ext.cuda(), w.cuda()), want, rtol=1e-5, atol=1e-6)
    win = window.cuda()  # in place
    cb.conv_window_update(win, x.cuda(), w.cuda(), keep_ext=False, new_window=win)
    assert torch.equal(win.cpu(), ext[rows:])


@gpu
@pytest.mark.parametrize("n,d", [(9 * 32, 128), (5, 100), (1, 7)])
def test_gpu_gated_rms_norm(n, d):
    gen = torch.Generator().manual_seed(n)
    o, z, w = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen), torch.randn(d, generator=gen)
    close(cb.gated_rms_norm(o.cuda(), z.cuda(), w.cuda(), 1e-6), ops.gated_rms_norm(o, z, w, 1e-6))
    o3 = o.reshape(n, 1, d)
    close(cb.gated_rms_norm(o3.cuda(), z.reshape(n, 1, d).cuda(), w.cuda(), 1e-6), ops.gated_rms_norm(o3, z.reshape(n, 1, d), w, 1e-6))


@gpu
@pytest.mark.parametrize("rows,hidden,group", [(9, 1024, 16), (1, 64, 16), (3, 5120, 16)])
def test_gpu_grouped_conv(rows, hidden, group):
    gen = torch.Generator().manual_seed(rows)
    h, base = torch.randn(rows, hidden, generator=gen), torch.randn(2, hidden, generator=gen)
    dyn = torch.randn(rows, 2, hidden // group, generator=gen)
    want = dflash.grouped_conv(h, base, dyn, group)
    got = cb.grouped_conv(h.cuda(), base.cuda(), dyn.cuda(), group)
    assert torch.equal(got.cpu(), want)  # separate multiplies and adds, rounded like the CPU


@gpu
@pytest.mark.parametrize("rows,vocab,hidden,rank", [(8, 248_320, 256, 256), (2, 700, 16, 8), (1, 40, 8, 4)])
def test_gpu_select_candidates(rows, vocab, hidden, rank):
    logits, final, hp, pred_cb, succ_cb = selector_inputs(rows, vocab, hidden, rank, seed=vocab)
    top_k = min(16, vocab)
    want = dflash.select_candidates(logits, final, 3, hp, pred_cb, succ_cb, top_k)
    for _ in range(2):  # the second launch checks the workspace counter was reset
        got = cb.select_candidates(*(t.cuda() for t in (logits, final)), 3, *(t.cuda() for t in (hp, pred_cb, succ_cb)),
                                   top_k)
        assert got == want


@gpu
def test_gpu_select_candidates_ties_to_lower_id():
    vocab, rank = 5000, 4
    logits = torch.zeros(3, vocab)
    logits[:, [4097, 7, 290]] = 5.0
    zeros = torch.zeros(vocab, rank)
    got = cb.select_candidates_ids(logits.cuda(), torch.zeros(3, rank).cuda(), 0, zeros.cuda(), zeros.cuda(), 4)
    assert got.tolist() == [7, 7, 7]


@gpu
@pytest.mark.parametrize("rows", [1, 3, 6, 9, 16, 17])
def test_gpu_rows_products_are_batch_invariant(rows):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(1000, 1024, generator=gen).to(torch.bfloat16).cuda()
    x = torch.randn(17, 1024, generator=gen).cuda()
    alone = torch.cat([cb.bf16_rows_product(x[r:r + 1], w) for r in range(17)])
    assert torch.equal(cb.bf16_rows_product(x[:rows], w), alone[:rows])
    close(alone, x @ w.float().T, rtol=1e-4, atol=1e-3)
    packed, scales, biases = (t.cuda() for t in int8_inputs(1000, 1024))
    alone8 = torch.cat([cb.int8_rows_product(x[r:r + 1], packed, scales, biases) for r in range(17)])
    assert torch.equal(cb.int8_rows_product(x[:rows], packed, scales, biases), alone8[:rows])
    close(alone8, dequantized_linear(x.cpu(), *(t.cpu() for t in (packed, scales, biases)), 8, 64), rtol=1e-4,
          atol=1e-3)


@gpu
@pytest.mark.parametrize("bits,group", [(4, 64), (2, 128), (1, 128)])
@pytest.mark.parametrize("rows", [1, 3, 9, 17])
def test_gpu_affine_linear(bits, group, rows):
    out, cols = 1000, 2048
    _, (packed, scales, biases) = quant_inputs(out, cols, bits, group, seed=bits)
    x = torch.randn(rows, cols)
    want = dequantized_linear(x, packed, scales, biases, bits, group)
    got = cb.affine_linear(x.cuda(), packed.cuda(), scales.cuda(), biases.cuda(), bits, group)
    close(got, want, rtol=1e-4, atol=2e-3)


@gpu
def test_gpu_kernels_under_cuda_graph_capture():
    """The decode path can be captured once and replayed (no per-launch overhead)."""
    args = [a.cuda() for a in gdn_inputs(1, 8, 64, 64)]
    window, x, w = torch.randn(3, 512).cuda(), torch.randn(1, 512).cuda(), torch.randn(512, 4).cuda()
    o, z, nw = torch.randn(8, 64).cuda(), torch.randn(8, 64).cuda(), torch.randn(64).cuda()

    def step():
        conv, _, _ = cb.conv_window_update(window, x, w, keep_ext=False)
        outs, state, _ = cb.gdn_recurrence(*args)
        return conv, outs, cb.gated_rms_norm(o, z, nw, 1e-6)

    eager = step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, eager):
        assert torch.equal(a, b)
