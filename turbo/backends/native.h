/* What the library's C files (native*.c, built together into one library) share: the structs
 * Python fills, the entry points one file calls in another, small math helpers. What only
 * the trunk's files share: native_internal.h. */
#ifndef TURBO_NATIVE_H
#define TURBO_NATIVE_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* The structs Python fills (turbo/backends/native_lib.py mirrors them with ctypes and checks
 * their sizes against struct_size at load). */

/* native_moe.c: one layer's mixture of experts (pointers to packed matrices) and sizes. */
typedef struct {
    int experts, top_k, inter, shared_inter, norm_topk;
    int wtype;                       /* the router's and the shared expert's gate */
    int ewtype;                      /* the experts' and the shared expert's (int4 / int8: read packed) */
    const void *router;              /* packed [experts, hidden] */
    const void *const *gate_up;      /* experts x packed [2 * inter, hidden] (gate rows | up rows) */
    const void *const *down;         /* experts x packed [hidden, inter] */
    const void *shared_gate_up, *shared_down, *shared_gate; /* [2 S, hidden], [hidden, S], [1, hidden]; NULL: none */
} Moe;

/* native_gdn.c, native_attn.c: one trunk layer's weights (pointers) and sizes. */
typedef struct {
    int hidden, inter, wtype;
    float eps;
    const float *in_norm, *post_norm; /* (1 + w), fp32 */
    const void *gate_up, *down;
    /* Gated DeltaNet */
    const void *in_proj, *out;
    const float *conv, *neg_a, *dt_bias, *gnorm; /* conv [taps, C]: the checkpoint's [C, taps] transposed */
    int kheads, kdim, vheads, vdim, taps;
    /* gated attention */
    const void *qkv, *o;
    const float *q_norm, *k_norm, *inv_freq;
    int heads, kv_heads, head_dim, rot;
    int kv_type; /* the K/V cache attn_layer reads and writes: fp32 0, bf16 1 */
    const Moe *moe; /* the MLP half routes to experts (native_moe.c) in place of gate_up / down; NULL: dense */
} Layer;

/* native_dflash.c: one DFlash layer and the drafter (DFlash2, or the published DFlash: no conv). */
typedef struct {
    const float *in_norm, *post_norm, *q_norm, *k_norm; /* (1 + w) */
    const void *q, *k, *v, *o, *gate, *up, *down;        /* packed [out, in] */
    const void *attn_proj, *mlp_proj;                    /* packed [2 * taps * groups, hidden] (NULL: no conv) */
    const float *attn_base, *mlp_base;                   /* [2, taps, hidden] (NULL: no conv) */
    float *ring_k, *ring_v;                              /* [capacity, kv_heads, head_dim] */
} DfLayer;

typedef struct {
    int hidden, heads, kv_heads, head_dim, inter, taps, group, aux_width, vocab, layers;
    int window, capacity, causal, mask_token, embed_wtype, embed_panels;
    int conv; /* 1: the grouped conv around every sublayer (DFlash2); 0: none (the published DFlash) */
    int wtype, lm_wtype; /* the packed matrices' (fc and the layers') and the lm_head's: fp32 0, bf16 1 */
    float eps;     /* the norms of unscaled values: q, k, the fused context */
    float res_eps; /* eps / scale^2: the norms reading the scaled residual stream */
    float scale;
    const void *embed; /* [vocab, hidden], fp32 or bf16 (the trunk's), rows or panels (embed_row) */
    const void *fc, *lm_head; /* packed */
    const float *hidden_norm, *final_norm, *inv_freq;
    const DfLayer *layer;
} Dflash;

/* sizeof(Layer), sizeof(Dflash), sizeof(DfLayer), sizeof(Moe) for which = 0, 1, 2, 3 (-1 otherwise). */
int struct_size(int which);

/* x += the MoE block of rms_norm(x) (post_norm, eps, hidden of L), R rows (native_moe.c). */
void moe_block(const Layer *L, float *x, int R);

/* y [R, n] = x [R, k] @ w[n, k]^T for a packed w (panels of 16 outputs; native_products.c). */
void linear_packed(const float *x, int R, int k, const void *P, int wtype, int n, float *y);

/* e^x in straight-line arithmetic, so loops over it vectorise (expf is a call per value):
 * x = k ln2 + r (Cody-Waite), Cephes' polynomial for e^r, 2^k through the exponent bits.
 * About 1 ulp from e^x on [-87, 88]; x is clamped there (e^-87 ~ 1.6e-38 stands for 0).
 * The same operations in a vector lane and in scalar code, so a value does not depend on
 * where it falls in a loop. */
static inline float fast_exp(float x) {
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    float k = (x * 1.44269504f + 12582912.0f) - 12582912.0f; /* round(x / ln 2): 1.5 * 2^23 */
    float r = (x - k * 0.693359375f) - k * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    int32_t bits = ((int32_t)k + 127) << 23;
    float two_k;
    memcpy(&two_k, &bits, 4);
    return p * two_k;
}

static inline float fast_sigmoid(float x) { return 1.0f / (1.0f + fast_exp(-x)); }
static inline float fast_silu(float x) { return x / (1.0f + fast_exp(-x)); }

/* out = x * rsqrt(mean(x^2) + eps) * scale over n values (in place allowed). */
static inline void rms_norm(const float *x, int n, const float *scale, float eps, float *out) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * inv * scale[i];
}

static inline void rms_norm_rows(const float *x, int R, int n, const float *scale, float eps, float *out) {
    for (int r = 0; r < R; r++) rms_norm(x + (size_t)r * n, n, scale, eps, out + (size_t)r * n);
}

/* out [H] = row t of an embedding table, fp32 or bf16 (wtype 0, 1; widened exactly),
 * row-major (panels 0), in a packed matrix's panels of 16 rows (1: element i of row t at
 * ((t / 16) * H + i) * 16 + t % 16) or its panel pairs (2, bf16: at ((t / 16) * ceil(H / 2)
 * + i / 2) * 32 + 2 (t % 16) + i % 2). */
static inline void embed_row(const void *table, int wtype, int panels, int t, int H, float *out) {
    size_t pairs = ((size_t)H + 1) / 2;
    for (int i = 0; i < H; i++) {
        size_t at = panels == 0 ? (size_t)t * H + i
                  : panels == 1 ? ((size_t)(t / 16) * H + i) * 16 + t % 16
                                : ((size_t)(t / 16) * pairs + i / 2) * 32 + 2 * (t % 16) + i % 2;
        if (wtype == 0) {
            out[i] = ((const float *)table)[at];
        } else {
            uint32_t u = (uint32_t)((const uint16_t *)table)[at] << 16;
            memcpy(out + i, &u, 4);
        }
    }
}

/* max and sum of x[0..n), sixteen lanes at a time then across the lanes (one chain per lane
 * instead of one through all n: a score row is a few hundred long); a fixed order. */
static inline float max_of(const float *x, int n) {
    float m = -INFINITY;
    int t = 0;
#if defined(__AVX512F__)
    __m512 v = _mm512_set1_ps(-INFINITY);
    for (; t + 16 <= n; t += 16) v = _mm512_max_ps(v, _mm512_loadu_ps(x + t));
    m = _mm512_reduce_max_ps(v);
#endif
    for (; t < n; t++) m = x[t] > m ? x[t] : m;
    return m;
}

static inline float sum_of(const float *x, int n) {
    float lanes[16] = {0}, z = 0.0f;
    int t = 0;
    for (; t + 16 <= n; t += 16)
        for (int l = 0; l < 16; l++) lanes[l] += x[t + l];
    for (int l = 0; l < 16; l++) z += lanes[l];
    for (; t < n; t++) z += x[t];
    return z;
}

#endif
