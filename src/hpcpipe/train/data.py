"""Training data: the embedded synthetic set or an HDF5 file, sharded over data-parallel replicas.

Which sample goes where (fixed, documented, independent of pp and schedule):

* Step s consumes global positions ``s*G .. s*G + G - 1`` of the sample
  stream, G = dp x micro_batches x micro_batch_size. Position p is sample
  ``p mod N`` of epoch ``p div N``: file order, or, when data.shuffle is
  true, the sample at place ``p mod N`` of a permutation of [0, N) seeded by
  (data.seed, epoch) (:class:`hpcpipe.train.shuffle.EpochPermutation`, a keyed
  bijection evaluated only at the step's positions: O(batch) time and
  memory per step, whatever N is).
* Within the step's global batch, micro-batch m is the slice
  ``[m*dp*B, (m+1)*dp*B)`` and replica d takes rows ``[d*B, (d+1)*B)`` of it
  (B = micro_batch_size), as in the seeds' dp-sharded micro-batches.

Only first-stage ranks read inputs and only last-stage ranks read targets;
each reads just its replica's rows, never the whole file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from hpcpipe.config import DECODERS, Config
from hpcpipe.errors import ConfigError
from hpcpipe.h5files import WatchedFile, file_identity, member, open_hdf5
from hpcpipe.lazy_h5py import h5py
from hpcpipe.train.shuffle import EpochPermutation
from hpcpipe.train.tokens import check_token_file

if TYPE_CHECKING:
    from hpcpipe.state.tokenizer import StoredTokenizer


class InMemoryData:
    """Samples held in memory: inputs ``_x`` and targets ``_y``, row by row (the synthetic sets)."""

    n: int
    _x: np.ndarray
    _y: np.ndarray

    def __len__(self) -> int:
        return self.n

    def read_x(self, idx: np.ndarray) -> np.ndarray:
        """Return input rows (token windows) for sample indices."""
        return self._x[idx]

    def read_y(self, idx: np.ndarray) -> np.ndarray:
        """Return target rows, labels or next-token targets for sample indices."""
        return self._y[idx]


class SyntheticTokens(InMemoryData):
    """Synthetic GPT data: windows of a fixed random Markov chain where each token has 4 possible successors.

    The best possible loss is ln 4 = 1.386 nats per token, so a run shows learning
    long before it reaches it; every rank draws the same windows from data.seed.
    """

    SUCCESSORS = 4

    def __init__(self, config: Config):
        m = config.model
        self.n = config.data.synthetic_samples
        rng = np.random.default_rng([config.data.seed, 3])
        table = rng.integers(0, m.vocab_size, size=(m.vocab_size, self.SUCCESSORS))
        stream = np.empty((self.n, m.seq_len + 1), dtype=np.int64)
        stream[:, 0] = rng.integers(0, m.vocab_size, size=self.n)
        picks = rng.integers(0, self.SUCCESSORS, size=(self.n, m.seq_len))
        for t in range(m.seq_len):
            stream[:, t + 1] = table[stream[:, t], picks[:, t]]
        self._x, self._y = stream[:, :-1], stream[:, 1:]


class SyntheticData(InMemoryData):
    """Embedded default data: Gaussian inputs and a fixed random 'teacher' mapping to targets."""

    def __init__(self, config: Config):
        dims = config.model.dims
        self.n = config.data.synthetic_samples
        self.loss = config.train.loss
        rng = np.random.default_rng([config.data.seed, 1])
        self._x = rng.standard_normal((self.n, dims[0])).astype(config.model.dtype)
        teacher = np.random.default_rng([config.data.seed, 2]).standard_normal((dims[0], dims[-1]))
        z = self._x @ (teacher / np.sqrt(dims[0]))
        self._y = z.argmax(axis=1).astype(np.int64) if self.loss == "cross_entropy" \
            else np.abs(np.tanh(z)).astype(config.model.dtype)


class HDF5Data:
    """Samples read on demand from datasets x and y of an HDF5 file (its size re-checked after every read)."""

    def __init__(self, config: Config):
        self.path, self.xname, self.yname = config.data.path, config.data.x, config.data.y
        self.n = check_data_file(config)
        self.identity = file_identity(self.path)   # what was checked: any later change is a DataError
        self._file: WatchedFile | None = None

    def _f(self) -> WatchedFile:
        if self._file is None:
            self._file = WatchedFile(self.path, f"data file {self.path!r}", self.identity)
        return self._file

    def __len__(self) -> int:
        return self.n

    def _read(self, name: str, idx: np.ndarray) -> np.ndarray:
        # h5py fancy selection needs increasing unique indices: read sorted, then restore order
        uniq, inverse = np.unique(idx, return_inverse=True)
        watched = self._f()
        try:
            if len(uniq) and uniq[-1] - uniq[0] + 1 == len(uniq):
                rows = watched.file[name][int(uniq[0]):int(uniq[-1]) + 1]
            else:
                rows = watched.file[name][uniq]
        except OSError as exc:
            raise watched.read_failed(f"dataset {name!r}", exc) from None
        watched.check()   # a file truncated under us reads as zeros: refuse those rows
        return rows[inverse]

    def read_x(self, idx: np.ndarray) -> np.ndarray:
        """Return input rows for sample indices."""
        return self._read(self.xname, idx)

    def read_y(self, idx: np.ndarray) -> np.ndarray:
        """Return target rows (or labels) for sample indices."""
        return self._read(self.yname, idx)

    def close(self) -> None:
        """Close the file handle."""
        if self._file is not None:
            self._file.close()
            self._file = None


def check_data_file(config: Config) -> int:
    """Validate the HDF5 data file against the model and loss; return the sample count."""
    d, dims, loss = config.data, config.model.dims, config.train.loss
    if config.model.kind in DECODERS:
        return check_token_file(d.path, d.x, d.y, config.model.seq_len, config.model.vocab_size)
    label = f"data.path {d.path!r}"
    with open_hdf5(d.path, label) as f:
        x, y = (member(f, name, label) for name in (d.x, d.y))
        for name, obj in ((d.x, x), (d.y, y)):
            if not isinstance(obj, h5py.Dataset):
                raise ConfigError(f"data.path {d.path!r} has no dataset {name!r} (it has: {sorted(f.keys())})")
        if x.ndim != 2 or x.shape[1] != dims[0]:
            raise ConfigError(f"dataset {d.x!r} in {d.path!r} has shape {x.shape}; model.dims[0] = {dims[0]} "
                              f"needs (N, {dims[0]})")
        if x.dtype.kind != "f":
            raise ConfigError(f"dataset {d.x!r} in {d.path!r} has dtype {x.dtype}; a float dtype is needed")
        n = x.shape[0]
        if loss == "mse":
            if y.shape != (n, dims[-1]) or y.dtype.kind != "f":
                raise ConfigError(f"dataset {d.y!r} in {d.path!r} has shape {y.shape} dtype {y.dtype}; loss mse "
                                  f"needs float ({n}, {dims[-1]})")
        else:
            if y.shape != (n,) or y.dtype.kind not in "iu":
                raise ConfigError(f"dataset {d.y!r} in {d.path!r} has shape {y.shape} dtype {y.dtype}; "
                                  f"loss cross_entropy needs integer labels of shape ({n},)")
        if n == 0:
            raise ConfigError(f"data.path {d.path!r} holds no samples")
    return n


def data_tokenizer(path: str, vocab_size: int) -> StoredTokenizer | None:
    """Return a token file's tokenizer (root attribute, and files for kind hf), checked; None when it has none."""
    from hpcpipe.state.tokenizer import read_stored

    with open_hdf5(path, f"data.path {path!r}") as f:
        stored = read_stored(f, f"data.path {path!r}")
    if stored is None:
        return None
    if stored.vocab_size > vocab_size:
        raise ConfigError(f"data.path {path!r} was tokenized with a vocabulary of {stored.vocab_size} "
                          f"({stored.kind}); model.vocab_size = {vocab_size} is smaller")
    return stored


def open_data(config: Config) -> SyntheticData | SyntheticTokens | HDF5Data:
    """Return the configured data source (validated)."""
    if config.data.path:
        return HDF5Data(config)
    return SyntheticTokens(config) if config.model.kind in DECODERS else SyntheticData(config)


def step_samples(step: int, global_batch: int, n: int, shuffle: bool, seed: int, offset: int = 0,
                 rows: np.ndarray | None = None) -> np.ndarray:
    """Return the sample indices of a step's global batch (see the module docstring).

    ``offset`` shifts the stream position (``offset + step*G``); it is 0 except after
    resuming a checkpoint taken with a different global batch size. ``rows`` picks
    positions inside the global batch (a replica's share); default all G of them.
    Time and memory are O(len(rows)), whatever n is.
    """
    start = offset + step * global_batch
    positions = start + (np.arange(global_batch, dtype=np.int64) if rows is None else np.asarray(rows, np.int64))
    epochs, offsets = np.divmod(positions, n)
    if not shuffle:
        return offsets
    out = np.empty_like(offsets)
    for epoch in np.unique(epochs):   # a step spans at most a few epochs
        sel = epochs == epoch
        out[sel] = EpochPermutation(n, seed, int(epoch))(offsets[sel])
    return out


def replica_rows(dp: int, dp_rank: int, n_micro: int, batch: int) -> np.ndarray:
    """Return the positions inside a global batch that replica dp_rank takes, micro-batch by micro-batch."""
    return np.concatenate([np.arange(m * dp * batch + dp_rank * batch, m * dp * batch + (dp_rank + 1) * batch)
                           for m in range(n_micro)])


class ReplicaFeeder:
    """Reads each step's inputs/targets for one replica, split into micro-batches."""

    def __init__(self, source: SyntheticData | HDF5Data, config: Config, dp: int, dp_rank: int,
                 need_x: bool, need_y: bool):
        tr = config.train
        self.source = source
        self.global_batch = dp * tr.micro_batches * tr.micro_batch_size
        self.rows = replica_rows(dp, dp_rank, tr.micro_batches, tr.micro_batch_size)
        self.n_micro, self.batch = tr.micro_batches, tr.micro_batch_size
        self.shuffle, self.seed = config.data.shuffle, config.data.seed
        self.need_x, self.need_y = need_x, need_y
        gpt = config.model.kind in DECODERS
        self.dtype = config.model.dtype
        self.x_dtype = "int64" if gpt else self.dtype     # token ids index the embedding
        self.offset = 0      # stream position shift, set when resuming at another global batch size
        # token ids were all checked before step 0 (train.tokens.check_token_file)
        self.n_classes = config.model.dims[-1] if config.train.loss == "cross_entropy" and not gpt else 0
        self.label = config.data.path or "the synthetic data"
        self.xname, self.yname = config.data.x, config.data.y

    def position(self, step: int) -> int:
        """Return the stream position (samples consumed) before the given step."""
        return self.offset + step * self.global_batch

    def step(self, step: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Return ([x per micro-batch], [y per micro-batch]) for this replica at a step (empty when not needed)."""
        if not (self.need_x or self.need_y):
            return [], []
        idx = step_samples(step, self.global_batch, len(self.source), self.shuffle, self.seed, self.offset,
                           self.rows)
        x = np.ascontiguousarray(self.source.read_x(idx), dtype=self.x_dtype) if self.need_x else None
        y = self.source.read_y(idx) if self.need_y else None
        if y is not None and y.dtype.kind in "iu":
            y = y.astype(np.int64, copy=False)
        if y is not None and y.dtype.kind == "f":
            y = y.astype(self.dtype, copy=False)
        for name, rows in ((self.xname, x), (self.yname, y)):
            if rows is not None and rows.dtype.kind == "f":
                self._check_finite(name, rows, idx, step)
        xs = np.split(x, self.n_micro) if x is not None else []
        ys = np.split(y, self.n_micro) if y is not None else []
        if self.n_classes and ys:
            bad = [int(v) for y in ys for v in y[(y < 0) | (y >= self.n_classes)]]
            if bad:
                raise ConfigError(f"labels in {self.label!r} must be in [0, {self.n_classes}) for "
                                  f"model.dims[-1] = {self.n_classes}; step {step} reads label {bad[0]}")
        return xs, ys

    def _check_finite(self, name: str, rows: np.ndarray, idx: np.ndarray, step: int) -> None:
        """Raise ConfigError naming the file, dataset and sample when a row read holds NaN or Inf.

        A non-finite input or target makes every step that contains it non-finite: the
        run would skip those steps (or stop with exit 77) instead of saying why. One
        pass over the rows just read: O(batch), nothing is scanned ahead.
        """
        finite = np.isfinite(rows)
        if finite.all():
            return
        bad = np.flatnonzero(~finite.reshape(len(rows), -1).all(axis=1))
        sample = int(np.min(idx[bad]))
        value = rows[idx == sample].reshape(-1)
        value = value[~np.isfinite(value)][0]
        raise ConfigError(f"dataset {name!r} in {self.label!r} holds a non-finite value ({value}) in row {sample} "
                          f"(read at step {step}); fix or drop that row")
