// Gated RMSNorm (the GDN output norm, docs/DESIGN.md 2.1): plain weight w (not 1 + w), fp32.
// Reference: turbo.backends.ops.gated_rms_norm(o, z, w, eps).
//
//   out[n, :] = w * (o[n, :] * rsqrt(mean(o[n, :]^2) + eps)) * silu(z[n, :])
//
// One warp per row n (rows = tokens x heads, width d); 4 rows per 128-thread block.

#define NORM_WARPS 4

extern "C" __global__ void __launch_bounds__(32 * NORM_WARPS)
gated_rms_norm_f32(const float* __restrict__ o,   // [N, d]
                   const float* __restrict__ z,   // [N, d]
                   const float* __restrict__ w,   // [d]
                   float* __restrict__ out,       // [N, d]
                   int N, int d, float eps)
{
    const int lane = threadIdx.x & 31;
    const int n = blockIdx.x * NORM_WARPS + (threadIdx.x >> 5);
    if (n >= N) return;
    const float* orow = o + (size_t)n * d;
    const float* zrow = z + (size_t)n * d;
    float ss = 0.0f;
    for (int i = lane; i < d; i += 32) ss = fmaf(orow[i], orow[i], ss);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    const float r = rsqrtf(ss / (float)d + eps);
    for (int i = lane; i < d; i += 32) {
        const float zv = zrow[i];
        out[(size_t)n * d + i] = w[i] * (orow[i] * r) * (zv / (1.0f + expf(-zv)));
    }
}
