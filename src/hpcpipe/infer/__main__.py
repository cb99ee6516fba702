"""``python -m hpcpipe.infer`` and the ``hpcpipe-infer`` console script: one entry, stop handlers first.

This module imports only :mod:`hpcpipe.runtime.signals` before the handlers are
installed, so a SIGUSR1/SIGTERM during the slow start-up is recorded instead of
killing the rank, and a Ctrl-C while NumPy, h5py and MPI load ends the job at
once without a traceback (see infer/command.py).
"""

import os
import sys

from hpcpipe.runtime.signals import StopSignals


def script() -> int:
    """Install the stop handlers, then load and run the infer command; return its exit status."""
    stop = StopSignals().install()   # before anything slow is imported, on purpose
    try:
        from hpcpipe.infer.command import main
    except KeyboardInterrupt:   # Ctrl-C while NumPy/h5py/MPI load: no traceback, no MPI_Finalize waiting for others
        print("hpcpipe: interrupted (SIGINT) while starting: nothing written; ending the job", file=sys.stderr,
              flush=True)
        import signal

        signal.signal(signal.SIGINT, signal.SIG_DFL)   # die of SIGINT: the launcher then ends the other ranks
        os.kill(os.getpid(), signal.SIGINT)             # (a plain exit before MPI_Init left them waiting in MPI_Init)
        os._exit(130)
    return main(stop=stop)


if __name__ == "__main__":
    sys.exit(script())
