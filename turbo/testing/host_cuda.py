"""The kernels' own CUDA C, compiled for the host with g++ against a small SIMT shim (HOST_SHIM):
one OS thread per CUDA thread, a block at a time; __syncthreads is a block barrier, warp shuffles
go through a per-warp exchange and barrier, __shared__ is block-static. fmul / fadd stay
separately rounded (-ffp-contract=off; fmaf is libm's exact one), so this runs the very index
math, reductions, barriers and merge logic the PTX was built from. A divergent barrier shows up
as a deadlock (a timeout). tests/test_cuda.py and tests/test_cuda_step.py launch through it
(`HostCompiled.launch` takes cuda_kernels.Kernels.launch's arguments, ctypes values whose
pointers are host addresses); every launch's arguments are checked against the PTX entry's
parameter list first (`ptx_params`).
"""

from __future__ import annotations

import ctypes
import re
import subprocess
import threading
from pathlib import Path

from turbo.backends import cuda_kernels as ck

PTX_TYPES = {ctypes.c_void_p: ".u64", ctypes.c_int32: ".u32", ctypes.c_float: ".f32"}


def ptx_params(module: str, kernel: str) -> list[str]:
    """The PTX types of `kernel`'s parameters, in order (from the checked-in sm_90 PTX)."""
    text = (ck.ptx_dir() / f"{module}.sm_90.ptx").read_text()
    body = re.search(rf"\.entry {kernel}\((.*?)\)", text, re.S).group(1)
    return re.findall(r"\.param (\.\w+) ", body)


def ptx_entries(module: str) -> list[str]:
    """Every kernel entry of a module's PTX."""
    return re.findall(r"\.visible \.entry (\w+)\(", (ck.ptx_dir() / f"{module}.sm_90.ptx").read_text())


HOST_SHIM = r"""
#include <math.h>
#include <string.h>
#include <stddef.h>
#include <pthread.h>
#include <algorithm>
struct emu_dim3 { unsigned x, y, z; };
static thread_local emu_dim3 threadIdx, blockIdx;
static emu_dim3 blockDim, gridDim;
static pthread_barrier_t emu_block_bar, emu_warp_bar[32];
static bool emu_ready = false;
static unsigned emu_xchg[32][32];
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
using std::min;
static inline unsigned emu_tid() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }
static inline void __syncthreads() { pthread_barrier_wait(&emu_block_bar); }
static inline void __threadfence() { __sync_synchronize(); }
static inline unsigned emu_shfl(unsigned v, int off) {
    const unsigned t = emu_tid(), w = t / 32, l = t % 32;
    emu_xchg[w][l] = v;
    pthread_barrier_wait(&emu_warp_bar[w]);
    const unsigned r = emu_xchg[w][l ^ off];
    pthread_barrier_wait(&emu_warp_bar[w]);
    return r;
}
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
static inline float __shfl_xor_sync(unsigned, float v, int off) {
    unsigned u; memcpy(&u, &v, 4); return __uint_as_float(emu_shfl(u, off)); }
static inline int __shfl_xor_sync(unsigned, int v, int off) { return (int)emu_shfl((unsigned)v, off); }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
template <class T> static inline T __ldcg(const T* p) { return *(const volatile T*)p; }
static inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
extern "C" void emu_launch(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz) {
    if (emu_ready) { pthread_barrier_destroy(&emu_block_bar); for (int w = 0; w < 32; ++w) pthread_barrier_destroy(&emu_warp_bar[w]); }
    gridDim = {gx, gy, gz}; blockDim = {bx, by, bz};
    pthread_barrier_init(&emu_block_bar, nullptr, bx * by * bz);
    for (int w = 0; w < 32; ++w) pthread_barrier_init(&emu_warp_bar[w], nullptr, 32);
    emu_ready = true;
}
extern "C" void emu_enter(unsigned bx, unsigned by, unsigned bz, unsigned tx, unsigned ty, unsigned tz) {
    blockIdx = {bx, by, bz}; threadIdx = {tx, ty, tz};
}
"""


HOST_RUNNER = r"""
#include <thread>
#include <utility>
#include <vector>
template <class... A, size_t... I>
static void emu_call_i(void (*f)(A...), void** a, std::index_sequence<I...>) { f(*(A*)a[I]...); }
template <class... A>
static void emu_call(void (*f)(A...), void** a) { emu_call_i(f, a, std::index_sequence_for<A...>{}); }
extern "C" void emu_run(void (*tramp)(void**), void** a, unsigned gx, unsigned gy, unsigned gz,
                        unsigned bx, unsigned by, unsigned bz) {
    emu_launch(gx, gy, gz, bx, by, bz);
    for (unsigned z = 0; z < gz; ++z) for (unsigned y = 0; y < gy; ++y) for (unsigned x = 0; x < gx; ++x) {
        std::vector<std::thread> ts;
        for (unsigned tz = 0; tz < bz; ++tz) for (unsigned ty = 0; ty < by; ++ty) for (unsigned tx = 0; tx < bx; ++tx)
            ts.emplace_back([=] { emu_enter(x, y, z, tx, ty, tz); tramp(a); });
        for (auto& t : ts) t.join();
    }
}
"""


class HostCompiled:
    """Launches go to the kernels' CUDA C built for the host (see HOST_SHIM); one library per
    module, built on first use into `build_dir` with a trampoline for every entry of its PTX."""

    def __init__(self, build_dir: Path):
        self.dir, self.libs, self.launches = Path(build_dir), {}, []
        self.dir.mkdir(parents=True, exist_ok=True)

    def lib(self, module: str):
        if module not in self.libs:
            shim = self.dir / "shim.h"
            shim.write_text(HOST_SHIM)
            src = self.dir / f"{module}_host.cpp"
            src.write_text(f'#include "{shim}"\n#include "{ck.ptx_dir() / (module + ".cu")}"\n' + HOST_RUNNER +
                           "".join(f'extern "C" void emu_tramp_{k}(void** a) {{ emu_call({k}, a); }}\n'
                                   for k in ptx_entries(module)))
            so = self.dir / f"{module}.so"
            res = subprocess.run(["g++", "-std=c++17", "-O1", "-ffp-contract=off", "-fPIC", "-shared", str(src),
                                  "-o", str(so), "-lpthread"], capture_output=True, text=True, timeout=300)
            if res.returncode != 0:
                raise RuntimeError(res.stderr)
            self.libs[module] = ctypes.CDLL(str(so))
        return self.libs[module]

    def launch(self, module, kernel, grid, block, args, shared=0, stream=None):
        got = [PTX_TYPES[type(a)] for a in args]
        want = ptx_params(module, kernel)
        if got != want:
            raise AssertionError(f"{kernel}: arguments {got} against the PTX entry's {want}")
        self.launches.append(kernel)
        lib = self.lib(module)
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        bx, by, bz = (tuple(block) + (1, 1))[:3]
        assert (bx * by * bz) % 32 == 0 and bx * by * bz <= 1024
        params = (ctypes.c_void_p * max(1, len(args)))(*[ctypes.addressof(a) for a in args])
        tramp = ctypes.cast(getattr(lib, f"emu_tramp_{kernel}"), ctypes.c_void_p)
        run = threading.Thread(target=lib.emu_run, args=(tramp, params, *(ctypes.c_uint(v) for v in
                                                                           (gx, gy, gz, bx, by, bz))), daemon=True)
        run.start()
        run.join(timeout=120)
        if run.is_alive():
            raise AssertionError(f"{kernel} deadlocked (a __syncthreads or shuffle not reached by all threads?)")


class HostDevice(HostCompiled):
    """The CUDA step's device on the host: cuda_kernels.Kernels' memory calls (alloc, free,
    htod, dtoh, dtod, memset, stream, sync) over host memory, its launches through the
    kernels' CUDA C (HostCompiled). A pointer is a host address; every allocation is kept
    until freed, and `allocated` counts the bytes held (the step allocates at open)."""

    def __init__(self, build_dir: Path):
        super().__init__(build_dir)
        self._bufs: dict[int, ctypes.Array] = {}
        self.allocated = 0

    def alloc(self, nbytes: int) -> int:
        n = max(1, int(nbytes)) + 255
        buf = (ctypes.c_char * n)()
        ptr = (ctypes.addressof(buf) + 255) & ~255  # cuMemAlloc's alignment (the vector loads need 16)
        self._bufs[ptr] = buf
        self.allocated += n
        return ptr

    def free(self, ptr: int) -> None:
        self.allocated -= len(self._bufs.pop(int(ptr)))

    def htod(self, dst: int, src: int, nbytes: int, stream=None) -> None:
        ctypes.memmove(int(dst), int(src), int(nbytes))

    dtoh = dtod = htod

    def memset(self, dst: int, nbytes: int, value: int = 0, stream=None) -> None:
        ctypes.memset(int(dst), int(value), int(nbytes))

    def stream(self) -> int:
        return 0

    def sync(self, stream=None) -> None:
        pass


# The same SIMT model on fibers (ucontext): one OS thread runs every CUDA thread of a block as a
# fiber, a barrier (block or warp) a switch back to a round-robin scheduler. Some hundred times
# faster than an OS thread per CUDA thread on a busy machine (no kernel wake-ups), the same
# semantics; a divergent barrier ends the launch with an error (no fiber can progress).
FIBER_SHIM = r"""
#include <math.h>
#include <string.h>
#include <stddef.h>
#include <stdlib.h>
#include <ucontext.h>
#include <algorithm>
struct emu_dim3 { unsigned x, y, z; };
static emu_dim3 threadIdx, blockIdx, blockDim, gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
using std::min;
struct EmuFiber { ucontext_t ctx; emu_dim3 tid; int done, waiting; };
static EmuFiber* emu_f = nullptr;
static char* emu_stacks = nullptr;
static int emu_n = 0, emu_cur = 0, emu_progress = 0;
static ucontext_t emu_sched;
static unsigned emu_bar_count = 0, emu_bar_gen = 0, emu_w_count[32], emu_w_gen[32];
static unsigned emu_xchg[32][32];
static const size_t EMU_STACK = 256 * 1024;
static inline void emu_yield() { swapcontext(&emu_f[emu_cur].ctx, &emu_sched); }
static inline unsigned emu_tid() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }
static inline void __syncthreads() {
    const unsigned gen = emu_bar_gen;
    if (++emu_bar_count == (unsigned)emu_n) { emu_bar_count = 0; ++emu_bar_gen; emu_progress = 1; return; }
    emu_f[emu_cur].waiting = 1;
    while (emu_bar_gen == gen) emu_yield();
    emu_f[emu_cur].waiting = 0;
}
static inline void emu_warp_bar(unsigned w) {
    const unsigned gen = emu_w_gen[w];
    if (++emu_w_count[w] == 32) { emu_w_count[w] = 0; ++emu_w_gen[w]; emu_progress = 1; return; }
    emu_f[emu_cur].waiting = 1;
    while (emu_w_gen[w] == gen) emu_yield();
    emu_f[emu_cur].waiting = 0;
}
static inline void __threadfence() {}
static inline unsigned emu_shfl(unsigned v, int off) {
    const unsigned t = emu_tid(), w = t / 32, l = t % 32;
    emu_xchg[w][l] = v;
    emu_warp_bar(w);
    const unsigned r = emu_xchg[w][l ^ off];
    emu_warp_bar(w);
    return r;
}
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
static inline float __shfl_xor_sync(unsigned, float v, int off) {
    unsigned u; memcpy(&u, &v, 4); return __uint_as_float(emu_shfl(u, off)); }
static inline int __shfl_xor_sync(unsigned, int v, int off) { return (int)emu_shfl((unsigned)v, off); }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
template <class T> static inline T __ldcg(const T* p) { return *(const volatile T*)p; }
static inline unsigned atomicAdd(unsigned* p, unsigned v) { unsigned o = *p; *p = o + v; return o; }
"""

FIBER_RUNNER = r"""
#include <utility>
template <class... A, size_t... I>
static void emu_call_i(void (*f)(A...), void** a, std::index_sequence<I...>) { f(*(A*)a[I]...); }
template <class... A>
static void emu_call(void (*f)(A...), void** a) { emu_call_i(f, a, std::index_sequence_for<A...>{}); }
static void (*emu_tramp_now)(void**);
static void** emu_args_now;
static void emu_body() { emu_tramp_now(emu_args_now); emu_f[emu_cur].done = 1; emu_progress = 1; }
// 0: ran; 1: a barrier no fiber could pass (divergent)
extern "C" int emu_run(void (*tramp)(void**), void** a, unsigned gx, unsigned gy, unsigned gz,
                       unsigned bx, unsigned by, unsigned bz) {
    gridDim = {gx, gy, gz}; blockDim = {bx, by, bz};
    const int n = (int)(bx * by * bz);
    if (n > emu_n || emu_f == nullptr) {
        free(emu_f); free(emu_stacks);
        emu_f = (EmuFiber*)calloc(n, sizeof(EmuFiber));
        emu_stacks = (char*)malloc(EMU_STACK * (size_t)n);
    }
    emu_n = n;
    emu_tramp_now = tramp; emu_args_now = a;
    for (unsigned z = 0; z < gz; ++z) for (unsigned y = 0; y < gy; ++y) for (unsigned x = 0; x < gx; ++x) {
        blockIdx = {x, y, z};
        emu_bar_count = 0; memset(emu_w_count, 0, sizeof emu_w_count);
        int t = 0;
        for (unsigned tz = 0; tz < bz; ++tz) for (unsigned ty = 0; ty < by; ++ty) for (unsigned tx = 0; tx < bx; ++tx, ++t) {
            EmuFiber& f = emu_f[t];
            f.tid = {tx, ty, tz}; f.done = 0; f.waiting = 0;
            getcontext(&f.ctx);
            f.ctx.uc_stack.ss_sp = emu_stacks + EMU_STACK * (size_t)t;
            f.ctx.uc_stack.ss_size = EMU_STACK;
            f.ctx.uc_link = &emu_sched;
            makecontext(&f.ctx, emu_body, 0);
        }
        for (int left = n; left > 0;) {
            emu_progress = 0;
            left = 0;
            for (int i = 0; i < n; ++i) {
                if (emu_f[i].done) continue;
                emu_cur = i; threadIdx = emu_f[i].tid;
                swapcontext(&emu_sched, &emu_f[i].ctx);
                left += !emu_f[i].done;
            }
            if (left > 0 && !emu_progress) {
                // every live fiber waits and none arrived anew in a whole round: a divergent barrier
                bool all_wait = true;
                for (int i = 0; i < n; ++i) if (!emu_f[i].done && !emu_f[i].waiting) all_wait = false;
                if (all_wait) return 1;
            }
        }
    }
    return 0;
}
"""


class HostFibers(HostDevice):
    """HostDevice whose launches run on fibers (FIBER_SHIM): the same kernels' C, the same
    barriers and shuffles, one OS thread; what the CUDA step's tests run on."""

    def lib(self, module: str):
        if module not in self.libs:
            shim = self.dir / "fiber_shim.h"
            shim.write_text(FIBER_SHIM)
            src = self.dir / f"{module}_fibers.cpp"
            src.write_text(f'#include "{shim}"\n#include "{ck.ptx_dir() / (module + ".cu")}"\n' + FIBER_RUNNER +
                           "".join(f'extern "C" void emu_tramp_{k}(void** a) {{ emu_call({k}, a); }}\n'
                                   for k in ptx_entries(module)))
            so = self.dir / f"{module}_fibers.so"
            res = subprocess.run(["g++", "-std=c++17", "-O1", "-ffp-contract=off", "-fPIC", "-shared", str(src),
                                  "-o", str(so)], capture_output=True, text=True, timeout=300)
            if res.returncode != 0:
                raise RuntimeError(res.stderr)
            lib = ctypes.CDLL(str(so))
            lib.emu_run.restype = ctypes.c_int
            self.libs[module] = lib
        return self.libs[module]

    def launch(self, module, kernel, grid, block, args, shared=0, stream=None):
        got = [PTX_TYPES[type(a)] for a in args]
        want = ptx_params(module, kernel)
        if got != want:
            raise AssertionError(f"{kernel}: arguments {got} against the PTX entry's {want}")
        self.launches.append(kernel)
        lib = self.lib(module)
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        bx, by, bz = (tuple(block) + (1, 1))[:3]
        assert (bx * by * bz) % 32 == 0 and bx * by * bz <= 1024
        params = (ctypes.c_void_p * max(1, len(args)))(*[ctypes.addressof(a) for a in args])
        tramp = ctypes.cast(getattr(lib, f"emu_tramp_{kernel}"), ctypes.c_void_p)
        if lib.emu_run(tramp, params, *(ctypes.c_uint(v) for v in (gx, gy, gz, bx, by, bz))):
            raise AssertionError(f"{kernel}: a barrier not reached by every thread of its block (divergent)")
