/* The matrix products (native.c's comment says why they are row-stable): packed fp32 / bf16
 * panels, the drafters' bf16-pair and int8 dot products, the affine int4 / int8 ones; the
 * threads they split over. linear_packed is the one entry point. */
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
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define VNNI512 1 /* vpdpbusd: the int8 products below */
#else
#define VNNI512 0
#endif
#define INT8_DOT (VNNI512 || AVX2_TIER) /* the int8 products, here or in native_avx2.c */

/* Which of the products are compiled in: bit 0 wtype 2 (bf16 pairs), bit 1 wtypes 3, 4 and 5
 * (int8 quads, affine int4 and int8), bit 2 wtype 8 (exact affine, fp32 scales), bit 3 wtype 9
 * (FP8 blocks). Their definitions follow the products they guard. */
int dot_products(void);

int threads = 1;

/* Threads for the matrix products (1 = the caller only). OpenMP: built with -fopenmp this
 * library shares the process's libgomp -- the one torch loaded -- so its parallel regions
 * use torch's pool instead of a second pool competing for the same cores. */
void set_threads(int n) { threads = n < 1 ? 1 : n; }

/* Outputs o0..o0+15 of one row (those below n) from a tile's register. */
static inline void store_outputs(float *row, int n, int o0, v16 v) {
    if (n - o0 >= 16) /* a fixed-size store: a variable count compiles to a slow string copy */
        memcpy(row + o0, &v, 64);
    else
        for (int l = 0; l < n - o0; l++) row[o0 + l] = v[l];
}

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

/* All rows, in row tiles of up to MAXR (TILE(NR) computes rows r..r+NR-1; a verify of up to
 * MAXR - 1 proposals reads each panel once; longer calls split near-evenly). */
#define ROW_TILES(TILE, MAXR)                                                                 \
    for (int r = 0; r < R;) {                                                                 \
        int left = R - r, nr = left <= MAXR ? left : left <= 2 * MAXR ? (left + 1) / 2 : MAXR; \
        switch (nr) {                                                                         \
        case 12: if (MAXR >= 12) TILE(12); break;                                             \
        case 11: if (MAXR >= 11) TILE(11); break;                                             \
        case 10: if (MAXR >= 10) TILE(10); break;                                             \
        case 9: if (MAXR >= 9) TILE(9); break;                                                \
        case 8: if (MAXR >= 8) TILE(8); break;                                                \
        case 7: if (MAXR >= 7) TILE(7); break;                                                \
        case 6: TILE(6); break;                                                               \
        case 5: TILE(5); break;                                                               \
        case 4: TILE(4); break;                                                               \
        case 3: TILE(3); break;                                                               \
        case 2: TILE(2); break;                                                               \
        default: TILE(1);                                                                     \
        }                                                                                     \
        r += nr;                                                                              \
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

#if INT8_DOT
/* ---- affine-quantized matrices: wtype 4 (int4) and 5 (int8), groups of 64 inputs ----
 * P, per panel of 16 outputs and per group g: the outputs' scales, then their biases (bf16,
 * 32 bytes each), then the levels q (u8) in words of 4 inputs x 16 outputs -- int8: 16 words,
 * byte (j, l, t) = q[16p + l, 64g + 4j + t]; int4: 8 words of nibbles, the low one input
 * 4j + t, the high one input 4j + 32 + t (one load gives two words, one AND and one shift).
 * x (group_quads): per row and group its scale s_g, the inputs as s8 x8 = round(x / s_g) and
 * the sum of the rounded inputs s_g sum(x8). Per output, w.x = sum over g, in order, of
 *     (q . x8)_g * (scale_g s_g) + bias_g s_g sum_g(x8)
 * where the integer dot (vpdpbusd) is exact in any order and the float part is one fixed
 * chain of fused multiply-adds: row-stable, like the float products. */
#define QGROUP 64

static inline size_t qgroup_bytes(int bits) { return 64 + (size_t)QGROUP * 16 * bits / 8; }
#endif

#if VNNI512

/* acc + the dot of u8 w with the s8 word at `in`, broadcast (vpdpbusd). As an asm with the sum
 * tied to its register: GCC's builtin lets the register allocator rotate a tile's sums through
 * the stack each pass of the loop (a store and a load on every sum's chain). */
static inline __m512i dot_u8s8(__m512i acc, __m512i w, const int32_t *in) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*in));
    return acc;
}

static inline __m512 widen_bf16(const uint8_t *at) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)at)), 16));
}

static inline __attribute__((always_inline)) void qtile(const uint8_t *x, int R, int k, const uint8_t *P,
                                                        const int bits, int n, int p, int r, float *y, const int NP,
                                                        const int NR) {
    int G = k / QGROUP;
    size_t gb = qgroup_bytes(bits);
    const float *scale = (const float *)x + r * G, *sum = (const float *)x + (size_t)(R + r) * G;
    const int32_t *words = (const int32_t *)x + (size_t)2 * R * G + r;
    /* the float sums, touched once a group, live in memory (the empty asm takes their address,
     * so the compiler cannot keep them in registers): the registers are left to the integer
     * sums of up to 2 panels x 12 rows (more live vectors and the compiler spills those) */
    __m512 acc[4][12];
    for (int a = 0; a < NP; a++)
        for (int b = 0; b < NR; b++) acc[a][b] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int g = 0; g < G; g++) {
        __asm__ volatile("" : : "r"(acc) : "memory");
        const uint8_t *W[4];
        __m512i ia[4][12];
        for (int a = 0; a < NP; a++) {
            W[a] = P + ((size_t)(p + a) * G + g) * gb;
            for (int b = 0; b < NR; b++) ia[a][b] = _mm512_setzero_si512();
        }
        for (int j = 0; j < (bits == 4 ? 8 : 16); j++) {
            /* the rows' words j (and j + 8: the high nibbles' inputs) side by side */
            const int32_t *wj = words + ((size_t)g * 16 + j) * R, *wh = wj + (size_t)8 * R;
            __m512i lo[4], hi[4];
            for (int a = 0; a < NP; a++) {
                __builtin_prefetch(W[a] + 2 * gb + 64 * j);
                __m512i v = _mm512_loadu_si512(W[a] + 64 + 64 * j);
                lo[a] = bits == 4 ? _mm512_and_si512(v, low) : v;
                hi[a] = bits == 4 ? _mm512_and_si512(_mm512_srli_epi16(v, 4), low) : v;
            }
            for (int b = 0; b < NR; b++)
                for (int a = 0; a < NP; a++) {
                    ia[a][b] = dot_u8s8(ia[a][b], lo[a], wj + b);
                    if (bits == 4) ia[a][b] = dot_u8s8(ia[a][b], hi[a], wh + b);
                }
        }
        for (int a = 0; a < NP; a++) {
            __m512 ws = widen_bf16(W[a]), wb = widen_bf16(W[a] + 32);
            for (int b = 0; b < NR; b++) {
                acc[a][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[a][b]),
                                            _mm512_mul_ps(ws, _mm512_set1_ps(scale[b * G + g])), acc[a][b]);
                acc[a][b] = _mm512_fmadd_ps(wb, _mm512_set1_ps(sum[b * G + g]), acc[a][b]);
            }
        }
    }
    for (int a = 0; a < NP; a++)
        for (int b = 0; b < NR; b++) store_outputs(y + (size_t)(r + b) * n, n, (p + a) * 16, (v16)acc[a][b]);
}

#define QTILE(NR) qtile((const uint8_t *)x, R, k, (const uint8_t *)P, bits, n, p, r, y, NP, NR)

/* Panels [p0, p1) of a quantized matrix, NP at a time, rows in tiles of up to MAXR: the integer
 * sums of 2 panels x 12 rows fill the registers (qtile keeps the float sums in memory), so a
 * verify of up to 12 rows reads each panel once; one or two rows take four panels at a time
 * (independent chains hide the latency). */
static inline __attribute__((always_inline)) void qpanels(const float *x, int R, int k, const void *P, int n, float *y,
                                                          int p0, int p1, const int bits, const int NP,
                                                          const int MAXR) {
    for (int p = p0; p + NP <= p1; p += NP)
        ROW_TILES(QTILE, MAXR)
}

/* Each (bits, panels, rows) shape of qpanels in a function of its own: inlined into one large
 * function, GCC keeps a tile's integer sums in memory and rotates them through the stack on
 * every pass (a store on every sum's chain); on its own, the tile's loop runs in registers. */
#define QPANELS_AS(BITS, NP, MAXR)                                                                           \
    static __attribute__((noinline)) void qpanels_##BITS##_##NP##_##MAXR(const float *x, int R, int k,       \
                                                                          const void *P, int n, float *y,     \
                                                                          int p0, int p1) {                   \
        qpanels(x, R, k, P, n, y, p0, p1, BITS, NP, MAXR);                                                   \
    }
#define QPANELS_FOR(BITS) QPANELS_AS(BITS, 4, 6) QPANELS_AS(BITS, 2, 6) QPANELS_AS(BITS, 1, 6) \
    QPANELS_AS(BITS, 2, 12) QPANELS_AS(BITS, 1, 12)
QPANELS_FOR(4)
QPANELS_FOR(8)

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

#endif /* VNNI512 */

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
#if !VNNI512 /* (the AVX2 tier) the same values one at a time: a maximum and an integer sum are
              * exact in any order, nearbyintf rounds to nearest even as vcvtps2dq does */
            float mx = 0.0f;
            for (int i = 0; i < QGROUP; i++) mx = fabsf(xg[i]) > mx ? fabsf(xg[i]) : mx;
            float s = mx > 0.0f ? mx / 127.0f : 1.0f, inv = 1.0f / s;
            int32_t t = 0;
            int8_t q[QGROUP];
            for (int i = 0; i < QGROUP; i++) {
                int32_t qi = (int32_t)nearbyintf(xg[i] * inv);
                t += qi;
                q[i] = (int8_t)(qi > 127 ? 127 : qi < -128 ? -128 : qi);
            }
            for (int j = 0; j < QGROUP / 4; j++) memcpy(words + ((size_t)g * 16 + j) * R + r, q + 4 * j, 4);
            scale[(size_t)r * G + g] = s;
            sum[(size_t)r * G + g] = s * (float)t;
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

/* ---- exact formats read packed: wtype 8, affine int4 / int8 with fp32 scales and biases in
 * any group (turbo/store/quant.py EXACT_INT4, GGUF_FORMATS); wtype 9, FP8 e4m3 codes with a scale per
 * 128 x 128 block (quant.FP8) ----
 * Both are float products: each weight is formed exactly as the torch step dequantizes it, then
 * the fp32 walk of the panels (one chain per output over i in order: row-stable, and for FP8 the
 * bf16 panels' products bit for bit). P starts with a 64-byte header (int32: wtype 8 bits,
 * group; wtype 9 group, panels per scale block pb, the codes' byte offset past the header), then
 *   wtype 8 int8, per panel of 16 outputs and per group g: the 16 scales, the 16 biases (fp32),
 *     then the levels, one byte an output per input (centered, header field 2 = 1: no biases,
 *     the levels signed c = q - 128, each weight c * scale); int4: see int4_lanes below (its sums run in
 *     16 lanes of inputs, then one fixed tree);
 *   wtype 9: per block of pb panels and group g its table, bf16(e4m3(c) * scale) for the 128
 *     codes c >= 0 as high bytes then low bytes (128 each; a negative code: the same with the
 *     sign bit); then per panel and group the codes in chunks of 4 inputs: byte 16L + 8h + 2d + e
 *     of a chunk is output 4L + d at input 2h + e, the order in which the byte interleaves below
 *     bring two inputs' words to each output's dword.
 * w = q * scale + bias is rounded twice, as torch's dequantization (mul then add, not fused). */
#define FHEADER 64

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define EXACT_READS 1
#else
#define EXACT_READS 0
#endif
#if EXACT_READS && defined(__AVX512VBMI__)
#define FP8_READS 1
#else
#define FP8_READS 0
#endif

#if EXACT_READS
static inline size_t fgroup_bytes(int kind, int group) { /* (kind 10: int8 centered, no biases) */
    return (kind == 9 ? 0 : kind == 10 ? 64 : 128) + (size_t)group * 16;
}

static inline __m512 affine_w(__m512i q, __m512 s, __m512 b) {
    const int rn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return _mm512_add_round_ps(_mm512_mul_round_ps(_mm512_cvtepi32_ps(q), s, rn), b, rn);
}

static inline __attribute__((always_inline)) void ftile(const float *x, int k, const uint8_t *P, const uint8_t *T,
                                                        int pb, const int kind, int group, int n, int p, int r,
                                                        float *y, const int NP, const int NR) {
    int G = k / group;
    size_t gb = fgroup_bytes(kind, group);
    v16 acc[4][12];
    for (int a = 0; a < NP; a++)
        for (int b = 0; b < NR; b++) acc[a][b] = (v16){0};
    /* inputs outer, panels inner (as ptile): the panels' independent chains hide the multiply-add
     * latency */
    for (int g = 0; g < G; g++) {
        const float *xg = x + (size_t)r * k + (size_t)g * group;
        const uint8_t *W[4];
        for (int a = 0; a < NP; a++) W[a] = P + ((size_t)(p + a) * G + g) * gb;
        if (kind == 9) {
#if FP8_READS
            __m512i hi0[4], hi1[4], lo0[4], lo1[4];
            for (int a = 0; a < NP; a++) {
                const uint8_t *tb = T + ((size_t)((p + a) / pb) * G + g) * 256;
                hi0[a] = _mm512_loadu_si512(tb), hi1[a] = _mm512_loadu_si512(tb + 64);
                lo0[a] = _mm512_loadu_si512(tb + 128), lo1[a] = _mm512_loadu_si512(tb + 192);
            }
            const __m512i sign = _mm512_set1_epi8((char)0x80), high = _mm512_set1_epi32((int)0xffff0000u);
            for (int j = 0; j < group; j += 4)
                for (int a = 0; a < NP; a++) { /* (each panel's weights used at once: fewer live registers;
                                                * the unrolled panels' chains still overlap) */
                    const uint8_t *at = W[a] + (size_t)16 * j;
                    __builtin_prefetch(at + 2048);
                    __m512i c = _mm512_loadu_si512(at);
                    __m512i hi = _mm512_permutex2var_epi8(hi0[a], c, hi1[a]);
                    __m512i lo = _mm512_permutex2var_epi8(lo0[a], c, lo1[a]);
                    hi = _mm512_ternarylogic_epi32(hi, c, sign, 0xf8); /* hi | (c & 0x80) */
                    /* the bf16 words, two inputs a dword: the low word's as an fp32 by a shift, the high
                     * one's by an AND (port 0 or 5 where a third interleave would take port 5) */
                    __m512i wl = _mm512_unpacklo_epi8(lo, hi), wh = _mm512_unpackhi_epi8(lo, hi);
                    v16 w[4] = {(v16)_mm512_slli_epi32(wl, 16), (v16)_mm512_and_si512(wl, high),
                                (v16)_mm512_slli_epi32(wh, 16), (v16)_mm512_and_si512(wh, high)};
                    for (int t = 0; t < 4; t++)
                        for (int b = 0; b < NR; b++) acc[a][b] += w[t] * xg[(size_t)b * k + j + t];
                }
#endif
        } else { /* int8; kind 10 centered: w = c * scale (see fpacked) */
            const int rn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            __m512 s[4], bias[4];
            for (int a = 0; a < NP; a++)
                s[a] = _mm512_loadu_ps((const float *)W[a]),
                bias[a] = kind == 10 ? s[a] : _mm512_loadu_ps((const float *)W[a] + 16);
            for (int j = 0; j < group; j++) {
                v16 w0[4];
                for (int a = 0; a < NP; a++) {
                    const uint8_t *at = W[a] + (kind == 10 ? 64 : 128) + (size_t)16 * j;
                    __builtin_prefetch(at + 1024);
                    __m128i c = _mm_loadu_si128((const __m128i *)at);
                    w0[a] = kind == 10 ? (v16)_mm512_mul_round_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)), s[a], rn)
                                       : (v16)affine_w(_mm512_cvtepu8_epi32(c), s[a], bias[a]);
                }
                for (int b = 0; b < NR; b++) {
                    float xb = xg[(size_t)b * k + j];
                    for (int a = 0; a < NP; a++) acc[a][b] += w0[a] * xb;
                }
            }
        }
    }
    for (int a = 0; a < NP; a++)
        for (int b = 0; b < NR; b++) store_outputs(y + (size_t)(r + b) * n, n, (p + a) * 16, acc[a][b]);
}

#define FTILE(NR) ftile(x, k, (const uint8_t *)P, T, pb, KIND, group, n, p, r, y, NP, NR)
/* One function per (kind, panels at a time, most rows): as qpanels', each tile's loop keeps its
 * sums in registers on its own. */
#define FPANELS_AS(KIND_, NP_, MAXR)                                                                         \
    static __attribute__((noinline)) void fpanels_##KIND_##_##NP_(const float *x, int R, int k, const void *P, \
                                                                   const uint8_t *T, int pb, int group,      \
                                                                   int n, float *y, int p0, int p1) {        \
        const int KIND = KIND_, NP = NP_;                                                                    \
        for (int p = p0; p + NP <= p1; p += NP)                                                              \
            ROW_TILES(FTILE, MAXR)                                                                           \
    }
/* A decode step's one row (and two), four panels at a time, each in a function of its own: in the
 * functions above GCC keeps such a tile's sums in memory. */
#define FTILE_AS(KIND_, NR_)                                                                                 \
    static __attribute__((noinline)) void ftile_##KIND_##_4_##NR_(const float *x, int R, int k, const void *P, \
                                                                  const uint8_t *T, int pb, int group, int n, \
                                                                  float *y, int p0, int p1) {                \
        (void)R;                                                                                             \
        for (int p = p0; p + 4 <= p1; p += 4)                                                                \
            ftile(x, k, (const uint8_t *)P, T, pb, KIND_, group, n, p, 0, y, 4, NR_);                        \
    }
#define FPANELS_FOR(KIND) FPANELS_AS(KIND, 4, 6) FPANELS_AS(KIND, 2, 6) FPANELS_AS(KIND, 1, 12) \
    FTILE_AS(KIND, 1) FTILE_AS(KIND, 2)
FPANELS_FOR(8)
FPANELS_FOR(10)
#if FP8_READS
FPANELS_FOR(9)
#endif

/* Panels [p0, p1) of a wtype 8 / 9 matrix (P past its header): four panels at a time for one
 * or two rows, two for up to six, then one at a time for up to 12 rows. */
#define FPACKED_AS(KIND)                                                                                     \
    static void fpacked_##KIND(const float *x, int R, int k, const void *P, const uint8_t *T, int pb, int group, \
                               int n, float *y, int p0, int p1) {                                            \
        int p = p0;                                                                                          \
        if (R <= 2) {                                                                                        \
            p = p0 + (p1 - p0) / 4 * 4;                                                                      \
            (R == 1 ? ftile_##KIND##_4_1 : ftile_##KIND##_4_2)(x, R, k, P, T, pb, group, n, y, p0, p);         \
        } else if (R <= 6) {                                                                                 \
            p = p0 + (p1 - p0) / 2 * 2;                                                                      \
            fpanels_##KIND##_2(x, R, k, P, T, pb, group, n, y, p0, p);                                       \
        }                                                                                                    \
        fpanels_##KIND##_1(x, R, k, P, T, pb, group, n, y, p, p1);                                           \
    }
FPACKED_AS(8)
FPACKED_AS(10)
#if FP8_READS
FPACKED_AS(9)
#endif

/* wtype 8 int4 ("lanes of inputs"): per block of 8 outputs (two a panel) and superblock of 128
 * inputs (the last may be shorter: m slices of 16), the groups' scales [ng][8] and biases [ng][8]
 * (fp32), then per output 64 bytes: dword l holds in nibble j the level of input 16j + l. Within
 * a group each output's 16 weights q * scale + bias (rounded twice, as torch) are one register,
 * its table: a level's weight is one in-register permute (vpermps) of it, and a product of 16
 * inputs one fused multiply-add per row. Each output sums 16 lane chains over the slices in order,
 * then the lanes by one fixed tree: the same operations whatever the tile (row-stable). */
#define SUPER 128
#ifndef PREFETCH
#define PREFETCH 2048 /* bytes ahead in a block's stream (measured: 2 KB beat 16 KB) */
#endif

static inline size_t super_bytes(int slices, int group) { return (size_t)64 * (16 * slices / group) + 512; }

static inline size_t octet_bytes(int k, int group) {
    return (size_t)(k / SUPER) * super_bytes(8, group) + (k % SUPER ? super_bytes(k % SUPER / 16, group) : 0);
}

/* Outputs o0..o0+NO-1 of block `blk` (within 8), rows r..r+NR-1. */
static inline __attribute__((always_inline)) void i4tile(const float *x, int k, const uint8_t *P, int group, int n,
                                                         int blk, int o0, int r, float *y, const int NO,
                                                         const int NR) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const int rn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m512 acc[8][12], tab[8];
    for (int o = 0; o < NO; o++)
        for (int b = 0; b < NR; b++) acc[o][b] = _mm512_setzero_ps();
    const uint8_t *at = P + (size_t)blk * octet_bytes(k, group);
    const float *xr = x + (size_t)r * k;
    const int per = group / 16;
    for (int i0 = 0; i0 < k; i0 += SUPER) {
        int m = k - i0 >= SUPER ? 8 : (k - i0) / 16, ng = 16 * m / group;
        const float *sc = (const float *)at, *bi = sc + 8 * ng;
        const uint8_t *codes = at + (size_t)64 * ng;
#define I4SLICE(j)                                                                                          \
    {                                                                                                       \
        /* far ahead, two lines a slice: the block is one sequential stream */                              \
        __builtin_prefetch(at + PREFETCH + 128 * (j));                                                      \
        __builtin_prefetch(at + PREFETCH + 128 * (j) + 64);                                                 \
        if (((j) & (per - 1)) == 0) { /* (groups of 16 * per inputs, per a power of two) */                \
            int g = (j) / per;                                                                              \
            for (int o = 0; o < NO; o++)                                                                    \
                tab[o] = _mm512_add_round_ps(_mm512_mul_round_ps(iota, _mm512_set1_ps(sc[8 * g + o0 + o]), rn), \
                                             _mm512_set1_ps(bi[8 * g + o0 + o]), rn);                       \
        }                                                                                                   \
        for (int o = 0; o < NO; o++) {                                                                      \
            __m512i q = _mm512_srli_epi32(_mm512_loadu_si512(codes + 64 * (o0 + o)), 4 * (j));             \
            __m512 w = _mm512_permutexvar_ps(q, tab[o]);                                                    \
            for (int b = 0; b < NR; b++)                                                                    \
                acc[o][b] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xr + (size_t)b * k + i0 + 16 * (j)), acc[o][b]); \
        }                                                                                                   \
    }
        if (m == 8) { /* (the shifts by constants: one instruction each) */
            I4SLICE(0) I4SLICE(1) I4SLICE(2) I4SLICE(3) I4SLICE(4) I4SLICE(5) I4SLICE(6) I4SLICE(7)
        } else {
            for (int j = 0; j < m; j++) I4SLICE(j)
        }
#undef I4SLICE
        at += super_bytes(m, group);
    }
    for (int o = 0; o < NO; o++) {
        int out = 8 * blk + o0 + o;
        if (out < n)
            for (int b = 0; b < NR; b++) y[(size_t)(r + b) * n + out] = _mm512_reduce_add_ps(acc[o][b]);
    }
}

#define I4TILE(NR) i4tile(x, k, (const uint8_t *)P, group, n, blk, o0, r, y, NO, NR)
/* Blocks [b0, b1), NO outputs at a time, rows in tiles of up to MAXR (registers: NO x NR sums and
 * NO tables); each shape a function of its own (as qpanels'). */
#define I4BLOCKS_AS(NO_, MAXR)                                                                                \
    static __attribute__((noinline)) void i4blocks_##NO_(const float *x, int R, int k, const void *P,         \
                                                          int group, int n, float *y, int b0, int b1) {        \
        const int NO = NO_;                                                                                   \
        for (int blk = b0; blk < b1; blk++)                                                                   \
            for (int o0 = 0; o0 < 8; o0 += NO)                                                                \
                ROW_TILES(I4TILE, MAXR)                                                                       \
    }
#define I4ROWS_AS(NR_)                                                                                        \
    static __attribute__((noinline)) void i4rows_##NR_(const float *x, int R, int k, const void *P, int group, \
                                                        int n, float *y, int b0, int b1) {                     \
        (void)R;                                                                                              \
        for (int blk = b0; blk < b1; blk++) i4tile(x, k, (const uint8_t *)P, group, n, blk, 0, 0, y, 8, NR_); \
    }
I4BLOCKS_AS(4, 6)
I4BLOCKS_AS(2, 12)
I4ROWS_AS(1)
I4ROWS_AS(2)

/* Panels [p0, p1): blocks 2 p0 .. 2 p1; all 8 outputs of a block at once for a decode step's row
 * (or two), four for up to six rows, two for more. */
static void int4_lanes(const float *x, int R, int k, const void *P, int group, int n, float *y, int p0, int p1) {
    if (R <= 2)
        (R == 1 ? i4rows_1 : i4rows_2)(x, R, k, P, group, n, y, 2 * p0, 2 * p1);
    else if (R <= 6)
        i4blocks_4(x, R, k, P, group, n, y, 2 * p0, 2 * p1);
    else
        i4blocks_2(x, R, k, P, group, n, y, 2 * p0, 2 * p1);
}

static void fpacked(const float *x, int R, int k, const void *P, int wtype, int n, float *y, int p0, int p1) {
    const int32_t *h = (const int32_t *)P;
    const uint8_t *D = (const uint8_t *)P + FHEADER;
#if FP8_READS
    if (wtype == 9) {
        fpacked_9(x, R, k, D + h[2], D, h[1], h[0], n, y, p0, p1);
        return;
    }
#endif
    if (h[0] == 4)
        int4_lanes(x, R, k, D, h[1], n, y, p0, p1);
    else if (h[2] == 1) /* int8 centered (header field 2): the levels stored as c = q - 128, each
                         * weight c * scale, one rounding that is exact, as q * scale and its sum
                         * with bias = -128 scale are (native_exact.centered) */
        fpacked_10(x, R, k, D, NULL, 1, h[1], n, y, p0, p1);
    else
        fpacked_8(x, R, k, D, NULL, 1, h[1], n, y, p0, p1);
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

/* ---- bf16 matrices by AMX (wtype 6's panels, TDPBF16PS) ----
 * Where the CPU has AMX-BF16 (and the kernel grants the tile data), a bf16 matrix whose width k
 * is a multiple of 32 is multiplied by the tiles, for every row count alike: the inputs rounded
 * to bf16 (to nearest even, as bf16_pairs), 16 rows to a tile (the last rows zero), each output
 * one accumulator tile walked over k in steps of 32 inputs in order. Row m of a product is made
 * from row m of the inputs alone by the same instructions whatever the other rows hold (zeros,
 * other prompts' rows, a prefill's): row-stable, but no longer the fp32 function (as a bf16
 * model in transformers, the activations are bf16 at each product). The panel_pairs layout is
 * already the tiles' "B" layout: panel p's pairs j..j+15 are one 1 KB tile, 64 bytes a pair row.
 * bf16_products(0) keeps the exact fp32 walk instead (TURBO_BF16_PRODUCTS=exact). */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define AMX_BF16 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define AMX_BF16 0
#endif

#ifndef AMX_AHEAD
#define AMX_AHEAD 0 /* bytes ahead in a panel's stream to prefetch (0: none; 1-8 KB measured no faster) */
#endif

static int amx_state = -1; /* -1 not asked yet, 0 off (absent, refused or turned off), 1 on */

/* bf16 matrices through AMX: want 1 on where the CPU and the kernel allow, 0 off (the exact fp32
 * walk), -1 only ask; returns whether they are on. Set once, before the first product. */
int bf16_products(int want) {
#if AMX_BF16
    if (amx_state < 0 || want >= 0) {
        int ok = 0;
        unsigned a, b, c, d; /* CPUID 7.0 EDX: bit 22 AMX-BF16, bit 24 AMX-TILE */
        if (want != 0 && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 22 & 1) && (d >> 24 & 1))
            ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
        amx_state = ok;
    }
    return amx_state;
#else
    (void)want;
    amx_state = 0;
    return 0;
#endif
}

#if AMX_BF16
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

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

/* One accumulator tile (16 rows x 16 outputs) into y: rows r.., outputs o0.. (those below R, n). */
#define AMX_STORE(T, r, o0)                                                                  \
    if ((r) + 16 <= R && (o0) + 16 <= n) {                                                   \
        _tile_stored(T, y + (size_t)(r) * n + (o0), (long)n * 4);                            \
    } else {                                                                                 \
        _tile_stored(T, buf, 64);                                                            \
        for (int b = 0; b < 16 && (r) + b < R; b++)                                          \
            for (int l = 0; l < 16 && (o0) + l < n; l++) y[(size_t)((r) + b) * n + (o0) + l] = buf[16 * b + l]; \
    }

/* Panels [p0, p1) of a wtype 6 matrix, all Rp rows (xb from amx_rows; kp = k / 2, a multiple of
 * 16): two panels by 32 rows at a time (four accumulator tiles), panels outer so that each panel
 * is read from memory once and the rows from the caches. */
static void amx_panels(const uint16_t *xb, int R, int Rp, int kp, const uint8_t *P, int n, float *y, int p0,
                       int p1, long xs) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    float buf[256] __attribute__((aligned(64)));
    int p = p0;
    if (Rp == 16) /* a decode step or a short verify: bound by reading the weights, four panels
                   * (four streams) at a time */
        for (; p + 4 <= p1; p += 4) {
            const uint8_t *B = P + (size_t)p * kp * 64;
            size_t ps = (size_t)kp * 64;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            /* the B tiles' registers in turn (5, 6, 7, 5; 6, 7, 5, 6; 7, 5, 6, 7): a load waits on the
             * product three before it, not the one just issued */
#define AMX_STEP(J, T0, T1, T2, T3)                                                            \
    {                                                                                          \
        _tile_loadd(4, xb + 2 * (J), xs);                                                      \
        _tile_loadd(T0, B + 64 * (J), 64);                                                     \
        _tile_dpbf16ps(0, 4, T0);                                                              \
        _tile_loadd(T1, B + ps + 64 * (J), 64);                                                \
        _tile_dpbf16ps(1, 4, T1);                                                              \
        _tile_loadd(T2, B + 2 * ps + 64 * (J), 64);                                            \
        _tile_dpbf16ps(2, 4, T2);                                                              \
        _tile_loadd(T3, B + 3 * ps + 64 * (J), 64);                                            \
        _tile_dpbf16ps(3, 4, T3);                                                              \
    }
            int j = 0;
            for (; j + 48 <= kp; j += 48) {
                AMX_STEP(j, 5, 6, 7, 5)
                AMX_STEP(j + 16, 6, 7, 5, 6)
                AMX_STEP(j + 32, 7, 5, 6, 7)
            }
            for (; j < kp; j += 16) AMX_STEP(j, 5, 6, 7, 5)
#undef AMX_STEP
            AMX_STORE(0, 0, p * 16)
            AMX_STORE(1, 0, p * 16 + 16)
            AMX_STORE(2, 0, p * 16 + 32)
            AMX_STORE(3, 0, p * 16 + 48)
        }
    for (; p < p1; p += 2) {
        int two = p + 1 < p1;
        const uint8_t *B0 = P + (size_t)p * kp * 64, *B1 = B0 + (size_t)kp * 64;
        for (int r = 0; r < Rp; r += 32) {
            int tall = r + 16 < Rp;
            const uint8_t *A0 = (const uint8_t *)(xb + (size_t)r * kp * 2), *A1 = A0 + (size_t)16 * xs;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            if (two && tall)
                for (int j = 0; j < kp; j += 16) {
                    _tile_loadd(4, A0 + 4 * j, xs);
                    _tile_loadd(6, B0 + 64 * j, 64);
                    _tile_loadd(5, A1 + 4 * j, xs);
                    _tile_loadd(7, B1 + 64 * j, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            else
                for (int j = 0; j < kp; j += 16) {
#if AMX_AHEAD
                    for (int c = 0; c < 1024; c += 64) {
                        __builtin_prefetch(B0 + 64 * j + AMX_AHEAD + c);
                        if (two) __builtin_prefetch(B1 + 64 * j + AMX_AHEAD + c);
                    }
#endif
                    _tile_loadd(4, A0 + 4 * j, xs);
                    _tile_loadd(6, B0 + 64 * j, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    if (two) {
                        _tile_loadd(7, B1 + 64 * j, 64);
                        _tile_dpbf16ps(1, 4, 7);
                    }
                    if (tall) {
                        _tile_loadd(5, A1 + 4 * j, xs);
                        _tile_dpbf16ps(2, 5, 6);
                        if (two) _tile_dpbf16ps(3, 5, 7);
                    }
                }
            AMX_STORE(0, r, p * 16)
            if (two) AMX_STORE(1, r, p * 16 + 16)
            if (tall) {
                AMX_STORE(2, r + 16, p * 16)
                if (two) AMX_STORE(3, r + 16, p * 16 + 16)
            }
        }
    }
    _tile_release();
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
