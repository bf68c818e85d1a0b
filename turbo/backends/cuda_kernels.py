"""The PTX loader over cuda-python's driver API (docs/DESIGN.md 7): no compiler at run time.

cuInit -> cuDeviceGet -> cuDevicePrimaryCtxRetain + cuCtxSetCurrent (torch's own primary
context, so torch's pointers and streams are valid here) -> cuModuleLoadData once per module
(`kernels_ptx/<module>.<arch>.ptx`, arch picked from the device's compute capability) ->
cuModuleGetFunction once per kernel (cached) -> cuLaunchKernel on torch's current stream with
pointers from `tensor.data_ptr()`. Every CUresult is checked; a failure raises CudaError
naming the call and the kernel (or module) it was for.
"""

from __future__ import annotations

import ctypes
import re
import threading
from pathlib import Path

import torch

from ..errors import TurboError
from ..shipped import PTX_DIR
from . import cuda_sim

ARCHS = ("sm_80", "sm_90")  # what scripts/build_ptx.py builds; sm_90 PTX also JITs on newer GPUs
MODULES = ("gdn", "conv", "norm", "dflash", "qgemv", "bgemv", "step")
# The checked-in PTX says `.version 9.0` (nvcc 13.0), which needs a CUDA 13.0 driver. The kernels
# use nothing newer than PTX ISA 7.8 (tests/test_cuda.py assembles every file at that version), so
# when an older driver refuses the file the loader retries once with the newest ISA it reads.
PTX_ISA_FOR_DRIVER = ((13000, "9.0"), (12090, "8.8"), (12080, "8.7"), (12050, "8.5"), (12040, "8.4"),
                      (12030, "8.3"), (12020, "8.2"), (12010, "8.1"), (12000, "8.0"), (11080, "7.8"))
MIN_PTX_ISA = PTX_ISA_FOR_DRIVER[-1][1]
_VERSION_LINE = re.compile(rb"^\.version \d+\.\d+$", re.M)


def isa_for_driver(version: int) -> str | None:
    """The newest PTX ISA a driver of cuDriverGetVersion() `version` reads (None: below 11.8)."""
    return next((isa for v, isa in PTX_ISA_FOR_DRIVER if version >= v), None)


def with_isa(image: bytes, isa: str) -> bytes:
    return _VERSION_LINE.sub(f".version {isa}".encode(), image, count=1)


class CudaError(TurboError):
    """A driver call failed: the message names the call, the kernel/module and the CUresult."""


_ptx_dir: Path | None = None  # OpenOptions.ptx_dir, set by the runtime that opens backend cuda


def use_ptx_dir(path: Path | None) -> None:
    global _ptx_dir
    _ptx_dir = path


def ptx_dir() -> Path:
    return _ptx_dir if _ptx_dir is not None else PTX_DIR


def arch_for(major: int, minor: int) -> str | None:
    """The checked-in PTX target a device of compute capability major.minor loads."""
    if major >= 9:
        return "sm_90"
    if major == 8:
        return "sm_80"
    return None


def _driver():
    """cuda-python's driver module, or the simulated device's stand-in when TURBO_CUDA_SIM=1."""
    if cuda_sim.enabled():
        return cuda_sim.driver
    from cuda.bindings import driver  # imported lazily: the cpu backend never needs cuda-python
    return driver


def result_name(driver, err) -> str:
    try:
        e, name = driver.cuGetErrorName(err)
        e2, text = driver.cuGetErrorString(err)
        name = name.decode() if isinstance(name, bytes) else str(name)
        text = text.decode() if isinstance(text, bytes) else str(text)
        return f"{name}: {text}" if int(e2) == 0 else name
    except Exception:  # noqa: BLE001 - naming the error must never hide it
        return f"CUresult {int(err)}"


def check(driver, result, call: str, what: str = ""):
    """Unpack a cuda-python (CUresult, *values) tuple; raise CudaError unless CUDA_SUCCESS."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        where = f" for {what}" if what else ""
        raise CudaError(f"{call} failed{where}: {result_name(driver, err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


# kernel argument helpers: cuLaunchKernel copies each parameter from the address we give it
def ptr(t) -> ctypes.c_void_p:
    """A device pointer argument: a torch CUDA tensor (its data_ptr), a driver-API pointer
    (CUdeviceptr or int) or None (a null pointer)."""
    if t is None:
        return ctypes.c_void_p(0)
    return ctypes.c_void_p(t.data_ptr() if hasattr(t, "data_ptr") else int(t))


def i32(v: int) -> ctypes.c_int32:
    return ctypes.c_int32(int(v))


def f32(v: float) -> ctypes.c_float:
    return ctypes.c_float(float(v))


class Kernels:
    """One device's loaded PTX modules and kernel handles (thread-safe, lazily loaded)."""

    def __init__(self, device: int = 0):
        d = _driver()
        self.driver = d
        check(d, d.cuInit(0), "cuInit")
        self.device_index = device
        # the simulated device: no torch CUDA streams, and parameters passed in the (values, types)
        # form cuda-python also takes, so the stand-in can check their count and sizes
        self.simulated = bool(getattr(d, "SIMULATED", False))
        self.device = check(d, d.cuDeviceGet(device), "cuDeviceGet", f"device {device}")
        attr = d.CUdevice_attribute
        major = check(d, d.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.device),
                      "cuDeviceGetAttribute", f"device {device}")
        minor = check(d, d.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.device),
                      "cuDeviceGetAttribute", f"device {device}")
        self.capability = (int(major), int(minor))
        self.arch = arch_for(*self.capability)
        if self.arch is None:
            raise CudaError(f"backend cuda needs compute capability 8.0 or newer (PTX for {', '.join(ARCHS)}); "
                            f"device {device} is {major}.{minor}")
        self.context = check(d, d.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain",
                             f"device {device}")
        self._lock = threading.Lock()
        self._modules: dict[str, object] = {}
        self._images: dict[str, bytes] = {}
        self._functions: dict[tuple[str, str], object] = {}
        self._make_current()

    def _make_current(self, what: str = "") -> None:
        # every launch: torch (set_device) or another device's loader may have made a different
        # context current on this thread, and the call costs far less than the launch
        check(self.driver, self.driver.cuCtxSetCurrent(self.context), "cuCtxSetCurrent",
              what or f"device {self.device_index}'s primary context")

    def ptx_path(self, module: str) -> Path:
        return ptx_dir() / f"{module}.{self.arch}.ptx"

    def module(self, name: str):
        with self._lock:
            if name not in self._modules:
                path = self.ptx_path(name)
                if not path.is_file():
                    raise CudaError(f"backend cuda: {path} is missing (python -m scripts.build_ptx builds it)")
                self._make_current()
                image = path.read_bytes() + b"\0"
                self._images[name] = image  # keep the image alive as long as the module
                try:
                    self._modules[name] = check(self.driver, self.driver.cuModuleLoadData(image), "cuModuleLoadData",
                                                f"module {path.name}")
                except CudaError as e:
                    if "UNSUPPORTED_PTX_VERSION" not in str(e):
                        raise
                    ver = int(check(self.driver, self.driver.cuDriverGetVersion(), "cuDriverGetVersion"))
                    isa = isa_for_driver(ver)
                    driver_text = f"the driver supports CUDA {ver // 1000}.{ver % 1000 // 10}"
                    if isa is None:
                        raise CudaError(f"{e} ({driver_text}; the kernels need PTX ISA {MIN_PTX_ISA}, "
                                        f"CUDA 11.8 or newer)") from None
                    image = with_isa(image, isa)
                    self._images[name] = image
                    self._modules[name] = check(self.driver, self.driver.cuModuleLoadData(image), "cuModuleLoadData",
                                                f"module {path.name} at PTX ISA {isa} ({driver_text})")
            return self._modules[name]

    def function(self, module: str, kernel: str):
        key = (module, kernel)
        fn = self._functions.get(key)
        if fn is None:
            mod = self.module(module)
            with self._lock:
                fn = self._functions.get(key)
                if fn is None:
                    fn = check(self.driver, self.driver.cuModuleGetFunction(mod, kernel.encode()),
                               "cuModuleGetFunction", f"kernel {kernel} in {module}.{self.arch}.ptx")
                    self._functions[key] = fn
        return fn

    def launch(self, module: str, kernel: str, grid: tuple[int, ...], block: tuple[int, ...], args: list,
               shared: int = 0, stream: int | None = None) -> None:
        """Launch `kernel` on torch's current stream (or `stream`, a raw cudaStream_t)."""
        fn = self.function(module, kernel)
        self._make_current(f"kernel {kernel}")
        if stream is None:
            stream = 0 if self.simulated else torch.cuda.current_stream(self.device_index).cuda_stream
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        bx, by, bz = (tuple(block) + (1, 1))[:3]
        if min(gx, gy, gz) <= 0:
            return  # nothing to compute (zero rows)
        if self.simulated:
            packed = (tuple(args), tuple(type(a) for a in args))
        else:
            params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
            packed = ctypes.addressof(params)
        check(self.driver, self.driver.cuLaunchKernel(fn, gx, gy, gz, bx, by, bz, shared,
                                                      self.driver.CUstream(stream), packed, 0),
              "cuLaunchKernel", f"kernel {kernel}")


    # ---- memory and streams (the CUDA step's; turbo/backends/cuda_step): raw device pointers ----

    def alloc(self, nbytes: int) -> int:
        """cuMemAlloc: a device pointer (int) to `nbytes` bytes (at least 1), 256-byte aligned."""
        self._make_current()
        d = self.driver
        return int(check(d, d.cuMemAlloc(max(1, int(nbytes))), "cuMemAlloc", f"{nbytes} bytes"))

    def free(self, ptr: int) -> None:
        self._make_current()
        check(self.driver, self.driver.cuMemFree(self.driver.CUdeviceptr(int(ptr))), "cuMemFree")

    def htod(self, dst: int, src: int, nbytes: int, stream: int | None = None) -> None:
        """Host address `src` -> device pointer `dst` (async on `stream` when given)."""
        d = self.driver
        if stream is None:
            check(d, d.cuMemcpyHtoD(d.CUdeviceptr(int(dst)), int(src), int(nbytes)), "cuMemcpyHtoD")
        else:
            check(d, d.cuMemcpyHtoDAsync(d.CUdeviceptr(int(dst)), int(src), int(nbytes), d.CUstream(stream)),
                  "cuMemcpyHtoDAsync")

    def dtoh(self, dst: int, src: int, nbytes: int, stream: int | None = None) -> None:
        d = self.driver
        if stream is None:
            check(d, d.cuMemcpyDtoH(int(dst), d.CUdeviceptr(int(src)), int(nbytes)), "cuMemcpyDtoH")
        else:
            check(d, d.cuMemcpyDtoHAsync(int(dst), d.CUdeviceptr(int(src)), int(nbytes), d.CUstream(stream)),
                  "cuMemcpyDtoHAsync")

    def dtod(self, dst: int, src: int, nbytes: int, stream: int | None = None) -> None:
        d = self.driver
        if stream is None:
            check(d, d.cuMemcpyDtoD(d.CUdeviceptr(int(dst)), d.CUdeviceptr(int(src)), int(nbytes)), "cuMemcpyDtoD")
        else:
            check(d, d.cuMemcpyDtoDAsync(d.CUdeviceptr(int(dst)), d.CUdeviceptr(int(src)), int(nbytes),
                                         d.CUstream(stream)), "cuMemcpyDtoDAsync")

    def memset(self, dst: int, nbytes: int, value: int = 0, stream: int | None = None) -> None:
        d = self.driver
        if stream is None:
            check(d, d.cuMemsetD8(d.CUdeviceptr(int(dst)), int(value), int(nbytes)), "cuMemsetD8")
        else:
            check(d, d.cuMemsetD8Async(d.CUdeviceptr(int(dst)), int(value), int(nbytes), d.CUstream(stream)),
                  "cuMemsetD8Async")

    def stream(self, flags: int = 1) -> int:
        """cuStreamCreate: a new stream (its raw handle, for `launch(stream=...)`); flags 1
        (CU_STREAM_NON_BLOCKING, the default) or 0 (ordered with the legacy stream's work)."""
        self._make_current()
        d = self.driver
        return int(check(d, d.cuStreamCreate(int(flags)), "cuStreamCreate"))

    def sync(self, stream: int | None = None) -> None:
        d = self.driver
        if stream is None:
            check(d, d.cuCtxSynchronize(), "cuCtxSynchronize")
        else:
            check(d, d.cuStreamSynchronize(d.CUstream(stream)), "cuStreamSynchronize")


    # ---- CUDA graphs (the CUDA step's one launch a step): opaque driver handles ----

    def begin_capture(self, stream: int) -> None:
        """cuStreamBeginCapture in global mode: until end_capture, `stream`'s work is recorded, not
        run, and a host sync anywhere in the process fails the capture (none may sit in a step)."""
        self._make_current()
        d = self.driver
        check(d, d.cuStreamBeginCapture(d.CUstream(stream), d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL),
              "cuStreamBeginCapture")

    def end_capture(self, stream: int):
        """cuStreamEndCapture: the captured graph (raises CudaError if the capture was invalidated)."""
        d = self.driver
        return check(d, d.cuStreamEndCapture(d.CUstream(stream)), "cuStreamEndCapture")

    def instantiate(self, graph):
        """cuGraphInstantiate: an executable graph (the graph itself may be destroyed after)."""
        d = self.driver
        return check(d, d.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")

    def graph_launch(self, graph_exec, stream: int) -> None:
        d = self.driver
        check(d, d.cuGraphLaunch(graph_exec, d.CUstream(stream)), "cuGraphLaunch")

    def graph_destroy(self, graph=None, graph_exec=None) -> None:
        d = self.driver
        if graph_exec is not None:
            check(d, d.cuGraphExecDestroy(graph_exec), "cuGraphExecDestroy")
        if graph is not None:
            check(d, d.cuGraphDestroy(graph), "cuGraphDestroy")


_kernels: dict[int, Kernels] = {}
_kernels_lock = threading.Lock()


def kernels(device: int | None = None) -> Kernels:
    """The loader for `device` (torch's current device by default), created once."""
    if device is None:
        device = 0 if cuda_sim.enabled() else torch.cuda.current_device()
    with _kernels_lock:
        if device not in _kernels:
            _kernels[device] = Kernels(device)
        return _kernels[device]
