/* One attention task over the paged KV cache (attention.c splits a call into tasks): nq queries
 * of one sequence and one kv head, o = softmax(q.K / sqrt(hd)) V each, read in place through the
 * sequence's block table. Every query's output is the same bits however the queries are grouped
 * into tasks and however its keys are laid out in blocks: the arithmetic of a query depends only
 * on q, its keys and values, and their number. That is what makes a token's output the same
 * whichever path computed it (attention.c). */
#include "sl_impl.h"

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

/* the first key (value) of block b of the sequence: size keys of hd halves follow, contiguous */
static inline const uint16_t *block_at(const uint16_t *cache, const pages *pg, int64_t b) {
    return cache + pg->table[b] * pg->block_stride + pg->head;
}

/* keys (values) of block b among the first S */
static inline int64_t block_len(const pages *pg, int64_t b, int64_t S) {
    const int64_t left = S - b * pg->size;
    return left < pg->size ? left : pg->size;
}

#if SL_AVX2
/* How many queries from i on (i's included, at most `most`) read as many keys of block b as
 * query i does: the ones a multi-query kernel can take together (all of a task's queries but
 * in its last blocks, where causal rows end at different keys). Query i must read block b. */
static int same_keys(const query *qs, int64_t nq, int64_t i, const pages *pg, int64_t b, int most) {
    const int64_t m = block_len(pg, b, qs[i].S);
    int c = 1;
    while (c < most && i + c < nq && block_len(pg, b, qs[i + c].S) == m) c++;
    return c;
}

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

#if SL_AVX2 && !SL_AVX512_VNNI
/* Two queries' scores for the same n keys of a block (block_scores for each, the same bits):
 * eight FMA chains instead of four, which is what keeps the FMA units busy; each key's floats and
 * each query's are loaded once per eight dims, six loads for eight FMAs (14 of the 16
 * registers). Left to itself GCC folded the queries' loads into the FMAs, twelve loads for
 * eight FMAs, and on a Zen 3 the loads bounded the loop. kf: the keys as floats, hd % 8 == 0.
 * (AVX-512 takes six queries at once: scores_z.) */
static void block_scores2(const float *q0, const float *q1, const uint16_t *keys, const float *kf,
                          int64_t n, int64_t hd, float scale, float *p0, float *p1) {
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        const float *k0 = kf + t * hd;
        for (int64_t d = 0; d < hd; d += 8) {
            __m256 qa = _mm256_loadu_ps(q0 + d), qb = _mm256_loadu_ps(q1 + d);
            SL_IN_REG(qa);
            SL_IN_REG(qb);
            __m256 k = _mm256_loadu_ps(k0 + d);
            SL_IN_REG(k);
            a0 = _mm256_fmadd_ps(qa, k, a0);
            b0 = _mm256_fmadd_ps(qb, k, b0);
            k = _mm256_loadu_ps(k0 + hd + d);
            SL_IN_REG(k);
            a1 = _mm256_fmadd_ps(qa, k, a1);
            b1 = _mm256_fmadd_ps(qb, k, b1);
            k = _mm256_loadu_ps(k0 + 2 * hd + d);
            SL_IN_REG(k);
            a2 = _mm256_fmadd_ps(qa, k, a2);
            b2 = _mm256_fmadd_ps(qb, k, b2);
            k = _mm256_loadu_ps(k0 + 3 * hd + d);
            SL_IN_REG(k);
            a3 = _mm256_fmadd_ps(qa, k, a3);
            b3 = _mm256_fmadd_ps(qb, k, b3);
        }
        _mm_storeu_ps(p0 + t, _mm_mul_ps(hsum4(a0, a1, a2, a3), _mm_set1_ps(scale)));
        _mm_storeu_ps(p1 + t, _mm_mul_ps(hsum4(b0, b1, b2, b3), _mm_set1_ps(scale)));
    }
    for (; t < n; t++) {
        p0[t] = dot_half(q0, keys + t * hd, hd) * scale;
        p1[t] = dot_half(q1, keys + t * hd, hd) * scale;
    }
}
#endif

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
                __m256 x = _mm256_loadu_ps(v + 8 * j);
                SL_IN_REG(x);
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
/* Queries that share each loaded key or value: six queries' value accumulators (4 registers
 * each) and the four loaded values fill 29 of the 32 registers. Against four, a 270-token turn
 * after 4,000 cached ones spent 4-12 % less time in attention on a Zen 4 EPYC; eight for the
 * keys alone was slower than six. Every query's arithmetic is the same whatever its group. */
#define GROUP 6

/* fn(c, ...) with c (1..GROUP) a literal, as DISPATCH_TILE calls the GEMM tiles */
#define DISPATCH_GROUP(fn, c, ...)                                                                 \
    switch (c) {                                                                                   \
        SL_CASE(fn, 6, __VA_ARGS__)                                                                \
        SL_CASE(fn, 5, __VA_ARGS__)                                                                \
        SL_CASES_4_TO_1(fn, __VA_ARGS__)                                                           \
    }

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
                                                           const float *kf, int64_t n, int64_t hd,
                                                           float scale, int64_t at) {
    for (int64_t t = 0; t < n; t += 4) {
        __m512 A[GROUP], B[GROUP];
        for (int j = 0; j < c; j++) A[j] = B[j] = _mm512_setzero_ps();
        const float *k = kf + t * hd;
        for (int64_t d = 0; d < hd; d += 8) {
            __m512 k01 = _mm512_loadu_ps(k + 2 * d), k23 = _mm512_loadu_ps(k + 2 * hd + 2 * d);
            SL_IN_REG(k01);
            SL_IN_REG(k23);
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

/* One block's scores for every query that reads it: up to GROUP queries with the same number of
 * keys in the block at once (all but the last block: all of them), the tail keys as
 * block_scores does them. */
static void block_scores_z(query *qs, int64_t nq, const uint16_t *keys, float *kf, const pages *pg,
                           int64_t b, int64_t S, int64_t hd, float scale) {
    const int64_t at = b * pg->size;
    to_pairs(keys, block_len(pg, b, S) / 4 * 4, hd, kf);
    for (int64_t i = 0; i < nq;) {
        if (qs[i].S <= at) {
            i++;
            continue;
        }
        const int64_t m = block_len(pg, b, qs[i].S), n = m / 4 * 4;
        const int c = same_keys(qs, nq, i, pg, b, GROUP);
        DISPATCH_GROUP(scores_z, c, qs + i, kf, n, hd, scale, at)
        for (int j = 0; j < c; j++, i++)
            for (int64_t t = n; t < m; t++)
                qs[i].p[at + t] = dot_half(qs[i].q, keys + t * hd, hd) * scale;
    }
}

/* c queries' values for the same n values of a block, hd >= 64: block_values' arithmetic to the
 * bit (each output its own chain over the values in order; a 16-lane register is two of its
 * 8-lane ones) with 4c chains; each value's floats are loaded once for all c queries and each
 * weight is broadcast from memory inside its FMA. */
static inline __attribute__((always_inline)) void
values_z(const int c, const query *qs, const float *vf, int64_t n, int64_t hd, int64_t at) {
    for (int64_t d0 = 0; d0 + 64 <= hd; d0 += 64) {
        __m512 acc[GROUP][4];
        for (int j = 0; j < c; j++)
            for (int u = 0; u < 4; u++) acc[j][u] = _mm512_loadu_ps(qs[j].o + d0 + 16 * u);
        const float *v = vf + d0;
        for (int64_t i = 0; i < n; i++, v += hd) {
            __m512 x0 = _mm512_loadu_ps(v), x1 = _mm512_loadu_ps(v + 16);
            __m512 x2 = _mm512_loadu_ps(v + 32), x3 = _mm512_loadu_ps(v + 48);
            SL_IN_REG(x0);
            SL_IN_REG(x1);
            SL_IN_REG(x2);
            SL_IN_REG(x3);
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

/* One block's values for every query that reads it, up to GROUP at once (as block_scores_z);
 * the dims past the last multiple of 64 as block_values does them. */
static void block_values_z(query *qs, int64_t nq, const uint16_t *vals, float *vf, const pages *pg,
                           int64_t b, int64_t S, int64_t hd) {
    const int64_t at = b * pg->size, tail = hd - hd % 64;
    to_floats(vals, block_len(pg, b, S) * hd, vf);
    for (int64_t i = 0; i < nq;) {
        if (qs[i].S <= at) {
            i++;
            continue;
        }
        const int64_t m = block_len(pg, b, qs[i].S);
        const int c = same_keys(qs, nq, i, pg, b, GROUP);
        DISPATCH_GROUP(values_z, c, qs + i, vf, m, hd, at)
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
void attend(query *qs, int64_t nq, const uint16_t *kc, const uint16_t *vc, const pages *pg,
            int64_t hd, float scale, float *kf, float *vf) {
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
#if SL_AVX2 && !SL_AVX512_VNNI
            if (keys_vec && same_keys(qs, nq, i, pg, b, 2) == 2) {
                block_scores2(qs[i].q, qs[i + 1].q, keys, kf, m, hd, scale, qs[i].p + at,
                              qs[i + 1].p + at);
                i++;
                continue;
            }
#endif
            block_scores(qs[i].q, keys, keys_vec ? kf : NULL, m, hd, scale, qs[i].p + at);
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
            if (vals_vec && same_keys(qs, nq, i, pg, b, 2) == 2) {
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
