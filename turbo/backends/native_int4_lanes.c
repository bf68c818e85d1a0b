/* Wtype 8's int4 (exact affine int4 in any group) in "lanes of inputs": its layout, its tile
 * (i4tile: a level's weight one in-register permute of its group's table) and the tile shapes,
 * each a function of its own, that int4_lanes (native_exact.c) picks among. Apart from
 * native_exact.c's int8 and FP8 since its sums are not one chain per output over the panels but
 * 16 lane chains an output, then one fixed tree. AVX-512 only (EXACT_READS). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_internal.h"

#if EXACT_READS
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
    INTERNAL __attribute__((noinline)) void i4blocks_##NO_(const float *x, int R, int k, const void *P,       \
                                                            int group, int n, float *y, int b0, int b1) {     \
        const int NO = NO_;                                                                                   \
        for (int blk = b0; blk < b1; blk++)                                                                   \
            for (int o0 = 0; o0 < 8; o0 += NO)                                                                \
                ROW_TILES(I4TILE, MAXR)                                                                       \
    }
#define I4ROWS_AS(NR_)                                                                                           \
    INTERNAL __attribute__((noinline)) void i4rows_##NR_(const float *x, int R, int k, const void *P, int group, \
                                                          int n, float *y, int b0, int b1) {                     \
        (void)R;                                                                                                 \
        for (int blk = b0; blk < b1; blk++) i4tile(x, k, (const uint8_t *)P, group, n, blk, 0, 0, y, 8, NR_);    \
    }
I4BLOCKS_AS(4, 6)
I4BLOCKS_AS(2, 12)
I4ROWS_AS(1)
I4ROWS_AS(2)
#endif
