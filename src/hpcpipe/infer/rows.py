"""Inference input and output: row assignment, checked HDF5 input, one output file written in parallel.

Rows (fixed, documented, independent of pp):

* Micro-batch m holds input rows ``[m*B, min((m+1)*B, N))`` (B =
  infer.micro_batch_size); there are ``M = ceil(N / B)`` of them and only the
  last may be partial.
* Replica d takes micro-batches ``d, d+dp, d+2dp, ...`` (round robin), so the
  replicas' shares differ by at most one micro-batch. Each replica's
  first-stage rank reads only its micro-batches' rows, one micro-batch at a
  time, never the whole file.

Output: world rank 0 creates ``OUT.tmp-XXXXXXXX`` beside OUT with dataset
``y`` (N, dims[-1]) stored *contiguously*, its storage allocated at creation
(no fill, no chunks, no filters), and records the byte offset of that
storage. Each replica's last-stage rank then writes its rows straight into
their place in that region with ``os.pwrite``, all replicas at once: the
row ranges are disjoint, no HDF5 metadata changes after creation, and the
file is a valid HDF5 file throughout (the technique MPI-IO parallel HDF5
uses, without needing a parallel HDF5 build). Only after every rank has
written, flushed and agreed does rank 0 rename the temporary file to OUT, so
OUT is either absent (or the previous file) or complete.
"""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path
from typing import Any

import numpy as np

from hpcpipe.errors import ConfigError
from hpcpipe.h5files import WatchedFile, member, open_hdf5
from hpcpipe.lazy_h5py import h5py
from hpcpipe.state.outputs import check_replaceable, check_writable, commit_output
from hpcpipe.state.sources import refuse_overwrite, same_file


def n_micro_batches(n_rows: int, batch: int) -> int:
    """Return how many micro-batches of up to `batch` rows cover n_rows rows."""
    return -(-n_rows // batch)


def replica_micro_batches(n_rows: int, batch: int, dp: int, dp_rank: int) -> list[int]:
    """Return the micro-batches replica dp_rank processes, in order (round robin over replicas)."""
    return list(range(dp_rank, n_micro_batches(n_rows, batch), dp))


def micro_batch_rows(m: int, n_rows: int, batch: int) -> tuple[int, int]:
    """Return (first row, row count) of micro-batch m."""
    start = m * batch
    return start, min(batch, n_rows - start)


def check_input(path: str | Path, dataset: str, width: int) -> int:
    """Return the row count of the input dataset, or raise ConfigError naming the file and values."""
    p = Path(path)
    label = f"input file {str(p)!r}"
    with open_hdf5(p, label) as f:
        x = member(f, dataset, label)
        if not isinstance(x, h5py.Dataset):
            raise ConfigError(f"input file {str(p)!r} has no dataset {dataset!r} (it has: {sorted(f.keys())}); "
                              f"set infer.x to choose another")
        if x.ndim != 2 or x.shape[1] != width:
            raise ConfigError(f"dataset {dataset!r} in {str(p)!r} has shape {x.shape}; model.dims[0] = {width} "
                              f"needs (N, {width})")
        if x.dtype.kind not in "fiu":
            raise ConfigError(f"dataset {dataset!r} in {str(p)!r} has dtype {x.dtype}; a numeric dtype is needed")
        return int(x.shape[0])


def check_output(path: str | Path, input_path: str | Path, protected_files: tuple[tuple[str, Path], ...] = (),
                 protected_dirs: tuple[tuple[str, Path], ...] = (), what: str = "output path",
                 kind: str = "infer") -> None:
    """Raise ConfigError unless a file of this kind can be written at path without destroying anything.

    Its directory must exist and take a new file (one is created and removed: as root /proc and read-only
    mounts pass the permission bits, and ``generate --json /proc/x`` failed after generating), and it must
    not be the input file, one of ``protected_files`` or anything inside ``protected_dirs``
    ((label, path) pairs, the label a phrase like "the weights file 'w.h5'").
    Paths are compared after resolving symlinks, and hard links count as the same file. An existing
    file there must be hpcpipe's own earlier output of ``kind`` (``own_output.check_replaceable``).
    """
    check_writable(path, what)
    p = Path(path)
    if same_file(p, Path(input_path)):
        raise ConfigError(f"{what} {str(p)!r} is the input file")
    refuse_overwrite(p, protected_files, protected_dirs, what)
    check_replaceable(p, kind, what)
    check_writable(path, what, probe=True)     # last: a refused path's directory (a checkpoint's) is left untouched


def temporary_name(path: str | Path) -> Path:
    """Return a fresh temporary name beside path: ``PATH.tmp-XXXXXXXX``."""
    p = Path(path)
    return p.with_name(f"{p.name}.tmp-{secrets.token_hex(4)}")


def create_output(tmp: Path, n_rows: int, width: int, dtype: str, dataset: str,
                  attrs: dict[str, Any]) -> int | None:
    """Create the temporary output file with contiguous, pre-allocated dataset; return its byte offset.

    Returns None when the dataset is empty (nothing to write).
    """
    with h5py.File(tmp, "w") as f:
        for key, value in attrs.items():
            f.attrs[key] = value
        space = h5py.h5s.create_simple((n_rows, width))
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_layout(h5py.h5d.CONTIGUOUS)
        dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
        dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        native = np.dtype(dtype).newbyteorder("=")
        dset = h5py.h5d.create(f.id, dataset.encode(), h5py.h5t.py_create(native), space, dcpl=dcpl)
        offset = dset.get_offset()
        size = dset.get_storage_size()
    if n_rows and size:
        # reserve the rows' blocks now: a full disk is then one error before any row is computed, not an
        # ENOSPC in a writer mid-stream (an abort that leaves this file behind)
        fd = os.open(tmp, os.O_RDWR)
        try:
            os.posix_fallocate(fd, offset, size)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):   # no reservation on this file system: go on
                raise
        finally:
            os.close(fd)
    return None if n_rows == 0 else offset


class RowReader:
    """Reads micro-batches of input rows into caller-provided buffers (HDF5 converts the dtype).

    The input's size is re-checked after every read (:class:`hpcpipe.h5files.WatchedFile`):
    a file truncated during the run is a DataError naming it, never rows of zeros.

    Uses h5py's low-level calls with dataspaces made once, so a read creates
    no HDF5 objects (h5py's ``read_direct`` builds selections per call).
    """

    def __init__(self, path: str | Path, dataset: str, batch: int, dtype: Any):
        self.watched = WatchedFile(path, f"input file {str(path)!r}")
        self.file = self.watched.file
        self.dataset = self.file[dataset]
        self.width = self.dataset.shape[1]
        self.fspace = self.dataset.id.get_space()
        self.mtype = h5py.h5t.py_create(np.dtype(dtype))
        self.mspaces: dict[int, Any] = {}
        n = self.dataset.shape[0]
        for rows in {min(batch, n), n % batch} - {0}:   # only the row counts that occur
            self.mspaces[rows] = h5py.h5s.create_simple((rows, self.width))

    def read(self, start: int, rows: int, out: np.ndarray) -> None:
        """Fill out[:rows] with input rows [start, start + rows)."""
        self.fspace.select_hyperslab((start, 0), (rows, self.width))
        try:
            self.dataset.id.read(self.mspaces[rows], self.fspace, out[:rows], self.mtype)
        except OSError as exc:
            raise self.watched.read_failed(f"rows {start}..{start + rows - 1}", exc) from None
        self.watched.check()   # HDF5 reads zeros past the end of a file truncated under us

    def close(self) -> None:
        """Close the input file."""
        self.file.close()


class RowWriter:
    """Writes output rows into their place in the temporary output file's pre-allocated storage."""

    def __init__(self, tmp: str | Path, offset: int | None, row_bytes: int):
        self.fd = os.open(tmp, os.O_WRONLY)
        self.offset = offset or 0
        self.row_bytes = row_bytes
        self.bytes_written = 0

    def write(self, start: int, rows: np.ndarray) -> None:
        """Write C-contiguous rows as output rows [start, start + len(rows))."""
        view = memoryview(rows).cast("B")
        position = self.offset + start * self.row_bytes
        done = 0
        while done < len(view):   # a regular file takes it in one call; loop on a short write anyway
            done += os.pwrite(self.fd, view[done:], position + done)
        self.bytes_written += done

    def close(self) -> None:
        """Flush the written rows to stable storage and close the file."""
        try:
            os.fsync(self.fd)
        finally:
            os.close(self.fd)

    def abandon(self) -> None:
        """Close the file without flushing it (it is about to be removed)."""
        os.close(self.fd)


def commit(tmp: Path, final: Path) -> None:
    """Atomically move the complete temporary output to its final name (and make it durable).

    Never over a file that appeared at the path during the run (``own_output.commit_output``).
    """
    commit_output(tmp, final, "infer", "output path")
    try:
        fd = os.open(final.parent, os.O_RDONLY)
    except OSError:   # directories that cannot be opened (some platforms): the rename is still atomic
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def discard(tmp: Path) -> None:
    """Remove a temporary output file if it exists."""
    try:
        tmp.unlink()
    except FileNotFoundError:
        pass
