/* The gated-attention layers (docs/DESIGN.md 2.1): the K/V caches (fp32 or bf16), q/k norms and
 * RoPE, each row's causal attention in a fixed order, the output gate. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_internal.h"

/* Queries whose sums a strip keeps in registers at once: four; on the AVX2 tier one (four
 * queries' 16-lane sums are twice its sixteen 8-lane registers, and GCC then keeps them all in
 * memory). Each query's chains are the same either way, so are its bits. */
#define QUERY_GROUP (AVX2_TIER ? 1 : 4)

/* Attention (scores) of at least this many: a one-row step over a short cache costs less than
 * the threads' barrier on a busy machine (a decode step over 512+ cached positions splits, a 9-row verify over 64+). */
#define MIN_PARALLEL_ATTENTION (1L << 20)
/* The attention scores one call holds at most (4M floats, 16 MB; at least one row's). */
#define SCORE_FLOATS (1L << 22)

/* The 16 lanes summed pairwise (lane i with i + 8, then i + 4, i + 2, i + 1): a fixed
 * order, four dependent adds instead of fifteen. */
static inline float lanes_sum(v16 a) {
    a += __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    a += __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    a += __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    return a[0] + a[1];
}

/* The K/V caches hold fp32 (kv_type 0) or bf16 (kv_type 1) values. bf16 rows are written
 * rounded to nearest (ties to even) and widened exactly to fp32 where attention reads them, a
 * few rows at a time into a buffer, once for all the queries that read them: every sum below
 * is the fp32 cache's code, in its order, over the rounded values. */
static inline size_t kv_bytes(int kt) { return kt ? sizeof(uint16_t) : sizeof(float); }

/* x [n] into a cache row (dst, of the cache's type). */
static void kv_store(void *dst, int kt, const float *x, int n) {
    if (kt == 0) {
        memcpy(dst, x, sizeof(float) * n);
        return;
    }
    for (int i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, x + i, 4);
        ((uint16_t *)dst)[i] = (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    }
}

/* Values [at, at + n) of a cache as fp32: the cache's own (fp32), or widened into buf (bf16). */
static inline const float *kv_floats(const void *c, int kt, size_t at, size_t n, float *buf) {
    if (kt == 0) return (const float *)c + at;
    const uint16_t *h = (const uint16_t *)c + at;
    for (size_t i = 0; i < n; i++) {
        uint32_t u = (uint32_t)h[i] << 16;
        memcpy(buf + i, &u, 4);
    }
    return buf;
}

/* Value `at` of a cache as fp32. */
static inline float kv_value(const void *c, int kt, size_t at) {
    if (kt == 0) return ((const float *)c)[at];
    uint32_t u = (uint32_t)((const uint16_t *)c)[at] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* a . b over n values in a fixed order: 16 lanes, the lanes in order, then the tail (explicit
 * fmaf: a compiler vectorises a plain tail's products apart from its adds in one loop and fuses
 * them in another, and every score of a key must have the same bits whichever loop computed it). */
#if AVX2_TIER
/* On the AVX2 tier the 16-lane sums below as two 8-lane halves (a 16-lane vector there lives in
 * memory: every step a store and a reload), lanes 0-7 and 8-15; lanes_sum's first pair (lane i
 * with i + 8) is then lo + hi, and the rest of its tree is within 8 lanes: the same bits. */
typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *x) {
    v8 v;
    memcpy(&v, x, 32);
    return v;
}

static inline float halves_sum(v8 lo, v8 hi) {
    v8 a = lo + hi;
    a += __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3);
    a += __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5);
    return a[0] + a[1];
}

/* 8 values of a cache as fp32 (bf16 widened exactly) */
static inline v8 kv8(const void *c, int kt, size_t at) {
    if (kt == 0) return load8((const float *)c + at);
    v8 r;
    __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)c + at))), 16);
    memcpy(&r, &u, 32);
    return r;
}
#endif

static inline float dot(const float *a, const float *b, int n) {
    int nv = n & ~15;
#if AVX2_TIER
    v8 lo = {0}, hi = {0};
    for (int i = 0; i < nv; i += 16) {
        lo += load8(a + i) * load8(b + i);
        hi += load8(a + i + 8) * load8(b + i + 8);
    }
    float s = halves_sum(lo, hi);
    for (int i = nv; i < n; i++) s = fmaf(a[i], b[i], s);
    return s;
#else
    v16 acc = {0}, u, v;
    for (int i = 0; i < nv; i += 16) {
        memcpy(&u, a + i, 64);
        memcpy(&v, b + i, 64);
        acc += u * v;
    }
    float s = lanes_sum(acc);
    for (int i = nv; i < n; i++) s = fmaf(a[i], b[i], s);
    return s;
#endif
}

/* a . K[j] for the four rows of K [4, n] at element `at` of a cache of type kt (a bf16 key is
 * widened in registers): four chains side by side (a read once for all), each the operations
 * of `dot` in its order, so each result is `dot`'s bit for bit. */
static inline void dot4(const float *a, const void *K, int kt, size_t at, int n, float *out) {
    int nv = n & ~15;
#if AVX2_TIER
    v8 l0 = {0}, h0 = {0}, l1 = {0}, h1 = {0}, l2 = {0}, h2 = {0}, l3 = {0}, h3 = {0};
    for (int i = 0; i < nv; i += 16) {
        v8 ul = load8(a + i), uh = load8(a + i + 8);
        l0 += ul * kv8(K, kt, at + i), h0 += uh * kv8(K, kt, at + i + 8);
        l1 += ul * kv8(K, kt, at + n + i), h1 += uh * kv8(K, kt, at + n + i + 8);
        l2 += ul * kv8(K, kt, at + 2 * (size_t)n + i), h2 += uh * kv8(K, kt, at + 2 * (size_t)n + i + 8);
        l3 += ul * kv8(K, kt, at + 3 * (size_t)n + i), h3 += uh * kv8(K, kt, at + 3 * (size_t)n + i + 8);
    }
    out[0] = halves_sum(l0, h0), out[1] = halves_sum(l1, h1), out[2] = halves_sum(l2, h2), out[3] = halves_sum(l3, h3);
    for (int j = 0; j < 4; j++)
        for (int i = nv; i < n; i++) out[j] = fmaf(a[i], kv_value(K, kt, at + (size_t)j * n + i), out[j]);
    return;
#endif
    v16 acc0 = {0}, acc1 = {0}, acc2 = {0}, acc3 = {0}, u;
    for (int i = 0; i < nv; i += 16) {
        memcpy(&u, a + i, 64);
        acc0 += u * load_w(K, kt, at + i);
        acc1 += u * load_w(K, kt, at + n + i);
        acc2 += u * load_w(K, kt, at + 2 * (size_t)n + i);
        acc3 += u * load_w(K, kt, at + 3 * (size_t)n + i);
    }
    out[0] = lanes_sum(acc0), out[1] = lanes_sum(acc1), out[2] = lanes_sum(acc2), out[3] = lanes_sum(acc3);
    for (int j = 0; j < 4; j++)
        for (int i = nv; i < n; i++) out[j] = fmaf(a[i], kv_value(K, kt, at + (size_t)j * n + i), out[j]);
}

/* Sixteen vectors' lanes_sum at once, lane v of the result the sum of x[v]: the same pairs
 * added at each level as lanes_sum (i with i + 8, + 4, + 2, + 1), so the same bits, in 15 adds. */
static inline v16 lanes_sums16(const v16 *x) {
    v16 h[8], q[4], e[2];
    for (int i = 0; i < 8; i++)
        h[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + __builtin_shufflevector(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                       30, 31);
    for (int i = 0; i < 4; i++)
        q[i] = __builtin_shufflevector(h[2 * i], h[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + __builtin_shufflevector(h[2 * i], h[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                       31);
    for (int i = 0; i < 2; i++)
        e[i] = __builtin_shufflevector(q[2 * i], q[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + __builtin_shufflevector(q[2 * i], q[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                       31);
    return __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* scale * (q[a] . K[b]) into out[a][b] for four queries and four keys (as dot4): sixteen chains
 * side by side, each key and query chunk read once for all, each chain `dot`'s operations. */
static inline void dot4x4(const float *const *q, const void *K, int kt, size_t at, int n, float scale,
                          float *const *out) {
    int nv = n & ~15;
    v16 acc[16] = {{0}}, k0, k1, k2, k3, u;
    for (int i = 0; i < nv; i += 16) {
        k0 = load_w(K, kt, at + i), k1 = load_w(K, kt, at + n + i);
        k2 = load_w(K, kt, at + 2 * (size_t)n + i), k3 = load_w(K, kt, at + 3 * (size_t)n + i);
        for (int a = 0; a < 4; a++) {
            memcpy(&u, q[a] + i, 64);
            acc[4 * a] += u * k0, acc[4 * a + 1] += u * k1, acc[4 * a + 2] += u * k2, acc[4 * a + 3] += u * k3;
        }
    }
    v16 s = lanes_sums16(acc);
    if (nv < n)
        for (int a = 0; a < 4; a++)
            for (int b = 0; b < 4; b++)
                for (int i = nv; i < n; i++)
                    s[4 * a + b] = fmaf(q[a][i], kv_value(K, kt, at + (size_t)b * n + i), s[4 * a + b]);
    s *= scale;
    for (int a = 0; a < 4; a++) memcpy(out[a], (float *)&s + 4 * a, 16);
}

/* out [d] = sum_t p[t] * V[t] (V [n, d], rows `stride` apart), each element summed over t in
 * order; 64 columns at a time in registers (an accumulator kept in memory would wait on its
 * own store). */
static void weighted_sum(const float *p, const float *V, int n, int d, int stride, float *out) {
    int c = 0;
    for (; c + 64 <= d; c += 64) { /* even and odd t in separate sums (two chains), added at the end */
        v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0}, u;
        int t = 0;
        for (; t + 2 <= n; t += 2) {
            const float *v = V + (size_t)t * stride + c, *w = v + stride;
            float pt = p[t], pw = p[t + 1];
            memcpy(&u, v, 64); a0 += pt * u;
            memcpy(&u, v + 16, 64); a1 += pt * u;
            memcpy(&u, v + 32, 64); a2 += pt * u;
            memcpy(&u, v + 48, 64); a3 += pt * u;
            memcpy(&u, w, 64); b0 += pw * u;
            memcpy(&u, w + 16, 64); b1 += pw * u;
            memcpy(&u, w + 32, 64); b2 += pw * u;
            memcpy(&u, w + 48, 64); b3 += pw * u;
        }
        if (t < n) {
            const float *v = V + (size_t)t * stride + c;
            float pt = p[t];
            memcpy(&u, v, 64); a0 += pt * u;
            memcpy(&u, v + 16, 64); a1 += pt * u;
            memcpy(&u, v + 32, 64); a2 += pt * u;
            memcpy(&u, v + 48, 64); a3 += pt * u;
        }
        a0 += b0, a1 += b1, a2 += b2, a3 += b3;
        memcpy(out + c, &a0, 64); memcpy(out + c + 16, &a1, 64);
        memcpy(out + c + 32, &a2, 64); memcpy(out + c + 48, &a3, 64);
    }
    for (int i = c; i < d; i++) {
        float acc = 0.0f;
        for (int t = 0; t < n; t++) acc += p[t] * V[(size_t)t * stride + i];
        out[i] = acc;
    }
}

/* Rows [t0, t1) of V [*, stride] (columns c..c+64) into the 64-column sums of NQ <= 4 queries
 * (query a: p[a][t] * V[t] for t below its n[a]): acc[a] [2][64] holds its even-t and odd-t sums,
 * each continued in registers over this block's even rows, then its odd rows, in ascending t:
 * weighted_sum's two chains a column, each V row loaded once for all NQ. */
static inline __attribute__((always_inline)) void strip64_block(const int NQ, const float *const *p, const int *n,
                                                                const float *V, int stride, int c, int t0, int t1,
                                                                float *const *acc) {
#if AVX2_TIER /* (NQ is 1: QUERY_GROUP) its 64 columns' even-t and odd-t chains in eight 8-lane sums */
    int end = n[0] < t1 ? n[0] : t1;
    for (int odd = 0; odd < 2; odd++) {
        float *a = acc[0] + 64 * odd;
        v8 s0 = load8(a), s1 = load8(a + 8), s2 = load8(a + 16), s3 = load8(a + 24), s4 = load8(a + 32),
           s5 = load8(a + 40), s6 = load8(a + 48), s7 = load8(a + 56);
        for (int t = t0 + odd; t < end; t += 2) {
            const float *v = V + (size_t)t * stride + c;
            float pt = p[0][t];
            s0 += pt * load8(v), s1 += pt * load8(v + 8), s2 += pt * load8(v + 16), s3 += pt * load8(v + 24);
            s4 += pt * load8(v + 32), s5 += pt * load8(v + 40), s6 += pt * load8(v + 48), s7 += pt * load8(v + 56);
        }
        memcpy(a, &s0, 32), memcpy(a + 8, &s1, 32), memcpy(a + 16, &s2, 32), memcpy(a + 24, &s3, 32);
        memcpy(a + 32, &s4, 32), memcpy(a + 40, &s5, 32), memcpy(a + 48, &s6, 32), memcpy(a + 56, &s7, 32);
    }
    return;
#endif
    int lo = t1, hi = t0;
    for (int a = 0; a < NQ; a++) lo = n[a] < lo ? n[a] : lo, hi = n[a] > hi ? n[a] : hi;
    hi = hi < t1 ? hi : t1;
    for (int odd = 0; odd < 2; odd++) {
        v16 s[QUERY_GROUP][4], u0, u1, u2, u3;
        for (int a = 0; a < NQ; a++) memcpy(s[a], acc[a] + 64 * odd, 256);
        int t = t0 + odd;
        for (; t < lo; t += 2) {
            const float *v = V + (size_t)t * stride + c;
            memcpy(&u0, v, 64), memcpy(&u1, v + 16, 64), memcpy(&u2, v + 32, 64), memcpy(&u3, v + 48, 64);
            for (int a = 0; a < NQ; a++) {
                float pt = p[a][t];
                s[a][0] += pt * u0, s[a][1] += pt * u1, s[a][2] += pt * u2, s[a][3] += pt * u3;
            }
        }
        for (; t < hi; t += 2) { /* the rows only some queries see (a later row's last keys) */
            const float *v = V + (size_t)t * stride + c;
            memcpy(&u0, v, 64), memcpy(&u1, v + 16, 64), memcpy(&u2, v + 32, 64), memcpy(&u3, v + 48, 64);
            for (int a = 0; a < NQ; a++)
                if (t < n[a]) {
                    float pt = p[a][t];
                    s[a][0] += pt * u0, s[a][1] += pt * u1, s[a][2] += pt * u2, s[a][3] += pt * u3;
                }
        }
        for (int a = 0; a < NQ; a++) memcpy(acc[a] + 64 * odd, s[a], 256);
    }
}

/* Queries summed together by strip64_sums (their sums stay in L1 with a block of V's strip). */
#define STRIP_QUERIES 16
/* V's rows a block: 64 x 64 columns (16 KB, fp32) stay in L1 while the queries reread them. */
#define STRIP_ROWS 64

/* weighted_sum's 64-column chains at c for nq <= STRIP_QUERIES queries (query a: out[a][c..c+64)
 * = sum_t p[a][t] * V[t] over its first n[a] rows of V [*, stride]): even-t and odd-t sums
 * (strip64_block, four queries at a time, a block of STRIP_ROWS rows of V after another), then
 * even + odd. Element for element weighted_sum's chains, so its bits; V comes from L1. */
static void strip64_sums(int nq, const float *const *p, const int *n, const float *V, int stride, int c,
                         float *const *out) {
    float sums[STRIP_QUERIES][2 * 64], *acc[STRIP_QUERIES];
    int hi = 0;
    for (int a = 0; a < nq; a++) hi = n[a] > hi ? n[a] : hi, acc[a] = sums[a];
    memset(sums, 0, sizeof(float) * 2 * 64 * nq);
    for (int t0 = 0; t0 < hi; t0 += STRIP_ROWS) {
        int t1 = hi - t0 < STRIP_ROWS ? hi : t0 + STRIP_ROWS;
        for (int q = 0; q < nq; q += QUERY_GROUP) switch (nq - q < QUERY_GROUP ? nq - q : QUERY_GROUP) {
#if QUERY_GROUP == 4
            case 4: strip64_block(4, p + q, n + q, V, stride, c, t0, t1, acc + q); break;
            case 3: strip64_block(3, p + q, n + q, V, stride, c, t0, t1, acc + q); break;
            case 2: strip64_block(2, p + q, n + q, V, stride, c, t0, t1, acc + q); break;
#endif
            default: strip64_block(1, p + q, n + q, V, stride, c, t0, t1, acc + q); break;
        }
    }
    for (int a = 0; a < nq; a++)
        for (int k = 0; k < 64; k += 16) {
            v16 e, o;
            memcpy(&e, sums[a] + k, 64), memcpy(&o, sums[a] + 64 + k, 64);
            e += o;
            memcpy(out[a] + c + k, &e, 64);
        }
}

/* Queries of a kv head (rows x its query heads) summed by weighted_sums, V read once for all. */
#define FEW_QUERIES 64

/* Rows t and t + 1 of V [*, d] (cache type kt), columns c..c+31, `ahead` bytes further on: fetched
 * while this block's rows are summed. */
static inline __attribute__((always_inline)) void prefetch_rows_ahead(const void *V, int kt, int d, int c, int t,
                                                                      size_t ahead) {
    for (size_t b = 0; b < 2 * (size_t)d * kv_bytes(kt); b += (size_t)d * kv_bytes(kt))
        for (size_t at = 0; at < 32 * kv_bytes(kt); at += 64)
            __builtin_prefetch((const char *)V + ((size_t)t * d + c) * kv_bytes(kt) + ahead + b + at, 0, 2);
}

/* Rows [t0, t1) of V [*, d] (cache type kt) into the sums of NQ queries over 32 columns at c:
 * acc [NQ][2][d] (even t, odd t), loaded into registers, summed row by row, stored back. */
static inline __attribute__((always_inline)) void strip_sums(const int NQ, const float *const *p, const void *V,
                                                             int kt, int d, int c, int t0, int t1,
                                                             float *const *acc, size_t ahead) {
#if AVX2_TIER /* (NQ is 1: QUERY_GROUP) its 32 columns' even-t and odd-t chains in eight 8-lane sums */
    float *a = acc[0];
    const float *pa = p[0];
    v8 e0 = load8(a + c), e1 = load8(a + c + 8), e2 = load8(a + c + 16), e3 = load8(a + c + 24);
    v8 o0 = load8(a + d + c), o1 = load8(a + d + c + 8), o2 = load8(a + d + c + 16), o3 = load8(a + d + c + 24);
    int t = t0;
    if (t < t1 && (t & 1)) {
        size_t at = (size_t)t * d + c;
        o0 += pa[t] * kv8(V, kt, at), o1 += pa[t] * kv8(V, kt, at + 8);
        o2 += pa[t] * kv8(V, kt, at + 16), o3 += pa[t] * kv8(V, kt, at + 24);
        t++;
    }
    for (; t + 2 <= t1; t += 2) {
        if (ahead) /* the next block's same columns, while this one is summed */
            prefetch_rows_ahead(V, kt, d, c, t, ahead);
        size_t at = (size_t)t * d + c, nx = at + (size_t)d;
        e0 += pa[t] * kv8(V, kt, at), e1 += pa[t] * kv8(V, kt, at + 8);
        e2 += pa[t] * kv8(V, kt, at + 16), e3 += pa[t] * kv8(V, kt, at + 24);
        o0 += pa[t + 1] * kv8(V, kt, nx), o1 += pa[t + 1] * kv8(V, kt, nx + 8);
        o2 += pa[t + 1] * kv8(V, kt, nx + 16), o3 += pa[t + 1] * kv8(V, kt, nx + 24);
    }
    if (t < t1) {
        size_t at = (size_t)t * d + c;
        e0 += pa[t] * kv8(V, kt, at), e1 += pa[t] * kv8(V, kt, at + 8);
        e2 += pa[t] * kv8(V, kt, at + 16), e3 += pa[t] * kv8(V, kt, at + 24);
    }
    memcpy(a + c, &e0, 32), memcpy(a + c + 8, &e1, 32), memcpy(a + c + 16, &e2, 32), memcpy(a + c + 24, &e3, 32);
    memcpy(a + d + c, &o0, 32), memcpy(a + d + c + 8, &o1, 32), memcpy(a + d + c + 16, &o2, 32);
    memcpy(a + d + c + 24, &o3, 32);
#else
    v16 e[QUERY_GROUP][2], o[QUERY_GROUP][2];
    for (int a = 0; a < NQ; a++) {
        memcpy(&e[a][0], acc[a] + c, 64), memcpy(&e[a][1], acc[a] + c + 16, 64);
        memcpy(&o[a][0], acc[a] + d + c, 64), memcpy(&o[a][1], acc[a] + d + c + 16, 64);
    }
    int t = t0;
    if (t < t1 && (t & 1)) {
        v16 u0 = load_w(V, kt, (size_t)t * d + c), u1 = load_w(V, kt, (size_t)t * d + c + 16);
        for (int a = 0; a < NQ; a++) o[a][0] += p[a][t] * u0, o[a][1] += p[a][t] * u1;
        t++;
    }
    for (; t + 2 <= t1; t += 2) {
        if (ahead) /* the next block's same columns, while this one is summed */
            prefetch_rows_ahead(V, kt, d, c, t, ahead);
        v16 u0 = load_w(V, kt, (size_t)t * d + c), u1 = load_w(V, kt, (size_t)t * d + c + 16);
        v16 w0 = load_w(V, kt, (size_t)(t + 1) * d + c), w1 = load_w(V, kt, (size_t)(t + 1) * d + c + 16);
        for (int a = 0; a < NQ; a++) {
            e[a][0] += p[a][t] * u0, e[a][1] += p[a][t] * u1;
            o[a][0] += p[a][t + 1] * w0, o[a][1] += p[a][t + 1] * w1;
        }
    }
    if (t < t1) {
        v16 u0 = load_w(V, kt, (size_t)t * d + c), u1 = load_w(V, kt, (size_t)t * d + c + 16);
        for (int a = 0; a < NQ; a++) e[a][0] += p[a][t] * u0, e[a][1] += p[a][t] * u1;
    }
    for (int a = 0; a < NQ; a++) {
        memcpy(acc[a] + c, &e[a][0], 64), memcpy(acc[a] + c + 16, &e[a][1], 64);
        memcpy(acc[a] + d + c, &o[a][0], 64), memcpy(acc[a] + d + c + 16, &o[a][1], 64);
    }
#endif
}

/* Rows [t0, t1) into the sums of nq <= 4 queries, strip after strip. */
static void rows_sums(int nq, const float *const *p, const void *V, int kt, int d, int t0, int t1,
                      float *const *acc, size_t ahead) {
    for (int c = 0; c < d; c += 32) switch (nq) {
#if QUERY_GROUP == 4
        case 4: strip_sums(4, p, V, kt, d, c, t0, t1, acc, ahead); break;
        case 3: strip_sums(3, p, V, kt, d, c, t0, t1, acc, ahead); break;
        case 2: strip_sums(2, p, V, kt, d, c, t0, t1, acc, ahead); break;
#endif
        default: strip_sums(1, p, V, kt, d, c, t0, t1, acc, ahead); break;
    }
}

/* The rows of V [*, d] one block of the cache (16 KB) holds: it stays in L1 while the strips
 * and the queries reread it, so each cached value comes from memory once per step. */
#define V_BLOCK_BYTES 16384

/* weighted_sum for `nq` queries at once, each out[q] = sum_t p[q][t] * V[t] over its first
 * n[q] rows, for d a multiple of 64: element for element the same chains as weighted_sum
 * (even and odd t in two sums added at the end, t ascending in each), so the bits are
 * weighted_sum's. V (cache type kt; bf16 widened in registers) is read a block of rows at a
 * time, four queries at once; acc [nq, 2, d]: the sums between blocks. */
static void weighted_sums(const float *const *p, const int *n, int nq, const void *V, int kt, int d, float *acc,
                          float *const *out) {
    int most = 0, block = V_BLOCK_BYTES / (d * (int)kv_bytes(kt));
    float *sums[FEW_QUERIES];
    memset(acc, 0, sizeof(float) * (size_t)nq * 2 * d);
    for (int q = 0; q < nq; q++) most = n[q] > most ? n[q] : most, sums[q] = acc + (size_t)q * 2 * d;
    block = block < 2 ? 2 : block & ~1;
    for (int t0 = 0; t0 < most; t0 += block) {
        int t1 = most - t0 < block ? most : t0 + block;
        for (int q0 = 0; q0 < nq; q0 += QUERY_GROUP) {
            int g = nq - q0 < QUERY_GROUP ? nq - q0 : QUERY_GROUP, common = t1;
            for (int a = 0; a < g; a++) common = n[q0 + a] < common ? n[q0 + a] : common;
            if (common > t0) /* the first group prefetches the next block */
                rows_sums(g, p + q0, V, kt, d, t0, common, sums + q0, q0 ? 0 : (size_t)block * d * kv_bytes(kt));
            for (int a = 0; a < g; a++) { /* a query's rows past the group's (a verify's later rows) */
                int end = n[q0 + a] < t1 ? n[q0 + a] : t1, from = common > t0 ? common : t0;
                if (end > from) rows_sums(1, p + q0 + a, V, kt, d, from, end, sums + q0 + a, 0);
            }
        }
    }
    for (int q = 0; q < nq; q++) {
        const float *a = sums[q], *b = a + d;
        v16 x, y;
        for (int c = 0; c < d; c += 16) {
            memcpy(&x, a + c, 64);
            memcpy(&y, b + c, 64);
            x += y;
            memcpy(out[q] + c, &x, 64);
        }
    }
}

/* NeoX rotate-half on the first `rot` dims of one head vector, at position pos (or, where pf
 * is given, at position pf[i] for frequency i: the multimodal rotation, turbo/vision/positions.py). */
static void rope(float *x, int rot, const float *inv_freq, int pos, const int *pf) {
    int half = rot / 2;
    for (int i = 0; i < half; i++) {
        float f = (float)(pf ? pf[i] : pos) * inv_freq[i], c = cosf(f), s = sinf(f);
        float a = x[i], b = x[i + half];
        x[i] = a * c + (-b) * s;
        x[i + half] = b * c + a * s;
    }
}

/* Columns of V summed per strip, every query of a kv head over one strip before the next:
 * a strip of a long cache (n x 64 floats) stays in the cache while the queries reread it,
 * so each cached value comes from memory once per step. */
#define V_STRIP 64
/* How far ahead of the scores the keys are fetched (keys; a few KB). */
#define KEYS_AHEAD 16
/* Keys scored against each quad of queries in turn (a multiple of 4). */
#define KEY_TILE 16

/* Kv head j of attn_layer: the scores of every row's queries on its keys K [N, hd], their
 * softmax, and the gated weighted sums of V [N, hd] into att (K, V of L->kv_type). */
static void attend_kv_head(const Layer *L, int j, int R, int p0, int start, int N, const void *K, const void *V,
                           const float *proj, const float *qs, float *scores, float *att) {
    int nh = L->heads, hd = L->head_dim, groups = nh / L->kv_heads, P = 2 * nh * hd + 2 * L->kv_heads * hd;
    int kt = L->kv_type;
    float scale = 1.0f / sqrtf((float)hd);
    /* [KEY_TILE, hd]: bf16 keys widened (a tile that many queries read, or the last N % 4) */
    float *keys = kt ? malloc(sizeof(float) * KEY_TILE * hd) : NULL;
    /* four keys at a time against four queries at a time, read from the cache (bf16 widened in
     * registers), each key and query read once for the others; each score is still one `dot`.
     * A tile of KEY_TILE keys (a few KB: it stays in L1) against each quad of queries in turn,
     * so a query comes from the outer caches once a tile, not once per four keys.
     * A row also scores the tile's keys past its own, never read. */
    int t = 0;
    size_t kb = kv_bytes(kt), ahead = KEYS_AHEAD * (size_t)hd * kb; /* prefetch: a long cache comes from memory */
    for (int tile = KEY_TILE; tile; tile = tile > 4 ? 4 : 0) /* whole tiles, then four keys at a time */
        for (; t + tile <= N; t += tile) {
            const char *next = (const char *)K + ((size_t)t * hd) * kb + ahead;
            for (size_t b = 0; b < (size_t)tile * hd * kb; b += 64) __builtin_prefetch(next + b, 0, 2);
            const float *q4[4];
            float *s4[4];
            int nq = 0, r0 = t < p0 - start ? 0 : t - (p0 - start);
            /* a bf16 tile many quads read: widened once (exactly), not in registers once a quad */
            const void *Kt = K;
            int ktt = kt;
            size_t at = (size_t)t * hd;
            if (kt && tile == KEY_TILE && (R - r0) * groups >= 8)
                Kt = kv_floats(K, kt, at, (size_t)tile * hd, keys), ktt = 0, at = 0;
            for (int r = r0; r < R; r++)
                for (int hq = j * groups; hq < (j + 1) * groups; hq++) {
                    size_t qi = (size_t)r * nh + hq;
                    q4[nq] = qs + qi * hd, s4[nq] = scores + qi * N + t;
                    if (QUERY_GROUP == 4 && ++nq == 4) {
                        for (int k = 0; k < tile; k += 4) {
                            float *s4k[4] = {s4[0] + k, s4[1] + k, s4[2] + k, s4[3] + k};
                            dot4x4(q4, Kt, ktt, at + (size_t)k * hd, hd, scale, s4k);
                        }
                        nq = 0;
                    } else if (QUERY_GROUP == 1) { /* dot4x4's sixteen chains, four at a time: dot4's, the same bits */
                        for (int k = 0; k < tile; k += 4) {
                            dot4(q4[0], Kt, ktt, at + (size_t)k * hd, hd, s4[0] + k);
                            for (int e = 0; e < 4; e++) s4[0][k + e] *= scale;
                        }
                    }
                }
            for (int a = 0; a < nq; a++)
                for (int k = 0; k < tile; k += 4) {
                    dot4(q4[a], Kt, ktt, at + (size_t)k * hd, hd, s4[a] + k);
                    for (int e = 0; e < 4; e++) s4[a][k + e] *= scale;
                }
        }
    for (; t < N; t++) {
        const float *k1 = kv_floats(K, kt, (size_t)t * hd, hd, keys);
        for (int r = t < p0 - start ? 0 : t - (p0 - start); r < R; r++)
            for (int hq = j * groups; hq < (j + 1) * groups; hq++) {
                size_t qi = (size_t)r * nh + hq;
                scores[qi * N + t] = dot(qs + qi * hd, k1, hd) * scale;
            }
    }
    free(keys);
    for (int r = 0; r < R; r++)
        for (int hq = j * groups; hq < (j + 1) * groups; hq++) {
            int n = p0 + r + 1 - start;
            float *sr = scores + ((size_t)r * nh + hq) * N;
            float m = max_of(sr, n);
            for (int t = 0; t < n; t++) sr[t] = fast_exp(sr[t] - m); /* (vectorises) */
            float z = sum_of(sr, n);
            for (int t = 0; t < n; t++) sr[t] /= z;
        }
    if (R * groups <= FEW_QUERIES) { /* a decode step or a verify: V streamed once, a block at a time */
        const float *p[FEW_QUERIES];
        float *out[FEW_QUERIES], acc[FEW_QUERIES * 2 * 256];
        int n[FEW_QUERIES], nq = 0;
        for (int r = 0; r < R; r++)
            for (int hq = j * groups; hq < (j + 1) * groups; hq++, nq++) {
                p[nq] = scores + ((size_t)r * nh + hq) * N, n[nq] = p0 + r + 1 - start;
                out[nq] = att + ((size_t)r * nh + hq) * hd;
            }
        if (hd <= 256 && hd % 64 == 0) { /* (weighted_sum's one-chain columns would compile differently) */
            weighted_sums(p, n, nq, V, kt, hd, acc, out);
            goto gated;
        }
    }
    { /* a prefill chunk's many queries: a bf16 V widened whole first ([N, hd], a chunk's rows share it) */
        float *wide = kt ? malloc(sizeof(float) * (size_t)N * hd) : NULL;
        const float *vf = kv_floats(V, kt, 0, (size_t)N * hd, wide);
        int nq = R * groups;
        for (int c = 0; c < hd; c += V_STRIP)
            for (int q0 = 0; q0 < nq; q0 += STRIP_QUERIES) { /* queries in order (row, head) */
                int g = nq - q0 < STRIP_QUERIES ? nq - q0 : STRIP_QUERIES, n[STRIP_QUERIES];
                const float *p[STRIP_QUERIES];
                float *out[STRIP_QUERIES];
                for (int a = 0; a < g; a++) {
                    int r = (q0 + a) / groups, hq = j * groups + (q0 + a) % groups;
                    p[a] = scores + ((size_t)r * nh + hq) * N, n[a] = p0 + r + 1 - start;
                    out[a] = att + ((size_t)r * nh + hq) * hd;
                }
                if (hd - c < V_STRIP) /* a last narrower strip: weighted_sum's one chain a column */
                    for (int a = 0; a < g; a++) weighted_sum(p[a], vf + c, n[a], hd - c, hd, out[a] + c);
                else
                    strip64_sums(g, p, n, vf, hd, c, out);
            }
        free(wide);
    }
gated:
    for (int r = 0; r < R; r++)
        for (int hq = j * groups; hq < (j + 1) * groups; hq++) {
            float *a = att + ((size_t)r * nh + hq) * hd;
            const float *gate = proj + (size_t)r * P + hq * 2 * hd + hd;
            for (int i = 0; i < hd; i++) a[i] *= fast_sigmoid(gate[i]);
        }
}

/* A block of one sequence's rows that attend together: their scores [rows, heads, n] in one
 * buffer (n: the keys its last row sees). */
typedef struct {
    int seq, r0, rows, n;
    size_t scores; /* its scores' offset in the call's buffer */
} AttnBlock;

/* One gated-attention layer over the rows of nseq sequences, then its MLP; x [sum rows,
 * hidden] is the residual stream (sequence 0's rows, then 1's, ...; updated in place). The
 * matrix products run over all the rows at once (each row's bits whatever rows share the
 * call); norms, RoPE, the K/V store and attention per sequence on its own cache, each row or
 * (block, kv head) whole on one thread. Sequence s's rows[s] rows sit at positions p0[s]..;
 * kc[s], vc[s] [kv_heads, cap[s], head_dim] of L->kv_type: its rows' K and V are written at
 * p0[s]..p0[s]+rows[s]-1; its row r attends to positions start[s]..p0[s]+r, exactly its own
 * causal prefix (start: the first cached one). rpos (NULL: none) [nseq]: where rpos[s] is given,
 * sequence s's row r rotates at rpos[s][r * rot/2 + i] for frequency i (a prompt with images,
 * or the rows after one: index + delta), else at its position. */
void attn_layer_seqs(const Layer *L, float *x, int nseq, const int *rows, const int *p0, const int *start,
                     void *const *kc, void *const *vc, const int *cap, const int *const *rpos) {
    int H = L->hidden, nh = L->heads, nkv = L->kv_heads, hd = L->head_dim, kt = L->kv_type;
    int P = 2 * nh * hd + 2 * nkv * hd, R = 0, nb = 0;
    size_t kb = kv_bytes(kt);
    for (int s = 0; s < nseq; s++) R += rows[s];
    int *seq = malloc(sizeof(int) * (size_t)R * 2), *local = seq + R; /* row -> its sequence, its row there */
    int *first = malloc(sizeof(int) * (size_t)nseq);                   /* a sequence's first row */
    for (int s = 0, at = 0; s < nseq; at += rows[s++]) {
        first[s] = at;
        for (int r = 0; r < rows[s]; r++) seq[at + r] = s, local[at + r] = r;
    }
    /* each sequence's rows attend in blocks whose scores [rows, heads, N] fit SCORE_FLOATS: memory
     * stays a chunk's however long the cache (the rows are independent: blocks change no value) */
    AttnBlock *blocks = malloc(sizeof(AttnBlock) * (size_t)R);
    for (int s = 0; s < nseq; s++) {
        int N = p0[s] + rows[s] - start[s]; /* keys the last row sees; row r sees the first N - (R - 1 - r) */
        int block = (int)(SCORE_FLOATS / ((long)nh * N));
        block = block < 1 ? 1 : block > rows[s] ? rows[s] : block;
        for (int r0 = 0; r0 < rows[s]; r0 += block) {
            int n = rows[s] - r0 < block ? rows[s] - r0 : block;
            blocks[nb++] = (AttnBlock){s, r0, n, p0[s] + r0 + n - start[s], 0};
        }
    }
    size_t most = 0; /* the largest group's scores: consecutive blocks while they fit SCORE_FLOATS together */
    for (int b = 0, g = 0; b < nb; b = g) {
        size_t sum = 0;
        for (g = b; g < nb; g++) {
            size_t f = (size_t)blocks[g].rows * nh * blocks[g].n;
            if (g > b && sum + f > SCORE_FLOATS) break;
            blocks[g].scores = sum, sum += f;
        }
        most = sum > most ? sum : most;
    }
    float *h = malloc(sizeof(float) * (size_t)R * H);
    float *proj = malloc(sizeof(float) * (size_t)R * P);
    float *att = malloc(sizeof(float) * (size_t)R * nh * hd);
    float *kbuf = malloc(sizeof(float) * (size_t)R * hd); /* [R, hd] */
    float *qs = malloc(sizeof(float) * (size_t)R * nh * hd);
    float *scores = malloc(sizeof(float) * most);
    float *y = malloc(sizeof(float) * (size_t)R * H);
    rms_norm_rows(x, R, H, L->in_norm, L->eps, h);
    linear_packed(h, R, H, L->qkv, L->wtype, P, proj);
    int parts = row_parts(R, (long)nh * hd);
#pragma omp parallel for if (parts > 1) num_threads(parts) schedule(static)
    for (int row = 0; row < R; row++) { /* K and V of every row into its cache first */
        const float *pr = proj + (size_t)row * P;
        int s = seq[row], pos = p0[s] + local[row];
        for (int j = 0; j < nkv; j++) {
            size_t at = ((size_t)j * cap[s] + pos) * hd;
            float *krow = kbuf + (size_t)row * hd; /* the row's K, normed and rotated, before it is stored */
            rms_norm(pr + 2 * nh * hd + j * hd, hd, L->k_norm, L->eps, krow);
            rope(krow, L->rot, L->inv_freq, pos, rpos && rpos[s] ? rpos[s] + (size_t)local[row] * (L->rot / 2) : NULL);
            kv_store((char *)kc[s] + at * kb, kt, krow, hd);
            kv_store((char *)vc[s] + at * kb, kt, pr + 2 * nh * hd + nkv * hd + j * hd, hd);
        }
    }
#pragma omp parallel for if (parts > 1) num_threads(parts) schedule(static)
    for (int row = 0; row < R; row++) /* every row's queries, normed and rotated */
        for (int hq = 0; hq < nh; hq++) {
            float *q = qs + ((size_t)row * nh + hq) * hd;
            rms_norm(proj + (size_t)row * P + hq * 2 * hd, hd, L->q_norm, L->eps, q);
            int s = seq[row];
            rope(q, L->rot, L->inv_freq, p0[s] + local[row],
                 rpos && rpos[s] ? rpos[s] + (size_t)local[row] * (L->rot / 2) : NULL);
        }
    /* the (block, kv head) pairs of a group are independent: each is attended whole by one
     * thread, in the same order whatever the thread count (and the row count, and the other
     * sequences: each score and sum is its own chain) */
    for (int b = 0, g = 0; b < nb; b = g) {
        long work = 0;
        for (g = b; g < nb && (g == b || blocks[g].scores); g++) /* (a group's first block: offset 0) */
            work += (long)blocks[g].rows * nh * blocks[g].n * hd;
        int units = (g - b) * nkv;
        parts = threads < units ? threads : units;
        if (work < MIN_PARALLEL_ATTENTION) parts = 1;
#pragma omp parallel for num_threads(parts) schedule(dynamic, 1)
        for (int u = 0; u < units; u++) {
            const AttnBlock *bk = blocks + b + u / nkv;
            int s = bk->seq, j = u % nkv;
            size_t at = ((size_t)j * cap[s] + start[s]) * hd, row = (size_t)first[s] + bk->r0;
            attend_kv_head(L, j, bk->rows, p0[s] + bk->r0, start[s], bk->n, (const char *)kc[s] + at * kb,
                           (const char *)vc[s] + at * kb, proj + row * P, qs + row * nh * hd, scores + bk->scores,
                           att + row * nh * hd);
        }
    }
    linear_packed(att, R, nh * hd, L->o, L->wtype, H, y);
    for (size_t i = 0; i < (size_t)R * H; i++) x[i] += y[i];
    free(seq); free(first); free(blocks);
    free(h); free(proj); free(att); free(kbuf); free(qs); free(scores); free(y);
    mlp_block(L, x, R);
}

/* attn_layer_seqs for one sequence of R rows at p0.. (its arguments, one of each). */
void attn_layer(const Layer *L, float *x, int R, int p0, int start, void *kc, void *vc, int cap) {
    attn_layer_seqs(L, x, 1, &R, &p0, &start, &kc, &vc, &cap, NULL);
}
