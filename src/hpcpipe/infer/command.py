"""``python -m hpcpipe.infer``: forward-only pipeline-parallel inference over MPI, HDF5 in and out.

    mpiexec -n 4 python -m hpcpipe.infer --weights PATH --input in.h5 --output out.h5
    mpiexec -n 8 python -m hpcpipe.infer --weights checkpoints --input in.h5 --output out.h5 --set parallel.pp=4
"""

from __future__ import annotations

import argparse
import sys

from hpcpipe.cli import CommandParser
from hpcpipe.errors import HpcpipeError
from hpcpipe.infer.pipeline import execute
from hpcpipe.infer.report import format_summary
from hpcpipe.infer.setup import InferSetup, prepare
from hpcpipe.infer.stop_outcome import StopRequested
from hpcpipe.runtime.host_memory import keep_freed_memory
from hpcpipe.runtime.job import run_job
from hpcpipe.runtime.signals import StopSignals
from hpcpipe.trace import write_json

DESCRIPTION = """Run a trained MLP forward over the rows of an HDF5 dataset with pipeline (pp) x data (dp)
parallelism over MPI, streaming micro-batches; write the outputs, in input order, to one HDF5 file.
World size must equal dp x pp (default pp=4, dp=world/pp). The model is the one stored with the weights."""


EPILOG = """examples:
  mpiexec -n 4 python -m hpcpipe.infer --weights model.h5 --input in.h5 --output out.h5
  mpiexec -n 8 python -m hpcpipe.infer --weights checkpoints --input in.h5 --output out.h5 --set parallel.pp=4
  mpiexec -n 2 python -m hpcpipe.infer --weights ck/step-00000100 --input in.h5 --output out.h5 \\
      --set parallel.pp=2 --set infer.micro_batch_size=256 --trace infer-trace.json

exit status: 0 success, 1 a rank failed while running, 2 bad configuration or input (nothing is written
at the output path), 75 stopped by SIGTERM/SIGUSR1 before the last row (nothing written; rerun the
command), 130 interrupted (SIGINT). An earlier file at the output path is left as it was in every
case but success. See docs/infer.md."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line."""
    parser = CommandParser(prog="python -m hpcpipe.infer", description=DESCRIPTION, epilog=EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", required=True, metavar="PATH",
                        help="weights file, checkpoint directory, step-NNNNNNNN directory or latest file")
    parser.add_argument("--input", required=True, metavar="IN.h5", help="HDF5 file with dataset infer.x (N, dims[0])")
    parser.add_argument("--output", required=True, metavar="OUT.h5",
                        help="HDF5 file to write with dataset infer.y (N, dims[-1]), atomically; an existing "
                             "file is replaced only when it is an earlier hpcpipe.infer output")
    parser.add_argument("--config", metavar="FILE", help="TOML config file ([parallel], [infer], [run] apply)")
    parser.add_argument("--set", dest="overrides", metavar="SECTION.KEY=VALUE", action="append", default=[],
                        help="override one config key (TOML value syntax); repeatable")
    parser.add_argument("--trace", metavar="FILE", default="", help="write a Chrome trace (JSON) of every rank")
    parser.add_argument("--report", metavar="FILE", default="", help="write the report as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, stop: StopSignals | None = None) -> int:
    """Entry point of ``python -m hpcpipe.infer`` (``stop``: its early handlers); returns the exit status."""
    # `python -m hpcpipe.infer` installed them before MPI and NumPy loaded (__main__.py): a stop signal
    # during start-up is only recorded, and every rank acts on it before its first micro-batch.
    stop = stop or StopSignals().install()
    try:
        return _main(parse_args(argv), stop)
    finally:
        stop.ignore()   # as train: a second signal while the ranks shut down must not kill one


def _main(args: argparse.Namespace, stop: StopSignals) -> int:
    keep_freed_memory()
    from mpi4py import MPI

    world = MPI.COMM_WORLD

    def setup() -> InferSetup:
        return prepare(args.weights, args.input, args.output, world.Get_size(), args.config, args.overrides,
                    args.trace, args.report)

    def body(p: InferSetup) -> int:
        try:
            report = execute(p, world, stop)
        except StopRequested as exc:   # every rank stopped together; nothing was committed
            if world.Get_rank() == 0:
                print(exc, file=sys.stderr, flush=True)
            return exc.code
        if world.Get_rank() == 0:
            print(format_summary(report) + f" -> {p.output!r}", flush=True)
            if args.report:
                try:
                    write_json(args.report, report, "report", "report path")
                except (OSError, HpcpipeError) as exc:   # the output is committed; only the report is lost
                    print(f"hpcpipe: error: report not written: {exc}", file=sys.stderr, flush=True)
                    return 1
        return 0

    return run_job(world, setup, body, lambda: f"rank {world.Get_rank()}")
