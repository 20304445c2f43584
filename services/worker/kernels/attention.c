/* Attention over the paged KV cache (layouts: sluice_cpu.h), for decode (one new token of a
 * sequence) and prefill (a chunk of a sequence's tokens) alike, any mix of both in one call: all
 * run this one body, so a token's key, value and attention output are the same bits whichever
 * path computed it (a prompt token prefilled, a generated token decoded, a prefix reused from
 * the cache or recomputed, the chunk size, the blocks the cache gave it and their size). That
 * holds because every query attends with the same routine (attend.c) over exactly the keys
 * 0..pos, in the same order, and nothing in a row's arithmetic depends on the other rows, the
 * task it falls in, where its keys are or the thread count. This file writes the keys and values
 * and splits the queries into tasks. */
#include "sl_impl.h"

#include <stdio.h>

#ifdef _OPENMP
#include <omp.h>
#else
static int omp_get_thread_num(void) { return 0; }
static int omp_get_num_threads(void) { return 1; }
#endif

/* A key or value into the cache, rounded to halves (to nearest, ties to even, on every build). */
static inline void store_halves(uint16_t *dst, const float *src, int64_t n) {
    int64_t i = 0;
#if SL_F16C
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) dst[i] = float_to_half(src[i]);
}

/* Optional per-head RMSNorm (Qwen3's q_norm / k_norm), then rotary embedding in the Hugging Face
 * convention: dimension i pairs with i + hd/2. */
static void norm_rope(float *v, int64_t hd, const float *norm, float eps, const float *cos,
                      const float *sin) {
    if (norm) {
        float ss = 0.0f;
        for (int64_t i = 0; i < hd; i++) ss += v[i] * v[i];
        const float r = 1.0f / sqrtf(ss / (float)hd + eps);
        for (int64_t i = 0; i < hd; i++) v[i] = norm[i] * (v[i] * r);
    }
    const int64_t h = hd / 2;
    for (int64_t i = 0; i < h; i++) {
        const float a = v[i], b = v[i + h];
        v[i] = a * cos[i] - b * sin[i];
        v[i + h] = b * cos[i + h] + a * sin[i + h];
    }
}

/* Per-thread scratch that outlives the call (the pool's threads do): the floats of one block's
 * keys and values, the queries of a task and their softmax rows, and the task list. Grown, never
 * shrunk; a failed allocation ends the process rather than attend over garbage. */
static _Thread_local void *scratch;
static _Thread_local size_t scratch_bytes;

static void *thread_scratch(size_t bytes) {
    if (bytes > scratch_bytes) {
        free(scratch);
        scratch = malloc(bytes);
        if (!scratch) {
            fprintf(stderr, "sluice kernels: out of memory for %zu bytes of attention scratch\n",
                    bytes);
            abort();
        }
        scratch_bytes = bytes;
    }
    return scratch;
}

/* queries per task, at most (run_rows) */
#define TASK_QUERIES 48

/* Rows per task run: up to TASK_QUERIES queries with the query heads of a kv head, so they
 * share each block's conversion, and their softmax rows (that many x the context) stay in L2.
 * A few sequences' rows (a speculative draft's, a short prompt's) are cut into shorter runs, so
 * that their kv heads' tasks make two per thread: one sequence's five rows made three tasks for
 * two threads, which then split by query head, each of the nine converting the blocks again;
 * in two runs, six tasks (ops/bench/prefill_profile.py: five rows after 800 cached tokens spent
 * 5.4 ms in attention against 6.2, two rows 3.6 against 5.2). */
static int64_t run_rows(int64_t n, const int64_t *seq, int64_t KV, int64_t G, int threads) {
    const int64_t rows = TASK_QUERIES / G > 0 ? TASK_QUERIES / G : 1;
    int64_t longest = 0, len = 0, seqs = 0;
    for (int64_t r = 0; r < n; r++) {
        const int next = r == 0 || seq[r] != seq[r - 1];
        seqs += next;
        len = next ? 1 : len + 1;
        longest = len > longest ? len : longest;
    }
    const int64_t want = (2 * threads + KV - 1) / KV; /* runs for two tasks per thread */
    if (seqs >= want || longest < 2) return rows;
    const int64_t cut = (longest * seqs + want - 1) / want;
    return cut < rows ? cut : rows;
}

/* qkv: [n, (H + 2 KV) * hd] straight from the fused projection (rotated in place): row r is the
 * token at position pos[r] of sequence seq[r], whose block table is tables + seq[r] *
 * table_stride; its key and value go to offset pos % block_size of block table[pos / block_size]
 * (layout: sluice_cpu.h). Rows of one sequence are consecutive. Every row's key and value are
 * written first, then each query attends to positions 0..its own of its own sequence (causal):
 * rows of one sequence in one call (a prefill chunk) see each other's keys. No two rows may
 * write the same place: a block shared between sequences (a common prefix) is only read.
 * out: [n, H * hd]. span: more than the largest position. */
void attention_body(int64_t n, int64_t H, int64_t KV, int64_t hd, float *qkv,
                    const float *cos_table, const float *sin_table, const int64_t *pos,
                    const int64_t *seq, const int32_t *tables, int64_t table_stride,
                    int64_t block_size, int64_t num_blocks, uint16_t *kc, uint16_t *vc,
                    const float *q_norm, const float *k_norm, float eps, float *out, int64_t span) {
    const int64_t width = (H + 2 * KV) * hd, G = H / KV;
    const int64_t run = block_size * hd, head_stride = num_blocks * run;
    const float scale = 1.0f / sqrtf((float)hd);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < n * KV; task++) {
        const int64_t r = task / KV, k = task % KV, at_pos = pos[r];
        float *row = qkv + r * width;
        const float *c = cos_table + at_pos * hd, *s = sin_table + at_pos * hd;
        for (int64_t g = 0; g < G; g++) norm_rope(row + (k * G + g) * hd, hd, q_norm, eps, c, s);
        float *key = row + (H + k) * hd, *val = row + (H + KV + k) * hd;
        norm_rope(key, hd, k_norm, eps, c, s);
        const int64_t block = tables[seq[r] * table_stride + at_pos / block_size];
        const int64_t at = k * head_stride + block * run + (at_pos % block_size) * hd;
        store_halves(kc + at, key, hd);
        store_halves(vc + at, val, hd);
    }
    /* the barrier above: every key is in the cache before anyone attends.
     * The tasks: runs of up to `rows` consecutive rows of one sequence, each with one kv head's
     * query heads, so the run's queries share each block's conversion. Fewer than two of those
     * per thread (one stream's decode: 3 kv heads for 2 threads would leave one idle a third of
     * the time) and each query head is a task of its own; two streams' decode rows (six tasks
     * for two threads, three queries each) measured 1.065x in whole forwards against the
     * eighteen lone queries they were at four per thread. Every thread lists the same runs. */
    const int64_t rows = run_rows(n, seq, KV, G, omp_get_num_threads());
    const int64_t most = rows * G; /* queries in a task */
    const size_t floats = (size_t)(2 * run + most * span);
    char *mem = thread_scratch(floats * sizeof(float) + (size_t)most * sizeof(query) +
                               (size_t)(n + 1) * sizeof(int64_t));
    float *kf = (float *)mem, *vf = kf + run, *p = vf + run;
    query *qs = (query *)(kf + floats);
    int64_t *starts = (int64_t *)(qs + most), runs = 0;
    for (int64_t r = 0; r < n; r++)
        if (r == 0 || seq[r] != seq[r - 1] || r - starts[runs - 1] == rows) starts[runs++] = r;
    starts[runs] = n;
    const int64_t split = runs * KV >= 2 * omp_get_num_threads() ? 1 : G, per = G / split;
    const int64_t tasks = runs * KV * split;
#define TASK(task)                                                                                 \
    do {                                                                                           \
        const int64_t u = (task) / (KV * split), k = (task) / split % KV;                          \
        const int64_t g0 = (task) % split * per, r0 = starts[u], r1 = starts[u + 1];               \
        const pages pg = {tables + seq[r0] * table_stride, run, k * head_stride, block_size};      \
        int64_t nq = 0;                                                                            \
        for (int64_t r = r0; r < r1; r++)                                                          \
            for (int64_t g = g0; g < g0 + per; g++, nq++)                                          \
                qs[nq] = (query){qkv + r * width + (k * G + g) * hd,                               \
                                 out + r * H * hd + (k * G + g) * hd, p + nq * span, pos[r] + 1};  \
        attend(qs, nq, kc, vc, &pg, hd, scale, kf, vf);                                            \
    } while (0)
    if (split == 1) {
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) TASK(task);
    } else {
        /* a query head each, in runs of neighbours: a kv head's query heads mostly share a
         * thread, and with it the kv head's keys and values in its cache */
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) TASK(task);
    }
#undef TASK
}

void sl_attention(int64_t n, int64_t H, int64_t KV, int64_t hd, float *qkv, const float *cos_table,
                  const float *sin_table, const int64_t *pos, const int64_t *seq,
                  const int32_t *tables, int64_t table_stride, int64_t block_size,
                  int64_t num_blocks, uint16_t *kc, uint16_t *vc, const float *q_norm,
                  const float *k_norm, float eps, float *out, int64_t span, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    attention_body(n, H, KV, hd, qkv, cos_table, sin_table, pos, seq, tables, table_stride,
                   block_size, num_blocks, kc, vc, q_norm, k_norm, eps, out, span);
}
