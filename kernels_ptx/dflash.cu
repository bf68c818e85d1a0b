// DFlash2 drafter kernels (docs/DESIGN.md 2.2, steps 3 and 5).

// ---- grouped dynamic causal conv ---------------------------------------------------------
// Reference: turbo.drafters.dflash.grouped_conv(h, base, dyn, group).
//   out[t, c] = sum_{o < taps, o <= t} (base[o, c] + dyn[t, o, c / group]) * h[t - o, c]
// One thread per (t, c).

extern "C" __global__ void __launch_bounds__(256)
grouped_conv_f32(const float* __restrict__ h,     // [rows, H]
                 const float* __restrict__ base,  // [taps, H]
                 const float* __restrict__ dyn,   // [rows, taps, H / group]
                 float* __restrict__ out,         // [rows, H]
                 int rows, int H, int taps, int group)
{
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int t = blockIdx.y;
    if (c >= H || t >= rows) return;
    const int groups = H / group;
    const float* d = dyn + (size_t)t * taps * groups + c / group;
    float acc = __fmul_rn(__fadd_rn(base[c], d[0]), h[(size_t)t * H + c]);
    for (int o = 1; o < taps && o <= t; ++o)
        acc = __fadd_rn(acc, __fmul_rn(__fadd_rn(base[(size_t)o * H + c], d[(size_t)o * groups]),
                                       h[(size_t)(t - o) * H + c]));
    out[(size_t)t * H + c] = acc;
}

// ---- candidate selector: top-k + greedy bigram rescoring, one launch ----------------------
// Reference: turbo.drafters.dflash.select_candidates(logits, final, anchor, hidden_projection,
// pred_codebook, succ_codebook, top_k), given proj = final @ hidden_projection^T.
//   cand_i = the top_k ids of logits_i (order: value descending, then id ascending)
//   score_ij = logits_i[c_ij] + dot(pred_codebook[pred_i] * proj_i, succ_codebook[c_ij])
//   d_i = argmax_j score_ij (ties: the lower id); pred_1 = anchor; pred_{i+1} = d_i
//
// Grid (rows); block SEL_THREADS. Block b finds row b's top-k (each thread keeps a sorted
// SEL_MAX_K list over its strided slice, then top_k rounds of a block argmax merge them) and
// writes it to the workspace. The last block to finish (a ticket on `counter`, which it
// resets to 0 for the next launch) runs the sequential rescoring over all rows.

#define SEL_THREADS 256
#define SEL_MAX_K 16
#define SEL_WARPS (SEL_THREADS / 32)

__device__ __forceinline__ bool sel_better(float av, int ai, float bv, int bi)
{
    return av > bv || (av == bv && ai < bi);
}

__device__ __forceinline__ void sel_warp_argmax(float& v, int& id)
{
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, off);
        const int oi = __shfl_xor_sync(0xffffffffu, id, off);
        if (sel_better(ov, oi, v, id)) { v = ov; id = oi; }
    }
}

extern "C" __global__ void __launch_bounds__(SEL_THREADS)
select_candidates_f32(const float* __restrict__ logits,  // [rows, V]
                      const float* __restrict__ proj,    // [rows, rank]
                      const float* __restrict__ pred_cb, // [V, rank]
                      const float* __restrict__ succ_cb, // [V, rank]
                      int anchor, int rows, int V, int rank, int top_k,
                      int* cand_id,                      // workspace [rows, top_k]
                      float* cand_val,                   // workspace [rows, top_k]
                      unsigned int* counter,             // workspace [1], 0 between launches
                      int* __restrict__ out)             // [rows]
{
    __shared__ float lv[SEL_MAX_K][SEL_THREADS];
    __shared__ int li[SEL_MAX_K][SEL_THREADS];
    __shared__ float wv[SEL_WARPS];
    __shared__ int wi[SEL_WARPS];
    __shared__ int winner;
    __shared__ bool last;
    __shared__ float score[SEL_MAX_K];
    __shared__ int pred_s;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int b = blockIdx.x;

    // 1. this thread's sorted top SEL_MAX_K of its strided slice of row b
    float tv[SEL_MAX_K];
    int tidx[SEL_MAX_K];
#pragma unroll
    for (int p = 0; p < SEL_MAX_K; ++p) { tv[p] = -INFINITY; tidx[p] = 0x7fffffff; }
    const float* row = logits + (size_t)b * V;
    for (int c = tid; c < V; c += SEL_THREADS) {
        float cv = row[c];
        int ci = c;
        if (!sel_better(cv, ci, tv[SEL_MAX_K - 1], tidx[SEL_MAX_K - 1])) continue;
#pragma unroll
        for (int p = 0; p < SEL_MAX_K; ++p) {
            if (sel_better(cv, ci, tv[p], tidx[p])) {
                const float sv = tv[p]; const int si = tidx[p];
                tv[p] = cv; tidx[p] = ci; cv = sv; ci = si;
            }
        }
    }
#pragma unroll
    for (int p = 0; p < SEL_MAX_K; ++p) { lv[p][tid] = tv[p]; li[p][tid] = tidx[p]; }
    __syncthreads();

    // 2. merge: top_k rounds of a block argmax over each thread's current head
    int head = 0;
    for (int r = 0; r < top_k; ++r) {
        float v = head < SEL_MAX_K ? lv[head][tid] : -INFINITY;
        int id = head < SEL_MAX_K ? li[head][tid] : 0x7fffffff;
        sel_warp_argmax(v, id);
        if (lane == 0) { wv[warp] = v; wi[warp] = id; }
        __syncthreads();
        if (tid == 0) {
            float bv = wv[0]; int bi = wi[0];
            for (int w = 1; w < SEL_WARPS; ++w)
                if (sel_better(wv[w], wi[w], bv, bi)) { bv = wv[w]; bi = wi[w]; }
            winner = bi;
            cand_id[(size_t)b * top_k + r] = bi;
            cand_val[(size_t)b * top_k + r] = bv;
        }
        __syncthreads();
        if (head < SEL_MAX_K && li[head][tid] == winner) ++head;
    }

    // 3. the last block rescoring all rows, in order
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        const unsigned int ticket = atomicAdd(counter, 1u);
        last = ticket == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (tid == 0) { *counter = 0u; pred_s = anchor; }
    __syncthreads();
    for (int i = 0; i < rows; ++i) {
        const int pred = pred_s;
        const float* pp = pred_cb + (size_t)pred * rank;
        const float* pj = proj + (size_t)i * rank;
        for (int j = warp; j < top_k; j += SEL_WARPS) {
            const int c = __ldcg(cand_id + (size_t)i * top_k + j);
            const float* sc = succ_cb + (size_t)c * rank;
            float dot = 0.0f;
            for (int e = lane; e < rank; e += 32) dot = fmaf(sc[e], pp[e] * pj[e], dot);
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
            if (lane == 0) score[j] = __ldcg(cand_val + (size_t)i * top_k + j) + dot;
        }
        __syncthreads();
        if (tid == 0) {
            float bv = score[0];
            int bi = __ldcg(cand_id + (size_t)i * top_k);
            for (int j = 1; j < top_k; ++j) {
                const int c = __ldcg(cand_id + (size_t)i * top_k + j);
                if (sel_better(score[j], c, bv, bi)) { bv = score[j]; bi = c; }
            }
            out[i] = bi;
            pred_s = bi;
        }
        __syncthreads();
    }
}
