/* Attention over the paged KV cache (layouts: sluice_cpu.h), for decode (one new token of a
 * sequence) and prefill (a chunk of a sequence's tokens) alike, any mix of both in one call: all
 * run this one body, so a token's key, value and attention output are the same bits whichever
 * path computed it (a prompt token prefilled, a generated token decoded, a prefix reused from
 * the cache or recomputed, the chunk size, the blocks the cache gave it and their size). That
 * holds because every query attends with the same routine over exactly the keys 0..pos, in the
 * same order, and nothing in a row's arithmetic depends on the other rows, where its keys are
 * or the thread count. */
#include "sl_impl.h"

#include <stdio.h>

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

/* One query of a task: its rotated q (hd floats), its output o, its softmax row p (S floats) and
 * S, the keys it attends to (positions 0..S-1 of its sequence). */
typedef struct {
    const float *q;
    float *o, *p;
    int64_t S;
} query;

#if SL_AVX2
/* eight floats at off: from the converted floats f where there are some, else from the halves h
 * (the same values: to_floats stores what load_half8 gives) */
static inline __m256 floats8(const float *f, const uint16_t *h, int64_t off) {
    return f ? _mm256_loadu_ps(f + off) : load_half8(h + off);
}
#endif

/* keys (values) t..n-1 of a block as floats: what load_half8 gives, converted once per task
 * instead of once per query */
static void to_floats(const uint16_t *h, int64_t n, float *f) {
    int64_t i = 0;
#if SL_AVX2
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(f + i, load_half8(h + i));
#endif
    for (; i < n; i++) f[i] = half_to_float(h[i]);
}

/* A query's scores for keys 0..n-1 of one block, into p: q.k / sqrt(hd). keys: the halves,
 * kf: the same keys as floats, or NULL (a lone query reads the halves in place).
 *
 * Each score is the same bits as when every query converted the keys itself, and as over a
 * contiguous run (the one-slot cache this replaced), so a token's output depends on neither the
 * blocks it got, nor their size, nor the other queries of its task: the groups of four keys
 * start at multiples of four and the scalar tail (fewer than four) comes last, provided no group
 * straddles blocks. A block size that is a multiple of four (the ABI asks for eight) makes every
 * block but the last whole groups; another size still reads only its own blocks, just grouped
 * (and rounded) differently. */
static void block_scores(const float *q, const uint16_t *keys, const float *kf, int64_t n,
                         int64_t hd, float scale, float *p) {
    int64_t t = 0;
#if SL_AVX2
    if (hd % 8 == 0) {
        /* four keys at a time: four independent FMA chains and one combined horizontal sum */
        for (; t + 4 <= n; t += 4) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            const int64_t k0 = t * hd;
            for (int64_t d = 0; d < hd; d += 8) {
                const __m256 qv = _mm256_loadu_ps(q + d);
                a0 = _mm256_fmadd_ps(qv, floats8(kf, keys, k0 + d), a0);
                a1 = _mm256_fmadd_ps(qv, floats8(kf, keys, k0 + hd + d), a1);
                a2 = _mm256_fmadd_ps(qv, floats8(kf, keys, k0 + 2 * hd + d), a2);
                a3 = _mm256_fmadd_ps(qv, floats8(kf, keys, k0 + 3 * hd + d), a3);
            }
            _mm_storeu_ps(p + t, _mm_mul_ps(hsum4(a0, a1, a2, a3), _mm_set1_ps(scale)));
        }
    }
#else
    (void)kf;
#endif
    for (; t < n; t++) p[t] = dot_half(q, keys + t * hd, hd) * scale;
}

/* Two queries' scores for the same n keys of a block (block_scores for each, the same bits):
 * eight FMA chains instead of four, which is what keeps the FMA units busy; each key's floats are
 * loaded once for both. kf: the keys as floats, hd % 8 == 0. */
static void block_scores2(const float *q0, const float *q1, const uint16_t *keys,
                          const float *kf, int64_t n, int64_t hd, float scale, float *p0,
                          float *p1) {
    int64_t t = 0;
#if SL_AVX2
    for (; t + 4 <= n; t += 4) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        const float *k0 = kf + t * hd;
        for (int64_t d = 0; d < hd; d += 8) {
            const __m256 qa = _mm256_loadu_ps(q0 + d), qb = _mm256_loadu_ps(q1 + d);
            __m256 k = _mm256_loadu_ps(k0 + d);
            a0 = _mm256_fmadd_ps(qa, k, a0);
            b0 = _mm256_fmadd_ps(qb, k, b0);
            k = _mm256_loadu_ps(k0 + hd + d);
            a1 = _mm256_fmadd_ps(qa, k, a1);
            b1 = _mm256_fmadd_ps(qb, k, b1);
            k = _mm256_loadu_ps(k0 + 2 * hd + d);
            a2 = _mm256_fmadd_ps(qa, k, a2);
            b2 = _mm256_fmadd_ps(qb, k, b2);
            k = _mm256_loadu_ps(k0 + 3 * hd + d);
            a3 = _mm256_fmadd_ps(qa, k, a3);
            b3 = _mm256_fmadd_ps(qb, k, b3);
        }
        _mm_storeu_ps(p0 + t, _mm_mul_ps(hsum4(a0, a1, a2, a3), _mm_set1_ps(scale)));
        _mm_storeu_ps(p1 + t, _mm_mul_ps(hsum4(b0, b1, b2, b3), _mm_set1_ps(scale)));
    }
#else
    (void)kf;
#endif
    for (; t < n; t++) {
        p0[t] = dot_half(q0, keys + t * hd, hd) * scale;
        p1[t] = dot_half(q1, keys + t * hd, hd) * scale;
    }
}

/* p := e^(p - max p) / their sum over S scores: the weights. Each is the product p_t * (1 / sum)
 * that the values' loop used to form per value (the same bits), formed once here. */
static void softmax_row(float *p, int64_t S) {
    float mx = -INFINITY, sum = 0.0f;
    int64_t t = 0;
#if SL_AVX2
    /* the max is exact in any order (max_ps(p, m) keeps m for a NaN p, as the scalar test
     * does); a scalar loop would be one dependent compare per score */
    __m256 vmx = _mm256_set1_ps(-INFINITY);
    for (; t + 8 <= S; t += 8) vmx = _mm256_max_ps(_mm256_loadu_ps(p + t), vmx);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmx), _mm256_extractf128_ps(vmx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    mx = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#endif
    for (; t < S; t++) mx = p[t] > mx ? p[t] : mx;
    t = 0;
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
    t = 0;
#if SL_AVX2
    for (; t + 8 <= S; t += 8)
        _mm256_storeu_ps(p + t, _mm256_mul_ps(_mm256_loadu_ps(p + t), _mm256_set1_ps(inv)));
#endif
    for (; t < S; t++) p[t] *= inv;
}

/* o += w_t v_t over values 0..n-1 of one block, w: the block's weights (o zeroed before the
 * first block). vals: the halves; vf: the same values as floats, or NULL (a lone query reads
 * the halves in place). Each output sums its S products in position order, block after block: the
 * order of the contiguous loop, whatever the blocks and the task. */
static void block_values(const float *w, const uint16_t *vals, const float *vf, int64_t n,
                         int64_t hd, float *o) {
    int64_t d0 = 0;
#if SL_AVX2
    /* 64 output dims at a time stay in eight registers across the block's values */
    for (; d0 + 64 <= hd; d0 += 64) {
        __m256 acc[8];
        for (int j = 0; j < 8; j++) acc[j] = _mm256_loadu_ps(o + d0 + 8 * j);
        for (int64_t i = 0; i < n; i++) {
            const __m256 wi = _mm256_set1_ps(w[i]);
            for (int j = 0; j < 8; j++)
                acc[j] = _mm256_fmadd_ps(wi, floats8(vf, vals, i * hd + d0 + 8 * j), acc[j]);
        }
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(o + d0 + 8 * j, acc[j]);
    }
#else
    (void)vf;
#endif
    for (int64_t i = 0; i < n && d0 < hd; i++) axpy_half(w[i], vals + i * hd + d0, o + d0, hd - d0);
}

#if SL_AVX2 && !SL_AVX512_VNNI
/* Two queries' values for the same n values of a block (block_values for each, the same bits:
 * each output is still its own chain over the values in order), with twice the independent
 * chains, 32 dims at a time so AVX2's sixteen registers hold the eight accumulators; vf: the
 * values as floats, hd >= 64. */
static void block_values2(const float *w0, const float *w1, const uint16_t *vals, const float *vf,
                          int64_t n, int64_t hd, float *o0, float *o1) {
    int64_t d0 = 0;
    for (; d0 + 32 <= hd - hd % 64; d0 += 32) {
        __m256 a[4], b[4];
        for (int j = 0; j < 4; j++) {
            a[j] = _mm256_loadu_ps(o0 + d0 + 8 * j);
            b[j] = _mm256_loadu_ps(o1 + d0 + 8 * j);
        }
        const float *v = vf + d0;
        for (int64_t i = 0; i < n; i++, v += hd) {
            const __m256 wa = _mm256_set1_ps(w0[i]), wb = _mm256_set1_ps(w1[i]);
            for (int j = 0; j < 4; j++) {
                const __m256 x = _mm256_loadu_ps(v + 8 * j);
                a[j] = _mm256_fmadd_ps(wa, x, a[j]);
                b[j] = _mm256_fmadd_ps(wb, x, b[j]);
            }
        }
        for (int j = 0; j < 4; j++) {
            _mm256_storeu_ps(o0 + d0 + 8 * j, a[j]);
            _mm256_storeu_ps(o1 + d0 + 8 * j, b[j]);
        }
    }
    for (int64_t i = 0; i < n && d0 < hd; i++) {
        axpy_half(w0[i], vals + i * hd + d0, o0 + d0, hd - d0);
        axpy_half(w1[i], vals + i * hd + d0, o1 + d0, hd - d0);
    }
}
#endif

#if SL_AVX512_VNNI
/* Keys 0..n-1 (n a multiple of four) as floats, pairs interleaved by eights: the 16 floats at
 * t * hd + 2 d are dims d..d+7 of key t, then of key t + 1 (t even), so one 16-float load holds
 * the eight-float chunks of two keys that block_scores multiplies by the same eight q values. */
static void to_pairs(const uint16_t *keys, int64_t n, int64_t hd, float *kf) {
    for (int64_t t = 0; t < n; t += 2)
        for (int64_t d = 0; d < hd; d += 8) {
            _mm256_storeu_ps(kf + t * hd + 2 * d, load_half8(keys + t * hd + d));
            _mm256_storeu_ps(kf + t * hd + 2 * d + 8, load_half8(keys + (t + 1) * hd + d));
        }
}

static inline __m256 upper8(__m512 v) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

/* c queries' scores for the first n keys of a block (n a multiple of four), kf from to_pairs:
 * block_scores' arithmetic to the bit (each 8-lane half of a 16-lane chain is one of its four
 * chains; hsum4 of the halves), with half the FMAs and 2c chains. */
static inline __attribute__((always_inline)) void scores_z(const int c, const query *qs,
                                                           const float *kf, int64_t n,
                                                           int64_t hd, float scale, int64_t at) {
    for (int64_t t = 0; t < n; t += 4) {
        __m512 A[4], B[4];
        for (int j = 0; j < c; j++) A[j] = B[j] = _mm512_setzero_ps();
        const float *k = kf + t * hd;
        for (int64_t d = 0; d < hd; d += 8) {
            const __m512 k01 = _mm512_loadu_ps(k + 2 * d), k23 = _mm512_loadu_ps(k + 2 * hd + 2 * d);
            for (int j = 0; j < c; j++) {
                const __m512 qq = _mm512_castpd_ps(
                    _mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(qs[j].q + d))));
                A[j] = _mm512_fmadd_ps(qq, k01, A[j]);
                B[j] = _mm512_fmadd_ps(qq, k23, B[j]);
            }
        }
        for (int j = 0; j < c; j++) {
            const __m128 r = hsum4(_mm512_castps512_ps256(A[j]), upper8(A[j]),
                                   _mm512_castps512_ps256(B[j]), upper8(B[j]));
            _mm_storeu_ps(qs[j].p + at + t, _mm_mul_ps(r, _mm_set1_ps(scale)));
        }
    }
}

/* One block's scores for every query that reads it: up to four queries with the same number of
 * keys in the block at once (all but the last block: all of them), the tail keys as
 * block_scores does them. */
static void block_scores_z(query *qs, int64_t nq, const uint16_t *keys, float *kf,
                           const pages *pg, int64_t b, int64_t S, int64_t hd, float scale) {
    const int64_t at = b * pg->size;
    to_pairs(keys, block_len(pg, b, S) / 4 * 4, hd, kf);
    for (int64_t i = 0; i < nq;) {
        if (qs[i].S <= at) {
            i++;
            continue;
        }
        const int64_t m = block_len(pg, b, qs[i].S), n = m / 4 * 4;
        int c = 1;
        while (c < 4 && i + c < nq && qs[i + c].S > at && block_len(pg, b, qs[i + c].S) == m) c++;
        switch (c) {
        case 4: scores_z(4, qs + i, kf, n, hd, scale, at); break;
        case 3: scores_z(3, qs + i, kf, n, hd, scale, at); break;
        case 2: scores_z(2, qs + i, kf, n, hd, scale, at); break;
        default: scores_z(1, qs + i, kf, n, hd, scale, at);
        }
        for (int j = 0; j < c; j++, i++)
            for (int64_t t = n; t < m; t++)
                qs[i].p[at + t] = dot_half(qs[i].q, keys + t * hd, hd) * scale;
    }
}

/* c queries' values for the same n values of a block, hd >= 64: block_values' arithmetic to the
 * bit (each output its own chain over the values in order; a 16-lane register is two of its
 * 8-lane ones) with 4c chains; each value's floats are loaded once for all c queries and each
 * weight is broadcast from memory inside its FMA. */
static inline __attribute__((always_inline)) void values_z(const int c, const query *qs,
                                                           const float *vf, int64_t n,
                                                           int64_t hd, int64_t at) {
    for (int64_t d0 = 0; d0 + 64 <= hd; d0 += 64) {
        __m512 acc[4][4];
        for (int j = 0; j < c; j++)
            for (int u = 0; u < 4; u++) acc[j][u] = _mm512_loadu_ps(qs[j].o + d0 + 16 * u);
        const float *v = vf + d0;
        for (int64_t i = 0; i < n; i++, v += hd) {
            const __m512 x0 = _mm512_loadu_ps(v), x1 = _mm512_loadu_ps(v + 16);
            const __m512 x2 = _mm512_loadu_ps(v + 32), x3 = _mm512_loadu_ps(v + 48);
            for (int j = 0; j < c; j++) {
                const __m512 w = _mm512_set1_ps(qs[j].p[at + i]);
                acc[j][0] = _mm512_fmadd_ps(w, x0, acc[j][0]);
                acc[j][1] = _mm512_fmadd_ps(w, x1, acc[j][1]);
                acc[j][2] = _mm512_fmadd_ps(w, x2, acc[j][2]);
                acc[j][3] = _mm512_fmadd_ps(w, x3, acc[j][3]);
            }
        }
        for (int j = 0; j < c; j++)
            for (int u = 0; u < 4; u++) _mm512_storeu_ps(qs[j].o + d0 + 16 * u, acc[j][u]);
    }
}

/* One block's values for every query that reads it, up to four at once (as block_scores_z);
 * the dims past the last multiple of 64 as block_values does them. */
static void block_values_z(query *qs, int64_t nq, const uint16_t *vals, float *vf,
                           const pages *pg, int64_t b, int64_t S, int64_t hd) {
    const int64_t at = b * pg->size, tail = hd - hd % 64;
    to_floats(vals, block_len(pg, b, S) * hd, vf);
    for (int64_t i = 0; i < nq;) {
        if (qs[i].S <= at) {
            i++;
            continue;
        }
        const int64_t m = block_len(pg, b, qs[i].S);
        int c = 1;
        while (c < 4 && i + c < nq && qs[i + c].S > at && block_len(pg, b, qs[i + c].S) == m) c++;
        switch (c) {
        case 4: values_z(4, qs + i, vf, m, hd, at); break;
        case 3: values_z(3, qs + i, vf, m, hd, at); break;
        case 2: values_z(2, qs + i, vf, m, hd, at); break;
        default: values_z(1, qs + i, vf, m, hd, at);
        }
        for (int j = i; j < i + c && tail < hd; j++)
            for (int64_t t = 0; t < m; t++)
                axpy_half(qs[j].p[at + t], vals + t * hd + tail, qs[j].o + tail, hd - tail);
        i += c;
    }
}
#endif

/* A task: nq queries over one kv head of one sequence (several rows of a prefill chunk, the
 * query heads that share the kv head), o = softmax(q.K / sqrt(hd)) V each, reading the keys and
 * values in place through the block table. A block's keys and values are converted to floats
 * once for all the queries (kf, vf: block size x hd floats each): that conversion, not the
 * arithmetic, bounded a query that converted them itself, so a prefill chunk's rows reading a
 * long cached context went at the speed of the conversions. */
static void attend(query *qs, int64_t nq, const uint16_t *kc, const uint16_t *vc,
                   const pages *pg, int64_t hd, float scale, float *kf, float *vf) {
    int64_t S = 0;
    for (int64_t i = 0; i < nq; i++) S = qs[i].S > S ? qs[i].S : S;
    const int64_t blocks = (S + pg->size - 1) / pg->size;
    /* a lone query (one stream's decode, split by query heads) reads the halves in place: a
     * conversion would be shared by nobody */
    const int keys_vec = SL_AVX2 && hd % 8 == 0 && nq > 1, vals_vec = SL_AVX2 && hd >= 64 && nq > 1;
    for (int64_t b = 0; b < blocks; b++) {
        const uint16_t *keys = block_at(kc, pg, b);
#if SL_AVX512_VNNI
        if (keys_vec) {
            block_scores_z(qs, nq, keys, kf, pg, b, S, hd, scale);
            continue;
        }
#endif
        if (keys_vec) to_floats(keys, block_len(pg, b, S) * hd, kf);
        for (int64_t i = 0; i < nq; i++) {
            if (qs[i].S <= b * pg->size) continue;
            const int64_t m = block_len(pg, b, qs[i].S), at = b * pg->size;
            if (keys_vec && i + 1 < nq && block_len(pg, b, qs[i + 1].S) == m) {
                block_scores2(qs[i].q, qs[i + 1].q, keys, kf, m, hd, scale, qs[i].p + at,
                              qs[i + 1].p + at);
                i++;
            } else {
                block_scores(qs[i].q, keys, keys_vec ? kf : NULL, m, hd, scale, qs[i].p + at);
            }
        }
    }
    for (int64_t i = 0; i < nq; i++) {
        softmax_row(qs[i].p, qs[i].S);
        memset(qs[i].o, 0, (size_t)hd * sizeof(float));
    }
    for (int64_t b = 0; b < blocks; b++) {
        const uint16_t *vals = block_at(vc, pg, b);
#if SL_AVX512_VNNI
        if (vals_vec) {
            block_values_z(qs, nq, vals, vf, pg, b, S, hd);
            continue;
        }
#endif
        if (vals_vec) to_floats(vals, block_len(pg, b, S) * hd, vf);
        for (int64_t i = 0; i < nq; i++) {
            if (qs[i].S <= b * pg->size) continue;
            const int64_t m = block_len(pg, b, qs[i].S), at = b * pg->size;
#if SL_AVX2 && !SL_AVX512_VNNI
            if (vals_vec && i + 1 < nq && block_len(pg, b, qs[i + 1].S) == m) {
                block_values2(qs[i].p + at, qs[i + 1].p + at, vals, vf, m, hd, qs[i].o,
                              qs[i + 1].o);
                i++;
                continue;
            }
#endif
            block_values(qs[i].p + at, vals, vals_vec ? vf : NULL, m, hd, qs[i].o);
        }
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

/* rows per task: with the query heads of a kv head, about this many queries share one
 * conversion of each block; their softmax rows (this many x the context) stay in L2 */
#define TASK_QUERIES 48

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
                    const float *q_norm, const float *k_norm, float eps, float *out,
                    int64_t span) {
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
     * query heads, so the run's queries share each block's conversion. Too few of those for the
     * threads (one stream's decode: 3 kv heads for 2 threads would leave one idle a third of
     * the time) and each query head is a task of its own. Every thread lists the same runs. */
    const int64_t rows = TASK_QUERIES / G > 0 ? TASK_QUERIES / G : 1;
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
    const int64_t split = runs * KV >= 4 * omp_get_num_threads() ? 1 : G, per = G / split;
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
