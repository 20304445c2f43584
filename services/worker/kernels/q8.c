/* The int8-weight GEMMs: Q8_0, and Q8_M / Q8_16, which hold the 5- and 6-bit GGUF types
 * exactly (layouts: sluice_cpu.h). Row by row: one weight row against one activation row. */
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

/* One weight row against one activation row, without the minimums (q8_body adds them). Literal
 * sub16 at every call site. One row, never a tile of rows: this layout is only used where N is
 * not a multiple of eight (a rare head), and a row's sum must not depend on how many rows share
 * the call (see forward.c), which a multi-row tile's different chains would break. */
static inline __attribute__((always_inline)) float q8_row(const int sub16, int64_t nb,
                                                          const int8_t *wr, const float *dr,
                                                          const int8_t *xq, const float *xd) {
    __m256 acc = _mm256_setzero_ps();
    int64_t b = 0;
#if SL_AVX512_VNNI
    __m512 acc512 = _mm512_setzero_ps();
    { /* two blocks per zmm register */
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
    { /* two chains, so the FMA latency is not the bound */
        __m256 acc2 = _mm256_setzero_ps();
        for (; b + 2 <= nb; b += 2) {
            const __m256i d0 = dot_i8(_mm256_loadu_si256((const __m256i *)(wr + b * QK)),
                                      _mm256_loadu_si256((const __m256i *)(xq + b * QK)));
            const __m256i d1 = dot_i8(_mm256_loadu_si256((const __m256i *)(wr + (b + 1) * QK)),
                                      _mm256_loadu_si256((const __m256i *)(xq + (b + 1) * QK)));
            const __m256 s0 = _mm256_mul_ps(block_scales(sub16, dr, b), _mm256_set1_ps(xd[b]));
            const __m256 s1 =
                _mm256_mul_ps(block_scales(sub16, dr, b + 1), _mm256_set1_ps(xd[b + 1]));
            acc = _mm256_fmadd_ps(s0, _mm256_cvtepi32_ps(d0), acc);
            acc2 = _mm256_fmadd_ps(s1, _mm256_cvtepi32_ps(d1), acc2);
        }
        acc = _mm256_add_ps(acc, acc2);
    }
#endif
    for (; b < nb; b++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(wr + b * QK));
        const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + b * QK));
        const __m256 scale = _mm256_mul_ps(block_scales(sub16, dr, b), _mm256_set1_ps(xd[b]));
        acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(dot_i8(w, x)), acc);
    }
#if SL_AVX512_VNNI
    return hsum(acc) + _mm512_reduce_add_ps(acc512);
#else
    return hsum(acc);
#endif
}
#else
static float q8_row(const int sub16, int64_t nb, const int8_t *wr, const float *dr,
                    const int8_t *xq, const float *xd) {
    float sum = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        int dot[2] = {0, 0}; /* values 0..15 and 16..31 */
        for (int j = 0; j < QK; j++) dot[j / 16] += wr[b * QK + j] * xq[b * QK + j];
        if (sub16)
            sum += dr[2 * b] * xd[b] * (float)dot[0] + dr[2 * b + 1] * xd[b] * (float)dot[1];
        else
            sum += dr[b] * xd[b] * (float)(dot[0] + dot[1]);
    }
    return sum;
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
        for (int64_t m = 0; m < M; m++) {
            const int8_t *x = xq + m * K;
            const float *d = xd + m * nb;
            float out = sub16 ? q8_row(1, nb, wr, dr, x, d) : q8_row(0, nb, wr, dr, x, d);
            if (wm) { /* sum_b wm * xd * sum(q_x) = sum_b wm * xs */
                float s = 0.0f;
                for (int64_t b = 0; b < nb; b++) s += wm[n * nb + b] * xs[m * nb + b];
                out += s;
            }
            store(y + m * N + n, out, bias, n, accumulate);
        }
    }
}

/* ---- eight rows interleaved (N % 8 == 0) ---------------------------------------------------
 * For rows 8g..8g+7 and block b: eight 32-byte vectors, byte 4r + i of vector j holding row r's
 * value 4j + i, then the scales [8] (Q8_16: [2][8], values 0..15 then 16..31) and minimums [8].
 * As for Q4 (matmul.c), a broadcast of four activation bytes then feeds eight rows' dot
 * products, and the scales are vectors: about half the instructions of the row-by-row tile. */
#define Q8X8_BLOCK 256

#if SL_AVX2
#if SL_VNNI
/* s + the eight rows' sums of four products |w| * (x with w's sign) */
static inline __m256i dot4_acc(__m256i s, __m256i wabs, __m256i w, __m256i x4) {
    return dpbusd256(s, wabs, _mm256_sign_epi8(x4, w));
}

static inline __attribute__((always_inline)) void
q8x8_tile(const int mt, const int sub16, const int half, int64_t nb, int64_t K, const int8_t *wg,
          const void *dg, const void *mg, const int8_t *xq, const float *xd, const float *xs,
          __m256 *acc) {
    for (int t = 0; t < mt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *wb = wg + b * Q8X8_BLOCK;
        __m256i w[8], wabs[8]; /* loaded once for the mt rows (32 registers: room for all) */
        for (int j = 0; j < 8; j++) {
            w[j] = _mm256_loadu_si256((const __m256i *)(wb + 32 * j));
            wabs[j] = _mm256_sign_epi8(w[j], w[j]);
        }
        const __m256 d0 = load_scales8(dg, b * (sub16 ? 16 : 8), half);
        const __m256 d1 = sub16 ? load_scales8(dg, b * 16 + 8, half) : d0;
        for (int t = 0; t < mt; t++) {
            const int8_t *x = xq + t * K + b * QK;
            __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) lo = dot4_acc(lo, wabs[j], w[j], bcast4(x + 4 * j));
            for (int j = 4; j < 8; j++) hi = dot4_acc(hi, wabs[j], w[j], bcast4(x + 4 * j));
            const __m256 xv = _mm256_set1_ps(xd[t * nb + b]);
            if (sub16) {
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d0, xv), _mm256_cvtepi32_ps(lo), acc[t]);
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d1, xv), _mm256_cvtepi32_ps(hi), acc[t]);
            } else {
                const __m256 dots = _mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi));
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d0, xv), dots, acc[t]);
            }
            if (mg)
                acc[t] = _mm256_fmadd_ps(load_scales8(mg, b * 8, half),
                                         _mm256_set1_ps(xs[t * nb + b]), acc[t]);
        }
    }
}
#else
/* AVX2 without VNNI (16 vector registers): as the 4-bit tile (matmul.c), each 32-byte weight
 * vector is loaded right before the mt rows use it, into int32 sums per row: 2 mt + 4 registers
 * live. One half block (values 0..15 or 16..31: vectors 4h..4h+3) at a time, since Q8_16 scales
 * the halves apart. */
static inline __attribute__((always_inline)) void
q8x8_half(const int mt, int64_t K, const int8_t *wb, const int8_t *x, __m256i *s32) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int j = 0; j < 4; j++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(wb + 32 * j));
        const __m256i wabs = _mm256_sign_epi8(w, w);
        for (int t = 0; t < mt; t++) {
            /* int16 pair sums cannot saturate: 2 x 127 x 127 < 32767 */
            const __m256i xs = _mm256_sign_epi8(bcast4(x + t * K + 4 * j), w);
            s32[t] =
                _mm256_add_epi32(s32[t], _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, xs), ones));
            SL_KEEP(s32[t]);
        }
    }
}

static inline __attribute__((always_inline)) void
q8x8_tile(const int mt, const int sub16, const int half, int64_t nb, int64_t K, const int8_t *wg,
          const void *dg, const void *mg, const int8_t *xq, const float *xd, const float *xs,
          __m256 *acc) {
    for (int t = 0; t < mt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *wb = wg + b * Q8X8_BLOCK, *x = xq + b * QK;
        __m256i s32[MT_MAX];
        for (int t = 0; t < mt; t++) s32[t] = _mm256_setzero_si256();
        q8x8_half(mt, K, wb, x, s32);
        if (sub16) { /* the first half's sums, scaled, before the second's */
            const __m256 d = load_scales8(dg, b * 16, half);
            for (int t = 0; t < mt; t++) {
                const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(xd[t * nb + b]));
                acc[t] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(s32[t]), acc[t]);
                s32[t] = _mm256_setzero_si256();
            }
        }
        q8x8_half(mt, K, wb + 128, x + 16, s32);
        const __m256 d = load_scales8(dg, b * (sub16 ? 16 : 8) + (sub16 ? 8 : 0), half);
        for (int t = 0; t < mt; t++) {
            const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(xd[t * nb + b]));
            acc[t] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(s32[t]), acc[t]);
        }
        if (mg) {
            const __m256 m = load_scales8(mg, b * 8, half);
            for (int t = 0; t < mt; t++)
                acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[t * nb + b]), acc[t]);
        }
    }
}
#endif
#endif

#if SL_AVX512_VNNI
/* Two groups (rows 8g..8g+15) on 512-bit vectors, g's in the low half and g + 1's in the high
 * half, as the 4-bit GEMM's 16-row tile (matmul.c): one broadcast and one vpdpbusd serve
 * sixteen weight rows. Each lane does the 8-row tile's arithmetic in its order: the same bits. */
static inline __attribute__((always_inline)) void
q8x16_tile(const int mt, const int sub16, const int half, int64_t nb, int64_t K, const int8_t *wg,
           const int8_t *wh, const void *dg, const void *dh, const void *mg, const void *mh,
           const int8_t *xq, const float *xd, const float *xs, __m512 *acc) {
    const int per = sub16 ? 16 : 8;
    for (int t = 0; t < mt; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *wb = wg + b * Q8X8_BLOCK, *hb = wh + b * Q8X8_BLOCK;
        __m512i w[8], wabs[8]; /* loaded once for the mt rows */
        for (int j = 0; j < 8; j++) {
            w[j] = join256(_mm256_loadu_si256((const __m256i *)(wb + 32 * j)),
                           _mm256_loadu_si256((const __m256i *)(hb + 32 * j)));
            wabs[j] = _mm512_abs_epi8(w[j]);
        }
        const __m512 d0 = join_ps(load_scales8(dg, b * per, half), load_scales8(dh, b * per, half));
        const __m512 d1 =
            sub16 ? join_ps(load_scales8(dg, b * 16 + 8, half), load_scales8(dh, b * 16 + 8, half))
                  : d0;
        for (int t = 0; t < mt; t++) {
            const int8_t *x = xq + t * K + b * QK;
            __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
            for (int j = 0; j < 8; j++) {
                int32_t x4;
                memcpy(&x4, x + 4 * j, 4);
                /* x with w's sign (512-bit vectors have no vpsignb): negated where w < 0; where
                 * w == 0 its |w| zeroes the product whatever x's sign */
                const __m512i xv4 = _mm512_set1_epi32(x4);
                const __m512i xs4 = _mm512_mask_sub_epi8(xv4, _mm512_movepi8_mask(w[j]),
                                                         _mm512_setzero_si512(), xv4);
                if (j < 4)
                    lo = _mm512_dpbusd_epi32(lo, wabs[j], xs4);
                else
                    hi = _mm512_dpbusd_epi32(hi, wabs[j], xs4);
            }
            const __m512 xv = _mm512_set1_ps(xd[t * nb + b]);
            if (sub16) {
                acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d0, xv), _mm512_cvtepi32_ps(lo), acc[t]);
                acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d1, xv), _mm512_cvtepi32_ps(hi), acc[t]);
            } else {
                const __m512 dots = _mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi));
                acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d0, xv), dots, acc[t]);
            }
            if (mg)
                acc[t] = _mm512_fmadd_ps(
                    join_ps(load_scales8(mg, b * 8, half), load_scales8(mh, b * 8, half)),
                    _mm512_set1_ps(xs[t * nb + b]), acc[t]);
        }
    }
}
#endif

/* Rows 8g..8g + cols - 1 of y (cols: 8, or 16 for two groups on 512-bit vectors) for every
 * activation row, MT rows per weight pass. */
static inline __attribute__((always_inline)) void
q8_groups(const int sub16, const int cols, int64_t g, int64_t M, int64_t N, int64_t K,
          const int8_t *xq, const float *xd, const float *xs, const int8_t *wq, const void *wd,
          const void *wm, const int half, const float *bias, float *y, int accumulate) {
    const int64_t nb = K / QK, per_block = sub16 ? 16 : 8;
    const int8_t *wg = wq + g * nb * Q8X8_BLOCK;
    const void *dg = scales_at(wd, g * nb * per_block, half);
    const void *mg = wm ? scales_at(wm, g * nb * 8, half) : NULL;
    for (int64_t m0 = 0, mt; m0 < M; m0 += mt) {
        mt = tile_rows(M, m0);
        float out[MT_MAX][16];
#if SL_AVX2
        const int8_t *x = xq + m0 * K;
        const float *d = xd + m0 * nb, *s = xs ? xs + m0 * nb : NULL;
#endif
#if SL_AVX512_VNNI
        if (cols == 16) {
            const int8_t *wh = wg + nb * Q8X8_BLOCK;
            const void *dh = scales_at(dg, nb * per_block, half);
            const void *mh = mg ? scales_at(mg, nb * 8, half) : NULL;
            __m512 acc[MT_MAX];
            if (sub16) {
                DISPATCH_TILE(q8x16_tile, mt, 1, half, nb, K, wg, wh, dg, dh, mg, mh, x, d, s, acc)
            } else {
                DISPATCH_TILE(q8x16_tile, mt, 0, half, nb, K, wg, wh, dg, dh, mg, mh, x, d, s, acc)
            }
            for (int t = 0; t < mt; t++) _mm512_storeu_ps(out[t], acc[t]);
        } else
#endif
        {
#if SL_AVX2
            __m256 acc[MT_MAX];
            if (sub16) {
                DISPATCH_TILE(q8x8_tile, mt, 1, half, nb, K, wg, dg, mg, x, d, s, acc)
            } else {
                DISPATCH_TILE(q8x8_tile, mt, 0, half, nb, K, wg, dg, mg, x, d, s, acc)
            }
            for (int t = 0; t < mt; t++) _mm256_storeu_ps(out[t], acc[t]);
#else
            for (int t = 0; t < mt; t++) {
                const int64_t row = m0 + t;
                for (int r = 0; r < 8; r++) {
                    float sum = 0.0f;
                    for (int64_t b = 0; b < nb; b++) {
                        const int8_t *wb = wg + b * Q8X8_BLOCK;
                        const int8_t *x = xq + row * K + b * QK;
                        int dot[2] = {0, 0}; /* values 0..15 and 16..31 */
                        for (int j = 0; j < 8; j++)
                            for (int i = 0; i < 4; i++)
                                dot[j / 4] += wb[32 * j + 4 * r + i] * x[4 * j + i];
                        const float xv = xd[row * nb + b];
                        if (sub16)
                            sum += scale_at(dg, b * 16 + r, half) * xv * (float)dot[0] +
                                   scale_at(dg, b * 16 + 8 + r, half) * xv * (float)dot[1];
                        else
                            sum += scale_at(dg, b * 8 + r, half) * xv * (float)(dot[0] + dot[1]);
                        if (mg) sum += scale_at(mg, b * 8 + r, half) * xs[row * nb + b];
                    }
                    out[t][r] = sum;
                }
            }
#endif
        }
        for (int t = 0; t < mt; t++)
            for (int r = 0; r < cols; r++)
                store(y + (m0 + t) * N + g * 8 + r, out[t][r], bias, g * 8 + r, accumulate);
    }
}

void gemm_q8x8_body(int64_t M, int64_t N, int64_t K, const int8_t *xq, const float *xd,
                    const float *xs, const int8_t *wq, const void *wd, const void *wm, int sub16,
                    int half, const float *bias, float *y, int accumulate) {
    if (gemm_on_amx(sub16 ? AMX_Q8_16 : AMX_Q8, M, N, K, xq, xd, xs, wq, wd, wm, half, bias, y,
                    accumulate))
        return;
    const int64_t groups = N / 8, span = x8_span(M);
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; g += span) { /* an odd last group alone */
        const int cols = g + 1 < groups && span == 2 ? 16 : 8;
        if (sub16)
            q8_groups(1, cols, g, M, N, K, xq, xd, xs, wq, wd, wm, half, bias, y, accumulate);
        else
            q8_groups(0, cols, g, M, N, K, xq, xd, xs, wq, wd, wm, half, bias, y, accumulate);
    }
}

void sl_gemm_q8_0(int64_t M, int64_t N, int64_t K, const int8_t *xq, const float *xd,
                  const int8_t *wq, const float *wd, const float *bias, float *y, int accumulate,
                  int nthreads) {
#pragma omp parallel num_threads(nthreads)
    gemm_q8_body(M, N, K, xq, xd, NULL, wq, wd, NULL, 0, bias, y, accumulate);
}
