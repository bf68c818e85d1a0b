/* The Gated DeltaNet layers (docs/DESIGN.md 2.1): the projections, the causal conv, the gated
 * delta rule (gdn_recurrence, also called alone to replay a rollback) and the gated norm. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_internal.h"

/* The recurrence's vectors: 16 lanes, or on the AVX2 tier 8 (a 16-lane vector there is kept
 * in memory, the sums stored and loaded on every step); a strip is up to GDN_STRIP of them. */
#if AVX2_TIER
typedef float vg __attribute__((vector_size(32)));
#else
typedef v16 vg;
#endif
#define VL ((int)(sizeof(vg) / sizeof(float)))
#define GDN_STRIP 4

static inline float softplusf(float x) { return x > 20.0f ? x : log1pf(fast_exp(x)); }

/* One head's delta rule for one row, on the state columns c..c+VL*NV-1 (strips of the
 * [dk, dv] state are independent): S *= decay and kv = k^T S in one walk over the strip,
 * u = (v - kv) * beta, then S += k u^T and out = q^T S in a second -- two walks instead of
 * four, the column sums in registers. Each element's operations, and their order, are
 * those of the four-loop form. */
/* Columns c..c+VL NV-1 of one head's state through all R rows (a column of the state evolves on
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
    vg acc[GDN_STRIP], u[GDN_STRIP], o[GDN_STRIP];
    const float *kr = k + (size_t)h * dk;
    float decay = fast_exp(g[h]);
    for (int a = 0; a < NV; a++) acc[a] = (vg){0};
    for (int i = 0; i < dk; i++)
        for (int a = 0; a < NV; a++) {
            vg x;
            memcpy(&x, Sin + (size_t)i * dv + c + VL * a, sizeof(vg));
            x = x * decay;
            memcpy(S + (size_t)i * dv + c + VL * a, &x, sizeof(vg));
            acc[a] += kr[i] * x;
        }
    for (int r = 0; r < R; r++) {
        size_t rh = (size_t)r * Hv + h;
        const float *qr = q + rh * dk, *vr = v + rh * dv, *kn = k + (rh + Hv) * dk;
        float b = beta[rh], next = r + 1 < R ? fast_exp(g[rh + Hv]) : 0.0f;
        kr = k + rh * dk;
        for (int a = 0; a < NV; a++) {
            vg vv;
            memcpy(&vv, vr + c + VL * a, sizeof(vg));
            u[a] = (vv - acc[a]) * b;
            o[a] = acc[a] = (vg){0};
        }
        float *keep = states && r + 1 < R ? states + rh * per + c : NULL;
        for (int i = 0; i < dk; i++) {
            float *row = S + (size_t)i * dv + c;
            for (int a = 0; a < NV; a++) {
                vg x;
                memcpy(&x, row + VL * a, sizeof(vg));
                x += kr[i] * u[a];
                o[a] += qr[i] * x;
                if (keep) {
#if defined(__AVX512F__) && !AVX2_TIER /* past the caches: nothing reads a checkpoint until a rollback, and a
                          * plain store first reads the line in (twice the memory traffic) */
                    if (streamed)
                        _mm512_stream_ps(keep + (size_t)i * dv + VL * a, (__m512)x);
                    else
#endif
                        memcpy(keep + (size_t)i * dv + VL * a, &x, sizeof(vg));
                }
                if (r + 1 < R) {
                    x = x * next;
                    acc[a] += kn[i] * x;
                }
                memcpy(row + VL * a, &x, sizeof(vg));
            }
        }
        if (out)
            for (int a = 0; a < NV; a++) memcpy(out + rh * dv + c + VL * a, &o[a], sizeof(vg));
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

/* One sequence's part of a recurrence call: its state before and after its R rows, its rows'
 * inputs q, k [R, Hv, dk], v [R, Hv, dv], g, beta [R, Hv], and (optional) out [R, Hv, dv] and
 * states [R, Hv, dk, dv] (the state after every row but the last, which is `state`). */
typedef struct {
    const float *state_in;
    float *state;
    int R;
    const float *q, *k, *v, *g, *beta;
    float *out, *states;
} GdnSeq;

/* The gated delta rule of every sequence's rows, one after another within a sequence. The
 * (sequence, head) pairs are independent: each runs its rows whole on one thread, so neither
 * the thread count nor the other sequences of the call change a value. */
static void gdn_recurrence_seqs(const GdnSeq *seqs, int nseq, int Hv, int dk, int dv) {
    size_t per = (size_t)dk * dv;
    long work = 0;
    for (int s = 0; s < nseq; s++) work += (long)seqs[s].R * Hv * per;
    int units = nseq * Hv, parts = threads < units ? threads : units;
    if (work < MIN_PARALLEL_MACS) parts = 1; /* the tiny model's decode step: less than a barrier */
#pragma omp parallel for num_threads(parts) schedule(dynamic, 1)
    for (int u = 0; u < units; u++) {
        const GdnSeq *e = seqs + u / Hv;
        int h = u % Hv, R = e->R;
        int streamed = e->states && ((uintptr_t)e->states & 63) == 0 && dv % 16 == 0;
        const float *Sin = e->state_in + h * per;
        float *S = e->state + h * per;
        int c = 0;
        /* strips of 4 vectors (64 columns; AVX2 32), then of one; each column's values are the
         * same in any strip */
        for (; c + GDN_STRIP * VL <= dv; c += GDN_STRIP * VL)
            gdn_strip_rows(Sin, S, dk, dv, c, R, Hv, h, e->q, e->k, e->v, e->g, e->beta, e->out, e->states, streamed,
                           GDN_STRIP);
        for (; c + VL <= dv; c += VL)
            gdn_strip_rows(Sin, S, dk, dv, c, R, Hv, h, e->q, e->k, e->v, e->g, e->beta, e->out, e->states, streamed, 1);
        for (; c < dv; c++) gdn_column(Sin, S, dk, dv, c, R, Hv, h, e->q, e->k, e->v, e->g, e->beta, e->out, e->states);
#if defined(__AVX512F__)
        if (streamed) _mm_sfence(); /* (streaming stores are weakly ordered: done before anyone reads them) */
#endif
    }
}

/* The gated delta rule over R rows of one sequence (gdn_recurrence_seqs' arguments; states
 * 64-byte aligned to be streamed), also called alone to replay a rollback. */
void gdn_recurrence(const float *state_in, float *state, int R, int Hv, int dk, int dv, const float *q,
                    const float *k, const float *v, const float *g, const float *beta, float *out, float *states) {
    GdnSeq one = {state_in, state, R, q, k, v, g, beta, out, states};
    gdn_recurrence_seqs(&one, 1, Hv, dk, dv);
}

/* One Gated DeltaNet layer over the rows of nseq sequences, then its MLP; x [sum rows, hidden]
 * is the residual stream (sequence 0's rows, then 1's, ...; updated in place). The matrix
 * products run over all the rows at once (each row's bits whatever rows share the call); the
 * conv, the recurrence and the gated norm per sequence on its own buffers, each row or
 * (sequence, head) whole on one thread. Per sequence s, of rows[s] = R rows: state_in[s] [Hv, dk,
 * dv] is read, state[s] the layer's state after the rows (and states[s] [R, Hv, dk, dv],
 * optional, after every row). window[s] [taps-1, C] is the conv window before the rows; ext[s]
 * [taps-1+R, C] receives it followed by the rows' conv inputs. inputs[s] [R * Hv * (2 dk + dv +
 * 2)] receives the recurrence inputs for a replay: q, k [R, Hv, dk], v [R, Hv, dv], g, beta
 * [R, Hv], one after another. */
void gdn_layer_seqs(const Layer *L, float *x, int nseq, const int *rows, const float *const *state_in,
                    float *const *state, const float *const *window, float *const *ext, float *const *inputs,
                    float *const *states) {
    int H = L->hidden, Hk = L->kheads, dk = L->kdim, Hv = L->vheads, dv = L->vdim, K = L->taps;
    int kd = Hk * dk, vd = Hv * dv, C = 2 * kd + vd, P = C + vd + 2 * Hv, rep = Hv / Hk, R = 0;
    for (int s = 0; s < nseq; s++) R += rows[s];
    int *seq = malloc(sizeof(int) * (size_t)R * 2), *local = seq + R; /* row -> its sequence, its row there */
    GdnSeq *seqs = malloc(sizeof(GdnSeq) * (size_t)nseq);
    float *h = malloc(sizeof(float) * (size_t)R * H);
    float *proj = malloc(sizeof(float) * (size_t)R * P);
    float *mix = malloc(sizeof(float) * (size_t)R * C); /* [R, C]: each row's conv output */
    float *o = malloc(sizeof(float) * (size_t)R * vd);
    float *y = malloc(sizeof(float) * (size_t)R * H);
    rms_norm_rows(x, R, H, L->in_norm, L->eps, h);
    linear_packed(h, R, H, L->in_proj, L->wtype, P, proj);
    for (int s = 0, at = 0; s < nseq; at += rows[s++]) {
        int n = rows[s];
        float *q = inputs[s], *k = q + (size_t)n * Hv * dk, *v = k + (size_t)n * Hv * dk, *g = v + (size_t)n * vd;
        seqs[s] = (GdnSeq){state_in[s], state[s], n, q, k, v, g, g + (size_t)n * Hv, o + (size_t)at * vd, states[s]};
        memcpy(ext[s], window[s], sizeof(float) * (size_t)(K - 1) * C);
        for (int r = 0; r < n; r++) {
            seq[at + r] = s, local[at + r] = r;
            memcpy(ext[s] + (size_t)(K - 1 + r) * C, proj + (size_t)(at + r) * P, sizeof(float) * C);
        }
    }
    float qscale = 1.0f / sqrtf((float)dk);
    const float *taps = L->conv; /* [K, C]: the loops below vectorise */
    int parts = row_parts(R, C);
#pragma omp parallel for if (parts > 1) num_threads(parts) schedule(static)
    for (int row = 0; row < R; row++) {
        int s = seq[row], r = local[row], n = rows[s];
        const float *pr = proj + (size_t)row * P, *ex = ext[s];
        float *mixed = mix + (size_t)row * C;
        float *q = inputs[s], *k = q + (size_t)n * Hv * dk, *v = k + (size_t)n * Hv * dk, *g = v + (size_t)n * vd;
        float *beta = g + (size_t)n * Hv;
        for (int c = 0; c < C; c++) mixed[c] = ex[(size_t)r * C + c] * taps[c];
        for (int j = 1; j < K; j++)
            for (int c = 0; c < C; c++) mixed[c] = mixed[c] + ex[(size_t)(r + j) * C + c] * taps[(size_t)j * C + c];
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
    gdn_recurrence_seqs(seqs, nseq, Hv, dk, dv);
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
    free(seq); free(seqs); free(h); free(proj); free(mix); free(o); free(y);
    mlp_block(L, x, R);
}

/* gdn_layer_seqs for one sequence of R rows (its arguments, one of each). */
void gdn_layer(const Layer *L, float *x, int R, const float *state_in, float *state, const float *window,
               float *ext, float *inputs, float *states) {
    gdn_layer_seqs(L, x, 1, &R, &state_in, &state, &window, &ext, &inputs, &states);
}
