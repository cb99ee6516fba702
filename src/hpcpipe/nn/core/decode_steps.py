"""A decoder's steps inside a KV-cached ``DecodeStage`` (hpcpipe.nn.core.decode): embedding, block and head over rows.

The training layers' forward without gradients, over the rows of every segment of a call::

    h = tok_emb[x] (+ pos_emb[position])
    per block: u = norm1(h); q, k, v = the kind's projections of u; q and k rotated at each token's absolute
               position when the kind uses RoPE (before the stage stores k); a = h + attend(q, k, v) @ Wo;
               y = a + mlp(norm2(a))
    logits = norm(h) @ (tok_emb.T | head)

The cache holds n_kv_heads heads (a GPT: one per query head). Attention itself (cache writes, masks,
softmax) is the stage's. With a tensor-parallel group ``tp`` the stage holds the rank's query heads, the
key/value heads they use, MLP columns and vocabulary rows (the kind's ``shards``): the blocks sum their
row-parallel outputs over tp, the embedding sums its vocabulary-parallel lookup, and the head returns the
logits of the rank's token ids [lo, hi) only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hpcpipe.kernels.row_product import RowProduct
from hpcpipe.nn.core.activations import Activation
from hpcpipe.nn.core.decoder import Block
from hpcpipe.nn.core.dense import Dense, linear
from hpcpipe.nn.core.half_table import ColumnTable
from hpcpipe.nn.core.rope import rotate
from hpcpipe.nn.core.tensor_parallel import is_split, vocab_lookup


def forward_only(params: dict[str, Any]) -> dict[str, None]:
    """Gradient slots for a forward-only layer: every name maps to None."""
    return dict.fromkeys(params)


class DecoderSteps:
    """The layers of one decode stage of a decoder model (hpcpipe.nn.core.decoder_model.DecoderModel)."""

    def __init__(self, model: Any, xp: Any, tp: Any = None, ep: Any = None):
        self.model, self.shape, self.xp = model, model.shape, xp
        self.tp = tp if is_split(tp) else None
        self.ep = ep if ep is not None and ep.size > 1 else None     # an expert-parallel group: this rank's experts
        self.n_heads, self.n_kv_heads = model.local_heads(self.tp)
        self.head_dim = model.shape.head_dim
        self.lo = model.vocab_lo(self.tp)
        self.blocks: list[Block] = []
        self.tok_emb = self.pos_emb = self.rope = None

    def group_params(self, index: int) -> list[tuple[str, tuple[int, ...]]]:
        """Names and shapes of group ``index``'s arrays (this rank's parts under tensor parallelism)."""
        full = self.model.group_params(index)
        if self.ep is not None:
            experts = self.model.expert_shards(index, self.ep.size, self.ep.rank)
            full = [(name, experts[name].shape(dims) if name in experts else dims) for name, dims in full]
        if self.tp is None:
            return full
        cut = self.model.shards(index, self.tp.size, self.tp.rank)
        return [(name, cut[name].shape(dims)) for name, dims in full]

    def build(self, params: dict[int, dict[str, Any]], table: Any) -> None:
        """Build the stage's layers from its groups' xp arrays; ``table``: tok_emb for a tied head, else None."""
        model, xp, n_blocks = self.model, self.xp, self.shape.n_blocks
        if 0 in params:
            self.tok_emb, self.pos_emb = params[0]["tok_emb"], params[0].get("pos_emb")
        self.blocks = [model.block(p, forward_only(p), xp, self.tp, i, self.ep) for i, p in sorted(params.items())
                       if 1 <= i <= n_blocks]
        if self.blocks:
            self.rope = self.blocks[0].attn.rope
        final = params.get(n_blocks + 1)
        if final is not None:
            self.norm = model.norm(final, forward_only(final), model.NORMS[2], xp)
            self.head = self._tied_head(table) if table is not None \
                else linear(final, forward_only(final), "head", xp, bias=False)

    def _tied_head(self, table: Any) -> Dense:
        """The head multiplying by a tied table kept transposed (ColumnTable), which the embedding then gathers from."""
        if isinstance(table, RowProduct):    # kept as stored (hpcpipe.nn.core.stage_weights): no transposed copy
            return Dense(-1, table, None, None, None, Activation(), self.xp)
        table_t = self.xp.ascontiguousarray(table.T)
        if self.tok_emb is table:    # this stage embeds too: one copy, the transposed one
            self.tok_emb = ColumnTable(table_t)
        return Dense(-1, table_t, None, None, None, Activation(), self.xp)

    def embed(self, tokens: Any, positions: Callable[[], Any]) -> Any:
        """Return the (rows, d) embeddings of checked token ids; ``positions()``: their positions on xp."""
        h = vocab_lookup(self.xp, self.tok_emb, tokens, self.lo, self.tp)
        if self.pos_emb is not None:
            h += self.pos_emb[positions()]
        return h

    def prepare(self, positions: Callable[[], Any]) -> Any:
        """Per-call state of the blocks: the RoPE (cos, sin) of every row's position, (rows, 1, head_dim / 2)."""
        if self.rope is None:
            return None
        cos, sin = self.rope.at(positions())
        return cos[:, None], sin[:, None]

    def block(self, index: int, h: Any, context: Any, attend: Callable[[Any, Any, Any], Any]) -> Any:
        """Local block ``index`` over the rows ``h``: a = h + attn(norm1(h)); return a + mlp(norm2(a))."""
        xp, block = self.xp, self.blocks[index]
        n, hd = h.shape[0], self.head_dim
        u, _ = block.norm1.forward(h)
        q, k, v, _ = block.attn.qkv.forward(u)
        q, k, v = q.reshape(n, -1, hd), k.reshape(n, -1, hd), v.reshape(n, -1, hd)
        if block.attn.q_norm is not None:               # Qwen3: each head's q and k normalized before RoPE
            q = block.attn.q_norm.forward(q)[0]
            k = block.attn.k_norm.forward(k)[0]
        if context is not None:
            cos, sin = context
            q = rotate(xp, q, cos, sin, out=q if q.flags.c_contiguous else None)
            k = rotate(xp, k, cos, sin, out=k if k.flags.c_contiguous else None)
        a, _ = block.attn.o.forward(attend(q, k, v))
        a += h
        u, _ = block.norm2.forward(a)
        y, _ = block.mlp.forward(u)
        y += a
        return y

    def join(self) -> None:
        """Take part in an expert-parallel step without rows of this rank's own: each sparse block, in order,
        exchanges (and computes its experts' share of the peers' rows) as a forward would."""
        for block in self.blocks:
            if hasattr(block.mlp, "join"):
                block.mlp.join()

    def head_logits(self, h: Any) -> Any:
        """Return the logits of the rows ``h`` (of the rank's token ids under tensor parallelism): norm, then head."""
        u, _ = self.norm.forward(h)
        return self.head.forward(u)[0]
