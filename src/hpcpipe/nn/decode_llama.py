"""The Llama kind's steps of a KV-cached ``DecodeStage`` (hpcpipe.nn.decode): embedding, block and head over rows.

The training layers' forward without gradients (``llama_layers.Block``, ``RMSNorm``,
``Dense``, SwiGLU): h = tok_emb[x]; per block u = rmsnorm(h), q = u @ Wq, k = u @ Wk,
v = u @ Wv (+ biases), q and k rotated (RoPE) at each token's absolute position before
the stage stores k, a = h + attn(q, k, v) @ Wo with n_kv_heads key/value heads shared by
n_heads / n_kv_heads query heads each, y = a + swiglu(rmsnorm(a)); logits =
rmsnorm(h) @ (tok_emb.T | head). The cache holds n_kv_heads heads, not n_heads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hpcpipe.nn.decode_gpt import forward_only, local_params, tied_head
from hpcpipe.nn.linear import linear
from hpcpipe.nn.llama_layers import Block, model_rope, rms_norm
from hpcpipe.nn.llama_params import LlamaShape, group_params
from hpcpipe.nn.rope import rotate
from hpcpipe.nn.sharding import kv_heads_of, llama_shards, vocab_range
from hpcpipe.nn.tensor_parallel import is_split, vocab_lookup


class LlamaSteps:
    """Llama layers of one decode stage; keys and values have n_kv_heads heads of head_dim.

    With a tensor-parallel group ``tp`` the stage holds the rank's query heads, the key/value heads
    they use (``sharding.kv_heads_of``: the cache holds only those), MLP columns and vocabulary rows,
    as GPTSteps does.
    """

    def __init__(self, shape: LlamaShape, xp: Any, tp: Any = None):
        self.shape, self.xp = shape, xp
        self.tp = tp if is_split(tp) else None
        size, rank = (tp.size, tp.rank) if self.tp else (1, 0)
        self.n_heads = shape.n_heads // size
        self.n_kv_heads = len(kv_heads_of(shape.n_heads, shape.n_kv_heads, size, rank))
        self.head_dim = shape.head_dim
        self.lo = vocab_range(shape.vocab, size, rank)[0]
        self.blocks: list[Block] = []

    def group_params(self, index: int) -> list[tuple[str, tuple[int, ...]]]:
        """Names and shapes of group ``index``'s arrays (this rank's parts under tensor parallelism)."""
        tp = self.tp
        return local_params(group_params(self.shape, index),
                            lambda names: llama_shards(self.shape, index, names, tp.size, tp.rank), tp)

    def build(self, params: dict[int, dict[str, Any]], table: Any) -> None:
        """Build the stage's layers from its groups' xp arrays; ``table``: tok_emb for a tied head, else None."""
        shape, xp = self.shape, self.xp
        if 0 in params:
            self.tok_emb = params[0]["tok_emb"]
        self.blocks = [Block(p, forward_only(p), shape, xp, self.tp) for i, p in sorted(params.items())
                       if 1 <= i <= shape.n_blocks]
        if self.blocks:
            self.rope = model_rope(shape, xp, self.blocks[0].attn.q.weight.dtype)
        final = params.get(shape.n_blocks + 1)
        if final is not None:
            self.norm = rms_norm(final, forward_only(final), "norm", shape.norm_eps, xp)
            self.head = tied_head(self, table, xp) if table is not None \
                else linear(final, forward_only(final), "head", xp, bias=False)

    def embed(self, tokens: Any, positions: Callable[[], Any]) -> Any:
        """Return the (rows, d) embeddings of checked token ids (positions enter through RoPE)."""
        return vocab_lookup(self.xp, self.tok_emb, tokens, self.lo, self.tp)

    def prepare(self, positions: Callable[[], Any]) -> Any:
        """Per-call state of the blocks: the RoPE (cos, sin) of every row's position, (rows, 1, head_dim / 2)."""
        if not self.blocks:
            return None
        cos, sin = self.rope.at(positions())
        return cos[:, None], sin[:, None]

    def block(self, index: int, h: Any, context: Any, attend: Callable[[Any, Any, Any], Any]) -> Any:
        """Local block ``index`` over the rows ``h``: a = h + attn(norm(h)); return a + mlp(norm(a))."""
        xp, block = self.xp, self.blocks[index]
        n, hd = h.shape[0], self.head_dim
        cos, sin = context
        u, _ = block.attn_norm.forward(h)
        q, _ = block.attn.q.forward(u)
        k, _ = block.attn.k.forward(u)
        v, _ = block.attn.v.forward(u)
        q, k = q.reshape(n, -1, hd), k.reshape(n, -1, hd)
        rotate(xp, q, cos, sin, out=q)                  # the projections' fresh outputs: rotated in place
        rotate(xp, k, cos, sin, out=k)
        a, _ = block.attn.o.forward(attend(q, k, v.reshape(n, -1, hd)))
        a += h
        u, _ = block.mlp_norm.forward(a)
        y, _ = block.mlp.forward(u)
        y += a
        return y

    def head_logits(self, h: Any) -> Any:
        """Return the logits of the rows ``h``: the final RMSNorm, then the head."""
        u, _ = self.norm.forward(h)
        return self.head.forward(u)[0]
