/* What the library's own C files share beyond native.h (not part of its interface): the vector
 * type and weight loads, the thread count (set_threads, native_products.c) and the row loops'
 * split, and the MLP half every trunk layer ends with (native_gdn.c, native_attn.c). */
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
 * and chains as native_products.c's (p0, p1: the panels of 16 outputs to compute). */
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define AVX2_TIER 1
#include <immintrin.h>
#else
#define AVX2_TIER 0
#endif
INTERNAL void avx2_panels(const float *x, int R, int k, const void *P, int wtype, int n, float *y, int p0, int p1);
INTERNAL void avx2_qpanels(const float *x, int R, int k, const void *P, int bits, int n, float *y, int p0, int p1);
INTERNAL void avx2_quads(const float *x, int R, int k, const void *P, int n, float *y, int p0, int p1);

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
