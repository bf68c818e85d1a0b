// Affine-quantized GEMV / small GEMM for decode and verify (docs/DESIGN.md 4, turbo/store/quant.py).
// Reference: x @ dequantize(packed, scales, biases, bits, group)^T, in fp32.
//
//   w[o, i] = scale[o, i / group] * q[o, i] + bias[o, i / group]   (rounded like turbo.store.quant.dequantize)
//   y[r, o] = sum_i x[r, i] * w[o, i]
//
// q is packed little-endian into uint32 words: element i of a row sits at bits
// (i % (32 / BITS)) * BITS of word i / (32 / BITS). int4: group 64, bf16 scales / biases;
// int2 / int1: group 128, f16 (scale_kind: 0 f16, 1 bf16 — raw 16-bit storage).
// One warp per output row, QG_WARPS rows per block; QG_MAX_ROWS input rows per pass.

#define QG_WARPS 8
#define QG_MAX_ROWS 8

__device__ __forceinline__ float qg_half(unsigned short u, int kind)
{
    if (kind == 1) return __uint_as_float(((unsigned int)u) << 16);
#ifdef __CUDA_ARCH__
    float f;
    asm("{ .reg .b16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(u));
    return f;
#else  // the host build tests/test_cuda.py runs the kernels' C through
    const unsigned int sign = (u & 0x8000u) << 16, e = (u >> 10) & 31u, m = u & 1023u;
    if (e == 31u) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    if (e != 0u) return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
    const float mag = (float)m * (1.0f / 16777216.0f);  // subnormal: m * 2^-24, exact
    return sign ? -mag : mag;
#endif
}

template <int BITS>
__device__ __forceinline__ void qgemv(const float* __restrict__ x, const unsigned int* __restrict__ qw,
                                      const unsigned short* __restrict__ scales,
                                      const unsigned short* __restrict__ biases, float* __restrict__ y,
                                      int R, int in, int out, int group, int scale_kind)
{
    constexpr int PER = 32 / BITS;
    constexpr unsigned int MASK = (1u << BITS) - 1u;
    const int lane = threadIdx.x & 31;
    const int o = blockIdx.x * QG_WARPS + (threadIdx.x >> 5);
    if (o >= out) return;
    const int words = in / PER;
    const int groups = in / group;
    const unsigned int* wrow = qw + (size_t)o * words;
    for (int r0 = 0; r0 < R; r0 += QG_MAX_ROWS) {
        const int nr = min(QG_MAX_ROWS, R - r0);
        float acc[QG_MAX_ROWS];
#pragma unroll
        for (int r = 0; r < QG_MAX_ROWS; ++r) acc[r] = 0.0f;
        for (int wi = lane; wi < words; wi += 32) {
            const unsigned int word = wrow[wi];
            const int col = wi * PER;
            const int gi = col / group;
            const float s = qg_half(scales[(size_t)o * groups + gi], scale_kind);
            const float b = qg_half(biases[(size_t)o * groups + gi], scale_kind);
#pragma unroll
            for (int e = 0; e < PER; ++e) {
                const float wv = __fadd_rn(__fmul_rn((float)((word >> (e * BITS)) & MASK), s), b);
#pragma unroll
                for (int r = 0; r < QG_MAX_ROWS; ++r)
                    if (r < nr) acc[r] = fmaf(wv, x[(size_t)(r0 + r) * in + col + e], acc[r]);
            }
        }
#pragma unroll
        for (int r = 0; r < QG_MAX_ROWS; ++r) {
            float a = acc[r];
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) a += __shfl_xor_sync(0xffffffffu, a, off);
            if (lane == 0 && r < nr) y[(size_t)(r0 + r) * out + o] = a;
        }
    }
}

#define QG_ENTRY(NAME, BITS)                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * QG_WARPS)                                  \
    NAME(const float* __restrict__ x, const unsigned int* __restrict__ qw,                       \
         const unsigned short* __restrict__ scales, const unsigned short* __restrict__ biases,   \
         float* __restrict__ y, int R, int in, int out, int group, int scale_kind)               \
    {                                                                                            \
        qgemv<BITS>(x, qw, scales, biases, y, R, in, out, group, scale_kind);                    \
    }

QG_ENTRY(affine_gemv_q4_f32, 4)
QG_ENTRY(affine_gemv_q2_f32, 2)
QG_ENTRY(affine_gemv_q1_f32, 1)
