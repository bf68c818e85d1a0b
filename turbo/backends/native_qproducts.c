/* The affine-quantized matrices' products, wtype 4 (int4) and 5 (int8) in groups of 64 inputs:
 * their layout and the AVX-512 VNNI tiles (qtile: integer dot products by vpdpbusd, then one
 * fixed float chain), each tile shape a function of its own (qpanels_*). Apart from the float
 * panels (native_products.c, whose packed_range picks the shape, qpacked, and whose linear_packed
 * quantizes the inputs, group_quads) since the kind is its own: integer sums over a layout and
 * an input format of their own. The AVX2 tier's tiles over the same layout: native_avx2.c. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_internal.h"

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
    INTERNAL __attribute__((noinline)) void qpanels_##BITS##_##NP##_##MAXR(const float *x, int R, int k,     \
                                                                            const void *P, int n, float *y,  \
                                                                            int p0, int p1) {                \
        qpanels(x, R, k, P, n, y, p0, p1, BITS, NP, MAXR);                                                   \
    }
#define QPANELS_FOR(BITS) QPANELS_AS(BITS, 4, 6) QPANELS_AS(BITS, 2, 6) QPANELS_AS(BITS, 1, 6) \
    QPANELS_AS(BITS, 2, 12) QPANELS_AS(BITS, 1, 12)
QPANELS_FOR(4)
QPANELS_FOR(8)

#endif /* VNNI512 */
