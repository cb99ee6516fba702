"""``mpiexec -n 2 python -m hpcpipe.plan.probe --out F.json``: measure what the planner needs of the MPI.

Three things, on exactly 2 ranks: the one-way point-to-point time of a
message and the 2-rank in-place allreduce time at message sizes from 4 KiB to
64 MiB, and the resident memory of a bare rank (after importing NumPy, h5py,
mpi4py and the trainer and initialising MPI, before any big buffer; the
larger of the 2 ranks). Rank 0 writes::

    {"p2p": [[nbytes, seconds], ...], "allreduce": [[nbytes, seconds], ...], "tp_allreduce": [...],
     "baseline_rss_bytes": int, "mpi": "<library line>", "ranks": 2, "probe_seconds": float}

hpcpipe.profiles.comm_model fits a latency/bandwidth model to it and runs this
command as a subprocess (measure_comm). It takes a few seconds: big messages
are repeated only a few times.
"""

from __future__ import annotations

import os
import sys
import time

from hpcpipe.cli import CommandParser
from hpcpipe.errors import EXIT_CONFIG, EXIT_FAILURE, EXIT_OK, ConfigError
from hpcpipe.runtime.launcher import launcher_rank, launcher_size
from hpcpipe.runtime.rss import resident_bytes
from hpcpipe.state.outputs import check_writable, write_json_atomic

KIB = 1024
DEFAULT_SIZES = tuple(4 * KIB * 4 ** k for k in range(8))     # 4 KiB .. 64 MiB, 8 sizes
MAX_SIZE = 1 << 30
RANKS = 2


def repeats_for(nbytes: int) -> int:
    """Return how many timed repeats a message of nbytes gets: 50 for small ones, 5 for the biggest."""
    return max(5, min(50, (128 * KIB * KIB) // max(nbytes, 1)))


def parse_args(argv: list[str] | None):
    """Parse and check the command line (before MPI starts: a usage error needs no MPI)."""
    parser = CommandParser(prog="python -m hpcpipe.plan.probe",
                           description="Measure point-to-point and allreduce times and a bare rank's memory "
                                       "(run under mpiexec -n 2).")
    parser.add_argument("--out", required=True, metavar="FILE.json", help="where rank 0 writes the results")
    parser.add_argument("--sizes", type=int, nargs="+", metavar="BYTES", default=list(DEFAULT_SIZES),
                        help="message sizes in bytes (default: 4 KiB to 64 MiB, x4 apart)")
    args = parser.parse_args(argv)
    bad = [n for n in args.sizes if not 4 <= n <= MAX_SIZE]
    if bad:
        parser.error(f"--sizes {bad[0]}: every size must be between 4 and {MAX_SIZE} bytes")
    if len(set(args.sizes)) < 2:
        parser.error(f"--sizes {' '.join(map(str, args.sizes))}: give at least 2 different sizes "
                     "(a line needs 2 points)")
    if os.path.lexists(args.out):
        parser.error(f"--out {args.out!r} already exists; the probe never overwrites a file (remove it or pick "
                     "another name)")
    folder = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(folder):
        parser.error(f"--out {args.out!r}: folder {folder!r} does not exist")
    try:    # a file is created and removed there: as root /proc passes the permission bits (it failed after the
        # measurements: "[probe rank 0] error: FileNotFoundError", MPI_Abort, exit 1)
        check_writable(args.out, "--out", probe=True)
    except ConfigError as exc:
        parser.error(str(exc))
    args.sizes = sorted(set(args.sizes))
    return args


def wrong_size_message(size: int, library: str) -> str:
    """Return the one-line refusal of a job that does not have exactly 2 ranks."""
    message = (f"hpcpipe: error: the communication probe needs exactly {RANKS} ranks "
               f"(mpiexec -n {RANKS} python -m hpcpipe.plan.probe ...), this job has {size}")
    started = launcher_size()
    if size == 1 and started > 1:
        message += (f"; the launcher started {started} processes but MPI sees each one alone: the launcher "
                    f"does not belong to the MPI library mpi4py uses ({library})")
    return message


def measure(world, sizes: list[int]) -> dict:
    """Time p2p and allreduce at every size on the 2 ranks of world (collective); return rank 0's results."""
    from hpcpipe.runtime.mpi_probes import allreduce_seconds, pingpong_seconds, polled_allreduce_seconds
    peer = 1 - world.Get_rank()
    p2p = [[n, pingpong_seconds(world, peer, n, repeats_for(n))] for n in sizes]
    allreduce = [[n, allreduce_seconds(world, n, repeats_for(n))] for n in sizes]
    # the tp collectives' own path (nonblocking, polled): over TCP it is many times the blocking allreduce
    polled = [[n, polled_allreduce_seconds(world, n, repeats_for(n))] for n in sizes]
    return {"p2p": p2p, "allreduce": allreduce, "tp_allreduce": polled}


def main(argv: list[str] | None = None) -> int:
    """Run the probe; return the exit status (0, 2 for a wrong rank count or usage, 1 for a failure)."""
    started = time.perf_counter()
    args = parse_args(argv)
    # the baseline is a rank with what every hpcpipe rank imports, and MPI running: nothing more
    import h5py  # noqa: F401
    import numpy  # noqa: F401
    from mpi4py import MPI

    import hpcpipe.train.trainer  # noqa: F401
    from hpcpipe.runtime.comm import abort, gather_to_root
    from hpcpipe.runtime.mpi_probes import library_line
    world = MPI.COMM_WORLD
    rss = resident_bytes()
    size = world.Get_size()
    if size != RANKS:
        if world.Get_rank() == 0 and launcher_rank() == 0:
            print(wrong_size_message(size, library_line(world)), file=sys.stderr, flush=True)
        return EXIT_CONFIG
    try:
        result = measure(world, args.sizes)
        rss_all = gather_to_root(world, rss)
        if world.Get_rank() == 0:
            result.update(baseline_rss_bytes=max(rss_all), mpi=library_line(world), ranks=RANKS,
                          probe_seconds=round(time.perf_counter() - started, 3))
            write_json_atomic(args.out, result)
    except BaseException as exc:  # noqa: BLE001 - the other rank may wait in a blocking call: end the job
        print(f"hpcpipe: [probe rank {world.Get_rank()}] error: {type(exc).__name__}: {exc}", file=sys.stderr,
              flush=True)
        abort(world, EXIT_FAILURE)
        return EXIT_FAILURE
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
