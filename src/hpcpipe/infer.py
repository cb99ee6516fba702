"""``python -m hpcpipe.infer`` and ``hpcpipe.infer.run``: forward-only pipeline-parallel inference over MPI.

    mpiexec -n 4 python -m hpcpipe.infer --weights PATH --input in.h5 --output out.h5
    mpiexec -n 8 python -m hpcpipe.infer --weights checkpoints --input in.h5 --output out.h5 --set parallel.pp=4

The model (dims, bias, activation, final_activation, dtype) is the one
stored with the weights; ``--config``/``--set`` may restate it but not
contradict it. Any (dp, pp) layout reads weights saved at any layout: each
rank reads only its stage's layers. Rows go to replicas and land in the
output as documented in :mod:`hpcpipe.infer_io`; the streaming itself is
:mod:`hpcpipe.infer_engine`, the report :mod:`hpcpipe.infer_report`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import checkpoint_mpi
from .checkpoint import WeightsSource, resolve_weights
from .cli import CommandParser, run_planned
from .comm import Poller, abort, barrier, broadcast, clock_offset, gather_to_root, together
from .config import Config, from_dict, load_raw, resolve_layout
from .errors import ConfigError
from .faults import fault_step
from .infer_engine import StreamStage
from .infer_io import (
    RowReader,
    RowWriter,
    check_input,
    check_output,
    commit,
    create_output,
    discard,
    replica_micro_batches,
    temporary_name,
)
from .infer_report import format_summary, summarize
from .layers import make_activation
from .model import layer_specs, partition
from .topology import make_topology
from .trace import inference_trace, write_json

# model keys the weights decide; the config may repeat them but not contradict them
MODEL_KEYS = ("dims", "bias", "activation", "final_activation", "dtype")

DESCRIPTION = """Run a trained MLP forward over the rows of an HDF5 dataset with pipeline (pp) x data (dp)
parallelism over MPI, streaming micro-batches; write the outputs, in input order, to one HDF5 file.
World size must equal dp x pp (default pp=4, dp=world/pp). The model is the one stored with the weights."""

EPILOG = """examples:
  mpiexec -n 4 python -m hpcpipe.infer --weights model.h5 --input in.h5 --output out.h5
  mpiexec -n 8 python -m hpcpipe.infer --weights checkpoints --input in.h5 --output out.h5 --set parallel.pp=4
  mpiexec -n 2 python -m hpcpipe.infer --weights ck/step-00000100 --input in.h5 --output out.h5 \\
      --set parallel.pp=2 --set infer.micro_batch_size=256 --trace infer-trace.json

exit status: 0 success, 1 a rank failed while running, 2 bad configuration or input (nothing is written
at the output path)."""


@dataclass(frozen=True)
class InferPlan:
    """Everything decided before the first collective (identical on every rank)."""

    config: Config
    dp: int
    pp: int
    stage_ranges: list[range]
    weights: WeightsSource
    input: str
    output: str
    n_rows: int
    trace: str = ""      # Chrome-trace file to write ("" = none)


def model_from_weights(raw: dict[str, Any], stored: dict[str, Any], label: str) -> dict[str, Any]:
    """Return raw config sections with the model keys taken from the weights; ConfigError on a contradiction."""
    raw = {name: dict(values) if isinstance(values, dict) else values for name, values in raw.items()}
    model = raw.setdefault("model", {})
    if not isinstance(model, dict):
        raise ConfigError(f"[model] must be a table of keys, got {model!r}")
    for key in MODEL_KEYS:
        if key not in stored:
            continue
        if key in model and model[key] != stored[key]:
            raise ConfigError(f"model.{key} = {model[key]!r} in the configuration does not match {label}, which "
                              f"was saved with model.{key} = {stored[key]!r}")
        model[key] = stored[key]
    return raw


def plan(weights: str | Path, input: str | Path, output: str | Path, world_size: int,
         config: str | Path | dict[str, Any] | None = None, overrides: list[str] | tuple[str, ...] = (),
         trace: str = "", report: str = "") -> InferPlan:
    """Check weights, config, layout, input, output, trace and report paths locally; raise ConfigError naming what is wrong.

    Nothing the run writes (output, trace, report) may be the input, the
    weights file, or lie inside the checkpoint the weights come from (the
    directory given as --weights, the one holding a given ``latest`` file,
    and the resolved step directory).
    """
    source = resolve_weights(weights)
    raw = load_raw(None, overrides) if isinstance(config, dict) or config is None else load_raw(config, overrides)
    if isinstance(config, dict):
        base = {name: dict(values) for name, values in config.items()}
        for name, values in raw.items():
            base.setdefault(name, {}).update(values)
        raw = base
    cfg = from_dict(model_from_weights(raw, source.model, source.describe()))
    if cfg.parallel.virtual_stages != 1:
        raise ConfigError(f"inference runs one stage per rank: parallel.virtual_stages must be 1, got "
                          f"{cfg.parallel.virtual_stages}")
    dp, pp = resolve_layout(cfg, world_size)
    specs = layer_specs(cfg)
    ranges = partition(specs, pp, cfg.parallel.stage_layers)
    source.check(specs)
    n_rows = check_input(input, cfg.infer.x, cfg.model.dims[0])
    files, dirs = weights_protection(weights, source)
    check_output(output, input, files, dirs)
    trace = trace or cfg.log.trace
    written = ((f"the output file {str(output)!r}", Path(output)),)
    if trace:
        check_output(trace, input, files + written, dirs, "trace path")
        written += ((f"the trace file {str(trace)!r}", Path(trace)),)
    if report:
        check_output(report, input, files + written, dirs, "report path")
    return InferPlan(cfg, dp, pp, ranges, source, str(input), str(output), n_rows, trace)


def weights_protection(weights: str | Path, source: WeightsSource) -> tuple[tuple[tuple[str, Path], ...],
                                                                         tuple[tuple[str, Path], ...]]:
    """Return (files, directories) the run must not write into: the weights file, or the checkpoint's directories."""
    if source.kind == "file":
        return ((f"the weights file {str(source.path)!r}", Path(source.path)),), ()
    given = Path(weights)
    top = given.parent if given.is_file() else given      # a `latest` pointer: its checkpoint root
    dirs = [top] if os.path.realpath(top) != os.path.realpath(source.path) else []
    dirs.append(Path(source.path))
    return (), tuple((f"the checkpoint directory {str(d)!r} that holds the weights", d) for d in dirs)


def _stage_layers(p: InferPlan, arrays: dict[int, dict[str, np.ndarray]], stage: int) -> list[tuple]:
    specs = layer_specs(p.config)
    dtype = p.config.model.dtype
    out = []
    for i in p.stage_ranges[stage]:
        bias = arrays[i].get("bias")
        out.append((np.ascontiguousarray(arrays[i]["weight"], dtype=dtype),
                    None if bias is None else np.ascontiguousarray(bias, dtype=dtype),
                    make_activation(specs[i].activation)))
    return out


def _build_stage(p: InferPlan, topo: Any, poller: Poller, arrays: dict, tmp: Path, offset: int | None) -> StreamStage:
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


def execute(p: InferPlan, comm: Any) -> dict[str, Any]:
    """Run a planned inference on every rank of comm (collective); return the report on every rank.

    Errors before streaming (unreadable weights, output not creatable) are
    agreed on and raised as AgreedError on every rank, and nothing is left at
    the output path. A failure while streaming on one rank aborts comm
    (MPI_Abort), since its neighbours would wait for it forever.
    """
    t_begin = time.perf_counter()
    cfg = p.config
    topo = make_topology(comm, p.dp, p.pp)
    poller = Poller(cfg.run.poll_min_us, cfg.run.poll_max_us)
    rank = comm.Get_rank()
    stage: StreamStage | None = None
    tmp: Path | None = None
    try:
        arrays = checkpoint_mpi.load(comm, poller, p.weights, list(p.stage_ranges[topo.pp_rank]),
                                     with_optimizer=False).arrays
        created = None
        # (the finally clause below removes a half-created output)
        with together(comm, poller, 2, lambda e: f"cannot create output file {str(tmp)!r} (for {p.output!r}): {e}"):
            if rank == 0:
                tmp = temporary_name(p.output)
                attrs = {"format": "hpcpipe-infer", "weights": str(p.weights.path), "step": p.weights.step,
                         "input": p.input, "model": json.dumps(cfg.to_dict()["model"], sort_keys=True)}
                created = (str(tmp), create_output(tmp, p.n_rows, cfg.model.dims[-1], cfg.model.dtype,
                                                   cfg.infer.y, attrs))
        tmp_name, offset = broadcast(comm, created)
        tmp = Path(tmp_name)
        # e.g. MemoryError or an unreadable input on one rank
        with together(comm, poller, 1, lambda e: f"rank {rank} ({topo.name}) cannot start: {type(e).__name__}: {e}"):
            stage = _build_stage(p, topo, poller, arrays, tmp, offset)
        stage.fault_at = fault_step(rank)
        shift = clock_offset(topo.cart, poller)   # our own communicator: no clash with the caller's tags
        barrier(comm, poller)
        t_start = time.perf_counter()
        try:
            events = stage.run()
        except BaseException as exc:  # noqa: BLE001 - neighbours wait on this rank: end the job, never hang
            if comm.Get_size() > 1:
                print(f"hpcpipe: [{topo.name}] error while streaming: {type(exc).__name__}: {exc}",
                      file=sys.stderr, flush=True)
                abort(comm, 1)
            raise
        stage_done, stage = stage, None
        with together(comm, poller, 1, lambda e: f"rank {rank} ({topo.name}) cannot finish writing {str(tmp)!r}: {e}"):
            stage_done.close()
        with together(comm, poller, 1, lambda e: f"cannot rename {str(tmp)!r} to {p.output!r}: {e}"):
            if rank == 0:
                commit(tmp, Path(p.output))
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
                    write_json(p.trace, inference_trace(parts))
                    report["trace"] = p.trace
                except OSError as exc:   # the results are written: a lost trace is not worth failing for
                    report["trace_error"] = f"cannot write trace {p.trace!r}: {exc}"
                    print(f"hpcpipe: warning: {report['trace_error']}", file=sys.stderr, flush=True)
        return broadcast(comm, report)
    finally:
        if stage is not None:   # an agreed error after the stage was built: release what it holds
            try:
                stage.close()
            except OSError:
                pass
        if rank == 0 and tmp is not None:
            discard(tmp)
        topo.free()


def run(weights: str | Path, input: str | Path, output: str | Path, *, comm: Any = None,
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
    return execute(plan(weights, input, output, comm.Get_size(), config, overrides, trace), comm)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line."""
    parser = CommandParser(prog="python -m hpcpipe.infer", description=DESCRIPTION, epilog=EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", required=True, metavar="PATH",
                        help="weights file, checkpoint directory, step-NNNNNNNN directory or latest file")
    parser.add_argument("--input", required=True, metavar="IN.h5", help="HDF5 file with dataset infer.x (N, dims[0])")
    parser.add_argument("--output", required=True, metavar="OUT.h5",
                        help="HDF5 file to write with dataset infer.y (N, dims[-1]); replaced atomically")
    parser.add_argument("--config", metavar="FILE", help="TOML config file ([parallel], [infer], [run] apply)")
    parser.add_argument("--set", dest="overrides", metavar="SECTION.KEY=VALUE", action="append", default=[],
                        help="override one config key (TOML value syntax); repeatable")
    parser.add_argument("--trace", metavar="FILE", default="", help="write a Chrome trace (JSON) of every rank")
    parser.add_argument("--report", metavar="FILE", default="", help="write the report as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m hpcpipe.infer``; returns the exit status."""
    args = parse_args(argv)
    from mpi4py import MPI

    world = MPI.COMM_WORLD

    def planner() -> InferPlan:
        return plan(args.weights, args.input, args.output, world.Get_size(), args.config, args.overrides,
                    args.trace, args.report)

    def body(p: InferPlan) -> int:
        report = execute(p, world)
        if world.Get_rank() == 0:
            print(format_summary(report) + f" -> {p.output!r}", flush=True)
            if args.report:
                write_json(args.report, report)
        return 0

    return run_planned(world, planner, body, lambda: f"rank {world.Get_rank()}")


if __name__ == "__main__":
    sys.exit(main())
