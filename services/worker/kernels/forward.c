/* A whole forward step in one call over ragged token rows: any mix of decode rows (one new token
 * of a sequence) and prefill chunks (layouts: sluice_cpu.h; attention: attention.c). Every
 * stage computes each token row on its own, in an order that depends on nothing but that row:
 * the GEMMs sum a row's blocks in block order whatever M is and however the output columns are
 * split between threads, the norms and activations are per row, and attention reads exactly the
 * keys 0..pos of the row's own sequence. So a token's logits are the same bits whether it is
 * decoded alone, in a batch, or prefilled in a chunk of any size. */
#include "sl_impl.h"

/* x: [n, hidden] embeddings in (row r the token at position pos[r] of sequence seq[r], whose
 * block table is tables + seq[r] * table_stride), final hidden states out; kc, vc: layer 0 of
 * the cache, layer i num_blocks * kv_heads * block_size * head_dim halves further on. logits:
 * [n_logits, vocab], row j for token row logit_rows[j] (ascending). One parallel region for the
 * whole step: the threads meet at barriers between stages instead of being started and joined
 * ~270 times. */
void sl_forward(const sl_model *m, int64_t n, float *x, const int64_t *pos, const int64_t *seq,
                const int32_t *tables, int64_t table_stride, int64_t block_size, uint16_t *kc,
                uint16_t *vc, int64_t num_blocks, int64_t span, const sl_scratch *w, float *logits,
                const int64_t *logit_rows, int64_t n_logits, int nthreads) {
    const int64_t C = m->hidden, H = m->heads, KV = m->kv_heads, hd = m->head_dim;
    const int64_t layer_elems = num_blocks * KV * block_size * hd, nb = C / QK;
#pragma omp parallel num_threads(nthreads)
    {
        for (int64_t i = 0; i < m->layers; i++) {
            const sl_layer *L = m->layer + i;
            rmsnorm_quantize_body(x, L->input_norm, m->eps, n, C, w->xq, w->xd, w->xs, w->tmp);
            linear_body(&L->qkv, n, w->xq, w->xd, w->xs, w->qkv, 0);
            attention_body(n, H, KV, hd, w->qkv, m->cos, m->sin, pos, seq, tables, table_stride,
                           block_size, num_blocks, kc + i * layer_elems, vc + i * layer_elems,
                           L->q_norm, L->k_norm, m->eps, w->attended, span);
            quantize_body(w->attended, n, H * hd, w->xq, w->xd, w->xs);
            linear_body(&L->o, n, w->xq, w->xd, w->xs, x, 1);
            rmsnorm_quantize_body(x, L->post_norm, m->eps, n, C, w->xq, w->xd, w->xs, w->tmp);
            linear_body(&L->gate_up, n, w->xq, w->xd, w->xs, w->gate_up, 0);
            swiglu_quantize_body(w->gate_up, n, m->inner, w->xq, w->xd, w->xs, w->tmp);
            linear_body(&L->down, n, w->xq, w->xd, w->xs, x, 1);
        }
        /* The head reads only the rows whose logits are wanted, packed in list order: one stage
         * per run of consecutive rows (each stage ends on a barrier), so one in all when every
         * row is wanted (decode), one per sequence when each wants its last row. Every thread
         * finds the same runs: they all meet the same stages. */
        for (int64_t j = 0; j < n_logits;) {
            int64_t end = j + 1;
            while (end < n_logits && logit_rows[end] == logit_rows[end - 1] + 1) end++;
            rmsnorm_quantize_body(x + logit_rows[j] * C, m->final_norm, m->eps, end - j, C,
                                  w->xq + j * C, w->xd + j * nb, w->xs + j * nb, w->tmp + j * C);
            j = end;
        }
        if (n_logits > 0) linear_body(&m->head, n_logits, w->xq, w->xd, w->xs, logits, 0);
    }
}
