"""The simulator's vectorised path: sweep a schedule's timeline arrays tick by tick, all ranks at once."""

from __future__ import annotations

import numpy as np

from hpcpipe.errors import ScheduleError
from hpcpipe.schedule.costs import Costs, SimResult, finite
from hpcpipe.schedule.ir import COMPUTE_OPS, IDLE, Action, B, F, Timeline, W, chunk_stage, stage_rank
from hpcpipe.schedule.validate_timeline import check_timeline_values


def simulate_timeline(timeline: Timeline, costs: Costs, block: int = 64) -> SimResult:
    """Simulate a schedule from its timeline arrays: what simulate(lower(actions)) gives, vectorised over ranks.

    Step time, bubble, busy time and peak stash are those :func:`simulate`
    computes for the lowered action lists (each end time by the same
    floating-point operations, so they are bit-identical); ``events`` is None.
    Messages are matched by (stage, micro-batch), which is the order of each
    channel for any timeline that passes :func:`validate_timeline`. Costs must
    be finite.

    An action ends at max(end of its rank's previous action, end of the
    action whose output it receives + comm) + its cost: a longest path over
    the ranks' chains and the message edges. The timeline's ticks order that
    graph (a message's producer has an earlier tick than its consumer), so one
    sweep over the ticks, with the ranks as one NumPy vector, computes every
    end time: at each tick every rank reads its input's end time from an
    array indexed by (producer stage, micro-batch), takes the max with its own
    clock, adds its cost and writes its own end time. That is a handful of
    vector operations per tick (2(m + p - 1) ticks for GPipe and 1F1B),
    whatever the number of actions. The array starts at +inf, so an input
    read before it was written poisons its rank's clock: a timeline out of
    dependency order raises ScheduleError instead of returning a wrong number.
    """
    if not finite(costs):
        raise ScheduleError(f"simulate_timeline needs finite costs, got {costs}")
    if block < 1:
        raise ScheduleError(f"block must be a positive number of ticks, got {block}")
    check_timeline_values(timeline)     # an out-of-range micro-batch would read another row's cell
    sweep = _Sweep(timeline, costs)
    if not sweep.run(block):
        sweep.run(block, find_error=True)   # raises, naming the first action that read an unwritten input
        raise ScheduleError(f"{timeline.name} timeline is not in dependency order")   # (not reached)
    pp = timeline.pp
    busy = sweep.busy.tolist()
    clock = sweep.clock + costs.step / 2    # ALLREDUCE, then OPT_STEP, as simulate() adds them
    clock += costs.step / 2
    step_time = max(clock.tolist())
    idle = pp * step_time - sum(busy)
    peak, peak_stage = timeline_peaks(timeline)
    return SimResult(step_time, idle / (pp * step_time) if step_time else 0.0, busy, peak, peak_stage, None)


def timeline_peaks(timeline: Timeline, ranks_per_pass: int = 16) -> tuple[list[int], dict[int, int]]:
    """Peak number of micro-batches whose activations each rank and each stage holds (F takes, B and W release).

    Only the order of each rank's actions matters, so this is a running sum
    along the tick axis, a few ranks at a time into reused buffers.
    """
    pp, v = timeline.pp, timeline.virtual
    if ranks_per_pass < 1:
        raise ScheduleError(f"ranks_per_pass must be a positive integer, got {ranks_per_pass}")
    ranks = np.arange(pp)
    rows = min(ranks_per_pass, pp)
    shape = (rows, timeline.n_ticks)
    is_op, delta, mine = np.empty(shape, bool), np.empty(shape, np.int8), np.empty(shape, np.int8)
    running, mine_running = np.empty(shape, np.int32), np.empty(shape, np.int32) if v > 1 else None
    peak = np.zeros(pp, np.int32)
    peak_stage = np.zeros((v, pp), np.int32)
    for r0 in range(0, pp, rows):
        ops = timeline.ops[r0:r0 + rows]
        n = len(ops)
        d, on, run = delta[:n], is_op[:n], running[:n]
        np.equal(ops, F, out=d, casting="unsafe")
        d -= np.equal(ops, B, out=on)
        d -= np.equal(ops, W, out=on)
        np.cumsum(d, axis=1, out=run).max(axis=1, out=peak[r0:r0 + n])
        if v > 1:
            chunk = timeline.chunk[r0:r0 + rows]
            mine_run = mine_running[:n]
            for c in range(v - 1):
                np.multiply(d, np.equal(chunk, c, out=on), out=mine[:n])
                np.cumsum(mine[:n], axis=1, out=mine_run).max(axis=1, out=peak_stage[c, r0:r0 + n])
                run -= mine_run
            # what is left of the rank's running sum is the last chunk's (integers: exact), one cumsum fewer
            run.max(axis=1, out=peak_stage[v - 1, r0:r0 + n])
    if v == 1:
        peak_stage[0] = peak
    stages = [chunk_stage(c, ranks, pp, timeline.placement).tolist() for c in range(v)]
    return peak.tolist(), {s: int(n) for c in range(v) for s, n in zip(stages[c], peak_stage[c].tolist(), strict=True)}


class _Sweep:
    """The tick-by-tick sweep of simulate_timeline and the tables it reads (one instance per simulation)."""

    def __init__(self, timeline: Timeline, costs: Costs) -> None:
        self.tl = timeline
        self.comm = costs.comm
        pp, v, n_micro = timeline.pp, timeline.virtual, timeline.n_micro
        n_stages = pp * v
        # End times live in one flat array of rows of n_micro cells: F of stage s in row n_stages - 1 - s,
        # B or I of stage s in row n_stages + 1 + s, so an action's input is always the next row (the
        # same cell of it). Rows n_stages and 2 n_stages + 1 are the -inf "inputs" of stage 0's F and the
        # last stage's B; W's and idle ticks write into row `sink`, whose next row is -inf as well. A row
        # is padded to an odd number of 64-byte lines so that the ranks' rows spread over the cache sets.
        self.row = n_micro + (8 - n_micro) % 16
        sink = 2 * n_stages + 2
        # Per-rank lookup tables by code = (op + 1) * v + chunk (IDLE -> 0), flattened with rank * width.
        width = 5 * v
        ranks = np.arange(pp)
        self.code_base = ranks * width + v
        keys = np.full((pp, width), sink * self.row, np.intp)
        cost = np.zeros((pp, width))
        # comm per (rank, code): 0 where the input comes from the same rank (the V's turn on rank pp - 1),
        # as simulate() adds no message there; needed only when some but not all hand-overs are local
        self.comm_of = np.full((pp, width), self.comm) if self.comm else None
        for c in range(v):
            stage = chunk_stage(c, ranks, pp, timeline.placement)
            keys[:, v + c] = (n_stages - 1 - stage) * self.row
            keys[:, 2 * v + c] = keys[:, 3 * v + c] = (n_stages + 1 + stage) * self.row
            for op in range(4):
                cost[:, (op + 1) * v + c] = [costs.of(COMPUTE_OPS[op], s) for s in stage.tolist()]
            if self.comm_of is not None:
                src_f = [stage_rank(s - 1, pp, timeline.placement) if s > 0 else -1 for s in stage.tolist()]
                src_b = [stage_rank(s + 1, pp, timeline.placement) if s < n_stages - 1 else -1
                         for s in stage.tolist()]
                self.comm_of[:, v + c] = np.where(np.array(src_f) == ranks, 0.0, self.comm)
                self.comm_of[:, 2 * v + c] = self.comm_of[:, 3 * v + c] = np.where(np.array(src_b) == ranks, 0.0,
                                                                                      self.comm)
        self.local = self.comm_of is not None and bool((self.comm_of == 0).any())
        self.keys, self.cost = keys, cost
        self.n_rows = 2 * n_stages + 4
        self.minus_inf_rows = (n_stages, 2 * n_stages + 1, sink + 1)
        self.clock = np.zeros(pp)
        self.busy = np.zeros(pp)
        self.narrow = np.int16 if width < 2 ** 15 else np.intp     # holds op * v + chunk, -v .. 4v - 1

    def run(self, block: int, find_error: bool = False) -> bool:
        """Sweep all ticks; False if some rank read an input that no earlier tick wrote."""
        tl = self.tl
        pp, v = tl.pp, tl.virtual
        row, comm = self.row, self.comm
        end = np.full(self.n_rows * row, np.inf)     # +inf: not computed yet
        for r in self.minus_inf_rows:
            end[r * row:(r + 1) * row] = -np.inf
        inputs = end[row:]                       # inputs[k] is end[k + row], the input of the cell at k
        clock, nxt = np.zeros(pp), np.empty(pp)
        messages = pp > 1                        # with one rank every stage hands over locally
        # reused every block (fresh temporaries would page-fault every block). A block's tables are
        # computed in the timeline's own (rank, tick) layout, where every read is contiguous, and only
        # the two the sweep reads, key and cost, are transposed to a row per tick: transposed reads of
        # the narrow ops / chunk / micro-batch arrays cost more than all the arithmetic
        base = self.code_base[:, None]
        local_buf = np.empty((pp, block), self.narrow)
        code_buf = np.empty((pp, block), np.intp)
        key_rm, cost_rm = np.empty((pp, block), np.intp), np.empty((pp, block))
        comm_rm = np.empty((pp, block)) if self.local else None
        key_buf = np.empty((block, pp), np.intp)
        cost_buf = np.empty((block, pp))
        comm_buf = np.empty((block, pp)) if self.local else None
        busy = np.zeros(pp)
        for t0 in range(0, tl.n_ticks, block):
            cols = slice(t0, t0 + block)
            n = min(block, tl.n_ticks - t0)
            code = code_buf[:, :n]
            if v > 1:
                local = np.multiply(tl.ops[:, cols], self.narrow(v), out=local_buf[:, :n])
                local += tl.chunk[:, cols]
                np.add(local, base, out=code)
            else:
                np.add(tl.ops[:, cols], base, out=code)
            # "wrap" skips numpy's buffered bounds check; simulate_timeline checked every value's range
            key = self.keys.take(code, out=key_rm[:, :n], mode="wrap")
            key += tl.mb[:, cols]
            key = key_buf[:n]
            key[...] = key_rm[:, :n].T
            cost = cost_buf[:n]
            cost[...] = self.cost.take(code, out=cost_rm[:, :n], mode="wrap").T
            if comm_buf is not None:
                comm_buf[:n] = self.comm_of.take(code, out=comm_rm[:, :n], mode="wrap").T
            for t in range(n):
                if messages:
                    k = key[t]
                    inputs.take(k, out=nxt, mode="wrap")
                    if comm_buf is not None:
                        nxt += comm_buf[t]
                    elif comm:
                        nxt += comm
                    np.maximum(nxt, clock, out=nxt)
                    nxt += cost[t]
                    end[k] = nxt
                else:
                    np.add(clock, cost[t], out=nxt)
                busy += cost[t]                  # simulate()'s busy += cost, in the same order
                clock, nxt = nxt, clock
                if find_error and not np.isfinite(clock).all():
                    self._raise_unready(t0 + t, int(np.flatnonzero(~np.isfinite(clock))[0]))
            if not np.isfinite(clock).all():
                return False
        self.clock, self.busy = clock, busy
        return True

    def _raise_unready(self, tick: int, rank: int) -> None:
        tl = self.tl
        op = COMPUTE_OPS[int(tl.ops[rank, tick])] if tl.ops[rank, tick] != IDLE else "IDLE"
        stage = int(chunk_stage(int(tl.chunk[rank, tick]), rank, tl.pp, tl.placement))
        action = Action(op, stage, int(tl.mb[rank, tick]))
        source = stage_rank(stage - 1 if op == "F" else stage + 1, tl.pp, tl.placement)
        raise ScheduleError(f"{tl.name} timeline is not in dependency order: rank {rank} runs {action} at "
                            f"tick {tick}, but its input from rank {source} is not computed at an earlier "
                            f"tick (or at all)")
