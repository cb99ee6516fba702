"""What every command does around its work: argument parsing helpers, one clear error, abort on failure.

Errors found before the first collective (ConfigError from planning) are
deterministic and identical on every rank: rank 0 prints one message and
every rank exits with status 2. Any exception after that may be on one rank
only while the others wait in a collective, so the failing rank prints its
message and calls MPI_Abort, which ends the whole job at once. An
AgreedError is the exception: every rank raised it together after an
agreement (e.g. a corrupt checkpoint), so rank 0 prints it and all exit.

The command line is parsed before MPI is initialised (importing mpi4py is
slow and a usage error should not need MPI), so :class:`CommandParser`
learns the world rank from the launcher's environment and lets only rank 0
print usage, help and errors; every rank exits with the same status.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from hpcpipe.errors import EXIT_CONFIG, EXIT_FAILURE, EXIT_INTERRUPTED, AgreedError, ConfigError, HpcpipeError

# world rank as set by MPICH/Hydra (PMI), Open MPI, PMIx launchers and srun, in that order of trust
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")


def launcher_rank() -> int:
    """Return this process's world rank from the launcher's environment (0 when not launched by one)."""
    for name in RANK_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return 0


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage, help and errors are printed by world rank 0 only.

    Under ``mpiexec -n 8`` every rank parses the same command line; without
    this a typo prints the usage eight times. Errors read ``hpcpipe: error: ...``
    and exit with status 2 on every rank.
    """

    def _print_message(self, message: str, file=None) -> None:
        if launcher_rank() == 0:
            super()._print_message(message, file)

    def error(self, message: str):
        """Print the usage and one ``hpcpipe: error:`` line (rank 0), then exit 2 (every rank)."""
        self.print_usage(sys.stderr)
        self.exit(EXIT_CONFIG, f"hpcpipe: error: {message} (see {self.prog} --help)\n")


def run_planned(world: Any, planner: Callable[[], Any], body: Callable[[Any], int], label: Callable[[], str]) -> int:
    """Run planner (local checks) then body(plan); turn errors into one message and the right exit."""
    rank = world.Get_rank()
    try:
        planned = planner()
    except ConfigError as exc:
        if rank == 0:
            print(f"hpcpipe: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    except Exception as exc:  # noqa: BLE001 - planning is local and identical on every rank: one report
        if rank == 0:
            print(f"hpcpipe: error: {type(exc).__name__}: {exc}\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        return EXIT_FAILURE
    if rank == 0:   # which MPI the job really runs on: a wheel's MPI and the site's are easy to mix up
        from hpcpipe.runtime.comm import library_line
        print(library_line(world), flush=True)
    try:
        return body(planned)
    except AgreedError as exc:   # raised by every rank together: one message, no abort needed
        if rank == 0:
            print(f"hpcpipe: error: {exc}", file=sys.stderr, flush=True)
        return exc.code
    except BaseException as exc:  # noqa: BLE001 - every failure must end the whole job
        if isinstance(exc, SystemExit) and not exc.code:
            raise
        name = label()
        detail = "" if isinstance(exc, (HpcpipeError, KeyboardInterrupt)) else "\n" + traceback.format_exc()
        print(f"hpcpipe: [{name}] error: {type(exc).__name__}: {exc}{detail}", file=sys.stderr, flush=True)
        code = EXIT_CONFIG if isinstance(exc, ConfigError) else \
            EXIT_INTERRUPTED if isinstance(exc, KeyboardInterrupt) else EXIT_FAILURE
        if world.Get_size() > 1:
            from hpcpipe.runtime.comm import abort
            abort(world, code)
        return code
