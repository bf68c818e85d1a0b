/* What the library's own C files share beyond native.h (not part of its interface): the vector
 * type and weight loads, the thread count (set_threads, native_products.c) and the row loops'
 * split, the matrix products' parts (which a build has, the calls between their files, what their
 * tiles share), and the MLP half every trunk layer ends with (native_gdn.c, native_attn.c). */
#ifndef TURBO_NATIVE_INTERNAL_H
#define TURBO_NATIVE_INTERNAL_H

#include <stdlib.h>

#include "native.h"

/* Shared between the library's files, not exported from it. */
#define INTERNAL __attribute__((visibility("hidden")))

typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

static inline v16 load_w(const void *w, int wtype, size_t at) {
    v16 r;
    if (wtype == 0) {
        memcpy(&r, (const float *)w + at, 64);
    } else {
#if defined(__AVX512F__) /* one widening load and a shift (compilers split the generic form in halves) */
        __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + at)));
        r = (v16)_mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
#else
        u16x16 h;
        memcpy(&h, (const uint16_t *)w + at, 32);
        u32x16 u = __builtin_convertvector(h, u32x16) << 16;
        memcpy(&r, &u, 64);
#endif
    }
    return r;
}

/* The AVX2 tier (AVX2 + FMA, no AVX-512): native_avx2.c's tiles, over the same packed layouts
 * and chains as native_products.c's and native_qproducts.c's (p0, p1: the panels of 16 outputs
 * to compute). */
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define AVX2_TIER 1
#include <immintrin.h>
#else
#define AVX2_TIER 0
#endif
INTERNAL void avx2_panels(const float *x, int R, int k, const void *P, int wtype, int n, float *y, int p0, int p1);
INTERNAL void avx2_qpanels(const float *x, int R, int k, const void *P, int bits, int n, float *y, int p0, int p1);
INTERNAL void avx2_quads(const float *x, int R, int k, const void *P, int n, float *y, int p0, int p1);

/* ---- the matrix products' files (native_products.c the entry point and the dispatch) ----
 * Which products a build has, by the ISA it is compiled for (dot_products reports them). */
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define VNNI512 1 /* vpdpbusd: the int8 products (native_products.c, native_qproducts.c) */
#else
#define VNNI512 0
#endif
#define INT8_DOT (VNNI512 || AVX2_TIER) /* the int8 products, by VNNI or in native_avx2.c */
#define QGROUP 64 /* inputs a group of the affine matrices (wtypes 4, 5; group_quads, native_qproducts.c) */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define EXACT_READS 1 /* the exact formats (native_exact.c, native_int4_lanes.c) */
#else
#define EXACT_READS 0
#endif
#if EXACT_READS && defined(__AVX512VBMI__)
#define FP8_READS 1
#else
#define FP8_READS 0
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define AMX_BF16 1 /* bf16 matrices by AMX tiles (native_amx.c) */
#else
#define AMX_BF16 0
#endif

/* The calls from one product's file into another's (each was a call, never inlined, before the
 * files were split): the affine groups' tile shapes (native_qproducts.c; qpacked picks one), the
 * exact formats (native_exact.c) and their int4's shapes (native_int4_lanes.c), AMX's tiles
 * (native_amx.c; bf16_products is exported too). */
#if VNNI512
#define QPANELS_DECL(BITS, NP, MAXR)                                                                        \
    INTERNAL void qpanels_##BITS##_##NP##_##MAXR(const float *x, int R, int k, const void *P, int n, float *y, \
                                                 int p0, int p1);
QPANELS_DECL(4, 4, 6) QPANELS_DECL(4, 2, 6) QPANELS_DECL(4, 1, 6) QPANELS_DECL(4, 2, 12) QPANELS_DECL(4, 1, 12)
QPANELS_DECL(8, 4, 6) QPANELS_DECL(8, 2, 6) QPANELS_DECL(8, 1, 6) QPANELS_DECL(8, 2, 12) QPANELS_DECL(8, 1, 12)
#undef QPANELS_DECL
#endif
#if EXACT_READS
INTERNAL void fpacked(const float *x, int R, int k, const void *P, int wtype, int n, float *y, int p0, int p1);
INTERNAL void i4blocks_4(const float *x, int R, int k, const void *P, int group, int n, float *y, int b0, int b1);
INTERNAL void i4blocks_2(const float *x, int R, int k, const void *P, int group, int n, float *y, int b0, int b1);
INTERNAL void i4rows_1(const float *x, int R, int k, const void *P, int group, int n, float *y, int b0, int b1);
INTERNAL void i4rows_2(const float *x, int R, int k, const void *P, int group, int n, float *y, int b0, int b1);
#endif
int bf16_products(int want);
#if AMX_BF16
INTERNAL void amx_panels(const uint16_t *xb, int R, int Rp, int kp, const uint8_t *P, int n, float *y, int p0,
                         int p1, long xs);
#endif

/* What the products' tiles share (native_products.c, native_qproducts.c, native_exact.c; ROW_TILES
 * native_int4_lanes.c too). Outputs o0..o0+15 of one row (those below n) from a tile's register. */
static inline void store_outputs(float *row, int n, int o0, v16 v) {
    if (n - o0 >= 16) /* a fixed-size store: a variable count compiles to a slow string copy */
        memcpy(row + o0, &v, 64);
    else
        for (int l = 0; l < n - o0; l++) row[o0 + l] = v[l];
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

/* Matrix products of at least this many multiply-adds are split over the threads. */
#define MIN_PARALLEL_MACS 65536

/* The threads for the matrix products and the rows' loops (set_threads, native_products.c). */
extern INTERNAL int threads;

/* Loops over a call's rows (norms, the conv, activations: each row computed whole by one thread,
 * so no value depends on the split) use the threads from this many values on: a verify's rows
 * at real scale, not a decode step's one row or the tiny model's (less than a barrier). */
#define MIN_PARALLEL_ROWS (1L << 14)
static inline int row_parts(int R, long per_row) {
    return R > 1 && R * per_row >= MIN_PARALLEL_ROWS ? (threads < R ? threads : R) : 1;
}

/* x += down(silu(gate) * up) of rms_norm(x): the MLP half of every layer. */
static inline void mlp_block(const Layer *L, float *x, int R) {
    if (L->moe) {
        moe_block(L, x, R);
        return;
    }
    int H = L->hidden, I = L->inter;
    float *h = malloc(sizeof(float) * (size_t)R * H);
    float *gu = malloc(sizeof(float) * (size_t)R * 2 * I);
    float *act = malloc(sizeof(float) * (size_t)R * I);
    float *y = malloc(sizeof(float) * (size_t)R * H);
    rms_norm_rows(x, R, H, L->post_norm, L->eps, h);
    linear_packed(h, R, H, L->gate_up, L->wtype, 2 * I, gu);
    int parts = row_parts(R, I);
#pragma omp parallel for if (parts > 1) num_threads(parts) schedule(static)
    for (int r = 0; r < R; r++)
        for (int i = 0; i < I; i++)
            act[(size_t)r * I + i] = fast_silu(gu[(size_t)r * 2 * I + i]) * gu[(size_t)r * 2 * I + I + i];
    linear_packed(act, R, I, L->down, L->wtype, H, y);
    for (size_t i = 0; i < (size_t)R * H; i++) x[i] += y[i];
    free(h); free(gu); free(act); free(y);
}

#endif
