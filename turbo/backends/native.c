/* The CPU decode/verify step of the Qwen3.5 trunk (docs/DESIGN.md 2.1), one call per layer.
 *
 * Why C: a one-token step of a small model is ~400 tiny torch ops (each costs more to
 * dispatch than to compute) and BLAS GEMV paths that are slower than reading the
 * weights once. Here every layer is one call and every matrix is read once per call.
 *
 * Why it stays lossless: every value a row produces is computed by the same code in the
 * same order whatever the number of rows R in the call -- each output element of a
 * matrix product is one multiply-add chain over the input in index order (packed
 * matrices, below), other sums run in a fixed order too, and no sum is split across
 * threads. So the B + 1 rows of a verify equal B + 1 one-row decode steps bit for bit,
 * by construction rather than by measurement.
 *
 * Threads (set_threads, from torch's intra-op count) split a matrix product by output
 * element: each output is still computed whole by one thread with the same code, so the
 * results do not depend on the thread count either.
 *
 * Built by turbo/backends/native_lib.py with the host's compiler (no -ffast-math: the
 * compiler must not reassociate sums). Matrices are fp32 (wtype 0) or bf16 (wtype 1);
 * bf16 is widened exactly to fp32 before the multiply, so activations stay fp32.
 *
 * Two more kinds are for drafters only, whose numbers shape proposals and never the output
 * (the trunk verifies every one), where the CPU has them (`dot_products`): wtype 2, bf16
 * pairs (inputs rounded to bf16, vdpbf16ps: two multiply-adds per lane and instruction),
 * and wtype 3, int8 (weights per output, inputs per row quantised to 8 bits, vpdpbusd:
 * four per lane, and half the bytes of bf16 to read -- a drafter pass runs right after the
 * trunk's verify has pushed its weights out of the caches). Still one fixed chain per
 * output, so still row-stable -- but not the fp32 function.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define BF16_DOT 1
#else
#define BF16_DOT 0
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define INT8_DOT 1
#else
#define INT8_DOT 0
#endif

/* Which of the products are compiled in: bit 0 wtype 2 (bf16 pairs), bit 1 wtypes 3, 4 and 5
 * (int8 quads, affine int4 and int8). */
int dot_products(void) { return BF16_DOT | INT8_DOT << 1; }

int struct_size(int which) {
    return which == 0 ? (int)sizeof(Layer) : which == 1 ? (int)sizeof(Dflash) : which == 2 ? (int)sizeof(DfLayer)
         : which == 3 ? (int)sizeof(Moe) : -1;
}

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

/* The 16 lanes summed pairwise (lane i with i + 8, then i + 4, i + 2, i + 1): a fixed
 * order, four dependent adds instead of fifteen. */
static inline float lanes_sum(v16 a) {
    a += __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    a += __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    a += __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    return a[0] + a[1];
}

/* Matrix products of at least this many multiply-adds are split over the threads. */
#define MIN_PARALLEL_MACS 65536
/* Attention (scores) of at least this many: a one-row step over a short cache costs less than
 * the threads' barrier on a busy machine (a decode step over 512+ cached positions splits, a 9-row verify over 64+). */
#define MIN_PARALLEL_ATTENTION (1L << 20)
/* The attention scores one call holds at most (4M floats, 16 MB; at least one row's). */
#define SCORE_FLOATS (1L << 22)
static int threads = 1;

/* Threads for the matrix products (1 = the caller only). OpenMP: built with -fopenmp this
 * library shares the process's libgomp -- the one torch loaded -- so its parallel regions
 * use torch's pool instead of a second pool competing for the same cores. */
void set_threads(int n) { threads = n < 1 ? 1 : n; }

/* Loops over a call's rows (norms, the conv, activations: each row computed whole by one thread,
 * so no value depends on the split) use the threads from this many values on: a verify's rows
 * at real scale, not a decode step's one row or the tiny model's (less than a barrier). */
#define MIN_PARALLEL_ROWS (1L << 14)
static inline int row_parts(int R, long per_row) {
    return R > 1 && R * per_row >= MIN_PARALLEL_ROWS ? (threads < R ? threads : R) : 1;
}

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
#if INT8_DOT
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
        }
    return out;
}
#endif

static void packed_range(const float *x, int R, int k, const void *P, int wtype, int n, float *y, int p0, int p1) {
    if (wtype == 0)
        packed_as(x, R, k, P, n, y, p0, p1, 0);
    else if (wtype == 6)
        packed_as(x, R, k, P, n, y, p0, p1, 6);
#if BF16_DOT
    else if (wtype == 2)
        packed_as(x, R, k, P, n, y, p0, p1, 2);
#endif
#if INT8_DOT
    else if (wtype == 3)
        packed_as(x, R, k, P, n, y, p0, p1, 3);
    else if (wtype == 4)
        qpacked_4(x, R, k, P, n, y, p0, p1);
    else if (wtype == 5)
        qpacked_8(x, R, k, P, n, y, p0, p1);
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

/* y [R, n] = x [R, k] @ w^T for a packed w; threads split the panels (in groups of four,
 * the widest tile). */
static void products(const float *x, int R, int k, const void *P, int wtype, int n, float *y) {
    int panels = (n + 15) / 16, groups = (panels + 3) / 4;
    int parts = threads < groups ? threads : 1;
    if (parts < 2 || (long)R * n * k < MIN_PARALLEL_MACS) {
        packed_range(x, R, k, P, wtype, n, y, 0, panels);
        return;
    }
#pragma omp parallel for num_threads(parts) schedule(static, 1)
    for (int t = 0; t < parts; t++) {
        int lo = (int)((long)groups * t / parts) * 4, hi = (int)((long)groups * (t + 1) / parts) * 4;
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
#if INT8_DOT /* the same values sixteen at a time (a maximum is exact in any order) */
        __m512 vm = _mm512_setzero_ps();
        for (; i + 16 <= k; i += 16) vm = _mm512_max_ps(vm, _mm512_abs_ps(_mm512_loadu_ps(xr + i)));
        m = _mm512_reduce_max_ps(vm);
#endif
        for (; i < k; i++) m = fabsf(xr[i]) > m ? fabsf(xr[i]) : m;
        float s = m > 0.0f ? m / 127.0f : 1.0f, inv = 1.0f / s;
        memcpy(o, &s, 4);
        uint8_t *q = (uint8_t *)(o + 1);
        i = 0;
#if INT8_DOT /* rounding to nearest even, as nearbyintf below */
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

void linear_packed(const float *x, int R, int k, const void *P, int wtype, int n, float *y) {
    if (wtype == 2) {
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
    } else {
        products(x, R, k, P, wtype, n, y);
    }
}

static inline float softplusf(float x) { return x > 20.0f ? x : log1pf(fast_exp(x)); }

/* x += down(silu(gate) * up) of rms_norm(x): the MLP half of every layer. */
static void mlp_block(const Layer *L, float *x, int R) {
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

/* One head's delta rule for one row, on the state columns c..c+16*NV-1 (strips of the
 * [dk, dv] state are independent): S *= decay and kv = k^T S in one walk over the strip,
 * u = (v - kv) * beta, then S += k u^T and out = q^T S in a second -- two walks instead of
 * four, the column sums in registers. Each element's operations, and their order, are
 * those of the four-loop form. */
/* Columns c..c+16NV-1 of one head's state through all R rows (a column of the state evolves on
 * its own). Row r: the state decays, u = (v - k.S) beta, S += k u^T, the output is q.S. Row r's
 * update and output and row r+1's decay and k.S share one pass over the strip, which stays in
 * L1 for all the rows, and a row's checkpoint is stored from the registers in that pass (not
 * copied after). Each element and each sum sees exactly a one-row step's operations in its
 * order, so any row is bit for bit a decode step. Sin (the state before the rows) is read, S
 * written (the same buffer or not); states [R, Hv, dk, dv] (optional) gets rows 0..R-2 (row
 * R-1's is S). */
static inline __attribute__((always_inline)) void gdn_strip_rows(const float *Sin, float *S, int dk, int dv, int c,
                                                                 int R, int Hv, int h, const float *q,
                                                                 const float *k, const float *v, const float *g,
                                                                 const float *beta, float *out, float *states,
                                                                 int streamed, const int NV) {
    size_t per = (size_t)dk * dv;
    v16 acc[4], u[4], o[4];
    const float *kr = k + (size_t)h * dk;
    float decay = fast_exp(g[h]);
    for (int a = 0; a < NV; a++) acc[a] = (v16){0};
    for (int i = 0; i < dk; i++)
        for (int a = 0; a < NV; a++) {
            v16 x;
            memcpy(&x, Sin + (size_t)i * dv + c + 16 * a, 64);
            x = x * decay;
            memcpy(S + (size_t)i * dv + c + 16 * a, &x, 64);
            acc[a] += kr[i] * x;
        }
    for (int r = 0; r < R; r++) {
        size_t rh = (size_t)r * Hv + h;
        const float *qr = q + rh * dk, *vr = v + rh * dv, *kn = k + (rh + Hv) * dk;
        float b = beta[rh], next = r + 1 < R ? fast_exp(g[rh + Hv]) : 0.0f;
        kr = k + rh * dk;
        for (int a = 0; a < NV; a++) {
            v16 vv;
            memcpy(&vv, vr + c + 16 * a, 64);
            u[a] = (vv - acc[a]) * b;
            o[a] = acc[a] = (v16){0};
        }
        float *keep = states && r + 1 < R ? states + rh * per + c : NULL;
        for (int i = 0; i < dk; i++) {
            float *row = S + (size_t)i * dv + c;
            for (int a = 0; a < NV; a++) {
                v16 x;
                memcpy(&x, row + 16 * a, 64);
                x += kr[i] * u[a];
                o[a] += qr[i] * x;
                if (keep) {
#if defined(__AVX512F__) /* past the caches: nothing reads a checkpoint until a rollback, and a
                          * plain store first reads the line in (twice the memory traffic) */
                    if (streamed)
                        _mm512_stream_ps(keep + (size_t)i * dv + 16 * a, (__m512)x);
                    else
#endif
                        memcpy(keep + (size_t)i * dv + 16 * a, &x, 64);
                }
                if (r + 1 < R) {
                    x = x * next;
                    acc[a] += kn[i] * x;
                }
                memcpy(row + 16 * a, &x, 64);
            }
        }
        if (out)
            for (int a = 0; a < NV; a++) memcpy(out + rh * dv + c + 16 * a, &o[a], 64);
    }
}

/* The same for a last column that is not part of a strip of 16, row after row (the fused
 * multiply-adds written out: left to contraction they would differ between the loop's
 * versions with and without the checkpoint stores). */
static void gdn_column(const float *Sin, float *S, int dk, int dv, int j, int R, int Hv, int h, const float *q,
                       const float *k, const float *v, const float *g, const float *beta, float *out,
                       float *states) {
    for (int i = 0; i < dk; i++) S[(size_t)i * dv + j] = Sin[(size_t)i * dv + j];
    for (int r = 0; r < R; r++) {
        size_t rh = (size_t)r * Hv + h;
        const float *qh = q + rh * dk, *kh = k + rh * dk;
        float decay = fast_exp(g[rh]), kv = 0.0f, o = 0.0f;
        for (int i = 0; i < dk; i++) {
            float x = S[(size_t)i * dv + j] * decay;
            S[(size_t)i * dv + j] = x;
            kv = fmaf(kh[i], x, kv);
        }
        float u = (v[rh * dv + j] - kv) * beta[rh];
        for (int i = 0; i < dk; i++) {
            float x = fmaf(kh[i], u, S[(size_t)i * dv + j]);
            S[(size_t)i * dv + j] = x;
            o = fmaf(qh[i], x, o);
            if (states && r + 1 < R) states[rh * dk * dv + (size_t)i * dv + j] = x;
        }
        if (out) out[rh * dv + j] = o;
    }
}

/* The gated delta rule over R rows, one after another, all heads: `state_in` [Hv, dk, dv]
 * read, `state` written with the state after the rows (the same buffer or not). q, k [R, Hv,
 * dk]; v [R, Hv, dv]; g, beta [R, Hv]. out [R, Hv, dv] and states [R, Hv, dk, dv] (the state
 * after every row but the last, which is `state`; 64-byte aligned) are optional. The heads
 * are independent: each runs its rows whole on one thread, so the thread count changes nothing. */
void gdn_recurrence(const float *state_in, float *state, int R, int Hv, int dk, int dv, const float *q,
                    const float *k, const float *v, const float *g, const float *beta, float *out, float *states) {
    size_t per = (size_t)dk * dv;
    int parts = threads < Hv ? threads : Hv, streamed = states && ((uintptr_t)states & 63) == 0 && dv % 16 == 0;
    if ((long)R * Hv * per < MIN_PARALLEL_MACS) parts = 1; /* the tiny model's decode step: less than a barrier */
#pragma omp parallel for num_threads(parts) schedule(static)
    for (int h = 0; h < Hv; h++) {
        const float *Sin = state_in + h * per;
        float *S = state + h * per;
        int c = 0;
        for (; c + 64 <= dv; c += 64)
            gdn_strip_rows(Sin, S, dk, dv, c, R, Hv, h, q, k, v, g, beta, out, states, streamed, 4);
        for (; c + 16 <= dv; c += 16)
            gdn_strip_rows(Sin, S, dk, dv, c, R, Hv, h, q, k, v, g, beta, out, states, streamed, 1);
        for (; c < dv; c++) gdn_column(Sin, S, dk, dv, c, R, Hv, h, q, k, v, g, beta, out, states);
#if defined(__AVX512F__)
        if (streamed) _mm_sfence(); /* (streaming stores are weakly ordered: done before anyone reads them) */
#endif
    }
}

/* One Gated DeltaNet layer over R rows, then its MLP; x [R, hidden] is the residual stream
 * (updated in place). state_in [Hv, dk, dv] is read, state the layer's state after the
 * rows (and states [R, Hv, dk, dv], optional, after every row). window [taps-1, C] is the
 * conv window before the rows; ext [taps-1+R, C] receives it followed by the rows' conv
 * inputs. inputs [R * Hv * (2 dk + dv + 2)] receives the recurrence inputs for a replay:
 * q, k [R, Hv, dk], v [R, Hv, dv], g, beta [R, Hv], one after another. */
void gdn_layer(const Layer *L, float *x, int R, const float *state_in, float *state, const float *window,
               float *ext, float *inputs, float *states) {
    int H = L->hidden, Hk = L->kheads, dk = L->kdim, Hv = L->vheads, dv = L->vdim, K = L->taps;
    int kd = Hk * dk, vd = Hv * dv, C = 2 * kd + vd, P = C + vd + 2 * Hv, rep = Hv / Hk;
    float *h = malloc(sizeof(float) * (size_t)R * H);
    float *proj = malloc(sizeof(float) * (size_t)R * P);
    float *mix = malloc(sizeof(float) * (size_t)R * C); /* [R, C]: each row's conv output */
    float *o = malloc(sizeof(float) * (size_t)R * vd);
    float *y = malloc(sizeof(float) * (size_t)R * H);
    float *q = inputs, *k = q + (size_t)R * Hv * dk, *v = k + (size_t)R * Hv * dk, *g = v + (size_t)R * vd;
    float *beta = g + (size_t)R * Hv;
    memcpy(ext, window, sizeof(float) * (size_t)(K - 1) * C);
    rms_norm_rows(x, R, H, L->in_norm, L->eps, h);
    linear_packed(h, R, H, L->in_proj, L->wtype, P, proj);
    for (int r = 0; r < R; r++) memcpy(ext + (size_t)(K - 1 + r) * C, proj + (size_t)r * P, sizeof(float) * C);
    float qscale = 1.0f / sqrtf((float)dk);
    float *taps = malloc(sizeof(float) * (size_t)K * C); /* conv [C, K] as [K, C]: the loops below vectorise */
    for (int c = 0; c < C; c++)
        for (int j = 0; j < K; j++) taps[(size_t)j * C + c] = L->conv[(size_t)c * K + j];
    int parts = row_parts(R, C);
#pragma omp parallel for if (parts > 1) num_threads(parts) schedule(static)
    for (int r = 0; r < R; r++) {
        const float *pr = proj + (size_t)r * P;
        float *mixed = mix + (size_t)r * C;
        for (int c = 0; c < C; c++) mixed[c] = ext[(size_t)r * C + c] * taps[c];
        for (int j = 1; j < K; j++)
            for (int c = 0; c < C; c++) mixed[c] = mixed[c] + ext[(size_t)(r + j) * C + c] * taps[(size_t)j * C + c];
        for (int c = 0; c < C; c++) mixed[c] = fast_silu(mixed[c]);
        for (int hk = 0; hk < Hk; hk++) { /* l2-normalised q (scaled) and k, shared by `rep` value heads */
            const float *mq = mixed + hk * dk, *mk = mixed + kd + hk * dk;
            float sq = 0.0f, sk = 0.0f;
            for (int i = 0; i < dk; i++) { sq += mq[i] * mq[i]; sk += mk[i] * mk[i]; }
            float iq = 1.0f / sqrtf(sq + 1e-6f), ik = 1.0f / sqrtf(sk + 1e-6f);
            for (int e = 0; e < rep; e++) {
                float *qo = q + ((size_t)r * Hv + hk * rep + e) * dk, *ko = k + ((size_t)r * Hv + hk * rep + e) * dk;
                for (int i = 0; i < dk; i++) { qo[i] = mq[i] * iq * qscale; ko[i] = mk[i] * ik; }
            }
        }
        memcpy(v + (size_t)r * vd, mixed + 2 * kd, sizeof(float) * vd);
        for (int hv = 0; hv < Hv; hv++) {
            beta[(size_t)r * Hv + hv] = fast_sigmoid(pr[C + vd + hv]);
            g[(size_t)r * Hv + hv] = L->neg_a[hv] * softplusf(pr[C + vd + Hv + hv] + L->dt_bias[hv]);
        }
    }
    gdn_recurrence(state_in, state, R, Hv, dk, dv, q, k, v, g, beta, o, states);
    parts = row_parts(R, vd);
#pragma omp parallel for if (parts > 1) num_threads(parts) schedule(static)
    for (int r = 0; r < R; r++) /* per-head RMSNormGated: plain weight times silu(z) */
        for (int hv = 0; hv < Hv; hv++) {
            float *oh = o + ((size_t)r * Hv + hv) * dv;
            const float *z = proj + (size_t)r * P + C + hv * dv;
            float ss = 0.0f;
            for (int j = 0; j < dv; j++) ss += oh[j] * oh[j];
            float inv = 1.0f / sqrtf(ss / (float)dv + L->eps);
            for (int j = 0; j < dv; j++) oh[j] = L->gnorm[j] * (oh[j] * inv) * fast_silu(z[j]);
        }
    linear_packed(o, R, vd, L->out, L->wtype, H, y);
    for (size_t i = 0; i < (size_t)R * H; i++) x[i] += y[i];
    free(h); free(proj); free(mix); free(o); free(y); free(taps);
    mlp_block(L, x, R);
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
static inline float dot(const float *a, const float *b, int n) {
    int nv = n & ~15;
    v16 acc = {0}, u, v;
    for (int i = 0; i < nv; i += 16) {
        memcpy(&u, a + i, 64);
        memcpy(&v, b + i, 64);
        acc += u * v;
    }
    float s = lanes_sum(acc);
    for (int i = nv; i < n; i++) s = fmaf(a[i], b[i], s);
    return s;
}

/* a . K[j] for the four rows of K [4, n] at element `at` of a cache of type kt (a bf16 key is
 * widened in registers): four chains side by side (a read once for all), each the operations
 * of `dot` in its order, so each result is `dot`'s bit for bit. */
static inline void dot4(const float *a, const void *K, int kt, size_t at, int n, float *out) {
    int nv = n & ~15;
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

/* Queries of a kv head (rows x its query heads) summed by weighted_sums, V read once for all. */
#define FEW_QUERIES 64

/* Rows [t0, t1) of V [*, d] (cache type kt) into the sums of NQ queries over 32 columns at c:
 * acc [NQ][2][d] (even t, odd t), loaded into registers, summed row by row, stored back. */
static inline __attribute__((always_inline)) void strip_sums(const int NQ, const float *const *p, const void *V,
                                                             int kt, int d, int c, int t0, int t1,
                                                             float *const *acc, size_t ahead) {
    v16 e[4][2], o[4][2];
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
            for (size_t b = 0; b < 2 * (size_t)d * kv_bytes(kt); b += (size_t)d * kv_bytes(kt))
                for (size_t at = 0; at < 32 * kv_bytes(kt); at += 64)
                    __builtin_prefetch((const char *)V + ((size_t)t * d + c) * kv_bytes(kt) + ahead + b + at, 0, 2);
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
}

/* Rows [t0, t1) into the sums of nq <= 4 queries, strip after strip. */
static void rows_sums(int nq, const float *const *p, const void *V, int kt, int d, int t0, int t1,
                      float *const *acc, size_t ahead) {
    for (int c = 0; c < d; c += 32) switch (nq) {
        case 4: strip_sums(4, p, V, kt, d, c, t0, t1, acc, ahead); break;
        case 3: strip_sums(3, p, V, kt, d, c, t0, t1, acc, ahead); break;
        case 2: strip_sums(2, p, V, kt, d, c, t0, t1, acc, ahead); break;
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
        for (int q0 = 0; q0 < nq; q0 += 4) {
            int g = nq - q0 < 4 ? nq - q0 : 4, common = t1;
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

/* NeoX rotate-half on the first `rot` dims of one head vector, at position pos. */
static void rope(float *x, int rot, const float *inv_freq, int pos) {
    int half = rot / 2;
    for (int i = 0; i < half; i++) {
        float f = (float)pos * inv_freq[i], c = cosf(f), s = sinf(f);
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

/* Kv head j of attn_layer: the scores of every row's queries on its keys K [N, hd], their
 * softmax, and the gated weighted sums of V [N, hd] into att (K, V of L->kv_type). */
static void attend_kv_head(const Layer *L, int j, int R, int p0, int start, int N, const void *K, const void *V,
                           const float *proj, const float *qs, float *scores, float *att) {
    int nh = L->heads, hd = L->head_dim, groups = nh / L->kv_heads, P = 2 * nh * hd + 2 * L->kv_heads * hd;
    int kt = L->kv_type;
    float scale = 1.0f / sqrtf((float)hd);
    float *keys = kt ? malloc(sizeof(float) * hd) : NULL; /* [hd]: a bf16 key widened (the last N % 4) */
    /* four keys at a time against four queries at a time, read from the cache (bf16 widened in
     * registers), each key and query read once for the others; each score is still one `dot`.
     * A row also scores the block's keys past its own, never read. */
    int t = 0;
    size_t kb = kv_bytes(kt), ahead = KEYS_AHEAD * (size_t)hd * kb; /* prefetch: a long cache comes from memory */
    for (; t + 4 <= N; t += 4) {
        const char *next = (const char *)K + ((size_t)t * hd) * kb + ahead;
        for (size_t b = 0; b < 4 * (size_t)hd * kb; b += 64) __builtin_prefetch(next + b, 0, 2);
        const float *q4[4];
        float *s4[4];
        int nq = 0;
        for (int r = t < p0 - start ? 0 : t - (p0 - start); r < R; r++)
            for (int hq = j * groups; hq < (j + 1) * groups; hq++) {
                size_t qi = (size_t)r * nh + hq;
                q4[nq] = qs + qi * hd, s4[nq] = scores + qi * N + t;
                if (++nq == 4) dot4x4(q4, K, kt, (size_t)t * hd, hd, scale, s4), nq = 0;
            }
        for (int a = 0; a < nq; a++) {
            dot4(q4[a], K, kt, (size_t)t * hd, hd, s4[a]);
            for (int e = 0; e < 4; e++) s4[a][e] *= scale;
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
        for (int c = 0; c < hd; c += V_STRIP)
            for (int r = 0; r < R; r++)
                for (int hq = j * groups; hq < (j + 1) * groups; hq++)
                    weighted_sum(scores + ((size_t)r * nh + hq) * N, vf + c, p0 + r + 1 - start,
                                 hd - c < V_STRIP ? hd - c : V_STRIP, hd, att + ((size_t)r * nh + hq) * hd + c);
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

/* One gated-attention layer over R rows at positions p0.., then its MLP. kc, vc
 * [kv_heads, cap, head_dim] of L->kv_type: the rows' K and V are written at p0..p0+R-1; row r
 * attends to positions start..p0+r, exactly its own causal prefix (start: the first cached one). */
void attn_layer(const Layer *L, float *x, int R, int p0, int start, void *kc, void *vc, int cap) {
    int H = L->hidden, nh = L->heads, nkv = L->kv_heads, hd = L->head_dim, kt = L->kv_type;
    int P = 2 * nh * hd + 2 * nkv * hd;
    size_t kb = kv_bytes(kt);
    float *h = malloc(sizeof(float) * (size_t)R * H);
    float *proj = malloc(sizeof(float) * (size_t)R * P);
    float *att = malloc(sizeof(float) * (size_t)R * nh * hd);
    float *kbuf = malloc(sizeof(float) * (size_t)R * hd); /* [R, hd] */
    int N = p0 + R - start; /* keys the last row sees; row r sees the first N - (R - 1 - r) */
    /* rows attend in blocks whose scores [rows, heads, N] fit SCORE_FLOATS: memory stays a
     * chunk's however long the cache (the rows are independent: blocks change no value) */
    int block = (int)(SCORE_FLOATS / ((long)nh * N));
    block = block < 1 ? 1 : block > R ? R : block;
    float *qs = malloc(sizeof(float) * (size_t)R * nh * hd);
    float *scores = malloc(sizeof(float) * (size_t)block * nh * N);
    float *y = malloc(sizeof(float) * (size_t)R * H);
    rms_norm_rows(x, R, H, L->in_norm, L->eps, h);
    linear_packed(h, R, H, L->qkv, L->wtype, P, proj);
    int parts = row_parts(R, (long)nh * hd);
#pragma omp parallel for if (parts > 1) num_threads(parts) schedule(static)
    for (int r = 0; r < R; r++) { /* K and V of every row into the cache first */
        const float *pr = proj + (size_t)r * P;
        for (int j = 0; j < nkv; j++) {
            size_t at = ((size_t)j * cap + p0 + r) * hd;
            float *krow = kbuf + (size_t)r * hd; /* the row's K, normed and rotated, before it is stored */
            rms_norm(pr + 2 * nh * hd + j * hd, hd, L->k_norm, L->eps, krow);
            rope(krow, L->rot, L->inv_freq, p0 + r);
            kv_store((char *)kc + at * kb, kt, krow, hd);
            kv_store((char *)vc + at * kb, kt, pr + 2 * nh * hd + nkv * hd + j * hd, hd);
        }
    }
#pragma omp parallel for if (parts > 1) num_threads(parts) schedule(static)
    for (int r = 0; r < R; r++) /* every row's queries, normed and rotated */
        for (int hq = 0; hq < nh; hq++) {
            float *q = qs + ((size_t)r * nh + hq) * hd;
            rms_norm(proj + (size_t)r * P + hq * 2 * hd, hd, L->q_norm, L->eps, q);
            rope(q, L->rot, L->inv_freq, p0 + r);
        }
    /* the kv heads are independent: each is attended whole by one thread, in the same order
     * whatever the thread count (and the row count: each score and sum is its own chain) */
    for (int r0 = 0; r0 < R; r0 += block) {
        int rows = R - r0 < block ? R - r0 : block, n = p0 + r0 + rows - start;
        parts = threads < nkv ? threads : nkv;
        if ((long)rows * nh * n * hd < MIN_PARALLEL_ATTENTION) parts = 1;
#pragma omp parallel for num_threads(parts) schedule(static)
        for (int j = 0; j < nkv; j++) {
            size_t at = ((size_t)j * cap + start) * hd;
            attend_kv_head(L, j, rows, p0 + r0, start, n, (const char *)kc + at * kb, (const char *)vc + at * kb,
                           proj + (size_t)r0 * P, qs + (size_t)r0 * nh * hd, scores, att + (size_t)r0 * nh * hd);
        }
    }
    linear_packed(att, R, nh * hd, L->o, L->wtype, H, y);
    for (size_t i = 0; i < (size_t)R * H; i++) x[i] += y[i];
    free(h); free(proj); free(att); free(kbuf); free(qs); free(scores); free(y);
    mlp_block(L, x, R);
}

/* dst rows (stride `stride` floats) = src [R, H]: the aux layers' outputs, side by side. */
void copy_rows(const float *src, int R, int H, float *dst, int stride) {
    for (int r = 0; r < R; r++) memcpy(dst + (size_t)r * stride, src + (size_t)r * H, sizeof(float) * H);
}

/* x [R, H] = the embedding table's rows ids (fp32, or bf16 widened exactly); the table is
 * row-major, or (panels) a packed matrix's panels -- a tied lm_head's, the table kept once. */
void embed_rows(const void *table, int wtype, int panels, const int *ids, int R, int H, float *x) {
    for (int r = 0; r < R; r++) embed_row(table, wtype, panels, ids[r], H, x + (size_t)r * H);
}

/* logits [R, vocab] = rms_norm(x) @ lm_head^T; normed [R, H] (optional) receives rms_norm(x). */
void head(const float *x, int R, int H, const float *norm, float eps, const void *lm, int wtype, int vocab,
          float *logits, float *normed) {
    float *h = normed ? normed : malloc(sizeof(float) * (size_t)R * H);
    rms_norm_rows(x, R, H, norm, eps, h);
    linear_packed(h, R, H, lm, wtype, vocab, logits);
    if (!normed) free(h);
}

/* The index of the largest of x[0..n), the first of equals; a NaN counts as larger than any
 * number (the first NaN): torch.argmax's answer, in a pass at memory speed (torch's takes ~0.5 ms
 * a row of a 248K vocabulary: 3 ms for a 9-row verify, an eighth of an int4 decode step at 0.8B). */
int argmax_row(const float *x, int n) {
    int best = 0, i = 0;
#if defined(__AVX512F__)
    if (n >= 16) { /* lane l keeps the first maximum of indices l, l + 16, ...; then the lanes */
        __m512 m = _mm512_loadu_ps(x);
        __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), idx = at;
        int nan = _mm512_cmp_ps_mask(m, m, _CMP_UNORD_Q) ? 0 : -1;
        for (i = 16; nan < 0 && i + 16 <= n; i += 16) {
            __m512 v = _mm512_loadu_ps(x + i);
            at = _mm512_add_epi32(at, _mm512_set1_epi32(16));
            if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) nan = i;
            __mmask16 up = _mm512_cmp_ps_mask(v, m, _CMP_GT_OQ);
            m = _mm512_mask_mov_ps(m, up, v);
            idx = _mm512_mask_mov_epi32(idx, up, at);
        }
        if (nan >= 0) { /* the first NaN, from the chunk that has it */
            for (i = nan; x[i] == x[i]; i++) {}
            return i;
        }
        float mv = _mm512_reduce_max_ps(m);
        best = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(m, _mm512_set1_ps(mv), _CMP_EQ_OQ), idx);
    }
#endif
    for (; i < n; i++) {
        if (x[i] != x[i]) return i;
        if (x[i] > x[best]) best = i;
    }
    return best;
}
