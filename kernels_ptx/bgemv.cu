// Batch-invariant products for the decode / verify regime (1..16 rows; issue #44). DEVICE-UNVERIFIED.
//
//   bf16_rows_gemv_f32:  y[r, o] = sum_i x[r, i] * w[o, i], w bf16 [out, in] as raw uint16 (the
//                        install's storage, no fp32 copy), x fp32 [R, in], y fp32 [R, out].
//   int8_rows_gemv_f32:  the same with w[o, i] = scale[o, i / group] * q[o, i] + bias[o, i / group]
//                        (turbo/quant.py "int8": uint8 levels, 4 per little-endian uint32 word,
//                        bf16 scales / biases, rounded like turbo.quant.dequantize).
//
// Every output row's value is a function of that row of x and w only, never of R: one warp per
// output row o, BG_WARPS rows o per block. Lane l owns the 16-byte chunks l, l + 32, l + 64, ...
// of w's row o (8 bf16 or 16 int8 elements each) and accumulates, per input row r, with one fmaf
// per element in chunk order then element order; the 32 lane sums meet in a fixed xor-shuffle
// tree. Input rows go in passes of up to BG_MAX_ROWS; a row's arithmetic in a pass is the same
// whether 1 or 16 rows share it (rows past R are skipped, not computed as zeros), and each pass
// reads w once. When `in` is not a multiple of the chunk (or in % 4 for int8) the whole row takes
// the scalar path, element i to lane i % 32 (still independent of R).
//
// Each kernel comes in pass sizes MAXR = 1, 4, 8, 16 (entries `..._r<MAXR>_f32`; the wrapper takes
// the smallest that holds R, 16 past that): fewer accumulators, fewer registers, more warps and
// loads in flight for decode. Only registers and the unrolling of loads differ: the per-row
// sequence of fmaf / shuffles, and so every bit of a row's result, is the same in all four.

#define BG_WARPS 8
#define BG_MAX_ROWS 16  // the largest pass

#ifndef __CUDACC__  // the host build tests/test_cuda.py runs the kernels' C through
struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
#endif

__device__ __forceinline__ float bg_bf16(unsigned int u) { return __uint_as_float(u << 16); }

// 8 weights (one chunk) against x[r, col .. col + 7] of every row r < nr: two 16-byte x loads a row
template <int MAXR>
__device__ __forceinline__ void bg_dot8(float* acc, const float* w8, const float* __restrict__ x, int in, int col,
                                        int nr)
{
#pragma unroll
    for (int r = 0; r < MAXR; ++r) {
        if (r < nr) {
            const float4* xp = reinterpret_cast<const float4*>(x + (size_t)r * in + col);
            const float4 a = xp[0], b = xp[1];
            float s = acc[r];
            s = fmaf(w8[0], a.x, s);
            s = fmaf(w8[1], a.y, s);
            s = fmaf(w8[2], a.z, s);
            s = fmaf(w8[3], a.w, s);
            s = fmaf(w8[4], b.x, s);
            s = fmaf(w8[5], b.y, s);
            s = fmaf(w8[6], b.z, s);
            s = fmaf(w8[7], b.w, s);
            acc[r] = s;
        }
    }
}

template <int MAXR>
__device__ __forceinline__ void bg_bf16_chunk(float* acc, const uint4 q, const float* __restrict__ x, int in, int c,
                                              int nr)
{
    float w8[8];
    w8[0] = bg_bf16(q.x & 0xffffu); w8[1] = __uint_as_float(q.x & 0xffff0000u);
    w8[2] = bg_bf16(q.y & 0xffffu); w8[3] = __uint_as_float(q.y & 0xffff0000u);
    w8[4] = bg_bf16(q.z & 0xffffu); w8[5] = __uint_as_float(q.z & 0xffff0000u);
    w8[6] = bg_bf16(q.w & 0xffffu); w8[7] = __uint_as_float(q.w & 0xffff0000u);
    bg_dot8<MAXR>(acc, w8, x, in, c * 8, nr);
}

template <int MAXR>
__device__ __forceinline__ void bg_reduce_store(float* acc, float* __restrict__ y, int lane, int r0, int nr, int out,
                                                int o)
{
#pragma unroll
    for (int r = 0; r < MAXR; ++r) {
        if (r < nr) {  // nr is warp-uniform: every lane takes the same shuffles
            float a = acc[r];
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) a += __shfl_xor_sync(0xffffffffu, a, off);
            if (lane == 0) y[(size_t)(r0 + r) * out + o] = a;
        }
    }
}

// 16-byte chunks in flight per lane: 4 for small passes, 2 where 16 accumulators fill the registers
#define BG_UNROLL(MAXR) ((MAXR) <= 4 ? 4 : 2)

template <int MAXR>
__device__ __forceinline__ void bf16_rows(const float* __restrict__ x, const unsigned short* __restrict__ w,
                                          float* __restrict__ y, int R, int in, int out)
{
    constexpr int U = BG_UNROLL(MAXR);
    const int lane = threadIdx.x & 31;
    const int o = blockIdx.x * BG_WARPS + (threadIdx.x >> 5);
    if (o >= out) return;
    const unsigned short* wrow = w + (size_t)o * in;
    const uint4* wv = reinterpret_cast<const uint4*>(wrow);  // 16-byte aligned when in % 8 == 0 (the wrapper)
    const int nvec = (in & 7) ? 0 : in >> 3;
    for (int r0 = 0; r0 < R; r0 += MAXR) {
        const int nr = min(MAXR, R - r0);
        const float* xr = x + (size_t)r0 * in;
        float acc[MAXR];
#pragma unroll
        for (int r = 0; r < MAXR; ++r) acc[r] = 0.0f;
        int c = lane;
        for (; c + 32 * (U - 1) < nvec; c += 32 * U) {  // U loads in flight, consumed in chunk order
            uint4 q[U];
#pragma unroll
            for (int u = 0; u < U; ++u) q[u] = wv[c + 32 * u];
#pragma unroll
            for (int u = 0; u < U; ++u) bg_bf16_chunk<MAXR>(acc, q[u], xr, in, c + 32 * u, nr);
        }
        for (; c < nvec; c += 32) bg_bf16_chunk<MAXR>(acc, wv[c], xr, in, c, nr);
        for (int i = nvec * 8 + lane; i < in; i += 32) {  // the scalar path (in % 8 != 0)
            const float wf = bg_bf16(wrow[i]);
#pragma unroll
            for (int r = 0; r < MAXR; ++r)
                if (r < nr) acc[r] = fmaf(wf, xr[(size_t)r * in + i], acc[r]);
        }
        bg_reduce_store<MAXR>(acc, y, lane, r0, nr, out, o);
    }
}

#define BG_BF16_ENTRY(MAXR)                                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * BG_WARPS)                                              \
    bf16_rows_gemv_r##MAXR##_f32(const float* __restrict__ x, const unsigned short* __restrict__ w,          \
                                 float* __restrict__ y, int R, int in, int out)                              \
    {                                                                                                        \
        bf16_rows<MAXR>(x, w, y, R, in, out);                                                                \
    }

BG_BF16_ENTRY(1)
BG_BF16_ENTRY(4)
BG_BF16_ENTRY(8)
BG_BF16_ENTRY(16)

// int8 affine: level k of a word at bits 8k; w = scale * q + bias, each rounded (quant.dequantize)
__device__ __forceinline__ float bg_level(unsigned int word, int k, float s, float b)
{
    return __fadd_rn(__fmul_rn((float)((word >> (8 * k)) & 255u), s), b);
}

template <int MAXR>
__device__ __forceinline__ void bg_int8_chunk(float* acc, const uint4 q, const unsigned short* __restrict__ srow,
                                              const unsigned short* __restrict__ brow, const float* __restrict__ x,
                                              int in, int c, int group, int nr)
{
    // a 16-element chunk lies in one group (group % 16 == 0, the wrapper)
    const int gi = (c * 16) / group;
    const float s = bg_bf16(srow[gi]), b = bg_bf16(brow[gi]);
    float w8[8];
    w8[0] = bg_level(q.x, 0, s, b); w8[1] = bg_level(q.x, 1, s, b);
    w8[2] = bg_level(q.x, 2, s, b); w8[3] = bg_level(q.x, 3, s, b);
    w8[4] = bg_level(q.y, 0, s, b); w8[5] = bg_level(q.y, 1, s, b);
    w8[6] = bg_level(q.y, 2, s, b); w8[7] = bg_level(q.y, 3, s, b);
    bg_dot8<MAXR>(acc, w8, x, in, c * 16, nr);
    w8[0] = bg_level(q.z, 0, s, b); w8[1] = bg_level(q.z, 1, s, b);
    w8[2] = bg_level(q.z, 2, s, b); w8[3] = bg_level(q.z, 3, s, b);
    w8[4] = bg_level(q.w, 0, s, b); w8[5] = bg_level(q.w, 1, s, b);
    w8[6] = bg_level(q.w, 2, s, b); w8[7] = bg_level(q.w, 3, s, b);
    bg_dot8<MAXR>(acc, w8, x, in, c * 16 + 8, nr);
}

template <int MAXR>
__device__ __forceinline__ void int8_rows(const float* __restrict__ x, const unsigned int* __restrict__ qw,
                                          const unsigned short* __restrict__ scales,
                                          const unsigned short* __restrict__ biases, float* __restrict__ y, int R,
                                          int in, int out, int group)
{
    constexpr int U = BG_UNROLL(MAXR);
    const int lane = threadIdx.x & 31;
    const int o = blockIdx.x * BG_WARPS + (threadIdx.x >> 5);
    if (o >= out) return;
    const int groups = in / group;
    const unsigned int* wrow = qw + (size_t)o * (in / 4);
    const unsigned short* srow = scales + (size_t)o * groups;
    const unsigned short* brow = biases + (size_t)o * groups;
    const uint4* wv = reinterpret_cast<const uint4*>(wrow);  // 16-byte aligned when in % 16 == 0 (the wrapper)
    const int nvec = ((in | group) & 15) ? 0 : in >> 4;  // a chunk must lie in one group
    for (int r0 = 0; r0 < R; r0 += MAXR) {
        const int nr = min(MAXR, R - r0);
        const float* xr = x + (size_t)r0 * in;
        float acc[MAXR];
#pragma unroll
        for (int r = 0; r < MAXR; ++r) acc[r] = 0.0f;
        int c = lane;
        for (; c + 32 * (U - 1) < nvec; c += 32 * U) {
            uint4 q[U];
#pragma unroll
            for (int u = 0; u < U; ++u) q[u] = wv[c + 32 * u];
#pragma unroll
            for (int u = 0; u < U; ++u) bg_int8_chunk<MAXR>(acc, q[u], srow, brow, xr, in, c + 32 * u, group, nr);
        }
        for (; c < nvec; c += 32) bg_int8_chunk<MAXR>(acc, wv[c], srow, brow, xr, in, c, group, nr);
        for (int i = nvec * 16 + lane; i < in; i += 32) {  // the scalar path (in % 16 != 0)
            const int gi = i / group;
            const float wf = bg_level(wrow[i >> 2], i & 3, bg_bf16(srow[gi]), bg_bf16(brow[gi]));
#pragma unroll
            for (int r = 0; r < MAXR; ++r)
                if (r < nr) acc[r] = fmaf(wf, xr[(size_t)r * in + i], acc[r]);
        }
        bg_reduce_store<MAXR>(acc, y, lane, r0, nr, out, o);
    }
}

#define BG_INT8_ENTRY(MAXR)                                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * BG_WARPS)                                              \
    int8_rows_gemv_r##MAXR##_f32(const float* __restrict__ x, const unsigned int* __restrict__ qw,           \
                                 const unsigned short* __restrict__ scales,                                  \
                                 const unsigned short* __restrict__ biases, float* __restrict__ y, int R,    \
                                 int in, int out, int group)                                                 \
    {                                                                                                        \
        int8_rows<MAXR>(x, qw, scales, biases, y, R, in, out, group);                                        \
    }

BG_INT8_ENTRY(1)
BG_INT8_ENTRY(4)
BG_INT8_ENTRY(8)
BG_INT8_ENTRY(16)
