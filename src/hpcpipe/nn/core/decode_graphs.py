"""A decode stage's decode-only steps replayed from captured graphs (as vLLM replays CUDA graphs for decoding).

On a GPU a decode step of the NumPy steps is hundreds of small kernel launches, each a few microseconds of
Python and driver time for a few microseconds of work. :class:`GraphedStage` wraps a
:class:`~hpcpipe.nn.core.decode.DecodeStage`. A call whose segments are all one new token (and that asks for no
logit rows) replays a graph captured once per shape: (rows, KV blocks attended, rounded up to a power of two,
the padding hidden by the mask). Before each replay the call's tokens (or activations), positions, cache places
and block tables are copied into that graph's own buffers (the integers in one copy; the mask is made inside).
Any other call (a prompt, logit rows) runs the stage as it is, on the same KV cache.

On CuPy a graph is captured on a non-blocking stream of its own, from a memory pool of its own: its
temporaries keep their addresses between replays and nothing else allocates there. The step runs eagerly once
first, which compiles every kernel and fills the pool. Events order that stream with the caller's current stream
both ways (its inputs and cache writes before a fill, the replay before the caller's next work), whatever stream
that is: the legacy default stream's implicit ordering would hold only for it, not for a caller's own stream or
per-thread default streams (CUPY_CUDA_PER_THREAD_DEFAULT_STREAM), and while a blocking stream captures, any use of
the legacy stream (by any thread) invalidates the capture.
On NumPy a "capture" keeps the step as a function and a "replay" calls it again over the same buffers and the
same plan object. Every host value the step read when captured (shapes, the plan's Python fields) comes again
from the capture's plan, as in a replayed GPU graph. So the CPU tests catch a step that depends on anything but
its buffers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from hpcpipe.nn.core.decode_plan import CallPlan, DecodeBatch, plan_call

KEPT = 32         # graphs a stage keeps (the least recently replayed is dropped first)


def graph_problem(stage: Any) -> str | None:
    """Why a decode stage's steps cannot be replayed from graphs (None: they can)."""
    if stage.compiled:
        return "a compiled CPU stage already runs a step in one call"
    if stage.steps.tp is not None:
        return "tensor parallelism sums over MPI inside every block"
    if stage.steps.ep is not None or not stage.steps.model.fusable():
        return "experts route their rows on the host"
    if stage.rings is not None:
        return "ring caches of windowed blocks (serve.kv_ring) are planned per call"
    return None


def pages_bucket(npages: int, most: int) -> int:
    """KV blocks a graph attends over for sequences needing ``npages``: the next power of two, at most ``most``."""
    return min(1 << (npages - 1).bit_length(), most)


def _put(dst: Any, src: Any) -> None:
    """Copy ``src`` (host, or on dst's device) into the buffer ``dst`` in place."""
    if isinstance(dst, np.ndarray) or not isinstance(src, np.ndarray):
        dst[...] = src
    else:
        dst.set(np.ascontiguousarray(src, dtype=dst.dtype))


class StaticStep:
    """One captured shape's buffers: the step's input and the plan it reads, refilled in place before a replay.

    The integers (token ids, cache places, positions, block tables) share one buffer, so a fill is one copy to the
    device (and the activations' on a later stage); the mask is made inside the step from the positions."""

    def __init__(self, stage: Any, n: int, npages: int):
        xp, page = stage.xp, stage.paged.page
        self.npages, self.keys = npages, npages * page
        sizes = {"ids": n if stage.has_embedding else 0, "blocks": n, "offsets": n, "positions": n,
                 "gather": n * npages}
        total = sum(sizes.values())
        self._host, self._ints = np.zeros(total, dtype=np.int64), xp.zeros(total, dtype=np.int64)
        self.host, dev, at = {}, {}, 0
        for name, size in sizes.items():
            self.host[name], dev[name] = self._host[at:at + size], self._ints[at:at + size]
            at += size
        self.input = dev["ids"] if stage.has_embedding else xp.zeros((n, stage.shape.d_model), dtype=stage.dtype)
        self._key_index = xp.arange(self.keys, dtype=np.int64)
        positions = dev["positions"]
        batch = DecodeBatch(None, dev["blocks"], dev["offsets"], n, self.keys, dev["gather"],
                            xp.zeros((n, 1, 1, self.keys), dtype=bool), positions)
        # host positions and slots stay the capture's: a replay never reads them (dev_positions is set)
        self.plan = CallPlan(n, np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64), None, [], batch, positions)

    def fill(self, x: Any, host: CallPlan, paged: Any) -> None:
        """Copy one call's input (checked) and its rows' places and block tables into the buffers."""
        slots, positions = host.row_slots, host.positions
        out = self.host
        if out["ids"].size:      # token ids given on the device come to the host buffer first (one small copy)
            out["ids"][:] = x if isinstance(x, np.ndarray) else x.get()
        out["blocks"][:], out["offsets"][:] = paged.where(slots, positions)
        out["positions"][:] = positions
        # the bucket's padding blocks (masked) read the row's first block again, not what a stale table entry names
        # (another sequence's block: a weight of 0 times its Inf or NaN is NaN, which eager steps never read alone)
        table = paged.tables[slots, :self.npages]
        own = np.arange(self.npages)[None, :] <= (positions // paged.page)[:, None]
        out["gather"][:] = np.where(own, table, table[:, :1]).reshape(-1)
        _put(self._ints, self._host)
        if not out["ids"].size:
            _put(self.input, x)

    def mask(self, xp: Any) -> None:
        """Hide each row's keys after its position (inside the step: from the positions on the device)."""
        batch = self.plan.decode
        n = batch.n
        xp.greater(self._key_index[None, :], batch.row_positions[:, None], out=batch.future.reshape(n, self.keys))


class HostReplay:
    """NumPy: the step kept as a function; a replay calls it again (over the capture's buffers and plan)."""

    def __init__(self, step: Callable[[], Any]):
        self.step = step

    def replay(self) -> Any:
        """Run the step; return its output."""
        return self.step()


class CudaReplay:
    """CuPy: the step captured into a CUDA graph on ``stream`` from ``pool``, after one eager run."""

    def __init__(self, step: Callable[[], Any], xp: Any, stream: Any, pool: Any):
        with xp.cuda.using_allocator(pool.malloc), stream:
            step()                        # eager once: compiles the kernels, leaves the pool its blocks
            stream.begin_capture()
            try:
                out = step()
            except BaseException:
                try:
                    stream.end_capture()
                except Exception:         # an invalidated capture says so here too; the step's error is the one
                    pass
                raise
            self.graph = stream.end_capture()
        self.out, self.stream = out, stream

    def replay(self) -> Any:
        """Launch the graph; return a copy of its output (the next replay overwrites the graph's own)."""
        with self.stream:
            self.graph.launch(self.stream)
            return self.out.copy()


class GraphedStage:
    """A decode stage whose decode-only calls replay captured graphs; every other call and attribute is the
    stage's own."""

    def __init__(self, stage: Any, kept: int = KEPT):
        problem = graph_problem(stage)
        if problem is not None:
            raise ValueError(f"decode graphs: not for this stage: {problem}")
        if isinstance(kept, bool) or not isinstance(kept, int) or kept < 1:
            raise ValueError(f"decode graphs: graphs kept must be a positive integer, got {kept!r}")
        self.stage, self.kept = stage, kept
        self._graphs: OrderedDict[tuple[int, int], tuple[StaticStep, Any, Any]] = OrderedDict()
        self.captured = self.replayed = 0
        self._stream = self._pool = self._events = None
        if stage.xp is not np:
            cuda = stage.xp.cuda
            self._stream = cuda.Stream(non_blocking=True)      # ordered with the caller's stream by events only
            self._pool = cuda.MemoryPool()
            self._events = (cuda.Event(disable_timing=True), cuda.Event(disable_timing=True))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stage, name)

    def forward(self, x: Any, segments: list, rows: list[int] | None = None) -> Any:
        """The stage's forward (same arguments and result); decode-only calls from a graph."""
        stage = self.stage
        if rows is not None or not segments or any(getattr(s, "length", None) != 1 for s in segments):
            return stage.forward(x, segments, rows)
        host = plan_call(segments, stage.paged, np, attention=False)        # the segments checked
        x = stage._token_ids(x, host) if stage.has_embedding else stage._activations(x, host)
        page, most = stage.paged.page, stage.paged.max_pages
        key = (host.n_rows, pages_bucket(int(host.positions.max()) // page + 1, most))
        entry = self._graphs.get(key)
        static = StaticStep(stage, *key) if entry is None else entry[0]    # new buffers zeroed on the caller's stream
        with self._ordered():
            static.fill(x, host, stage.paged)
            if entry is None:
                entry = (static, self._capture(static), stage._scratch)    # the scratch a graph writes stays alive
                self.captured += 1
                self._graphs[key] = entry
                while len(self._graphs) > self.kept:
                    self._graphs.popitem(last=False)
            else:
                self._graphs.move_to_end(key)
            out = entry[1].replay()
        self.replayed += 1
        return out

    @contextmanager
    def _ordered(self) -> Iterator[None]:
        """Run the body on the graph stream, after the caller's current stream's work so far (the inputs, the new
        buffers, prompts' cache writes) and before its later work (reading the output, freeing the inputs, reusing
        their memory, writing the cache). NumPy: no streams."""
        if self._stream is None:
            yield
            return
        ready, done = self._events
        caller = self.stage.xp.cuda.get_current_stream()
        self._stream.wait_event(caller.record(ready))
        try:
            with self._stream:
                yield
        finally:
            caller.wait_event(self._stream.record(done))

    def _capture(self, static: StaticStep) -> Any:
        stage = self.stage

        def step() -> Any:
            static.mask(stage.xp)
            h = stage.steps.embed(static.input, lambda: static.plan.dev_positions) if stage.has_embedding \
                else static.input
            return stage._through(h, static.plan, None)

        if self._stream is None:
            return HostReplay(step)
        return CudaReplay(step, stage.xp, self._stream, self._pool)
