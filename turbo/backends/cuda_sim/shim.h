// CUDA C on the simulated device (turbo/backends/cuda_sim): included before a kernels_ptx/*.cu
// file, which is then compiled for the host by g++ with -ffp-contract=off (fmul / fadd rounded
// separately, as __fmul_rn / __fadd_rn and the PTX's mul.rn / add.rn) and TSan instrumentation
// (runtime.cpp counts the bytes each launch reads and writes through it).
//
// __CUDACC__ is defined (this is CUDA C), __CUDA_ARCH__ is not (this is not the device compiler's
// pass: `#ifdef __CUDA_ARCH__` inline PTX takes its host fallback). The CUDA vector types come
// from here. Thread / block indices, barriers and warp operations go to runtime.cpp's fibers.
// Known differences from the device: transcendental functions (expf, logf, rsqrtf, __expf, ...)
// are the host's libm, not the device's approximations, so they may differ in the last bits;
// a plain `a * b + c` is two roundings here but nvcc may contract it to one fma (write fmaf or
// __fmul_rn / __fadd_rn where bits matter).

#pragma once
#define __CUDACC__ 1
#define TURBO_CUDA_SIM 1

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

struct dim3 {
    unsigned x, y, z;
};
typedef dim3 uint3;

extern "C" {
dim3 sim_thread_idx();
dim3 sim_block_idx();
dim3 sim_block_dim();
dim3 sim_grid_dim();
void* sim_dyn_smem();
void sim_syncthreads(int line);
int sim_syncthreads_op(int line, int op, int pred);
unsigned long long sim_warp_op(int op, unsigned mask, unsigned long long value, int arg, int width);
}

#define threadIdx (sim_thread_idx())
#define blockIdx (sim_block_idx())
#define blockDim (sim_block_dim())
#define gridDim (sim_grid_dim())
#define warpSize 32

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __shared__ static
#define __constant__ static
#define __managed__
#define __align__(n) alignas(n)

// ---- vector types --------------------------------------------------------------------------------
#define SIM_VEC4(T, N, A) \
    struct alignas(A) N##4 { T x, y, z, w; }; \
    static inline N##4 make_##N##4(T x, T y, T z, T w) { return N##4{x, y, z, w}; }
#define SIM_VEC2(T, N, A) \
    struct alignas(A) N##2 { T x, y; }; \
    static inline N##2 make_##N##2(T x, T y) { return N##2{x, y}; }
SIM_VEC4(float, float, 16)
SIM_VEC4(int, int, 16)
SIM_VEC4(unsigned int, uint, 16)
SIM_VEC2(float, float, 8)
SIM_VEC2(int, int, 8)
SIM_VEC2(unsigned int, uint, 8)
struct ushort2 { unsigned short x, y; };
struct alignas(8) ushort4 { unsigned short x, y, z, w; };

// ---- barriers and warp operations (runtime.cpp) -----------------------------------------------------
#define __syncthreads() sim_syncthreads(__LINE__)
#define __syncthreads_count(p) sim_syncthreads_op(__LINE__, 1, (p))
#define __syncthreads_and(p) sim_syncthreads_op(__LINE__, 2, (p))
#define __syncthreads_or(p) sim_syncthreads_op(__LINE__, 3, (p))
static inline void __threadfence() {}
static inline void __threadfence_block() {}
static inline void __syncwarp(unsigned mask = 0xffffffffu) { sim_warp_op(0, mask, 0, 0, 32); }

template <class T>
static inline unsigned long long sim_bits(T v) {
    static_assert(sizeof(T) <= 8, "warp shuffles move 4 or 8 bytes");
    unsigned long long u = 0;
    __builtin_memcpy(&u, &v, sizeof(T));
    return u;
}
template <class T>
static inline T sim_from(unsigned long long u) {
    T v;
    __builtin_memcpy(&v, &u, sizeof(T));
    return v;
}
template <class T>
static inline T __shfl_sync(unsigned m, T v, int src, int w = 32) { return sim_from<T>(sim_warp_op(1, m, sim_bits(v), src, w)); }
template <class T>
static inline T __shfl_up_sync(unsigned m, T v, unsigned d, int w = 32) { return sim_from<T>(sim_warp_op(2, m, sim_bits(v), (int)d, w)); }
template <class T>
static inline T __shfl_down_sync(unsigned m, T v, unsigned d, int w = 32) { return sim_from<T>(sim_warp_op(3, m, sim_bits(v), (int)d, w)); }
template <class T>
static inline T __shfl_xor_sync(unsigned m, T v, int x, int w = 32) { return sim_from<T>(sim_warp_op(4, m, sim_bits(v), x, w)); }
static inline unsigned __ballot_sync(unsigned m, int p) { return (unsigned)sim_warp_op(5, m, p != 0, 0, 32); }
static inline int __any_sync(unsigned m, int p) { return (int)sim_warp_op(6, m, p != 0, 0, 32); }
static inline int __all_sync(unsigned m, int p) { return (int)sim_warp_op(7, m, p != 0, 0, 32); }

// ---- arithmetic -------------------------------------------------------------------------------------
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline float __frcp_rn(float a) { return 1.0f / a; }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline float __fdividef(float a, float b) { return a / b; }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
// the fast intrinsics (glibc declares functions of these names: macros, not definitions)
#define __expf(x) expf(x)
#define __logf(x) logf(x)
#define __sinf(x) sinf(x)
#define __cosf(x) cosf(x)
#define __powf(a, b) powf(a, b)
static inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
static inline float __int_as_float(int i) { return sim_from<float>((unsigned)i); }
static inline int __float_as_int(float f) { return (int)(unsigned)sim_bits(f); }
static inline float __uint_as_float(unsigned u) { return sim_from<float>(u); }
static inline unsigned __float_as_uint(float f) { return (unsigned)sim_bits(f); }
static inline int __float2int_rn(float f) { return (int)nearbyintf(f); }
static inline int __float2int_rz(float f) { return (int)f; }
static inline float __int2float_rn(int i) { return (float)i; }
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static inline int __clz(unsigned x) { return x ? __builtin_clz(x) : 32; }
static inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
static inline unsigned __brev(unsigned x) {
    unsigned r = 0;
    for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}

#define SIM_MINMAX(T) \
    static inline T min(T a, T b) { return b < a ? b : a; } \
    static inline T max(T a, T b) { return a < b ? b : a; }
SIM_MINMAX(int)
SIM_MINMAX(unsigned)
SIM_MINMAX(long long)
SIM_MINMAX(unsigned long long)
SIM_MINMAX(long)
SIM_MINMAX(unsigned long)
SIM_MINMAX(float)
SIM_MINMAX(double)
static inline unsigned min(int a, unsigned b) { return min((unsigned)a, b); }
static inline unsigned min(unsigned a, int b) { return min(a, (unsigned)b); }
static inline unsigned max(int a, unsigned b) { return max((unsigned)a, b); }
static inline unsigned max(unsigned a, int b) { return max(a, (unsigned)b); }

// ---- loads and atomics (plain accesses: the instrumentation counts them; one OS thread runs
// every fiber and switches only at barriers and warp ops, so read-modify-write is atomic) -----------
template <class T> static inline T __ldg(const T* p) { return *p; }
template <class T> static inline T __ldcg(const T* p) { return *(const volatile T*)p; }
template <class T> static inline T __ldca(const T* p) { return *p; }
template <class T> static inline T __ldcs(const T* p) { return *p; }
template <class T> static inline T __ldlu(const T* p) { return *p; }
template <class T> static inline T __ldcv(const T* p) { return *(const volatile T*)p; }
template <class T> static inline void __stcg(T* p, T v) { *p = v; }
template <class T> static inline void __stcs(T* p, T v) { *p = v; }
template <class T> static inline void __stwt(T* p, T v) { *p = v; }
template <class T> static inline T atomicAdd(T* p, T v) { T o = *p; *p = o + v; return o; }
template <class T> static inline T atomicSub(T* p, T v) { T o = *p; *p = o - v; return o; }
template <class T> static inline T atomicExch(T* p, T v) { T o = *p; *p = v; return o; }
template <class T> static inline T atomicMax(T* p, T v) { T o = *p; *p = o < v ? v : o; return o; }
template <class T> static inline T atomicMin(T* p, T v) { T o = *p; *p = v < o ? v : o; return o; }
template <class T> static inline T atomicOr(T* p, T v) { T o = *p; *p = o | v; return o; }
template <class T> static inline T atomicAnd(T* p, T v) { T o = *p; *p = o & v; return o; }
template <class T> static inline T atomicXor(T* p, T v) { T o = *p; *p = o ^ v; return o; }
template <class T> static inline T atomicCAS(T* p, T cmp, T v) { T o = *p; if (o == cmp) *p = v; return o; }
static inline unsigned atomicInc(unsigned* p, unsigned lim) { unsigned o = *p; *p = o >= lim ? 0u : o + 1u; return o; }
