/* The DFlash drafters' CPU pass (docs/DESIGN.md 2.2): one call per draft pass and one per batch of
 * context rows. DFlash2 wraps every sublayer in its grouped conv; the published DFlash
 * (`conv` 0) runs the same layers without it. Activations fp32; the matrix products fp32, or the drafter-only bf16 or
 * int8 ones (native_products.c's wtype 2 and 3, `draft_products`).
 *
 * Why C: a draft pass of a small drafter is ~1,400 tiny torch ops and Python calls, about
 * half its time; here it is one call, its matrix products native_products.c's `linear_packed`.
 *
 * What it must match: DflashDrafter's torch pass (turbo/drafters/dflash.py), the same
 * function up to rounding with fp32 products (up to their quantisation with the others) --
 * including the scaled residual stream (rows enter divided by
 * `scale`, the norms reading it use eps / scale^2, every update is added divided by
 * `scale`). It need not be row-stable (the trunk verifies every proposed token, so
 * speculation stays lossless), only deterministic: every value below is a fixed-order
 * computation, whatever the thread count (products split by output, never within a sum).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"


/* cos and sin [R, head_dim / 2] of positions p0..p0+R-1: one table shared by every head and layer. */
static void df_rope_table(const Dflash *D, int p0, int R, float *cs, float *sn) {
    int half = D->head_dim / 2;
    for (int r = 0; r < R; r++)
        for (int i = 0; i < half; i++) {
            float f = (float)(p0 + r) * D->inv_freq[i];
            cs[(size_t)r * half + i] = cosf(f);
            sn[(size_t)r * half + i] = sinf(f);
        }
}

/* rms_norm with (1 + w) `norm`, then NeoX rotate-half over the whole head, for each head
 * of one row; x [heads, head_dim], cs/sn that row's table. */
static void df_norm_rope(const Dflash *D, const float *x, int heads, const float *norm, const float *cs,
                         const float *sn, float *out) {
    int d = D->head_dim, half = d / 2;
    for (int h = 0; h < heads; h++) {
        float *o = out + (size_t)h * d;
        rms_norm_rows(x + (size_t)h * d, 1, d, norm, D->eps, o);
        for (int i = 0; i < half; i++) {
            float a = o[i], b = o[i + half];
            o[i] = a * cs[i] + (-b) * sn[i];
            o[i + half] = b * cs[i] + a * sn[i];
        }
    }
}

/* One side of the grouped conv: out[t, c] = sum_o (base[o, c] + dyn[t, o, c / group]) * h[t - o, c]
 * over the taps o with t - o >= 0, in tap order. h [R, H]; base [taps, H]; dyn the projection's
 * rows (stride `stride`), [taps, groups] from its start. */
static void df_gconv(const Dflash *D, const float *h, int R, const float *base, const float *dyn, int stride,
                     float *out) {
    int H = D->hidden, G = H / D->group, gs = D->group;
    for (int t = 0; t < R; t++) {
        const float *dt = dyn + (size_t)t * stride;
        float *ot = out + (size_t)t * H;
        for (int g = 0; g < G; g++) /* tap 0, then each earlier row added in turn (contiguous: vectorised) */
            for (int c = g * gs; c < (g + 1) * gs; c++) ot[c] = (base[c] + dt[g]) * h[(size_t)t * H + c];
        for (int o = 1; o < D->taps && o <= t; o++)
            for (int g = 0; g < G; g++)
                for (int c = g * gs; c < (g + 1) * gs; c++)
                    ot[c] = ot[c] + (base[(size_t)o * H + c] + dt[o * G + g]) * h[(size_t)(t - o) * H + c];
    }
}

/* A sublayer's input: the conv's side 0 of xn into u (the projection's dynamic kernels, both
 * sides, into dyn [R, P]), or xn itself where the drafter has no conv. */
static const float *df_conv_prepare(const Dflash *D, const float *xn, int R, const void *proj, const float *base,
                                    float *dyn, int P, float *u) {
    if (!D->conv) return xn;
    linear_packed(xn, R, D->hidden, proj, D->wtype, P, dyn);
    df_gconv(D, xn, R, base, dyn, P, u);
    return u;
}

/* A sublayer's output y: the conv's side 1 into out (dyn: side 1's kernels), or y itself without a conv. */
static const float *df_conv_finish(const Dflash *D, const float *y, int R, const float *base, const float *dyn,
                                   int P, float *out) {
    if (!D->conv) return y;
    df_gconv(D, y, R, base + (size_t)D->taps * D->hidden, dyn, P, out);
    return out;
}

/* Attention of the R block rows (positions p0..): each query sees the context positions
 * max(0, p0 - window)..p0-1, read from the ring in position order (so a wrapped ring and an
 * unbounded one compute the same thing), then the block's own keys -- all of them, or up to
 * its own row when causal. q [R, heads, d]; kb, vb [R, kv_heads, d]; out [R, heads, d].
 * Each kv head's keys and values are gathered into native.c's packed layout (one pass over
 * the ring, every slot's heads together), so the scores of its R x rep queries and their
 * weighted values are two products. */
static void df_attend(const Dflash *D, const DfLayer *L, const float *q, const float *kb, const float *vb, int R,
                      int p0, float *out) {
    int nh = D->heads, nkv = D->kv_heads, d = D->head_dim, cap = D->capacity, rep = nh / nkv, Q = R * rep;
    int lo = p0 > D->window ? p0 - D->window : 0, ctx = p0 - lo, n = ctx + R;
    size_t kn = (size_t)(n + 15) / 16 * 16 * d, vn = (size_t)(d + 15) / 16 * 16 * n; /* one head's panels */
    float scale = 1.0f / sqrtf((float)d);
    float *kp = malloc(sizeof(float) * (nkv * (kn + vn) + (size_t)Q * (2 * d + n)));
    float *vp = kp + nkv * kn, *qj = vp + nkv * vn, *s = qj + (size_t)Q * d, *o = s + (size_t)Q * n;
    for (int j = 0; j < nkv; j++) { /* padding lanes: zero (their outputs are never stored) */
        for (size_t i = (size_t)(n / 16) * 16 * d; n % 16 && i < kn; i++) kp[j * kn + i] = 0.0f;
        if (d % 16)
            for (size_t i = (size_t)(d / 16) * 16 * n; i < vn; i++) vp[j * vn + i] = 0.0f;
    }
    for (int t = 0, slot = lo % cap; t < n; t++) { /* key t -> lane t % 16 of panel t / 16 */
        const float *keys = t < ctx ? L->ring_k + (size_t)slot * nkv * d : kb + (size_t)(t - ctx) * nkv * d;
        const float *vals = t < ctx ? L->ring_v + (size_t)slot * nkv * d : vb + (size_t)(t - ctx) * nkv * d;
        for (int j = 0; j < nkv; j++) {
            float *kt = kp + j * kn + (size_t)(t / 16) * d * 16 + t % 16;
            for (int i = 0; i < d; i++) kt[(size_t)i * 16] = keys[j * d + i];
            int c = 0;
            for (; c + 16 <= d; c += 16) /* a fixed size: a variable one compiles to a slow string copy */
                memcpy(vp + j * vn + ((size_t)(c / 16) * n + t) * 16, vals + j * d + c, 64);
            if (c < d)
                memcpy(vp + j * vn + ((size_t)(c / 16) * n + t) * 16, vals + j * d + c, sizeof(float) * (d - c));
        }
        if (t < ctx && ++slot == cap) slot = 0;
    }
    for (int j = 0; j < nkv; j++) {
        for (int r = 0; r < R; r++)
            memcpy(qj + (size_t)r * rep * d, q + ((size_t)r * nh + j * rep) * d, sizeof(float) * rep * d);
        linear_packed(qj, Q, d, kp + j * kn, 0, n, s);
        for (int r = 0; r < R; r++)
            for (int e = 0; e < rep; e++) { /* softmax of the keys row r sees; the rest weigh 0 */
                float *sr = s + ((size_t)r * rep + e) * n;
                int seen = D->causal ? ctx + r + 1 : n;
                for (int t = 0; t < seen; t++) sr[t] *= scale;
                float m = max_of(sr, seen);
                for (int t = 0; t < seen; t++) sr[t] = fast_exp(sr[t] - m);
                float z = sum_of(sr, seen);
                for (int t = 0; t < seen; t++) sr[t] /= z;
                for (int t = seen; t < n; t++) sr[t] = 0.0f;
            }
        linear_packed(s, Q, n, vp + j * vn, 0, d, o);
        for (int r = 0; r < R; r++)
            memcpy(out + ((size_t)r * nh + j * rep) * d, o + (size_t)r * rep * d, sizeof(float) * rep * d);
    }
    free(kp);
}

/* The draft pass: rows [anchor, mask x block] at positions p0.. through every layer.
 * logits [block, vocab] and final [block, hidden] (the normed hidden) of the block rows. */
void dflash_forward(const Dflash *D, int anchor, int p0, int block, float *logits, float *final) {
    int R = block + 1, H = D->hidden, I = D->inter, d = D->head_dim, half = d / 2;
    int qd = D->heads * d, kvd = D->kv_heads * d;
    int P = D->conv ? 2 * D->taps * (H / D->group) : 0, off = P / 2; /* the conv's dynamic kernels per row */
    float s = D->scale;
    size_t n_x = (size_t)R * H, n_i = (size_t)R * I;
    float *buf = malloc(sizeof(float) * (4 * n_x + (size_t)R * (P + 2 * qd + 2 * kvd + 2 * half) + 2 * n_i));
    float *x = buf, *xn = x + n_x, *u = xn + n_x, *y = u + n_x, *dyn = y + n_x, *q = dyn + (size_t)R * P;
    float *att = q + (size_t)R * qd, *k = att + (size_t)R * qd, *v = k + (size_t)R * kvd;
    float *cs = v + (size_t)R * kvd, *sn = cs + (size_t)R * half, *g = sn + (size_t)R * half, *up = g + n_i;
    for (int r = 0; r < R; r++) {
        float *xr = x + (size_t)r * H;
        embed_row(D->embed, D->embed_wtype, D->embed_panels, r ? D->mask_token : anchor, H, xr);
        for (int c = 0; c < H; c++) xr[c] = xr[c] / s;
    }
    df_rope_table(D, p0, R, cs, sn);
    for (int l = 0; l < D->layers; l++) {
        const DfLayer *L = &D->layer[l];
        /* attention, between the two sides of its grouped conv */
        rms_norm_rows(x, R, H, L->in_norm, D->res_eps, xn);
        const float *in = df_conv_prepare(D, xn, R, L->attn_proj, L->attn_base, dyn, P, u), *out;
        linear_packed(in, R, H, L->q, D->wtype, qd, y);
        for (int r = 0; r < R; r++)
            df_norm_rope(D, y + (size_t)r * qd, D->heads, L->q_norm, cs + (size_t)r * half, sn + (size_t)r * half,
                         q + (size_t)r * qd);
        linear_packed(in, R, H, L->k, D->wtype, kvd, y);
        for (int r = 0; r < R; r++)
            df_norm_rope(D, y + (size_t)r * kvd, D->kv_heads, L->k_norm, cs + (size_t)r * half,
                         sn + (size_t)r * half, k + (size_t)r * kvd);
        linear_packed(in, R, H, L->v, D->wtype, kvd, v);
        df_attend(D, L, q, k, v, R, p0, att);
        linear_packed(att, R, qd, L->o, D->wtype, H, y);
        out = df_conv_finish(D, y, R, L->attn_base, dyn + off, P, u);
        for (size_t i = 0; i < n_x; i++) x[i] = x[i] + out[i] / s;
        /* the MLP, between the two sides of its own */
        rms_norm_rows(x, R, H, L->post_norm, D->res_eps, xn);
        in = df_conv_prepare(D, xn, R, L->mlp_proj, L->mlp_base, dyn, P, u);
        linear_packed(in, R, H, L->gate, D->wtype, I, g);
        linear_packed(in, R, H, L->up, D->wtype, I, up);
        for (size_t i = 0; i < n_i; i++) g[i] = fast_silu(g[i]) * up[i];
        linear_packed(g, R, I, L->down, D->wtype, H, y);
        out = df_conv_finish(D, y, R, L->mlp_base, dyn + off, P, u);
        for (size_t i = 0; i < n_x; i++) x[i] = x[i] + out[i] / s;
    }
    rms_norm_rows(x + H, block, H, D->final_norm, D->res_eps, final);
    linear_packed(final, block, H, D->lm_head, D->lm_wtype, D->vocab, logits);
    free(buf);
}

/* Context rows p0..p0+n-1: aux [n, aux_width] (the trunk's fused aux states) -> every layer's
 * normed, rotated K and its V in the ring slots (position % capacity), in row order. */
void dflash_add_context(const Dflash *D, const float *aux, int n, int p0) {
    int H = D->hidden, d = D->head_dim, half = d / 2, kvd = D->kv_heads * d, cap = D->capacity;
    float *ctx = malloc(sizeof(float) * ((size_t)n * (H + kvd + 2 * half)));
    float *kv = ctx + (size_t)n * H, *cs = kv + (size_t)n * kvd, *sn = cs + (size_t)n * half;
    linear_packed(aux, n, D->aux_width, D->fc, D->wtype, H, ctx);
    rms_norm_rows(ctx, n, H, D->hidden_norm, D->eps, ctx);
    df_rope_table(D, p0, n, cs, sn);
    for (int l = 0; l < D->layers; l++) {
        const DfLayer *L = &D->layer[l];
        linear_packed(ctx, n, H, L->k, D->wtype, kvd, kv);
        for (int r = 0; r < n; r++)
            df_norm_rope(D, kv + (size_t)r * kvd, D->kv_heads, L->k_norm, cs + (size_t)r * half,
                         sn + (size_t)r * half, L->ring_k + (size_t)((p0 + r) % cap) * kvd);
        linear_packed(ctx, n, H, L->v, D->wtype, kvd, kv);
        for (int r = 0; r < n; r++)
            memcpy(L->ring_v + (size_t)((p0 + r) % cap) * kvd, kv + (size_t)r * kvd, sizeof(float) * kvd);
    }
    free(ctx);
}

/* The candidate selector (DflashDrafter's select_candidates): each row's top_k logits
 * (ties: the lower id), rescored by the bigram of the previous pick, greedily row after
 * row: score(c) = logit(c) + succ[c] . (pred[prev] * proj_i), proj_i = hproj @ final_i;
 * the best score wins, ties to the lower id. logits [B, V], final [B, H], hproj [rank, H],
 * pred_cb / succ_cb [V, rank], all fp32; top_k <= 64. Writes out[B]. */
void dflash_select(const float *logits, const float *final, int B, int V, int H, const float *hproj, int rank,
                   const float *pred_cb, const float *succ_cb, int top_k, int anchor, int *out) {
    int ids[64];
    float vals[64], *proj = malloc(sizeof(float) * (size_t)rank);
    int prev = anchor;
    for (int i = 0; i < B; i++) {
        const float *li = logits + (size_t)i * V;
        int n = 0, low = 0; /* kept candidates; the index of the weakest (lowest value, then highest id) */
        for (int c = 0; c < V; c++) {
            if (n == top_k && (c & 15) == 0 && c + 16 <= V && max_of(li + c, 16) <= vals[low]) {
                c += 15; /* sixteen at once that cannot enter (entering takes strictly more) */
                continue;
            }
            if (n < top_k) {
                ids[n] = c, vals[n] = li[c], n++;
            } else if (li[c] > vals[low]) {
                ids[low] = c, vals[low] = li[c];
            } else {
                continue;
            }
            for (int j = 0; j < n; j++)
                if (vals[j] < vals[low] || (vals[j] == vals[low] && ids[j] > ids[low])) low = j;
        }
        for (int r = 0; r < rank; r++) {
            float s = 0.0f;
            for (int h = 0; h < H; h++) s += hproj[(size_t)r * H + h] * final[(size_t)i * H + h];
            proj[r] = s * pred_cb[(size_t)prev * rank + r];
        }
        int best = -1;
        float best_score = 0.0f;
        for (int j = 0; j < n; j++) {
            float s = 0.0f;
            for (int r = 0; r < rank; r++) s += succ_cb[(size_t)ids[j] * rank + r] * proj[r];
            s += vals[j];
            if (best < 0 || s > best_score || (s == best_score && ids[j] < best)) best = ids[j], best_score = s;
        }
        out[i] = prev = best;
    }
    free(proj);
}
