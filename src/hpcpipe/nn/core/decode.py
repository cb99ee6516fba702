"""KV-cached forward of one pipeline stage of a decoder (GPT or Llama kind) over the new tokens of many sequences.

A ``DecodeStage`` holds a contiguous range of layer groups and, per local
block, a key and a value cache of shape (slots, n_kv_heads, seq_len, head_dim)
(GPT: n_kv_heads = n_heads): row ``slot`` belongs to one sequence, position j
of it holds the key (value) of that sequence's token j. Each ``forward`` call
runs the stage over the new tokens of several sequences (``Segment``: slot,
start, length), writes their keys and values at positions [start, start +
length) and attends causally over [0, start + length). The model's steps
(:class:`hpcpipe.nn.core.decode_steps.DecoderSteps`) run the training layers'
forward without gradients once over the rows of every segment; this module is
the attention part: segments, planning, cache writes, gather, masks and
softmax. Query head i attends with key/value head i // (n_heads / n_kv_heads):
the queries of one kv head are handled as one block, so the products run per
kv head with no repeated keys or values. Decode segments (length 1) share one
batched attention over their caches gathered up to the longest; longer
(prefill) segments attend one by one. Layout and sizing: docs/decode.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcpipe.nn.core.decode_steps import DecoderSteps
from hpcpipe.nn.core.half_table import HalfTable

# decode slots spread over at most this many times their count are read in place, wider ones gathered
_IN_PLACE_SPAN = 1.5


@dataclass(frozen=True)
class Segment:
    """The new tokens of one sequence in a forward call."""

    slot: int     # KV-cache row of this sequence, 0 <= slot < slots
    start: int    # position of the first new token (= tokens already in the cache for this slot)
    length: int   # new tokens (1 for a decode step, the prompt length for a prefill)


@dataclass
class _DecodeBatch:
    """The decode (length-1) segments of a forward call: one batched attention over their slots' caches.

    When their slots lie in a span at most _IN_PLACE_SPAN times their count, attention reads that span of the
    cache in place (a view: no copy) with the queries spread over the span's rows; otherwise it gathers their
    slots' keys and values into a scratch buffer the stage reuses.
    """

    rows: Any        # xp int64 rows of the decode tokens in the call, or None when they are all the rows
    slots: Any       # xp int64 (n,) their slots
    positions: Any   # xp int64 (n,) their tokens' positions
    n: int
    keys: int        # keys attended over: max(position) + 1
    span: slice | None   # the cache rows read in place, or None: gather ``slots``
    gather: Any      # xp int64 (n * kv * keys,) rows of the cache seen as (slots * kv * seq_len, hd) rows, or None
    order: Any       # xp int64 (n,) each token's row in the span, or None when row i is token i
    future: Any      # xp bool (rows attended, 1, 1, keys): True where a key is after the query


@dataclass
class _Plan:
    """Where the segments of one forward call sit among its rows, on the host and as xp index arrays."""

    n_rows: int
    positions: np.ndarray                # host int64 (n_rows,): each row's position in its sequence
    last_rows: Any                       # xp int64 (n_segments,), or None when every row is a segment's last
    prefill: list[tuple[int, Segment]]   # (first row, segment) of each segment longer than 1
    decode: _DecodeBatch | None
    dev_positions: Any = None            # xp copy of positions, made on first use (see DecodeStage._positions)


def _all(rows: Any) -> Any:
    """Index of the given rows, or of all rows when None."""
    return slice(None) if rows is None else rows


class DecodeStage:
    """Layer groups ``groups`` (a range of group indices, e.g. range(0, 3)) of a decoder, with a KV cache per block.

    ``model``: the decoder's model (hpcpipe.nn.core.decoder_model.DecoderModel, any kind). With a tensor-parallel
    group ``tp`` (hpcpipe.nn.core.tensor_parallel.Group) ``arrays`` hold the rank's parts of each parameter
    (hpcpipe.nn.core.sharding), the cache the rank's key/value heads, and the head stage returns the logits of
    the rank's token ids only; every tp rank of the stage calls ``forward`` with the same tokens and rows.
    """

    def __init__(self, model: Any, groups: range, arrays: dict[int, dict[str, np.ndarray]],
                 xp: Any, dtype: str, slots: int, tok_emb: Any = None, tp: Any = None):
        if not hasattr(model, "local_heads"):
            raise ValueError(f"decode stage: no KV-cached decoding for a model of type {type(model).__name__}")
        shape = model.shape
        self.steps = DecoderSteps(model, xp, tp)
        if not isinstance(groups, range) or groups.step != 1 or len(groups) == 0 \
                or groups.start < 0 or groups.stop > shape.n_groups:
            raise ValueError(f"decode stage groups {groups!r} must be a non-empty range within 0..{shape.n_groups}")
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
            raise ValueError(f"decode stage slots must be a positive integer, got {slots!r}")
        self.shape, self.groups, self.xp, self.slots = shape, groups, xp, slots
        self.dtype = np.dtype(dtype)
        params = {i: self._load_group(i, arrays) for i in groups}
        self.has_embedding = 0 in groups
        self.has_head = shape.n_blocks + 1 in groups
        self.steps.build(params, self._head_table(params, tok_emb))
        self.n_heads, self.n_kv_heads, self.head_dim = self.steps.n_heads, self.steps.n_kv_heads, self.steps.head_dim
        self.group = self.n_heads // self.n_kv_heads
        kv, t, dh = self.n_kv_heads, shape.seq_len, self.head_dim
        # one allocation: cache[b, 0] keys and cache[b, 1] values of local block b
        self._cache = xp.zeros((len(self.steps.blocks), 2, slots, kv, t, dh), dtype=self.dtype)
        self._future = xp.triu(xp.ones((t, t), dtype=bool), k=1)   # [i, j]: key j is after query i
        self._scale = 1.0 / math.sqrt(dh)
        self._scratch = None                      # (2, rows, d_head): gathered keys and values, see _gather
        self._take_mode = {"mode": "clip"} if xp is np else {}

    def _load_group(self, index: int, arrays: dict[int, dict[str, np.ndarray]]) -> dict[str, Any]:
        """Copy group ``index``'s host arrays to xp arrays of the stage's dtype, checking names and shapes."""
        group = arrays.get(index)
        if group is None:
            raise ValueError(f"decode stage: no arrays for layer group {index}")
        out = {}
        for name, dims in self.steps.group_params(index):
            if name not in group:
                raise ValueError(f"decode stage: layer group {index} has no array {name!r}")
            if tuple(group[name].shape) != dims:
                raise ValueError(f"decode stage: layer group {index} array {name!r} has shape "
                                 f"{tuple(group[name].shape)}, expected {dims}")
            if isinstance(group[name], HalfTable):    # a 16-bit embedding table, gathered from as it is
                out[name] = HalfTable(group[name].bits, group[name].kind, self.dtype).on(self.xp)
                continue
            out[name] = self.xp.ascontiguousarray(self.xp.asarray(group[name], dtype=self.dtype))
        return out

    def _head_table(self, params: dict[int, dict[str, Any]], tok_emb: Any) -> Any:
        """The table a tied head multiplies by (transposed): group 0's tok_emb or ``tok_emb`` (the rank's vocabulary
        rows under tensor parallelism); None when not needed."""
        if not self.has_head or not self.shape.tied:
            return None
        if self.has_embedding:
            table = params[0]["tok_emb"]
            return table.dense() if isinstance(table, HalfTable) else table
        if tok_emb is None:
            raise ValueError("decode stage: a tied head on a stage without layer group 0 needs tok_emb")
        want = dict(self.steps.group_params(0))["tok_emb"]
        if tuple(tok_emb.shape) != want:
            raise ValueError(f"decode stage: tok_emb has shape {tuple(tok_emb.shape)}, expected {want}")
        return self.xp.ascontiguousarray(self.xp.asarray(tok_emb, dtype=self.dtype))

    @property
    def cache_bytes(self) -> int:
        """Bytes of this stage's KV cache: 2 x local blocks x slots x n_kv_heads x seq_len x head_dim x itemsize."""
        return int(self._cache.nbytes)

    def clear_slot(self, slot: int) -> None:
        """Zero the keys and values of one slot in every local block.

        Positions past a sequence's length are masked with a weight of exactly 0, but 0 x NaN is NaN: a
        sequence whose forward overflowed leaves values that would poison the next sequence in its slot.
        """
        self._cache[:, :, slot] = 0

    def _plan(self, segments: list[Segment]) -> _Plan:
        """Check the segments and build the row and cache indices one forward call needs."""
        if not segments:
            raise ValueError("decode stage: forward needs at least one segment")
        seq_len, seen = self.shape.seq_len, set()
        for seg in segments:
            for name in ("slot", "start", "length"):
                value = getattr(seg, name)
                if not isinstance(value, int | np.integer) or isinstance(value, bool):
                    raise ValueError(f"decode stage: segment {name} must be an integer, got {value!r}")
            if not 0 <= seg.slot < self.slots:
                raise ValueError(f"decode stage: segment slot {seg.slot} out of range 0..{self.slots - 1}")
            if seg.start < 0 or seg.length < 1:
                raise ValueError(f"decode stage: segment start {seg.start} must be >= 0 and length {seg.length} >= 1")
            if seg.start + seg.length > seq_len:
                raise ValueError(f"decode stage: segment start {seg.start} + length {seg.length} = "
                                 f"{seg.start + seg.length} exceeds seq_len {seq_len} (slot {seg.slot})")
            if seg.slot in seen:
                raise ValueError(f"decode stage: slot {seg.slot} appears in two segments of one forward call")
            seen.add(seg.slot)
        xp = self.xp
        lengths = np.array([s.length for s in segments], dtype=np.int64)
        starts = np.array([s.start for s in segments], dtype=np.int64)
        firsts = np.cumsum(lengths) - lengths
        n_rows = int(lengths.sum())
        positions = np.arange(n_rows, dtype=np.int64) + np.repeat(starts - firsts, lengths)
        is_dec = lengths == 1
        all_last = bool(is_dec.all())
        prefill = [(int(firsts[i]), segments[i]) for i in np.flatnonzero(~is_dec)]
        decode = None
        if is_dec.any():
            slots = np.array([s.slot for s in segments], dtype=np.int64)[is_dec]
            decode = self._decode_batch(None if all_last else firsts[is_dec], slots, starts[is_dec])
        last_rows = None if all_last else xp.asarray(firsts + lengths - 1)
        return _Plan(n_rows, positions, last_rows, prefill, decode)

    def _decode_batch(self, rows: np.ndarray | None, slots: np.ndarray, positions: np.ndarray) -> _DecodeBatch:
        """Plan the batched attention of the decode tokens at ``rows`` (host arrays) of a forward call."""
        xp, n = self.xp, slots.size
        keys = int(positions.max()) + 1
        low, span = int(slots.min()), int(slots.max() - slots.min()) + 1
        dev_slots, dev_pos = xp.asarray(slots), xp.asarray(positions)
        future = self._future[dev_pos, :keys]
        if span > _IN_PLACE_SPAN * n:
            kv, t = self.n_kv_heads, self.shape.seq_len
            # every (slot, kv head) pair's first ``keys`` positions, as rows of head_dim values: one take per array
            gather = (((slots[:, None] * kv + np.arange(kv))[:, :, None] * t) + np.arange(keys)).reshape(-1)
            return _DecodeBatch(None if rows is None else xp.asarray(rows), dev_slots, dev_pos, n, keys, None,
                                xp.asarray(gather), None, future.reshape(n, 1, 1, keys))
        order = None
        if span != n or (slots != np.arange(low, low + span)).any():
            order = xp.asarray(slots - low)
            # the span's rows without a query attend to key 0 only: finite, and dropped afterwards
            spread = xp.ones((span, keys), dtype=bool)
            spread[:, 0] = False
            spread[order] = future
            future = spread
        return _DecodeBatch(None if rows is None else xp.asarray(rows), dev_slots, dev_pos, n, keys,
                            slice(low, low + span), None, order, future.reshape(span, 1, 1, keys))

    def _input(self, x: Any, plan: _Plan) -> Any:
        """Return the stage's first activations: embedded tokens (group 0) or the previous stage's rows."""
        xp, d = self.xp, self.shape.d_model
        if self.has_embedding:
            x = x if isinstance(x, np.ndarray) else xp.asarray(x)
            if x.shape != (plan.n_rows,) or x.dtype.kind not in "iu":
                raise ValueError(f"decode stage: expected {plan.n_rows} integer token ids, got {x.dtype} {x.shape}")
            # checked where the ids are (host ids: no device round trip), then copied to the device once
            low, high = int(x.min()), int(x.max())
            x = xp.asarray(x)
            if low < 0 or high >= self.shape.vocab:   # CuPy would wrap an out-of-range index silently
                raise ValueError(f"decode stage: token id {low if low < 0 else high} out of range "
                                 f"0..{self.shape.vocab - 1}")
            return self.steps.embed(x, lambda: self._positions(plan))
        x = xp.asarray(x)
        if x.shape != (plan.n_rows, d):
            raise ValueError(f"decode stage: expected activations of shape {(plan.n_rows, d)}, got {x.shape}")
        return x.astype(self.dtype, copy=False)

    def _positions(self, plan: _Plan) -> Any:
        """The rows' positions on xp, copied to the device once per call and only when a step asks."""
        if plan.dev_positions is None:
            plan.dev_positions = self.xp.asarray(plan.positions)
        return plan.dev_positions

    def _softmax_(self, scores: Any, future: Any) -> Any:
        """Scale, mask and softmax attention scores in place over the last axis (as CausalSelfAttention)."""
        xp = self.xp
        scores *= self._scale
        xp.copyto(scores, -xp.inf, where=future)     # exp(-inf - max) is exactly 0
        scores -= scores.max(axis=-1, keepdims=True)
        p = xp.exp(scores, out=scores)
        p /= p.sum(axis=-1, keepdims=True)
        return p

    def _attend(self, q: Any, k: Any, v: Any, cache: Any, plan: _Plan) -> Any:
        """Write the new keys and values into ``cache`` and return the attention heads (n_rows, n_heads * head_dim).

        ``q``: (n_rows, n_heads, head_dim), ``k`` and ``v``: (n_rows, n_kv_heads, head_dim), any strides.
        """
        xp, n = self.xp, plan.n_rows
        kv, grp, dh = self.n_kv_heads, self.group, self.head_dim
        keys, values = cache[0], cache[1]
        heads = xp.empty((n, kv, grp, dh), dtype=q.dtype)
        for first, seg in plan.prefill:
            new, length = slice(first, first + seg.length), seg.length
            end = seg.start + length
            keys[seg.slot, :, seg.start:end] = k[new].transpose(1, 0, 2)
            values[seg.slot, :, seg.start:end] = v[new].transpose(1, 0, 2)
            # the group's query heads stacked along the rows: one product per kv head (a view when the group is 1)
            qs = q[new].reshape(length, kv, grp, dh).transpose(1, 2, 0, 3).reshape(kv, grp * length, dh)
            scores = qs @ keys[seg.slot, :, :end].swapaxes(-1, -2)                # (kv, grp * length, end)
            p = self._softmax_(scores.reshape(kv, grp, length, end), self._future[seg.start:end, :end])
            out = p.reshape(kv, grp * length, end) @ values[seg.slot, :, :end]
            heads[new] = out.reshape(kv, grp, length, dh).transpose(2, 0, 1, 3)
        if plan.decode is not None:
            heads[_all(plan.decode.rows)] = self._attend_decode(q, k, v, keys, values, plan.decode)
        return heads.reshape(n, kv * grp * dh)

    def _attend_decode(self, q: Any, k: Any, v: Any, keys: Any, values: Any, dec: _DecodeBatch) -> Any:
        """Write the decode tokens' keys and values and return their attention heads (n, kv, group, head_dim)."""
        xp = self.xp
        n, kv, grp, dh = dec.n, self.n_kv_heads, self.group, self.head_dim
        rows = _all(dec.rows)
        keys[dec.slots, :, dec.positions] = k[rows]
        values[dec.slots, :, dec.positions] = v[rows]
        q = q[rows].reshape(n, kv, grp, dh)                            # a kv head's queries against its keys
        if dec.span is None:
            k, v = self._gather(keys, values, dec)                     # (n, kv, keys, dh) each
        else:
            k, v = keys[dec.span, :, :dec.keys], values[dec.span, :, :dec.keys]   # views of the cache
            if dec.order is not None:
                spread = xp.zeros((k.shape[0], kv, grp, dh), dtype=q.dtype)
                spread[dec.order] = q
                q = spread
        p = self._softmax_(q @ k.swapaxes(-1, -2), dec.future)        # (rows, kv, grp, keys)
        out = p @ v
        if dec.order is not None:
            out = out[dec.order]
        return out

    def _gather(self, keys: Any, values: Any, dec: _DecodeBatch) -> tuple[Any, Any]:
        """Copy the decode slots' keys and values up to ``dec.keys`` into the stage's scratch (grown when short).

        Fancy indexing would allocate two fresh arrays of that size per block, and NumPy's large allocations
        cost a page fault per 4 KiB page each time (measured: 3x the whole step with 32 sequences).
        """
        xp, dh = self.xp, self.head_dim
        rows = dec.gather
        n_rows = rows.shape[0]
        if self._scratch is None or self._scratch.shape[1] < n_rows:
            self._scratch = xp.empty((2, n_rows, dh), dtype=self.dtype)
        out = []
        for source, buf in zip((keys, values), self._scratch, strict=True):
            # NumPy buffers ``out`` under the default mode "raise"; the rows are in range by construction
            xp.take(source.reshape(-1, dh), rows, axis=0, out=buf[:n_rows], **self._take_mode)
            out.append(buf[:n_rows].reshape(dec.n, self.n_kv_heads, dec.keys, dh))
        return tuple(out)

    def forward(self, x: Any, segments: list[Segment]) -> Any:
        """Run the stage over the new tokens of several sequences at once.

        ``x``: int64 token ids (n_rows,) on the stage holding group 0, else activations (n_rows, d_model), rows
        in segment order. Returns logits (len(segments), vocab) after each segment's last new token on the
        stage holding the head, else C-contiguous activations (n_rows, d_model).
        """
        plan = self._plan(segments)
        h = self._input(x, plan)
        steps = self.steps
        context = steps.prepare(lambda: self._positions(plan))
        for index, cache in enumerate(self._cache):
            h = steps.block(index, h, context, lambda q, k, v, cache=cache: self._attend(q, k, v, cache, plan))
        if not self.has_head:
            return self.xp.ascontiguousarray(h)
        if plan.last_rows is not None:
            h = h[plan.last_rows]
        return steps.head_logits(h)
