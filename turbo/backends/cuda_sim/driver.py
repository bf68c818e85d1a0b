"""The simulated device's stand-in for `cuda.bindings.driver` (cuda-python): the calls turbo makes
and a CUDA step needs, with cuda-python's signatures, `(CUresult, value...)` returns, enum names
and handle types (CUdeviceptr & co. are not ints: `int(p)` as with cuda-python).

Everything runs eagerly, in issue order, on the calling thread: a stream is an order, not a
queue. Device memory is the runtime's arena (host memory; a CUdeviceptr is its address). A
launch checks its parameters against the PTX entry's list, then runs the kernel's own CUDA C
(built for the host) over its grid and appends a launch record (records.py). Stream capture
records launches, copies and memsets into a graph that cuGraphLaunch replays in order; a host
sync while a capture is active fails as on a GPU and invalidates the capture.

A failed call's CUresult gets a sentence on what the simulation saw: cuGetErrorString returns
the standard text with it appended (so cuda_kernels.check's CudaError carries it), and
last_error() returns it.
"""

from __future__ import annotations

import ctypes
import enum
import itertools
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ...shipped import PTX_DIR
from . import build, ptx
from .records import Record, Touch, append

SIMULATED = True  # what cuda_kernels looks for to pass launch parameters in their checkable form
DRIVER_VERSION = 13000
DEVICE_NAME = "turbo simulated device (cuda_sim, sm_90)"
CAPABILITY = (9, 0)
MAX_PTX_ISA = (9, 0)
DEFAULT_SHARED = 48 * 1024
MAX_SHARED_OPTIN = 227 * 1024


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_DEINITIALIZED = 4
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_INVALID_IMAGE = 200
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_INVALID_PTX = 218
    CUDA_ERROR_UNSUPPORTED_PTX_VERSION = 222
    CUDA_ERROR_INVALID_SOURCE = 300
    CUDA_ERROR_INVALID_HANDLE = 400
    CUDA_ERROR_ILLEGAL_STATE = 401
    CUDA_ERROR_NOT_FOUND = 500
    CUDA_ERROR_NOT_READY = 600
    CUDA_ERROR_ILLEGAL_ADDRESS = 700
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701
    CUDA_ERROR_LAUNCH_TIMEOUT = 702
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713
    CUDA_ERROR_LAUNCH_FAILED = 719
    CUDA_ERROR_NOT_PERMITTED = 800
    CUDA_ERROR_NOT_SUPPORTED = 801
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901
    CUDA_ERROR_STREAM_CAPTURE_UNMATCHED = 903
    CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906
    CUDA_ERROR_CAPTURED_EVENT = 907
    CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD = 908
    CUDA_ERROR_UNKNOWN = 999


_TEXT = {
    0: "no error", 1: "invalid argument", 2: "out of memory", 3: "initialization error",
    100: "no CUDA-capable device is detected", 101: "invalid device ordinal", 200: "device kernel image is invalid",
    201: "invalid device context", 218: "a PTX JIT compilation failed",
    222: "the provided PTX was compiled with an unsupported toolchain.", 400: "invalid resource handle",
    401: "the operation cannot be performed in the present state", 500: "named symbol not found",
    600: "device not ready", 700: "an illegal memory access was encountered",
    701: "too many resources requested for launch", 702: "the launch timed out and was terminated", 719: "unspecified launch failure",
    801: "operation not supported", 900: "operation not permitted when stream is capturing",
    901: "operation failed due to a previous error during capture",
    906: "operation would make the legacy stream depend on a capturing blocking stream",
    907: "operation not permitted on an event last recorded in a capturing stream",
}


class CUdevice_attribute(enum.IntEnum):
    CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 1
    CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X = 2
    CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y = 3
    CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z = 4
    CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X = 5
    CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y = 6
    CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z = 7
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK = 8
    CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY = 9
    CU_DEVICE_ATTRIBUTE_WARP_SIZE = 10
    CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK = 12
    CU_DEVICE_ATTRIBUTE_CLOCK_RATE = 13
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
    CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE = 36
    CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH = 37
    CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE = 38
    CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR = 39
    CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR = 81
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97


_ATTRS = {1: 1024, 2: 1024, 3: 1024, 4: 64, 5: 2 ** 31 - 1, 6: 65535, 7: 65535, 8: DEFAULT_SHARED, 9: 65536,
          10: 32, 12: 65536, 13: 1_980_000, 16: 132, 36: 2_619_000, 37: 5120, 38: 50 * 2 ** 20, 39: 2048, 41: 1,
          75: CAPABILITY[0], 76: CAPABILITY[1], 81: 228 * 1024, 97: MAX_SHARED_OPTIN}


class CUfunction_attribute(enum.IntEnum):
    CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0
    CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1
    CU_FUNC_ATTRIBUTE_NUM_REGS = 4
    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class CUstreamCaptureStatus(enum.IntEnum):
    CU_STREAM_CAPTURE_STATUS_NONE = 0
    CU_STREAM_CAPTURE_STATUS_ACTIVE = 1
    CU_STREAM_CAPTURE_STATUS_INVALIDATED = 2


class CUstreamCaptureMode(enum.IntEnum):
    CU_STREAM_CAPTURE_MODE_GLOBAL = 0
    CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1
    CU_STREAM_CAPTURE_MODE_RELAXED = 2


class CUstream_flags(enum.IntEnum):
    CU_STREAM_DEFAULT = 0
    CU_STREAM_NON_BLOCKING = 1


class CUevent_flags(enum.IntEnum):
    CU_EVENT_DEFAULT = 0
    CU_EVENT_BLOCKING_SYNC = 1
    CU_EVENT_DISABLE_TIMING = 2


class CUgraphInstantiate_flags(enum.IntEnum):
    CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH = 1
    CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD = 2


class _Handle:
    """A cuda-python style handle: built from an int, read back with int() or getPtr(); no
    arithmetic and no equality with ints (cuda-python's handles have neither)."""

    __slots__ = ("_value",)

    def __init__(self, init_value: int = 0):
        self._value = ctypes.c_uint64(int(init_value or 0))

    def __int__(self) -> int:
        return int(self._value.value)

    def getPtr(self) -> int:
        return ctypes.addressof(self._value)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {int(self):#x}>"


class CUdeviceptr(_Handle):
    pass


class CUdevice(_Handle):
    def __repr__(self) -> str:
        return f"<CUdevice {int(self)}>"


class CUcontext(_Handle):
    pass


class CUmodule(_Handle):
    pass


class CUfunction(_Handle):
    pass


class CUstream(_Handle):
    pass


class CUevent(_Handle):
    pass


class CUgraph(_Handle):
    pass


class CUgraphExec(_Handle):
    pass


# ---- state -----------------------------------------------------------------------------------------

@dataclass
class _Module:
    source: Path
    entries: dict[str, ptx.Entry]
    lib: ctypes.CDLL


@dataclass
class _Function:
    module: _Module
    entry: ptx.Entry
    tramp: int
    max_dynamic_shared: int = DEFAULT_SHARED


@dataclass
class _Launch:
    """One launch as the driver copied it: cuLaunchKernel's parameters are read at the call."""
    fn: _Function
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared: int
    blob: ctypes.Array
    offsets: tuple[int, ...]
    values: tuple
    checked: bool


@dataclass
class _Capture:
    mode: int
    thread: int
    nodes: list = field(default_factory=list)
    invalidated: str | None = None


_lock = threading.RLock()
_tls = threading.local()
_ids = itertools.count(1)
_state: dict = {"init": False}
_rt: ctypes.CDLL | None = None
_modules: dict[int, _Module] = {}
_functions: dict[int, _Function] = {}
_streams: dict[int, _Capture | None] = {0: None}  # stream id -> its active capture
_events: dict[int, float | None] = {}
_captured_events: set[int] = set()
_graphs: dict[int, list] = {}
_execs: dict[int, list] = {}
_allocs: dict[int, tuple[int, int, bool]] = {}  # base -> (size, runtime id, host)
_by_id: dict[int, int] = {}  # runtime id -> base
_host_registered: dict[int, int] = {}
_contexts: dict[int, str] = {}
_primary: dict[int, int] = {}
_detail: dict = {"code": 0, "text": ""}
_source_dirs: list[Path] = []


def source_dirs() -> list[Path]:
    """Where module images are matched to their CUDA C: registered directories, then the
    `TURBO_CUDA_SIM_SOURCES` directories, then kernels_ptx/."""
    env = [Path(p) for p in os.environ.get("TURBO_CUDA_SIM_SOURCES", "").split(os.pathsep) if p]
    return [*_source_dirs, *env, PTX_DIR]


def add_source_dir(path: Path) -> None:
    with _lock:
        if Path(path) not in _source_dirs:
            _source_dirs.insert(0, Path(path))


def accept_host_memory(on: bool) -> None:
    """Let kernels read and write any host address, as if all of it were registered
    (cuMemHostRegister): for tests that launch on CPU tensors' memory. Arena bounds stay checked."""
    with _lock:
        _runtime().sim_accept_host(1 if on else 0)


def set_timeout(seconds: float) -> None:
    """How long one launch may run before it ends with CUDA_ERROR_LAUNCH_TIMEOUT."""
    with _lock:
        _runtime().sim_set_timeout(float(seconds))


def last_error() -> str:
    """What the simulation said about the last failed call ('' when none failed)."""
    return _detail["text"]


def _err(code: CUresult, text: str = "") -> tuple:
    _detail["code"], _detail["text"] = int(code), text
    return (code,)


def _ok(*values) -> tuple:
    return (CUresult.CUDA_SUCCESS, *values)


def _int(h) -> int:
    if h is None:
        return 0
    return int(h)


def _runtime() -> ctypes.CDLL:
    global _rt
    if _rt is None:
        lib = build.load(build.runtime_library(), global_symbols=True)
        lib.sim_alloc.restype = ctypes.c_uint64
        lib.sim_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int]
        lib.sim_free.argtypes = [ctypes.c_uint64]
        lib.sim_find.restype = ctypes.c_uint32
        lib.sim_find.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint64),
                                 ctypes.POINTER(ctypes.c_size_t)]
        lib.sim_arena_base.restype = ctypes.c_uint64
        lib.sim_arena_size.restype = ctypes.c_size_t
        lib.sim_init.argtypes = [ctypes.c_size_t]
        lib.sim_error.restype = ctypes.c_char_p
        lib.sim_register_host.argtypes = [ctypes.c_uint64, ctypes.c_size_t]
        lib.sim_unregister_host.argtypes = [ctypes.c_uint64]
        lib.sim_register_module.argtypes = [ctypes.c_void_p]
        lib.sim_accept_host.argtypes = [ctypes.c_int]
        lib.sim_set_timeout.argtypes = [ctypes.c_double]
        lib.sim_set_timeout(float(os.environ.get("TURBO_CUDA_SIM_TIMEOUT", "300")))
        lib.sim_take_counts.argtypes = [ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64),
                                        ctypes.POINTER(ctypes.c_uint64), ctypes.c_int, ctypes.POINTER(ctypes.c_uint64)]
        lib.sim_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64,
                                   *([ctypes.c_uint] * 7), ctypes.c_char_p]
        gib = float(os.environ.get("TURBO_CUDA_SIM_MEMORY_GB", "80"))
        if lib.sim_init(int(gib * 2 ** 30)) != 0:
            raise MemoryError("the simulated device could not reserve its arena")
        _rt = lib
    return _rt


def _find(ptr: int, n: int) -> int:
    """The runtime id of the live allocation holding [ptr, ptr + n), 0 if none."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    return _runtime().sim_find(ptr, max(n, 1), ctypes.byref(base), ctypes.byref(size))


def _host_ok(ptr: int, n: int) -> bool:
    return _find(ptr, n) != 0 or any(b <= ptr and ptr + n <= b + s for b, s in _host_registered.items())


def _need_context() -> tuple | None:
    if not _state["init"]:
        return _err(CUresult.CUDA_ERROR_NOT_INITIALIZED, "cuInit has not been called")
    if getattr(_tls, "ctx", 0) == 0:
        return _err(CUresult.CUDA_ERROR_INVALID_CONTEXT, "no current context on this thread (cuCtxSetCurrent)")
    return None


def _captures() -> list[tuple[int, _Capture]]:
    return [(s, c) for s, c in _streams.items() if c is not None]


def _blocking_captures() -> list[tuple[int, _Capture]]:
    """The captures a potentially unsafe call from this thread interferes with."""
    me = threading.get_ident()
    return [(s, c) for s, c in _captures()
            if c.mode == CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL
            or (c.mode == CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL and c.thread == me)]


def _refuse_in_capture(call: str, captures: list[tuple[int, _Capture]],
                       code: CUresult = CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) -> tuple | None:
    if not captures:
        return None
    why = f"{call} while stream {captures[0][0]:#x} is capturing (a host sync inside a captured step)"
    for _, c in captures:
        c.invalidated = c.invalidated or why
    return _err(code, why)


def _stream_id(h) -> tuple[int, tuple | None]:
    s = _int(h)
    if s not in _streams:
        return s, _err(CUresult.CUDA_ERROR_INVALID_HANDLE, f"stream {s:#x} does not exist")
    return s, None


def _enqueue(stream: int, node: tuple, call: str) -> tuple | None:
    """Capture `node` if `stream` is capturing (returns success), refuse on the legacy stream
    during a capture, else None: the caller runs it now."""
    cap = _streams.get(stream)
    if cap is not None:
        if cap.invalidated:
            return _err(CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, cap.invalidated)
        cap.nodes.append(node)
        return _ok()
    if stream == 0:
        refused = _refuse_in_capture(call + " on the legacy stream", _blocking_captures(),
                                     CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)
        if refused:
            return refused
    return None


# ---- init, device, context ----------------------------------------------------------------------


def cuInit(Flags: int):
    with _lock:
        missing = build.compiler_missing()
        if missing:
            return _err(CUresult.CUDA_ERROR_NO_DEVICE, missing)
        _state["init"] = True
        return _ok()


def cuDriverGetVersion():
    return _ok(DRIVER_VERSION)


def cuDeviceGetCount():
    if not _state["init"]:
        return _err(CUresult.CUDA_ERROR_NOT_INITIALIZED)
    return _ok(1)


def cuDeviceGet(ordinal: int):
    if not _state["init"]:
        return _err(CUresult.CUDA_ERROR_NOT_INITIALIZED)
    if int(ordinal) != 0:
        return _err(CUresult.CUDA_ERROR_INVALID_DEVICE, f"the simulated device is ordinal 0, not {ordinal}")
    return _ok(CUdevice(0))


def _dev(dev) -> tuple | None:
    if not _state["init"]:
        return _err(CUresult.CUDA_ERROR_NOT_INITIALIZED)
    if _int(dev) != 0:
        return _err(CUresult.CUDA_ERROR_INVALID_DEVICE)
    return None


def cuDeviceGetAttribute(attrib, dev):
    bad = _dev(dev)
    if bad:
        return bad
    if int(attrib) not in _ATTRS:
        return _err(CUresult.CUDA_ERROR_INVALID_VALUE, f"attribute {int(attrib)} is not simulated")
    return _ok(_ATTRS[int(attrib)])


def cuDeviceGetName(length: int, dev):
    bad = _dev(dev)
    return bad or _ok(DEVICE_NAME.encode()[:max(0, int(length) - 1)])


def cuDeviceTotalMem(dev):
    bad = _dev(dev)
    return bad or _ok(int(_runtime().sim_arena_size()))


def cuMemGetInfo():
    bad = _need_context()
    if bad:
        return bad
    total = int(_runtime().sim_arena_size())
    return _ok(total - sum(s for s, _, _ in _allocs.values()), total)


def cuDevicePrimaryCtxRetain(dev):
    with _lock:
        bad = _dev(dev)
        if bad:
            return bad
        if 0 not in _primary:
            _primary[0] = next(_ids)
            _contexts[_primary[0]] = "primary"
        return _ok(CUcontext(_primary[0]))


def cuDevicePrimaryCtxRelease(dev):
    return _dev(dev) or _ok()


def cuCtxCreate(ctxCreateParams, flags: int, dev):
    with _lock:
        bad = _dev(dev)
        if bad:
            return bad
        ctx = next(_ids)
        _contexts[ctx] = "created"
        _tls.ctx = ctx
        return _ok(CUcontext(ctx))


def cuCtxSetCurrent(ctx):
    if not _state["init"]:
        return _err(CUresult.CUDA_ERROR_NOT_INITIALIZED)
    c = _int(ctx)
    if c != 0 and c not in _contexts:
        return _err(CUresult.CUDA_ERROR_INVALID_CONTEXT, f"context {c:#x} does not exist")
    _tls.ctx = c
    return _ok()


def cuCtxGetCurrent():
    if not _state["init"]:
        return _err(CUresult.CUDA_ERROR_NOT_INITIALIZED)
    return _ok(CUcontext(getattr(_tls, "ctx", 0)))


def cuCtxDestroy(ctx):
    with _lock:
        c = _int(ctx)
        if _contexts.get(c) != "created":
            return _err(CUresult.CUDA_ERROR_INVALID_CONTEXT, f"context {c:#x} was not made by cuCtxCreate")
        del _contexts[c]
        if getattr(_tls, "ctx", 0) == c:
            _tls.ctx = 0
        return _ok()


def cuCtxSynchronize():
    with _lock:
        bad = _need_context()
        if bad:
            return bad
        return _refuse_in_capture("cuCtxSynchronize", _captures()) or _ok()


def cuGetErrorName(error):
    try:
        return _ok(CUresult(int(error)).name.encode())
    except ValueError:
        return _err(CUresult.CUDA_ERROR_INVALID_VALUE)


def cuGetErrorString(error):
    code = int(error)
    text = _TEXT.get(code, "unknown error")
    if _detail["code"] == code and _detail["text"]:
        text = f"{text} (simulated device: {_detail['text']})"
    return _ok(text.encode())


# ---- modules and functions ------------------------------------------------------------------------


def _image_text(image) -> str:
    if isinstance(image, int):
        return ctypes.string_at(image).decode(errors="replace")
    if isinstance(image, str):
        return image
    return bytes(memoryview(image).cast("B")).split(b"\0", 1)[0].decode(errors="replace")


_VERSION = re.compile(r"^\.version\s+(\d+)\.(\d+)", re.MULTILINE)


def cuModuleLoadData(image):
    with _lock:
        bad = _need_context()
        if bad:
            return bad
        text = _image_text(image)
        m = _VERSION.search(text)
        if m is None:
            return _err(CUresult.CUDA_ERROR_INVALID_IMAGE, "the image is not PTX text (no .version line)")
        if (int(m.group(1)), int(m.group(2))) > MAX_PTX_ISA:
            return _err(CUresult.CUDA_ERROR_UNSUPPORTED_PTX_VERSION,
                        f"PTX ISA {m.group(1)}.{m.group(2)} is newer than this driver's {MAX_PTX_ISA[0]}.{MAX_PTX_ISA[1]}")
        entries = ptx.entries(text)
        if not entries:
            return _err(CUresult.CUDA_ERROR_INVALID_PTX, "the PTX has no .entry")
        dirs = source_dirs()
        cu = ptx.find_source(set(entries), dirs, build.cache_dir())
        if cu is None:
            return _err(CUresult.CUDA_ERROR_INVALID_PTX, f"no kernel source in {', '.join(map(str, dirs))} defines "
                                                         f"all of {', '.join(sorted(entries))}")
        _runtime()
        try:
            lib = build.load(build.module_library(cu, sorted(entries)))
        except (build.BuildError, OSError) as e:
            return _err(CUresult.CUDA_ERROR_INVALID_PTX, str(e).replace("\n", " | "))
        mod = _Module(cu, entries, lib)
        for name, entry in entries.items():
            sizes = (ctypes.c_int * 64)()
            count = getattr(lib, f"sim_sizes_{name}")(sizes)
            if list(sizes[:count]) != [p.size for p in entry.params]:
                return _err(CUresult.CUDA_ERROR_INVALID_PTX,
                            f"{name}: the PTX's parameter sizes {[p.size for p in entry.params]} are not those of "
                            f"{cu.name}'s signature {list(sizes[:count])} (is the PTX stale? scripts/build_ptx.py)")
        _runtime().sim_register_module(ctypes.cast(getattr(lib, f"sim_tramp_{next(iter(entries))}"), ctypes.c_void_p))
        handle = next(_ids)
        _modules[handle] = mod
        return _ok(CUmodule(handle))


def cuModuleLoadDataEx(image, numOptions: int, options, optionValues):
    return cuModuleLoadData(image)


def cuModuleUnload(hmod):
    with _lock:
        if _modules.pop(_int(hmod), None) is None:
            return _err(CUresult.CUDA_ERROR_INVALID_HANDLE)
        return _ok()


def cuModuleGetFunction(hmod, name: bytes):
    if not isinstance(name, (bytes, bytearray)):
        raise TypeError(f"expected bytes, {type(name).__name__} found")
    with _lock:
        mod = _modules.get(_int(hmod))
        if mod is None:
            return _err(CUresult.CUDA_ERROR_INVALID_HANDLE, f"module {_int(hmod):#x} is not loaded")
        entry = mod.entries.get(name.decode())
        if entry is None:
            return _err(CUresult.CUDA_ERROR_NOT_FOUND, f"{name.decode()} is not an entry of {mod.source.name}'s PTX")
        tramp = ctypes.cast(getattr(mod.lib, f"sim_tramp_{entry.name}"), ctypes.c_void_p).value
        handle = next(_ids)
        _functions[handle] = _Function(mod, entry, tramp)
        return _ok(CUfunction(handle))


def cuFuncGetAttribute(attrib, hfunc):
    fn = _functions.get(_int(hfunc))
    if fn is None:
        return _err(CUresult.CUDA_ERROR_INVALID_HANDLE)
    a = int(attrib)
    values = {0: fn.entry.max_threads or 1024, 1: fn.entry.static_shared, 4: 32, 8: fn.max_dynamic_shared}
    if a not in values:
        return _err(CUresult.CUDA_ERROR_INVALID_VALUE, f"function attribute {a} is not simulated")
    return _ok(values[a])


def cuFuncSetAttribute(hfunc, attrib, value: int):
    fn = _functions.get(_int(hfunc))
    if fn is None:
        return _err(CUresult.CUDA_ERROR_INVALID_HANDLE)
    if int(attrib) != CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES:
        return _err(CUresult.CUDA_ERROR_INVALID_VALUE, f"function attribute {int(attrib)} is not settable here")
    if int(value) + fn.entry.static_shared > MAX_SHARED_OPTIN:
        return _err(CUresult.CUDA_ERROR_INVALID_VALUE, f"{value} bytes of dynamic shared memory is over the opt-in limit")
    fn.max_dynamic_shared = int(value)
    return _ok()


# ---- memory -------------------------------------------------------------------------------------------


def _alloc(size: int, host: bool):
    with _lock:
        bad = _need_context()
        if bad:
            return bad
        refused = _refuse_in_capture("cuMemAlloc", _blocking_captures())
        if refused:
            return refused
        if int(size) <= 0:
            return _err(CUresult.CUDA_ERROR_INVALID_VALUE, "an allocation of 0 bytes")
        rt = _runtime()
        ptr = int(rt.sim_alloc(int(size), 1))
        if ptr == 0:
            return _err(CUresult.CUDA_ERROR_OUT_OF_MEMORY, f"{size} bytes do not fit the simulated device's arena")
        rid = _find(ptr, 1)
        _allocs[ptr] = (int(size), rid, host)
        _by_id[rid] = ptr
        return _ok(CUdeviceptr(ptr) if not host else ptr)


def cuMemAlloc(bytesize: int):
    return _alloc(bytesize, False)


def cuMemAllocHost(bytesize: int):
    """Pinned host memory: the arena too (device-accessible, as UVA makes it); returns its
    address as an int, as cuda-python does."""
    return _alloc(bytesize, True)


def _free(ptr: int, host: bool):
    with _lock:
        bad = _need_context()
        if bad:
            return bad
        refused = _refuse_in_capture("cuMemFree", _blocking_captures())
        if refused:
            return refused
        info = _allocs.get(ptr)
        if info is None or info[2] != host:
            return _err(CUresult.CUDA_ERROR_INVALID_VALUE, f"{ptr:#x} is not the start of a live "
                                                           f"{'host' if host else 'device'} allocation")
        _runtime().sim_free(ptr)
        del _allocs[ptr]
        _by_id.pop(info[1], None)
        return _ok()


def cuMemFree(dptr):
    return _free(_int(dptr), False)


def cuMemFreeHost(p):
    return _free(_int(p), True)


def cuMemHostRegister(p, bytesize: int, Flags: int):
    with _lock:
        ptr = _int(p)
        if ptr in _host_registered:
            return _err(CUresult.CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)
        _host_registered[ptr] = int(bytesize)
        _runtime().sim_register_host(ptr, int(bytesize))
        return _ok()


def cuMemHostUnregister(p):
    with _lock:
        ptr = _int(p)
        if _host_registered.pop(ptr, None) is None:
            return _err(CUresult.CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED)
        _runtime().sim_unregister_host(ptr)
        return _ok()


def cuMemHostGetDevicePointer(p, Flags: int):
    return _ok(CUdeviceptr(_int(p)))


def cuMemGetAddressRange(dptr):
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    if not _runtime().sim_find(_int(dptr), 1, ctypes.byref(base), ctypes.byref(size)):
        return _err(CUresult.CUDA_ERROR_NOT_FOUND, f"{_int(dptr):#x} is in no live allocation")
    return _ok(CUdeviceptr(base.value), size.value)


def _host_buffer(obj, n: int, writable: bool):
    """(address, keep-alive) of host memory given as an int address or a buffer."""
    if isinstance(obj, int):
        return obj, None
    if isinstance(obj, (ctypes.Array, ctypes.Structure, ctypes._SimpleCData)):
        if ctypes.sizeof(obj) < n:
            raise ValueError(f"a {ctypes.sizeof(obj)}-byte ctypes object for {n} bytes")
        return ctypes.addressof(obj), obj
    mv = memoryview(obj).cast("B")
    if mv.nbytes < n:
        raise ValueError(f"a {mv.nbytes}-byte buffer for {n} bytes")
    if writable:
        if mv.readonly:
            raise ValueError("the destination buffer is read-only")
        arr = (ctypes.c_char * mv.nbytes).from_buffer(mv)
        return ctypes.addressof(arr), arr
    arr = ctypes.create_string_buffer(bytes(mv[:n]), n)
    return ctypes.addressof(arr), arr


def _copy_node(kind: str, dst, src, n: int):
    """A memcpy as a node: (kind, dst address, src address, n, keep-alive)."""
    n = int(n)
    keep = None
    if kind == "HtoD":
        d = _int(dst)
        s, keep = _host_buffer(src, n, False)
        if keep is not None and kind == "HtoD":
            # the driver reads pageable host memory at the call: a captured copy keeps that copy
            s, keep = _host_buffer(ctypes.string_at(s, n), n, False)
        ok = _find(d, n) != 0
        what = f"destination {d:#x} + {n} bytes"
    elif kind == "DtoH":
        d, keep = _host_buffer(dst, n, True)
        s = _int(src)
        ok = _find(s, n) != 0 or _host_ok(s, n)
        what = f"source {s:#x} + {n} bytes"
    else:
        d, s = _int(dst), _int(src)
        ok = _host_ok(d, n) and _host_ok(s, n)
        what = f"{s:#x} -> {d:#x}, {n} bytes"
    if not ok:
        return None, _err(CUresult.CUDA_ERROR_INVALID_VALUE, f"cuMemcpy{kind}: {what} is not inside a live allocation")
    return ("memcpy", kind, d, s, n, keep), None


def _memcpy(kind: str, dst, src, n: int, stream, call: str, sync: bool):
    with _lock:
        bad = _need_context()
        if bad:
            return bad
        try:
            node, bad = _copy_node(kind, dst, src, n)
        except (TypeError, ValueError) as e:
            return _err(CUresult.CUDA_ERROR_INVALID_VALUE, f"{call}: {e}")
        if bad:
            return bad
        return _submit(node, stream, call, sync)


def _submit(node: tuple, stream, call: str, sync: bool) -> tuple:
    """A copy's or memset's node: a synchronous one run now (refused while a capture it would
    break runs), an async one captured where its stream captures, else run now (the caller holds
    the lock)."""
    if sync:
        refused = _refuse_in_capture(call, _blocking_captures())
        if refused:
            return refused
        _run(node, 0, None)
        return _ok()
    s, bad = _stream_id(stream)
    if bad:
        return bad
    queued = _enqueue(s, node, call)
    if queued:
        return queued
    _run(node, s, None)
    return _ok()


def cuMemcpyHtoD(dstDevice, srcHost, ByteCount: int):
    return _memcpy("HtoD", dstDevice, srcHost, ByteCount, None, "cuMemcpyHtoD", True)


def cuMemcpyDtoH(dstHost, srcDevice, ByteCount: int):
    return _memcpy("DtoH", dstHost, srcDevice, ByteCount, None, "cuMemcpyDtoH", True)


def cuMemcpyDtoD(dstDevice, srcDevice, ByteCount: int):
    return _memcpy("DtoD", dstDevice, srcDevice, ByteCount, None, "cuMemcpyDtoD", True)


def cuMemcpyHtoDAsync(dstDevice, srcHost, ByteCount: int, hStream):
    return _memcpy("HtoD", dstDevice, srcHost, ByteCount, hStream, "cuMemcpyHtoDAsync", False)


def cuMemcpyDtoHAsync(dstHost, srcDevice, ByteCount: int, hStream):
    return _memcpy("DtoH", dstHost, srcDevice, ByteCount, hStream, "cuMemcpyDtoHAsync", False)


def cuMemcpyDtoDAsync(dstDevice, srcDevice, ByteCount: int, hStream):
    return _memcpy("DtoD", dstDevice, srcDevice, ByteCount, hStream, "cuMemcpyDtoDAsync", False)


def _memset(dst, value: int, width: int, n: int, stream, call: str, sync: bool):
    with _lock:
        bad = _need_context()
        if bad:
            return bad
        d, n = _int(dst), int(n)
        if width == 4 and d % 4:
            return _err(CUresult.CUDA_ERROR_INVALID_VALUE, f"{call}: {d:#x} is not 4-byte aligned")
        if n and _find(d, n * width) == 0:
            return _err(CUresult.CUDA_ERROR_INVALID_VALUE, f"{call}: {d:#x} + {n * width} bytes is not inside a live allocation")
        node = ("memset", f"D{8 * width}", d, int(value), width, n)
        return _submit(node, stream, call, sync)


def cuMemsetD8(dstDevice, uc: int, N: int):
    return _memset(dstDevice, uc, 1, N, None, "cuMemsetD8", True)


def cuMemsetD32(dstDevice, ui: int, N: int):
    return _memset(dstDevice, ui, 4, N, None, "cuMemsetD32", True)


def cuMemsetD8Async(dstDevice, uc: int, N: int, hStream):
    return _memset(dstDevice, uc, 1, N, hStream, "cuMemsetD8Async", False)


def cuMemsetD32Async(dstDevice, ui: int, N: int, hStream):
    return _memset(dstDevice, ui, 4, N, hStream, "cuMemsetD32Async", False)


# ---- launches -----------------------------------------------------------------------------------------

_FLOAT_TYPES = (ctypes.c_float, ctypes.c_double)


def _pack(fn: _Function, kernelParams) -> tuple[_Launch | None, str]:
    """Copy the launch's parameters as the driver does; check them against the PTX entry."""
    params = fn.entry.params
    name = fn.entry.name
    want = ", ".join(f".{p.kind}" for p in params)
    raw: list[bytes] = []
    checked = True
    if kernelParams is None or (isinstance(kernelParams, int) and kernelParams == 0):
        if params:
            return None, f"{name} takes {len(params)} parameters ({want}), got none"
    elif isinstance(kernelParams, tuple) and len(kernelParams) == 2 and isinstance(kernelParams[0], (tuple, list)):
        values, types = kernelParams
        if len(values) != len(types) or len(values) != len(params):
            return None, f"{name} takes {len(params)} parameters ({want}), got {len(values)}"
        for i, (v, t, p) in enumerate(zip(values, types, params)):
            if t is None:
                if not callable(getattr(v, "getPtr", None)):
                    return None, f"{name} parameter {i}: type None needs a handle with getPtr(), got {type(v).__name__}"
                size, data, floating = 8, int(v).to_bytes(8, "little"), False
            else:
                size = ctypes.sizeof(t)
                obj = v if isinstance(v, t) else t(v)
                data, floating = ctypes.string_at(ctypes.addressof(obj), size), issubclass(t, _FLOAT_TYPES)
            if size != p.size:
                return None, f"{name} parameter {i} is .{p.kind} ({p.size} bytes), got {size} bytes"
            if floating != p.floating and p.kind != "b8":
                return None, f"{name} parameter {i} is .{p.kind}, got a {'float' if floating else 'integer'} value"
            raw.append(data)
    else:
        # a void** (an int address or a buffer): the count is checked for a buffer, neither count
        # nor sizes for a bare address (the record says so)
        if isinstance(kernelParams, int):
            addr, count, checked = kernelParams, None, False
        else:
            mv = memoryview(kernelParams).cast("B")
            count = mv.nbytes // 8
            addr = ctypes.addressof((ctypes.c_char * mv.nbytes).from_buffer(mv)) if not mv.readonly else \
                ctypes.addressof(ctypes.create_string_buffer(bytes(mv)))
        if count is not None and count != len(params):
            return None, f"{name} takes {len(params)} parameters ({want}), got an array of {count}"
        ptrs = (ctypes.c_void_p * max(1, len(params))).from_address(addr)
        for i, p in enumerate(params):
            if not ptrs[i]:
                return None, f"{name} parameter {i}: a null pointer in kernelParams"
            raw.append(ctypes.string_at(ptrs[i], p.size))
    offsets, pos = [], 0
    for data in raw:
        pos = (pos + 15) // 16 * 16
        offsets.append(pos)
        pos += len(data)
    blob = ctypes.create_string_buffer(max(pos, 16))
    for off, data in zip(offsets, raw):
        ctypes.memmove(ctypes.addressof(blob) + off, data, len(data))
    values = tuple(_decode(p, data) for p, data in zip(params, raw))
    return _Launch(fn, (0, 0, 0), (0, 0, 0), 0, blob, tuple(offsets), values, checked), ""


def _decode(p: ptx.Param, data: bytes):
    if p.kind == "f32":
        return ctypes.c_float.from_buffer_copy(data).value
    if p.kind == "f64":
        return ctypes.c_double.from_buffer_copy(data).value
    if p.kind.startswith("s"):
        return int.from_bytes(data, "little", signed=True)
    if len(data) <= 8:
        return int.from_bytes(data, "little")
    return bytes(data)


def cuLaunchKernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
                   sharedMemBytes, hStream, kernelParams, extra):
    with _lock:
        bad = _need_context()
        if bad:
            return bad
        fn = _functions.get(_int(f))
        if fn is None:
            return _err(CUresult.CUDA_ERROR_INVALID_HANDLE, f"function {_int(f):#x} does not exist")
        name = fn.entry.name
        if extra not in (None, 0):
            return _err(CUresult.CUDA_ERROR_INVALID_VALUE, f"{name}: `extra` parameters are not simulated")
        grid = tuple(int(v) for v in (gridDimX, gridDimY, gridDimZ))
        block = tuple(int(v) for v in (blockDimX, blockDimY, blockDimZ))
        threads = block[0] * block[1] * block[2]
        if min(grid) <= 0 or grid[0] > _ATTRS[5] or grid[1] > _ATTRS[6] or grid[2] > _ATTRS[7]:
            return _err(CUresult.CUDA_ERROR_INVALID_VALUE, f"{name}: grid {grid} is out of range")
        if min(block) <= 0 or threads > 1024 or block[2] > 64:
            return _err(CUresult.CUDA_ERROR_INVALID_VALUE, f"{name}: block {block} is out of range")
        if fn.entry.max_threads is not None and threads > fn.entry.max_threads:
            return _err(CUresult.CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,
                        f"{name}: block of {threads} threads over its __launch_bounds__ {fn.entry.max_threads}")
        shared = int(sharedMemBytes)
        if shared > fn.max_dynamic_shared or shared + fn.entry.static_shared > MAX_SHARED_OPTIN:
            return _err(CUresult.CUDA_ERROR_INVALID_VALUE,
                        f"{name}: {shared} bytes of dynamic shared memory over the function's limit "
                        f"{fn.max_dynamic_shared} (cuFuncSetAttribute MAX_DYNAMIC_SHARED_SIZE_BYTES)")
        try:
            launch, why = _pack(fn, kernelParams)
        except (TypeError, ValueError, OverflowError) as e:
            launch, why = None, f"{name}: {e}"
        if launch is None:
            return _err(CUresult.CUDA_ERROR_INVALID_VALUE, why)
        launch.grid, launch.block, launch.shared = grid, block, shared
        s, bad = _stream_id(hStream)
        if bad:
            return bad
        node = ("launch", launch)
        queued = _enqueue(s, node, "cuLaunchKernel")
        if queued:
            return queued
        return _run(node, s, None)


def _touches(rt: ctypes.CDLL, args: dict[int, list[int]]) -> tuple[tuple[Touch, ...], int, int]:
    cap = 4096
    ids, rd, wr = (ctypes.c_uint32 * cap)(), (ctypes.c_uint64 * cap)(), (ctypes.c_uint64 * cap)()
    raw = (ctypes.c_uint64 * 2)()
    n = rt.sim_take_counts(ids, rd, wr, cap, raw)
    out = []
    for i in range(n):
        base = _by_id.get(ids[i])
        size = _allocs[base][0] if base in _allocs else 0
        out.append(Touch(base or 0, size, int(rd[i]), int(wr[i]), tuple(args.get(base, ()))))
    out.sort(key=lambda t: (t.args or (1 << 30,), t.base))
    return tuple(out), int(raw[0]), int(raw[1])


def _run(node: tuple, stream: int, graph: int | None) -> tuple:
    """Execute one operation now and append its record."""
    rt = _runtime()
    t0 = time.perf_counter()
    if node[0] == "launch":
        launch: _Launch = node[1]
        fn = launch.fn
        base = ctypes.addressof(launch.blob)
        args = (ctypes.c_void_p * max(1, len(launch.offsets)))(*[base + o for o in launch.offsets])
        code = rt.sim_launch(fn.tramp, ctypes.addressof(args), base, base + ctypes.sizeof(launch.blob),
                             *launch.grid, *launch.block, launch.shared, fn.entry.name.encode())
        pointer_args: dict[int, list[int]] = {}
        for i, (p, v) in enumerate(zip(fn.entry.params, launch.values)):
            if p.size == 8 and isinstance(v, int) and v:
                b = ctypes.c_uint64()
                if rt.sim_find(v, 1, ctypes.byref(b), None):
                    pointer_args.setdefault(b.value, []).append(i)
        touches, raw_r, raw_w = _touches(rt, pointer_args)
        append(Record("launch", fn.entry.name, fn.module.source.stem, launch.grid, launch.block, launch.shared,
                      launch.values, touches, raw_r, raw_w, stream, graph, launch.checked, time.perf_counter() - t0))
        if code:
            return _err(CUresult(code), rt.sim_error().decode(errors="replace"))
        return _ok()
    if node[0] == "memcpy":
        _, kind, d, s, n, _keep = node
        ctypes.memmove(d, s, n)
        touches = []
        if kind in ("DtoH", "DtoD"):
            touches.append(_touch_of(s, n, read=True))
        if kind in ("HtoD", "DtoD"):
            touches.append(_touch_of(d, n, read=False))
        append(Record("memcpy", kind, "", (0, 0, 0), (0, 0, 0), 0, (d, s, n), tuple(t for t in touches if t), 0, 0,
                      stream, graph, True, time.perf_counter() - t0))
        return _ok()
    if node[0] == "memset":
        _, kind, d, value, width, n = node
        if width == 1:
            ctypes.memset(d, value & 0xFF, n)
        else:
            (ctypes.c_uint32 * n).from_address(d)[:] = [value & 0xFFFFFFFF] * n
        t = _touch_of(d, n * width, read=False)
        append(Record("memset", kind, "", (0, 0, 0), (0, 0, 0), 0, (d, value, n), (t,) if t else (), 0, 0, stream,
                      graph, True, time.perf_counter() - t0))
        return _ok()
    if node[0] == "event":
        _events[node[1]] = time.perf_counter()
        return _ok()
    raise AssertionError(node[0])


def _touch_of(ptr: int, n: int, read: bool) -> Touch | None:
    b, size = ctypes.c_uint64(), ctypes.c_size_t()
    if not _runtime().sim_find(ptr, 1, ctypes.byref(b), ctypes.byref(size)):
        return None
    return Touch(b.value, size.value, n if read else 0, 0 if read else n, ())


# ---- streams, events, graphs ------------------------------------------------------------------------------


def _new_handle(table: dict, handle):
    """A fresh id entered in `table` (streams, events) as `handle`, inside a current context."""
    with _lock:
        bad = _need_context()
        if bad:
            return bad
        h = next(_ids)
        table[h] = None
        return _ok(handle(h))


def cuStreamCreate(Flags: int):
    return _new_handle(_streams, CUstream)


def cuStreamDestroy(hStream):
    with _lock:
        s = _int(hStream)
        if s == 0 or s not in _streams:
            return _err(CUresult.CUDA_ERROR_INVALID_HANDLE)
        del _streams[s]
        return _ok()


def cuStreamSynchronize(hStream):
    with _lock:
        s, bad = _stream_id(hStream)
        if bad:
            return bad
        caps = [(s, _streams[s])] if _streams[s] is not None else (_blocking_captures() if s == 0 else [])
        return _refuse_in_capture("cuStreamSynchronize", caps) or _ok()


def cuStreamQuery(hStream):
    return cuStreamSynchronize(hStream)


def cuStreamWaitEvent(hStream, hEvent, Flags: int):
    _, bad = _stream_id(hStream)
    return bad or _ok()


def cuStreamBeginCapture(hStream, mode):
    with _lock:
        s, bad = _stream_id(hStream)
        if bad:
            return bad
        if s == 0:
            return _err(CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "the legacy stream cannot be captured")
        if _streams[s] is not None:
            return _err(CUresult.CUDA_ERROR_ILLEGAL_STATE, f"stream {s:#x} is already capturing")
        _streams[s] = _Capture(int(mode), threading.get_ident())
        return _ok()


def cuStreamEndCapture(hStream):
    with _lock:
        s, bad = _stream_id(hStream)
        if bad:
            return bad
        cap = _streams[s]
        if cap is None:
            return _err(CUresult.CUDA_ERROR_ILLEGAL_STATE, f"stream {s:#x} is not capturing")
        _streams[s] = None
        if cap.invalidated:
            return _err(CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, cap.invalidated) + (CUgraph(0),)
        g = next(_ids)
        _graphs[g] = list(cap.nodes)
        return _ok(CUgraph(g))


def cuStreamIsCapturing(hStream):
    with _lock:
        s, bad = _stream_id(hStream)
        if bad:
            return bad
        cap = _streams[s]
        if cap is None:
            status = CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE
        elif cap.invalidated:
            status = CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_INVALIDATED
        else:
            status = CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE
        return _ok(status)


def cuGraphInstantiate(hGraph, flags: int = 0):
    with _lock:
        nodes = _graphs.get(_int(hGraph))
        if nodes is None:
            return _err(CUresult.CUDA_ERROR_INVALID_VALUE, f"graph {_int(hGraph):#x} does not exist")
        e = next(_ids)
        _execs[e] = list(nodes)
        return _ok(CUgraphExec(e))


def cuGraphLaunch(hGraphExec, hStream):
    with _lock:
        e = _int(hGraphExec)
        nodes = _execs.get(e)
        if nodes is None:
            return _err(CUresult.CUDA_ERROR_INVALID_HANDLE, f"graph exec {e:#x} does not exist")
        s, bad = _stream_id(hStream)
        if bad:
            return bad
        cap = _streams.get(s)
        if cap is not None:
            cap.nodes.extend(nodes)
            return _ok()
        for node in nodes:
            res = _run(node, s, e)
            if int(res[0]) != 0:
                return res
        return _ok()


def cuGraphUpload(hGraphExec, hStream):
    if _int(hGraphExec) not in _execs:
        return _err(CUresult.CUDA_ERROR_INVALID_HANDLE, f"graph exec {_int(hGraphExec):#x} does not exist")
    _, bad = _stream_id(hStream)
    return bad or _ok()


def cuGraphGetNodes(hGraph, numNodes: int = 0):
    nodes = _graphs.get(_int(hGraph))
    if nodes is None:
        return _err(CUresult.CUDA_ERROR_INVALID_VALUE)
    return _ok(None, len(nodes))


def cuGraphDestroy(hGraph):
    with _lock:
        return _ok() if _graphs.pop(_int(hGraph), None) is not None else _err(CUresult.CUDA_ERROR_INVALID_VALUE)


def cuGraphExecDestroy(hGraphExec):
    with _lock:
        return _ok() if _execs.pop(_int(hGraphExec), None) is not None else _err(CUresult.CUDA_ERROR_INVALID_VALUE)


def cuEventCreate(Flags: int):
    return _new_handle(_events, CUevent)


def cuEventDestroy(hEvent):
    with _lock:
        return _ok() if _events.pop(_int(hEvent), 0) != 0 else _err(CUresult.CUDA_ERROR_INVALID_HANDLE)


def cuEventRecord(hEvent, hStream):
    with _lock:
        e = _int(hEvent)
        if e not in _events:
            return _err(CUresult.CUDA_ERROR_INVALID_HANDLE)
        s, bad = _stream_id(hStream)
        if bad:
            return bad
        if _streams[s] is not None:
            _captured_events.add(e)
        else:
            _captured_events.discard(e)
        node = ("event", e)
        return _enqueue(s, node, "cuEventRecord") or _run(node, s, None)


def cuEventSynchronize(hEvent):
    with _lock:
        e = _int(hEvent)
        if e not in _events:
            return _err(CUresult.CUDA_ERROR_INVALID_HANDLE)
        if e in _captured_events:
            return _err(CUresult.CUDA_ERROR_CAPTURED_EVENT, "the event was last recorded in a capture")
        return _refuse_in_capture("cuEventSynchronize", _blocking_captures()) or _ok()


def cuEventQuery(hEvent):
    return cuEventSynchronize(hEvent)


def cuEventElapsedTime(hStart, hEnd):
    a, b = _events.get(_int(hStart)), _events.get(_int(hEnd))
    if a is None or b is None:
        return _err(CUresult.CUDA_ERROR_NOT_READY, "an event has not been recorded")
    return _ok((b - a) * 1000.0)
