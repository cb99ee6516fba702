"""FLOPs, parameter counts and activation-stash bytes of the benchmark GPT (pure arithmetic, used by bench_gpt.py).

FLOPs per token = 6 x N + 12 x n_blocks x T x d, N = the parameters that take part
in a matrix product or a norm: everything but the two embedding tables (their
forward is a row gather, their backward a scatter-add). 6 x N counts the forward
(2 per parameter) and the backward (input and weight gradients, 2 each). The
attention term is QK^T and PV: each takes T x d multiply-adds (2 FLOPs) per query
token and block, so 4 x T x d forward and 12 x T x d forward + backward, the causal
mask counted FULLY (every (query, key) pair: hpcpipe computes the full T x T scores and
masks them; a causal-aware kernel would do about half).

Stash bytes follow what each hpcpipe layer keeps in its forward cache
(src/hpcpipe/nn/*.py), counting each distinct buffer once (views such as q, k, v
of the one qkv product, or a (b*T, d) row view, share their base):
  block:  ln1 x_hat (b,T,d) + 1/std (b,T,1); attn input u1 (b,T,d); qkv (b,T,3d);
          softmax p (b,H,T,T); concatenated heads (b*T,d); ln2 x_hat + 1/std; mlp
          input u2 (b,T,d); fc pre-activation z and tanh t (b*T,ff each); GELU output
          (b*T,ff)  ->  b*T*(8d + 3ff + 2) + b*H*T^2 values
  head:   ln_f x_hat + 1/std; head input (b,T,d)  ->  b*T*(2d + 1) values
  embed:  the token ids (b,T) int64 (the engine counts each array by its own
          memory region, so a micro-batch's ids, a view of the step's array, count
          b*T*8 bytes)
A stage holds that for every micro-batch in flight: GPipe all m, 1F1B at most
pp - stage. With train.recompute = "stage" only each micro-batch's stage input is
kept (token ids on stage 0, a (b,T,d) activation after it); the caches rebuilt for
a backward B are transient (not stashed).
"""

from __future__ import annotations

from hpcpipe.nn.gpt.shape import GPTShape


def block_params(m: GPTShape) -> int:
    """Parameters of one decoder block (two LayerNorms, qkv, proj, fc, mlp proj, with biases)."""
    d, ff = m.d_model, m.ff
    return 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * ff + ff) + (ff * d + d)


def params(m: GPTShape) -> dict[str, int]:
    """Parameter counts: embedding tables, blocks, final norm + untied head, the FLOP-counted total, all."""
    emb = m.vocab * m.d_model + m.seq_len * m.d_model
    blocks = m.n_blocks * block_params(m)
    final = 2 * m.d_model + m.d_model * m.vocab
    return {"embedding": emb, "blocks": blocks, "final": final, "flop_counted": blocks + final,
            "total": emb + blocks + final}


def attention_flops_per_token(m: GPTShape) -> int:
    """FLOPs of QK^T and PV per token, forward + backward, causal mask counted fully: 12 x n_blocks x T x d."""
    return 12 * m.n_blocks * m.seq_len * m.d_model


def flops_per_token(m: GPTShape) -> int:
    """6 x (non-embedding parameters) + attention FLOPs, per trained token."""
    return 6 * params(m)["flop_counted"] + attention_flops_per_token(m)


def block_stash_values(m: GPTShape, b: int) -> int:
    """Values one block keeps for its backward, per micro-batch of b sequences (tiled attention: one
    log-sum-exp a head and token, no T x T weights)."""
    t = m.seq_len
    return b * t * (8 * m.d_model + 3 * m.ff + 2) + b * m.n_heads * t


def stage_stash_bytes(m: GPTShape, b: int, groups: range, itemsize: int = 4, token_bytes: int | None = None) -> int:
    """Bytes one micro-batch leaves in the stash of a stage holding layer groups ``groups`` (0 = embedding).

    ``token_bytes``: what the token ids count for (default b x T int64: ids of their own).
    """
    total = 0
    for g in groups:
        if g == 0:
            total += b * m.seq_len * 8 if token_bytes is None else token_bytes
        elif g <= m.n_blocks:
            total += block_stash_values(m, b) * itemsize
        else:
            total += b * m.seq_len * (2 * m.d_model + 1) * itemsize
    return total


def stage_input_bytes(m: GPTShape, b: int, first: bool, itemsize: int = 4, token_bytes: int | None = None) -> int:
    """Bytes of one micro-batch's stage input: token ids on the first stage, a (b, T, d) activation after it."""
    if first:
        return b * m.seq_len * 8 if token_bytes is None else token_bytes
    return b * m.seq_len * m.d_model * itemsize


def in_flight(schedule: str, n_micro: int, pp: int, stage: int) -> int:
    """Most micro-batches a stage holds activations for at once (GPipe: all; 1F1B: pp - stage)."""
    return n_micro if schedule == "gpipe" else min(n_micro, pp - stage)


def stash_formula(m: GPTShape, b: int, n_micro: int, schedule: str, stage_groups: list[range],
                  recompute: bool) -> list[int]:
    """Predicted peak stash bytes per stage (float32 activations), as the engine counts them."""
    pp = len(stage_groups)
    tokens = b * m.seq_len * 8
    out = []
    for s, groups in enumerate(stage_groups):
        per = (stage_input_bytes(m, b, s == 0, token_bytes=tokens) if recompute
               else stage_stash_bytes(m, b, groups, token_bytes=tokens))
        out.append(in_flight(schedule, n_micro, pp, s) * per)
    return out
