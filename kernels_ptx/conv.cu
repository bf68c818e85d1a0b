// Conv-window update + depthwise causal conv + SiLU over R rows (docs/DESIGN.md 2.1, GDN layers).
// Reference: turbo.backends.ops.causal_conv_rows(ext, w) with ext = cat([window, x]).
//
//   ext = [window (K-1 rows); x (R rows)]          (written when ext != null: rollback replays it)
//   out[t, c] = silu(sum_j w[c, j] * ext[t + j, c]) (separate multiplies and adds, in j order,
//                                                    rounded like the CPU reference)
//   new_window = ext[R:]                            (may alias window: one thread per channel
//                                                    reads its window before writing it)
// One thread per channel c.

#define CONV_MAX_TAPS 8

__device__ __forceinline__ float silu_f32(float x) { return x / (1.0f + expf(-x)); }

extern "C" __global__ void __launch_bounds__(256)
conv_window_silu_f32(const float* window,             // [K-1, C]
                     const float* __restrict__ x,     // [R, C]
                     const float* __restrict__ w,     // [C, K]
                     float* __restrict__ out,         // [R, C]
                     float* __restrict__ ext,         // [K-1+R, C] or null
                     float* new_window,               // [K-1, C] or null
                     int R, int C, int K)
{
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float wc[CONV_MAX_TAPS];
    float vals[CONV_MAX_TAPS];  // vals[0 .. K-2]: the last K-1 inputs; vals[K-1]: the current row
#pragma unroll
    for (int j = 0; j < CONV_MAX_TAPS; ++j) {
        wc[j] = j < K ? w[(size_t)c * K + j] : 0.0f;
        vals[j] = 0.0f;
        if (j < K - 1) {
            vals[j] = window[(size_t)j * C + c];
            if (ext != nullptr) ext[(size_t)j * C + c] = vals[j];
        }
    }
    for (int t = 0; t < R; ++t) {
        const float xv = x[(size_t)t * C + c];
        if (ext != nullptr) ext[(size_t)(K - 1 + t) * C + c] = xv;
#pragma unroll
        for (int j = 0; j < CONV_MAX_TAPS; ++j)
            if (j == K - 1) vals[j] = xv;
        float acc = __fmul_rn(vals[0], wc[0]);
#pragma unroll
        for (int j = 1; j < CONV_MAX_TAPS; ++j)
            if (j < K) acc = __fadd_rn(acc, __fmul_rn(vals[j], wc[j]));
        out[(size_t)t * C + c] = silu_f32(acc);
#pragma unroll
        for (int j = 0; j + 1 < CONV_MAX_TAPS; ++j)
            if (j < K - 1) vals[j] = vals[j + 1];
    }
    if (new_window != nullptr) {
#pragma unroll
        for (int j = 0; j < CONV_MAX_TAPS; ++j)
            if (j < K - 1) new_window[(size_t)j * C + c] = vals[j];
    }
}
