"""``python -m hpcpipe.train`` and the ``hpcpipe-train`` console script: one entry, stop handlers first.

This module imports only :mod:`hpcpipe.runtime.signals` before the handlers are
installed, so a batch system's SIGUSR1/SIGTERM during the slow start-up (NumPy,
h5py, MPI) is recorded instead of killing the rank (see train/command.py).
"""

import sys

from hpcpipe.runtime.signals import StopSignals


def script() -> int:
    """Install the stop handlers, then load and run the train command; return its exit status."""
    stop = StopSignals().install()   # before anything slow is imported, on purpose
    from hpcpipe.train.command import main

    return main(stop=stop)


if __name__ == "__main__":
    sys.exit(script())
