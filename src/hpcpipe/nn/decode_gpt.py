"""The GPT kind's steps of a KV-cached ``DecodeStage`` (hpcpipe.nn.decode): embedding, block and head over rows.

The training layers' forward without gradients (``gpt_layers.Block``, ``LayerNorm``,
``Dense``): h = tok_emb[x] + pos_emb[position]; per block a = h + attn(ln1(h)) with
qkv = u @ Wqkv + bqkv split into q | k | v of n_heads heads each (every query head has
its own key/value head), y = a + mlp(ln2(a)); logits = ln_f(h) @ (tok_emb.T | head).
Attention itself (cache writes, masks, softmax) is the stage's, kind-neutral.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hpcpipe.nn.gpt_layers import Block, layer_norm
from hpcpipe.nn.gpt_params import GPTShape, group_params
from hpcpipe.nn.half_table import ColumnTable
from hpcpipe.nn.layers import Activation, Dense
from hpcpipe.nn.linear import linear
from hpcpipe.nn.sharding import gpt_shards, vocab_range
from hpcpipe.nn.tensor_parallel import is_split, vocab_lookup


def forward_only(params: dict[str, Any]) -> dict[str, None]:
    """Gradient slots for a forward-only layer: every name maps to None."""
    return dict.fromkeys(params)


def tied_head(steps: Any, table: Any, xp: Any) -> Dense:
    """The head multiplying by a tied table kept transposed (ColumnTable), which the embedding then gathers from."""
    table_t = xp.ascontiguousarray(table.T)
    if getattr(steps, "tok_emb", None) is table:    # this stage embeds too: one copy, the transposed one
        steps.tok_emb = ColumnTable(table_t)
    return Dense(-1, table_t, None, None, None, Activation(), xp)


def local_params(full: list[tuple[str, tuple[int, ...]]], shards: Callable[[list[str]], dict], tp: Any
                 ) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of the part of a group a tp rank holds (``shards(names)``: hpcpipe.nn.sharding's cut)."""
    if not is_split(tp):
        return full
    cut = shards([name for name, _ in full])
    return [(name, cut[name].shape(dims)) for name, dims in full]


class GPTSteps:
    """GPT layers of one decode stage; keys and values have n_heads heads of d_head.

    With a tensor-parallel group ``tp`` the stage holds the rank's heads (n_heads / tp of them), MLP
    columns and vocabulary rows (hpcpipe.nn.sharding): the blocks sum their row-parallel outputs over
    tp, the embedding sums its vocabulary-parallel lookup, and the head returns the logits of the
    rank's token ids [lo, hi) only.
    """

    def __init__(self, shape: GPTShape, xp: Any, tp: Any = None):
        self.shape, self.xp = shape, xp
        self.tp = tp if is_split(tp) else None
        size, rank = (tp.size, tp.rank) if self.tp else (1, 0)
        self.n_heads = self.n_kv_heads = shape.n_heads // size
        self.head_dim = shape.d_head
        self.lo = vocab_range(shape.vocab, size, rank)[0]
        self.blocks: list[Block] = []

    def group_params(self, index: int) -> list[tuple[str, tuple[int, ...]]]:
        """Names and shapes of group ``index``'s arrays (this rank's parts under tensor parallelism)."""
        tp = self.tp
        return local_params(group_params(self.shape, index),
                            lambda names: gpt_shards(self.shape, index, names, tp.size, tp.rank), tp)

    def build(self, params: dict[int, dict[str, Any]], table: Any) -> None:
        """Build the stage's layers from its groups' xp arrays; ``table``: tok_emb for a tied head, else None."""
        shape, xp = self.shape, self.xp
        if 0 in params:
            self.tok_emb, self.pos_emb = params[0]["tok_emb"], params[0]["pos_emb"]
        self.blocks = [Block(p, forward_only(p), shape.n_heads, xp, self.tp) for i, p in sorted(params.items())
                       if 1 <= i <= shape.n_blocks]
        final = params.get(shape.n_blocks + 1)
        if final is not None:
            self.ln_f = layer_norm(final, forward_only(final), "ln_f", xp)
            self.head = tied_head(self, table, xp) if table is not None \
                else linear(final, forward_only(final), "head", xp, bias=False)

    def embed(self, tokens: Any, positions: Callable[[], Any]) -> Any:
        """Return the (rows, d) embeddings of checked token ids; ``positions()``: their positions on xp."""
        h = vocab_lookup(self.xp, self.tok_emb, tokens, self.lo, self.tp)
        h += self.pos_emb[positions()]
        return h

    def prepare(self, positions: Callable[[], Any]) -> None:
        """Per-call state of the blocks: none (positions entered with the embedding)."""
        return None

    def block(self, index: int, h: Any, context: Any, attend: Callable[[Any, Any, Any], Any]) -> Any:
        """Local block ``index`` over the rows ``h``: a = h + attn(ln1(h)); return a + mlp(ln2(a))."""
        block = self.blocks[index]
        n, heads, dh = h.shape[0], self.n_heads, self.head_dim
        u, _ = block.ln1.forward(h)
        qkv, _ = block.attn.qkv.forward(u)
        qkv = qkv.reshape(n, 3, heads, dh)
        a, _ = block.attn.proj.forward(attend(qkv[:, 0], qkv[:, 1], qkv[:, 2]))
        a += h
        u, _ = block.ln2.forward(a)
        y, _ = block.mlp.forward(u)
        y += a
        return y

    def head_logits(self, h: Any) -> Any:
        """Return the logits of the rows ``h`` (of the rank's token ids under tensor parallelism): ln_f, the head."""
        u, _ = self.ln_f.forward(h)
        return self.head.forward(u)[0]
