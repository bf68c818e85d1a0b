/* The exact formats read packed (wtypes 8 and 9, native_exact.py packs them): affine int8 with
 * fp32 scales and biases, and FP8 e4m3 blocks, each weight formed as torch dequantizes it and then
 * the fp32 walk of the panels (ftile), each tile shape a function of its own; fpacked, the one call
 * packed_range (native_products.c) makes, picks the format and the shape. Apart from the packed
 * panels since these formats are read as stored (a weight is made from a code and its group's
 * scale before the multiply); wtype 8's int4 takes tiles of its own, native_int4_lanes.c.
 * AVX-512 only (EXACT_READS). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_internal.h"

/* ---- exact formats read packed: wtype 8, affine int4 / int8 with fp32 scales and biases in
 * any group (turbo/store/quant.py EXACT_INT4, GGUF_FORMATS); wtype 9, FP8 e4m3 codes with a scale per
 * 128 x 128 block (quant.FP8) ----
 * Both are float products: each weight is formed exactly as the torch step dequantizes it, then
 * the fp32 walk of the panels (one chain per output over i in order: row-stable, and for FP8 the
 * bf16 panels' products bit for bit). P starts with a 64-byte header (int32: wtype 8 bits,
 * group; wtype 9 group, panels per scale block pb, the codes' byte offset past the header), then
 *   wtype 8 int8, per panel of 16 outputs and per group g: the 16 scales, the 16 biases (fp32),
 *     then the levels, one byte an output per input (centered, header field 2 = 1: no biases,
 *     the levels signed c = q - 128, each weight c * scale); int4: see native_int4_lanes.c (its
 *     sums run in 16 lanes of inputs, then one fixed tree);
 *   wtype 9: per block of pb panels and group g its table, bf16(e4m3(c) * scale) for the 128
 *     codes c >= 0 as high bytes then low bytes (128 each; a negative code: the same with the
 *     sign bit); then per panel and group the codes in chunks of 4 inputs: byte 16L + 8h + 2d + e
 *     of a chunk is output 4L + d at input 2h + e, the order in which the byte interleaves below
 *     bring two inputs' words to each output's dword.
 * w = q * scale + bias is rounded twice, as torch's dequantization (mul then add, not fused). */
#define FHEADER 64

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

INTERNAL void fpacked(const float *x, int R, int k, const void *P, int wtype, int n, float *y, int p0, int p1) {
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
