/* The int8-weight GEMMs: Q8_0, and Q8_M / Q8_16, which hold the 5- and 6-bit GGUF types
 * exactly (layouts: sluice_cpu.h). Row by row: one weight row against up to MT activation rows. */
#include "sl_impl.h"

#if SL_AVX2
/* Eight int32 sums of four products w * x each (int8 x int8): lane i covers bytes 4i..4i+3, so
 * lanes 0..3 are values 0..15 of the block and lanes 4..7 values 16..31. The unsigned x signed
 * byte multiply (maddubs, vpdpbusd) wants one unsigned side: |w| and x with w's sign. */
static inline __m256i dot_i8(__m256i w, __m256i x) {
    const __m256i wabs = _mm256_sign_epi8(w, w), xs = _mm256_sign_epi8(x, w);
#if SL_VNNI
    return dpbusd256(_mm256_setzero_si256(), wabs, xs);
#else
    /* int16 pair sums cannot saturate: 2 x 128 x 127 < 32767 */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, xs), _mm256_set1_epi16(1));
#endif
}

/* two floats at p in lanes 0 and 1 (movq; __m128i loads may alias anything) */
static inline __m128 load2(const float *p) {
    return _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)p));
}

/* The weight scales of block b as eight lanes: one scale, or (sub16) one per half block. */
static inline __m256 block_scales(const int sub16, const float *dr, int64_t b) {
    if (!sub16) return _mm256_set1_ps(dr[b]);
    return _mm256_set_m128(_mm_set1_ps(dr[2 * b + 1]), _mm_set1_ps(dr[2 * b]));
}

/* One weight row against mt (<= MT) activation rows, without the minimums (q8_body adds them).
 * Literal mt and sub16 at every call site (DISPATCH_TILE in gemm_q8_body). */
static inline __attribute__((always_inline)) void q8_tile(const int mt, const int sub16, int64_t nb,
                                                          int64_t K, const int8_t *wr,
                                                          const float *dr, const int8_t *xq,
                                                          const float *xd, float *out) {
    __m256 acc[MT];
    for (int t = 0; t < mt; t++) acc[t] = _mm256_setzero_ps();
    int64_t b = 0;
#if SL_AVX512_VNNI
    __m512 acc512 = _mm512_setzero_ps();
    if (mt == 1) { /* one row (decode): two blocks per zmm register */
        /* lane l of a zmm covers values 4l..4l+3 of the pair: scale index l / 4 of the four
         * half-block scales (sub16), or l / 8 of the two block scales */
        const __m512i quarter = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
        const __m512i half = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        for (; b + 2 <= nb; b += 2) {
            const __m512i w = _mm512_loadu_si512((const void *)(wr + b * QK));
            const __m512i x = _mm512_loadu_si512((const void *)(xq + b * QK));
            /* x with w's sign (no _mm512_sign_epi8): negate where w < 0; w == 0 adds 0 anyway */
            const __m512i xs =
                _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
            const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(w), xs);
            __m512 wscale;
            if (sub16)
                wscale = _mm512_permutexvar_ps(quarter,
                                               _mm512_castps128_ps512(_mm_loadu_ps(dr + 2 * b)));
            else
                wscale = _mm512_permutexvar_ps(half, _mm512_castps128_ps512(_mm_castpd_ps(
                                                         _mm_load_sd((const double *)(dr + b)))));
            const __m512 xscale =
                _mm512_permutexvar_ps(half, _mm512_castps128_ps512(load2(xd + b)));
            acc512 =
                _mm512_fmadd_ps(_mm512_mul_ps(wscale, xscale), _mm512_cvtepi32_ps(dot), acc512);
        }
    }
#else
    if (mt == 1) { /* one row (decode): two chains, so the FMA latency is not the bound */
        __m256 acc2 = _mm256_setzero_ps();
        for (; b + 2 <= nb; b += 2) {
            const __m256i d0 = dot_i8(_mm256_loadu_si256((const __m256i *)(wr + b * QK)),
                                      _mm256_loadu_si256((const __m256i *)(xq + b * QK)));
            const __m256i d1 = dot_i8(_mm256_loadu_si256((const __m256i *)(wr + (b + 1) * QK)),
                                      _mm256_loadu_si256((const __m256i *)(xq + (b + 1) * QK)));
            const __m256 s0 = _mm256_mul_ps(block_scales(sub16, dr, b), _mm256_set1_ps(xd[b]));
            const __m256 s1 =
                _mm256_mul_ps(block_scales(sub16, dr, b + 1), _mm256_set1_ps(xd[b + 1]));
            acc[0] = _mm256_fmadd_ps(s0, _mm256_cvtepi32_ps(d0), acc[0]);
            acc2 = _mm256_fmadd_ps(s1, _mm256_cvtepi32_ps(d1), acc2);
        }
        acc[0] = _mm256_add_ps(acc[0], acc2);
    }
#endif
    for (; b < nb; b++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(wr + b * QK));
        const __m256 ws = block_scales(sub16, dr, b);
        for (int t = 0; t < mt; t++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + t * K + b * QK));
            const __m256 scale = _mm256_mul_ps(ws, _mm256_set1_ps(xd[t * nb + b]));
            acc[t] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(dot_i8(w, x)), acc[t]);
        }
    }
    for (int t = 0; t < mt; t++) out[t] = hsum(acc[t]);
#if SL_AVX512_VNNI
    if (mt == 1) out[0] += _mm512_reduce_add_ps(acc512);
#endif
}
#else
static void q8_tile(const int mt, const int sub16, int64_t nb, int64_t K, const int8_t *wr,
                    const float *dr, const int8_t *xq, const float *xd, float *out) {
    for (int t = 0; t < mt; t++) {
        float sum = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            int dot[2] = {0, 0}; /* values 0..15 and 16..31 */
            for (int j = 0; j < QK; j++) dot[j / 16] += wr[b * QK + j] * xq[t * K + b * QK + j];
            const float xs = xd[t * nb + b];
            if (sub16)
                sum += dr[2 * b] * xs * (float)dot[0] + dr[2 * b + 1] * xs * (float)dot[1];
            else
                sum += dr[b] * xs * (float)(dot[0] + dot[1]);
        }
        out[t] = sum;
    }
}
#endif

void gemm_q8_body(int64_t M, int64_t N, int64_t K, const int8_t *xq, const float *xd,
                  const float *xs, const int8_t *wq, const float *wd, const float *wm, int sub16,
                  const float *bias, float *y, int accumulate) {
    const int64_t nb = K / QK, per_row = sub16 ? 2 * nb : nb;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *wr = wq + n * K;
        const float *dr = wd + n * per_row;
        for (int64_t m0 = 0; m0 < M; m0 += MT) {
            const int mt = M - m0 < MT ? (int)(M - m0) : MT;
            float out[MT] = {0};
            const int8_t *x = xq + m0 * K;
            const float *d = xd + m0 * nb;
            if (sub16) {
                DISPATCH_TILE(q8_tile, mt, 1, nb, K, wr, dr, x, d, out)
            } else {
                DISPATCH_TILE(q8_tile, mt, 0, nb, K, wr, dr, x, d, out)
            }
            if (wm) /* sum_b wm * xd * sum(q_x) = sum_b wm * xs */
                for (int t = 0; t < mt; t++) {
                    float s = 0.0f;
                    for (int64_t b = 0; b < nb; b++) s += wm[n * nb + b] * xs[(m0 + t) * nb + b];
                    out[t] += s;
                }
            for (int t = 0; t < mt; t++) store(y + (m0 + t) * N + n, out[t], bias, n, accumulate);
        }
    }
}

void sl_gemm_q8_0(int64_t M, int64_t N, int64_t K, const int8_t *xq, const float *xd,
                  const int8_t *wq, const float *wd, const float *bias, float *y, int accumulate,
                  int nthreads) {
#pragma omp parallel num_threads(nthreads)
    gemm_q8_body(M, N, K, xq, xd, NULL, wq, wd, NULL, 0, bias, y, accumulate);
}
