"""Stop signals (SIGUSR1, SIGTERM) that only set a flag, installable before anything slow is imported.

This module imports nothing but :mod:`signal` (not even :mod:`typing`), so
``python -m hpcpipe.train`` installs the handlers before NumPy and mpi4py
(which initialises MPI) load: a batch system's warning signal that arrives
during start-up is then recorded instead of killing the rank, and every rank
learns of it at the first step decision (see :mod:`hpcpipe.runtime.step_health`).
"""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopSignals:
    """Installs SIGUSR1/SIGTERM handlers that only record which signal came; restores the old ones on close.

    SIGINT keeps raising KeyboardInterrupt (stop at once, exit 130) but is also
    recorded: Python drops an exception raised inside a weakref callback or a
    ``__del__`` ("Exception ignored"), and a Ctrl-C that landed there let the
    job train on to its end; the training loop checks the record every step.
    """

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS):
        self.signals = signals
        self.received: int | None = None
        self.interrupted = False   # SIGINT came (its KeyboardInterrupt may have been dropped by a finalizer)
        self._previous: dict[int, object] = {}

    def _interrupt(self, signum: int, frame: object) -> None:
        # As Python's default handler, but remembered: a KeyboardInterrupt raised inside a weakref
        # callback or __del__ is printed as "Exception ignored" and lost; check_interrupt() re-raises it.
        self.interrupted = True
        raise KeyboardInterrupt

    def check_interrupt(self) -> None:
        """Raise KeyboardInterrupt if SIGINT arrived, even when the handler's own exception was swallowed."""
        if self.interrupted:
            raise KeyboardInterrupt

    def _handler(self, signum: int, frame: object) -> None:
        # Only a flag: a handler runs between two bytecodes of the main thread, possibly inside
        # MPI or HDF5 calls, so it must neither do I/O nor start a collective.
        self.received = signum

    def install(self) -> StopSignals:
        """Install the handlers (main thread only; elsewhere a no-op, as Python allows no other)."""
        for sig in self.signals:
            try:
                self._previous[sig] = signal.signal(sig, self._handler)
            except ValueError:   # not the main thread
                break
            # restart interrupted system calls (SA_RESTART): a signal arriving inside MPI start-up
            # or an HDF5 read must not make a C library's read or write fail with EINTR
            signal.siginterrupt(sig, False)
        else:
            # Ctrl-C as Python's own handler would take it, but remembered; an inherited "ignore" stays
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._interrupt)
        return self

    def ignore(self) -> None:
        """Ignore further stop signals: the run has decided how it ends (on the way out of the command).

        Python resets the handlers it installed to the default action while it finalises,
        and SIGUSR1's default kills the process: a late second signal would turn a clean
        exit 75 into a launcher's abort. Ignored signals stay ignored through finalisation.
        """
        for sig in self.signals:
            try:
                signal.signal(sig, signal.SIG_IGN)
            except ValueError:   # not the main thread
                return
        if signal.SIGINT in self._previous:   # a late Ctrl-C must not turn the decided exit status into a kill
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    @property
    def requested(self) -> bool:
        """True once any stop signal has arrived."""
        return self.received is not None

    @property
    def name(self) -> str:
        """Name of the signal received ('' when none)."""
        return signal.Signals(self.received).name if self.received is not None else ""

    def close(self) -> None:
        """Restore the previous handlers."""
        for sig, old in self._previous.items():
            signal.signal(sig, old)
        self._previous.clear()
