"""A long write of one output (checkpoint import, export) in a child process, so that nothing is left on failure.

HDF5 cannot be trusted once a write has failed: on a full disk every dataset handle that closes prints an
"Exception ignored" traceback and the interpreter then dies of SIGSEGV on its way out, leaving the
temporary file behind (it held 20 tracebacks and a growing hidden file before issue 40). And a SIGTERM
used to kill the command before its ``except`` could remove the temporary. So the command forks; the
parent creates the temporary ``tmp`` (so it is this run's alone), the child fills it (``write()``) and
ends with ``os._exit``; the parent only waits, and whatever happens to the child (an error, a segfault,
a stop signal to either process) the parent removes ``tmp`` and reports one line:

    parent                               child
    create tmp, block stop signals,
    fork  ------------------------->     default signal actions, unblock, write() into tmp, _exit(0)
    stop handlers, unblock, wait          (an error through a pipe, _exit(1); a crash: a signal)
    exit 0: the caller commits tmp        a stop signal in the parent: SIGKILL the child, remove tmp,
    otherwise remove tmp, raise           raise :class:`Stopped`

The child is forked after the source was opened and checked in the parent (no HDF5 file is open then).
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import resource
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hpcpipe.errors import HpcpipeError

STOPS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
PAUSE_HOOK = "HPCPIPE_PAUSE_IN_WRITE"   # test hook: the child sleeps this many seconds once tmp exists


class Stopped(HpcpipeError):
    """A stop signal came while the output was being written: the temporary was removed, nothing written."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class WriteFailed(HpcpipeError):
    """The output could not be written (a full disk, a quota, an I/O error); the temporary was removed."""


def check_space(directory: Path, need: int, what: str) -> None:
    """Raise WriteFailed when the file system of ``directory`` has less than ``need`` bytes free (found before the
    first byte is written; a file system that fills up meanwhile is the child's failure)."""
    try:
        usage = shutil.disk_usage(directory)
    except OSError:
        return      # the write itself will say what is wrong
    if usage.free < need:
        raise WriteFailed(f"cannot write {what}: it needs about {_size(need)} and the file system of "
                          f"{str(directory)!r} has {_size(usage.free)} free; nothing was written")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _why_it_died(tmp: Path) -> str:
    """Why a write most likely failed, from what it left (HDF5 crashes on a full disk before saying so itself)."""
    try:
        size = sum(p.stat().st_size for p in tmp.iterdir()) if tmp.is_dir() else tmp.stat().st_size
        free = shutil.disk_usage(tmp.parent).free
    except OSError:
        return "it failed"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and size >= limit - (1 << 16):
        return f"the file size limit was reached (ulimit -f: {_size(limit)})"
    if free < (1 << 20):
        return f"the file system of {str(tmp.parent)!r} is full ({_size(free)} free)"
    return "it failed"


def _remove(tmp: Path) -> None:
    """Remove what the child created at tmp (a file or a directory), whatever state it is in."""
    if tmp.is_dir() and not tmp.is_symlink():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.unlink(missing_ok=True)


def _report(exc: BaseException) -> bytes:
    """What the child sends of its failure: an hpcpipe error itself (pickled: the parent raises the same class,
    e.g. a ConfigError found while writing), else one line; an OSError is said by its errno (h5py's text holds
    the whole HDF5 error stack)."""
    if isinstance(exc, HpcpipeError):
        try:
            return b"E" + pickle.dumps(exc)
        except Exception:  # noqa: BLE001 - an error class that does not pickle: its text
            pass
    code = getattr(exc, "errno", None)
    if isinstance(exc, OSError) and code:
        why = {errno.ENOSPC: " (the disk is full)", errno.EDQUOT: " (the quota is full)",
               errno.EFBIG: " (the file size limit, ulimit -f, was reached)"}.get(code, "")
        line = os.strerror(code) + why
    else:
        line = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    return b"T" + line.encode("utf-8", "replace")


def _child(write: Callable[[], None], pipe: int) -> None:
    """Run in the child: write, report a failure through the pipe; never return."""
    code = 1
    try:
        for sig in STOPS:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)
        # HDF5's handles failing to close after ENOSPC print a traceback each: the parent says it in one line
        sys.unraisablehook = lambda _: None
        quiet = os.open(os.devnull, os.O_WRONLY)
        os.dup2(quiet, 2)
        pause = os.environ.get(PAUSE_HOOK)
        if pause:   # test hook: stop a write in the middle, deterministically
            time.sleep(float(pause))
        write()
        code = 0
    except BaseException as exc:  # noqa: BLE001 - every failure is reported by the parent in one line
        try:
            os.write(pipe, _report(exc))
        except OSError:
            pass
    finally:
        os._exit(code)


def write_in_child(tmp: Path, write: Callable[[], None], what: str, directory: bool = False) -> None:
    """Run ``write()`` in a forked child, after creating ``tmp`` here (a new empty file, or with ``directory`` a new
    directory: the name is this run's alone, so removing it destroys nothing else) for ``write`` to fill whole
    and fsync.

    Returns when it succeeded (the caller then commits ``tmp``). Otherwise ``tmp`` is removed and the failure
    raised: the child's own hpcpipe error (e.g. a ConfigError found while writing), WriteFailed (naming
    ``what`` and the reason, e.g. a full disk) or Stopped (a stop signal came: the child was ended first).
    """
    if directory:
        tmp.mkdir()
    else:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)   # no handler runs in the child before it resets them

    def stop(signum: int, frame: object) -> None:
        raise Stopped(signum)

    handlers = {sig: signal.signal(sig, stop) for sig in STOPS}
    try:
        status, report = _fork_and_wait(write, previous)
        if status != 0:
            why = _why_it_died(tmp)
            _remove(tmp)
    except BaseException:
        signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)    # a second signal must not interrupt the clean-up
        _remove(tmp)
        raise
    finally:
        for sig, old in handlers.items():
            signal.signal(sig, old)
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    if status == 0:
        return
    if report.startswith(b"E"):
        raise pickle.loads(report[1:])   # noqa: S301 - this process's own fork wrote it
    line = report[1:].decode("utf-8", "replace")
    if os.WIFSIGNALED(status):
        line = f"{why} (the writing process died of {signal.Signals(os.WTERMSIG(status)).name})"
    raise WriteFailed(f"cannot write {what}: {line or 'the writing process failed'}; nothing was left behind")


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def _fork_and_wait(write: Callable[[], None], mask: Any) -> tuple[int, bytes]:
    """Fork, run write() in the child, wait for it with ``mask`` as this thread's signal mask; return (wait status,
    the child's report). A stop signal (its handler raises Stopped) ends the child first, and goes on up."""
    read_end, write_end = os.pipe()
    try:
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            _child(write, write_end)
        os.close(write_end)
        write_end = -1
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            _, status = os.waitpid(pid, 0)
        except BaseException:
            signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise
        signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
        return status, b"" if status == 0 else _read_all(read_end)
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGTERM, SIGUSR1 and SIGINT back while the body runs (a commit: a rename and an unlink that must not be
    parted); one that came meanwhile acts when the body is done."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
