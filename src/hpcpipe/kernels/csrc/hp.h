/* hpcpipe's CPU kernels: weight products for float32 / bfloat16 / float16 / q8_0 weights, the decoder's
 * elementwise steps, attention over a paged KV cache (decode rows and prompt chunks), and a whole decode stage as one call.
 *
 * Everything computes in float32, except q8_0 products where the CPU has AVX512-VNNI: they quantize the activations
 * to q8 blocks too and sum int8 x int8 products exactly in int32 (q8_vnni.c; hp_q8_int8_activations). A weight is stored as the model file has it, (out, in) row-major
 * (Hugging Face's nn.Linear layout): bf16 and f16 values are widened to float32 in registers, q8_0 is
 * GGUF's block format (32 int8 along `in` with one float16 scale per block, kept as two arrays).
 * The AVX-512 paths are compiled for that target and chosen at run time (hp_init); the portable
 * paths run everywhere and are what the AVX-512 ones are tested against.
 */
#ifndef HP_H
#define HP_H

#include <stdint.h>

/* the AVX-512 paths exist on x86-64 only; elsewhere the portable ones are all there is */
#if defined(__x86_64__)
#define HP_X86 1
#else
#define HP_X86 0
#endif

enum { HP_F32 = 0, HP_BF16 = 1, HP_F16 = 2, HP_Q8_0 = 3 };
enum { HP_RMSNORM = 0, HP_LAYERNORM = 1 };
enum { HP_SWIGLU = 0, HP_GELU = 1 };

typedef struct {
    int32_t fmt;              /* HP_F32 | HP_BF16 | HP_F16 | HP_Q8_0 */
    int32_t pad;
    int64_t rows;             /* outputs (N) */
    int64_t cols;             /* inputs (K); a multiple of 32 for q8_0 */
    const void *data;         /* N x K values (int8 for q8_0) */
    const uint16_t *scales;   /* q8_0: N x K/32 float16 scales, else NULL */
} hp_weight;

/* One decoder block of a stage, as hp_stage_forward runs it (pointers NULL where the kind has none). */
typedef struct {
    const float *norm1_w, *norm1_b;   /* before attention */
    hp_weight qkv;                    /* q | k | v rows: (H + 2 K) hd outputs */
    const float *qkv_b;
    const float *q_norm_w, *k_norm_w; /* per-head RMSNorm of q and k before RoPE (Qwen3), hd each */
    hp_weight o;
    const float *o_b;
    const float *norm2_w, *norm2_b;   /* before the MLP */
    hp_weight up;                     /* SwiGLU: gate | up rows (2 ff outputs); GELU: fc (ff outputs) */
    const float *up_b;
    hp_weight down;
    const float *down_b;
    float *cache;                     /* keys then values, paged: (2, n_kv, pages, page, hd) */
    int64_t window;                   /* > 0: a row attends to its sequence's last `window` positions only */
    /* the block's own KV block tables and pool size (a windowed block of a model mixing windowed and full
     * blocks keeps its keys in per-slot rings: hpcpipe.nn.core.kv_pages); NULL: the stage's */
    const int64_t *tables;
    int64_t pages;
} hp_block;

typedef struct {
    int64_t n_blocks, d, n_heads, n_kv, hd, ff, slots, seq_len;
    int32_t norm, act, rope, pad;     /* HP_RMSNORM | HP_LAYERNORM, HP_SWIGLU | HP_GELU, RoPE on (1) or off */
    float eps, qk_eps, scale, pad2;   /* norm epsilon, q/k-norm epsilon, 1 / sqrt(hd) */
    const float *cos, *sin;           /* (seq_len, hd / 2) RoPE tables */
    const hp_block *blocks;
    int64_t page, pages, max_pages;   /* positions per KV block, blocks in the pool, blocks a sequence may hold */
    const int64_t *tables;            /* (slots, max_pages): the pool block of each slot's block i */
    /* tensor parallelism: each block's two row-parallel partial sums (o's, down's: m x d floats) are summed in
     * place over the tp ranks by reduce(ctx, x, n) before the bias and the residual (nonzero: the stage stops);
     * NULL at tp = 1 */
    int (*reduce)(void *ctx, float *x, int64_t n);
    void *reduce_ctx;
} hp_stage;

int hp_init(void);                    /* 1 when the AVX-512 paths are in use */
void hp_use_portable(int on);         /* tests: force the portable paths */
/* q8_0 products: quantize the activations to q8 too and multiply int8 by int8 (on: the default) where the CPU
 * has AVX512-VNNI, or widen the weights and multiply float activations (off). Returns 1 when the int8 path runs. */
int hp_q8_int8_activations(int on);
int64_t hp_scratch_floats(const hp_stage *s, int64_t n_rows);

/* y[m, n] (+)= sum_k x[m, k] W[n, k]; x rows ldx apart, y rows ldy apart */
void hp_matmul(const hp_weight *w, const float *x, int64_t m, int64_t ldx, float *y, int64_t ldy, int accumulate);
/* the same for many rows through a widened float32 panel of W (gemm.c); -1 when it cannot run here */
int hp_gemm(const hp_weight *w, const float *x, int64_t m, int64_t ldx, float *y, int64_t ldy, int accumulate);
void hp_set_gemm_rows(int64_t rows);  /* hp_matmul takes hp_gemm from this many rows of x (tests: 1) */
void hp_rmsnorm(const float *x, const float *w, float *y, int64_t m, int64_t d, float eps);
void hp_layernorm(const float *x, const float *w, const float *b, float *y, int64_t m, int64_t d, float eps);
void hp_rope(float *x, int64_t m, int64_t heads, int64_t hd, int64_t stride, const float *cos, const float *sin,
             const int64_t *positions);
void hp_swiglu(const float *gate_up, float *out, int64_t m, int64_t ff);   /* rows of gate | up -> silu(g) u */
void hp_gelu(float *x, int64_t n);                                        /* tanh approximation, in place */
/* attention of the m rows (keys and values written to the cache first); scores: hp_scratch_floats' share,
 * HP_TILE_LANES x seq_len + HP_TILE_LANES x hd floats and at least (n_heads / n_kv) x seq_len (attend.c) */
#define HP_TILE_LANES 16

/* How the row tiles of m rows of x (m / 4 tiles a group of weight rows) spread the prefetch of the next group,
 * `lines` lines (or rows) a step in all: over the first *share tiles, the returned count a step each. Issued all
 * by the first tile, the requests queued behind each other and the later tiles waited on memory. */
static inline int hp_prefetch_split(int64_t m, int lines, int *share) {
    int s = m >= 16 ? 4 : m >= 8 ? 2 : 1;
    if (s > lines) s = lines;
    *share = s;
    return lines / s;
}
void hp_attend(const hp_stage *s, float *cache, const float *qkv, int64_t m, const int64_t *slots,
               const int64_t *positions, int64_t window, float *heads, float *scores, const float **rows);
int hp_stage_forward(const hp_stage *s, float *h, int64_t m, const int64_t *slots, const int64_t *positions,
                     float *scratch);

/* shared by the kernels' files */
float hp_bf16_to_f32(uint16_t b);
float hp_f16_to_f32(uint16_t h);
extern int hp_avx512;
/* q8_vnni.c: 0 when it cannot run (no scratch memory) and the caller's float path must */
int hp_matmul_q8_vnni(const hp_weight *w, const float *x, int64_t m, int64_t ldx, float *y, int64_t ldy,
                      int accumulate);

#endif
