// The CUDA step's own kernels (issue #55): the fused Gated DeltaNet tail, gated attention for R
// query rows against the K/V cache, the residual add + RMSNorm, SiLU-mul and the embedding
// gather. DEVICE-UNVERIFIED (built and run only through the host-compiled emulation so far).
//
// Numerics. Every row's value is a function of that row (and, in the GDN recurrence and
// attention, of the rows before it) in one fixed order that never depends on R = 1..16: a
// verify row equals the decode step it stands for, bit for bit. Where the CPU native step's
// chain is defined the same way on every tier it is followed operation for operation
// (native.h's fast_exp / fast_silu / fast_sigmoid with the multiply-adds GCC contracts on an
// FMA tier written as fmaf; the sequential fma chains of its sums of squares, conv taps and
// recurrence), so given the same inputs these are bit-equal to native.c on an FMA tier:
//   add_rms_norm_f32, silu_mul_f32, embed_rows_bf16_f32, and gdn_step_f32 apart from g
//   (softplus's log1pf is libm's on the CPU, CUDA's here: either may be 1 ulp off).
// Not equal to the CPU (own fixed order, documented where it is chosen): the matrix products
// (bgemv.cu: the CPU's order is per tier — AVX512-BF16 rounds x to bf16, panels walk k in one
// chain), attention's dot products / softmax sums (the CPU's lanes) and RoPE (cosf / sinf and
// the contraction of a*c - b*s differ between libms and compilers).

// ---- native.h's elementwise functions, with the contractions of an FMA tier made explicit ----
__device__ __forceinline__ float st_exp(float x)
{
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    const float k = fmaf(x, 1.44269504f, 12582912.0f) - 12582912.0f;  // round(x / ln 2)
    const float r = fmaf(-k, -2.12194440e-4f, fmaf(-k, 0.693359375f, x));
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r) + 1.0f;
    return p * __int_as_float(((int)k + 127) << 23);
}
__device__ __forceinline__ float st_sigmoid(float x) { return 1.0f / (1.0f + st_exp(-x)); }
__device__ __forceinline__ float st_silu(float x) { return x / (1.0f + st_exp(-x)); }
__device__ __forceinline__ float st_softplus(float x) { return x > 20.0f ? x : log1pf(st_exp(x)); }

// ---- residual add + RMSNorm: x += y (y null: none); h = x * (1 / sqrt(mean(x^2) + eps)) * w ----
// One block per row. The sum of squares is one chain in element order, each product rounded
// before its add (native.h rms_norm as the library builds it; __fmul_rn keeps nvcc from fusing),
// summed by one thread from the row staged in shared memory (H serial adds, a few us at 1024:
// the price of the CPU's bits; a fixed tree would be R-independent too, a knob for the device).
#define ST_NORM_THREADS 256
#define ST_NORM_MAXH 8192  // rows staged in shared memory up to this width (wider: read from global)

extern "C" __global__ void __launch_bounds__(ST_NORM_THREADS)
add_rms_norm_f32(float* __restrict__ x,        // [R, H] residual stream, updated in place when y is given
                 const float* __restrict__ y,  // [R, H] or null
                 const float* __restrict__ w,  // [H] the norm's scale ((1 + w) folded for the trunk's norms)
                 float* __restrict__ h,        // [R, H] out
                 int R, int H, float eps)
{
    __shared__ float inv;
    __shared__ float row[ST_NORM_MAXH];
    const int r = blockIdx.x;
    const bool staged = H <= ST_NORM_MAXH;
    float* xr = x + (size_t)r * H;
    const float* yr = y != nullptr ? y + (size_t)r * H : nullptr;
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
        const float v = yr != nullptr ? xr[i] + yr[i] : xr[i];
        if (yr != nullptr) xr[i] = v;
        if (staged) row[i] = v;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const float* src = staged ? row : xr;
        float ss = 0.0f;
        for (int i = 0; i < H; ++i) ss = __fadd_rn(ss, __fmul_rn(src[i], src[i]));  // (native: not fused)
        inv = 1.0f / sqrtf(ss / (float)H + eps);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < H; i += blockDim.x) h[(size_t)r * H + i] = (staged ? row[i] : xr[i]) * inv * w[i];
}

// ---- SwiGLU's product input: act[r, i] = silu(gu[r, i]) * gu[r, I + i] (gate rows | up rows) ----
extern "C" __global__ void __launch_bounds__(256)
silu_mul_f32(const float* __restrict__ gu,  // [R, 2I]
             float* __restrict__ act,       // [R, I]
             int R, int I)
{
    const size_t n = (size_t)R * I;
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (size_t)gridDim.x * blockDim.x) {
        const size_t r = e / I, i = e % I;
        act[e] = st_silu(gu[r * 2 * I + i]) * gu[r * 2 * I + I + i];
    }
}

// ---- embedding rows: x[r, :] = table[ids[r], :] (bf16 rows widened exactly) ----
extern "C" __global__ void __launch_bounds__(256)
embed_rows_bf16_f32(const unsigned short* __restrict__ table,  // [vocab, H] bf16 as stored
                    const int* __restrict__ ids,               // [R]
                    float* __restrict__ x,                     // [R, H]
                    int R, int H)
{
    const int r = blockIdx.x;
    const size_t t = (size_t)ids[r];
    for (int i = threadIdx.x; i < H; i += blockDim.x)
        x[(size_t)r * H + i] = __uint_as_float((unsigned int)table[t * H + i] << 16);
}

// ---- the Gated DeltaNet tail of R rows in one launch (docs/DESIGN.md 2.1) ----
// From the in_proj product's rows proj [R, P] (P = C + vd + 2 Hv: qkv C = 2 kd + vd | z vd | b Hv |
// a Hv), per value head h (one block each; GDN_THREADS threads, thread j owns state column j):
//   1. the rows' conv inputs for the head's channels (its key head's q and k, its v) through the
//      depthwise causal conv (the window before the rows, then the rows), SiLU; q, k
//      L2-normalised (q also by dk^-0.5); beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias);
//   2. the recurrence, row after row, state column j in global memory (read and written by thread
//      j only: state_in may alias state_out), the state after every row but the last into
//      `states` (the checkpoints a rollback restores; row R-1's is state_out);
//   3. the per-head gated RMSNorm of the outputs times silu(z) into out [R, vd].
// It also writes ext [K-1+R, C] (the window, then the rows' conv inputs: the new window is its
// last K-1 rows) and window_out [K-1, C] (must not alias window_in: other blocks still read it).
// Limits: dk, dv <= GDN_MAXD, R <= GDN_MAXR (the step's verify and prefill chunks stay there).
#define GDN_THREADS 128
#define GDN_MAXD 128
#define GDN_MAXR 16
#define GDN_MAXK 8

// the body of gdn_step_f32 and gdn_step_ind_f32 (one code, two ways to name the state). Not
// static: nvcc names a static function's __shared__ arrays after the source's absolute path
// (_INTERNAL_<hash>), so the PTX would differ with the checkout's directory.
__device__ __forceinline__ void
gdn_step_body(const float* __restrict__ proj,       // [R, P]
             const float* __restrict__ window_in,  // [K-1, C] conv inputs before the rows
             float* __restrict__ window_out,       // [K-1, C] after the rows
             float* __restrict__ ext,              // [K-1+R, C] or null: window then the rows' conv inputs
             const float* __restrict__ conv,       // [C, K] depthwise taps
             const float* __restrict__ neg_a,      // [Hv] -exp(A_log)
             const float* __restrict__ dt_bias,    // [Hv]
             const float* __restrict__ gnorm,      // [dv] the gated norm's plain weight
             const float* state_in,                // [Hv, dk, dv] fp32
             float* state_out,                     // [Hv, dk, dv] (may alias state_in)
             float* __restrict__ states,           // [R-1, Hv, dk, dv] or null: after rows 0..R-2
             float* __restrict__ out,              // [R, Hv * dv] gated-normed outputs
             int R, int Hk, int dk, int Hv, int dv, int K, float eps)
{
    __shared__ float sq[GDN_MAXR][GDN_MAXD];  // the rows' normalised, scaled q of this head's key head
    __shared__ float sk[GDN_MAXR][GDN_MAXD];  // k, normalised
    __shared__ float sv[GDN_MAXR][GDN_MAXD];  // v; then the recurrence's outputs
    __shared__ float sg[GDN_MAXR], sb[GDN_MAXR], sinv[GDN_MAXR][2];
    const int h = blockIdx.x, t = threadIdx.x;
    const int kd = Hk * dk, vd = Hv * dv, C = 2 * kd + vd, P = C + vd + 2 * Hv;
    const int rep = Hv / Hk, hk = h / rep;
    const bool writes_qk = h % rep == 0;  // one block per key head writes its q, k channels out
    const float qscale = 1.0f / sqrtf((float)dk);

    // 1. conv + SiLU of the head's 2 dk + dv channels, every row
    for (int e = t; e < 2 * dk + dv; e += blockDim.x) {
        const int c = e < dk ? hk * dk + e : e < 2 * dk ? kd + hk * dk + (e - dk) : 2 * kd + h * dv + (e - 2 * dk);
        const bool mine = c >= 2 * kd || writes_qk;
        float win[GDN_MAXK + GDN_MAXR];  // this channel's window then rows
        for (int j = 0; j < K - 1; ++j) win[j] = window_in[(size_t)j * C + c];
        for (int r = 0; r < R; ++r) win[K - 1 + r] = proj[(size_t)r * P + c];
        if (mine) {
            if (ext != nullptr)
                for (int j = 0; j < K - 1 + R; ++j) ext[(size_t)j * C + c] = win[j];
            for (int j = 0; j < K - 1; ++j) window_out[(size_t)j * C + c] = win[R + j];
        }
        for (int r = 0; r < R; ++r) {
            float m = win[r] * conv[(size_t)c * K];
            for (int j = 1; j < K; ++j) m = fmaf(win[r + j], conv[(size_t)c * K + j], m);
            m = st_silu(m);
            if (e < dk) sq[r][e] = m;
            else if (e < 2 * dk) sk[r][e - dk] = m;
            else sv[r][e - 2 * dk] = m;
        }
    }
    __syncthreads();
    // the L2 norms (one fma chain each, element order: native_gdn.c) and the gates
    if (t < R) {
        float a = 0.0f, b = 0.0f;
        for (int i = 0; i < dk; ++i) { a = fmaf(sq[t][i], sq[t][i], a); b = fmaf(sk[t][i], sk[t][i], b); }
        sinv[t][0] = 1.0f / sqrtf(a + 1e-6f);
        sinv[t][1] = 1.0f / sqrtf(b + 1e-6f);
        const float* pr = proj + (size_t)t * P;
        sb[t] = st_sigmoid(pr[C + vd + h]);
        sg[t] = neg_a[h] * st_softplus(pr[C + vd + Hv + h] + dt_bias[h]);
    }
    __syncthreads();
    for (int e = t; e < R * dk; e += blockDim.x) {
        const int r = e / dk, i = e % dk;
        sq[r][i] = sq[r][i] * sinv[r][0] * qscale;
        sk[r][i] = sk[r][i] * sinv[r][1];
    }
    __syncthreads();

    // 2. the recurrence (native_gdn.c gdn_strip_rows' operations for one column, in its order)
    const size_t per = (size_t)dk * dv;
    if (t < dv) {
        const float* Sin = state_in + h * per + t;
        float* S = state_out + h * per + t;
        const float decay = st_exp(sg[0]);
        float acc = 0.0f;
        for (int i = 0; i < dk; ++i) {
            const float x = Sin[(size_t)i * dv] * decay;
            S[(size_t)i * dv] = x;
            acc = fmaf(sk[0][i], x, acc);
        }
        for (int r = 0; r < R; ++r) {
            const float u = (sv[r][t] - acc) * sb[r];
            const float next = r + 1 < R ? st_exp(sg[r + 1]) : 0.0f;
            float* keep = states != nullptr && r + 1 < R ? states + ((size_t)r * Hv + h) * per + t : nullptr;
            float o = 0.0f;
            acc = 0.0f;
            for (int i = 0; i < dk; ++i) {
                float x = fmaf(sk[r][i], u, S[(size_t)i * dv]);
                o = fmaf(sq[r][i], x, o);
                if (keep != nullptr) keep[(size_t)i * dv] = x;
                if (r + 1 < R) {
                    x = x * next;
                    acc = fmaf(sk[r + 1][i], x, acc);
                }
                S[(size_t)i * dv] = x;
            }
            sv[r][t] = o;  // (v of row r is read above, before: the same thread's element)
        }
    }
    __syncthreads();

    // 3. the gated RMSNorm per row (one fma chain in element order), times silu(z)
    if (t < R) {
        float ss = 0.0f;
        for (int j = 0; j < dv; ++j) ss = fmaf(sv[t][j], sv[t][j], ss);
        sinv[t][0] = 1.0f / sqrtf(ss / (float)dv + eps);
    }
    __syncthreads();
    for (int e = t; e < R * dv; e += blockDim.x) {
        const int r = e / dv, j = e % dv;
        const float z = proj[(size_t)r * P + C + h * dv + j];
        out[(size_t)r * vd + h * dv + j] = gnorm[j] * (sv[r][j] * sinv[r][0]) * st_silu(z);
    }
}

extern "C" __global__ void __launch_bounds__(GDN_THREADS)
gdn_step_f32(const float* __restrict__ proj, const float* __restrict__ window_in, float* __restrict__ window_out,
             float* __restrict__ ext, const float* __restrict__ conv, const float* __restrict__ neg_a,
             const float* __restrict__ dt_bias, const float* __restrict__ gnorm, const float* state_in,
             float* state_out, float* __restrict__ states, float* __restrict__ out,
             int R, int Hk, int dk, int Hv, int dv, int K, float eps)
{
    gdn_step_body(proj, window_in, window_out, ext, conv, neg_a, dt_bias, gnorm, state_in, state_out, states, out,
                  R, Hk, dk, Hv, dv, K, eps);
}

// The same with the per-sequence, per-step addresses read from device memory (a CUDA graph bakes
// its launch arguments at capture; the step writes this block before each replay):
// seq [6] = window_in, window_out, ext, state_in, state_out, states (0: none) as 64-bit addresses.
extern "C" __global__ void __launch_bounds__(GDN_THREADS)
gdn_step_ind_f32(const float* __restrict__ proj, const unsigned long long* __restrict__ seq,
                 const float* __restrict__ conv, const float* __restrict__ neg_a, const float* __restrict__ dt_bias,
                 const float* __restrict__ gnorm, float* __restrict__ out,
                 int R, int Hk, int dk, int Hv, int dv, int K, float eps)
{
    gdn_step_body(proj, (const float*)seq[0], (float*)seq[1], (float*)seq[2], conv, neg_a, dt_bias, gnorm,
                  (const float*)seq[3], (float*)seq[4], (float*)seq[5], out, R, Hk, dk, Hv, dv, K, eps);
}

// ---- gated attention for R query rows of one sequence (docs/DESIGN.md 2.1) ----
// proj [R, P] (P = 2 nh hd + 2 nkv hd: per q head [query hd | gate hd], then K nkv hd, then V
// nkv hd). Rows sit at positions p0..p0+R-1 and attend causally to 0..p0+r. One block per
// (kv head j, row r): it writes row r's K (k_norm, RoPE) and V into the cache at p0 + r, and
// computes the keys of this step's rows r' <= r itself from proj (the cache holds only
// positions < p0 when other blocks read it: no block waits on another), for each of the
// kv head's q heads: q_norm, RoPE, scores (one fma chain over hd per key) * hd^-0.5 into the
// scratch, the max and the sum of exp by a fixed tree (per thread in key order, then the
// threads), the weighted sum of V (per dim one fma chain in key order), times sigmoid(gate).
// rope_cs [positions, rot/2, 2]: cos, sin of each position and frequency (made on the host at
// open, the CPU's libm values).
#define ATT_THREADS 128
#define ATT_MAXD 256

__device__ __forceinline__ float att_tree(float* red, float v, bool is_max)
{
    red[threadIdx.x] = v;
    __syncthreads();
    for (int s = ATT_THREADS / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) {
            const float a = red[threadIdx.x], b = red[threadIdx.x + s];
            red[threadIdx.x] = is_max ? (b > a ? b : a) : a + b;
        }
        __syncthreads();
    }
    const float r = red[0];
    __syncthreads();
    return r;
}

// one head vector src [hd] -> dst: rms_norm (fma chain, thread 0) * w, then RoPE at pos
__device__ __forceinline__ void att_norm_rope(const float* src, float* dst, const float* w, float eps, int hd,
                                              int rot, const float* rope_cs, int pos, float* inv)
{
    if (threadIdx.x == 0) {
        float ss = 0.0f;
        for (int i = 0; i < hd; ++i) ss = fmaf(src[i], src[i], ss);
        *inv = 1.0f / sqrtf(ss / (float)hd + eps);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < hd; i += blockDim.x) dst[i] = src[i] * *inv * w[i];
    __syncthreads();
    const int half = rot / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float c = rope_cs[((size_t)pos * half + i) * 2], s = rope_cs[((size_t)pos * half + i) * 2 + 1];
        const float a = dst[i], b = dst[i + half];
        dst[i] = fmaf(a, c, -b * s);
        dst[i + half] = fmaf(b, c, a * s);
    }
    __syncthreads();
}

// the body of attn_rows_f32 and attn_rows_ind_f32
__device__ __forceinline__ void
attn_rows_body(const float* __restrict__ proj,     // [R, P]
              float* __restrict__ kc,             // [nkv, cap, hd] fp32 K cache
              float* __restrict__ vc,             // [nkv, cap, hd] fp32 V cache
              const float* __restrict__ q_norm,   // [hd] (1 + w)
              const float* __restrict__ k_norm,   // [hd] (1 + w)
              const float* __restrict__ rope_cs,  // [cap, rot/2, 2]
              float* __restrict__ scores,         // [R, nh, cap] scratch
              float* __restrict__ att,            // [R, nh * hd] gated attention outputs
              int R, int p0, int cap, int nh, int nkv, int hd, int rot, float eps)
{
    __shared__ float qv[ATT_MAXD], kv[ATT_MAXD], red[ATT_THREADS], inv;
    const int j = blockIdx.x, r = blockIdx.y, groups = nh / nkv;
    const int P = 2 * nh * hd + 2 * nkv * hd, n = p0 + r + 1;
    const float scale = 1.0f / sqrtf((float)hd);
    // this row's K, V into the cache (only this block writes position p0 + r of kv head j)
    att_norm_rope(proj + (size_t)r * P + 2 * nh * hd + j * hd, kv, k_norm, eps, hd, rot, rope_cs, p0 + r, &inv);
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        kc[((size_t)j * cap + p0 + r) * hd + i] = kv[i];
        vc[((size_t)j * cap + p0 + r) * hd + i] = proj[(size_t)r * P + 2 * nh * hd + nkv * hd + j * hd + i];
    }
    for (int hq = j * groups; hq < (j + 1) * groups; ++hq) {
        att_norm_rope(proj + (size_t)r * P + hq * 2 * hd, qv, q_norm, eps, hd, rot, rope_cs, p0 + r, &inv);
        float* sr = scores + ((size_t)r * nh + hq) * cap;
        // cached keys (positions < p0), one chain a key
        for (int t = threadIdx.x; t < p0; t += blockDim.x) {
            const float* kt = kc + ((size_t)j * cap + t) * hd;
            float s = 0.0f;
            for (int i = 0; i < hd; ++i) s = fmaf(qv[i], kt[i], s);
            sr[t] = s * scale;
        }
        // this step's keys r' <= r, from proj (the same values the cache gets)
        for (int rr = 0; rr <= r; ++rr) {
            att_norm_rope(proj + (size_t)rr * P + 2 * nh * hd + j * hd, kv, k_norm, eps, hd, rot, rope_cs, p0 + rr,
                          &inv);
            if (threadIdx.x == 0) {
                float s = 0.0f;
                for (int i = 0; i < hd; ++i) s = fmaf(qv[i], kv[i], s);
                sr[p0 + rr] = s * scale;
            }
            __syncthreads();
        }
        float m = -INFINITY;
        for (int t = threadIdx.x; t < n; t += blockDim.x) m = sr[t] > m ? sr[t] : m;
        m = att_tree(red, m, true);
        float z = 0.0f;
        for (int t = threadIdx.x; t < n; t += blockDim.x) {
            const float p = st_exp(sr[t] - m);
            sr[t] = p;
            z += p;
        }
        z = att_tree(red, z, false);  // (its barriers also publish every sr[t])
        for (int t = threadIdx.x; t < n; t += blockDim.x) sr[t] = sr[t] / z;  // (native_attn.c: p / z, then sums)
        __syncthreads();
        const float* gate = proj + (size_t)r * P + hq * 2 * hd + hd;
        for (int i = threadIdx.x; i < hd; i += blockDim.x) {
            float a = 0.0f;
            for (int t = 0; t < p0; ++t) a = fmaf(sr[t], vc[((size_t)j * cap + t) * hd + i], a);
            for (int rr = 0; rr <= r; ++rr)
                a = fmaf(sr[p0 + rr], proj[(size_t)rr * P + 2 * nh * hd + nkv * hd + j * hd + i], a);
            att[(size_t)r * nh * hd + hq * hd + i] = a * st_sigmoid(gate[i]);
        }
        __syncthreads();
    }
}

extern "C" __global__ void __launch_bounds__(ATT_THREADS)
attn_rows_f32(const float* __restrict__ proj, float* __restrict__ kc, float* __restrict__ vc,
              const float* __restrict__ q_norm, const float* __restrict__ k_norm, const float* __restrict__ rope_cs,
              float* __restrict__ scores, float* __restrict__ att,
              int R, int p0, int cap, int nh, int nkv, int hd, int rot, float eps)
{
    attn_rows_body(proj, kc, vc, q_norm, k_norm, rope_cs, scores, att, R, p0, cap, nh, nkv, hd, rot, eps);
}

// The same with the sequence's K/V and its position read from device memory (see gdn_step_ind_f32):
// seq [3] = kc, vc (64-bit addresses), p0.
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
attn_rows_ind_f32(const float* __restrict__ proj, const unsigned long long* __restrict__ seq,
                  const float* __restrict__ q_norm, const float* __restrict__ k_norm,
                  const float* __restrict__ rope_cs, float* __restrict__ scores, float* __restrict__ att,
                  int R, int cap, int nh, int nkv, int hd, int rot, float eps)
{
    attn_rows_body(proj, (float*)seq[0], (float*)seq[1], q_norm, k_norm, rope_cs, scores, att, R, (int)seq[2], cap,
                   nh, nkv, hd, rot, eps);
}

// ---- MoE routing (native_moe.c route): per row, softmax of the router logits (the max, e^(l - max)
// with native.h's fast_exp, their sum as native.h sum_of takes it: sixteen lane sums over whole
// groups of 16, the lanes in order, then the tail), the top_k most probable (ties to the lower
// index), written in ascending expert order with their probabilities (renormalised by their sum,
// in that pick order, when norm_topk). One thread a row: E is a few hundred at most.
#define MOE_MAXE 512

extern "C" __global__ void __launch_bounds__(32)
moe_route_f32(float* __restrict__ probs,    // [R, E] router logits in, probabilities out
              int* __restrict__ ids,        // [R, k] experts, ascending
              float* __restrict__ weights,  // [R, k]
              int R, int E, int k, int norm_topk)
{
    const int r = blockIdx.x * 32 + threadIdx.x;
    if (r >= R) return;
    float* p = probs + (size_t)r * E;
    float m = -INFINITY;
    for (int e = 0; e < E; ++e) m = p[e] > m ? p[e] : m;
    for (int e = 0; e < E; ++e) p[e] = st_exp(p[e] - m);
    float lanes[16], z = 0.0f;
    for (int l = 0; l < 16; ++l) lanes[l] = 0.0f;
    int t = 0;
    for (; t + 16 <= E; t += 16)
        for (int l = 0; l < 16; ++l) lanes[l] = lanes[l] + p[t + l];
    for (int l = 0; l < 16; ++l) z = z + lanes[l];
    for (; t < E; ++t) z = z + p[t];
    for (int e = 0; e < E; ++e) p[e] = p[e] / z;
    unsigned char taken[MOE_MAXE];
    for (int e = 0; e < E; ++e) taken[e] = 0;
    float total = 0.0f;
    for (int j = 0; j < k; ++j) {
        int best = -1;
        for (int e = 0; e < E; ++e)
            if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
        taken[best] = 1;
        total = total + p[best];
    }
    for (int e = 0, j = 0; e < E; ++e)
        if (taken[e]) {
            ids[(size_t)r * k + j] = e;
            weights[(size_t)r * k + j++] = norm_topk ? p[e] / total : p[e];
        }
}

// ---- MoE sum: y[r, c] = sum over the row's experts (ascending) of weight * out, then (shared: not
// null) + sigmoid(gate[r]) * shared[r, c]; each term one fma in that order (native_moe.c's sums).
extern "C" __global__ void __launch_bounds__(256)
moe_combine_f32(const float* __restrict__ ye,       // [R * k, H] the routed experts' outputs
                const float* __restrict__ weights,  // [R, k]
                const float* __restrict__ shared,   // [R, H] the shared expert's output, or null
                const float* __restrict__ gate,     // [R] its gate logit, or null
                float* __restrict__ y,              // [R, H]
                int R, int k, int H)
{
    const int r = blockIdx.x;
    const float g = shared != nullptr ? st_sigmoid(gate[r]) : 0.0f;
    for (int c = threadIdx.x; c < H; c += blockDim.x) {
        float a = 0.0f;
        for (int j = 0; j < k; ++j) a = fmaf(ye[((size_t)r * k + j) * H + c], weights[(size_t)r * k + j], a);
        if (shared != nullptr) a = fmaf(g, shared[(size_t)r * H + c], a);
        y[(size_t)r * H + c] = a;
    }
}
