/* The MoE block of a Qwen3.5-MoE / Qwen3-Next layer (docs/DESIGN.md 2.1), the MLP half that
 * the trunk's layers (mlp_block) call in place of the dense SwiGLU when a layer routes (Layer.moe).
 *
 * Per row: router logits, softmax, the top_k most probable experts (ties to the lower index),
 * their probabilities renormalised when the config says so. Then per expert, in ascending
 * index order, one product over just the rows that picked it -- each expert's weights are read
 * once per call, and only the selected experts' are read at all -- and each row adds
 * weight * expert(row) into its sum in that same ascending order, then the sigmoid-gated
 * shared expert. A row's arithmetic is the same whatever rows share the call (linear_packed
 * is row-stable; the routing and the sums are per row, in a fixed order), so the rows of a
 * verify equal one-row decode steps bit for bit.
 */
#include <stdlib.h>
#include <string.h>

#include "native.h"

/* Row r's experts (ascending) and weights from its probabilities p [E] (softmaxed in place). */
static void route(float *p, const Moe *M, int *experts, float *weights) {
    int E = M->experts, k = M->top_k;
    float m = max_of(p, E);
    for (int e = 0; e < E; e++) p[e] = fast_exp(p[e] - m);
    float z = sum_of(p, E);
    for (int e = 0; e < E; e++) p[e] /= z;
    char *taken = calloc((size_t)E, 1);
    float total = 0.0f;
    for (int j = 0; j < k; j++) { /* the j-th most probable: strict > keeps the lower index on a tie */
        int best = -1;
        for (int e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
        taken[best] = 1;
        total += p[best];
    }
    for (int e = 0, j = 0; e < E; e++)
        if (taken[e]) {
            experts[j] = e;
            weights[j++] = M->norm_topk ? p[e] / total : p[e];
        }
    free(taken);
}

/* out [n, H] = down(silu(gate x) * up x) for x [n, H], gate_up [2I, H] (the gate's rows first). */
static void swiglu(const float *x, int n, int H, int I, const void *gate_up, const void *down, int wtype, float *out) {
    float *gu = malloc(sizeof(float) * (size_t)n * 2 * I);
    float *act = malloc(sizeof(float) * (size_t)n * I);
    linear_packed(x, n, H, gate_up, wtype, 2 * I, gu);
    for (int r = 0; r < n; r++)
        for (int i = 0; i < I; i++)
            act[(size_t)r * I + i] = fast_silu(gu[(size_t)r * 2 * I + i]) * gu[(size_t)r * 2 * I + I + i];
    linear_packed(act, n, I, down, wtype, H, out);
    free(gu); free(act);
}

void moe_block(const Layer *L, float *x, int R) {
    const Moe *M = L->moe;
    int H = L->hidden, E = M->experts, k = M->top_k, I = M->inter, S = M->shared_inter;
    float *h = malloc(sizeof(float) * (size_t)R * H);
    float *probs = malloc(sizeof(float) * (size_t)R * E);
    int *experts = malloc(sizeof(int) * (size_t)R * k);
    float *weights = malloc(sizeof(float) * (size_t)R * k);
    float *acc = calloc((size_t)R * H, sizeof(float));
    int *rows = malloc(sizeof(int) * (size_t)R);
    float *w = malloc(sizeof(float) * (size_t)R);
    float *xe = malloc(sizeof(float) * (size_t)R * H);
    float *ye = malloc(sizeof(float) * (size_t)R * H);
    rms_norm_rows(x, R, H, L->post_norm, L->eps, h);
    linear_packed(h, R, H, M->router, M->wtype, E, probs);
    for (int r = 0; r < R; r++) route(probs + (size_t)r * E, M, experts + (size_t)r * k, weights + (size_t)r * k);
    for (int e = 0; e < E; e++) {
        int n = 0;
        for (int r = 0; r < R; r++)
            for (int j = 0; j < k; j++)
                if (experts[(size_t)r * k + j] == e) {
                    rows[n] = r;
                    w[n] = weights[(size_t)r * k + j];
                    memcpy(xe + (size_t)n++ * H, h + (size_t)r * H, sizeof(float) * H);
                }
        if (!n) continue;
        swiglu(xe, n, H, I, M->gate_up[e], M->down[e], M->ewtype, ye);
        for (int i = 0; i < n; i++) {
            float *a = acc + (size_t)rows[i] * H;
            const float *y = ye + (size_t)i * H;
            for (int c = 0; c < H; c++) a[c] += y[c] * w[i];
        }
    }
    if (M->shared_gate_up) {
        float *gate = malloc(sizeof(float) * (size_t)R);
        swiglu(h, R, H, S, M->shared_gate_up, M->shared_down, M->ewtype, ye);
        linear_packed(h, R, H, M->shared_gate, M->wtype, 1, gate);
        for (int r = 0; r < R; r++) {
            float g = fast_sigmoid(gate[r]);
            for (int c = 0; c < H; c++) acc[(size_t)r * H + c] += g * ye[(size_t)r * H + c];
        }
        free(gate);
    }
    for (size_t i = 0; i < (size_t)R * H; i++) x[i] += acc[i];
    free(h); free(probs); free(experts); free(weights); free(acc); free(rows); free(w); free(xe); free(ye);
}
