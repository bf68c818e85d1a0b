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
 * The parts: native_products.c (the matrix products' entry point and dispatch, the float panels,
 * the threads; native_qproducts.c the affine int4 / int8 groups, native_exact.c and
 * native_int4_lanes.c the exact formats, native_amx.c bf16 by AMX, native_avx2.c the AVX2
 * tier's tiles for them), native_gdn.c (Gated
 * DeltaNet), native_attn.c (gated attention), native_moe.c (the MoE block), native_dflash.c (the
 * drafter's pass); this file: the structs' sizes, embedding rows, the head, argmax.
 *
 * Built by turbo/backends/native_lib.py with the host's compiler (no -ffast-math: the
 * compiler must not reassociate sums). Matrices are fp32 (wtype 0) or bf16 (wtype 1, 6);
 * bf16 is widened exactly to fp32 before the multiply, so activations stay fp32 -- except where
 * the CPU has AMX-BF16 (native_amx.c, bf16_products): there a bf16 matrix's products take
 * the inputs rounded to bf16 through the tiles, for every row count alike (still row-stable).
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

#include "native_internal.h"

int struct_size(int which) {
    return which == 0 ? (int)sizeof(Layer) : which == 1 ? (int)sizeof(Dflash) : which == 2 ? (int)sizeof(DfLayer)
         : which == 3 ? (int)sizeof(Moe) : -1;
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
#elif AVX2_TIER
    if (n >= 8) { /* the same, eight lanes: lane l keeps the first maximum of indices l, l + 8, ... */
        __m256 m = _mm256_loadu_ps(x);
        __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), idx = at;
        int nan = _mm256_movemask_ps(_mm256_cmp_ps(m, m, _CMP_UNORD_Q)) ? 0 : -1;
        for (i = 8; nan < 0 && i + 8 <= n; i += 8) {
            __m256 v = _mm256_loadu_ps(x + i);
            at = _mm256_add_epi32(at, _mm256_set1_epi32(8));
            if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))) nan = i;
            __m256 up = _mm256_cmp_ps(v, m, _CMP_GT_OQ);
            m = _mm256_blendv_ps(m, v, up);
            idx = _mm256_blendv_epi8(idx, at, _mm256_castps_si256(up));
        }
        if (nan >= 0) {
            for (i = nan; x[i] == x[i]; i++) {}
            return i;
        }
        float lanes[8];
        int32_t where[8];
        _mm256_storeu_ps(lanes, m);
        _mm256_storeu_si256((__m256i *)where, idx);
        best = where[0];
        for (int l = 1; l < 8; l++) /* the largest, then the first index among equals */
            if (lanes[l] > x[best] || (lanes[l] == x[best] && where[l] < best)) best = where[l];
    }
#endif
    for (; i < n; i++) {
        if (x[i] != x[i]) return i;
        if (x[i] > x[best]) best = i;
    }
    return best;
}
