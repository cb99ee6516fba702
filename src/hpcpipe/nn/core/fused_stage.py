"""A decode stage computed by the compiled kernels: the embedding gather, every block in one call, norm and head.

Used by :class:`hpcpipe.nn.core.decode.DecodeStage` on the CPU (NumPy backend, float32) when the kernels are
built; the NumPy steps (hpcpipe.nn.core.decode_steps) stay the reference it is tested against. Under tensor
parallelism (a ``tp`` group, hpcpipe.nn.core.tensor_parallel) a rank holds what the NumPy steps' rank holds
(its heads' q|k|v rows and o columns, its ff slice of gate|up and down, its vocabulary rows): the compiled
blocks call ``tp.sum_`` on each row-parallel partial product (o, down) before the bias, the embedding sums its
vocabulary-parallel lookup, and the head gives the logits of the rank's token ids. Weights are (out, in)
:class:`hpcpipe.kernels.formats.RowWeight` in the stage's weight format
(``float32``, ``stored``: a checkpoint's bfloat16 / float16 as they are, or ``q8_0``); the kind maps its
block's parameters onto the compiled block (``model.fused_block``). A tied head multiplies by the embedding
table the embedding gathers from: one copy of it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcpipe.kernels import cpu
from hpcpipe.kernels.formats import Q8_BLOCK, RowWeight, row_weight
from hpcpipe.kernels.stage import StagePlan
from hpcpipe.nn.core.half_table import HalfTable
from hpcpipe.nn.core.sharding import split_range
from hpcpipe.nn.core.tensor_parallel import is_split


def compiled_available(xp: Any, dtype: Any, tp: Any, model: Any = None) -> bool:
    """Whether a stage of ``model`` on this backend, dtype and tensor-parallel group can run compiled (under tp:
    a model whose rank's query heads split evenly over its key/value heads, as the compiled attention reads them)."""
    if xp is not np or np.dtype(dtype) != np.float32 or cpu.library() is None:
        return False
    if is_split(tp):
        if model is None:
            return False
        heads, kv = model.local_heads(tp)
        if heads % kv:
            return False
    return model is None or model.fusable()


def tp_q8_problem(model: Any, tp: Any) -> str | None:
    """Why q8_0 cannot run at this tp (None: it can): each rank's input slice of the row-parallel products (o: its
    heads x head_dim, down: its ff part) must be whole q8_0 blocks of 32, so the rank's blocks are the whole
    matrix's blocks."""
    if not is_split(tp):
        return None
    shape = model.shape
    heads, _ = model.local_heads(tp)
    o_width = heads * shape.head_dim
    ff_parts = [len(range(shape.ff)[split_range(shape.ff, tp.size, r)]) for r in range(tp.size)]
    if o_width % Q8_BLOCK or any(p % Q8_BLOCK for p in ff_parts):
        return (f"q8_0 at tp = {tp.size} needs each rank's input slice of the row-parallel products in whole blocks "
                f"of {Q8_BLOCK}: o's is {heads} heads x {shape.head_dim} = {o_width}, down's ff parts are "
                f"{ff_parts}; use model.weight_format = \"stored\" or \"float32\", or another tp")
    return None


def table_rows(table: Any, ids: np.ndarray) -> np.ndarray:
    """Rows ``ids`` of an embedding table (float array, HalfTable or RowWeight) as float32."""
    if isinstance(table, RowWeight):
        if table.kind == "float32":
            return table.data[ids]
        return table.rows_at(ids)
    return np.asarray(table[ids], dtype=np.float32)


def as_table(value: Any, fmt: str) -> Any:
    """An embedding table as the stage keeps it: 16-bit tables as they are, float32 as float32, q8_0 quantized."""
    if isinstance(value, HalfTable):
        return RowWeight(value.kind, np.ascontiguousarray(value.bits)) if fmt != "q8_0" else \
            row_weight(RowWeight(value.kind, np.ascontiguousarray(value.bits)), fmt)
    if isinstance(value, RowWeight):
        return row_weight(value, fmt)
    array = np.ascontiguousarray(value, dtype=np.float32)          # (vocab, d): already (out, in) for the head
    return row_weight(RowWeight("float32", array), fmt)


class FusedStage:
    """Layer groups ``groups`` of a decoder model, computed by the compiled kernels (see the module docstring)."""

    def __init__(self, model: Any, groups: range, arrays: dict[int, dict[str, Any]], fmt: str, paged: Any,
                 tok_emb: Any = None, release: bool = False, tp: Any = None, rings: Any = None):
        shape = model.shape
        self.model, self.shape, self.fmt = model, shape, fmt
        self.tp = tp if is_split(tp) else None
        self.lo = model.vocab_lo(self.tp)
        self.has_embedding = 0 in groups
        self.has_head = shape.n_blocks + 1 in groups
        blocks = [i for i in groups if 1 <= i <= shape.n_blocks]
        problem = tp_q8_problem(model, self.tp) if fmt == "q8_0" and blocks else None
        if problem:
            raise ValueError(f"decode stage: {problem}")
        n_heads, n_kv = model.local_heads(self.tp)
        hd = shape.head_dim
        # a windowed block beside full ones keeps its keys in per-slot rings (``rings``: kv_pages.ring_layout)
        ringed = [rings is not None and model.window(i) > 0 for i in blocks]
        self.cache = paged.allocate(np, np.float32, ringed.count(False), n_kv, hd)
        self.ring_cache = rings.allocate(np, np.float32, ringed.count(True), n_kv, hd) if rings is not None else None
        # block by block, each block's arrays released (with ``release``) once its fused form exists
        fused = [model.fused_block(arrays.pop(i) if release else arrays[i], fmt, i) for i in blocks]
        kind = model.fused_kind()
        rope = model.rope(np, np.float32).tables(shape.seq_len) if kind.rope else None
        ff = fused[0].down.shape[1] if fused else shape.ff          # the rank's ff part under tp
        self.plan = StagePlan(kind, fused, shape.d_model, n_heads, n_kv, hd, ff, self.cache, rope,
                              paged.tables, shape.seq_len, self.tp.sum_ if self.tp is not None else None,
                              None if rings is None else (self.ring_cache, rings.tables)) \
            if blocks else None
        self.table = self.pos_emb = None
        if self.has_embedding:
            self.table = as_table(arrays[0]["tok_emb"], fmt)
            if "pos_emb" in arrays[0]:
                self.pos_emb = np.ascontiguousarray(arrays[0]["pos_emb"], dtype=np.float32)
        if self.has_head:
            final = arrays[shape.n_blocks + 1]
            self.norm = {name: np.ascontiguousarray(value, dtype=np.float32) for name, value in final.items()
                         if name != "head/weight"}
            if not shape.tied:
                self.head = row_weight(final["head/weight"], fmt)
            elif self.table is not None:
                self.head = self.table
            else:
                if tok_emb is None:
                    raise ValueError("decode stage: a tied head on a stage without layer group 0 needs tok_emb")
                self.head = as_table(tok_emb, fmt)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the stage's weights as kept (the KV cache aside)."""
        total = sum(b.nbytes for b in self.plan._keep[0]) if self.plan is not None else 0
        tables = {id(t): t for t in (self.table, getattr(self, "head", None)) if t is not None}
        return total + sum(t.nbytes for t in tables.values())

    def embed(self, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The (rows, d) float32 embeddings of checked token ids at their positions (under tp: the rank's
        vocabulary rows, 0 for other ids, summed over the ranks)."""
        if self.tp is None:
            h = np.ascontiguousarray(table_rows(self.table, tokens), dtype=np.float32)
        else:
            local = tokens - self.lo
            mine = (local >= 0) & (local < self.table.shape[0])
            h = np.ascontiguousarray(table_rows(self.table, np.where(mine, local, 0)), dtype=np.float32)
            h *= mine[:, None]
            self.tp.sum_(h)
        if self.pos_emb is not None:
            h += self.pos_emb[positions]
        return h

    def blocks(self, h: np.ndarray, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Every block over the rows, in place (each row's keys and values written at its slot and position)."""
        if self.plan is not None:
            self.plan.forward(h, slots, positions)
        return h

    def logits(self, h: np.ndarray) -> np.ndarray:
        """The final norm and the head over rows ``h``: (rows, vocab) float32 logits."""
        h = np.ascontiguousarray(h, dtype=np.float32)
        kind = self.model.fused_kind()
        prefix = self.model.NORMS[2]
        if kind.norm == "rms":
            u = cpu.rms_norm(h, self.norm[f"{prefix}/weight"], kind.eps)
        else:
            u = cpu.layer_norm(h, self.norm[f"{prefix}/weight"], self.norm[f"{prefix}/bias"], kind.eps)
        return cpu.matmul(self.head, u)
