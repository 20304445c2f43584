/* A whole forward step in one call, for decode (T = 1) and prefill alike (layouts: sluice_cpu.h;
 * attention: attention.c). Every stage computes each token row on its own, in an order that
 * depends on nothing but that row: the GEMMs sum a row's blocks in block order whatever M is
 * and however the output columns are split between threads, the norms and activations are per
 * row, and attention reads exactly the keys 0..pos. So a token's logits are the same bits
 * whether it is decoded alone, in a batch, or prefilled in a chunk of any size. */
#include "sl_impl.h"

/* x: [B * T, hidden] embeddings in (row b * T + t at position starts[b] + t of slot slots[b]),
 * final hidden states out; logits: [B * n_logits, vocab], the last n_logits rows of each b.
 * One parallel region for the whole step: the threads meet at barriers between stages instead
 * of being started and joined ~270 times. */
void sl_forward(const sl_model *m, int64_t B, int64_t T, float *x, const int64_t *starts,
                const int64_t *slots, uint16_t *kc, uint16_t *vc, int64_t cache_slots,
                int64_t capacity, int64_t span, const sl_scratch *w, float *logits,
                int64_t n_logits, int nthreads) {
    const int64_t C = m->hidden, H = m->heads, KV = m->kv_heads, hd = m->head_dim, M = B * T;
    const int64_t layer_elems = cache_slots * KV * capacity * hd, nb = C / QK;
#pragma omp parallel num_threads(nthreads)
    {
        for (int64_t i = 0; i < m->layers; i++) {
            const sl_layer *L = m->layer + i;
            rmsnorm_quantize_body(x, L->input_norm, m->eps, M, C, w->xq, w->xd, w->xs, w->tmp);
            linear_body(&L->qkv, M, w->xq, w->xd, w->xs, w->qkv, 0);
            attention_body(B, T, H, KV, hd, w->qkv, m->cos, m->sin, starts, slots,
                           kc + i * layer_elems, vc + i * layer_elems, capacity, L->q_norm,
                           L->k_norm, m->eps, w->attended, w->scores, span);
            quantize_body(w->attended, M, H * hd, w->xq, w->xd, w->xs);
            linear_body(&L->o, M, w->xq, w->xd, w->xs, x, 1);
            rmsnorm_quantize_body(x, L->post_norm, m->eps, M, C, w->xq, w->xd, w->xs, w->tmp);
            linear_body(&L->gate_up, M, w->xq, w->xd, w->xs, w->gate_up, 0);
            swiglu_quantize_body(w->gate_up, M, m->inner, w->xq, w->xd, w->xs, w->tmp);
            linear_body(&L->down, M, w->xq, w->xd, w->xs, x, 1);
        }
        /* the head reads only the rows whose logits are wanted, packed b by b (one stage when
         * that is every row: decode) */
        const int64_t parts = n_logits == T ? 1 : B, rows = n_logits == T ? M : n_logits;
        for (int64_t b = 0; b < parts; b++) {
            const int64_t from = b * T + T - n_logits, to = b * n_logits;
            rmsnorm_quantize_body(x + from * C, m->final_norm, m->eps, rows, C, w->xq + to * C,
                                  w->xd + to * nb, w->xs + to * nb, w->tmp + to * C);
        }
        linear_body(&m->head, B * n_logits, w->xq, w->xd, w->xs, logits, 0);
    }
}
