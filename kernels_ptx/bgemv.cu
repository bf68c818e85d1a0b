// Batch-invariant products for the decode / verify regime (1..16 rows; issue #44). DEVICE-UNVERIFIED.
//
//   bf16_rows_gemv_f32:  y[r, o] = sum_i x[r, i] * w[o, i], w bf16 [out, in] as raw uint16 (the
//                        install's storage, no fp32 copy), x fp32 [R, in], y fp32 [R, out].
//   int8_rows_gemv_f32:  the same with w[o, i] = scale[o, i / group] * q[o, i] + bias[o, i / group]
//                        (turbo/store/quant.py "int8": uint8 levels, 4 per little-endian uint32 word,
//                        bf16 scales / biases, rounded like turbo.store.quant.dequantize).
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
// loads in flight for decode. A warp of the larger passes computes OW output rows o at once
// (BG_OW: 1, 4, 2, 2), each x load serving OW weight rows (x is re-read from L1 once per chunk
// and row; OW cuts that traffic). Only registers, the unrolling of loads and OW differ: the
// per-(output, input)-row sequence of fmaf / shuffles, and so every bit of a row's result, is the
// same in all four.

#define BG_WARPS 8
#define BG_MAX_ROWS 16  // the largest pass
// outputs per warp and 16-byte chunks in flight per (lane, output) for pass size MAXR
#define BG_OW(MAXR) ((MAXR) == 1 ? 1 : (MAXR) == 4 ? 4 : 2)  // a tuning knob for the device
#define BG_UNROLL(MAXR) ((MAXR) == 1 ? 4 : 1)

#ifndef __CUDACC__  // the host build tests/test_cuda.py runs the kernels' C through
struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
#endif

__device__ __forceinline__ float bg_bf16(unsigned int u) { return __uint_as_float(u << 16); }

// 8 weights of each of the warp's ow outputs against x[r, col .. col + 7] of every row r < nr:
// two 16-byte x loads a row, shared by the outputs
template <int MAXR, int OW>
__device__ __forceinline__ void bg_dot8(float (*acc)[MAXR], const float (*w8)[8], int ow,
                                        const float* __restrict__ x, int in, int col, int nr)
{
#pragma unroll
    for (int r = 0; r < MAXR; ++r) {
        if (r < nr) {
            const float4* xp = reinterpret_cast<const float4*>(x + (size_t)r * in + col);
            const float4 a = xp[0], b = xp[1];
#pragma unroll
            for (int j = 0; j < OW; ++j) {
                if (j < ow) {
                    float s = acc[j][r];
                    s = fmaf(w8[j][0], a.x, s);
                    s = fmaf(w8[j][1], a.y, s);
                    s = fmaf(w8[j][2], a.z, s);
                    s = fmaf(w8[j][3], a.w, s);
                    s = fmaf(w8[j][4], b.x, s);
                    s = fmaf(w8[j][5], b.y, s);
                    s = fmaf(w8[j][6], b.z, s);
                    s = fmaf(w8[j][7], b.w, s);
                    acc[j][r] = s;
                }
            }
        }
    }
}

template <int MAXR, int OW>
__device__ __forceinline__ void bg_reduce_store(float (*acc)[MAXR], float* __restrict__ y, int lane, int r0, int nr,
                                                int out, int o0, int ow)
{
#pragma unroll
    for (int j = 0; j < OW; ++j) {
#pragma unroll
        for (int r = 0; r < MAXR; ++r) {
            if (j < ow && r < nr) {  // ow, nr are warp-uniform: every lane takes the same shuffles
                float a = acc[j][r];
#pragma unroll
                for (int off = 16; off > 0; off >>= 1) a += __shfl_xor_sync(0xffffffffu, a, off);
                if (lane == 0) y[(size_t)(r0 + r) * out + o0 + j] = a;
            }
        }
    }
}

template <int MAXR, int OW>
__device__ __forceinline__ void bg_bf16_chunk(float (*acc)[MAXR], const uint4* q, int ow, const float* __restrict__ x,
                                              int in, int c, int nr)
{
    float w8[OW][8];
#pragma unroll
    for (int j = 0; j < OW; ++j) {
        w8[j][0] = bg_bf16(q[j].x & 0xffffu); w8[j][1] = __uint_as_float(q[j].x & 0xffff0000u);
        w8[j][2] = bg_bf16(q[j].y & 0xffffu); w8[j][3] = __uint_as_float(q[j].y & 0xffff0000u);
        w8[j][4] = bg_bf16(q[j].z & 0xffffu); w8[j][5] = __uint_as_float(q[j].z & 0xffff0000u);
        w8[j][6] = bg_bf16(q[j].w & 0xffffu); w8[j][7] = __uint_as_float(q[j].w & 0xffff0000u);
    }
    bg_dot8<MAXR, OW>(acc, w8, ow, x, in, c * 8, nr);
}

template <int MAXR>
__device__ __forceinline__ void bf16_rows(const float* __restrict__ x, const unsigned short* __restrict__ w,
                                          float* __restrict__ y, int R, int in, int out)
{
    constexpr int OW = BG_OW(MAXR), U = BG_UNROLL(MAXR);
    const int lane = threadIdx.x & 31;
    const int o0 = (blockIdx.x * BG_WARPS + (threadIdx.x >> 5)) * OW;
    if (o0 >= out) return;
    const int ow = min(OW, out - o0);
    const int nvec = (in & 7) ? 0 : in >> 3;
    // row o's 16-byte chunks: aligned when in % 8 == 0 (the wrapper aligns w)
    const uint4* wv = reinterpret_cast<const uint4*>(w + (size_t)o0 * in);
    const int vstride = in >> 3;
    for (int r0 = 0; r0 < R; r0 += MAXR) {
        const int nr = min(MAXR, R - r0);
        const float* xr = x + (size_t)r0 * in;
        float acc[OW][MAXR];
#pragma unroll
        for (int j = 0; j < OW; ++j)
#pragma unroll
            for (int r = 0; r < MAXR; ++r) acc[j][r] = 0.0f;
        int c = lane;
        for (; c + 32 * (U - 1) < nvec; c += 32 * U) {  // U * ow loads in flight, consumed in chunk order
            uint4 q[U][OW];
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int j = 0; j < OW; ++j)
                    if (j < ow) q[u][j] = wv[(size_t)j * vstride + c + 32 * u];
#pragma unroll
            for (int u = 0; u < U; ++u) bg_bf16_chunk<MAXR, OW>(acc, q[u], ow, xr, in, c + 32 * u, nr);
        }
        for (; c < nvec; c += 32) {
            uint4 q[OW];
#pragma unroll
            for (int j = 0; j < OW; ++j)
                if (j < ow) q[j] = wv[(size_t)j * vstride + c];
            bg_bf16_chunk<MAXR, OW>(acc, q, ow, xr, in, c, nr);
        }
        for (int i = nvec * 8 + lane; i < in; i += 32) {  // the scalar path (in % 8 != 0)
#pragma unroll
            for (int j = 0; j < OW; ++j) {
                if (j < ow) {
                    const float wf = bg_bf16(w[(size_t)(o0 + j) * in + i]);
#pragma unroll
                    for (int r = 0; r < MAXR; ++r)
                        if (r < nr) acc[j][r] = fmaf(wf, xr[(size_t)r * in + i], acc[j][r]);
                }
            }
        }
        bg_reduce_store<MAXR, OW>(acc, y, lane, r0, nr, out, o0, ow);
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

// one 16-level chunk of each output (a chunk lies in one group: group % 16 == 0, else the scalar path)
template <int MAXR, int OW>
__device__ __forceinline__ void bg_int8_chunk(float (*acc)[MAXR], const uint4* q, int ow,
                                              const unsigned short* __restrict__ scales,
                                              const unsigned short* __restrict__ biases, int o0, int groups,
                                              const float* __restrict__ x, int in, int c, int group, int nr)
{
    const int gi = (c * 16) / group;
    float s[OW], b[OW], w8[OW][8];
#pragma unroll
    for (int j = 0; j < OW; ++j) {
        s[j] = b[j] = 0.0f;
        if (j < ow) {
            s[j] = bg_bf16(scales[(size_t)(o0 + j) * groups + gi]);
            b[j] = bg_bf16(biases[(size_t)(o0 + j) * groups + gi]);
        }
    }
#pragma unroll
    for (int j = 0; j < OW; ++j) {
        w8[j][0] = bg_level(q[j].x, 0, s[j], b[j]); w8[j][1] = bg_level(q[j].x, 1, s[j], b[j]);
        w8[j][2] = bg_level(q[j].x, 2, s[j], b[j]); w8[j][3] = bg_level(q[j].x, 3, s[j], b[j]);
        w8[j][4] = bg_level(q[j].y, 0, s[j], b[j]); w8[j][5] = bg_level(q[j].y, 1, s[j], b[j]);
        w8[j][6] = bg_level(q[j].y, 2, s[j], b[j]); w8[j][7] = bg_level(q[j].y, 3, s[j], b[j]);
    }
    bg_dot8<MAXR, OW>(acc, w8, ow, x, in, c * 16, nr);
#pragma unroll
    for (int j = 0; j < OW; ++j) {
        w8[j][0] = bg_level(q[j].z, 0, s[j], b[j]); w8[j][1] = bg_level(q[j].z, 1, s[j], b[j]);
        w8[j][2] = bg_level(q[j].z, 2, s[j], b[j]); w8[j][3] = bg_level(q[j].z, 3, s[j], b[j]);
        w8[j][4] = bg_level(q[j].w, 0, s[j], b[j]); w8[j][5] = bg_level(q[j].w, 1, s[j], b[j]);
        w8[j][6] = bg_level(q[j].w, 2, s[j], b[j]); w8[j][7] = bg_level(q[j].w, 3, s[j], b[j]);
    }
    bg_dot8<MAXR, OW>(acc, w8, ow, x, in, c * 16 + 8, nr);
}

template <int MAXR>
__device__ __forceinline__ void int8_rows(const float* __restrict__ x, const unsigned int* __restrict__ qw,
                                          const unsigned short* __restrict__ scales,
                                          const unsigned short* __restrict__ biases, float* __restrict__ y, int R,
                                          int in, int out, int group)
{
    constexpr int OW = BG_OW(MAXR), U = BG_UNROLL(MAXR);
    const int lane = threadIdx.x & 31;
    const int o0 = (blockIdx.x * BG_WARPS + (threadIdx.x >> 5)) * OW;
    if (o0 >= out) return;
    const int ow = min(OW, out - o0);
    const int groups = in / group;
    const int words = in / 4;
    const uint4* wv = reinterpret_cast<const uint4*>(qw + (size_t)o0 * words);  // aligned when in % 16 == 0
    const int vstride = in >> 4;
    const int nvec = ((in | group) & 15) ? 0 : in >> 4;  // a chunk must lie in one group
    for (int r0 = 0; r0 < R; r0 += MAXR) {
        const int nr = min(MAXR, R - r0);
        const float* xr = x + (size_t)r0 * in;
        float acc[OW][MAXR];
#pragma unroll
        for (int j = 0; j < OW; ++j)
#pragma unroll
            for (int r = 0; r < MAXR; ++r) acc[j][r] = 0.0f;
        int c = lane;
        for (; c + 32 * (U - 1) < nvec; c += 32 * U) {
            uint4 q[U][OW];
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int j = 0; j < OW; ++j)
                    if (j < ow) q[u][j] = wv[(size_t)j * vstride + c + 32 * u];
#pragma unroll
            for (int u = 0; u < U; ++u)
                bg_int8_chunk<MAXR, OW>(acc, q[u], ow, scales, biases, o0, groups, xr, in, c + 32 * u, group, nr);
        }
        for (; c < nvec; c += 32) {
            uint4 q[OW];
#pragma unroll
            for (int j = 0; j < OW; ++j)
                if (j < ow) q[j] = wv[(size_t)j * vstride + c];
            bg_int8_chunk<MAXR, OW>(acc, q, ow, scales, biases, o0, groups, xr, in, c, group, nr);
        }
        for (int i = nvec * 16 + lane; i < in; i += 32) {  // the scalar path (in % 16 != 0 or group % 16 != 0)
            const int gi = i / group;
#pragma unroll
            for (int j = 0; j < OW; ++j) {
                if (j < ow) {
                    const size_t oj = (size_t)(o0 + j);
                    const float wf = bg_level(qw[oj * words + (i >> 2)], i & 3, bg_bf16(scales[oj * groups + gi]),
                                              bg_bf16(biases[oj * groups + gi]));
#pragma unroll
                    for (int r = 0; r < MAXR; ++r)
                        if (r < nr) acc[j][r] = fmaf(wf, xr[(size_t)r * in + i], acc[j][r]);
                }
            }
        }
        bg_reduce_store<MAXR, OW>(acc, y, lane, r0, nr, out, o0, ow);
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

// ---- int4 affine (turbo/store/quant.py "int4": 8 levels per little-endian uint32 word, level k at
// bits 4k; bf16 scales / biases per group of 64): w = scale * q + bias, each rounded
// (quant.dequantize). A 16-byte chunk is 32 levels (4 words); the vector path needs in % 32 == 0
// and group % 32 == 0 (a chunk in one group), else the whole row takes the scalar path. The
// per-(output, input)-row arithmetic is that of the bf16 / int8 kernels: one fmaf per element in
// chunk order then element order, then the fixed xor-shuffle tree, whatever R.

__device__ __forceinline__ float bg_nibble(unsigned int word, int k, float s, float b)
{
    return __fadd_rn(__fmul_rn((float)((word >> (4 * k)) & 15u), s), b);
}

template <int MAXR, int OW>
__device__ __forceinline__ void bg_int4_word(float (*acc)[MAXR], const unsigned int* wd, const float* s,
                                             const float* b, int ow, const float* __restrict__ x, int in, int col,
                                             int nr)
{
    float w8[OW][8];
#pragma unroll
    for (int j = 0; j < OW; ++j)
#pragma unroll
        for (int e = 0; e < 8; ++e) w8[j][e] = bg_nibble(wd[j], e, s[j], b[j]);
    bg_dot8<MAXR, OW>(acc, w8, ow, x, in, col, nr);
}

template <int MAXR, int OW>
__device__ __forceinline__ void bg_int4_chunk(float (*acc)[MAXR], const uint4* q, int ow,
                                              const unsigned short* __restrict__ scales,
                                              const unsigned short* __restrict__ biases, int o0, int groups,
                                              const float* __restrict__ x, int in, int c, int group, int nr)
{
    const int gi = (c * 32) / group;
    float s[OW], b[OW];
    unsigned int wd[OW];
#pragma unroll
    for (int j = 0; j < OW; ++j) {
        s[j] = b[j] = 0.0f;
        if (j < ow) {
            s[j] = bg_bf16(scales[(size_t)(o0 + j) * groups + gi]);
            b[j] = bg_bf16(biases[(size_t)(o0 + j) * groups + gi]);
        }
    }
#pragma unroll
    for (int j = 0; j < OW; ++j) wd[j] = q[j].x;
    bg_int4_word<MAXR, OW>(acc, wd, s, b, ow, x, in, c * 32, nr);
#pragma unroll
    for (int j = 0; j < OW; ++j) wd[j] = q[j].y;
    bg_int4_word<MAXR, OW>(acc, wd, s, b, ow, x, in, c * 32 + 8, nr);
#pragma unroll
    for (int j = 0; j < OW; ++j) wd[j] = q[j].z;
    bg_int4_word<MAXR, OW>(acc, wd, s, b, ow, x, in, c * 32 + 16, nr);
#pragma unroll
    for (int j = 0; j < OW; ++j) wd[j] = q[j].w;
    bg_int4_word<MAXR, OW>(acc, wd, s, b, ow, x, in, c * 32 + 24, nr);
}

template <int MAXR>
__device__ __forceinline__ void int4_rows(const float* __restrict__ x, const unsigned int* __restrict__ qw,
                                          const unsigned short* __restrict__ scales,
                                          const unsigned short* __restrict__ biases, float* __restrict__ y, int R,
                                          int in, int out, int group)
{
    constexpr int OW = BG_OW(MAXR), U = BG_UNROLL(MAXR);
    const int lane = threadIdx.x & 31;
    const int o0 = (blockIdx.x * BG_WARPS + (threadIdx.x >> 5)) * OW;
    if (o0 >= out) return;
    const int ow = min(OW, out - o0);
    const int groups = in / group;
    const int words = in / 8;
    const uint4* wv = reinterpret_cast<const uint4*>(qw + (size_t)o0 * words);  // aligned when in % 32 == 0
    const int vstride = in >> 5;
    const int nvec = ((in | group) & 31) ? 0 : in >> 5;  // a chunk must lie in one group
    for (int r0 = 0; r0 < R; r0 += MAXR) {
        const int nr = min(MAXR, R - r0);
        const float* xr = x + (size_t)r0 * in;
        float acc[OW][MAXR];
#pragma unroll
        for (int j = 0; j < OW; ++j)
#pragma unroll
            for (int r = 0; r < MAXR; ++r) acc[j][r] = 0.0f;
        int c = lane;
        for (; c + 32 * (U - 1) < nvec; c += 32 * U) {
            uint4 q[U][OW];
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int j = 0; j < OW; ++j)
                    if (j < ow) q[u][j] = wv[(size_t)j * vstride + c + 32 * u];
#pragma unroll
            for (int u = 0; u < U; ++u)
                bg_int4_chunk<MAXR, OW>(acc, q[u], ow, scales, biases, o0, groups, xr, in, c + 32 * u, group, nr);
        }
        for (; c < nvec; c += 32) {
            uint4 q[OW];
#pragma unroll
            for (int j = 0; j < OW; ++j)
                if (j < ow) q[j] = wv[(size_t)j * vstride + c];
            bg_int4_chunk<MAXR, OW>(acc, q, ow, scales, biases, o0, groups, xr, in, c, group, nr);
        }
        for (int i = nvec * 32 + lane; i < in; i += 32) {  // the scalar path (in % 32 != 0 or group % 32 != 0)
            const int gi = i / group;
#pragma unroll
            for (int j = 0; j < OW; ++j) {
                if (j < ow) {
                    const size_t oj = (size_t)(o0 + j);
                    const float wf = bg_nibble(qw[oj * words + (i >> 3)], i & 7, bg_bf16(scales[oj * groups + gi]),
                                               bg_bf16(biases[oj * groups + gi]));
#pragma unroll
                    for (int r = 0; r < MAXR; ++r)
                        if (r < nr) acc[j][r] = fmaf(wf, xr[(size_t)r * in + i], acc[j][r]);
                }
            }
        }
        bg_reduce_store<MAXR, OW>(acc, y, lane, r0, nr, out, o0, ow);
    }
}

#define BG_INT4_ENTRY(MAXR)                                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * BG_WARPS)                                              \
    int4_rows_gemv_r##MAXR##_f32(const float* __restrict__ x, const unsigned int* __restrict__ qw,           \
                                 const unsigned short* __restrict__ scales,                                  \
                                 const unsigned short* __restrict__ biases, float* __restrict__ y, int R,    \
                                 int in, int out, int group)                                                 \
    {                                                                                                        \
        int4_rows<MAXR>(x, qw, scales, biases, y, R, in, out, group);                                        \
    }

BG_INT4_ENTRY(1)
BG_INT4_ENTRY(4)
BG_INT4_ENTRY(8)
BG_INT4_ENTRY(16)

// ---- routed experts (the CUDA step's MoE): pair p (a row's j-th expert) multiplies row p / row_div
// of x by expert ids[p]'s bf16 matrix, taken from the device table wtab [experts] of pointers (the
// routing never comes back to the host). Grid (ceil(out / BG_WARPS), pairs); each pair is a one-row
// product with the r1 entry's arithmetic, so a routed row's bits are its expert's one-row product.
extern "C" __global__ void __launch_bounds__(32 * BG_WARPS)
bf16_experts_gemv_f32(const float* __restrict__ x,                // [pairs / row_div, in]
                      const int* __restrict__ ids,                // [pairs] expert of each pair
                      const unsigned long long* __restrict__ wtab,  // [experts] -> bf16 [out, in]
                      float* __restrict__ y,                      // [pairs, out]
                      int pairs, int in, int out, int row_div)
{
    const int p = blockIdx.y;
    const unsigned short* w = reinterpret_cast<const unsigned short*>(wtab[ids[p]]);
    bf16_rows<1>(x + (size_t)(p / row_div) * in, w, y + (size_t)p * out, 1, in, out);
}
