"""``python -m hpcpipe.generate`` and the ``hpcpipe-generate`` console script: text from a GPT (serve/one_prompt.py).

This module imports only :mod:`hpcpipe.runtime.signals` before the stop handlers are installed, so a
SIGTERM/SIGUSR1 during the slow start-up is recorded (the run then stops at its first step, exit 75)
instead of killing the rank, and a Ctrl-C while NumPy and MPI load ends the job without a traceback.
"""

import os
import sys

from hpcpipe.runtime.signals import StopSignals


def script() -> int:
    """Install the stop handlers, then load and run the generate command; return its exit status."""
    stop = StopSignals().install()   # before anything slow is imported, on purpose
    try:
        from hpcpipe.serve.one_prompt import main
    except KeyboardInterrupt:   # Ctrl-C while NumPy/MPI load: no traceback, no MPI_Finalize waiting for others
        print("hpcpipe: interrupted (SIGINT) while starting: nothing generated; ending the job", file=sys.stderr,
              flush=True)
        import signal

        signal.signal(signal.SIGINT, signal.SIG_DFL)   # die of SIGINT: the launcher then ends the other ranks
        os.kill(os.getpid(), signal.SIGINT)
        os._exit(130)
    return main(stop=stop)


if __name__ == "__main__":
    sys.exit(script())
