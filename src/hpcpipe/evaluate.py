"""Held-out evaluation on one process: sequential NumPy forward of stored weights over an HDF5 data file.

    python -m hpcpipe.evaluate --weights checkpoints --data data/digits-test.h5

Weights are anything :func:`hpcpipe.checkpoint.resolve_weights` accepts; the
model (dims, activation, final_activation) is the one stored with them.
Prints accuracy (integer labels) or mean squared error (float targets).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from .checkpoint import resolve_weights
from .errors import ConfigError
from .layers import make_activation


def forward(arrays: dict[int, dict[str, np.ndarray]], model: dict[str, Any], x: np.ndarray) -> np.ndarray:
    """Return the model output for inputs x, layer by layer (float32, as training)."""
    n = len(arrays)
    a = np.asarray(x, dtype=np.float32)
    for i in range(n):
        z = a @ arrays[i]["weight"]
        if "bias" in arrays[i]:
            z = z + arrays[i]["bias"]
        last = i == n - 1
        name = model.get("activation", "relu") if (not last or model.get("final_activation", True)) else "identity"
        a, _ = make_activation(name).forward(np, z)
    return a


def evaluate(weights: str | Path, data: str | Path, x_name: str = "x", y_name: str = "y") -> dict[str, Any]:
    """Return {'n', 'accuracy'} for integer labels or {'n', 'mse'} for float targets on a data file."""
    source = resolve_weights(weights)
    arrays = source.read(list(range(source.n_layers)))
    p = Path(data)
    if not p.is_file():
        raise ConfigError(f"data file {str(p)!r} does not exist")
    with h5py.File(p, "r") as f:
        for name in (x_name, y_name):
            if name not in f:
                raise ConfigError(f"data file {str(p)!r} has no dataset {name!r}")
        x, y = f[x_name][...], f[y_name][...]
    if x.ndim != 2 or x.shape[1] != arrays[0]["weight"].shape[0]:
        raise ConfigError(f"dataset {x_name!r} in {str(p)!r} has shape {x.shape}; the weights take "
                          f"{arrays[0]['weight'].shape[0]} features")
    out = forward(arrays, source.model, x)
    result: dict[str, Any] = {"n": int(len(x)), "weights": str(source.path), "step": source.step}
    if y.dtype.kind in "iu":
        result["accuracy"] = float(np.mean(out.argmax(axis=1) == y))
    else:
        result["mse"] = float(np.mean((out - y) ** 2))
    return result


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m hpcpipe.evaluate``; prints one JSON line, returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m hpcpipe.evaluate", description=__doc__.split("\n")[0])
    parser.add_argument("--weights", required=True, help="weights file, checkpoint root or step directory")
    parser.add_argument("--data", required=True, help="HDF5 file with datasets x and y")
    parser.add_argument("--x", default="x")
    parser.add_argument("--y", default="y")
    args = parser.parse_args(argv)
    try:
        print(json.dumps(evaluate(args.weights, args.data, args.x, args.y)))
    except ConfigError as exc:
        print(f"hpcpipe.evaluate: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
