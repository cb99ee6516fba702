"""The command line every hpcpipe command shares: one parser, one error format, a quiet end on a closed pipe.

The command line is parsed before MPI is initialised (importing mpi4py is
slow and a usage error should not need MPI), so :class:`CommandParser`
learns the world rank from the launcher's environment and lets only rank 0
print usage, help and errors; every rank exits with the same status. The
single-process commands (simulate, checkpoint, evaluate, plan) use the same
parser, so every usage error reads ``hpcpipe: error: ...`` and exits 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from hpcpipe.errors import EXIT_BROKEN_PIPE, EXIT_CONFIG
from hpcpipe.runtime.launcher import launcher_rank


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage, help and errors are printed by world rank 0 only.

    Under ``mpiexec -n 8`` every rank parses the same command line; without
    this a typo prints the usage eight times. Errors read ``hpcpipe: error: ...``
    and exit with status 2 on every rank.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def _print_message(self, message: str, file=None) -> None:
        if launcher_rank() == 0:
            super()._print_message(message, file)

    def error(self, message: str):
        """Print the usage and one ``hpcpipe: error:`` line (rank 0), then exit 2 (every rank)."""
        self.print_usage(sys.stderr)
        self.exit(EXIT_CONFIG, f"hpcpipe: error: {message} (see {self.prog} --help)\n")


def reader_left() -> int:
    """After a BrokenPipeError on stdout (``| head`` closed it): stop quietly, return 141 as SIGPIPE would."""
    # stdout is pointed at /dev/null so that the interpreter's final flush finds nothing to complain about
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_BROKEN_PIPE
