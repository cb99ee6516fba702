"""Console-script entry points of the MPI commands: the stop handlers first, then the command.

``python -m hpcpipe.train`` (and ``.infer``) installs its SIGUSR1/SIGTERM handlers in
``__main__``'s first statement, before NumPy, h5py and mpi4py load. A console script
imports its target's module before it calls it, so ``hpcpipe-train`` pointing at
``hpcpipe.train.command:main`` installed them only after those imports, and a batch
system's signal during start-up killed the rank (exit 15 instead of the stop contract's 75).
This module imports nothing but the signal handlers before it installs them.
"""

from hpcpipe.runtime.stopsignal import StopSignals


def train() -> int:
    """``hpcpipe-train``: the same as ``python -m hpcpipe.train``."""
    stop = StopSignals().install()
    from hpcpipe.train.command import main
    return main(stop=stop)


def infer() -> int:
    """``hpcpipe-infer``: the same as ``python -m hpcpipe.infer``."""
    stop = StopSignals().install()
    from hpcpipe.infer.command import main
    return main(stop=stop)
