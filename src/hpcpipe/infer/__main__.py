"""``python -m hpcpipe.infer``: the stop handlers are installed by this file's first statement (see command.py)."""

from hpcpipe.runtime.stopsignal import StopSignals

EARLY_STOP = StopSignals().install()   # before anything slow is imported, on purpose

import os  # noqa: E402
import sys  # noqa: E402

try:
    from hpcpipe.infer.command import main  # noqa: E402
except KeyboardInterrupt:   # Ctrl-C while NumPy/h5py/MPI load: no traceback, no MPI_Finalize that waits for the others
    print("hpcpipe: interrupted (SIGINT) while starting: nothing written; ending the job", file=sys.stderr, flush=True)
    import signal  # noqa: E402
    signal.signal(signal.SIGINT, signal.SIG_DFL)   # die of SIGINT: the launcher then ends the other ranks
    os.kill(os.getpid(), signal.SIGINT)             # (a plain exit before MPI_Init left them waiting in MPI_Init)
    os._exit(130)

sys.exit(main(stop=EARLY_STOP))
