/* Activation quantization, the 4-bit GEMMs and the per-format dispatch (layouts: sluice_cpu.h;
 * the int8-weight GEMMs: q8.c). */
#include "sl_impl.h"

int sl_vectorized(void) { return SL_AVX2 ? (SL_AVX512_VNNI ? 2 : 1) : 0; }

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

/* ---- activation quantization ------------------------------------------------------------- */

/* One row of K floats -> int8 blocks with a scale and the scaled block sum. */
static void quantize_row(const float *x, int64_t K, int8_t *q, float *d, float *s) {
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
#if SL_AVX2
        /* the same arithmetic as the scalar loop: cvtps rounds half to even, as lrintf does */
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 v[4], mx = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(xb + 8 * j);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float vscale = _mm_cvtss_f32(m4) / 127.0f;
        const __m256 vinv = _mm256_set1_ps(vscale > 0.0f ? 1.0f / vscale : 0.0f);
        __m256i i32[4];
        for (int j = 0; j < 4; j++) i32[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], vinv));
        const __m256i sum32 =
            _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
        /* packs interleave 128-bit lanes; the permute puts the 32 bytes back in order */
        const __m256i i16a = _mm256_packs_epi32(i32[0], i32[1]),
                      i16b = _mm256_packs_epi32(i32[2], i32[3]);
        const __m256i i8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(i16a, i16b),
                                                       _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + b * QK), i8);
        __m128i s4 =
            _mm_add_epi32(_mm256_castsi256_si128(sum32), _mm256_extracti128_si256(sum32, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        d[b] = vscale;
        s[b] = vscale * (float)_mm_cvtsi128_si32(s4);
        continue;
#endif
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) {
            float a = fabsf(xb[i]);
            amax = a > amax ? a : amax;
        }
        const float scale = amax / 127.0f;
        const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        int sum = 0;
        for (int i = 0; i < QK; i++) {
            int v = (int)lrintf(xb[i] * inv);
            q[b * QK + i] = (int8_t)v;
            sum += v;
        }
        d[b] = scale;
        s[b] = scale * (float)sum;
    }
}

/* The *_body functions are the stages sl_forward runs inside its parallel region; the sl_*
 * wrappers open a region of their own (for prefill and the tests). */
void quantize_body(const float *x, int64_t M, int64_t K, int8_t *xq, float *xd, float *xs) {
    const int64_t nb = K / QK;
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++)
        quantize_row(x + m * K, K, xq + m * K, xd + m * nb, xs + m * nb);
}

void sl_quantize(const float *x, int64_t M, int64_t K, int8_t *xq, float *xd, float *xs,
                 int nthreads) {
#pragma omp parallel num_threads(nthreads)
    quantize_body(x, M, K, xq, xd, xs);
}

/* sum of x[i]^2 in double (each square is exact there); AVX2: eight lanes of partial sums */
static double sum_squares(const float *x, int64_t K) {
    double ss = 0.0;
    int64_t i = 0;
#if SL_AVX2
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    for (; i + 8 <= K; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
        const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
        a0 = _mm256_fmadd_pd(lo, lo, a0);
        a1 = _mm256_fmadd_pd(hi, hi, a1);
    }
    const __m256d a = _mm256_add_pd(a0, a1);
    __m128d s2 = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
    ss = _mm_cvtsd_f64(_mm_add_sd(s2, _mm_unpackhi_pd(s2, s2)));
#endif
    for (; i < K; i++) ss += (double)x[i] * x[i];
    return ss;
}

/* RMSNorm(x) * w, quantized; the normalized floats only go to tmp (they only feed a matmul). */
void rmsnorm_quantize_body(const float *x, const float *w, float eps, int64_t M, int64_t K,
                           int8_t *xq, float *xd, float *xs, float *tmp) {
    const int64_t nb = K / QK;
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const float *row = x + m * K;
        float *t = tmp + m * K;
        const float r = 1.0f / sqrtf((float)(sum_squares(row, K) / (double)K) + eps);
        for (int64_t i = 0; i < K; i++) t[i] = w[i] * (row[i] * r);
        quantize_row(t, K, xq + m * K, xd + m * nb, xs + m * nb);
    }
}

void sl_rmsnorm_quantize(const float *x, const float *w, float eps, int64_t M, int64_t K,
                         int8_t *xq, float *xd, float *xs, float *tmp, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    rmsnorm_quantize_body(x, w, eps, M, K, xq, xd, xs, tmp);
}

/* silu(gate) * up for rows laid out [gate (I), up (I)], quantized for the down projection. */
void swiglu_quantize_body(const float *gu, int64_t M, int64_t I, int8_t *xq, float *xd, float *xs,
                          float *tmp) {
    const int64_t nb = I / QK;
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const float *g = gu + m * 2 * I, *u = g + I;
        float *t = tmp + m * I;
        int64_t i = 0;
#if SL_AVX2
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= I; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 sig =
                _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, gv))));
            _mm256_storeu_ps(t + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < I; i++) t[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        quantize_row(t, I, xq + m * I, xd + m * nb, xs + m * nb);
    }
}

void sl_swiglu_quantize(const float *gu, int64_t M, int64_t I, int8_t *xq, float *xd, float *xs,
                        float *tmp, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    swiglu_quantize_body(gu, M, I, xq, xd, xs, tmp);
}

/* ---- quantized matmuls: y[m, n] (+)= sum_k x[m, k] w[n, k] (+ bias[n]) ------------------- */

/* Q4_1 weights, eight rows interleaved: for rows 8g..8g+7 and block b, four 32-byte vectors
 * whose byte 4r + i (row r) holds value 4j + i in its low nibble and value 16 + 4j + i in its high
 * nibble (j = 0..3), then eight scales and eight minimums. One register then carries four values
 * of eight rows, so a broadcast of four activation bytes feeds eight dot products at once, and
 * the per-block scales become vectors: ~8 multiply-adds per instruction against ~3 row by row.
 *
 * sum_k w x = sum_b (wd * xd * sum_j q_w q_x) + wm * (xd * sum_j q_x) = ... + wm * xs.
 * The int16 partial sums of a block cannot overflow: 8 x 2 x 15 x 127 = 30480 < 32767. */
#define Q4X8_BLOCK 128 /* bytes of nibbles per 8 rows x 32 values */

#if SL_AVX2
static inline __m256i bcast4(const int8_t *x) {
    int32_t v;
    memcpy(&v, x, 4);
    return _mm256_set1_epi32(v);
}

#if SL_VNNI
static inline __attribute__((always_inline)) void
q4x8_tile(const int mt, int64_t nb, int64_t K, const uint8_t *wg, const float *dg, const float *mg,
          const int8_t *xq, const float *xd, const float *xs, __m256 *acc) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int t = 0; t < mt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = wg + b * Q4X8_BLOCK;
        /* Q4_0 (no minimums): w = d * (q - 8), i.e. Q4_1 with m = -8 d */
        const __m256 d = _mm256_loadu_ps(dg + b * 8);
        const __m256 m = mg ? _mm256_loadu_ps(mg + b * 8) : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
        __m256i lo[4], hi[4]; /* unpacked once for the mt rows (32 registers: room for all) */
        for (int j = 0; j < 4; j++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(wb + 32 * j));
            lo[j] = _mm256_and_si256(raw, low);
            hi[j] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        }
        for (int t = 0; t < mt; t++) {
            const int8_t *x = xq + t * K + b * QK;
            __m256i s32 = _mm256_setzero_si256(); /* int32 sums straight from the bytes */
            for (int j = 0; j < 4; j++) {
                s32 = dpbusd256(s32, lo[j], bcast4(x + 4 * j));
                s32 = dpbusd256(s32, hi[j], bcast4(x + 16 + 4 * j));
            }
            const __m256 dots = _mm256_cvtepi32_ps(s32);
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
 * 2 mt + 5 registers live, and the unpacking is still shared by the mt rows. */
static inline __attribute__((always_inline)) void
q4x8_tile(const int mt, int64_t nb, int64_t K, const uint8_t *wg, const float *dg, const float *mg,
          const int8_t *xq, const float *xd, const float *xs, __m256 *acc) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int t = 0; t < mt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = wg + b * Q4X8_BLOCK;
        const int8_t *x = xq + b * QK;
        __m256i s16[MT];
        for (int j = 0; j < 4; j++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(wb + 32 * j));
            const __m256i lo = _mm256_and_si256(raw, low);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
            for (int t = 0; t < mt; t++) {
                const __m256i p =
                    _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(x + t * K + 4 * j)),
                                     _mm256_maddubs_epi16(hi, bcast4(x + t * K + 16 + 4 * j)));
                s16[t] = j ? _mm256_add_epi16(s16[t], p) : p;
                SL_KEEP(s16[t]);
            }
        }
        /* Q4_0 (no minimums): w = d * (q - 8), i.e. Q4_1 with m = -8 d */
        const __m256 d = _mm256_loadu_ps(dg + b * 8);
        const __m256 m = mg ? _mm256_loadu_ps(mg + b * 8) : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
        for (int t = 0; t < mt; t++) {
            const __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[t], _mm256_set1_epi16(1)));
            const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(xd[t * nb + b]));
            acc[t] = _mm256_fmadd_ps(scale, dots, acc[t]);
            acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[t * nb + b]), acc[t]);
        }
    }
}
#endif
#endif

void gemm_q4_1_body(int64_t M, int64_t N, int64_t K, const int8_t *xq, const float *xd,
                    const float *xs, const uint8_t *wq, const float *wd, const float *wm,
                    const float *bias, float *y, int accumulate) {
    const int64_t nb = K / QK;
#if SL_AMX /* amx.c defines gemm_amx_body only then (an -O0 build would not link) */
    if (M >= SL_AMX_MIN_M && amx_usable()) {
        gemm_amx_body(AMX_Q4, M, N, K, xq, xd, xs, wq, wd, wm, bias, y, accumulate);
        return;
    }
#endif
#pragma omp for schedule(static)
    for (int64_t g = 0; g < N / 8; g++) {
        const uint8_t *wg = wq + g * nb * Q4X8_BLOCK;
        const float *dg = wd + g * nb * 8, *mg = wm ? wm + g * nb * 8 : NULL;
        for (int64_t m0 = 0; m0 < M; m0 += MT) {
            const int mt = M - m0 < MT ? (int)(M - m0) : MT;
            float out[MT][8];
#if SL_AVX2
            __m256 acc[MT];
            const int8_t *x = xq + m0 * K;
            const float *d = xd + m0 * nb, *s = xs + m0 * nb;
            DISPATCH_TILE(q4x8_tile, mt, nb, K, wg, dg, mg, x, d, s, acc)
            for (int t = 0; t < mt; t++) _mm256_storeu_ps(out[t], acc[t]);
#else
            for (int t = 0; t < mt; t++) {
                const int64_t row = m0 + t;
                for (int r = 0; r < 8; r++) {
                    float sum = 0.0f;
                    for (int64_t b = 0; b < nb; b++) {
                        const uint8_t *wb = wg + b * Q4X8_BLOCK;
                        const int8_t *x = xq + row * K + b * QK;
                        int dot = 0;
                        for (int j = 0; j < 4; j++)
                            for (int i = 0; i < 4; i++) {
                                const uint8_t byte = wb[32 * j + 4 * r + i];
                                dot +=
                                    (byte & 0x0F) * x[4 * j + i] + (byte >> 4) * x[16 + 4 * j + i];
                            }
                        const float mr = mg ? mg[b * 8 + r] : -8.0f * dg[b * 8 + r];
                        sum +=
                            dg[b * 8 + r] * xd[row * nb + b] * (float)dot + mr * xs[row * nb + b];
                    }
                    out[t][r] = sum;
                }
            }
#endif
            for (int t = 0; t < mt; t++)
                for (int r = 0; r < 8; r++)
                    store(y + (m0 + t) * N + g * 8 + r, out[t][r], bias, g * 8 + r, accumulate);
        }
    }
}

void sl_gemm_q4_1(int64_t M, int64_t N, int64_t K, const int8_t *xq, const float *xd,
                  const float *xs, const uint8_t *wq, const float *wd, const float *wm,
                  const float *bias, float *y, int accumulate, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    gemm_q4_1_body(M, N, K, xq, xd, xs, wq, wd, wm, bias, y, accumulate);
}

void sl_gemm_q4_0(int64_t M, int64_t N, int64_t K, const int8_t *xq, const float *xd,
                  const float *xs, const uint8_t *wq, const float *wd, const float *bias, float *y,
                  int accumulate, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    gemm_q4_1_body(M, N, K, xq, xd, xs, wq, wd, NULL, bias, y, accumulate);
}

void linear_body(const sl_linear *l, int64_t M, const int8_t *xq, const float *xd, const float *xs,
                 float *y, int accumulate) {
    if (l->type & SL_X8) {
        const int type = (int)(l->type & ~(int64_t)SL_X8);
        gemm_q8x8_body(M, l->n, l->k, xq, xd, xs, (const int8_t *)l->q, l->d,
                       type == SL_Q8_M ? l->m : NULL, type == SL_Q8_16, l->bias, y, accumulate);
        return;
    }
    switch (l->type) {
    case SL_Q8_0:
    case SL_Q8_M:
    case SL_Q8_16:
        gemm_q8_body(M, l->n, l->k, xq, xd, xs, (const int8_t *)l->q, l->d,
                     l->type == SL_Q8_M ? l->m : NULL, l->type == SL_Q8_16, l->bias, y, accumulate);
        break;
    case SL_Q4_0: /* the Q4_1 GEMM without minimums */
        gemm_q4_1_body(M, l->n, l->k, xq, xd, xs, (const uint8_t *)l->q, l->d, NULL, l->bias, y,
                       accumulate);
        break;
    default:
        gemm_q4_1_body(M, l->n, l->k, xq, xd, xs, (const uint8_t *)l->q, l->d, l->m, l->bias, y,
                       accumulate);
        break;
    }
}

void sl_linear_forward(const sl_linear *l, int64_t M, const int8_t *xq, const float *xd,
                       const float *xs, float *y, int accumulate, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    linear_body(l, M, xq, xd, xs, y, accumulate);
}
