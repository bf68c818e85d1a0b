/* The AVX2 tier's matrix products (TURBO_ISA=avx2, or a CPU with AVX2 + FMA + F16C and no
 * AVX-512: AMD Zen 2/3, Intel client CPUs since Alder Lake). The AVX-512 tiles (native_products.c,
 * native_qproducts.c) keep up to 2 x 12 sixteen-lane sums in registers; written for eight-lane
 * registers (16 of them) the compiler spills most of them on every step, so this tier has tiles
 * of its own, over the same packed layouts (packed.py), and the same chains:
 *
 * - float panels (wtypes 0, 1, 6): each output one fused multiply-add chain over the inputs in
 *   order, as ptile's -- the same bits as the AVX-512 tier's products;
 * - affine int4 / int8 in groups of 64 (wtypes 4, 5) and the drafters' int8 quads (wtype 3):
 *   the integer dot products, which AVX2 has no vpdpbusd for, from vpmaddubsw (u8 x s8 pairs
 *   to int16) and vpmaddwd (int16 pairs to int32). Integer sums are exact in any order as long
 *   as none saturates, so the levels that could (a u8 above 15 times an s8 up to 128: pairs
 *   past 32767) are split into their nibbles, 16 hi + lo; then the float part is qtile's fixed
 *   chain of fused multiply-adds, and every output is bit for bit the AVX-512 tier's.
 *
 * A tile is NP panels (16 outputs, two registers each) by NR rows, 2 NP NR <= 12 sums. Rows go
 * in blocks of ROW_BLOCK, panels inside: a block's inputs stay in the caches while every panel
 * of the call's share streams past them once. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_internal.h"

#if AVX2_TIER
#include <immintrin.h>

#define ROW_BLOCK 96

/* Outputs o0..o0+15 of one row (those below n) from a tile's two registers (masked stores: a
 * local array to copy through would keep the tile's sums in memory throughout). */
static inline void store16(float *row, int n, int o0, __m256 lo, __m256 hi) {
    if (n - o0 >= 16) {
        _mm256_storeu_ps(row + o0, lo);
        _mm256_storeu_ps(row + o0 + 8, hi);
    } else {
        __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), left = _mm256_set1_epi32(n - o0);
        _mm256_maskstore_ps(row + o0, _mm256_cmpgt_epi32(left, lane), lo);
        _mm256_maskstore_ps(row + o0 + 8, _mm256_cmpgt_epi32(left, _mm256_add_epi32(lane, _mm256_set1_epi32(8))), hi);
    }
}

static inline __m256 widen8(const uint16_t *h) { /* 8 bf16 to fp32, exactly */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)h)), 16));
}

/* ---- float panels: P [panels, k, 16] fp32 (wtype 0) or bf16 (1); bf16 pairs [panels,
 * ceil(k/2), 16, 2] (6) ---- */

/* A tile's sums as twelve named registers, slot s = a NR + b (panel a, row b) in s<s>l / s<s>h,
 * the low and high 8 outputs: as an array, GCC keeps them in memory and stores every one on
 * every step, whatever its size or indexing. SUM_SLOT(s, l, h, x): slot s += (l, h) * x, where
 * s is a constant once the tile's shape is. */
#define SUMS_ZERO                                                                                      \
    __m256 s0l = _mm256_setzero_ps(), s0h = s0l, s1l = s0l, s1h = s0l, s2l = s0l, s2h = s0l, s3l = s0l, \
           s3h = s0l, s4l = s0l, s4h = s0l, s5l = s0l, s5h = s0l
#define SUM_SLOT(S, L, H, X)                                                                           \
    switch (S) {                                                                                       \
    case 0: s0l = _mm256_fmadd_ps(L, X, s0l); s0h = _mm256_fmadd_ps(H, X, s0h); break;                 \
    case 1: s1l = _mm256_fmadd_ps(L, X, s1l); s1h = _mm256_fmadd_ps(H, X, s1h); break;                 \
    case 2: s2l = _mm256_fmadd_ps(L, X, s2l); s2h = _mm256_fmadd_ps(H, X, s2h); break;                 \
    case 3: s3l = _mm256_fmadd_ps(L, X, s3l); s3h = _mm256_fmadd_ps(H, X, s3h); break;                 \
    case 4: s4l = _mm256_fmadd_ps(L, X, s4l); s4h = _mm256_fmadd_ps(H, X, s4h); break;                 \
    default: s5l = _mm256_fmadd_ps(L, X, s5l); s5h = _mm256_fmadd_ps(H, X, s5h);                       \
    }

static inline __attribute__((always_inline)) void ftile(const float *x, int k, const void *P, int wtype, int n, int p,
                                                        int r, float *y, const int NP, const int NR) {
    SUMS_ZERO;
    const float *xr = x + (size_t)r * k;
    if (wtype == 6) {
        const uint32_t *W = (const uint32_t *)P;
        size_t kp = (size_t)(k + 1) / 2;
        const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
        for (int i = 0; i < k; i += 2) {
            __m256i v[4][2];
            for (int a = 0; a < NP; a++) {
                const uint32_t *at = W + ((size_t)(p + a) * kp + i / 2) * 16;
                __builtin_prefetch((const char *)at + 2048);
                v[a][0] = _mm256_loadu_si256((const __m256i *)at);
                v[a][1] = _mm256_loadu_si256((const __m256i *)(at + 8));
            }
            for (int b = 0; b < NR; b++) {
                __m256 x0 = _mm256_broadcast_ss(xr + (size_t)b * k + i);
                for (int a = 0; a < NP; a++)
                    SUM_SLOT(a * NR + b, _mm256_castsi256_ps(_mm256_slli_epi32(v[a][0], 16)),
                             _mm256_castsi256_ps(_mm256_slli_epi32(v[a][1], 16)), x0)
            }
            if (i + 1 < k)
                for (int b = 0; b < NR; b++) {
                    __m256 x1 = _mm256_broadcast_ss(xr + (size_t)b * k + i + 1);
                    for (int a = 0; a < NP; a++)
                        SUM_SLOT(a * NR + b, _mm256_castsi256_ps(_mm256_and_si256(v[a][0], high)),
                                 _mm256_castsi256_ps(_mm256_and_si256(v[a][1], high)), x1)
                }
        }
    } else {
        for (int i = 0; i < k; i++) {
            __m256 w[4][2];
            for (int a = 0; a < NP; a++) {
                size_t at = ((size_t)(p + a) * k + i) * 16;
                if (wtype == 0) {
                    __builtin_prefetch((const float *)P + at + 512);
                    w[a][0] = _mm256_loadu_ps((const float *)P + at);
                    w[a][1] = _mm256_loadu_ps((const float *)P + at + 8);
                } else {
                    __builtin_prefetch((const uint16_t *)P + at + 1024);
                    w[a][0] = widen8((const uint16_t *)P + at);
                    w[a][1] = widen8((const uint16_t *)P + at + 8);
                }
            }
            for (int b = 0; b < NR; b++) {
                __m256 xb = _mm256_broadcast_ss(xr + (size_t)b * k + i);
                for (int a = 0; a < NP; a++) SUM_SLOT(a * NR + b, w[a][0], w[a][1], xb)
            }
        }
    }
    const __m256 sums[6][2] = {{s0l, s0h}, {s1l, s1h}, {s2l, s2h}, {s3l, s3h}, {s4l, s4h}, {s5l, s5h}};
    for (int a = 0; a < NP; a++)
        for (int b = 0; b < NR; b++)
            store16(y + (size_t)(r + b) * n, n, (p + a) * 16, sums[a * NR + b][0], sums[a * NR + b][1]);
}

/* Each (layout, shape) in a function of its own: GCC keeps a tile's sums in registers only
 * then (with the layout a variable, it stores every sum on every step). */
#define FTILE_AS(WT, NP, NR)                                                                                 \
    static __attribute__((noinline)) void ftile_##WT##_##NP##_##NR(const float *x, int k, const void *P,     \
                                                                   int n, int p, int r, float *y) {          \
        ftile(x, k, P, WT, n, p, r, y, NP, NR);                                                              \
    }
#define FTILES_FOR(WT) FTILE_AS(WT, 4, 1) FTILE_AS(WT, 2, 2) FTILE_AS(WT, 2, 3) FTILE_AS(WT, 1, 1) \
    FTILE_AS(WT, 1, 2) FTILE_AS(WT, 1, 3) FTILE_AS(WT, 1, 4) FTILE_AS(WT, 1, 5) FTILE_AS(WT, 1, 6)
FTILES_FOR(0)
FTILES_FOR(1)
FTILES_FOR(6)

typedef void (*Tile)(const float *x, int k, const void *P, int n, int p, int r, float *y);
/* per layout: [0] 4 panels x 1 row, [1] 2 x 2, [2] 2 x 3, [2 + nr] 1 x nr */
#define TILES_OF(WT) {ftile_##WT##_4_1, ftile_##WT##_2_2, ftile_##WT##_2_3, ftile_##WT##_1_1, ftile_##WT##_1_2, \
                      ftile_##WT##_1_3, ftile_##WT##_1_4, ftile_##WT##_1_5, ftile_##WT##_1_6}
static const Tile TILES[3][9] = {TILES_OF(0), TILES_OF(1), TILES_OF(6)};

/* The row tiles of rows [r0, r1): six at a time, the rest split near-evenly (7 rows: 4 + 3). */
#define EACH_ROW_TILE(r0, r1, BODY)                                                            \
    for (int r = r0; r < r1;) {                                                                \
        int left = r1 - r, nr = left <= 6 ? left : left <= 12 ? (left + 1) / 2 : 6;            \
        BODY;                                                                                  \
        r += nr;                                                                               \
    }

INTERNAL void avx2_panels(const float *x, int R, int k, const void *P, int wtype, int n, float *y, int p0, int p1) {
    const Tile *t = TILES[wtype == 6 ? 2 : wtype];
    int p = p0;
    if (R <= 3) { /* few rows: more panels at once, independent chains to hide the latency */
        for (; p + 4 <= p1 && R == 1; p += 4) t[0](x, k, P, n, p, 0, y);
        for (; p + 2 <= p1 && R >= 2; p += 2) t[R - 1](x, k, P, n, p, 0, y);
        for (; p < p1; p++) t[2 + R](x, k, P, n, p, 0, y);
        return;
    }
    for (int r0 = 0; r0 < R; r0 += ROW_BLOCK) {
        int r1 = R - r0 <= ROW_BLOCK + ROW_BLOCK / 2 ? R : r0 + ROW_BLOCK; /* no short last block */
        for (p = p0; p < p1; p++) EACH_ROW_TILE(r0, r1, t[2 + nr](x, k, P, n, p, r, y))
        r0 = r1 - ROW_BLOCK;
    }
}

/* ---- affine int4 / int8 in groups of 64 (wtypes 4, 5), as native_qproducts.c's qtile: x is
 * group_quads' (per row and group the scale and the rounded inputs' scaled sum, then the s8
 * inputs in words of four, [G, 16, R]); P per panel and group the 16 scales and biases (bf16)
 * and the levels, u8 words of 4 inputs x 16 outputs (int4: 8 words of nibbles, the low one
 * input 4j + t, the high one 4j + 32 + t; int8: 16 words). One half-panel (8 outputs) at a
 * time: its integer sums in int16 for four words (products of a nibble and an s8 are at most
 * 15 x 128; eight pairs of them fit), then widened into int32. ---- */
static inline size_t qgroup_bytes(int bits) { return 64 + (size_t)QGROUP * 16 * bits / 8; }

#define Q_AHEAD 6 /* groups prefetched ahead (3.4 KB of int4: past the memory's latency) */

/* A tile's integer sums as six named registers (as SUM_SLOT's, for the same reason): slot S +=
 * V, and slot S's value. */
#define INTS_ZERO __m256i i0 = _mm256_setzero_si256(), i1 = i0, i2 = i0, i3 = i0, i4 = i0, i5 = i0
#define INT_ADD(S, V)                                         \
    switch (S) {                                              \
    case 0: i0 = _mm256_add_epi32(i0, V); break;              \
    case 1: i1 = _mm256_add_epi32(i1, V); break;              \
    case 2: i2 = _mm256_add_epi32(i2, V); break;              \
    case 3: i3 = _mm256_add_epi32(i3, V); break;              \
    case 4: i4 = _mm256_add_epi32(i4, V); break;              \
    default: i5 = _mm256_add_epi32(i5, V);                    \
    }
#define INT_OF(S) ((S) == 0 ? i0 : (S) == 1 ? i1 : (S) == 2 ? i2 : (S) == 3 ? i3 : (S) == 4 ? i4 : i5)

/* One half-panel's (8 outputs') products for rows r..r+NR-1 (int8: NR <= 3, slots b + 3 the high
 * nibbles' sums). Each word's pairs of products, at most 2 x 15 x 128 in an int16, are widened
 * to int32 at once by vpmaddwd. */
static inline __attribute__((always_inline)) void qhalf(const uint8_t *x, int R, int k, const uint8_t *P,
                                                        const int bits, int n, int p, int r, int h, float *y,
                                                        const int NR) {
    int G = k / QGROUP;
    size_t gb = qgroup_bytes(bits);
    const float *scale = (const float *)x + (size_t)r * G, *sum = (const float *)x + (size_t)(R + r) * G;
    const int32_t *words = (const int32_t *)x + (size_t)2 * R * G + r;
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    SUMS_ZERO;
    (void)s0h; (void)s1h; (void)s2h; (void)s3h; (void)s4h; (void)s5h;
    for (int g = 0; g < G; g++) {
        const uint8_t *W = P + ((size_t)p * G + g) * gb;
        if (h == 0) /* every line of the group Q_AHEAD groups on (a panel's groups, then the next
                     * panel's, lie one after another): a decode step reads each from memory once */
            for (size_t l = 0; l < gb; l += 64) __builtin_prefetch(W + Q_AHEAD * gb + l);
        INTS_ZERO;
        for (int j = 0; j < (bits == 4 ? 8 : 16); j++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(W + 64 + 64 * j + 32 * h));
            __m256i lo = _mm256_and_si256(v, low), up = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            const int32_t *wj = words + ((size_t)g * 16 + j) * R;
            for (int b = 0; b < NR; b++) {
                __m256i xb = _mm256_set1_epi32(wj[b]);
                if (bits == 4) { /* the high nibbles' inputs: word j + 8 */
                    __m256i xh = _mm256_set1_epi32(wj[(size_t)8 * R + b]);
                    __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xb), _mm256_maddubs_epi16(up, xh));
                    INT_ADD(b, _mm256_madd_epi16(t, ones))
                } else { /* q = 16 up + lo, both times the same inputs */
                    INT_ADD(b, _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xb), ones))
                    INT_ADD(b + 3, _mm256_madd_epi16(_mm256_maddubs_epi16(up, xb), ones))
                }
            }
        }
        __m256 ws = widen8((const uint16_t *)W + 8 * h), wb = widen8((const uint16_t *)(W + 32) + 8 * h);
        for (int b = 0; b < NR; b++) {
            __m256i dot = bits == 8 ? _mm256_add_epi32(_mm256_slli_epi32(INT_OF(b + 3), 4), INT_OF(b)) : INT_OF(b);
            __m256 v = _mm256_mul_ps(ws, _mm256_set1_ps(scale[b * G + g])), c = _mm256_cvtepi32_ps(dot);
            __m256 bias = _mm256_set1_ps(sum[b * G + g]);
            switch (b) { /* qtile's chain: acc = fma(dot, ws s, acc); acc = fma(wb, sum, acc) */
            case 0: s0l = _mm256_fmadd_ps(wb, bias, _mm256_fmadd_ps(c, v, s0l)); break;
            case 1: s1l = _mm256_fmadd_ps(wb, bias, _mm256_fmadd_ps(c, v, s1l)); break;
            case 2: s2l = _mm256_fmadd_ps(wb, bias, _mm256_fmadd_ps(c, v, s2l)); break;
            case 3: s3l = _mm256_fmadd_ps(wb, bias, _mm256_fmadd_ps(c, v, s3l)); break;
            case 4: s4l = _mm256_fmadd_ps(wb, bias, _mm256_fmadd_ps(c, v, s4l)); break;
            default: s5l = _mm256_fmadd_ps(wb, bias, _mm256_fmadd_ps(c, v, s5l));
            }
        }
    }
    const __m256 sums[6] = {s0l, s1l, s2l, s3l, s4l, s5l};
    __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), left = _mm256_set1_epi32(n - p * 16 - 8 * h);
    for (int b = 0; b < NR; b++) {
        float *at = y + (size_t)(r + b) * n + p * 16 + 8 * h;
        if (n - p * 16 - 8 * h >= 8)
            _mm256_storeu_ps(at, sums[b]);
        else if (n - p * 16 - 8 * h > 0)
            _mm256_maskstore_ps(at, _mm256_cmpgt_epi32(left, lane), sums[b]);
    }
}

static inline __attribute__((always_inline)) void qtile(const uint8_t *x, int R, int k, const uint8_t *P,
                                                        const int bits, int n, int p, int r, float *y, const int NR) {
    qhalf(x, R, k, P, bits, n, p, r, 0, y, NR);
    qhalf(x, R, k, P, bits, n, p, r, 1, y, NR);
}

typedef void (*QTile)(const uint8_t *x, int R, int k, const uint8_t *P, int n, int p, int r, float *y);
#define QTILE_AS(BITS, NR)                                                                                       \
    static __attribute__((noinline)) void qtile_##BITS##_##NR(const uint8_t *x, int R, int k, const uint8_t *P, \
                                                              int n, int p, int r, float *y) {                  \
        qtile(x, R, k, P, BITS, n, p, r, y, NR);                                                               \
    }
QTILE_AS(4, 1) QTILE_AS(4, 2) QTILE_AS(4, 3) QTILE_AS(4, 4) QTILE_AS(4, 5) QTILE_AS(4, 6)
QTILE_AS(8, 1) QTILE_AS(8, 2) QTILE_AS(8, 3)
static const QTile Q4[7] = {NULL, qtile_4_1, qtile_4_2, qtile_4_3, qtile_4_4, qtile_4_5, qtile_4_6};
static const QTile Q8[4] = {NULL, qtile_8_1, qtile_8_2, qtile_8_3};

/* int4 for one row (a decode step), a whole panel -- both halves -- at once: one load of each word
 * of inputs for the 16 outputs, and the int16 sums of two words (at most 4 x 2 x 15 x 128) widened
 * together, a sixth fewer operations than two half-panels; the same integer sums (exact in any
 * order) and qtile's float chain, so the same bits. */
static __attribute__((noinline)) void q4_row(const uint8_t *x, int k, const uint8_t *P, int n, int p, float *y) {
    int G = k / QGROUP;
    size_t gb = qgroup_bytes(4);
    const float *scale = (const float *)x, *sum = (const float *)x + G;
    const int32_t *words = (const int32_t *)x + (size_t)2 * G;
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    for (int g = 0; g < G; g++) {
        const uint8_t *W = P + ((size_t)p * G + g) * gb;
        for (size_t l = 0; l < gb; l += 64) __builtin_prefetch(W + Q_AHEAD * gb + l);
        __m256i i0 = _mm256_setzero_si256(), i1 = i0;
        const int32_t *wg = words + (size_t)g * 16;
        for (int j = 0; j < 8; j += 2) {
            __m256i s0 = _mm256_setzero_si256(), s1 = s0;
            for (int e = j; e < j + 2; e++) {
                __m256i xb = _mm256_set1_epi32(wg[e]), xh = _mm256_set1_epi32(wg[e + 8]);
                __m256i v0 = _mm256_loadu_si256((const __m256i *)(W + 64 + 64 * e));
                __m256i v1 = _mm256_loadu_si256((const __m256i *)(W + 96 + 64 * e));
                s0 = _mm256_add_epi16(s0, _mm256_add_epi16(
                                              _mm256_maddubs_epi16(_mm256_and_si256(v0, low), xb),
                                              _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v0, 4), low), xh)));
                s1 = _mm256_add_epi16(s1, _mm256_add_epi16(
                                              _mm256_maddubs_epi16(_mm256_and_si256(v1, low), xb),
                                              _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v1, 4), low), xh)));
            }
            i0 = _mm256_add_epi32(i0, _mm256_madd_epi16(s0, ones));
            i1 = _mm256_add_epi32(i1, _mm256_madd_epi16(s1, ones));
        }
        __m256 sc = _mm256_set1_ps(scale[g]), bias = _mm256_set1_ps(sum[g]);
        a0 = _mm256_fmadd_ps(widen8((const uint16_t *)(W + 32)), bias,
                             _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(widen8((const uint16_t *)W), sc), a0));
        a1 = _mm256_fmadd_ps(widen8((const uint16_t *)(W + 32) + 8), bias,
                             _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(widen8((const uint16_t *)W + 8), sc), a1));
    }
    store16(y, n, p * 16, a0, a1);
}

INTERNAL void avx2_qpanels(const float *x, int R, int k, const void *P, int bits, int n, float *y, int p0, int p1) {
    if (R == 1 && bits == 4) {
        for (int p = p0; p < p1; p++) q4_row((const uint8_t *)x, k, (const uint8_t *)P, n, p, y);
        return;
    }
    for (int r0 = 0; r0 < R; r0 += ROW_BLOCK) {
        int r1 = R - r0 <= ROW_BLOCK + ROW_BLOCK / 2 ? R : r0 + ROW_BLOCK;
        for (int p = p0; p < p1; p++) {
            if (bits == 4)
                EACH_ROW_TILE(r0, r1, Q4[nr]((const uint8_t *)x, R, k, (const uint8_t *)P, n, p, r, y))
            else
                for (int r = r0; r < r1;) { /* (three rows a tile: their sums take two registers each) */
                    int nr = r1 - r < 3 ? r1 - r : 3;
                    Q8[nr]((const uint8_t *)x, R, k, (const uint8_t *)P, n, p, r, y);
                    r += nr;
                }
        }
        r0 = r1 - ROW_BLOCK;
    }
}

/* ---- the drafters' int8 quads (wtype 3), as ptile's: x per row its scale then words of four
 * inputs as u8 (+128); P the outputs' scales, their corrections (128 sum(w)), then s8 weights in
 * words of 4 inputs x 16 outputs. The u8 inputs go in as nibbles (16 hi + lo), each pair of
 * products then within int16. ---- */
static inline __attribute__((always_inline)) void i8tile(const uint32_t *xq, int k, const void *P, int n, int p, int r,
                                                         float *y, const int NR) {
    int panels = (n + 15) / 16, kq = k - 1;
    const float *wscale = (const float *)P;
    const int32_t *corr = (const int32_t *)(wscale + (size_t)panels * 16);
    const int8_t *W = (const int8_t *)(corr + (size_t)panels * 16);
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256i lo32[6][2], hi32[6][2];
    for (int b = 0; b < NR; b++)
        for (int h = 0; h < 2; h++) lo32[b][h] = hi32[b][h] = _mm256_setzero_si256();
    for (int i0 = 0; i0 < kq; i0 += 4) { /* four words a time in int16: 8 products of 15 x 128 each */
        __m256i lo16[6][2], hi16[6][2];
        for (int b = 0; b < NR; b++)
            for (int h = 0; h < 2; h++) lo16[b][h] = hi16[b][h] = _mm256_setzero_si256();
        for (int i = i0; i < i0 + 4 && i < kq; i++) {
            const int8_t *wi = W + ((size_t)p * kq + i) * 64;
            __builtin_prefetch(wi + 2048);
            __m256i w0 = _mm256_loadu_si256((const __m256i *)wi), w1 = _mm256_loadu_si256((const __m256i *)(wi + 32));
            for (int b = 0; b < NR; b++) {
                __m256i xb = _mm256_set1_epi32((int)xq[(size_t)(r + b) * k + 1 + i]);
                __m256i xl = _mm256_and_si256(xb, low), xh = _mm256_and_si256(_mm256_srli_epi16(xb, 4), low);
                lo16[b][0] = _mm256_add_epi16(lo16[b][0], _mm256_maddubs_epi16(xl, w0));
                lo16[b][1] = _mm256_add_epi16(lo16[b][1], _mm256_maddubs_epi16(xl, w1));
                hi16[b][0] = _mm256_add_epi16(hi16[b][0], _mm256_maddubs_epi16(xh, w0));
                hi16[b][1] = _mm256_add_epi16(hi16[b][1], _mm256_maddubs_epi16(xh, w1));
            }
        }
        for (int b = 0; b < NR; b++)
            for (int h = 0; h < 2; h++) {
                lo32[b][h] = _mm256_add_epi32(lo32[b][h], _mm256_madd_epi16(lo16[b][h], ones));
                hi32[b][h] = _mm256_add_epi32(hi32[b][h], _mm256_madd_epi16(hi16[b][h], ones));
            }
    }
    for (int b = 0; b < NR; b++) {
        float rs;
        memcpy(&rs, xq + (size_t)(r + b) * k, 4);
        __m256 v[2];
        for (int h = 0; h < 2; h++) {
            __m256i dot = _mm256_add_epi32(_mm256_slli_epi32(hi32[b][h], 4), lo32[b][h]);
            __m256i c = _mm256_loadu_si256((const __m256i *)(corr + (size_t)p * 16 + 8 * h));
            __m256 ws = _mm256_loadu_ps(wscale + (size_t)p * 16 + 8 * h);
            v[h] = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(dot, c)), ws), _mm256_set1_ps(rs));
        }
        store16(y + (size_t)(r + b) * n, n, p * 16, v[0], v[1]);
    }
}

typedef void (*I8Tile)(const uint32_t *xq, int k, const void *P, int n, int p, int r, float *y);
#define I8TILE_AS(NR)                                                                                        \
    static __attribute__((noinline)) void i8tile_##NR(const uint32_t *xq, int k, const void *P, int n, int p, \
                                                      int r, float *y) {                                     \
        i8tile(xq, k, P, n, p, r, y, NR);                                                                    \
    }
I8TILE_AS(1) I8TILE_AS(2) I8TILE_AS(3)
static const I8Tile I8[4] = {NULL, i8tile_1, i8tile_2, i8tile_3};

INTERNAL void avx2_quads(const float *x, int R, int k, const void *P, int n, float *y, int p0, int p1) {
    for (int p = p0; p < p1; p++)
        for (int r = 0; r < R;) {
            int nr = R - r < 3 ? R - r : 3;
            I8[nr]((const uint32_t *)x, k, P, n, p, r, y);
            r += nr;
        }
}
#endif
