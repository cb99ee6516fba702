"""Stopping a streamed inference on SIGTERM/SIGUSR1: every rank leaves the stream, agrees, and nothing is committed.

The ranks learn of a stop from each other through :mod:`hpcpipe.runtime.stop_notice`
(a one-integer notice, checked once per micro-batch and in every wait on a
neighbour); after the stream they agree, and if any rank left early all of
them discard the output together. A signal that arrives once this rank's
stream is over lets the run finish.
"""

from __future__ import annotations

import signal

from hpcpipe.errors import EXIT_PREEMPTED, AgreedError


class StopRequested(AgreedError):
    """Every rank agreed to stop on a signal: nothing is committed; the command exits EXIT_PREEMPTED."""

    def __init__(self, message: str):
        super().__init__(message, EXIT_PREEMPTED)


def stop_message(every: list[tuple[bool, int]], output: str, earlier: bool, started: bool = True) -> str:
    """The one line rank 0 prints after an agreed stop (``started``: the temporary output existed)."""
    signals = [s for _, s in every if s]
    name = signal.Signals(signals[0]).name if signals else "a stop signal"
    kept = "; the earlier file there is unchanged" if earlier else ""
    where = "before the last row" if started else "while starting, before the first row"
    tmp = ", the temporary output removed" if started else ""
    return (f"hpcpipe: stopped by {name} (received on {len(signals)} of {len(every)} ranks) {where}: "
            f"nothing written at {output!r}{kept}{tmp}; exit status {EXIT_PREEMPTED} "
            f"(inference keeps no checkpoint: rerun the command to infer again)")
