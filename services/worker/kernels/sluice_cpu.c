/* sluice CPU kernels: quantized matmuls and the fused pieces of a decode step.
 *
 * Why this exists: on a CPU, one decode step of a small model is a few megabytes of weights and
 * about 1,500 tiny torch ops; the ops' dispatch costs more than the arithmetic. These kernels
 * work straight from 4- and 8-bit blocks (the GGUF Q4_1 / Q8_0 formats, re-laid out) with
 * activations quantized to 8 bits per block of 32, as llama.cpp does, fuse the glue (RMSNorm +
 * quantize, SwiGLU + quantize, RoPE + KV write + attention), and run a whole decode step
 * (sl_decode) as one call with one OpenMP parallel region.
 *
 * Layouts (row-major, QK = 32 values per block, nb = K / QK blocks per row):
 *   activations  xq int8 [M, K], xd float [M, nb] (scale), xs float [M, nb] (scale * sum of q)
 *   Q4_1 weight  eight rows interleaved (N % 8 == 0): wq uint8 [N/8, nb, 128], wd and wm float
 *                [N/8, nb, 8] (scale, minimum): w = wd * q + wm; see gemm_q4_1_body
 *   Q8_0 weight  wq int8 [N, nb, 32], wd float [N, nb]: w = wd * q
 *   KV cache     one layer: [slots, kv_heads, capacity, head_dim] floats
 *
 * Threads: every entry point takes nthreads and uses OpenMP, the same libgomp torch loaded, so
 * the two share one thread pool instead of fighting over the cores.
 * Without AVX2 + FMA the scalar loops below compute the same results (slowly).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SL_AVX2 1
#else
#define SL_AVX2 0
#endif

#define QK 32
#define MT 4 /* activation rows per weight pass: a weight block is unpacked once per MT rows */

int sl_vectorized(void) { return SL_AVX2; }

/* ---- vector helpers ----------------------------------------------------------------------- */

#if SL_AVX2
static inline float hsum(__m256 v) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

/* e^x for 8 floats (Cephes' polynomial, relative error ~2e-7), inputs clamped to [-87, 88]. */
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* [hsum(a), hsum(b), hsum(c), hsum(d)] */
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* 16 bytes of packed nibbles -> 32 unsigned bytes in value order. */
static inline __m256i unpack_q4(const uint8_t *p) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)p);
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}
#endif

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
        const __m256i sum32 = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]),
                                               _mm256_add_epi32(i32[2], i32[3]));
        /* packs interleave 128-bit lanes; the permute puts the 32 bytes back in order */
        const __m256i i16a = _mm256_packs_epi32(i32[0], i32[1]), i16b = _mm256_packs_epi32(i32[2], i32[3]);
        const __m256i i8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(i16a, i16b),
                                                       _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + b * QK), i8);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum32), _mm256_extracti128_si256(sum32, 1));
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

/* The *_body functions hold an orphaned `omp for`: called inside a parallel region (sl_decode)
 * they share its threads and end on its barrier; the sl_* wrappers open a region of their own. */
static void quantize_body(const float *x, int64_t M, int64_t K, int8_t *xq, float *xd, float *xs) {
    const int64_t nb = K / QK;
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, K, xq + m * K, xd + m * nb, xs + m * nb);
}

void sl_quantize(const float *x, int64_t M, int64_t K, int8_t *xq, float *xd, float *xs,
                 int nthreads) {
#pragma omp parallel num_threads(nthreads)
    quantize_body(x, M, K, xq, xd, xs);
}

/* RMSNorm(x) * w, quantized; the normalized floats only go to tmp (they only feed a matmul). */
static void rmsnorm_quantize_body(const float *x, const float *w, float eps, int64_t M, int64_t K,
                                  int8_t *xq, float *xd, float *xs, float *tmp) {
    const int64_t nb = K / QK;
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const float *row = x + m * K;
        float *t = tmp + m * K;
        double ss = 0.0;
        for (int64_t i = 0; i < K; i++) ss += (double)row[i] * row[i];
        const float r = 1.0f / sqrtf((float)(ss / (double)K) + eps);
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
static void swiglu_quantize_body(const float *gu, int64_t M, int64_t I, int8_t *xq, float *xd,
                                 float *xs, float *tmp) {
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
            const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, gv))));
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


static inline void store(float *y, float v, const float *bias, int64_t n, int accumulate) {
    if (bias) v += bias[n];
    if (accumulate) v += *y;
    *y = v;
}

/* One output row n against mt (<= MT) activation rows. always_inline + a literal mt per call site
 * lets the compiler keep the accumulators in registers. */
#if SL_AVX2
static inline __attribute__((always_inline)) void q8_0_tile(const int mt, int64_t nb, int64_t K,
                                                            const int8_t *wr, const float *dr,
                                                            const int8_t *xq, const float *xd,
                                                            float *out) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MT];
    for (int t = 0; t < mt; t++) acc[t] = _mm256_setzero_ps();
    int64_t b = 0;
    if (mt == 1) { /* one row (decode): two chains, as in q4_1_tile */
        __m256 acc2 = _mm256_setzero_ps();
        for (; b + 2 <= nb; b += 2) {
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(wr + b * QK));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wr + (b + 1) * QK));
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + b * QK));
            const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + (b + 1) * QK));
            const __m256i d0 = _mm256_madd_epi16(
                _mm256_maddubs_epi16(_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(x0, w0)), ones);
            const __m256i d1 = _mm256_madd_epi16(
                _mm256_maddubs_epi16(_mm256_sign_epi8(w1, w1), _mm256_sign_epi8(x1, w1)), ones);
            acc[0] = _mm256_fmadd_ps(_mm256_set1_ps(dr[b] * xd[b]), _mm256_cvtepi32_ps(d0), acc[0]);
            acc2 = _mm256_fmadd_ps(_mm256_set1_ps(dr[b + 1] * xd[b + 1]), _mm256_cvtepi32_ps(d1),
                                   acc2);
        }
        acc[0] = _mm256_add_ps(acc[0], acc2);
    }
    for (; b < nb; b++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(wr + b * QK));
        const __m256i wabs = _mm256_sign_epi8(w, w); /* maddubs wants one unsigned side */
        for (int t = 0; t < mt; t++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + t * K + b * QK));
            const __m256i dot =
                _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(x, w)), ones);
            const __m256 scale = _mm256_set1_ps(dr[b] * xd[t * nb + b]);
            acc[t] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(dot), acc[t]);
        }
    }
    for (int t = 0; t < mt; t++) out[t] = hsum(acc[t]);
}
#else
static void q8_0_tile(const int mt, int64_t nb, int64_t K, const int8_t *wr, const float *dr,
                      const int8_t *xq, const float *xd, float *out) {
    for (int t = 0; t < mt; t++) {
        float sum = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            int dot = 0;
            for (int j = 0; j < QK; j++) dot += wr[b * QK + j] * xq[t * K + b * QK + j];
            sum += dr[b] * xd[t * nb + b] * (float)dot;
        }
        out[t] = sum;
    }
}
#endif

#define DISPATCH_TILE(fn, mt, ...)                                                            \
    switch (mt) {                                                                              \
    case 4: fn(4, __VA_ARGS__); break;                                                         \
    case 3: fn(3, __VA_ARGS__); break;                                                         \
    case 2: fn(2, __VA_ARGS__); break;                                                         \
    default: fn(1, __VA_ARGS__); break;                                                        \
    }

static inline float dot_f32(const float *a, const float *b, int64_t n);

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

static inline __attribute__((always_inline)) void q4x8_tile(const int mt, int64_t nb, int64_t K,
                                                            const uint8_t *wg, const float *dg,
                                                            const float *mg, const int8_t *xq,
                                                            const float *xd, const float *xs,
                                                            __m256 *acc) {
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
    for (int t = 0; t < mt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = wg + b * Q4X8_BLOCK;
        const __m256 d = _mm256_loadu_ps(dg + b * 8), m = _mm256_loadu_ps(mg + b * 8);
        __m256i raw[4];
        for (int j = 0; j < 4; j++) raw[j] = _mm256_loadu_si256((const __m256i *)(wb + 32 * j));
        for (int t = 0; t < mt; t++) {
            const int8_t *x = xq + t * K + b * QK;
            __m256i s16 = _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {
                const __m256i lo = _mm256_and_si256(raw[j], low);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw[j], 4), low);
                s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(lo, bcast4(x + 4 * j)));
                s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(hi, bcast4(x + 16 + 4 * j)));
            }
            const __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones));
            const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(xd[t * nb + b]));
            acc[t] = _mm256_fmadd_ps(scale, dots, acc[t]);
            acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[t * nb + b]), acc[t]);
        }
    }
}
#endif

static void gemm_q4_1_body(int64_t M, int64_t N, int64_t K, const int8_t *xq, const float *xd,
                           const float *xs, const uint8_t *wq, const float *wd, const float *wm,
                           const float *bias, float *y, int accumulate) {
    const int64_t nb = K / QK;
#pragma omp for schedule(static)
    for (int64_t g = 0; g < N / 8; g++) {
        const uint8_t *wg = wq + g * nb * Q4X8_BLOCK;
        const float *dg = wd + g * nb * 8, *mg = wm + g * nb * 8;
        for (int64_t m0 = 0; m0 < M; m0 += MT) {
            const int mt = M - m0 < MT ? (int)(M - m0) : MT;
            float out[MT][8];
#if SL_AVX2
            __m256 acc[MT];
            const int8_t *x = xq + m0 * K;
            const float *d = xd + m0 * nb, *s = xs + m0 * nb;
            switch (mt) {
            case 4: q4x8_tile(4, nb, K, wg, dg, mg, x, d, s, acc); break;
            case 3: q4x8_tile(3, nb, K, wg, dg, mg, x, d, s, acc); break;
            case 2: q4x8_tile(2, nb, K, wg, dg, mg, x, d, s, acc); break;
            default: q4x8_tile(1, nb, K, wg, dg, mg, x, d, s, acc); break;
            }
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
                                dot += (byte & 0x0F) * x[4 * j + i] + (byte >> 4) * x[16 + 4 * j + i];
                            }
                        sum += dg[b * 8 + r] * xd[row * nb + b] * (float)dot +
                               mg[b * 8 + r] * xs[row * nb + b];
                    }
                    out[t][r] = sum;
                }
            }
#endif
            for (int t = 0; t < mt; t++)
                for (int r = 0; r < 8; r++) store(y + (m0 + t) * N + g * 8 + r, out[t][r], bias, g * 8 + r, accumulate);
        }
    }
}

void sl_gemm_q4_1(int64_t M, int64_t N, int64_t K, const int8_t *xq, const float *xd,
                  const float *xs, const uint8_t *wq, const float *wd, const float *wm,
                  const float *bias, float *y, int accumulate, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    gemm_q4_1_body(M, N, K, xq, xd, xs, wq, wd, wm, bias, y, accumulate);
}

static void gemm_q8_0_body(int64_t M, int64_t N, int64_t K, const int8_t *xq, const float *xd,
                           const int8_t *wq, const float *wd, const float *bias, float *y,
                           int accumulate) {
    const int64_t nb = K / QK;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *wr = wq + n * K;
        const float *dr = wd + n * nb;
        for (int64_t m0 = 0; m0 < M; m0 += MT) {
            const int mt = M - m0 < MT ? (int)(M - m0) : MT;
            float out[MT] = {0};
            DISPATCH_TILE(q8_0_tile, mt, nb, K, wr, dr, xq + m0 * K, xd + m0 * nb, out)
            for (int t = 0; t < mt; t++) store(y + (m0 + t) * N + n, out[t], bias, n, accumulate);
        }
    }
}

void sl_gemm_q8_0(int64_t M, int64_t N, int64_t K, const int8_t *xq, const float *xd,
                  const int8_t *wq, const float *wd, const float *bias, float *y, int accumulate,
                  int nthreads) {
#pragma omp parallel num_threads(nthreads)
    gemm_q8_0_body(M, N, K, xq, xd, wq, wd, bias, y, accumulate);
}

/* ---- decode attention: one new token per row ---------------------------------------------- */

static inline float dot_f32(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#if SL_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    s = hsum(acc);
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy_f32(float a, const float *x, float *y, int64_t n) {
    int64_t i = 0;
#if SL_AVX2
    const __m256 va = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++) y[i] += a * x[i];
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

/* One query head over S cached keys/values: o = softmax(q.K / sqrt(hd)) V. p: S floats. */
static void attend(const float *q, const float *keys, const float *vals, int64_t S, int64_t hd,
                   float scale, float *p, float *o) {
    int64_t t = 0;
    float mx = -INFINITY, sum = 0.0f;
#if SL_AVX2
    if (hd % 8 == 0) {
        /* four keys at a time: four independent FMA chains and one combined horizontal sum */
        for (; t + 4 <= S; t += 4) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            const float *k0 = keys + t * hd;
            for (int64_t d = 0; d < hd; d += 8) {
                const __m256 qv = _mm256_loadu_ps(q + d);
                a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
                a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + hd + d), a1);
                a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 2 * hd + d), a2);
                a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 3 * hd + d), a3);
            }
            _mm_storeu_ps(p + t, _mm_mul_ps(hsum4(a0, a1, a2, a3), _mm_set1_ps(scale)));
        }
    }
#endif
    for (; t < S; t++) p[t] = dot_f32(q, keys + t * hd, hd) * scale;
    for (t = 0; t < S; t++) mx = p[t] > mx ? p[t] : mx;
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
    int64_t d0 = 0;
#if SL_AVX2
    /* 64 output dims at a time stay in eight registers across all S values */
    for (; d0 + 64 <= hd; d0 += 64) {
        __m256 acc[8];
        for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
        for (t = 0; t < S; t++) {
            const __m256 w = _mm256_set1_ps(p[t] * inv);
            const float *v = vals + t * hd + d0;
            for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * j), acc[j]);
        }
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(o + d0 + 8 * j, acc[j]);
    }
#endif
    if (d0 < hd) {
        memset(o + d0, 0, (size_t)(hd - d0) * sizeof(float));
        for (t = 0; t < S; t++) axpy_f32(p[t] * inv, vals + t * hd + d0, o + d0, hd - d0);
    }
}

/* qkv: [B, (H + 2 KV) * hd] straight from the fused projection (rotated in place).
 * For row b the new token sits at position pos[b] of cache slot slots[b]; it is written there,
 * then attends to positions 0..pos[b]. out: [B, H * hd]. scores: B * H * span floats, span > max pos. */
static void attention_decode_body(int64_t B, int64_t H, int64_t KV, int64_t hd, float *qkv,
                                  const float *cos_table, const float *sin_table,
                                  const int64_t *pos, const int64_t *slots, float *kc, float *vc,
                                  int64_t capacity, const float *q_norm, const float *k_norm,
                                  float eps, float *out, float *scores, int64_t span) {
    const int64_t width = (H + 2 * KV) * hd, G = H / KV;
    const int64_t head_stride = capacity * hd, slot_stride = KV * head_stride;
    const float scale = 1.0f / sqrtf((float)hd);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < B * KV; task++) {
        const int64_t b = task / KV, k = task % KV;
        float *row = qkv + b * width;
        const float *c = cos_table + pos[b] * hd, *s = sin_table + pos[b] * hd;
        for (int64_t g = 0; g < G; g++) norm_rope(row + (k * G + g) * hd, hd, q_norm, eps, c, s);
        float *key = row + (H + k) * hd, *val = row + (H + KV + k) * hd;
        norm_rope(key, hd, k_norm, eps, c, s);
        const int64_t at = slots[b] * slot_stride + k * head_stride + pos[b] * hd;
        memcpy(kc + at, key, (size_t)hd * sizeof(float));
        memcpy(vc + at, val, (size_t)hd * sizeof(float));
    }
    /* the barrier above: every key is in the cache before anyone attends */
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < B * KV; task++) {
        const int64_t b = task / KV, k = task % KV;
        const float *keys = kc + slots[b] * slot_stride + k * head_stride;
        const float *vals = vc + slots[b] * slot_stride + k * head_stride;
        for (int64_t g = 0; g < G; g++) {
            const int64_t h = k * G + g;
            attend(qkv + b * width + h * hd, keys, vals, pos[b] + 1, hd, scale,
                   scores + (b * H + h) * span, out + b * H * hd + h * hd);
        }
    }
}

void sl_attention_decode(int64_t B, int64_t H, int64_t KV, int64_t hd, float *qkv,
                         const float *cos_table, const float *sin_table, const int64_t *pos,
                         const int64_t *slots, float *kc, float *vc, int64_t capacity,
                         const float *q_norm, const float *k_norm, float eps, float *out,
                         float *scores, int64_t span, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    attention_decode_body(B, H, KV, hd, qkv, cos_table, sin_table, pos, slots, kc, vc, capacity,
                          q_norm, k_norm, eps, out, scores, span);
}

/* ---- a whole decode step ------------------------------------------------------------------ */

/* A Q4_1 (or, for the head, Q8_0) linear: weights, scales, minimums, optional bias. */
typedef struct {
    const void *q;
    const float *d, *m, *bias;
    int64_t n, k;
} sl_linear;

typedef struct {
    const float *input_norm, *post_norm, *q_norm, *k_norm;
    sl_linear qkv, o, gate_up, down;
} sl_layer;

typedef struct {
    int64_t layers, hidden, inner, heads, kv_heads, head_dim;
    float eps;
    const float *cos, *sin, *final_norm;
    const sl_layer *layer;
    sl_linear head;
} sl_model;

/* Per-step buffers, sized for B rows by the caller. */
typedef struct {
    int8_t *xq; /* B x max(hidden, inner, heads * head_dim) */
    float *xd, *xs, *tmp;
    float *qkv, *attended, *gate_up, *scores; /* scores: B * heads * span */
} sl_scratch;

static void q4_linear(const sl_linear *l, int64_t M, const sl_scratch *w, float *y, int acc) {
    gemm_q4_1_body(M, l->n, l->k, w->xq, w->xd, w->xs, (const uint8_t *)l->q, l->d, l->m,
                   l->bias, y, acc);
}

/* x: [B, hidden] embeddings in, final hidden state out; logits: [B, vocab]. One parallel region
 * for the whole step: the threads meet at barriers between stages instead of being started and
 * joined ~270 times. */
void sl_decode(const sl_model *m, int64_t B, float *x, const int64_t *pos, const int64_t *slots,
               float *kc, float *vc, int64_t cache_slots, int64_t capacity, int64_t span,
               const sl_scratch *w, float *logits, int nthreads) {
    const int64_t C = m->hidden, H = m->heads, KV = m->kv_heads, hd = m->head_dim;
    const int64_t layer_elems = cache_slots * KV * capacity * hd;
#pragma omp parallel num_threads(nthreads)
    {
        for (int64_t i = 0; i < m->layers; i++) {
            const sl_layer *L = m->layer + i;
            rmsnorm_quantize_body(x, L->input_norm, m->eps, B, C, w->xq, w->xd, w->xs, w->tmp);
            q4_linear(&L->qkv, B, w, w->qkv, 0);
            attention_decode_body(B, H, KV, hd, w->qkv, m->cos, m->sin, pos, slots,
                                  kc + i * layer_elems, vc + i * layer_elems, capacity, L->q_norm,
                                  L->k_norm, m->eps, w->attended, w->scores, span);
            quantize_body(w->attended, B, H * hd, w->xq, w->xd, w->xs);
            q4_linear(&L->o, B, w, x, 1);
            rmsnorm_quantize_body(x, L->post_norm, m->eps, B, C, w->xq, w->xd, w->xs, w->tmp);
            q4_linear(&L->gate_up, B, w, w->gate_up, 0);
            swiglu_quantize_body(w->gate_up, B, m->inner, w->xq, w->xd, w->xs, w->tmp);
            q4_linear(&L->down, B, w, x, 1);
        }
        rmsnorm_quantize_body(x, m->final_norm, m->eps, B, C, w->xq, w->xd, w->xs, w->tmp);
        gemm_q8_0_body(B, m->head.n, m->head.k, w->xq, w->xd, (const int8_t *)m->head.q,
                       m->head.d, m->head.bias, logits, 0);
    }
}
