/* sluice CPU kernels, internal: instruction-set selection, vector helpers, and the stages shared
 * between quantize.c, matmul.c, q8.c, amx.c, attend.c, attention.c and forward.c. Not part of
 * the ABI (sluice_cpu.h is). */
#ifndef SL_IMPL_H
#define SL_IMPL_H

#include "sluice_cpu.h"

#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SL_AVX2 1
#else
#define SL_AVX2 0
#endif

/* vpdpbusd on 256-bit vectors: AVX-512 VNNI with AVX512VL (or the VEX-coded AVX-VNNI). */
#if SL_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SL_VNNI              1
#define dpbusd256(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif SL_AVX2 && defined(__AVXVNNI__)
#define SL_VNNI              1
#define dpbusd256(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#else
#define SL_VNNI 0
#endif

/* 512-bit integer code (two blocks per vector) with vpdpbusd on zmm registers. */
#if SL_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SL_AVX512_VNNI 1
#else
#define SL_AVX512_VNNI 0
#endif

/* AMX int8 tiles for prefill (amx.c), where the compiler targets them; -DSL_NO_AMX builds
 * without them (the tests compare both builds bit for bit). */
#if SL_AVX512_VNNI && defined(__AMX_TILE__) && defined(__AMX_INT8__) && !defined(SL_NO_AMX)
#define SL_AMX 1
#else
#define SL_AMX 0
#endif
/* Fewer activation rows (decode of small batches) stay on the VNNI tiles. A tile costs the same
 * for 1 or 16 rows (rows past M are zeros): from 8 rows it was 1.0-1.8x the VNNI tiles' speed
 * on the default model's shapes, at 6 0.8-1.6x, at 4 0.7-1.0x (ops/bench/amx_gemm.py). */
#ifndef SL_AMX_MIN_M
#define SL_AMX_MIN_M 8
#endif

/* Activation rows per weight pass: a weight block is unpacked once per MT rows. Eight with
 * AVX-512, whose 32 vector registers hold eight accumulators beside the unpacked block. */
#ifndef MT
#if SL_AVX512_VNNI
#define MT 8
#else
#define MT 4
#endif
#endif

/* The most rows one tile takes (tile_rows): MT, or on AVX2 without VNNI MT + 1. */
#if SL_AVX2 && !SL_VNNI && MT == 4
#define MT_MAX 5
#else
#define MT_MAX MT
#endif

/* F16C (vcvtph2ps / vcvtps2ph): every AVX2 CPU has it; a build without it converts in C. */
#if SL_AVX2 && defined(__F16C__)
#define SL_F16C 1
#else
#define SL_F16C 0
#endif

/* ---- IEEE half precision (the KV cache's element) ------------------------------------------ */

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Exact: every half is a float. */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F;
    uint32_t man = h & 0x3FF;
    if (exp == 0x1F) return bits_f32(sign | 0x7F800000 | man << 13); /* inf, nan */
    if (exp) return bits_f32(sign | (exp + 112) << 23 | man << 13);
    if (!man) return bits_f32(sign);
    uint32_t e = 113; /* a subnormal: shift its leading one into the implicit bit */
    while (!(man & 0x400)) {
        man <<= 1;
        e--;
    }
    return bits_f32(sign | e << 23 | (man & 0x3FF) << 13);
}

/* Round to nearest, ties to even, as vcvtps2ph does (F. Giesen's float_to_half_fast3_rtne):
 * the scalar build writes the same cache bits as the vector builds. */
static inline uint16_t float_to_half(float f) {
    uint32_t u = f32_bits(f);
    const uint32_t sign = u & 0x80000000u;
    u ^= sign;
    uint16_t h;
    if (u >= (127u + 16) << 23) { /* at least 2^16: inf, or nan */
        h = u > 255u << 23 ? 0x7E00 : 0x7C00;
    } else if (u < 113u << 23) { /* below 2^-14: a subnormal or zero; the FPU's add rounds */
        const float magic = bits_f32(((127u - 15) + (23 - 10) + 1) << 23);
        h = (uint16_t)(f32_bits(bits_f32(u) + magic) - f32_bits(magic));
    } else {
        const uint32_t odd = (u >> 13) & 1;
        u += ((uint32_t)(15 - 127) << 23) + 0xFFF + odd;
        h = (uint16_t)(u >> 13);
    }
    return (uint16_t)(h | sign >> 16);
}

/* Weight scales and minimums: floats, or halves where they come from a GGUF's own f16 fields
 * (SL_H16): half the bytes, the same values, and one stream's decode reads them every token. */
static inline const void *scales_at(const void *p, int64_t i, const int half) {
    return (const char *)p + i * (half ? 2 : 4);
}

static inline float scale_at(const void *p, int64_t i, const int half) {
    return half ? half_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

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

/* An empty asm that "modifies" v: the compiler must have v in a register here, as computed so
 * far. In a tile's inner loop it keeps each accumulator a running sum: otherwise GCC regroups
 * the integer adds (they are associative) into a tree of partial sums that needs more than
 * AVX2's 16 vector registers, and spills. */
#define SL_KEEP(v) __asm__("" : "+x"(v))

/* The same for a vector loaded once and used by several FMAs (a key or a value that every
 * query of a group multiplies): GCC otherwise folds the load into each FMA as its memory
 * operand, so c queries load the same bytes c times, and on Zen 4 the loads, not the FMAs,
 * bound the loop. "v": any of AVX-512's 32 registers. */
#define SL_IN_REG(v) __asm__("" : "+v"(v))

/* four activation bytes at x in every 32-bit lane: what the interleaved tiles multiply eight
 * weight rows by at once */
static inline __m256i bcast4(const int8_t *x) {
    int32_t v;
    memcpy(&v, x, 4);
    return _mm256_set1_epi32(v);
}

#if SL_AVX512_VNNI
/* one 512-bit vector from two 256-bit ones, a in the low half: the 16-row tiles' two groups */
static inline __m512i join256(__m256i a, __m256i b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}
static inline __m512 join_ps(__m256 a, __m256 b) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1);
}
#endif
/* eight halves as floats */
static inline __m256 load_half8(const uint16_t *p) {
#if SL_F16C
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    return _mm256_setr_ps(half_to_float(p[0]), half_to_float(p[1]), half_to_float(p[2]),
                          half_to_float(p[3]), half_to_float(p[4]), half_to_float(p[5]),
                          half_to_float(p[6]), half_to_float(p[7]));
#endif
}

/* scales i..i+7 (see scales_at) */
static inline __m256 load_scales8(const void *p, int64_t i, const int half) {
    return half ? load_half8((const uint16_t *)p + i) : _mm256_loadu_ps((const float *)p + i);
}

/* [hsum(a), hsum(b), hsum(c), hsum(d)] */
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
#endif

/* Stages shared between the files: each holds an orphaned `omp for`, so called inside a parallel
 * region (sl_forward) it shares that region's threads and ends on its barrier. Hidden: only the
 * sl_* entry points are exported. */
#define SL_INTERNAL __attribute__((visibility("hidden")))
SL_INTERNAL void quantize_body(const float *x, int64_t M, int64_t K, int8_t *xq, float *xd,
                               float *xs);
SL_INTERNAL void rmsnorm_quantize_body(const float *x, const float *w, float eps, int64_t M,
                                       int64_t K, int8_t *xq, float *xd, float *xs, float *tmp);
SL_INTERNAL void swiglu_quantize_body(const float *gu, int64_t M, int64_t I, int8_t *xq, float *xd,
                                      float *xs, float *tmp);
/* half: the scales and minimums are IEEE halves (SL_H16) */
SL_INTERNAL void gemm_q4_1_body(int64_t M, int64_t N, int64_t K, const int8_t *xq, const float *xd,
                                const float *xs, const uint8_t *wq, const void *wd, const void *wm,
                                int half, const float *bias, float *y, int accumulate);
/* Q5_M: the Q4 layout with the values' fifth bits (matmul.c documents it) */
SL_INTERNAL void gemm_q5_body(int64_t M, int64_t N, int64_t K, const int8_t *xq, const float *xd,
                              const float *xs, const uint8_t *wq, const void *wd, const void *wm,
                              int half, const float *bias, float *y, int accumulate);
/* int8 weights (q8.c): scales per 32 values, or per 16 (sub16); optional minimums per 32 */
SL_INTERNAL void gemm_q8_body(int64_t M, int64_t N, int64_t K, const int8_t *xq, const float *xd,
                              const float *xs, const int8_t *wq, const float *wd, const float *wm,
                              int sub16, const float *bias, float *y, int accumulate);
/* the same, eight rows interleaved (SL_X8: q8.c documents the layout) */
SL_INTERNAL void gemm_q8x8_body(int64_t M, int64_t N, int64_t K, const int8_t *xq, const float *xd,
                                const float *xs, const int8_t *wq, const void *wd, const void *wm,
                                int sub16, int half, const float *bias, float *y, int accumulate);
/* 1 when amx.c's GEMMs can run: built with AMX and the kernel granted the tile state */
SL_INTERNAL int amx_usable(void);
/* The eight-row interleaved GEMMs on AMX tiles (amx.c documents them): run when the call has
 * at least SL_AMX_MIN_M rows and the tiles are usable; 1 when they ran, 0 when the caller's own
 * tiles must. A build without AMX has nothing to call (nor to link, even at -O0). */
enum { AMX_Q4, AMX_Q5, AMX_Q8, AMX_Q8_16 };
#if SL_AMX
SL_INTERNAL int gemm_on_amx(int kind, int64_t M, int64_t N, int64_t K, const int8_t *xq,
                            const float *xd, const float *xs, const void *wq, const void *wd,
                            const void *wm, int half, const float *bias, float *y, int accumulate);
#else
#define gemm_on_amx(...) 0
#endif

/* One kv head of one sequence in a layer's paged cache: the block ids in the sequence's table,
 * the halves per block (all kv heads), where this head's keys sit in a block, the block size. */
typedef struct {
    const int32_t *table;
    int64_t block_stride, head, size; /* halves from one block to the next; the kv head's base */
} pages;

/* One query of a task: its rotated q (hd floats), its output o, its softmax row p (S floats) and
 * S, the keys it attends to (positions 0..S-1 of its sequence). */
typedef struct {
    const float *q;
    float *o, *p;
    int64_t S;
} query;

/* nq queries over one kv head of one sequence (attend.c); kf, vf: block size x hd floats each of
 * scratch */
SL_INTERNAL void attend(query *qs, int64_t nq, const uint16_t *kc, const uint16_t *vc,
                        const pages *pg, int64_t hd, float scale, float *kf, float *vf);
/* attention over the paged KV cache, decode and prefill rows alike (attention.c documents the
 * arguments) */
SL_INTERNAL void attention_body(int64_t n, int64_t H, int64_t KV, int64_t hd, float *qkv,
                                const float *cos_table, const float *sin_table, const int64_t *pos,
                                const int64_t *seq, const int32_t *tables, int64_t table_stride,
                                int64_t block_size, int64_t num_blocks, uint16_t *kc, uint16_t *vc,
                                const float *q_norm, const float *k_norm, float eps, float *out,
                                int64_t span);
/* y (+)= x W^T (+ bias) for any format: the GEMM its type names */
SL_INTERNAL void linear_body(const sl_linear *l, int64_t M, const int8_t *xq, const float *xd,
                             const float *xs, float *y, int accumulate);

static inline void store(float *y, float v, const float *bias, int64_t n, int accumulate) {
    if (bias) v += bias[n];
    if (accumulate) v += *y;
    *y = v;
}

/* case n: fn(n, ...). The dispatchers call an always_inline kernel with a literal row (or
 * query) count: with the literal the compiler keeps the kernel's accumulators in registers. */
#define SL_CASE(fn, n, ...)                                                                        \
    case n:                                                                                        \
        fn(n, __VA_ARGS__);                                                                        \
        break;
/* the cases every dispatcher ends with: 4, 3, 2, and 1 for anything else */
#define SL_CASES_4_TO_1(fn, ...)                                                                   \
    SL_CASE(fn, 4, __VA_ARGS__)                                                                    \
    SL_CASE(fn, 3, __VA_ARGS__)                                                                    \
    SL_CASE(fn, 2, __VA_ARGS__)                                                                    \
    default:                                                                                       \
        fn(1, __VA_ARGS__);                                                                        \
        break;

/* A tile function called with a literal row count mt (1..MT_MAX). The cases above MT_MAX are
 * left out, not just never taken: GCC would otherwise inline them and warn about acc[MT_MAX]
 * indexed past its end. */
#if MT_MAX > 5
#define SL_TILE_CASES_5_TO_8(fn, ...)                                                              \
    SL_CASE(fn, 8, __VA_ARGS__)                                                                    \
    SL_CASE(fn, 7, __VA_ARGS__)                                                                    \
    SL_CASE(fn, 6, __VA_ARGS__)                                                                    \
    SL_CASE(fn, 5, __VA_ARGS__)
#elif MT_MAX == 5
#define SL_TILE_CASES_5_TO_8(fn, ...) SL_CASE(fn, 5, __VA_ARGS__)
#else
#define SL_TILE_CASES_5_TO_8(fn, ...)
#endif
#define DISPATCH_TILE(fn, mt, ...)                                                                 \
    switch (mt) {                                                                                  \
        SL_TILE_CASES_5_TO_8(fn, __VA_ARGS__)                                                      \
        SL_CASES_4_TO_1(fn, __VA_ARGS__)                                                           \
    }

/* Activation rows in the tile of the interleaved GEMMs (matmul.c, q8.c) that starts at row m0 of
 * M: MT, or what is left, except that on AVX2 without VNNI five rows left go in one tile. There a
 * tile of one row after one of four unpacks every weight block again and, its accumulator chain
 * alone in the loop, waits on its latency: one thread's Q4_1 GEMM of 3,072 x 576 took 122 us for
 * 5 rows against 86 for 4, and with one tile of five 104 (9 rows: 207 against 190). Five rows are
 * a four-stream step with one draft row, or one stream's step with four. Each row's sums are
 * the same arithmetic in either tile: the same bits. */
static inline int tile_rows(int64_t M, int64_t m0) {
    const int64_t left = M - m0;
    if (left == MT_MAX) return MT_MAX;
    return left < MT ? (int)left : MT;
}

/* Weight groups (eight interleaved rows each) per tile of the interleaved GEMMs (matmul.c, q8.c):
 * two, on 512-bit vectors, past sl_narrow_rows activation rows (sl_set_narrow_rows). One row
 * reads each weight once either way, and memory bounds it: there the 8-row tile measured faster.
 * How many more rows it stays faster for depends on the CPU: on a Cascade Lake Xeon, whose
 * 512-bit units are whole, the 16-row tile ran four to eight rows' steps 1.14-1.33x as fast; on a
 * Zen 4 EPYC, which runs a 512-bit instruction as two 256-bit halves, the 8-row tile won up to
 * 7-14 rows (two to five rows' forwards 13-22 % faster), while prompt chunks still gained from
 * the 16-row tile. So it is measured at load (tiles.py). The bits are the same either way. */
SL_INTERNAL extern int sl_narrow_rows;
static inline int64_t x8_span(int64_t M) { return SL_AVX512_VNNI && M > sl_narrow_rows ? 2 : 1; }

/* static asserts: the ABI's sizes (mirrored by ctypes, checked again at load through sl_sizeof) */
_Static_assert(sizeof(sl_block_q4_0) == 2 + QK / 2, "block_q4_0 is 18 bytes");
_Static_assert(sizeof(sl_block_q4_1) == 4 + QK / 2, "block_q4_1 is 20 bytes");
_Static_assert(sizeof(sl_block_q8_0) == 2 + QK, "block_q8_0 is 34 bytes");
_Static_assert(sizeof(sl_block_q5_0) == 22, "block_q5_0 is 22 bytes");
_Static_assert(sizeof(sl_block_q5_1) == 24, "block_q5_1 is 24 bytes");
_Static_assert(sizeof(sl_block_q4_K) == 144, "block_q4_K is 144 bytes");
_Static_assert(sizeof(sl_block_q5_K) == 176, "block_q5_K is 176 bytes");
_Static_assert(sizeof(sl_block_q6_K) == 210, "block_q6_K is 210 bytes");
_Static_assert(sizeof(sl_linear) == 4 * sizeof(void *) + 3 * 8, "sl_linear: 4 pointers, 3 int64");
_Static_assert(sizeof(sl_scratch) == 7 * sizeof(void *), "sl_scratch: 7 pointers");

#endif
