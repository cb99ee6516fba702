"""Checking a GPT token data file before step 0: integer ``x`` and ``y`` of shape (N, seq_len), ids in the vocabulary.

The id range is checked in row slabs of about ``SLAB_ELEMENTS`` ids, so a
file far larger than memory is read once, a slab at a time; the first bad id
(lowest row, x before y) is named with its file, dataset, row, column and value.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hpcpipe.errors import ConfigError
from hpcpipe.h5files import member, open_hdf5
from hpcpipe.lazy_h5py import h5py

SLAB_ELEMENTS = 1 << 20     # ids read per slab and dataset (8 MiB of int64)


def check_token_file(path: str | Path, x_name: str, y_name: str, seq_len: int, vocab_size: int) -> int:
    """Validate a token file (datasets, integer dtype, shapes (N, seq_len), ids in [0, vocab_size)); return N."""
    where = f"token file {str(path)!r}"
    with open_hdf5(path, where) as f:
        x, y = (_dataset(f, where, name) for name in (x_name, y_name))
        for name, d in ((x_name, x), (y_name, y)):
            if d.dtype == bool or not np.issubdtype(d.dtype, np.integer):
                raise ConfigError(f"dataset {name!r} in {where} has dtype {d.dtype}; token ids must be integers")
            if d.ndim != 2 or d.shape[1] != seq_len:
                raise ConfigError(f"dataset {name!r} in {where} has shape {d.shape}; expected (N, {seq_len}) "
                                  f"(N windows of model.seq_len = {seq_len} tokens)")
        if x.shape[0] != y.shape[0]:
            raise ConfigError(f"{where}: dataset {x_name!r} has {x.shape[0]} rows but {y_name!r} has "
                              f"{y.shape[0]}; each input row needs its row of next-token targets")
        n = x.shape[0]
        if n == 0:
            raise ConfigError(f"{where} holds no token windows (datasets {x_name!r} and {y_name!r} have 0 rows)")
        _check_ids(where, ((x_name, x), (y_name, y)), n, seq_len, vocab_size)
        return n


def _dataset(f: h5py.File, where: str, name: str) -> h5py.Dataset:
    """Return dataset name of f, or raise ConfigError listing what the file holds."""
    obj = member(f, name, where)
    if not isinstance(obj, h5py.Dataset):
        missing = "has no dataset" if obj is None else "has a group, not a dataset, at"
        raise ConfigError(f"{where} {missing} {name!r} (it has: {sorted(f.keys())})")
    return obj


def _check_ids(where: str, datasets, n: int, seq_len: int, vocab_size: int) -> None:
    """Raise ConfigError at the first id outside [0, vocab_size), scanning all datasets slab by slab."""
    rows = max(1, SLAB_ELEMENTS // max(seq_len, 1))
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        first = None        # (row, dataset order, column, name, value) of the earliest bad id in this slab
        for order, (name, d) in enumerate(datasets):
            slab = d[start:stop]
            bad = (slab >= vocab_size) if slab.dtype.kind == "u" else (slab < 0) | (slab >= vocab_size)
            if bad.any():
                r, c = divmod(int(np.argmax(bad.reshape(-1))), seq_len)
                hit = (start + r, order, c, name, int(slab[r, c]))
                first = hit if first is None else min(first, hit)
        if first is not None:
            row, _, col, name, value = first
            raise ConfigError(f"{where}: dataset {name!r} row {row} column {col} holds token id {value}, outside "
                              f"the vocabulary [0, {vocab_size}) (the first bad id in the file)")
