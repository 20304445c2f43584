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
 *   Q4_0 weight  as Q4_1 without the minimums: w = wd * (q - 8)
 *   Q8_0 weight  wq int8 [N, nb, 32], wd float [N, nb]: w = wd * q
 *   KV cache     one layer: [slots, kv_heads, capacity, head_dim] floats
 *
 * Threads: every entry point takes nthreads and uses OpenMP, the same libgomp torch loaded, so
 * the two share one thread pool instead of fighting over the cores.
 * Without AVX2 + FMA the scalar loops compute the same results (slowly).
 *
 * Files: sluice_cpu.h (this: layouts, vector helpers, the shared stage functions), matmul.c
 * (activation quantization, the Q4_1 and Q8_0 GEMMs), decode.c (attention, the decode step).
 */
#ifndef SLUICE_CPU_H
#define SLUICE_CPU_H

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
    const __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* [hsum(a), hsum(b), hsum(c), hsum(d)] */
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
#endif

/* ---- the model's structs ------------------------------------------------------------------ */

/* Weight formats, numbered as ggml numbers its types (GGML_TYPE_*). */
enum { SL_Q4_0 = 2, SL_Q4_1 = 3, SL_Q8_0 = 8 };

/* These structs are mirrored field by field by the ctypes Structures in __init__.py (Linear,
 * Layer, Model, Scratch): change both together. */

/* A packed linear: weights, scales, minimums (Q4_1 only), optional bias, its format (SL_*). */
typedef struct {
    const void *q;
    const float *d, *m, *bias;
    int64_t n, k, type;
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

/* Stages shared between the files: each holds an orphaned `omp for`, so called inside a parallel
 * region (sl_decode) it shares that region's threads and ends on its barrier. Hidden: only the
 * sl_* entry points are exported. */
#define SL_INTERNAL __attribute__((visibility("hidden")))
SL_INTERNAL void quantize_body(const float *x, int64_t M, int64_t K, int8_t *xq, float *xd,
                               float *xs);
SL_INTERNAL void rmsnorm_quantize_body(const float *x, const float *w, float eps, int64_t M,
                                       int64_t K, int8_t *xq, float *xd, float *xs, float *tmp);
SL_INTERNAL void swiglu_quantize_body(const float *gu, int64_t M, int64_t I, int8_t *xq, float *xd,
                                      float *xs, float *tmp);
SL_INTERNAL void gemm_q4_1_body(int64_t M, int64_t N, int64_t K, const int8_t *xq, const float *xd,
                                const float *xs, const uint8_t *wq, const float *wd,
                                const float *wm, const float *bias, float *y, int accumulate);
SL_INTERNAL void gemm_q8_0_body(int64_t M, int64_t N, int64_t K, const int8_t *xq, const float *xd,
                                const int8_t *wq, const float *wd, const float *bias, float *y,
                                int accumulate);
/* y (+)= x W^T (+ bias) for any format: the GEMM its type names */
SL_INTERNAL void linear_body(const sl_linear *l, int64_t M, const int8_t *xq, const float *xd,
                             const float *xs, float *y, int accumulate);

#endif
