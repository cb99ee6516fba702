"""``python -m hpcpipe.serve`` and the ``hpcpipe-serve`` console script: one entry, stop handlers first.

Only :mod:`hpcpipe.runtime.signals` is imported before the handlers are installed, so a SIGTERM/SIGUSR1
during the slow start-up is recorded (the server then drains at once and exits 0) instead of killing the
rank, and a Ctrl-C while NumPy, aiohttp and MPI load ends the job without a traceback.
"""

import os
import sys

from hpcpipe.runtime.signals import StopSignals


def script() -> int:
    """Install the stop handlers, then load and run the serve command; return its exit status."""
    stop = StopSignals().install()   # before anything slow is imported, on purpose
    try:
        from hpcpipe.serve.command import main
    except KeyboardInterrupt:   # Ctrl-C while NumPy/aiohttp/MPI load: no traceback, no MPI_Finalize waiting
        print("hpcpipe: interrupted (SIGINT) while starting; ending the job", file=sys.stderr, flush=True)
        import signal

        signal.signal(signal.SIGINT, signal.SIG_DFL)   # die of SIGINT: the launcher then ends the other ranks
        os.kill(os.getpid(), signal.SIGINT)
        os._exit(130)
    return main(stop=stop)


if __name__ == "__main__":
    sys.exit(script())
