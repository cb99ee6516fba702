"""KV-cached forward of one pipeline stage of a decoder (GPT or Llama kind) over the new tokens of many sequences.

A ``DecodeStage`` holds a contiguous range of layer groups and, per local
block, a paged key and value cache (hpcpipe.nn.core.kv_pages: KV blocks of
``kv_block`` positions from one pool, a block table per slot; GPT: n_kv_heads
= n_heads): a slot is one sequence, position j of it holds the key (value) of
that sequence's token j in the KV block its table names. Each ``forward`` call
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
(prefill) segments attend one by one, over tiles (hpcpipe.nn.core.flash): a
long prompt never holds its (length, length) scores. On the CPU (NumPy, float32, any tp)
the compiled kernels run the same stage in one call per step instead
(:mod:`hpcpipe.nn.core.fused_stage`), with the weights kept in the stage's
weight format. Layout and sizing: docs/decode.md.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from hpcpipe.kernels.formats import FORMATS, RowWeight
from hpcpipe.nn.core.decode_plan import CallPlan, DecodeBatch, Segment, all_rows, plan_call
from hpcpipe.nn.core.decode_steps import DecoderSteps
from hpcpipe.nn.core.flash import flash_forward
from hpcpipe.nn.core.fused_stage import FusedStage, compiled_available
from hpcpipe.nn.core.half_table import HalfTable
from hpcpipe.nn.core.kv_pages import PagedLayout, stage_rings
from hpcpipe.nn.core.stage_weights import compact_choice, compact_matrix, compact_table, shared_table, widened


class DecodeStage:
    """Layer groups ``groups`` (a range of group indices, e.g. range(0, 3)) of a decoder, with a KV cache per block.

    ``model``: the decoder's model (hpcpipe.nn.core.decoder_model.DecoderModel, any kind). With a tensor-parallel
    group ``tp`` (hpcpipe.nn.core.tensor_parallel.Group) ``arrays`` hold the rank's parts of each parameter
    (hpcpipe.nn.core.sharding), the cache the rank's key/value heads, and the head stage returns the logits of
    the rank's token ids only; every tp rank of the stage calls ``forward`` with the same tokens and rows.
    With an expert-parallel group ``ep`` (hpcpipe.runtime.expert_comm.ExpertGroup) ``arrays`` hold the rank's
    experts, and each forward (or :meth:`join`) exchanges rows with the ep peers', which call it in step.

    ``weight_format`` (float32 | stored | q8_0, hpcpipe.kernels.formats) says how the weights are kept; the
    arrays are float (in, out) or :class:`hpcpipe.kernels.formats.RowWeight` (out, in) as stored. ``compiled``:
    run the compiled kernels (hpcpipe.nn.core.fused_stage), the NumPy steps, or (None) the compiled ones when
    available; the NumPy steps compute with the weights widened to the stage's dtype, or kept as stored
    (``compact``; None: on a GPU in weight format stored or q8_0, hpcpipe.nn.core.stage_weights). ``release``: drop each
    block's arrays from ``arrays`` once built (a loader's copies: the peak stays one block above the weights).
    ``kv_block``: positions per KV block; ``kv_blocks``: KV blocks in the pool (None: every slot's whole context,
    each slot owning its own; otherwise a caller sets the slots' tables with :meth:`set_pages`). ``kv_ring``:
    KV blocks of each slot's ring for the windowed blocks (hpcpipe.nn.core.kv_pages.ring_layout; 0: every block
    keeps its keys in the pool), whose caller writes no further ahead than the ring holds (serve.kv_ledger.room).
    """

    def __init__(self, model: Any, groups: range, arrays: dict[int, dict[str, Any]],
                 xp: Any, dtype: str, slots: int, tok_emb: Any = None, tp: Any = None,
                 weight_format: str = "float32", compiled: bool | None = None, release: bool = False,
                 ep: Any = None, kv_block: int = 16, kv_blocks: int | None = None, kv_ring: int = 0,
                 compact: bool | None = None):
        if not hasattr(model, "local_heads"):
            raise ValueError(f"decode stage: no KV-cached decoding for a model of type {type(model).__name__}")
        shape = model.shape
        self.steps = DecoderSteps(model, xp, tp, ep)
        if not isinstance(groups, range) or groups.step != 1 or len(groups) == 0 \
                or groups.start < 0 or groups.stop > shape.n_groups:
            raise ValueError(f"decode stage groups {groups!r} must be a non-empty range within 0..{shape.n_groups}")
        self.paged = PagedLayout(slots, shape.seq_len, kv_block, kv_blocks)
        if weight_format not in FORMATS:
            raise ValueError(f"decode stage: weight format {weight_format!r} is not one of {', '.join(FORMATS)}")
        if compiled and not compiled_available(xp, dtype, tp, model):
            raise ValueError("decode stage: the compiled kernels run NumPy float32 stages of a model whose blocks "
                             "they compute (not experts; under tp, a rank's query heads split evenly over its "
                             "key/value heads), and only when built (pip install with a C compiler)")
        self.compiled = compiled_available(xp, dtype, tp, model) if compiled is None else compiled
        self.compact = compact_choice(compact, xp, dtype, weight_format, model, self.compiled)
        self.shape, self.groups, self.xp, self.slots = shape, groups, xp, slots
        self.dtype = np.dtype(dtype)
        self.weight_format = weight_format
        self.has_embedding = 0 in groups
        self.has_head = shape.n_blocks + 1 in groups
        self.n_heads, self.n_kv_heads, self.head_dim = self.steps.n_heads, self.steps.n_kv_heads, self.steps.head_dim
        self.group = self.n_heads // self.n_kv_heads
        kv, dh = self.n_kv_heads, self.head_dim
        self.windows = [model.window(i) for i in groups if 1 <= i <= shape.n_blocks]   # per local block
        self.rings = stage_rings(kv_ring, self.windows, slots, shape.seq_len, self.paged.page)
        ringed = [self.rings is not None and w > 0 for w in self.windows]
        self._fused = None
        if self.compiled:
            for i in groups:
                self._check_group(i, arrays)
            self._fused = FusedStage(model, groups, arrays, weight_format, self.paged, self._tied_table(tok_emb),
                                     release, self.steps.tp, self.rings)
            self._cache, self._ring_cache = self._fused.cache, self._fused.ring_cache
        else:
            params = {i: self._load_group(i, arrays) for i in groups}
            self.steps.build(params, self._head_table(params, tok_emb))
            # one allocation: cache[b, 0] keys and cache[b, 1] values of local block b, (kv, pages, page, dh) each
            self._cache = self.paged.allocate(xp, self.dtype, ringed.count(False), kv, dh)
            self._ring_cache = None if self.rings is None else \
                self.rings.allocate(xp, self.dtype, ringed.count(True), kv, dh)
        # each local block's cache: the pool's, or (a windowed block beside full ones) its rings'
        taken = {False: 0, True: 0}
        self._block_caches = []
        for ring in ringed:
            self._block_caches.append((self._ring_cache if ring else self._cache)[taken[ring]])
            taken[ring] += 1
        self._ringed = ringed
        self._scale = 1.0 / math.sqrt(dh)
        self._scratch = None                      # gathered keys and values of the decode rows, see _gather
        self._take_mode = {"mode": "clip"} if xp is np else {}

    def _check_group(self, index: int, arrays: dict[int, dict[str, Any]]) -> dict[str, Any]:
        """Return group ``index``'s arrays after checking their names and shapes ((out, in) for a RowWeight)."""
        group = arrays.get(index)
        if group is None:
            raise ValueError(f"decode stage: no arrays for layer group {index}")
        for name, dims in self.steps.group_params(index):
            if name not in group:
                raise ValueError(f"decode stage: layer group {index} has no array {name!r}")
            value = group[name]
            got = tuple(value.shape)[::-1] if isinstance(value, RowWeight) and name != "tok_emb" else tuple(value.shape)
            if got != dims:
                raise ValueError(f"decode stage: layer group {index} array {name!r} has shape {got}, expected {dims}")
        return group

    def _load_group(self, index: int, arrays: dict[int, dict[str, Any]]) -> dict[str, Any]:
        """Copy group ``index``'s host arrays to xp arrays of the stage's dtype, checking names and shapes."""
        group = self._check_group(index, arrays)
        out = {}
        for name, _ in self.steps.group_params(index):
            value = group[name]
            if isinstance(value, HalfTable):    # a 16-bit embedding table, gathered from as it is
                out[name] = HalfTable(value.bits, value.kind, self.dtype).on(self.xp)
                continue
            if name == "tok_emb" and self.compact:
                table = shared_table(value, self.weight_format, self.dtype, self.xp)
                if table is not None:          # gathered from (and a tied head's) as stored: one 16-bit copy
                    out[name] = table
                    continue
            product = compact_matrix(name, value, self.weight_format, self.xp) if self.compact else None
            if product is not None:
                out[name] = product
                continue
            value = widened(name, value, self.weight_format, self.dtype)
            out[name] = self.xp.ascontiguousarray(self.xp.asarray(value, dtype=self.dtype))
        return out

    def _tied_table(self, tok_emb: Any) -> Any:
        """``tok_emb`` for a tied head on a stage without group 0, checked; None when not needed."""
        if not self.has_head or not self.shape.tied or self.has_embedding:
            return None
        if tok_emb is None:
            raise ValueError("decode stage: a tied head on a stage without layer group 0 needs tok_emb")
        want = dict(self.steps.group_params(0))["tok_emb"]
        if tuple(tok_emb.shape) != want:
            raise ValueError(f"decode stage: tok_emb has shape {tuple(tok_emb.shape)}, expected {want}")
        return tok_emb

    def _head_table(self, params: dict[int, dict[str, Any]], tok_emb: Any) -> Any:
        """The table a tied head multiplies by (transposed): group 0's tok_emb or ``tok_emb`` (the rank's vocabulary
        rows under tensor parallelism); None when not needed."""
        if not self.has_head or not self.shape.tied:
            return None
        if self.compact:
            table = params[0]["tok_emb"] if self.has_embedding else self._tied_table(tok_emb)
            return compact_table(table, self.weight_format, self.xp, self.has_embedding)
        if self.has_embedding:
            table = params[0]["tok_emb"]
            return table.dense() if isinstance(table, HalfTable) else table
        table = self._tied_table(tok_emb)
        if isinstance(table, HalfTable):
            table = RowWeight(table.kind, table.bits)
        return self.xp.ascontiguousarray(self.xp.asarray(widened("tok_emb", table, self.weight_format, self.dtype),
                                                         dtype=self.dtype))

    @property
    def cache_bytes(self) -> int:
        """Bytes of this stage's KV cache: 2 x local blocks x KV blocks x kv_block x n_kv_heads x head_dim x
        itemsize."""
        return int(self._cache.nbytes) + self.ring_bytes

    @property
    def ring_bytes(self) -> int:
        """Bytes of the windowed blocks' rings (0 without): 2 x windowed blocks x slots x kv_ring x kv_block x
        n_kv_heads x head_dim x itemsize."""
        return 0 if self._ring_cache is None else int(self._ring_cache.nbytes)

    def set_pages(self, slot: int, first: int, pages: list[int]) -> None:
        """Give ``slot`` the KV blocks ``pages`` as its blocks ``first``, ``first + 1``, ... (checked).

        A table from block 0 starts a sequence: its rings are zeroed (a failed sequence's NaN, masked by a weight
        of 0, must not reach the NumPy attention of the next; see :meth:`clear_pages`)."""
        self.paged.set_pages(slot, first, pages)
        if first == 0:
            self._clear_rings(slot)

    def _clear_rings(self, slot: int) -> None:
        """Zero ``slot``'s rings in every windowed block (none without rings)."""
        if self.rings is not None:
            ring = self.rings.tables[slot, 0]
            self._ring_cache[:, :, :, ring:ring + self.rings.pages // self.slots] = 0

    def clear_pages(self, pages: list[int]) -> None:
        """Zero the keys and values of these KV blocks in every local block.

        Positions past a sequence's length are masked with a weight of exactly 0, but 0 x NaN is NaN: a
        sequence whose forward overflowed leaves values that would poison the next sequence in its KV blocks.
        """
        if len(pages) and self._cache.shape[0]:
            self._cache[:, :, :, self.xp.asarray(np.asarray(pages, dtype=np.int64))] = 0

    def clear_slot(self, slot: int) -> None:
        """Zero the KV blocks of one slot's table (and its rings) in every local block (see :meth:`clear_pages`)."""
        self.clear_pages(self.paged.tables[slot])
        self._clear_rings(slot)

    def _input(self, x: Any, plan: CallPlan) -> Any:
        """Return the stage's first activations: embedded tokens (group 0) or the previous stage's rows."""
        if self.has_embedding:
            return self.steps.embed(self.xp.asarray(self._token_ids(x, plan)), lambda: self._positions(plan))
        return self._activations(x, plan).astype(self.dtype, copy=False)

    def _token_ids(self, x: Any, plan: CallPlan) -> Any:
        """The call's token ids, checked where they are (host ids: no device round trip)."""
        x = x if isinstance(x, np.ndarray) else self.xp.asarray(x)
        if x.shape != (plan.n_rows,) or x.dtype.kind not in "iu":
            raise ValueError(f"decode stage: expected {plan.n_rows} integer token ids, got {x.dtype} {x.shape}")
        low, high = int(x.min()), int(x.max())
        if low < 0 or high >= self.shape.vocab:   # CuPy would wrap an out-of-range index silently
            raise ValueError(f"decode stage: token id {low if low < 0 else high} out of range "
                             f"0..{self.shape.vocab - 1}")
        return x

    def _activations(self, x: Any, plan: CallPlan) -> Any:
        """The previous stage's rows, checked."""
        x = self.xp.asarray(x)
        if x.shape != (plan.n_rows, self.shape.d_model):
            raise ValueError(f"decode stage: expected activations of shape {(plan.n_rows, self.shape.d_model)}, got "
                             f"{x.shape}")
        return x

    def _positions(self, plan: CallPlan) -> Any:
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

    def _attend(self, q: Any, k: Any, v: Any, cache: Any, plan: CallPlan, window: int = 0) -> Any:
        """Write the new keys and values into ``cache`` and return the attention heads (n_rows, n_heads * head_dim).

        ``q``: (n_rows, n_heads, head_dim), ``k`` and ``v``: (n_rows, n_kv_heads, head_dim), any strides.
        """
        xp, n = self.xp, plan.n_rows
        kv, grp, dh = self.n_kv_heads, self.group, self.head_dim
        keys, values = cache[0], cache[1]                     # (kv, pages, page, dh) each
        heads = xp.empty((n, kv, grp, dh), dtype=q.dtype)
        for pre in plan.prefill:
            seg, length = pre.segment, pre.segment.length
            new, end = slice(pre.first, pre.first + length), seg.start + length
            keys[:, pre.blocks, pre.offsets] = k[new].transpose(1, 0, 2)
            values[:, pre.blocks, pre.offsets] = v[new].transpose(1, 0, 2)
            # the sequence's KV blocks in order, as one (kv, positions, dh) run of keys and of values
            seen_k = keys[:, pre.pages].reshape(kv, -1, dh)[:, :end]
            seen_v = values[:, pre.pages].reshape(kv, -1, dh)[:, :end]
            # each kv head's query heads, time-major rows: tiles with an online softmax, never (length, end) scores
            qs = q[new].reshape(length, kv, grp, dh).transpose(1, 0, 2, 3).reshape(kv, length * grp, dh)
            out, _ = flash_forward(xp, qs, seen_k, seen_v, self._scale, grp, seg.start, window=window)
            heads[new] = out.reshape(kv, length, grp, dh).transpose(1, 0, 2, 3)
        if plan.decode is not None:
            heads[all_rows(plan.decode.rows)] = self._attend_decode(q, k, v, keys, values, plan.decode, window)
        return heads.reshape(n, kv * grp * dh)

    def _attend_decode(self, q: Any, k: Any, v: Any, keys: Any, values: Any, dec: DecodeBatch,
                       window: int = 0) -> Any:
        """Write the decode tokens' keys and values and return their attention heads (n, kv, group, head_dim)."""
        xp = self.xp
        n, kv, grp, dh = dec.n, self.n_kv_heads, self.group, self.head_dim
        rows = all_rows(dec.rows)
        keys[:, dec.blocks, dec.offsets] = k[rows].transpose(1, 0, 2)
        values[:, dec.blocks, dec.offsets] = v[rows].transpose(1, 0, 2)
        q = q[rows].reshape(n, kv, grp, dh)                            # a kv head's queries against its keys
        k, v = self._gather(keys, values, dec)                         # (n, kv, keys, dh) each
        hidden = dec.future
        if window:         # keys more than ``window`` positions back are hidden too (a sliding-window block)
            old = xp.arange(dec.keys)[None, :] <= (dec.row_positions - window)[:, None]
            hidden = hidden | old.reshape(hidden.shape)
        p = self._softmax_(q @ k.swapaxes(-1, -2), hidden)           # (n, kv, grp, keys)
        return p @ v

    def _gather(self, keys: Any, values: Any, dec: DecodeBatch) -> tuple[Any, Any]:
        """Copy the decode sequences' KV blocks into the stage's scratch (grown when short): (n, kv, keys, dh) views.

        One ``take`` of whole KV blocks per array. Fancy indexing would allocate two fresh arrays of that size
        per block, and NumPy's large allocations cost a page fault per 4 KiB page each time (measured: 3x the
        whole step with 32 sequences).
        """
        xp, dh, kv, page = self.xp, self.head_dim, self.n_kv_heads, self.paged.page
        if dec.strided is not None and keys.strides[1] == page * keys.strides[2]:
            return self._grid_view(keys, dec), self._grid_view(values, dec)
        m = dec.gather.shape[0]
        size = kv * m * page * dh
        if self._scratch is None or self._scratch.size < 2 * size:
            self._scratch = xp.empty(2 * size, dtype=self.dtype)
        out = []
        for index, source in enumerate((keys, values)):
            buf = self._scratch[index * size:(index + 1) * size].reshape(kv, m, page, dh)
            # NumPy buffers ``out`` under the default mode "raise"; the KV blocks are in range by construction
            xp.take(source, dec.gather, axis=1, out=buf, **self._take_mode)
            out.append(buf.reshape(kv, dec.n, dec.keys, dh).transpose(1, 0, 2, 3))
        return out[0], out[1]

    def _grid_view(self, source: Any, dec: DecodeBatch) -> Any:
        """The decode sequences' keys (or values) as a strided (n, kv, keys, dh) view of the cache, no copy.

        A kv head's KV blocks are consecutive in memory (``(kv, pages, page, dh)``), so sequence i's positions
        are ``dec.keys`` rows from block ``first + i * step``: one view spans them all.
        """
        first, step = dec.strided
        lowest = first + min(0, (dec.n - 1) * step)    # sequences in falling block order: view them rising
        run = source[:, lowest:]                       # a view whose first element is the lowest sequence's
        s_kv, s_page, s_pos, s_dim = run.strides
        view = self.xp.lib.stride_tricks.as_strided(
            run, shape=(dec.n, self.n_kv_heads, dec.keys, self.head_dim),
            strides=(abs(step) * s_page, s_kv, s_pos, s_dim))
        return view if step >= 0 else view[::-1]

    def join(self) -> None:
        """An expert-parallel step with no rows here (an idle serving replica): the stage's sparse blocks still
        exchange with their ep peers, whose forward of the same step needs this rank's experts."""
        self.steps.join()

    def forward(self, x: Any, segments: list[Segment], rows: list[int] | None = None) -> Any:
        """Run the stage over the new tokens of several sequences at once.

        ``x``: int64 token ids (n_rows,) on the stage holding group 0, else activations (n_rows, d_model), rows
        in segment order. Returns logits (len(segments), vocab) after each segment's last new token on the
        stage holding the head (``rows``: after these rows of the call instead, e.g. every prompt token's for
        their log-probabilities), else C-contiguous activations (n_rows, d_model).
        """
        plan = plan_call(segments, self.paged, self.xp, self._fused is None)
        rings = plan_call(segments, self.rings, self.xp) if self.rings is not None and self._fused is None else None
        if rows is not None:
            bad = [r for r in rows if not 0 <= r < plan.n_rows]
            if bad:
                raise ValueError(f"decode stage: logit row {bad[0]} out of range 0..{plan.n_rows - 1}")
            plan.last_rows = self.xp.asarray(np.asarray(rows, dtype=np.int64))
        if self._fused is not None:
            return self._forward_fused(x, plan, segments)
        return self._through(self._input(x, plan), plan, rings)

    def _through(self, h: Any, plan: CallPlan, rings: CallPlan | None) -> Any:
        """The NumPy steps' blocks and head over the first activations ``h`` (what a captured graph replays)."""
        steps = self.steps
        context = steps.prepare(lambda: self._positions(plan))
        for index, cache in enumerate(self._block_caches):
            window, at = self.windows[index], rings if self._ringed[index] else plan
            h = steps.block(index, h, context,
                            lambda q, k, v, c=cache, w=window, p=at: self._attend(q, k, v, c, p, w))
        if not self.has_head:
            return self.xp.ascontiguousarray(h)
        if plan.last_rows is not None:
            h = h[plan.last_rows]
        return steps.head_logits(h)

    def _forward_fused(self, x: Any, plan: CallPlan, segments: list[Segment]) -> np.ndarray:
        """forward through the compiled kernels: the embedding, every block in one call, the head."""
        fused = self._fused
        if self.has_embedding:
            ids = self._token_ids(x, plan)
            h = fused.embed(ids, plan.positions)
        else:
            h = self._activations(x, plan)
            h = np.array(h, dtype=np.float32, order="C")    # a private copy: the blocks update it in place
        fused.blocks(h, plan.row_slots, plan.positions)
        if not self.has_head:
            return h
        if plan.last_rows is not None:
            h = h[plan.last_rows]
        return fused.logits(h)
