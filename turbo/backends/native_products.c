/* The matrix products' entry point and their dispatch (native.c's comment says why the products
 * are row-stable): linear_packed, the one entry point, with the inputs' conversions it makes (bf16
 * pairs, int8 quads, the affine groups' quads) and a mixed matrix's segments; products, the
 * threads a product splits over; packed_range, which picks a range of panels' product by wtype
 * and tier. Here too the packed fp32 / bf16 panels' tile (ptile, with the drafters' bf16-pair and
 * int8-quad dot products) and the affine groups' choice of tile shape (qpacked): packed_range
 * inlines both. Each other kind is a file of its own behind one call: native_qproducts.c (affine
 * int4 / int8 groups, wtypes 4 and 5), native_exact.c (the exact formats, wtypes 8 and 9; its
 * int4 in native_int4_lanes.c), native_amx.c (bf16 by AMX tiles), native_avx2.c (the AVX2 tier's
 * tiles). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_internal.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define BF16_DOT 1
#else
#define BF16_DOT 0
#endif

/* Which of the products are compiled in: bit 0 wtype 2 (bf16 pairs), bit 1 wtypes 3, 4 and 5
 * (int8 quads, affine int4 and int8), bit 2 wtype 8 (exact affine, fp32 scales), bit 3 wtype 9
 * (FP8 blocks). Their definitions: BF16_DOT above, the others in native_internal.h. */
int dot_products(void);

int threads = 1;

/* Threads for the matrix products (1 = the caller only). OpenMP: built with -fopenmp this
 * library shares the process's libgomp -- the one torch loaded -- so its parallel regions
 * use torch's pool instead of a second pool competing for the same cores. */
void set_threads(int n) { threads = n < 1 ? 1 : n; }

/* ---- packed matrices: the layout the trunk's products use ----
 * A matrix w [n, k] is stored as panels of 16 outputs, P [ceil(n/16), k, 16] (the last
 * panel zero-padded): P[p, i, l] = w[16p + l, i]. A tile keeps NP panels x NR rows of
 * outputs in registers and walks i once: each output is a single chain over i in order,
 * y = ((w_0 x_0 + w_1 x_1) + w_2 x_2) + ..., the same chain in every tile shape, and no
 * horizontal sums (with k of a few hundred those cost as much as the products). */
static inline __attribute__((always_inline)) void ptile(const float *x, int k, const void *P, int wtype, int n,
                                                        int p, int r, float *y, const int NP, const int NR) {
    v16 acc[4][12];
    for (int a = 0; a < NP; a++)
        for (int b = 0; b < NR; b++) acc[a][b] = (v16){0};
#if BF16_DOT
    if (wtype == 2) { /* x: bf16 pairs [R, k] (as uint32), P [panels, k, 16 outputs, 2] bf16 */
        const uint32_t *xp = (const uint32_t *)x;
        for (int i = 0; i < k; i++) {
            __m512bh wv[4];
            for (int a = 0; a < NP; a++) {
                __builtin_prefetch((const uint16_t *)P + ((size_t)(p + a) * k + i) * 32 + 1024);
                wv[a] = (__m512bh)_mm512_loadu_si512((const uint16_t *)P + ((size_t)(p + a) * k + i) * 32);
            }
            for (int b = 0; b < NR; b++) {
                __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xp[(size_t)(r + b) * k + i]);
                for (int a = 0; a < NP; a++) acc[a][b] = (v16)_mm512_dpbf16_ps((__m512)acc[a][b], wv[a], xb);
            }
        }
        k = 0; /* the fp32 walk below is skipped; the stores are shared */
    }
#endif
#if VNNI512
    if (wtype == 3) { /* x: per row its scale then k - 1 words of 4 inputs as u8 (+128); P: see int8_quads */
        const uint32_t *xq = (const uint32_t *)x;
        int panels = (n + 15) / 16, kq = k - 1;
        const float *wscale = (const float *)P;
        const int32_t *corr = (const int32_t *)(wscale + (size_t)panels * 16);
        const int8_t *W = (const int8_t *)(corr + (size_t)panels * 16);
        __m512i iacc[4][12];
        for (int a = 0; a < NP; a++)
            for (int b = 0; b < NR; b++) iacc[a][b] = _mm512_setzero_si512();
        for (int i = 0; i < kq; i++) {
            __m512i wv[4];
            for (int a = 0; a < NP; a++) {
                __builtin_prefetch(W + ((size_t)(p + a) * kq + i) * 64 + 2048);
                wv[a] = _mm512_loadu_si512(W + ((size_t)(p + a) * kq + i) * 64);
            }
            for (int b = 0; b < NR; b++) {
                __m512i xb = _mm512_set1_epi32((int)xq[(size_t)(r + b) * k + 1 + i]);
                for (int a = 0; a < NP; a++) iacc[a][b] = _mm512_dpbusd_epi32(iacc[a][b], xb, wv[a]);
            }
        }
        for (int a = 0; a < NP; a++) {
            __m512 ws = _mm512_loadu_ps(wscale + (size_t)(p + a) * 16);
            __m512i c = _mm512_loadu_si512(corr + (size_t)(p + a) * 16);
            for (int b = 0; b < NR; b++) {
                float rs;
                memcpy(&rs, xq + (size_t)(r + b) * k, 4);
                __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(iacc[a][b], c));
                acc[a][b] = (v16)_mm512_mul_ps(_mm512_mul_ps(v, ws), _mm512_set1_ps(rs));
            }
        }
        k = 0;
    }
#endif
    if (wtype == 6) { /* P [panels, ceil(k/2), 16 outputs, 2] bf16: one load, a shift and an AND
                       * widen two inputs' weights (the "panels" walk: a load-widen and a shift
                       * each); every chain still runs over i in order */
        const uint32_t *W = (const uint32_t *)P;
        size_t kp = (size_t)(k + 1) / 2;
        for (int i = 0; i < k; i += 2) {
            v16 we[4], wo[4];
            for (int a = 0; a < NP; a++) {
                const uint32_t *at = W + ((size_t)(p + a) * kp + i / 2) * 16;
                __builtin_prefetch((const char *)at + 2048);
                u32x16 v;
                memcpy(&v, at, 64);
                u32x16 e = v << 16, o = v & 0xffff0000u;
                memcpy(&we[a], &e, 64);
                memcpy(&wo[a], &o, 64);
            }
            for (int b = 0; b < NR; b++) {
                float x0 = x[(size_t)(r + b) * k + i];
                for (int a = 0; a < NP; a++) acc[a][b] += we[a] * x0;
            }
            if (i + 1 < k)
                for (int b = 0; b < NR; b++) {
                    float x1 = x[(size_t)(r + b) * k + i + 1];
                    for (int a = 0; a < NP; a++) acc[a][b] += wo[a] * x1;
                }
        }
        k = 0;
    }
    for (int i = 0; i < k; i++) {
        v16 wv[4];
        for (int a = 0; a < NP; a++) {
            /* a panel is one sequential stream; asking for it 1024 values ahead keeps a tile
             * with many rows (arithmetic-bound) from waiting on memory (a prefetch never faults) */
            __builtin_prefetch((const char *)P + (((size_t)(p + a) * k + i) * 16 + 1024) * (wtype ? 2 : 4));
            wv[a] = load_w(P, wtype, ((size_t)(p + a) * k + i) * 16);
        }
        for (int b = 0; b < NR; b++) {
            float xb = x[(size_t)(r + b) * k + i];
            for (int a = 0; a < NP; a++) acc[a][b] += wv[a] * xb;
        }
    }
    for (int a = 0; a < NP; a++)
        for (int b = 0; b < NR; b++) store_outputs(y + (size_t)(r + b) * n, n, (p + a) * 16, acc[a][b]);
}

#define PTILE(NR) ptile(x, k, P, wtype, n, p, r, y, NP, NR)
#define PANEL_ROWS(NP_)                                                                       \
    {                                                                                         \
        const int NP = NP_;                                                                   \
        ROW_TILES(PTILE, 12)                                                                  \
    }

/* Panels [p0, p1): four at a time for few rows (four independent chains per row hide the
 * multiply-add latency), two at a time for many (registers: up to 2 x 12 accumulators). */
static inline __attribute__((always_inline)) void packed_as(const float *x, int R, int k, const void *P, int n,
                                                            float *y, int p0, int p1, const int wtype) {
    int p = p0;
    if (R >= 5)
        for (; p + 2 <= p1; p += 2) { PANEL_ROWS(2) }
    else
        for (; p + 4 <= p1; p += 4) { PANEL_ROWS(4) }
    for (; p < p1; p++) { PANEL_ROWS(1) }
}

#if VNNI512
#define QPACKED_AS(BITS)                                                                                     \
    static void qpacked_##BITS(const float *x, int R, int k, const void *P, int n, float *y, int p0, int p1) { \
        if (R > 6) {                                                                                         \
            int p = p0 + (p1 - p0) / 2 * 2;                                                                  \
            qpanels_##BITS##_2_12(x, R, k, P, n, y, p0, p);                                                  \
            qpanels_##BITS##_1_12(x, R, k, P, n, y, p, p1);                                                  \
            return;                                                                                          \
        }                                                                                                    \
        int wide = R <= 2 ? 4 : 2, p = p0 + (p1 - p0) / wide * wide;                                         \
        if (wide == 4)                                                                                       \
            qpanels_##BITS##_4_6(x, R, k, P, n, y, p0, p);                                                   \
        else                                                                                                 \
            qpanels_##BITS##_2_6(x, R, k, P, n, y, p0, p);                                                   \
        qpanels_##BITS##_1_6(x, R, k, P, n, y, p, p1);                                                       \
    }
QPACKED_AS(4)
QPACKED_AS(8)
#endif

#if INT8_DOT
/* x [R, k] (k a multiple of 64) as qtile reads it: G = k / 64 scales per row s_g = max|x_g| / 127
 * (1 for a group of zeros), [R, G]; the sums s_g sum(x8_g), [R, G]; then the inputs x8 as s8 in
 * words of four, [G, 16, R]: a word's R rows side by side, so a tile's broadcasts of one word
 * lie at fixed offsets from one pointer. The bias then multiplies the rounded inputs as the
 * scale does: y is the dequantized w times the rounded x (the exact sum of x would leave the
 * scale's part, larger, uncancelled). */
static uint8_t *group_quads(const float *x, int R, int k) {
    int G = k / QGROUP;
    uint8_t *out = malloc(((size_t)8 * G + k) * R);
    float *scale = (float *)out, *sum = scale + (size_t)R * G;
    int32_t *words = (int32_t *)(sum + (size_t)R * G);
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) {
            const float *xg = x + (size_t)r * k + (size_t)QGROUP * g;
#if !VNNI512 /* (the AVX2 tier) the same values eight at a time: a maximum and an integer sum are
              * exact in any order; vcvtps2dq rounds to nearest even, and |x / s| <= 127 (saturated
              * at the ends as the AVX-512 tier's vpmovsdb does). Scalar, this was a fifth of the
              * serial work between a decode step's products, with the other thread waiting. */
            const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
            __m256 v[8], m = _mm256_setzero_ps();
            for (int c = 0; c < 8; c++) { /* max(|x|, m): a NaN input leaves m, as the scalar max did */
                v[c] = _mm256_loadu_ps(xg + 8 * c);
                m = _mm256_max_ps(_mm256_and_ps(v[c], absmask), m);
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
            float mx = _mm_cvtss_f32(m4), s = mx > 0.0f ? mx / 127.0f : 1.0f;
            __m256 inv = _mm256_set1_ps(1.0f / s);
            __m256i t = _mm256_setzero_si256();
            int8_t q[QGROUP];
            for (int c = 0; c < 8; c += 2) {
                __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(v[c], inv)), b = _mm256_cvtps_epi32(_mm256_mul_ps(v[c + 1], inv));
                t = _mm256_add_epi32(t, _mm256_add_epi32(a, b));
                __m256i w = _mm256_packs_epi32(a, b); /* int16, lanes interleaved: a0-3 b0-3 a4-7 b4-7 */
                __m128i p = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
                /* p: a0-3 b0-3 a4-7 b4-7 as int8 -> a0-7 b0-7 */
                _mm_storeu_si128((__m128i *)(q + 8 * c), _mm_shuffle_epi32(p, _MM_SHUFFLE(3, 1, 2, 0)));
            }
            __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
            t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, _MM_SHUFFLE(1, 0, 3, 2)));
            t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, _MM_SHUFFLE(2, 3, 0, 1)));
            for (int j = 0; j < QGROUP / 4; j++) memcpy(words + ((size_t)g * 16 + j) * R + r, q + 4 * j, 4);
            scale[(size_t)r * G + g] = s;
            sum[(size_t)r * G + g] = s * (float)_mm_cvtsi128_si32(t4);
#else
            __m512 v[4], m = _mm512_setzero_ps();
            for (int c = 0; c < 4; c++) {
                v[c] = _mm512_loadu_ps(xg + 16 * c);
                m = _mm512_max_ps(m, _mm512_abs_ps(v[c]));
            }
            float mx = _mm512_reduce_max_ps(m), s = mx > 0.0f ? mx / 127.0f : 1.0f;
            __m512 inv = _mm512_set1_ps(1.0f / s);
            __m512i t = _mm512_setzero_si512();
            int8_t q[QGROUP];
            for (int c = 0; c < 4; c++) { /* to nearest even; |x / s| <= 127 (saturated at the ends) */
                __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v[c], inv));
                t = _mm512_add_epi32(t, qi);
                _mm_storeu_si128((__m128i *)(q + 16 * c), _mm512_cvtsepi32_epi8(qi));
            }
            for (int j = 0; j < QGROUP / 4; j++) memcpy(words + ((size_t)g * 16 + j) * R + r, q + 4 * j, 4);
            scale[(size_t)r * G + g] = s;
            sum[(size_t)r * G + g] = s * (float)_mm512_reduce_add_epi32(t);
#endif
        }
    return out;
}
#endif

static void packed_range(const float *x, int R, int k, const void *P, int wtype, int n, float *y, int p0, int p1) {
#if AVX2_TIER
    if (wtype == 0 || wtype == 1 || wtype == 6)
        avx2_panels(x, R, k, P, wtype, n, y, p0, p1);
    else
#endif
    if (wtype == 0)
        packed_as(x, R, k, P, n, y, p0, p1, 0);
    else if (wtype == 6)
        packed_as(x, R, k, P, n, y, p0, p1, 6);
#if BF16_DOT
    else if (wtype == 2)
        packed_as(x, R, k, P, n, y, p0, p1, 2);
#endif
#if VNNI512
    else if (wtype == 3)
        packed_as(x, R, k, P, n, y, p0, p1, 3);
    else if (wtype == 4)
        qpacked_4(x, R, k, P, n, y, p0, p1);
    else if (wtype == 5)
        qpacked_8(x, R, k, P, n, y, p0, p1);
#elif AVX2_TIER
    else if (wtype == 3)
        avx2_quads(x, R, k, P, n, y, p0, p1);
    else if (wtype == 4 || wtype == 5)
        avx2_qpanels(x, R, k, P, wtype == 4 ? 4 : 8, n, y, p0, p1);
#endif
#if EXACT_READS
    else if (wtype == 8 || wtype == 9)
        fpacked(x, R, k, P, wtype, n, y, p0, p1);
#endif
    else
        packed_as(x, R, k, P, n, y, p0, p1, 1);
}

/* x [R, k] rounded to bf16 (to nearest, ties to even) in pairs: out [R, ceil(k/2)], the
 * even input in the low half, an odd k's last pair padded with zero. */
static uint32_t *bf16_pairs(const float *x, int R, int k) {
    int kp = (k + 1) / 2;
    uint32_t *out = malloc(sizeof(uint32_t) * (size_t)R * kp);
    for (int r = 0; r < R; r++)
        for (int j = 0; j < kp; j++) {
            uint32_t h[2] = {0, 0};
            for (int t = 0; t < 2 && 2 * j + t < k; t++) {
                uint32_t bits;
                memcpy(&bits, x + (size_t)r * k + 2 * j + t, 4);
                h[t] = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
            }
            out[(size_t)r * kp + j] = h[0] | h[1] << 16;
        }
    return out;
}

/* bf16 matrices by AMX (native_amx.c says how; its tiles' loop there, amx_panels): the inputs
 * rounded to bf16 rows, and the threads' split of the panels, as products' below. */
#if AMX_BF16
/* x [R, k] fp32 -> [Rp, kp] bf16 pairs (Rp = R rounded up to 16; the added rows zero; one row
 * alone is read with stride 0 instead, its tile 16 copies of it: no rows added). */
static uint16_t *amx_rows(const float *x, int R, int k, int Rp) {
    if (R == 1) Rp = 1;
    uint16_t *out = aligned_alloc(64, ((size_t)Rp * k * 2 + 63) / 64 * 64);
    for (int r = 0; r < R; r++) {
        const uint32_t *in = (const uint32_t *)(x + (size_t)r * k);
        uint16_t *o = out + (size_t)r * k;
        int i = 0;
        for (; i + 16 <= k; i += 16) {
            __m512i b = _mm512_loadu_si512(in + i);
            __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
            __m512i h = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), odd), 16);
            _mm256_storeu_si256((__m256i *)(o + i), _mm512_cvtepi32_epi16(h));
        }
        for (; i < k; i++) o[i] = (uint16_t)((in[i] + 0x7fffu + ((in[i] >> 16) & 1u)) >> 16);
    }
    memset(out + (size_t)R * k, 0, (size_t)(Rp - R) * k * 2);
    return out;
}

static void amx_products(const float *x, int R, int k, const void *P, int n, float *y) {
    int Rp = (R + 15) / 16 * 16, kp = k / 2, panels = (n + 15) / 16, groups = (panels + 3) / 4;
    uint16_t *xb = amx_rows(x, R, k, Rp);
    long xs = R == 1 ? 0 : (long)kp * 4; /* (a row's bytes; one row: its copies) */
    int parts = threads < groups ? threads : 1;
    if (parts < 2 || (long)R * n * k < MIN_PARALLEL_MACS) {
        amx_panels(xb, R, Rp, kp, (const uint8_t *)P, n, y, 0, panels, xs);
    } else {
        int chunks = groups < parts * 8 ? groups : parts * 8;
#pragma omp parallel for num_threads(parts) schedule(dynamic, 1)
        for (int c = 0; c < chunks; c++) {
            int lo = (int)((long)groups * c / chunks) * 4, hi = (int)((long)groups * (c + 1) / chunks) * 4;
            amx_panels(xb, R, Rp, kp, (const uint8_t *)P, n, y, lo, hi < panels ? hi : panels, xs);
        }
    }
    free(xb);
}
#endif

/* y [R, n] = x [R, k] @ w^T for a packed w; threads split the panels (in groups of four,
 * the widest tile). */
static void products(const float *x, int R, int k, const void *P, int wtype, int n, float *y) {
    int panels = (n + 15) / 16, groups = (panels + 3) / 4;
    int parts = threads < groups ? threads : 1;
    if (parts < 2 || (long)R * n * k < MIN_PARALLEL_MACS) {
        packed_range(x, R, k, P, wtype, n, y, 0, panels);
        return;
    }
    /* chunks of whole 4-panel groups handed out as threads free up, not one fixed share each: on
     * shared cores (a server's event loop, other processes) a preempted thread's share no longer
     * holds the others up at the barrier. An output's bits do not depend on the thread it runs on. */
    int chunks = groups < parts * 8 ? groups : parts * 8;
#pragma omp parallel for num_threads(parts) schedule(dynamic, 1)
    for (int c = 0; c < chunks; c++) {
        int lo = (int)((long)groups * c / chunks) * 4, hi = (int)((long)groups * (c + 1) / chunks) * 4;
        packed_range(x, R, k, P, wtype, n, y, lo, hi < panels ? hi : panels);
    }
}

/* x [R, k] quantised per row for the int8 products: out [R, 1 + ceil(k/4)], word 0 the
 * row's scale s = max|x| / 127 (fp32 bits), then round(x / s) + 128 as u8, four to a word
 * (an unfinished last word padded with 128, i.e. zero). */
static uint32_t *int8_quads(const float *x, int R, int k) {
    int kq = (k + 3) / 4;
    uint32_t *out = malloc(sizeof(uint32_t) * (size_t)R * (1 + kq));
    for (int r = 0; r < R; r++) {
        const float *xr = x + (size_t)r * k;
        uint32_t *o = out + (size_t)r * (1 + kq);
        float m = 0.0f;
        int i = 0;
#if VNNI512 /* the same values sixteen at a time (a maximum is exact in any order) */
        __m512 vm = _mm512_setzero_ps();
        for (; i + 16 <= k; i += 16) vm = _mm512_max_ps(vm, _mm512_abs_ps(_mm512_loadu_ps(xr + i)));
        m = _mm512_reduce_max_ps(vm);
#endif
        for (; i < k; i++) m = fabsf(xr[i]) > m ? fabsf(xr[i]) : m;
        float s = m > 0.0f ? m / 127.0f : 1.0f, inv = 1.0f / s;
        memcpy(o, &s, 4);
        uint8_t *q = (uint8_t *)(o + 1);
        i = 0;
#if VNNI512 /* rounding to nearest even, as nearbyintf below */
        for (; i + 16 <= k; i += 16) {
            __m512i t = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xr + i), _mm512_set1_ps(inv)));
            t = _mm512_min_epi32(_mm512_max_epi32(t, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
            _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtepi32_epi8(_mm512_add_epi32(t, _mm512_set1_epi32(128))));
        }
#endif
        for (; i < 4 * kq; i++) {
            float v = i < k ? nearbyintf(xr[i] * inv) : 0.0f;
            q[i] = (uint8_t)(int)(128.0f + (v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v));
        }
    }
    return out;
}

int dot_products(void) { return BF16_DOT | INT8_DOT << 1 | EXACT_READS << 2 | FP8_READS << 3; }

/* wtype 7: a matrix whose rows come in segments of their own formats (a layer mixing FP8 or
 * exact int4 with bf16 matrices, a fused matrix of mixed parts). P: int32 count at 0, then from
 * byte 64 per segment {int32 rows, int32 wtype, int64 byte offset from P}; each segment's
 * outputs are its own products, computed alone and copied into place (row-stable as they are). */
static void segments(const float *x, int R, int k, const uint8_t *P, int n, float *y) {
    int count = *(const int32_t *)P;
    const uint8_t *e = P + 64;
    if (count == 1) {
        linear_packed(x, R, k, P + *(const int64_t *)(e + 8), ((const int32_t *)e)[1], n, y);
        return;
    }
    float *t = malloc(sizeof(float) * (size_t)R * n);
    for (int s = 0, at = 0; s < count; s++, e += 16) {
        int rows = ((const int32_t *)e)[0];
        linear_packed(x, R, k, P + *(const int64_t *)(e + 8), ((const int32_t *)e)[1], rows, t);
        for (int r = 0; r < R; r++) memcpy(y + (size_t)r * n + at, t + (size_t)r * rows, sizeof(float) * rows);
        at += rows;
    }
    free(t);
}

void linear_packed(const float *x, int R, int k, const void *P, int wtype, int n, float *y) {
    if (wtype == 7) {
        segments(x, R, k, (const uint8_t *)P, n, y);
    } else if (wtype == 2) {
        uint32_t *xp = bf16_pairs(x, R, k); /* then the same walk, over k / 2 pairs */
        products((const float *)xp, R, (k + 1) / 2, P, 2, n, y);
        free(xp);
    } else if (wtype == 3) {
        uint32_t *xq = int8_quads(x, R, k);
        products((const float *)xq, R, 1 + (k + 3) / 4, P, 3, n, y);
        free(xq);
#if INT8_DOT
    } else if (wtype == 4 || wtype == 5) {
        uint8_t *xq = group_quads(x, R, k);
        products((const float *)xq, R, k, P, wtype, n, y);
        free(xq);
#endif
#if AMX_BF16
    } else if (wtype == 6 && k % 32 == 0 && bf16_products(-1)) {
        amx_products(x, R, k, P, n, y);
#endif
    } else {
        products(x, R, k, P, wtype, n, y);
    }
}
