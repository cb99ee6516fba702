"""How the NumPy steps of a decode stage hold its weights: widened to the stage's dtype, or kept as stored.

Widened (the reference, and float32 everywhere): every matrix in the training layout ((in, out)), as the weight
format keeps its values (q8_0: rounded, then widened). Kept as stored (``compact``: a GPU stage with
model.weight_format ``stored`` or ``q8_0``, where the compiled CPU stage does not run): every block matrix and the
head as a :class:`hpcpipe.kernels.row_product.RowProduct` on the device, so a bfloat16 checkpoint takes its own
bytes there and a q8_0 one about a quarter of float32's; the NumPy steps multiply it as they would the widened one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcpipe.kernels.formats import RowWeight, kept_values, row_weight
from hpcpipe.kernels.row_product import RowProduct
from hpcpipe.nn.core.half_table import HalfTable

TABLES = ("tok_emb", "pos_emb")       # gathered from: never a row product


def keeps_compact(xp: Any, dtype: Any, fmt: str, model: Any, compiled: bool) -> bool:
    """Whether a stage keeps its matrices as stored (:class:`RowProduct`): the NumPy steps (not the compiled stage)
    on a GPU, float32, weight format stored or q8_0, a model whose blocks are all dense matrices (no experts)."""
    return (not compiled and xp is not np and np.dtype(dtype) == np.float32 and fmt in ("stored", "q8_0")
            and model.fusable())


def compact_choice(compact: bool | None, xp: Any, dtype: Any, fmt: str, model: Any, compiled: bool) -> bool:
    """A stage's ``compact`` setting, checked: None lets :func:`keeps_compact` decide (a GPU stage); True is allowed on
    NumPy too (the CPU tests of this path) but refused where it cannot apply."""
    if compact is None:
        return keeps_compact(xp, dtype, fmt, model, compiled)
    if compact and (compiled or fmt == "float32" or not model.fusable() or np.dtype(dtype) != np.float32):
        raise ValueError(f"decode stage: weights kept as stored (compact) are for the float32 NumPy steps of a model "
                         f"without experts in weight format stored or q8_0, not {fmt!r} {dtype} "
                         f"{'compiled' if compiled else 'uncompiled'}")
    return bool(compact)


def widened(name: str, value: Any, fmt: str, dtype: Any) -> Any:
    """A parameter as the NumPy steps compute with it: the values the weight format keeps, in the training layout
    ((in, out) matrices), widened to ``dtype`` once."""
    if not isinstance(value, RowWeight):
        return kept_values(name, value, fmt)
    value = row_weight(value, fmt) if fmt == "q8_0" else value
    return value.dense(dtype) if name == "tok_emb" else value.dense(dtype).T


def compact_matrix(name: str, value: Any, fmt: str, xp: Any) -> RowProduct | None:
    """The row product of a block matrix or untied head (RowWeight, or float (in, out) array) in weight format
    ``fmt`` on ``xp``; None for anything else (vectors, embedding tables)."""
    if name in TABLES or not name.endswith("/weight") or len(getattr(value, "shape", ())) != 2:
        return None
    return RowProduct(row_weight(value, fmt), xp)


def shared_table(value: Any, fmt: str, dtype: Any, xp: Any) -> HalfTable | None:
    """A compact stage's own 16-bit tok_emb (a bfloat16 / float16 RowWeight, as a stored read gives it) kept as stored
    on ``xp`` in weight format stored: a HalfTable the embedding gathers from and a tied head's row product shares
    (widened, the table took float32's bytes). None otherwise (q8_0 rounds the table, and gathers are not from
    blocks)."""
    if fmt != "stored" or not isinstance(value, RowWeight) or value.kind not in ("bfloat16", "float16"):
        return None
    return HalfTable(value.data, value.kind, dtype).on(xp)


def compact_table(table: Any, fmt: str, xp: Any, loaded: bool) -> RowProduct:
    """The row product a tied head multiplies by, holding the (vocab, d) table's values as the widened steps' head
    does: ``loaded``, the stage's own embedding table as it was loaded (a HalfTable's bits on ``xp``, shared with the
    embedding's gather, or the float values the format keeps); else the table handed to a head stage (a HalfTable,
    RowWeight or float array on the host) in weight format ``fmt``."""
    if isinstance(table, HalfTable):
        table = RowWeight(table.kind, table.bits)
    if loaded:                     # on xp already: shared with the embedding's gather, no second copy
        if isinstance(table, RowWeight):
            return RowProduct(table, xp)
        return RowProduct(RowWeight("float32", xp.ascontiguousarray(table, dtype=np.float32)), xp)
    # a host table: its (vocab, d) rows are the head's (out, in) already; made a row weight on the host (CuPy's
    # ascontiguousarray takes only CuPy arrays), in the weight format (q8_0 blocks, not their widened floats)
    if not isinstance(table, RowWeight):
        table = RowWeight("float32", np.ascontiguousarray(table, dtype=np.float32))
    return RowProduct(row_weight(table, fmt), xp)
