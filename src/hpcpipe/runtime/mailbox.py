"""Tagged messages of run-time shape between ranks of one communicator (serving's work and results)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from hpcpipe.runtime.comm import MPI, Poller  # runtime.comm is the one module importing mpi4py

if TYPE_CHECKING:
    from mpi4py.MPI import Comm

    from hpcpipe.runtime.backend import Backend


class Mailbox:
    """Tagged messages between ranks of one communicator, each a small picklable header and optionally one array.

    Serving moves work whose shape is known only at run time (which sequences,
    how many new tokens), so a message is a pickled header, then, when the
    header carries ``("array", shape, dtype)`` last, the array itself on tag + 1.
    Receiving never blocks the caller: :meth:`poll` matches a header with a
    matched probe (``improbe``) and returns None when nothing has arrived.
    """

    def __init__(self, comm: Comm, backend: Backend, poller: Poller):
        self.comm, self.backend, self.poller = comm, backend, poller
        self._sends: list = []
        self.bytes_sent = 0

    def post(self, dest: int, tag: int, header: tuple, array: Any = None) -> None:
        """Start sending header (and array, C-contiguous) to rank dest; buffers are kept until the sends complete."""
        if array is not None:
            header = header + (("array", tuple(array.shape), str(array.dtype)),)
        self._sends.append((self.comm.isend(header, dest=dest, tag=tag), header))
        if array is not None:
            wire = array.get() if self.backend.on_gpu and not isinstance(array, np.ndarray) else array
            self._sends.append((self.comm.Isend(wire, dest=dest, tag=tag + 1), wire))
            self.bytes_sent += wire.nbytes
        if len(self._sends) > 64:
            self._sends = [(r, b) for r, b in self._sends if not r.Test()]

    def poll(self, source: int | None, tag: int) -> tuple[tuple, Any, int] | None:
        """Return (header, array or None, source rank) of the next message on tag from source (None: any rank).

        Returns None when no such message is waiting.
        """
        status = MPI.Status()
        message = self.comm.improbe(source=MPI.ANY_SOURCE if source is None else source, tag=tag, status=status)
        if message is None:
            return None
        header = message.recv()
        sender = status.Get_source()
        array = None
        if header and isinstance(header[-1], tuple) and header[-1][:1] == ("array",):
            _, shape, dtype = header[-1]
            header = header[:-1]
            array = np.empty(shape, dtype=dtype)
            self.poller.wait([self.comm.Irecv(array, source=sender, tag=tag + 1)])
            if self.backend.on_gpu:
                array = self.backend.xp.asarray(array)
        return header, array, sender

    def flush(self) -> None:
        """Complete every outstanding send (before leaving the loop that posted them)."""
        self.poller.wait([r for r, _ in self._sends])
        self._sends.clear()
