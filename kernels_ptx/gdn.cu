// Gated DeltaNet recurrence over R verify rows, with per-row state checkpoints (docs/DESIGN.md 2.1).
// Reference: turbo.backends.ops.gdn_recurrence(state, q, k, v, g, beta, keep_states=True).
//
// Per row t and value head h, state S [dk, dv] fp32:
//   S = exp(g) * S;  u = beta * (v - S^T k);  S = S + k u^T;  o = S^T q
//
// Grid (H, ceil(dv / GDN_TJ)); block (GDN_TJ, GDN_TI). Thread (tx, ti) owns column
// j = blockIdx.y * GDN_TJ + tx and rows i = ti, ti + GDN_TI, ... of its head's state, kept in
// registers for all R rows. Column sums reduce over ti in a fixed order (deterministic).
// state_in and state_out may alias: each element is read and written by the same thread.

#define GDN_TJ 32
#define GDN_TI 8
#define GDN_MAX_PER 32  // dk <= GDN_TI * GDN_MAX_PER = 256

extern "C" __global__ void __launch_bounds__(GDN_TJ * GDN_TI)
gdn_recurrence_f32(const float* state_in,           // [H, dk, dv]
                   float* state_out,                // [H, dk, dv]
                   float* __restrict__ states,      // [R, H, dk, dv] or null
                   float* __restrict__ out,         // [R, H, dv]
                   const float* __restrict__ q,     // [R, H, dk]
                   const float* __restrict__ k,     // [R, H, dk]
                   const float* __restrict__ v,     // [R, H, dv]
                   const float* __restrict__ g,     // [R, H]
                   const float* __restrict__ beta,  // [R, H]
                   int R, int H, int dk, int dv)
{
    __shared__ float sk[GDN_TI * GDN_MAX_PER];
    __shared__ float sq[GDN_TI * GDN_MAX_PER];
    __shared__ float red[GDN_TI][GDN_TJ];
    __shared__ float su[GDN_TJ];

    const int h = blockIdx.x;
    const int tx = threadIdx.x, ti = threadIdx.y;
    const int j = blockIdx.y * GDN_TJ + tx;
    const bool col = j < dv;
    const int tid = ti * GDN_TJ + tx;

    float s[GDN_MAX_PER];
#pragma unroll
    for (int p = 0; p < GDN_MAX_PER; ++p) {
        const int i = ti + p * GDN_TI;
        s[p] = (col && i < dk) ? state_in[((size_t)h * dk + i) * dv + j] : 0.0f;
    }

    for (int t = 0; t < R; ++t) {
        const size_t row = (size_t)t * H + h;
        __syncthreads();  // everyone is done with the previous row's sk / sq
        for (int idx = tid; idx < dk; idx += GDN_TJ * GDN_TI) {
            sk[idx] = k[row * dk + idx];
            sq[idx] = q[row * dk + idx];
        }
        const float decay = expf(g[row]);
        const float b = beta[row];
        __syncthreads();

        float part = 0.0f;
#pragma unroll
        for (int p = 0; p < GDN_MAX_PER; ++p) {
            const int i = ti + p * GDN_TI;
            if (i < dk) {
                s[p] = s[p] * decay;
                part = fmaf(sk[i], s[p], part);
            }
        }
        red[ti][tx] = part;
        __syncthreads();
        if (ti == 0) {
            float kv = 0.0f;
#pragma unroll
            for (int r = 0; r < GDN_TI; ++r) kv += red[r][tx];
            const float vj = col ? v[row * dv + j] : 0.0f;
            su[tx] = (vj - kv) * b;
        }
        __syncthreads();
        const float u = su[tx];

        part = 0.0f;
#pragma unroll
        for (int p = 0; p < GDN_MAX_PER; ++p) {
            const int i = ti + p * GDN_TI;
            if (i < dk) {
                s[p] = fmaf(sk[i], u, s[p]);
                part = fmaf(sq[i], s[p], part);
            }
        }
        red[ti][tx] = part;
        __syncthreads();
        if (ti == 0 && col) {
            float o = 0.0f;
#pragma unroll
            for (int r = 0; r < GDN_TI; ++r) o += red[r][tx];
            out[row * dv + j] = o;
        }
        if (states != nullptr && col) {
#pragma unroll
            for (int p = 0; p < GDN_MAX_PER; ++p) {
                const int i = ti + p * GDN_TI;
                if (i < dk) states[(row * dk + i) * dv + j] = s[p];
            }
        }
    }

    if (col) {
#pragma unroll
        for (int p = 0; p < GDN_MAX_PER; ++p) {
            const int i = ti + p * GDN_TI;
            if (i < dk) state_out[((size_t)h * dk + i) * dv + j] = s[p];
        }
    }
}
