"""Running a set-up inference (collective): load each stage's layers, stream micro-batches, commit the output.

Rows go to replicas and land in the output as documented in
:mod:`hpcpipe.infer.rows`; the streaming itself is :mod:`hpcpipe.infer.stream`,
the report :mod:`hpcpipe.infer.report`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hpcpipe.errors import EXIT_FAILURE, EXIT_INTERRUPTED, ConfigError, HpcpipeError
from hpcpipe.infer.report import summarize
from hpcpipe.infer.rows import (
    RowReader,
    RowWriter,
    commit,
    create_output,
    discard,
    replica_micro_batches,
    temporary_name,
)
from hpcpipe.infer.setup import InferSetup, prepare
from hpcpipe.infer.stop_outcome import StopRequested, stop_message
from hpcpipe.infer.stream import StreamStage
from hpcpipe.nn.core.activations import make_activation
from hpcpipe.nn.registry import model_specs
from hpcpipe.runtime.comm import (
    ABORT_GRACE_S,
    Poller,
    abort,
    barrier,
    broadcast,
    gather_to_root,
    together,
)
from hpcpipe.runtime.faults import fault_step
from hpcpipe.runtime.mpi_probes import clock_offset
from hpcpipe.runtime.stop_notice import StopNotice, StoppablePoller, StreamStopped
from hpcpipe.runtime.topology import make_topology
from hpcpipe.state import collective as checkpoint_mpi
from hpcpipe.state.outputs import INFER_FORMAT
from hpcpipe.trace import inference_trace, write_json

if TYPE_CHECKING:
    from mpi4py.MPI import Comm

    from hpcpipe.runtime.topology import Topology


def _stage_layers(p: InferSetup, arrays: dict[int, dict[str, np.ndarray]], stage: int) -> list[tuple]:
    specs = model_specs(p.config)
    dtype = p.config.model.dtype
    out = []
    for i in p.stage_ranges[stage]:
        bias = arrays[i].get("bias")
        out.append((np.ascontiguousarray(arrays[i]["weight"], dtype=dtype),
                    None if bias is None else np.ascontiguousarray(bias, dtype=dtype),
                    make_activation(specs[i].activation)))
    return out


def _build_stage(p: InferSetup, topo: Topology, poller: Poller, arrays: dict, tmp: Path,
                 offset: int | None) -> StreamStage:
    cfg = p.config
    inf, dims, dtype = cfg.infer, cfg.model.dims, np.dtype(cfg.model.dtype)
    stage = topo.pp_rank
    first, last = stage == 0, stage == p.pp - 1
    r = p.stage_ranges[stage]
    return StreamStage(
        layers=_stage_layers(p, arrays, stage),
        micro_batches=replica_micro_batches(p.n_rows, inf.micro_batch_size, p.dp, topo.dp_rank),
        n_rows=p.n_rows, batch=inf.micro_batch_size, slots=inf.buffers, dtype=dtype,
        in_width=dims[r.start], out_width=dims[r.stop],
        reader=RowReader(p.input, inf.x, inf.micro_batch_size, dtype) if first else None,
        writer=RowWriter(tmp, offset, dims[-1] * dtype.itemsize) if last else None,
        pp_comm=topo.pp_comm, prev=topo.prev, next=topo.next, poller=poller)


def execute(p: InferSetup, comm: Comm, stop: Any = None) -> dict[str, Any]:
    """Run a set-up inference on every rank of comm (collective); return the report on every rank.

    Errors before streaming (unreadable weights, output not creatable) are
    agreed on and raised as AgreedError on every rank, and nothing is left at
    the output path. A failure while streaming on one rank aborts comm
    (MPI_Abort), since its neighbours would wait for it forever. ``stop`` (the
    command's StopSignals) makes a stop signal on any rank end the stream on
    every rank: StopRequested on every rank, nothing committed (infer.stopping).
    """
    t_begin = time.perf_counter()
    cfg = p.config
    topo = make_topology(comm, p.dp, p.pp)
    poller = Poller(cfg.run.poll_min_us, cfg.run.poll_max_us)
    rank = comm.Get_rank()
    stage: StreamStage | None = None
    tmp: Path | None = None
    notice = StopNotice(comm, stop) if stop is not None else None
    stream_poller = poller if notice is None else \
        StoppablePoller(cfg.run.poll_min_us, cfg.run.poll_max_us, notice.check)
    try:
        # every rank knows the temporary output's name from the start: a rank interrupted before the stream
        # removes it itself (the job's abort may kill rank 0 before its finally clause runs)
        tmp = Path(broadcast(comm, str(temporary_name(p.output)) if rank == 0 else None))
        _stop_if_asked(notice, poller, p.output)    # a stop during start-up: before the weights load ...
        arrays = checkpoint_mpi.load(comm, poller, p.weights, list(p.stage_ranges[topo.pp_rank]),
                                     with_optimizer=False).arrays
        _stop_if_asked(notice, poller, p.output)    # ... and before the full-size output is created
        offset = None
        # (the finally clause below removes a half-created output)
        with together(comm, poller, 2, lambda e: f"cannot create output file {str(tmp)!r} (for {p.output!r}): {e}"):
            if rank == 0:
                attrs = {"format": INFER_FORMAT, "weights": str(p.weights.path), "step": p.weights.step,
                         "input": p.input, "model": json.dumps(cfg.to_dict()["model"], sort_keys=True)}
                offset = create_output(tmp, p.n_rows, cfg.model.dims[-1], cfg.model.dtype, cfg.infer.y, attrs)
        offset = broadcast(comm, offset)
        # e.g. MemoryError or an unreadable input on one rank
        with together(comm, poller, 1, lambda e: f"rank {rank} ({topo.name}) cannot start: {type(e).__name__}: {e}"):
            stage = _build_stage(p, topo, stream_poller, arrays, tmp, offset)
        stage.fault_at = fault_step(rank)
        if notice is not None:
            stage.stopped = notice.check
        shift = clock_offset(topo.cart, poller)   # our own communicator: no clash with the caller's tags
        barrier(comm, poller)
        t_start = time.perf_counter()
        left_early = False
        try:
            events = stage.run()
        except StreamStopped:
            left_early = True
            stage.abandon()   # before agreeing: a neighbour may still be sending into this rank's buffers
        except BaseException as exc:  # noqa: BLE001 - neighbours wait on this rank: end the job, never hang
            _abort_stream(comm, topo.name, exc, tmp, p.output)
            raise
        if notice is not None:
            every = notice.agree(poller, left_early)
            if any(early for early, _ in every):   # some rank stopped: the output is incomplete everywhere
                if not left_early:
                    stage.abandon()
                stage = None
                raise StopRequested(stop_message(every, p.output, os.path.lexists(p.output)))
        stage_done, stage = stage, None
        with together(comm, poller, 1, lambda e: f"rank {rank} ({topo.name}) cannot finish writing {str(tmp)!r}: {e}"):
            stage_done.close()
        with together(comm, poller, 1, lambda e: f"cannot rename {str(tmp)!r} to {p.output!r}: {e}"):
            if rank == 0:
                try:
                    commit(tmp, Path(p.output))
                except ConfigError:   # a file appeared at the output path meanwhile: the result is kept, and named
                    tmp = None
                    raise
        tmp = None
        recv_wait, send_wait = stage_done.waits()
        part = {"rank": rank, "dp_rank": topo.dp_rank, "pp_rank": topo.pp_rank, "last": topo.next < 0,
                "mbs": stage_done.mbs, "rows": [r for _, r in stage_done.rows], "events": events + shift,
                "start": t_start + shift, "end": stage_done.end_time + shift,
                "recv_wait": recv_wait, "send_wait": send_wait, "cpu_s": stage_done.cpu_s}
        parts = gather_to_root(comm, part)
        report = None
        if rank == 0:
            report = summarize(parts, p.n_rows, cfg.infer.micro_batch_size, p.dp, p.pp)
            report.update(output=p.output, weights=str(p.weights.path), step=p.weights.step,
                          setup_s=t_start - t_begin, total_s=time.perf_counter() - t_begin)
            if p.trace:
                try:
                    write_json(p.trace, inference_trace(parts), "trace", "trace path")
                    report["trace"] = p.trace
                except (OSError, HpcpipeError) as exc:   # the results are written: a lost trace is not worth failing
                    report["trace_error"] = f"cannot write trace {p.trace!r}: {exc}"
                    print(f"hpcpipe: warning: {report['trace_error']}", file=sys.stderr, flush=True)
        return broadcast(comm, report)
    except KeyboardInterrupt:
        # Ctrl-C on this rank ends the job (the command aborts it), which may kill rank 0 before its finally
        # clause runs, even while it creates the temporary output: remove it now and once more after the
        # grace the abort gives a starting file operation anyway
        if tmp is not None and comm.Get_size() > 1:
            for pause in (0.0, ABORT_GRACE_S):
                time.sleep(pause)
                try:
                    discard(tmp)
                except OSError:
                    pass
        raise
    finally:
        if stage is not None:   # an agreed error after the stage was built: release what it holds
            try:
                stage.close()
            except OSError:
                pass
        if rank == 0 and tmp is not None:
            discard(tmp)
        if notice is not None:
            notice.close()
        topo.free()


def _stop_if_asked(notice: StopNotice | None, poller: Poller, output: str) -> None:
    """Raise StopRequested on every rank if a stop signal reached any rank so far (collective; setup only)."""
    if notice is None:
        return
    every = notice.agree(poller, notice.check())
    if any(stopped for stopped, _ in every):
        raise StopRequested(stop_message(every, output, os.path.lexists(output), started=False))


def _abort_stream(comm: Comm, name: str, exc: BaseException, tmp: Path, output: str) -> None:
    """A rank failed or was interrupted mid-stream: say so, remove the temporary output, end the job now."""
    if comm.Get_size() == 1:
        return   # one process: the exception ends the command, execute's finally removes the temporary
    if isinstance(exc, KeyboardInterrupt):
        print(f"hpcpipe: [{name}] interrupted (SIGINT) while streaming: nothing written at {output!r}; "
              f"ending the job (exit status {EXIT_INTERRUPTED})", file=sys.stderr, flush=True)
    else:
        print(f"hpcpipe: [{name}] error while streaming: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    try:   # the abort ends every rank, rank 0's finally clause too: remove it now
        discard(tmp)
    except OSError:
        pass
    abort(comm, EXIT_INTERRUPTED if isinstance(exc, KeyboardInterrupt) else EXIT_FAILURE)


def run(weights: str | Path, input: str | Path, output: str | Path, *, comm: Comm = None,
        config: str | Path | dict[str, Any] | None = None, overrides: list[str] | tuple[str, ...] = (),
        trace: str = "") -> dict[str, Any]:
    """Infer the outputs of `input`'s rows with the model in `weights` into `output` (collective over comm).

    Every rank of ``comm`` (default: MPI.COMM_WORLD) calls it with the same
    arguments. ``config`` is a TOML path or a dict of sections (e.g.
    ``{"parallel": {"pp": 2}, "infer": {"micro_batch_size": 64}}``),
    ``overrides`` are ``section.key=value`` strings as ``--set`` takes.
    Returns the report (rows/s, latency, fill/drain, bubble, ...) on every
    rank. Raises ConfigError (identically on every rank) for a bad
    configuration or input, AgreedError when the ranks agreed on a failure.
    """
    if comm is None:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
    return execute(prepare(weights, input, output, comm.Get_size(), config, overrides, trace), comm)
