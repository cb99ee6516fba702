"""``python -m hpcpipe.simulate``: simulate a schedule on a cost model, or draw a measured trace.

    python -m hpcpipe.simulate --schedule 1f1b --pp 8 --micro-batches 32 [--costs F,B,W,comm]
    python -m hpcpipe.simulate --schedule zb-h1 --pp 4 --micro-batches 8 --plot timeline.png
    python -m hpcpipe.simulate --schedule 1f1b --pp 2 --micro-batches 16 --calibrate trace.json
    python -m hpcpipe.simulate --schedule zb-h1 --pp 4 --micro-batches 16 --calibrate trace.json --cores 2
    python -m hpcpipe.simulate --measured trace.json --plot measured.png
    python -m hpcpipe.simulate --schedule 1f1b --pp 2 --micro-batches 8 --calibrate trace.json --tp 2 \
        --tp-comm 0.004,0.004

``--tp N`` predicts the same stages split over N tensor-parallel ranks: every compute action costs 1/N,
plus ``--tp-comm F,B`` seconds of tp collectives per forward and per backward (input) action of a stage
(a trace of a tp run already holds them: calibrate from it without --tp).

The simulator itself is :mod:`hpcpipe.schedule.event_sim` (per action) and
:mod:`hpcpipe.schedule.sweep` (vectorised over a timeline); the pictures are
:mod:`hpcpipe.schedule.render`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from hpcpipe.cli import CommandParser, reader_left
from hpcpipe.errors import ScheduleError
from hpcpipe.schedule.calibrate import calibrated_costs
from hpcpipe.schedule.costs import Costs
from hpcpipe.schedule.event_sim import simulate_schedule
from hpcpipe.schedule.registry import SCHEDULES
from hpcpipe.schedule.render import ascii_timeline, plot_timeline, sim_rows
from hpcpipe.trace import measured_events


def _parse_costs(text: str) -> Costs:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise ScheduleError(f"--costs expects numbers F,B[,W[,comm]], got {text!r}") from None
    if not 2 <= len(values) <= 4 or not all(0 <= v < math.inf for v in values):   # nan, inf: a nan step time
        raise ScheduleError(f"--costs expects 2 to 4 finite non-negative numbers F,B[,W[,comm]], got {text!r}")
    f, b = values[0], values[1]
    w = values[2] if len(values) > 2 else b / 2
    comm = values[3] if len(values) > 3 else 0.0
    if w > b:
        raise ScheduleError(f"--costs: W ({w}) cannot exceed the full backward B ({b})")
    return Costs(f, b, w, comm)


def _parse_tp(tp: int, text: str) -> tuple[int, float, float]:
    if tp < 1:
        raise ScheduleError(f"--tp must be >= 1, got {tp}")
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise ScheduleError(f"--tp-comm expects two numbers F,B (seconds), got {text!r}") from None
    if len(values) != 2 or not all(0 <= v < math.inf for v in values):
        raise ScheduleError(f"--tp-comm expects two finite non-negative numbers F,B (seconds), got {text!r}")
    return tp, values[0], values[1]


def _listing(items: list[str], edge: int = 8) -> str:
    """Join per-rank entries; for hundreds of ranks show the first and last `edge` (a line per rank is unreadable)."""
    if len(items) <= 3 * edge:
        return " ".join(items)
    return " ".join(items[:edge]) + f" ... ({len(items) - 2 * edge} more) ... " + " ".join(items[-edge:])


def _unit(args: argparse.Namespace) -> str:
    """The step time's unit: a trace's costs are seconds; --costs are in whatever unit the user gave them."""
    if args.calibrate:
        return f"s (costs measured in {args.calibrate!r})"
    return f"units of --costs (F,B[,W[,comm]] = {args.costs} per stage; seconds when they are seconds)"


def _plot_path_problem(path: str) -> str:
    """Why matplotlib could not write its chart to ``path`` (empty: it can): checked before simulating."""
    from matplotlib.backend_bases import FigureCanvasBase

    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        return f"the folder {folder!r} does not exist or is not writable"
    kinds = FigureCanvasBase.get_supported_filetypes()
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    if suffix not in kinds:
        return f"matplotlib cannot write a {suffix or 'suffix-less'} file; name it .png, .svg or .pdf " \
               f"(it writes {', '.join(sorted(kinds))})"
    if os.path.exists(path):
        return "" if os.access(path, os.W_OK) else "the file exists and is not writable"
    try:    # a writable-looking folder may still refuse a file (/proc, a read-only mount as root)
        with open(path, "xb"):
            pass
        os.unlink(path)
    except OSError as exc:
        return f"cannot create it: {exc.strerror or exc}"
    return ""


# What one run may ask for: seconds, not minutes (or a machine's memory). The array form holds pp x ticks cells,
# ticks about 2 x (micro-batches x virtual stages + pp), and its peaks pass walks them once per virtual stage:
# 3.6e7 cells took 3.9 s and 290 MB (gpipe 3000 x 3000), 1.3e5 cells x 2000 virtual stages 2 s, x 3000 13 s;
# --pp 100000 asked 2e10 cells and grew past 20 GB in a minute. Action by action (--ascii, --plot, --per-action,
# --cores below pp) 64 x 2048 zb-h1 micro-batches took 13 s, 27 s with --cores 8.
MAX_CELLS = 50_000_000
MAX_CELL_PASSES = 300_000_000
MAX_ACTION_MICRO_BATCHES = 131_072


def _size_problem(args: argparse.Namespace) -> str:
    """Why the requested simulation is too large to run in seconds (empty: it is not); values below 1 are left
    to the schedule builder's own messages."""
    pp, m, v = args.pp, args.micro_batches, args.virtual_stages
    if min(pp, m, v) < 1:
        return ""
    asked = f"--pp {pp} --micro-batches {m} --virtual-stages {v}"
    per_action = args.per_action or args.ascii or args.plot or (args.cores is not None and args.cores < pp)
    if per_action and pp * m * v > MAX_ACTION_MICRO_BATCHES:
        return (f"{asked} is {pp * m * v} stage micro-batches, too many to simulate action by action (--ascii, "
                f"--plot, --per-action or --cores below --pp; at most {MAX_ACTION_MICRO_BATCHES}): simulate fewer, "
                f"or leave those options out")
    cells = pp * 2 * (m * v + pp)
    if cells > MAX_CELLS or cells * v > MAX_CELL_PASSES:
        return (f"{asked} is a timeline of about {cells:.1e} cells (pp x 2 x (micro-batches x virtual stages + "
                f"pp)) walked {v} time(s), more than this simulator takes in seconds ({MAX_CELLS:.0e} cells, "
                f"{MAX_CELL_PASSES:.0e} cell walks): simulate fewer stages, micro-batches or virtual stages")
    return ""


EPILOG = """examples:
  python -m hpcpipe.simulate --schedule 1f1b --pp 8 --micro-batches 32 --costs 1,2,1,0.1
  python -m hpcpipe.simulate --schedule zb-h1 --pp 4 --micro-batches 8 --plot timeline.png
  python -m hpcpipe.simulate --schedule 1f1b --pp 2 --micro-batches 16 --calibrate log.trace
  python -m hpcpipe.simulate --measured log.trace --plot measured.png

Costs are seconds (or any unit) per whole stage: F forward, B backward (input gradient), W weight gradient
(zero-bubble schedules split B and W), comm a message between stages. exit status: 0 success, 2 bad input."""


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m hpcpipe.simulate``; returns the exit status."""
    try:
        return _main(argv)
    except BrokenPipeError:
        return reader_left()     # the reader (`| head`) left


def _main(argv: list[str] | None) -> int:
    parser = CommandParser(prog="python -m hpcpipe.simulate", description=__doc__.split("\n\n")[0], epilog=EPILOG)
    parser.add_argument("--schedule", default="1f1b", help=f"one of {', '.join(SCHEDULES)} (default 1f1b)")
    parser.add_argument("--pp", type=int, default=4, help="pipeline stages, one rank each (default 4)")
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches a step (default 8)")
    parser.add_argument("--virtual-stages", type=int, default=1,
                        help="model chunks per rank (default 1): more for interleaved-1f1b; zb-v needs 2")
    parser.add_argument("--costs", default="1,2,1,0", dash_value=True,     # "-1,2": a value, said to be negative
                        help="F,B[,W[,comm]] per whole stage (default 1,2,1,0)")
    parser.add_argument("--calibrate", metavar="TRACE",
                        help="take costs from a training trace (log.trace) of the same model, any layout")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel ranks per stage: compute per action / tp, plus --tp-comm (default 1)")
    parser.add_argument("--tp-comm", default="0,0", metavar="F,B", dash_value=True,
                        help="seconds of tp collectives per forward and per backward action of a stage (with --tp)")
    parser.add_argument("--cores", type=int, default=None,
                        help="cores shared by the ranks (default: one per rank)")
    parser.add_argument("--measured", metavar="TRACE", help="draw/print a measured trace instead of simulating")
    parser.add_argument("--plot", metavar="PNG", help="draw the rank x time chart with matplotlib")
    parser.add_argument("--ascii", action="store_true", help="print the timeline as text")
    parser.add_argument("--no-validate", action="store_true",
                        help="skip the validator (the output then says the schedule was not checked)")
    parser.add_argument("--per-action", action="store_true",
                        help="simulate action by action, the reference path (--ascii and --plot imply it; "
                             "otherwise the schedule's timeline arrays are simulated, same numbers, much faster)")
    args = parser.parse_args(argv)
    if args.plot:   # say it before a simulation that may take seconds, not after printing its results
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            print(f"hpcpipe: error: --plot needs matplotlib ({exc}): pip install matplotlib "
                  f"(or, in the source tree, pip install \".[plot]\")", file=sys.stderr)
            return 2
        problem = _plot_path_problem(args.plot)
        if problem:
            print(f"hpcpipe: error: --plot {args.plot!r}: {problem}", file=sys.stderr)
            return 2
    problem = "" if args.measured else _size_problem(args)
    if problem:
        print(f"hpcpipe: error: {problem}", file=sys.stderr)
        return 2
    try:
        if args.measured:
            rows = measured_events(args.measured)
            end = max(e for row in rows for _, _, e in row)
            print(f"measured step: {end * 1e3:.2f} ms on {len(rows)} ranks")
            if args.plot:
                plot_timeline(rows, args.plot, f"measured: {args.measured}")
                print(f"wrote {args.plot}")
            return 0
        if args.calibrate:
            costs = calibrated_costs(args.calibrate, args.pp, args.virtual_stages)
        else:
            costs = _parse_costs(args.costs)
        if args.tp != 1 or args.tp_comm != "0,0":
            costs = costs.tensor_parallel(*_parse_tp(args.tp, args.tp_comm))
        result = simulate_schedule(args.schedule, args.pp, args.micro_batches, args.virtual_stages,
                                   costs, check=not args.no_validate, cores=args.cores,
                                   per_rank_costs=not args.calibrate,
                                   events=bool(args.per_action or args.ascii or args.plot))
    except ScheduleError as exc:
        print(f"hpcpipe: error: {exc}", file=sys.stderr)
        return 2
    except MemoryError as exc:      # the timeline grids of pp x micro-batches x virtual stages
        print(f"hpcpipe: error: not enough memory to simulate --pp {args.pp} --micro-batches {args.micro_batches} "
              f"--virtual-stages {args.virtual_stages} ({exc}): simulate fewer stages or micro-batches",
              file=sys.stderr)
        return 2
    print(f"schedule {args.schedule}  pp={args.pp}  micro-batches={args.micro_batches}  "
          f"virtual stages={args.virtual_stages}" + (f"  tp={args.tp}" if args.tp != 1 else ""))
    print(f"step time        {result.step_time:.6g} {_unit(args)}")
    print(f"bubble           {result.bubble:.4f} of rank time ({result.bubble_over_compute:.4f} of compute)")
    print("peak stashed     " + _listing([f"r{r}:{n}" for r, n in enumerate(result.peak_stashed)])
          + ("  (micro-batches per rank)" if args.virtual_stages == 1 else
             f"  (stage activations per rank; each is 1/{args.virtual_stages} of a rank's layers)"))
    if args.virtual_stages > 1:
        print("per stage        " + _listing([f"s{s}:{n}" for s, n in sorted(result.peak_stashed_stage.items())]))
    vectorised = result.events is None
    print("simulator        " + ("vectorised over the schedule's timeline arrays" if vectorised else "per action"))
    if args.no_validate:
        print("validation       SKIPPED (--no-validate): the schedule was not checked")
    else:
        how = "vectorised (validate_timeline)" if vectorised else "per action (validate)"
        print(f"validation       {how}: complete, channels in order, deadlock-free")
    if args.ascii:
        print(ascii_timeline(result))
    if args.plot:
        try:
            plot_timeline(sim_rows(result), args.plot,
                          f"{args.schedule} pp={args.pp} m={args.micro_batches} v={args.virtual_stages} "
                          f"(simulated, bubble {result.bubble:.1%})",
                          "time (s)" if args.calibrate else "time (cost units)")
        except ScheduleError as exc:
            print(f"hpcpipe: error: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:      # the folder changed since the check above
            print(f"hpcpipe: error: --plot {args.plot!r}: cannot write it: {exc.strerror or exc}", file=sys.stderr)
            return 2
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
