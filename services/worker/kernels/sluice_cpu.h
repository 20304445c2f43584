/* sluice CPU kernels: quantized matmuls and the fused pieces of a decode step.
 *
 * Why this exists: on a CPU, one decode step of a small model is a few megabytes of weights and
 * about 1,500 tiny torch ops; the ops' dispatch costs more than the arithmetic. These kernels
 * work straight from 4- and 8-bit blocks (the GGUF Q4_1 / Q8_0 formats, re-laid out) with
 * activations quantized to 8 bits per block of 32, as llama.cpp does, fuse the glue (RMSNorm +
 * quantize, SwiGLU + quantize, RoPE + KV write + attention), and run a whole forward step
 * (sl_forward: decode or a prefill chunk) as one call with one OpenMP parallel region.
 *
 * Layouts (row-major, QK = 32 values per block, nb = K / QK blocks per row):
 *   activations  xq int8 [M, K], xd float [M, nb] (scale), xs float [M, nb] (scale * sum of q)
 *   Q4_1 weight  eight rows interleaved (N % 8 == 0): wq uint8 [N/8, nb, 128], wd and wm float
 *                [N/8, nb, 8] (scale, minimum): w = wd * q + wm; see gemm_q4_1_body
 *   Q4_0 weight  as Q4_1 without the minimums: w = wd * (q - 8)
 *   Q8_0 weight  wq int8 [N, nb, 32], wd float [N, nb]: w = wd * q
 *   Q8_M weight  Q8_0 plus wm float [N, nb]: w = wd * q + wm, q in 0..31: Q5_0 (wm = -16 wd),
 *                Q5_1, Q5_K where N % 8 != 0 (else Q5_M)
 *   Q8_16 weight wq int8 [N, nb, 32], wd float [N, 2 nb]: one scale per 16 values (Q6_K)
 *   Q5_M weight  Q8_M's values (0..31) packed as Q4_1 (eight rows interleaved) plus a plane of
 *                their fifth bits: wq uint8 [N/8, nb, 160], wd and wm float [N/8, nb, 8]; the
 *                5-bit types' layout wherever N % 8 == 0 (matmul.c documents the bytes); wm
 *                NULL: Q5_0's minimums, -16 wd, implied as Q4_0's -8 wd are
 *   KV cache     one layer: [kv_heads, num_blocks, block_size, head_dim] IEEE halves (uint16),
 *                paged: a sequence's block table (int32 block ids) lists its blocks in position
 *                order, so its key and value at position p live in block table[p / block_size]
 *                at offset p % block_size. Heads outermost: a kv head's keys in consecutive
 *                blocks are one contiguous run, which decode streams through as it did one
 *                slot's (with the head inside each block, a 3,500-token decode step ran 2x
 *                slower: 2 KB runs 6 KB apart defeat the prefetchers). Halves,
 *                as llama.cpp keeps them: one stream's decode reads every cached key and value
 *                once a token, at a few hundred tokens a tenth of the bytes the weights take.
 *                Blocks let sequences of any length share one pool and share a common prefix
 *                (two tables naming the same blocks). block_size is a multiple of 8: attention
 *                then reads keys in the same groups as over a contiguous run, the same bits
 *                whatever the blocks (attention.c)
 *   token rows   a forward's n rows are ragged: row r is the token at position pos[r] of
 *                sequence seq[r], whose table is tables + seq[r] * table_stride; a decode row
 *                and a prefill chunk's rows sit side by side in one call
 *
 * Threads: every entry point takes nthreads and uses OpenMP, the same libgomp torch loaded, so
 * the two share one thread pool instead of fighting over the cores.
 *
 * Instruction sets, chosen at build time from the compiler's target (-march=native): AVX-512
 * VNNI (vpdpbusd: four byte products summed into int32 in one instruction), else AVX2 + FMA,
 * else the generic scalar loops, which are the reference the tests compare every variant to.
 * Each SIMD variant sits beside the generic code it replaces and computes the same results.
 * With AVX-512 VNNI, where the compiler also targets AMX int8 tiles (Sapphire Rapids and later)
 * and the OS grants the tile state at load, GEMMs of 8 or more activation rows (prefill,
 * batched decode) run on the tiles (amx.c), bit-identical to the VNNI tiles; -DSL_NO_AMX leaves
 * them out.
 *
 * Files: sluice_cpu.h (this: the ABI: every exported function and struct), sl_impl.h (vector
 * helpers, the stages shared between files), quantize.c (activation quantization), matmul.c
 * (the 4- and 5-bit GEMMs), q8.c (the int8 GEMMs), amx.c (both on AMX tiles, for prefill),
 * attention.c (attention), forward.c (the whole step).
 */
#ifndef SLUICE_CPU_H
#define SLUICE_CPU_H

#include <stdint.h>

#define QK 32 /* values per quantization block */

/* Weight formats: the first three numbered as ggml numbers its types (GGML_TYPE_*), the others
 * sluice's own int8 layouts that hold the 5- and 6-bit GGUF types exactly. */
enum {
    SL_Q4_0 = 2,
    SL_Q4_1 = 3,
    SL_Q8_0 = 8,
    SL_Q8_M = 64,  /* values 0..31, a scale and a minimum per 32: Q5_0, Q5_1, Q5_K */
    SL_Q8_16 = 65, /* int8 values, a scale per 16: Q6_K */
    SL_Q5_M = 66,  /* Q8_M's values in five bits, eight rows interleaved (N % 8 == 0) */
    SL_X8 = 256,   /* flag on the Q8 formats: eight rows interleaved (N % 8 == 0; see q8.c) */
    SL_H16 = 512,  /* flag: the scales and minimums are IEEE halves (Q4_0, Q4_1, Q5_M, Q8_0 | X8) */
};

/* The GGUF blocks the formats come from (ggml's block_q4_0 etc.; d and m are IEEE halves). The
 * loader packs them into the layouts above; their sizes are part of the ABI (sl_sizeof). */
typedef struct {
    uint16_t d;
    uint8_t qs[QK / 2]; /* value i in the low nibble of byte i, value 16 + i in its high nibble */
} sl_block_q4_0;

typedef struct {
    uint16_t d, m;
    uint8_t qs[QK / 2];
} sl_block_q4_1;

typedef struct {
    uint16_t d;
    int8_t qs[QK];
} sl_block_q8_0;

typedef struct {
    uint16_t d;
    uint8_t qh[4]; /* bit i: the fifth bit of value i */
    uint8_t qs[QK / 2];
} sl_block_q5_0; /* w = d (q - 16) */

typedef struct {
    uint16_t d, m;
    uint8_t qh[4];
    uint8_t qs[QK / 2];
} sl_block_q5_1; /* w = d q + m */

/* 256 values: eight 32-value sub-blocks w = (d sc) q - (dmin m), sc and m 6-bit in scales[],
 * so each sub-block is a Q4_1 block with fp32 scale and minimum: the loader packs it so. */
typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qs[128]; /* per 64 values: 32 bytes, the first 32 in low nibbles, the next in high */
} sl_block_q4_K;

typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12]; /* as Q4_K */
    uint8_t
        qh[32]; /* bit 2c (2c + 1) of byte l: the fifth bit of value l of sub-block 2c (2c + 1) */
    uint8_t qs[128]; /* as Q4_K */
} sl_block_q5_K;

/* 256 values w = d sc (q - 32), q 6-bit, one int8 scale sc per 16 values: int8 values q - 32 with
 * fp32 scales d sc per 16, i.e. Q8_16, exactly. */
typedef struct {
    uint8_t ql[128]; /* low four bits */
    uint8_t qh[64];  /* high two bits */
    int8_t scales[16];
    uint16_t d;
} sl_block_q6_K;

/* These structs are mirrored field by field by the ctypes Structures in abi.py (Linear,
 * Layer, Model, Scratch): change both together. */

/* A packed linear: weights, scales, minimums (Q4_1 only), optional bias, its format (SL_*, with
 * the X8 and H16 flags): scales and minimums are floats, or IEEE halves under SL_H16. */
typedef struct {
    const void *q, *d, *m;
    const float *bias;
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

/* Per-step buffers, sized for a forward's n token rows by the caller. */
typedef struct {
    int8_t *xq; /* n x max(hidden, inner, heads * head_dim) */
    float *xd, *xs, *tmp;
    float *qkv, *attended, *gate_up;
} sl_scratch;

/* ---- exported functions ------------------------------------------------------------------ */

/* What the build vectorizes with: 0 scalar, 1 AVX2 + FMA, 2 AVX-512 (VNNI where present). */
int sl_vectorized(void);
/* "avx512vnni", "avx512", "avx2" or "scalar". */
const char *sl_isa(void);
/* The interleaved GEMMs take 8 weight rows per tile up to this many activation rows and 16 (on
 * 512-bit vectors) past it; at least 1, the default. Only speed differs, never the bits. Set
 * once, before the GEMMs run (the loader measures it: tiles.py). */
void sl_set_narrow_rows(int rows);
/* sizeof the struct of that name ("sl_linear", "sl_block_q4_0", ...), -1 for an unknown name. */
int64_t sl_sizeof(const char *name);

/* Activations: rows of x (M, K) -> int8 blocks xq, scales xd, scaled sums xs. */
void sl_quantize(const float *x, int64_t M, int64_t K, int8_t *xq, float *xd, float *xs,
                 int nthreads);
void sl_rmsnorm_quantize(const float *x, const float *w, float eps, int64_t M, int64_t K,
                         int8_t *xq, float *xd, float *xs, float *tmp, int nthreads);
void sl_swiglu_quantize(const float *gu, int64_t M, int64_t I, int8_t *xq, float *xd, float *xs,
                        float *tmp, int nthreads);

/* y[m, n] (+)= sum_k x[m, k] w[n, k] (+ bias[n]), per format, and for any sl_linear (its type
 * picks the GEMM). */
void sl_gemm_q4_1(int64_t M, int64_t N, int64_t K, const int8_t *xq, const float *xd,
                  const float *xs, const uint8_t *wq, const float *wd, const float *wm,
                  const float *bias, float *y, int accumulate, int nthreads);
void sl_gemm_q4_0(int64_t M, int64_t N, int64_t K, const int8_t *xq, const float *xd,
                  const float *xs, const uint8_t *wq, const float *wd, const float *bias, float *y,
                  int accumulate, int nthreads);
void sl_gemm_q8_0(int64_t M, int64_t N, int64_t K, const int8_t *xq, const float *xd,
                  const int8_t *wq, const float *wd, const float *bias, float *y, int accumulate,
                  int nthreads);
void sl_linear_forward(const sl_linear *l, int64_t M, const int8_t *xq, const float *xd,
                       const float *xs, float *y, int accumulate, int nthreads);

/* Attention over one layer of the paged KV cache for n ragged token rows (layouts above; the
 * arguments: attention.c), and a whole forward step over them (forward.c). span: more than the
 * largest position (it sizes each thread's scratch, which the kernels keep between calls).
 * sl_forward's kc and vc point at layer 0, layer i i * num_blocks * kv_heads * block_size *
 * head_dim halves on; its logits are [n_logits, vocab], row j for token row logit_rows[j]
 * (ascending). One code path for decode and prefill: a token's logits do not depend on the path,
 * the batch, the chunk or the blocks that computed it. */
void sl_attention(int64_t n, int64_t H, int64_t KV, int64_t hd, float *qkv, const float *cos_table,
                  const float *sin_table, const int64_t *pos, const int64_t *seq,
                  const int32_t *tables, int64_t table_stride, int64_t block_size,
                  int64_t num_blocks, uint16_t *kc, uint16_t *vc, const float *q_norm,
                  const float *k_norm, float eps, float *out, int64_t span, int nthreads);
void sl_forward(const sl_model *m, int64_t n, float *x, const int64_t *pos, const int64_t *seq,
                const int32_t *tables, int64_t table_stride, int64_t block_size, uint16_t *kc,
                uint16_t *vc, int64_t num_blocks, int64_t span, const sl_scratch *w, float *logits,
                const int64_t *logit_rows, int64_t n_logits, int nthreads);

#endif
