/* Attention over the paged KV cache (layouts: sluice_cpu.h), for decode (one new token of a
 * sequence) and prefill (a chunk of a sequence's tokens) alike, any mix of both in one call: all
 * run this one body, so a token's key, value and attention output are the same bits whichever
 * path computed it (a prompt token prefilled, a generated token decoded, a prefix reused from
 * the cache or recomputed, the chunk size, the blocks the cache gave it and their size). That
 * holds because every query attends with the same routine over exactly the keys 0..pos, in the
 * same order, and nothing in a row's arithmetic depends on the other rows, where its keys are
 * or the thread count. */
#include "sl_impl.h"

#ifdef _OPENMP
#include <omp.h>
#else
static int omp_get_thread_num(void) { return 0; }
static int omp_get_num_threads(void) { return 1; }
#endif

/* q . k for a cached key k */
static inline float dot_half(const float *q, const uint16_t *k, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#if SL_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load_half8(k + i), acc);
    s = hsum(acc);
#endif
    for (; i < n; i++) s += q[i] * half_to_float(k[i]);
    return s;
}

/* y += a v for a cached value v */
static inline void axpy_half(float a, const uint16_t *v, float *y, int64_t n) {
    int64_t i = 0;
#if SL_AVX2
    const __m256 va = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, load_half8(v + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++) y[i] += a * half_to_float(v[i]);
}

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

/* One kv head of one sequence in a layer's paged cache: the block ids in the sequence's table,
 * the halves per block (all kv heads), where this head's keys sit in a block, the block size. */
typedef struct {
    const int32_t *table;
    int64_t block_stride, head, size; /* halves from one block to the next; the kv head's base */
} pages;

/* the first key (value) of block b of the sequence: size keys of hd halves follow, contiguous */
static inline const uint16_t *block_at(const uint16_t *cache, const pages *pg, int64_t b) {
    return cache + pg->table[b] * pg->block_stride + pg->head;
}

/* keys (values) of block b among the first S */
static inline int64_t block_len(const pages *pg, int64_t b, int64_t S) {
    const int64_t left = S - b * pg->size;
    return left < pg->size ? left : pg->size;
}

/* One query head over the S keys/values at positions 0..S-1 of a sequence, read in place through
 * its block table: o = softmax(q.K / sqrt(hd)) V. p: S floats.
 *
 * Every value is the same bits as if the S keys and values lay contiguously (the one-slot cache
 * this replaced), so a token's output does not depend on the blocks it got or their size. The
 * scores: the groups of four keys start at multiples of four and the scalar tail (fewer than
 * four) comes last, as over a contiguous run, provided no group straddles blocks: a block size
 * that is a multiple of four (the ABI asks for eight) makes every block but the last whole
 * groups. Another size still reads only its own blocks, just grouped (and rounded) differently.
 * The softmax runs over p as before. The values: each output chunk sums its S products in
 * position order, block after block, the order of the contiguous loop. */
static void attend(const float *q, const uint16_t *kc, const uint16_t *vc, const pages *pg,
                   int64_t S, int64_t hd, float scale, float *p, float *o) {
    const int64_t blocks = (S + pg->size - 1) / pg->size;
    float mx = -INFINITY, sum = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        const uint16_t *keys = block_at(kc, pg, b);
        const int64_t n = block_len(pg, b, S);
        float *pb = p + b * pg->size;
        int64_t t = 0;
#if SL_AVX2
        if (hd % 8 == 0) {
            /* four keys at a time: four independent FMA chains and one combined horizontal sum */
            for (; t + 4 <= n; t += 4) {
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                const uint16_t *k0 = keys + t * hd;
                for (int64_t d = 0; d < hd; d += 8) {
                    const __m256 qv = _mm256_loadu_ps(q + d);
                    a0 = _mm256_fmadd_ps(qv, load_half8(k0 + d), a0);
                    a1 = _mm256_fmadd_ps(qv, load_half8(k0 + hd + d), a1);
                    a2 = _mm256_fmadd_ps(qv, load_half8(k0 + 2 * hd + d), a2);
                    a3 = _mm256_fmadd_ps(qv, load_half8(k0 + 3 * hd + d), a3);
                }
                _mm_storeu_ps(pb + t, _mm_mul_ps(hsum4(a0, a1, a2, a3), _mm_set1_ps(scale)));
            }
        }
#endif
        for (; t < n; t++) pb[t] = dot_half(q, keys + t * hd, hd) * scale;
    }
    for (int64_t i = 0; i < S; i++) mx = p[i] > mx ? p[i] : mx;
    int64_t t = 0;
#if SL_AVX2
    __m256 vsum = _mm256_setzero_ps();
    for (; t + 8 <= S; t += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(p + t), _mm256_set1_ps(mx)));
        _mm256_storeu_ps(p + t, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    sum = hsum(vsum);
#endif
    for (; t < S; t++) {
        p[t] = expf(p[t] - mx);
        sum += p[t];
    }
    const float inv = 1.0f / sum;
    int64_t d0 = 0;
#if SL_AVX2
    /* 64 output dims at a time stay in eight registers across all S values */
    for (; d0 + 64 <= hd; d0 += 64) {
        __m256 acc[8];
        for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; b++) {
            const uint16_t *v = block_at(vc, pg, b) + d0;
            const float *pb = p + b * pg->size;
            const int64_t n = block_len(pg, b, S);
            for (int64_t i = 0; i < n; i++, v += hd) {
                const __m256 w = _mm256_set1_ps(pb[i] * inv);
                for (int j = 0; j < 8; j++)
                    acc[j] = _mm256_fmadd_ps(w, load_half8(v + 8 * j), acc[j]);
            }
        }
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(o + d0 + 8 * j, acc[j]);
    }
#endif
    if (d0 < hd) {
        memset(o + d0, 0, (size_t)(hd - d0) * sizeof(float));
        for (int64_t b = 0; b < blocks; b++) {
            const uint16_t *v = block_at(vc, pg, b) + d0;
            const float *pb = p + b * pg->size;
            const int64_t n = block_len(pg, b, S);
            for (int64_t i = 0; i < n; i++) axpy_half(pb[i] * inv, v + i * hd, o + d0, hd - d0);
        }
    }
}

/* qkv: [n, (H + 2 KV) * hd] straight from the fused projection (rotated in place): row r is the
 * token at position pos[r] of sequence seq[r], whose block table is tables + seq[r] *
 * table_stride; its key and value go to offset pos % block_size of block table[pos / block_size]
 * (layout: sluice_cpu.h). Every row's key and value are written first, then each query attends
 * to positions 0..its own of its own sequence (causal): rows of one sequence in one call (a
 * prefill chunk) see each other's keys. No two rows may write the same place: a block shared
 * between sequences (a common prefix) is only read. out: [n, H * hd]. scores: span floats per
 * thread, span > the largest position. */
void attention_body(int64_t n, int64_t H, int64_t KV, int64_t hd, float *qkv,
                    const float *cos_table, const float *sin_table, const int64_t *pos,
                    const int64_t *seq, const int32_t *tables, int64_t table_stride,
                    int64_t block_size, int64_t num_blocks, uint16_t *kc, uint16_t *vc,
                    const float *q_norm, const float *k_norm, float eps, float *out, float *scores,
                    int64_t span) {
    const int64_t width = (H + 2 * KV) * hd, G = H / KV, tasks = n * KV;
    const int64_t run = block_size * hd, head_stride = num_blocks * run;
    const float scale = 1.0f / sqrtf((float)hd);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks; task++) {
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
    /* the barrier above: every key is in the cache before anyone attends */
    float *p = scores + (int64_t)omp_get_thread_num() * span;
    if (tasks >= 4 * omp_get_num_threads()) {
        /* a kv head's query heads together: its keys and values come from memory once */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t r = task / KV, k = task % KV;
            const pages pg = {tables + seq[r] * table_stride, run, k * head_stride, block_size};
            for (int64_t g = 0; g < G; g++) {
                const int64_t h = k * G + g;
                attend(qkv + r * width + h * hd, kc, vc, &pg, pos[r] + 1, hd, scale, p,
                       out + r * H * hd + h * hd);
            }
        }
    } else {
        /* few kv heads for the threads (one stream's decode: 3 for 2 threads would leave one
         * idle a third of the time): a query head each, in runs of neighbours, so a kv head's
         * query heads mostly share a thread. The same attend per head: the same bits. */
#pragma omp for schedule(static)
        for (int64_t task = 0; task < n * H; task++) {
            const int64_t r = task / H, h = task % H;
            const pages pg = {tables + seq[r] * table_stride, run, (h / G) * head_stride,
                              block_size};
            attend(qkv + r * width + h * hd, kc, vc, &pg, pos[r] + 1, hd, scale, p,
                   out + r * H * hd + h * hd);
        }
    }
}

void sl_attention(int64_t n, int64_t H, int64_t KV, int64_t hd, float *qkv, const float *cos_table,
                  const float *sin_table, const int64_t *pos, const int64_t *seq,
                  const int32_t *tables, int64_t table_stride, int64_t block_size,
                  int64_t num_blocks, uint16_t *kc, uint16_t *vc, const float *q_norm,
                  const float *k_norm, float eps, float *out, float *scores, int64_t span,
                  int nthreads) {
#pragma omp parallel num_threads(nthreads)
    attention_body(n, H, KV, hd, qkv, cos_table, sin_table, pos, seq, tables, table_stride,
                   block_size, num_blocks, kc, vc, q_norm, k_norm, eps, out, scores, span);
}
