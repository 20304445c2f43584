/* Activation quantization: rows of floats -> int8 blocks of 32 with a scale and the scaled sum
 * (layouts: sluice_cpu.h), alone or fused with the RMSNorm or SwiGLU that feeds a matmul. */
#include "sl_impl.h"

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
