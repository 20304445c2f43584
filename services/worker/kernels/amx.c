/* Prefill GEMMs on AMX int8 tiles (Sapphire Rapids and later), for the eight-row interleaved
 * layouts: Q4 (matmul.c: Q4_0, Q4_1, and Q4_K re-laid out as Q4_1), Q5_M (the same with the
 * fifth bits added while unpacking) and int8 (q8.c: Q8_0, Q8_M, Q8_16). One TDPBSSD multiplies 16
 * activation rows by 16 weight rows over one block of 32 values and replaces 32 vpdpbusd plus their
 * broadcasts. Every block has its own scales, so its int32 results leave the tile (a tile store)
 * before the next block: those stores, not the float scaling, bound the speed (docs/benchmarks.md,
 * "AMX prefill GEMMs").
 *
 * Bit-identical to the AVX-512 VNNI tiles: the int32 dot of a block is exact on both paths, and
 * each output then goes through the same float operations in the same block order (the
 * VNNI tiles' comments: acc = fma(wd * xd, dot, acc), then fma(wm, xs, acc)), so a token's
 * logits do not depend on whether its rows took this path (M >= SL_AMX_MIN_M) or the VNNI one.
 *
 * The tiles, and why the weights are the B side: the interleaved layouts already are the VNNI
 * B-tile layout of eight columns (byte 4r + i of vector j: row r, value 4j + i), so a B tile of
 * two groups (16 weight rows) is eight 64-byte rows, each two 32-byte vectors side by side, and
 * the activations load straight from xq as the A tile (16 rows of 32 bytes, stride K): no copy
 * of them. Weight values are 0..15, 0..31 or int8, activations int8: TDPBSSD (signed x signed)
 * fits all. C[t][n] is then row t's 16 outputs, contiguous in y. */
#define _GNU_SOURCE /* syscall(), which -std=c11 hides */
#include "sl_impl.h"

#if SL_AMX
#include <sys/syscall.h>
#include <unistd.h>

/* Linux gives a process the 8 KiB of tile state only on request (arch_prctl); refused (an old
 * kernel, a hypervisor hiding it), the GEMMs keep to the VNNI tiles. Asked once, at load. */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA  18
static int amx_granted;

__attribute__((constructor)) static void amx_request(void) {
    amx_granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

int amx_usable(void) { return amx_granted; }

/* Tile registers: 0, 1 int32 results (16 x 16 each). Q4 and int8: 2, 3 activations (16 rows x
 * 32 bytes) and weights (8 k-quads x 16 rows x 4 bytes) of an even block, 4, 5 of the odd one
 * (two blocks in flight: one's scaling overlaps the next one's tile product). Q8_16, whose
 * halves have a scale each: 0, 1 an even block's results for values 0..15 and 16..31, 2, 3 the
 * odd block's; 4, 5 values 0..15 (A 16 x 16 bytes, B 4 x 64), 6, 7 values 16..31. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void configure(const int sub16) {
    static const uint8_t rows[2][8] = {{16, 16, 16, 8, 16, 8}, {16, 16, 16, 16, 16, 4, 16, 4}};
    static const uint16_t colsb[2][8] = {{64, 64, 32, 64, 32, 64},
                                         {64, 64, 64, 64, 16, 64, 16, 64}};
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) c.rows[i] = rows[sub16][i], c.colsb[i] = colsb[sub16][i];
    _tile_loadconfig(&c);
}

/* A thread's buffers, kept between calls (OpenMP threads persist) and grown on demand. */
static __thread uint8_t *scratch_at;
static __thread size_t scratch_size;

static uint8_t *scratch(size_t bytes) {
    if (bytes > scratch_size) {
        free(scratch_at);
        scratch_size = (bytes + 4095) & ~(size_t)4095;
        scratch_at = aligned_alloc(64, scratch_size);
        if (!scratch_at) scratch_size = 0;
    }
    return scratch_at;
}

/* Two groups' blocks as B tiles (512 bytes a block) with their scales and minimums as 16 lanes
 * (Q8_16: scales of values 0..15, then of 16..31). wm NULL: Q8 without minimums, or Q4_0 and
 * Q5_0, whose minimums are -8 wd and -16 wd, computed as the VNNI tile does. */
static void unpack_pair(const int kind, const int half, int64_t nb, const uint8_t *w0,
                        const uint8_t *w1, const void *d0, const void *d1, const void *m0,
                        const void *m1, uint8_t *tiles, float *dv, float *mv) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *tb = tiles + b * 512;
        if (kind == AMX_Q4 || kind == AMX_Q5) {
            const int64_t wb = kind == AMX_Q5 ? 160 : 128;
            for (int j = 0; j < 4; j++) {
                const __m256i lo = _mm256_loadu_si256((const __m256i *)(w0 + b * wb + 32 * j));
                const __m256i hi = w1 ? _mm256_loadu_si256((const __m256i *)(w1 + b * wb + 32 * j))
                                      : _mm256_setzero_si256();
                const __m512i raw = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
                __m512i v[2] = {_mm512_and_si512(raw, low),
                                _mm512_and_si512(_mm512_srli_epi16(raw, 4), low)};
                if (kind == AMX_Q5) /* + 16 where the fifth bit is set: word j, then 4 + j */
                    for (int h = 0; h < 2; h++) {
                        uint32_t bits0, bits1 = 0;
                        memcpy(&bits0, w0 + b * wb + 128 + 4 * (4 * h + j), 4);
                        if (w1) memcpy(&bits1, w1 + b * wb + 128 + 4 * (4 * h + j), 4);
                        const __mmask64 k = _cvtu64_mask64(bits0 | (uint64_t)bits1 << 32);
                        v[h] = _mm512_mask_add_epi8(v[h], k, v[h], _mm512_set1_epi8(0x10));
                    }
                _mm512_store_si512(tb + 64 * j, v[0]);
                _mm512_store_si512(tb + 64 * (4 + j), v[1]);
            }
        } else {
            for (int j = 0; j < 8; j++) {
                const __m256i lo = _mm256_loadu_si256((const __m256i *)(w0 + b * 256 + 32 * j));
                const __m256i hi = w1 ? _mm256_loadu_si256((const __m256i *)(w1 + b * 256 + 32 * j))
                                      : _mm256_setzero_si256();
                _mm512_store_si512(tb + 64 * j,
                                   _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
            }
        }
        const int per = kind == AMX_Q8_16 ? 16 : 8;
        for (int h = 0; h < per / 8; h++) {
            const __m256 a = load_scales8(d0, b * per + 8 * h, half);
            const __m256 c = d1 ? load_scales8(d1, b * per + 8 * h, half) : _mm256_setzero_ps();
            _mm512_store_ps(dv + (b * per / 8 + h) * 16,
                            _mm512_insertf32x8(_mm512_castps256_ps512(a), c, 1));
        }
        if ((kind == AMX_Q4 || kind == AMX_Q5) && !m0) { /* Q4_0, Q5_0: -8 d, -16 d */
            const __m512 d = _mm512_load_ps(dv + b * 16);
            const float by = kind == AMX_Q5 ? -16.0f : -8.0f;
            _mm512_store_ps(mv + b * 16, _mm512_mul_ps(d, _mm512_set1_ps(by)));
        } else if (m0) {
            const __m256 a = load_scales8(m0, b * 8, half);
            const __m256 c = m1 ? load_scales8(m1, b * 8, half) : _mm256_setzero_ps();
            _mm512_store_ps(mv + b * 16, _mm512_insertf32x8(_mm512_castps256_ps512(a), c, 1));
        }
    }
}

/* Row t's term of one block into acc[t], the VNNI tiles' operations in their order. */
static inline __attribute__((always_inline)) void
scale_block(const int sub16, const int has_m, int64_t b, const float *xt, const float *dv,
            const float *mv, int32_t (*dots)[16][16], __m512 *acc) {
    const float *xd = xt + b * 32, *xs = xd + 16;
    if (sub16) {
        const __m512 d0 = _mm512_load_ps(dv + b * 32), d1 = _mm512_load_ps(dv + b * 32 + 16);
        for (int t = 0; t < 16; t++) {
            const __m512 xv = _mm512_set1_ps(xd[t]);
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_load_si512(dots[0][t]));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_load_si512(dots[1][t]));
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d0, xv), lo, acc[t]);
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d1, xv), hi, acc[t]);
        }
        return;
    }
    const __m512 d = _mm512_load_ps(dv + b * 16);
    const __m512 m = has_m ? _mm512_load_ps(mv + b * 16) : _mm512_setzero_ps();
    for (int t = 0; t < 16; t++) {
        const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(xd[t]));
        acc[t] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(_mm512_load_si512(dots[0][t])), acc[t]);
        if (has_m) acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[t]), acc[t]);
    }
}

/* 16 activation rows (x: stride K; xt: their scales and sums, [nb][2][16]) times the 16
 * unpacked weight rows, all blocks: acc[t] = row t's 16 sums. sub16: Q8_16's two scales a
 * block; has_m: add the minimums' term. */
static inline __attribute__((always_inline)) void
amx_tile(const int sub16, const int has_m, int64_t nb, int64_t K, const int8_t *x, const float *xt,
         const uint8_t *tiles, const float *dv, const float *mv, __m512 *acc) {
    int32_t dots[2][2][16][16] __attribute__((aligned(64)));
    for (int t = 0; t < 16; t++) acc[t] = _mm512_setzero_ps();
    if (sub16) { /* pipelined as below, two result tiles per block */
#define SL_ISSUE16(lo, hi, blk)                                                                    \
    do {                                                                                           \
        _tile_zero(lo);                                                                            \
        _tile_zero(hi);                                                                            \
        _tile_loadd(4, x + (blk)*QK, K);                                                           \
        _tile_loadd(5, tiles + (blk)*512, 64);                                                     \
        _tile_loadd(6, x + (blk)*QK + 16, K);                                                      \
        _tile_loadd(7, tiles + (blk)*512 + 256, 64);                                               \
        _tile_dpbssd(lo, 4, 5);                                                                    \
        _tile_dpbssd(hi, 6, 7);                                                                    \
    } while (0)
        SL_ISSUE16(0, 1, 0);
        for (int64_t b = 0; b < nb; b += 2) {
            _tile_stored(0, dots[0][0], 64);
            _tile_stored(1, dots[0][1], 64);
            if (b + 1 < nb) SL_ISSUE16(2, 3, b + 1);
            scale_block(1, 0, b, xt, dv, mv, dots[0], acc);
            if (b + 1 >= nb) break;
            _tile_stored(2, dots[1][0], 64);
            _tile_stored(3, dots[1][1], 64);
            if (b + 2 < nb) SL_ISSUE16(0, 1, b + 2);
            scale_block(1, 0, b + 1, xt, dv, mv, dots[1], acc);
        }
#undef SL_ISSUE16
        return;
    }
    /* Software-pipelined: block b + 1's tile product is issued before block b is scaled, so
     * the product's latency (tens of cycles) hides behind the scaling. Even blocks use tiles 0,
     * 2, 3, odd ones 1, 4, 5 (literal tile numbers: the instructions encode them). */
#define SL_ISSUE(c, a, w, blk)                                                                     \
    do {                                                                                           \
        _tile_zero(c);                                                                             \
        _tile_loadd(a, x + (blk)*QK, K);                                                           \
        _tile_loadd(w, tiles + (blk)*512, 64);                                                     \
        _tile_dpbssd(c, a, w);                                                                     \
    } while (0)
    SL_ISSUE(0, 2, 3, 0);
    for (int64_t b = 0; b < nb; b += 2) {
        _tile_stored(0, dots[0][0], 64);
        if (b + 1 < nb) SL_ISSUE(1, 4, 5, b + 1);
        scale_block(0, has_m, b, xt, dv, mv, dots[0], acc);
        if (b + 1 >= nb) break;
        _tile_stored(1, dots[1][0], 64);
        if (b + 2 < nb) SL_ISSUE(0, 2, 3, b + 2);
        scale_block(0, has_m, b + 1, xt, dv, mv, dots[1], acc);
    }
#undef SL_ISSUE
}

/* Once per call and thread: the activations' scales and sums transposed to [tile][nb][2][16]
 * (a row's value is then a broadcast at a constant offset; rows past M read zeros), and the
 * last partial row tile's values copied to 16 zero-padded rows (tiles load 16). */
static void prepare_rows(int64_t M, int64_t K, const int8_t *xq, const float *xd, const float *xs,
                         float *xt, int8_t *pad) {
    const int64_t nb = K / QK, tiles = (M + 15) / 16;
    for (int64_t i = 0; i < tiles; i++)
        for (int64_t b = 0; b < nb; b++)
            for (int t = 0; t < 16; t++) {
                const int64_t row = 16 * i + t;
                float *at = xt + (i * nb + b) * 32 + t;
                at[0] = row < M ? xd[row * nb + b] : 0.0f;
                at[16] = row < M && xs ? xs[row * nb + b] : 0.0f;
            }
    if (M % 16) {
        memset(pad, 0, 16 * (size_t)K);
        memcpy(pad, xq + (M - M % 16) * K, (size_t)(M % 16) * K);
    }
}

int gemm_on_amx(int kind, int64_t M, int64_t N, int64_t K, const int8_t *xq, const float *xd,
                const float *xs, const void *wq, const void *wd, const void *wm, int half,
                const float *bias, float *y, int accumulate) {
    if (M < SL_AMX_MIN_M || !amx_usable()) return 0; /* every thread alike: the same M */
    const int64_t nb = K / QK, groups = N / 8, row_tiles = (M + 15) / 16;
    const int64_t wblock = kind == AMX_Q4 ? 128 : kind == AMX_Q5 ? 160 : 256;
    const int64_t dper = kind == AMX_Q8_16 ? 16 : 8;
    /* per thread: the pair's tiles, scales and minimums; the rows' transposed scales and sums;
     * the padded last row tile */
    const size_t tiles_b = (size_t)nb * 512, dv_b = (size_t)nb * 32 * sizeof(float),
                 mv_b = (size_t)nb * 16 * sizeof(float),
                 xt_b = (size_t)(row_tiles * nb * 32) * sizeof(float), pad_b = 16 * (size_t)K;
    const int has_m = kind == AMX_Q4 || kind == AMX_Q5 || wm; /* implied for Q4_0 and Q5_0 */
    uint8_t *buf = NULL;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < (groups + 1) / 2; p++) {
        if (!buf) { /* this thread's first pair of the call */
            buf = scratch(tiles_b + dv_b + mv_b + xt_b + pad_b);
            if (!buf) abort(); /* well under a MiB: out of memory is not worth a fallback */
            configure(kind == AMX_Q8_16);
            prepare_rows(M, K, xq, xd, xs, (float *)(buf + tiles_b + dv_b + mv_b),
                         (int8_t *)(buf + tiles_b + dv_b + mv_b + xt_b));
        }
        uint8_t *tiles = buf;
        float *dv = (float *)(buf + tiles_b), *mv = (float *)(buf + tiles_b + dv_b);
        const float *xt = (const float *)(buf + tiles_b + dv_b + mv_b);
        const int8_t *pad = (const int8_t *)(buf + tiles_b + dv_b + mv_b + xt_b);
        const int64_t g0 = 2 * p;
        const int two = g0 + 1 < groups;
        const uint8_t *w = wq;
        unpack_pair(kind, half, nb, w + g0 * nb * wblock, two ? w + (g0 + 1) * nb * wblock : NULL,
                    scales_at(wd, g0 * nb * dper, half),
                    two ? scales_at(wd, (g0 + 1) * nb * dper, half) : NULL,
                    wm ? scales_at(wm, g0 * nb * 8, half) : NULL,
                    wm && two ? scales_at(wm, (g0 + 1) * nb * 8, half) : NULL, tiles, dv, mv);
        const __mmask16 cols = two ? 0xFFFF : 0x00FF;
        const int64_t n0 = g0 * 8;
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(cols, bias + n0) : _mm512_setzero_ps();
        for (int64_t i = 0; i < row_tiles; i++) {
            const int64_t m0 = 16 * i;
            const int rows = M - m0 < 16 ? (int)(M - m0) : 16;
            const int8_t *x = rows < 16 ? pad : xq + m0 * K;
            const float *xti = xt + i * nb * 32;
            __m512 acc[16];
            if (kind == AMX_Q8_16)
                amx_tile(1, 0, nb, K, x, xti, tiles, dv, mv, acc);
            else if (has_m)
                amx_tile(0, 1, nb, K, x, xti, tiles, dv, mv, acc);
            else
                amx_tile(0, 0, nb, K, x, xti, tiles, dv, mv, acc);
                /* store() lane by lane: + bias, then + y. Unrolled: acc stays in registers. */
#pragma GCC unroll 16
            for (int t = 0; t < 16; t++) {
                if (t >= rows) break;
                float *yr = y + (m0 + t) * N + n0;
                __m512 v = acc[t];
                if (bias) v = _mm512_add_ps(v, bv);
                if (accumulate) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(cols, yr));
                _mm512_mask_storeu_ps(yr, cols, v);
            }
        }
    }
    if (buf) _tile_release(); /* back to the init state: no 8 KiB to save on a switch */
    return 1;
}
#else
int amx_usable(void) { return 0; }
#endif
