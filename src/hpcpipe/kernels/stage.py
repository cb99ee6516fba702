"""A decode stage's blocks laid out for the compiled stage step: one C call runs every block over the new rows.

The kind says what its blocks are made of (:class:`FusedKind`: norm, MLP, RoPE; :class:`FusedBlock`: the
block's norms, fused q|k|v, output projection, fused gate|up or fc, down projection, biases, q/k norms)
and where its KV cache lives; :class:`StagePlan` keeps the ctypes structs and the arrays they point to
alive together, and a scratch buffer grown to the largest call. The KV cache is paged: each block's keys and
values are (n_kv, pages, page, head_dim) and a row finds its sequence's KV block of position t in
``tables[slot, t // page]`` (hpcpipe.nn.core.decode, docs/decode.md). Under tensor parallelism the blocks hold
the rank's heads and ff slice, and ``reduce`` (the tp group's in-place sum) is called from C on each block's two
row-parallel partial products.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hpcpipe.kernels.cpu import REDUCE, Block, Stage, library, weight_struct
from hpcpipe.kernels.formats import RowWeight

_NORMS = {"rms": 0, "layer": 1}
_ACTS = {"swiglu": 0, "gelu": 1}


@dataclass(frozen=True)
class FusedKind:
    """What every block of a stage computes: ``norm`` rms | layer, ``act`` swiglu | gelu, RoPE or not, epsilons."""

    norm: str
    act: str
    rope: bool
    eps: float
    qk_eps: float = 1e-6


@dataclass
class FusedBlock:
    """One block's parameters for the compiled step (vectors float32; None where the kind has none)."""

    norm1_w: np.ndarray
    norm1_b: np.ndarray | None
    qkv: RowWeight                   # q | k | v rows
    qkv_b: np.ndarray | None
    o: RowWeight
    o_b: np.ndarray | None
    norm2_w: np.ndarray
    norm2_b: np.ndarray | None
    up: RowWeight                    # swiglu: gate | up rows; gelu: fc
    up_b: np.ndarray | None
    down: RowWeight
    down_b: np.ndarray | None
    q_norm_w: np.ndarray | None = None
    k_norm_w: np.ndarray | None = None
    window: int = 0                  # > 0: a row attends to its sequence's last ``window`` positions only

    @property
    def nbytes(self) -> int:
        """Bytes held by the block's parameters."""
        vectors = (self.norm1_w, self.norm1_b, self.qkv_b, self.o_b, self.norm2_w, self.norm2_b, self.up_b,
                   self.down_b, self.q_norm_w, self.k_norm_w)
        return sum(w.nbytes for w in (self.qkv, self.o, self.up, self.down)) + sum(
            v.nbytes for v in vectors if v is not None)


def _vector(v: np.ndarray | None) -> np.ndarray | None:
    return None if v is None else np.ascontiguousarray(v, dtype=np.float32)


def _check_cache(cache: np.ndarray, n: int, n_kv: int, hd: int, tables: np.ndarray, seq_len: int) -> None:
    """Raise ValueError unless ``cache`` holds ``n`` blocks' paged keys and values read through ``tables``."""
    blocks, two, kv, _, page, width = cache.shape
    if (blocks, two, kv, width) != (n, 2, n_kv, hd) or cache.dtype != np.float32 or not cache.flags.c_contiguous:
        raise ValueError(f"stage plan: cache of shape {cache.shape} {cache.dtype} does not hold {n} "
                         f"blocks of {n_kv} kv heads of {hd}")
    if tables.dtype != np.int64 or not tables.flags.c_contiguous or tables.shape[1] * page < seq_len:
        raise ValueError(f"stage plan: block tables {tables.dtype} {tables.shape} do not cover {seq_len} "
                         f"positions in blocks of {page}")


class StagePlan:
    """Every block of a decode stage as one ``hp_stage``: ``forward`` runs them all over the rows in one call."""

    def __init__(self, kind: FusedKind, blocks: list[FusedBlock], d: int, n_heads: int, n_kv: int, hd: int, ff: int,
                 cache: np.ndarray, rope: tuple[np.ndarray, np.ndarray] | None, tables: np.ndarray, seq_len: int,
                 reduce: Callable[[np.ndarray], object] | None = None,
                 ring: tuple[np.ndarray, np.ndarray] | None = None):
        self.lib = library()
        if self.lib is None:
            raise RuntimeError("stage plan: the compiled kernels are not available")
        # ``ring``: (cache, tables) of the windowed blocks (window > 0), which then keep their keys apart
        ringed = [ring is not None and b.window > 0 for b in blocks]
        _check_cache(cache, ringed.count(False), n_kv, hd, tables, seq_len)
        if ring is not None:
            _check_cache(ring[0], ringed.count(True), n_kv, hd, ring[1], seq_len)
            if ring[1].shape != tables.shape or ring[0].shape[4] != cache.shape[4]:
                raise ValueError(f"stage plan: ring tables {ring[1].shape} of blocks of {ring[0].shape[4]} do not "
                                 f"match the stage's {tables.shape} of {cache.shape[4]}")
        pages, page = cache.shape[3], cache.shape[4]
        slots, max_pages = tables.shape
        self.d, self.slots, self.seq_len = d, slots, seq_len
        self.tables = tables                          # the stage's, updated in place: the struct points at it
        self.cache = cache
        self._keep: list = [blocks, ring]                 # every array a struct points to stays alive with the plan
        self.rope = None if rope is None else tuple(np.ascontiguousarray(t, dtype=np.float32) for t in rope)
        self._blocks = (Block * len(blocks))()
        used = {False: 0, True: 0}                    # blocks placed so far in the stage's cache and in the rings
        for i, b in enumerate(blocks):
            store, own = ring if ringed[i] else (cache, None)
            where = store[used[ringed[i]]].ctypes.data
            used[ringed[i]] += 1
            vectors = {name: _vector(getattr(b, name)) for name in ("norm1_w", "norm1_b", "qkv_b", "o_b", "norm2_w",
                                                                    "norm2_b", "up_b", "down_b", "q_norm_w",
                                                                    "k_norm_w")}
            self._keep.append(vectors)
            addr = {name: (None if v is None else v.ctypes.data) for name, v in vectors.items()}
            self._blocks[i] = Block(addr["norm1_w"], addr["norm1_b"], weight_struct(b.qkv), addr["qkv_b"],
                                    addr["q_norm_w"], addr["k_norm_w"], weight_struct(b.o), addr["o_b"],
                                    addr["norm2_w"], addr["norm2_b"], weight_struct(b.up), addr["up_b"],
                                    weight_struct(b.down), addr["down_b"], where, b.window,
                                    None if own is None else own.ctypes.data, 0 if own is None else store.shape[3])
        cos, sin = self.rope if self.rope is not None else (None, None)
        self._stage = Stage(len(blocks), d, n_heads, n_kv, hd, ff, slots, seq_len, _NORMS[kind.norm],
                            _ACTS[kind.act], int(kind.rope), 0, kind.eps, kind.qk_eps, 1.0 / np.sqrt(hd), 0.0,
                            None if cos is None else cos.ctypes.data, None if sin is None else sin.ctypes.data,
                            ctypes.cast(self._blocks, ctypes.POINTER(Block)), page, pages, max_pages,
                            tables.ctypes.data)
        self._failed: list[BaseException] = []
        if reduce is not None:
            self._reduce = REDUCE(self._reducer(reduce))     # the plan keeps the callback alive as long as C uses it
            self._stage.reduce = self._reduce
        self._scratch = np.empty(0, dtype=np.float32)

    def _reducer(self, reduce: Callable[[np.ndarray], object]) -> Callable[[int, int, int], int]:
        """hp_stage.reduce calling ``reduce`` on the n floats at x; an exception stops the stage (ctypes would only
        print it) and is raised again by :meth:`forward`."""
        def call(ctx: int, x: int, n: int) -> int:
            try:
                # the partial products are in the scratch: a slice of it is a cheaper view than a new one of x
                first = (x - self._scratch.ctypes.data) // 4
                rows = self._scratch[first:first + n] if 0 <= first <= self._scratch.size - n else \
                    np.ctypeslib.as_array(ctypes.cast(x, ctypes.POINTER(ctypes.c_float)), shape=(n,))
                reduce(rows)
            except BaseException as exc:        # noqa: BLE001 - handed back to forward's caller
                self._failed.append(exc)
                return 1
            return 0
        return call

    def forward(self, h: np.ndarray, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Run every block over the rows ``h`` (m, d) float32 in place; row i writes and reads its sequence's cache
        at ``slots[i]`` up to ``positions[i]`` (int64). Returns h."""
        m = h.shape[0]
        if h.dtype != np.float32 or h.shape != (m, self.d) or not h.flags.c_contiguous:
            raise ValueError(f"stage plan: expected C-contiguous float32 rows of {self.d}, got {h.dtype} {h.shape}")
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        if slots.shape != (m,) or positions.shape != (m,):
            raise ValueError(f"stage plan: {m} rows need {m} slots and positions, got {slots.shape} {positions.shape}")
        need = int(self.lib.hp_scratch_floats(ctypes.byref(self._stage), m))
        if self._scratch.size < need:
            self._scratch = np.empty(need, dtype=np.float32)
        status = self.lib.hp_stage_forward(ctypes.byref(self._stage), h.ctypes.data, m, slots.ctypes.data,
                                           positions.ctypes.data, self._scratch.ctypes.data)
        if self._failed:
            raise self._failed.pop()
        if status:
            raise ValueError(f"stage plan: a row's slot or position is outside {self.slots} slots of {self.seq_len}")
        return h


def attend(qkv: np.ndarray, cache: np.ndarray, tables: np.ndarray, slots: np.ndarray, positions: np.ndarray,
           n_heads: int, n_kv: int, seq_len: int, window: int = 0) -> np.ndarray:
    """Run the compiled attention step alone (tests): write the rows' keys and values of ``qkv`` ((m, (H + 2 K) hd)
    float32 rows, q | k | v) into ``cache`` ((2, K, pages, page, hd) float32, in place) at ``slots``, ``positions``
    through ``tables``, and return each row's heads (m, H hd) over its sequence up to its position."""
    lib = library()
    two, kv, pages, page, hd = cache.shape
    m = qkv.shape[0]
    if (two, kv) != (2, n_kv) or cache.dtype != np.float32 or not cache.flags.c_contiguous \
            or qkv.dtype != np.float32 or qkv.shape != (m, (n_heads + 2 * n_kv) * hd) or not qkv.flags.c_contiguous:
        raise ValueError(f"attend: qkv {qkv.dtype} {qkv.shape} and cache {cache.dtype} {cache.shape} do not hold "
                         f"{n_heads} heads and {n_kv} kv heads")
    slots_, max_pages = tables.shape
    tables = np.ascontiguousarray(tables, dtype=np.int64)
    slots = np.ascontiguousarray(slots, dtype=np.int64)
    positions = np.ascontiguousarray(positions, dtype=np.int64)
    if slots.shape != (m,) or positions.shape != (m,) or (slots < 0).any() or (slots >= slots_).any() \
            or (positions < 0).any() or (positions >= min(seq_len, max_pages * page)).any() \
            or (tables < 0).any() or (tables >= pages).any():
        raise ValueError("attend: a slot, position or block table entry is outside the cache")
    stage = Stage(0, 0, n_heads, n_kv, hd, 0, slots_, seq_len, 0, 0, 0, 0, 0.0, 0.0, 1.0 / np.sqrt(hd), 0.0,
                  None, None, None, page, pages, max_pages, tables.ctypes.data)
    scratch = np.empty(int(lib.hp_scratch_floats(ctypes.byref(stage), m)), dtype=np.float32)
    pointers = 2 * seq_len * ((ctypes.sizeof(ctypes.c_void_p) + 3) // 4)      # stage.c's layout: pointers first
    heads = np.empty((m, n_heads * hd), dtype=np.float32)
    fn = lib.hp_attend
    fn.argtypes = [ctypes.POINTER(Stage), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = None
    fn(ctypes.byref(stage), cache.ctypes.data, qkv.ctypes.data, m, slots.ctypes.data, positions.ctypes.data, window,
       heads.ctypes.data, scratch[pointers:].ctypes.data, scratch.ctypes.data)
    return heads
