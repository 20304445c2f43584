/* The 4- and 5-bit GEMMs and the per-format dispatch (layouts: sluice_cpu.h; activation
 * quantization: quantize.c; the int8-weight GEMMs: q8.c). */
#include "sl_impl.h"

int sl_vectorized(void) { return SL_AVX2 ? (SL_AVX512_VNNI ? 2 : 1) : 0; }

int sl_narrow_rows = 1;

void sl_set_narrow_rows(int rows) { sl_narrow_rows = rows < 1 ? 1 : rows; }

const char *sl_isa(void) {
    if (SL_AVX512_VNNI) return amx_usable() ? "avx512vnni+amx" : "avx512vnni";
    if (SL_VNNI) return "avx2+vnni";
    return SL_AVX2 ? "avx2" : "scalar";
}

int64_t sl_sizeof(const char *name) {
#define SL_SIZE(type)                                                                              \
    if (strcmp(name, #type) == 0) return (int64_t)sizeof(type);
    SL_SIZE(sl_block_q4_0)
    SL_SIZE(sl_block_q4_1)
    SL_SIZE(sl_block_q8_0)
    SL_SIZE(sl_block_q5_0)
    SL_SIZE(sl_block_q5_1)
    SL_SIZE(sl_block_q4_K)
    SL_SIZE(sl_block_q5_K)
    SL_SIZE(sl_block_q6_K)
    SL_SIZE(sl_linear)
    SL_SIZE(sl_layer)
    SL_SIZE(sl_model)
    SL_SIZE(sl_scratch)
#undef SL_SIZE
    return -1;
}

/* ---- quantized matmuls: y[m, n] (+)= sum_k x[m, k] w[n, k] (+ bias[n]) ------------------- */

/* Q4_1 weights, eight rows interleaved: for rows 8g..8g+7 and block b, four 32-byte vectors
 * whose byte 4r + i (row r) holds value 4j + i in its low nibble and value 16 + 4j + i in its high
 * nibble (j = 0..3), then eight scales and eight minimums. One register then carries four values
 * of eight rows, so a broadcast of four activation bytes feeds eight dot products at once, and
 * the per-block scales become vectors: ~8 multiply-adds per instruction against ~3 row by row.
 *
 * sum_k w x = sum_b (wd * xd * sum_j q_w q_x) + wm * (xd * sum_j q_x) = ... + wm * xs.
 * The int16 partial sums of a block cannot overflow: 8 x 2 x 15 x 127 = 30480 < 32767.
 *
 * Q5_M (five = 1) is the same block followed by the values' fifth bits: eight 32-bit words,
 * word j (j = 0..3) with bit 4r + i set when row r's value 4j + i is 16 or more, word 4 + j the
 * same for value 16 + 4j + i; that is bit k of word v for byte k of unpacked vector v (the low
 * nibbles of vector j are v = j, the high ones v = 4 + j). 160 bytes per 256 values where the
 * int8 layout it replaces (Q8_M) took 256: one stream's decode reads every weight once per
 * token, so the bytes read are what bound it. */
#define Q4X8_BLOCK 128 /* bytes of nibbles per 8 rows x 32 values */
#define Q5X8_BLOCK 160 /* and the fifth bits */

#if SL_AVX2
/* 0x10 in byte k where bit k of the 32-bit word at p is set */
static inline __m256i fifth_bits(const uint8_t *p) {
    uint32_t word;
    memcpy(&word, p, 4);
#if SL_AVX512_VNNI && defined(__AVX512VL__)
    return _mm256_maskz_mov_epi8(_cvtu32_mask32(word), _mm256_set1_epi8(0x10));
#else
    /* AVX2: byte k takes byte k / 8 of the word (a shuffle within each 128-bit lane of the
     * broadcast), then tests its bit k % 8 */
    const __m256i spread =
        _mm256_shuffle_epi8(_mm256_set1_epi32((int32_t)word),
                            _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2,
                                             2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201ULL);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
#endif
}

/* vector j's low and high nibbles as bytes, with their fifth bits (five) from the words at hb */
static inline __attribute__((always_inline)) void unpack_q(const int five, const uint8_t *wb,
                                                           const int j, __m256i *lo, __m256i *hi) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(wb + 32 * j));
    *lo = _mm256_and_si256(raw, low);
    *hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    if (five) {
        *lo = _mm256_or_si256(*lo, fifth_bits(wb + Q4X8_BLOCK + 4 * j));
        *hi = _mm256_or_si256(*hi, fifth_bits(wb + Q4X8_BLOCK + 16 + 4 * j));
    }
}

#if SL_VNNI
static inline __attribute__((always_inline)) void
q4x8_tile(const int mt, const int five, const int half, int64_t nb, int64_t K, const uint8_t *wg,
          const void *dg, const void *mg, const int8_t *xq, const float *xd, const float *xs,
          __m256 *acc) {
    for (int t = 0; t < mt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = wg + b * (five ? Q5X8_BLOCK : Q4X8_BLOCK);
        /* Q4_0 and Q5_0 (no minimums): w = d * (q - 8) or d * (q - 16), i.e. Q4_1 and Q5_M
         * with m = -8 d and -16 d */
        const __m256 d = load_scales8(dg, b * 8, half);
        const __m256 m = mg ? load_scales8(mg, b * 8, half)
                            : _mm256_mul_ps(d, _mm256_set1_ps(five ? -16.0f : -8.0f));
        __m256i lo[4], hi[4]; /* unpacked once for the mt rows (32 registers: room for all) */
        for (int j = 0; j < 4; j++) unpack_q(five, wb, j, &lo[j], &hi[j]);
        for (int t = 0; t < mt; t++) {
            const int8_t *x = xq + t * K + b * QK;
            /* int32 sums straight from the bytes, in two chains (exact: the same sums) */
            __m256i sa = _mm256_setzero_si256(), sb = sa;
            for (int j = 0; j < 4; j++) {
                sa = dpbusd256(sa, lo[j], bcast4(x + 4 * j));
                sb = dpbusd256(sb, hi[j], bcast4(x + 16 + 4 * j));
            }
            const __m256 dots = _mm256_cvtepi32_ps(_mm256_add_epi32(sa, sb));
            const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(xd[t * nb + b]));
            acc[t] = _mm256_fmadd_ps(scale, dots, acc[t]);
            acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[t * nb + b]), acc[t]);
        }
    }
}
#else
/* AVX2 without VNNI has 16 vector registers: the eight unpacked nibble vectors of a block plus
 * the rows' accumulators do not fit (the compiler spilled a third of the loop to the stack).
 * So each 32-byte vector is unpacked right before the mt rows use it, into int16 sums per row:
 * 2 mt + 5 registers live, and the unpacking is still shared by the mt rows. Five-bit values
 * reach 2 x 2 x 31 x 127 = 15748 per vector: two vectors' sums fit int16, then go to int32. */
static inline __attribute__((always_inline)) void
q4x8_tile(const int mt, const int five, const int half, int64_t nb, int64_t K, const uint8_t *wg,
          const void *dg, const void *mg, const int8_t *xq, const float *xd, const float *xs,
          __m256 *acc) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int per16 = five ? 2 : 4; /* vectors summed in int16 */
    for (int t = 0; t < mt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = wg + b * (five ? Q5X8_BLOCK : Q4X8_BLOCK);
        const int8_t *x = xq + b * QK;
        __m256i s16[MT_MAX], s32[MT_MAX];
        for (int t = 0; t < mt; t++) /* each set before it is read: for GCC's warnings */
            s16[t] = s32[t] = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            __m256i lo, hi;
            unpack_q(five, wb, j, &lo, &hi);
            for (int t = 0; t < mt; t++) {
                const __m256i p =
                    _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(x + t * K + 4 * j)),
                                     _mm256_maddubs_epi16(hi, bcast4(x + t * K + 16 + 4 * j)));
                s16[t] = j % per16 ? _mm256_add_epi16(s16[t], p) : p;
                SL_KEEP(s16[t]);
            }
            if (five && j == 1)
                for (int t = 0; t < mt; t++) s32[t] = _mm256_madd_epi16(s16[t], ones);
        }
        /* Q4_0 and Q5_0 (no minimums): w = d * (q - 8) or d * (q - 16), i.e. Q4_1 and Q5_M
         * with m = -8 d and -16 d */
        const __m256 d = load_scales8(dg, b * 8, half);
        const __m256 m = mg ? load_scales8(mg, b * 8, half)
                            : _mm256_mul_ps(d, _mm256_set1_ps(five ? -16.0f : -8.0f));
        for (int t = 0; t < mt; t++) {
            __m256i sum = _mm256_madd_epi16(s16[t], ones);
            if (five) sum = _mm256_add_epi32(s32[t], sum);
            const __m256 dots = _mm256_cvtepi32_ps(sum);
            const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(xd[t * nb + b]));
            acc[t] = _mm256_fmadd_ps(scale, dots, acc[t]);
            acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[t * nb + b]), acc[t]);
        }
    }
}
#endif
#else
/* Rows 8g..8g+7 (values and fifth bits at wg, scales dg, minimums mg or NULL) against rows
 * 0..mt-1 of x, the generic loops: out[t][r] = row t's product with weight row r. */
static void q4x8_generic(const int five, const int half, int mt, int64_t nb, int64_t K,
                         const uint8_t *wg, const void *dg, const void *mg, const int8_t *xq,
                         const float *xd, const float *xs, float (*out)[16]) {
    for (int t = 0; t < mt; t++) {
        for (int r = 0; r < 8; r++) {
            float sum = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *wb = wg + b * (five ? Q5X8_BLOCK : Q4X8_BLOCK);
                const int8_t *x = xq + t * K + b * QK;
                int dot = 0;
                for (int j = 0; j < 4; j++) {
                    uint32_t lo5 = 0, hi5 = 0;
                    if (five) {
                        memcpy(&lo5, wb + Q4X8_BLOCK + 4 * j, 4);
                        memcpy(&hi5, wb + Q4X8_BLOCK + 16 + 4 * j, 4);
                    }
                    for (int i = 0; i < 4; i++) {
                        const uint8_t byte = wb[32 * j + 4 * r + i];
                        const int lo = (byte & 0x0F) | (int)((lo5 >> (4 * r + i)) & 1) << 4;
                        const int hi = (byte >> 4) | (int)((hi5 >> (4 * r + i)) & 1) << 4;
                        dot += lo * x[4 * j + i] + hi * x[16 + 4 * j + i];
                    }
                }
                const float dr = scale_at(dg, b * 8 + r, half);
                const float mr = mg ? scale_at(mg, b * 8 + r, half) : (five ? -16.0f : -8.0f) * dr;
                sum += dr * xd[t * nb + b] * (float)dot + mr * xs[t * nb + b];
            }
            out[t][r] = sum;
        }
    }
}
#endif

#if SL_AVX512_VNNI
/* Two groups (rows 8g..8g+15) against rows 0..mt-1 of x on 512-bit vectors: group g's vectors in
 * the low half, g + 1's in the high half, so one broadcast of four activation bytes and one
 * vpdpbusd serve sixteen weight rows, half the row-dependent instructions of two 8-row tiles.
 * Where few rows make the GEMM compute-bound (a decode step of a few streams, a speculative
 * draft's rows), that is the step's cost. Each lane does the 8-row tile's arithmetic in its
 * order, so the output bits are the same. */
static inline __attribute__((always_inline)) void
q4x16_tile(const int mt, const int five, const int half, int64_t nb, int64_t K, const uint8_t *wg,
           const uint8_t *wh, const void *dg, const void *dh, const void *mg, const void *mh,
           const int8_t *xq, const float *xd, const float *xs, __m512 *acc) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const int block = five ? Q5X8_BLOCK : Q4X8_BLOCK;
    for (int t = 0; t < mt; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = wg + b * block, *hb = wh + b * block;
        const __m512 d = join_ps(load_scales8(dg, b * 8, half), load_scales8(dh, b * 8, half));
        const __m512 m = mg ? join_ps(load_scales8(mg, b * 8, half), load_scales8(mh, b * 8, half))
                            : _mm512_mul_ps(d, _mm512_set1_ps(five ? -16.0f : -8.0f));
        __m512i lo[4], hi[4]; /* unpacked once for the mt rows */
        for (int j = 0; j < 4; j++) {
            const __m512i raw = join256(_mm256_loadu_si256((const __m256i *)(wb + 32 * j)),
                                        _mm256_loadu_si256((const __m256i *)(hb + 32 * j)));
            lo[j] = _mm512_and_si512(raw, low);
            hi[j] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            if (five) {
                lo[j] = _mm512_or_si512(lo[j], join256(fifth_bits(wb + Q4X8_BLOCK + 4 * j),
                                                       fifth_bits(hb + Q4X8_BLOCK + 4 * j)));
                hi[j] = _mm512_or_si512(hi[j], join256(fifth_bits(wb + Q4X8_BLOCK + 16 + 4 * j),
                                                       fifth_bits(hb + Q4X8_BLOCK + 16 + 4 * j)));
            }
        }
        for (int t = 0; t < mt; t++) {
            const int8_t *x = xq + t * K + b * QK;
            __m512i sa = _mm512_setzero_si512(), sb = sa; /* two chains, as the 8-row tile */
            for (int j = 0; j < 4; j++) {
                int32_t x4, x16;
                memcpy(&x4, x + 4 * j, 4);
                memcpy(&x16, x + 16 + 4 * j, 4);
                sa = _mm512_dpbusd_epi32(sa, lo[j], _mm512_set1_epi32(x4));
                sb = _mm512_dpbusd_epi32(sb, hi[j], _mm512_set1_epi32(x16));
            }
            const __m512 dots = _mm512_cvtepi32_ps(_mm512_add_epi32(sa, sb));
            const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(xd[t * nb + b]));
            acc[t] = _mm512_fmadd_ps(scale, dots, acc[t]);
            acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[t * nb + b]), acc[t]);
        }
    }
}
#endif

/* Rows 8g..8g + 8 cols - 1 of y (cols: 8, or 16 for two groups on 512-bit vectors) for every
 * activation row, MT rows per weight pass. */
static inline __attribute__((always_inline)) void
q4_groups(const int five, const int cols, int64_t g, int64_t M, int64_t N, int64_t K,
          const int8_t *xq, const float *xd, const float *xs, const uint8_t *wq, const void *wd,
          const void *wm, const int half, const float *bias, float *y, int accumulate) {
    const int64_t nb = K / QK;
    const int64_t stride = nb * (five ? Q5X8_BLOCK : Q4X8_BLOCK); /* bytes per group */
    const uint8_t *wg = wq + g * stride;
    const void *dg = scales_at(wd, g * nb * 8, half);
    const void *mg = wm ? scales_at(wm, g * nb * 8, half) : NULL;
    for (int64_t m0 = 0, mt; m0 < M; m0 += mt) {
        mt = tile_rows(M, m0);
        float out[MT_MAX][16];
        const int8_t *x = xq + m0 * K;
        const float *d = xd + m0 * nb, *s = xs + m0 * nb;
#if SL_AVX512_VNNI
        if (cols == 16) {
            const void *dh = scales_at(dg, nb * 8, half);
            const void *mh = mg ? scales_at(mg, nb * 8, half) : NULL;
            __m512 acc[MT_MAX];
            if (five)
                DISPATCH_TILE(q4x16_tile, mt, 1, half, nb, K, wg, wg + stride, dg, dh, mg, mh, x, d,
                              s, acc)
            else
                DISPATCH_TILE(q4x16_tile, mt, 0, half, nb, K, wg, wg + stride, dg, dh, mg, mh, x, d,
                              s, acc)
            for (int t = 0; t < mt; t++) _mm512_storeu_ps(out[t], acc[t]);
        } else
#endif
        {
#if SL_AVX2
            __m256 acc[MT_MAX];
            if (five)
                DISPATCH_TILE(q4x8_tile, mt, 1, half, nb, K, wg, dg, mg, x, d, s, acc)
            else
                DISPATCH_TILE(q4x8_tile, mt, 0, half, nb, K, wg, dg, mg, x, d, s, acc)
            for (int t = 0; t < mt; t++) _mm256_storeu_ps(out[t], acc[t]);
#else
            q4x8_generic(five, half, mt, nb, K, wg, dg, mg, x, d, s, out);
#endif
        }
        for (int t = 0; t < mt; t++)
            for (int r = 0; r < cols; r++)
                store(y + (m0 + t) * N + g * 8 + r, out[t][r], bias, g * 8 + r, accumulate);
    }
}

static inline __attribute__((always_inline)) void
gemm_x8(const int five, int64_t M, int64_t N, int64_t K, const int8_t *xq, const float *xd,
        const float *xs, const uint8_t *wq, const void *wd, const void *wm, const int half,
        const float *bias, float *y, int accumulate) {
    if (gemm_on_amx(five ? AMX_Q5 : AMX_Q4, M, N, K, xq, xd, xs, wq, wd, wm, half, bias, y,
                    accumulate))
        return;
    const int64_t groups = N / 8, span = x8_span(M);
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; g += span) { /* an odd last group alone */
        /* a literal width per call, each tile inlined on its own (a width known only at run time
         * made a lone stream's five rows 4 % slower) */
        if (g + 1 < groups && span == 2)
            q4_groups(five, 16, g, M, N, K, xq, xd, xs, wq, wd, wm, half, bias, y, accumulate);
        else
            q4_groups(five, 8, g, M, N, K, xq, xd, xs, wq, wd, wm, half, bias, y, accumulate);
    }
}

void gemm_q4_1_body(int64_t M, int64_t N, int64_t K, const int8_t *xq, const float *xd,
                    const float *xs, const uint8_t *wq, const void *wd, const void *wm, int half,
                    const float *bias, float *y, int accumulate) {
    gemm_x8(0, M, N, K, xq, xd, xs, wq, wd, wm, half, bias, y, accumulate);
}

void gemm_q5_body(int64_t M, int64_t N, int64_t K, const int8_t *xq, const float *xd,
                  const float *xs, const uint8_t *wq, const void *wd, const void *wm, int half,
                  const float *bias, float *y, int accumulate) {
    gemm_x8(1, M, N, K, xq, xd, xs, wq, wd, wm, half, bias, y, accumulate);
}

void sl_gemm_q4_1(int64_t M, int64_t N, int64_t K, const int8_t *xq, const float *xd,
                  const float *xs, const uint8_t *wq, const float *wd, const float *wm,
                  const float *bias, float *y, int accumulate, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    gemm_q4_1_body(M, N, K, xq, xd, xs, wq, wd, wm, 0, bias, y, accumulate);
}

void sl_gemm_q4_0(int64_t M, int64_t N, int64_t K, const int8_t *xq, const float *xd,
                  const float *xs, const uint8_t *wq, const float *wd, const float *bias, float *y,
                  int accumulate, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    gemm_q4_1_body(M, N, K, xq, xd, xs, wq, wd, NULL, 0, bias, y, accumulate);
}

void linear_body(const sl_linear *l, int64_t M, const int8_t *xq, const float *xd, const float *xs,
                 float *y, int accumulate) {
    const int half = (l->type & SL_H16) != 0;
    const int64_t type = l->type & ~(int64_t)(SL_X8 | SL_H16);
    if (l->type & SL_X8) {
        gemm_q8x8_body(M, l->n, l->k, xq, xd, xs, (const int8_t *)l->q, l->d,
                       type == SL_Q8_M ? l->m : NULL, type == SL_Q8_16, half, l->bias, y,
                       accumulate);
        return;
    }
    switch (type) {
    case SL_Q5_M:
        gemm_q5_body(M, l->n, l->k, xq, xd, xs, (const uint8_t *)l->q, l->d, l->m, half, l->bias, y,
                     accumulate);
        break;
    case SL_Q8_0: /* rows not interleaved (N % 8 != 0): float scales only */
    case SL_Q8_M:
    case SL_Q8_16:
        gemm_q8_body(M, l->n, l->k, xq, xd, xs, (const int8_t *)l->q, (const float *)l->d,
                     type == SL_Q8_M ? (const float *)l->m : NULL, type == SL_Q8_16, l->bias, y,
                     accumulate);
        break;
    case SL_Q4_0: /* the Q4_1 GEMM without minimums */
        gemm_q4_1_body(M, l->n, l->k, xq, xd, xs, (const uint8_t *)l->q, l->d, NULL, half, l->bias,
                       y, accumulate);
        break;
    default:
        gemm_q4_1_body(M, l->n, l->k, xq, xd, xs, (const uint8_t *)l->q, l->d, l->m, half, l->bias,
                       y, accumulate);
        break;
    }
}

void sl_linear_forward(const sl_linear *l, int64_t M, const int8_t *xq, const float *xd,
                       const float *xs, float *y, int accumulate, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    linear_body(l, M, xq, xd, xs, y, accumulate);
}
