/* A decode stage's blocks over the new rows of many sequences in one call.
 *
 * Roughly, for each block (the NumPy path's equations, hpcpipe.nn.core.decode_steps):
 *
 *     u = norm1(h); qkv = u W_qkv^T (+ b); q, k = per-head RMSNorm (Qwen3), RoPE at each row's position
 *     write k, v at (slot, position); heads = attention of each row over its sequence's keys 0..position
 *     h += heads W_o^T (+ b)
 *     u = norm2(h); h += swiglu(u W_gate|up^T) W_down^T   |   h += gelu(u W_fc^T + b) W_proj^T + b
 *
 * Scratch (hp_scratch_floats) holds the attention's 2 x seq_len row pointers (first: 8-byte aligned), u, qkv,
 * heads, the MLP's hidden rows and the attention scores. The KV cache is paged (hp.h: hp_stage.tables).
 * Tensor parallelism: a rank holds its heads (q|k|v rows, o columns) and its ff slice (gate|up rows, down
 * columns); s->reduce sums the o and down partial products over the ranks, then the bias is added once.
 */
#include <math.h>

#include "hp.h"

#define PTR_FLOATS (((int64_t)sizeof(void *) + 3) / 4)   /* floats of scratch one row pointer takes */

int64_t hp_scratch_floats(const hp_stage *s, int64_t m) {
    int64_t qkv = (s->n_heads + 2 * s->n_kv) * s->hd, up = s->act == HP_SWIGLU ? 2 * s->ff : s->ff;
    int64_t pointers = 2 * s->seq_len * PTR_FLOATS;
    int64_t group = s->n_heads / s->n_kv, lanes = group > HP_TILE_LANES ? group : HP_TILE_LANES;
    int64_t scores = lanes * s->seq_len + HP_TILE_LANES * s->hd;   /* hp_attend's: a query tile's, or a row's */
    return pointers + m * (s->d + qkv + s->n_heads * s->hd + up + s->ff) + scores + 64;
}

static void add_bias(float *y, const float *b, int64_t m, int64_t n) {
    if (!b) return;
    for (int64_t r = 0; r < m; r++)
        for (int64_t i = 0; i < n; i++) y[r * n + i] += b[i];
}

static void norm(const hp_stage *s, const float *w, const float *b, const float *x, float *y, int64_t m) {
    if (s->norm == HP_LAYERNORM) hp_layernorm(x, w, b, y, m, s->d, s->eps);
    else hp_rmsnorm(x, w, y, m, s->d, s->eps);
}

static void head_norm(const float *w, float *x, int64_t m, int64_t heads, int64_t hd, int64_t stride, float eps) {
    /* RMSNorm of each head's hd values, in place */
    for (int64_t r = 0; r < m; r++)
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + r * stride + h * hd;
            hp_rmsnorm(v, w, v, 1, hd, eps);
        }
}

int hp_stage_forward(const hp_stage *s, float *h, int64_t m, const int64_t *slots, const int64_t *positions,
                     float *scratch) {
    int64_t d = s->d, hd = s->hd, H = s->n_heads, K = s->n_kv, ff = s->ff;
    int64_t width = (H + 2 * K) * hd, up_width = s->act == HP_SWIGLU ? 2 * ff : ff;
    for (int64_t r = 0; r < m; r++)
        if (slots[r] < 0 || slots[r] >= s->slots || positions[r] < 0 || positions[r] >= s->seq_len) return -1;
    const float **rows = (const float **)scratch;
    float *u = scratch + 2 * s->seq_len * PTR_FLOATS, *qkv = u + m * d, *heads = qkv + m * width, *up = heads + m * H * hd, *hidden = up + m * up_width;
    float *scores = hidden + m * ff;
    for (int64_t b = 0; b < s->n_blocks; b++) {
        const hp_block *blk = s->blocks + b;
        norm(s, blk->norm1_w, blk->norm1_b, h, u, m);
        hp_matmul(&blk->qkv, u, m, d, qkv, width, 0);
        add_bias(qkv, blk->qkv_b, m, width);
        if (blk->q_norm_w) head_norm(blk->q_norm_w, qkv, m, H, hd, width, s->qk_eps);
        if (blk->k_norm_w) head_norm(blk->k_norm_w, qkv + H * hd, m, K, hd, width, s->qk_eps);
        if (s->rope) {
            hp_rope(qkv, m, H, hd, width, s->cos, s->sin, positions);
            hp_rope(qkv + H * hd, m, K, hd, width, s->cos, s->sin, positions);
        }
        hp_stage own = *s;            /* a block with its own tables (a windowed block's rings) reads through them */
        if (blk->tables) { own.tables = blk->tables; own.pages = blk->pages; }
        hp_attend(&own, blk->cache, qkv, m, slots, positions, blk->window, heads, scores, rows);
        if (blk->o_b || s->reduce) {   /* (sum over tp of heads Wo^T) + b) + h, the NumPy path's order */
            hp_matmul(&blk->o, heads, m, H * hd, u, d, 0);
            if (s->reduce && s->reduce(s->reduce_ctx, u, m * d)) return -2;
            add_bias(u, blk->o_b, m, d);
            for (int64_t i = 0; i < m * d; i++) h[i] += u[i];
        } else {
            hp_matmul(&blk->o, heads, m, H * hd, h, d, 1);
        }
        norm(s, blk->norm2_w, blk->norm2_b, h, u, m);
        hp_matmul(&blk->up, u, m, d, up, up_width, 0);
        const float *act = hidden;
        if (s->act == HP_SWIGLU) {
            hp_swiglu(up, hidden, m, ff);
        } else {
            add_bias(up, blk->up_b, m, ff);
            hp_gelu(up, m * ff);
            act = up;
        }
        if (blk->down_b || s->reduce) {
            hp_matmul(&blk->down, act, m, ff, u, d, 0);
            if (s->reduce && s->reduce(s->reduce_ctx, u, m * d)) return -2;
            add_bias(u, blk->down_b, m, d);
            for (int64_t i = 0; i < m * d; i++) h[i] += u[i];
        } else {
            hp_matmul(&blk->down, act, m, ff, h, d, 1);
        }
    }
    return 0;
}
