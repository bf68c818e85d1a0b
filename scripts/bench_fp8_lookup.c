/* What bounds the FP8 products (native_exact.c, wtype 9) on this CPU: one 4-panel decode tile
 * (1 row, the step's shape) over 256 MB of codes, from memory, 1 and 2 threads, its parts taken
 * away one at a time, beside an int8 tile of one packed dot product per 64 weights (wtype 5's).
 *
 *     gcc -O3 -march=native -fopenmp scripts/bench_fp8_lookup.c -o build/fp8_lookup && build/fp8_lookup [k]
 *
 * Variants, each the same bytes (one code a weight, 16 outputs x 4 inputs a 64-byte load):
 *   fp8          the product as shipped: two 128-entry byte lookups (vpermt2b: hi / lo byte of the
 *                bf16 weight), the sign, two interleaves, widened to fp32, four multiply-adds;
 *   fp8 bf16-x   the same lookups, the inputs rounded to bf16 and two bf16 dot products (vdpbf16ps)
 *                in place of the widening and the four multiply-adds (not exact: what that would gain);
 *   lookups+fma  the two lookups and four multiply-adds, no interleave (wrong weights: a bound);
 *   fma only     the four multiply-adds on the loaded bytes (no lookup: a bound);
 *   int8         one vpdpbusd per 64 weights.
 * A benchmark, not a test: run it on a quiet machine, twice. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef float v16 __attribute__((vector_size(64)));
#define NP 4
#ifndef PF
#define PF 2048 /* bytes ahead in a panel's stream (native_exact.c's) */
#endif

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define TILE(NAME, ...)                                                                                     \
    __attribute__((noinline)) static void NAME(const float *x, int k, const uint8_t *P, const uint8_t *T, float *y) { \
        v16 acc[NP];                                                                                        \
        for (int a = 0; a < NP; a++) acc[a] = (v16){0};                                                     \
        __m512i hi0 = _mm512_loadu_si512(T), hi1 = _mm512_loadu_si512(T + 64);                              \
        __m512i lo0 = _mm512_loadu_si512(T + 128), lo1 = _mm512_loadu_si512(T + 192);                       \
        const __m512i sign = _mm512_set1_epi8((char)0x80), high = _mm512_set1_epi32((int)0xffff0000u);      \
        const int32_t *xp = (const int32_t *)x;                                                             \
        (void)sign, (void)high, (void)xp, (void)hi0, (void)hi1, (void)lo0, (void)lo1;                       \
        for (int j = 0; j < k; j += 4)                                                                      \
            for (int a = 0; a < NP; a++) {                                                                  \
                const uint8_t *at = P + ((size_t)a * k + j) * 16;                                           \
                __builtin_prefetch(at + PF);                                                                \
                __m512i c = _mm512_loadu_si512(at);                                                         \
                __VA_ARGS__                                                                                 \
            }                                                                                               \
        for (int a = 0; a < NP; a++) memcpy(y + 16 * a, &acc[a], 64);                                       \
    }
#define FMAS for (int t = 0; t < 4; t++) acc[a] += w[t] * x[j + t];
#define LOOKUPS                                                                                             \
    __m512i hi = _mm512_permutex2var_epi8(hi0, c, hi1), lo = _mm512_permutex2var_epi8(lo0, c, lo1);          \
    hi = _mm512_ternarylogic_epi32(hi, c, sign, 0xf8);                                                      \
    __m512i wl = _mm512_unpacklo_epi8(lo, hi), wh = _mm512_unpackhi_epi8(lo, hi);

TILE(fp8, LOOKUPS v16 w[4] = {(v16)_mm512_slli_epi32(wl, 16), (v16)_mm512_and_si512(wl, high),
                              (v16)_mm512_slli_epi32(wh, 16), (v16)_mm512_and_si512(wh, high)}; FMAS)
TILE(fp8_bf16x, LOOKUPS
     acc[a] = (v16)_mm512_dpbf16_ps((__m512)acc[a], (__m512bh)wl, (__m512bh)_mm512_set1_epi32(xp[k + j / 2]));
     acc[a] = (v16)_mm512_dpbf16_ps((__m512)acc[a], (__m512bh)wh, (__m512bh)_mm512_set1_epi32(xp[k + j / 2 + 1]));)
TILE(lookups_fma, __m512i hi = _mm512_permutex2var_epi8(hi0, c, hi1), lo = _mm512_permutex2var_epi8(lo0, c, lo1);
     v16 w[4] = {(v16)hi, (v16)lo, (v16)hi, (v16)lo}; FMAS)
TILE(fma_only, v16 w[4] = {(v16)c, (v16)c, (v16)c, (v16)c}; FMAS)
TILE(int8, acc[a] = (v16)_mm512_dpbusd_epi32((__m512i)acc[a], c, _mm512_set1_epi32(xp[j / 4]));)

typedef void (*tile_fn)(const float *, int, const uint8_t *, const uint8_t *, float *);

int main(int argc, char **argv) {
    int k = argc > 1 ? atoi(argv[1]) : 1024;
    size_t total = (size_t)256 << 20, tile_bytes = (size_t)NP * k * 16;
    int tiles = (int)(total / tile_bytes), per = tiles / 8; /* a product: `per` tiles (a 7168 x 1024 matrix: 112) */
    uint8_t *P = aligned_alloc(64, total + 4096), T[256];
    for (size_t i = 0; i < total + 4096; i++) P[i] = i % 4 == 3 ? 0x3c : rand() & 0x7e; /* normal floats for "fma only" */
    for (int i = 0; i < 256; i++) T[i] = i < 128 ? 0x38 + i % 4 : (uint8_t)(i * 37); /* bf16 weights of 1e-3..1e-2 */
    float *x = malloc(sizeof(float) * 2 * k), *y = malloc(sizeof(float) * 16 * NP * tiles);
    for (int i = 0; i < 2 * k; i++) x[i] = 1e-3f * (i % 7 + 1);
    tile_fn fns[] = {fp8, fp8_bf16x, lookups_fma, fma_only, int8};
    const char *names[] = {"fp8", "fp8 bf16-x", "lookups+fma", "fma only", "int8"};
    double best[5][2];
    for (int f = 0; f < 5; f++) best[f][0] = best[f][1] = 1e9;
    for (int rep = 0; rep < 7; rep++)
        for (int th = 1; th <= 2; th++)
            for (int f = 0; f < 5; f++) { /* interleaved; each product's tiles in 16 chunks, as products() */
                double t = now();
                for (int part = 0; part < 8; part++) {
#pragma omp parallel for num_threads(th) schedule(dynamic, 1)
                    for (int c = 0; c < 16; c++)
                        for (int i = c * per / 16; i < (c + 1) * per / 16; i++) {
                            int at = part * per + i;
                            fns[f](x, k, P + (size_t)at * tile_bytes, T, y + 16 * NP * at);
                        }
                }
                double dt = (now() - t) / 8;
                if (dt < best[f][th - 1]) best[f][th - 1] = dt;
            }
    printf("k = %d, best of 7 interleaved, GB/s of codes read\n", k);
    for (int f = 0; f < 5; f++)
        printf("%-12s 1 thread %5.1f   2 threads %5.1f\n", names[f], per * (double)tile_bytes / best[f][0] / 1e9,
               per * (double)tile_bytes / best[f][1] / 1e9);
    return 0;
}
