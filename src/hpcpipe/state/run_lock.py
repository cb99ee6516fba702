"""One live run per run directory: an exclusive lock that world rank 0 holds while its run writes there.

Two jobs that resume the same checkpoint (or one resumes a run another is
still writing) would each clean the other's temporary directories, replace
each other's committed steps and prune each other's checkpoints: both could
report success while one's checkpoints are gone. World rank 0 therefore takes
``RUN/.lock`` with ``flock`` (exclusive, non-blocking) before its run reads or
writes anything there, and holds it until the run ends. The kernel drops it
when the process dies, however it dies, so a crashed run never leaves a stale
lock (a file left by a killed run is only a name; the lock is free). The file
names the holder (pid, host, start time) for the message the second job gets.
On a file system without locks (some Lustre mounts without ``flock``) the run
goes on unprotected, with a warning.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import sys
import time
from pathlib import Path

from hpcpipe.errors import ConfigError
from hpcpipe.state.outputs import file_kind

LOCK_NAME = ".lock"
_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


class RunLock:
    """The held lock of one run directory (release it, or let the process end)."""

    def __init__(self, fd: int | None, path: Path):
        self.fd, self.path = fd, path

    @classmethod
    def acquire(cls, run_dir: str | Path) -> RunLock:
        """Lock run_dir for this process; ConfigError naming the holder when another live run has it."""
        path = Path(run_dir) / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, 0o666)
        except OSError as exc:
            raise ConfigError(f"cannot lock the run directory {str(run_dir)!r} ({path.name}): "
                              f"{exc.strerror or exc}") from None
        _must_be_regular(fd, path, run_dir)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if not _still_named(fd, path):
                # the holder released it (and removed the file) between our open and our lock: a new
                # run may have made a new file there; lock that one instead
                os.close(fd)
                return cls.acquire(run_dir)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise in_use_error(run_dir, holder) from None
        except OSError as exc:
            if exc.errno not in _NO_LOCKS:
                os.close(fd)
                raise ConfigError(f"cannot lock the run directory {str(run_dir)!r}: {exc.strerror or exc}") from None
            os.close(fd)
            print(f"hpcpipe: warning: the file system of {str(run_dir)!r} has no file locks ({exc.strerror}): "
                  f"nothing stops a second job from writing this run directory at the same time",
                  file=sys.stderr, flush=True)
            return cls(None, path)
        stamp = f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n"
        os.ftruncate(fd, 0)
        os.pwrite(fd, stamp.encode(), 0)
        return cls(fd, path)

    def release(self) -> None:
        """Let another run have the directory: remove the file (if still ours) and close it, which drops the lock."""
        if self.fd is not None:
            if _still_named(self.fd, self.path):
                self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None


def in_use_error(run_dir: str | Path, holder: str) -> ConfigError:
    """The error a run gets when another live run holds run_dir's lock."""
    return ConfigError(f"the run directory {str(run_dir)!r} is in use by another run ({holder}): two runs "
                       f"writing one run directory would delete each other's checkpoints; wait for it to "
                       f"end, or start a fresh run (without --resume) into its own directory")


def live_holder(run_dir: str | Path) -> str | None:
    """Name the live run that holds run_dir's lock, or None when none does (the lock is only probed, not taken).

    The probe asks for a shared lock, which the holder's exclusive one refuses and
    other probes (every rank of a job checks) do not; it creates no file.
    """
    path = Path(run_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)   # a named pipe there must not block every rank for good
    except OSError:
        return None
    _must_be_regular(fd, path, run_dir)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read_holder(fd)
    except OSError:
        return None
    finally:
        os.close(fd)
    return None


def _must_be_regular(fd: int, path: Path, run_dir: str | Path) -> None:
    """Close fd and raise ConfigError when it is not a regular file (a named pipe, a device left at .lock)."""
    if stat.S_ISREG(os.fstat(fd).st_mode):
        return
    os.close(fd)
    raise ConfigError(f"the lock file of the run directory {str(run_dir)!r}, {str(path)!r}, is {file_kind(path)}, "
                      f"not a regular file: hpcpipe made no such file; move it away and run again")


def _still_named(fd: int, path: Path) -> bool:
    """Whether path still names the file open as fd (not removed or replaced meanwhile)."""
    try:
        mine, there = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "a process that has not written its name yet"
