"""Write scikit-learn's bundled handwritten digits (8x8 images, 10 classes) as hpcpipe HDF5 data files.

    python examples/digits_to_hdf5.py --out data        # -> data/digits-train.h5, data/digits-test.h5

The data ship inside scikit-learn (no download). Pixels are scaled from
0..16 to 0..1 as float32 ``x`` (N, 64); ``y`` (N,) holds int64 labels 0..9.
The split is stratified and seeded: 1437 training and 360 held-out images.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import h5py
import numpy as np

SOURCE = "sklearn.datasets.load_digits"     # the root attribute that marks this example's own output


def write(path: Path, x: np.ndarray, y: np.ndarray) -> None:
    """Write one data file with checksummed datasets x and y."""
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=x.astype(np.float32), fletcher32=True, chunks=True)
        f.create_dataset("y", data=y.astype(np.int64), fletcher32=True, chunks=True)
        f.attrs["source"] = SOURCE


def foreign(path: Path) -> bool:
    """Whether path exists and is not a digits file this example wrote (another file of that name is not replaced)."""
    if not os.path.lexists(path):
        return False
    try:
        with h5py.File(path, "r") as f:
            return f.attrs.get("source") != SOURCE
    except OSError:    # not HDF5 at all, or unreadable
        return True


def main(argv: list[str] | None = None) -> None:
    """Split the digits into train/test and write both files."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        sys.exit("error: this example needs scikit-learn (its bundled digits): pip install scikit-learn")

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="data", help="output directory (default: data)")
    parser.add_argument("--test-size", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="replace output files this example did not write")
    args = parser.parse_args(argv)
    if os.path.lexists(args.out) and not os.path.isdir(args.out):
        parser.error(f"--out {args.out!r} exists and is not a directory: name a directory (it is made if missing)")
    if not 0 < args.test_size < 1:
        parser.error(f"--test-size must be between 0 and 1 (a fraction of the images), got {args.test_size}")
    others = [str(Path(args.out) / name) for name in ("digits-train.h5", "digits-test.h5")
              if foreign(Path(args.out) / name)]
    if others and not args.force:
        parser.error(f"{', '.join(others)} exist(s) and were not written by this example; it replaces only its own "
                     f"earlier output: move them away, choose another --out, or pass --force")
    digits = load_digits()
    x = digits.data / 16.0
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=args.test_size,
                                                        random_state=args.seed, stratify=digits.target)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write(out / "digits-train.h5", x_train, y_train)
    write(out / "digits-test.h5", x_test, y_test)
    print(f"wrote {out / 'digits-train.h5'} ({len(x_train)} samples) and {out / 'digits-test.h5'} "
          f"({len(x_test)} samples)")


if __name__ == "__main__":
    main()
