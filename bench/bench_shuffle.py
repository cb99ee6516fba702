"""Cost of the per-step sample order: data.shuffle = true vs false, and vs reading the rows.

    python bench/bench_shuffle.py                      # n = 2e7 and 6.25e8, global batch 1024
    python bench/bench_shuffle.py --read               # also read the step's rows from an HDF5 file of n = 2e7
    python bench/bench_shuffle.py --old                # also time the old permutation(n) per step (n = 2e7 only)

Prints milliseconds per step (median of --steps steps at spread-out stream positions).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

from hpcpipe.train.data import step_samples


def per_step(fn, steps: int) -> float:
    """Median milliseconds of fn(step) over spread-out steps."""
    times = []
    for k in range(steps):
        t0 = time.perf_counter()
        fn(k * 7919)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def old_shuffle(step: int, g: int, n: int, seed: int) -> np.ndarray:
    """The previous implementation: a full permutation(n) per epoch touched, every step."""
    positions = np.arange(step * g, step * g + g, dtype=np.int64)
    epochs, offsets = np.divmod(positions, n)
    out = np.empty_like(offsets)
    for epoch in np.unique(epochs):
        perm = np.random.default_rng([seed, int(epoch)]).permutation(n)
        sel = epochs == epoch
        out[sel] = perm[offsets[sel]]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=1024, help="global batch (samples per step)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--read", action="store_true", help="also time reading the rows (HDF5, n = 2e7 x 4 float32)")
    parser.add_argument("--old", action="store_true", help="also time the old full permutation (n = 2e7)")
    args = parser.parse_args()
    g = args.batch
    for n in (20_000_000, 625_000_000):
        plain = per_step(lambda s, n=n: step_samples(s, g, n, False, 0), args.steps)
        shuffled = per_step(lambda s, n=n: step_samples(s, g, n, True, 0), args.steps)
        print(f"n={n:.3g} batch={g}: order per step {plain:.3f} ms unshuffled, {shuffled:.3f} ms shuffled")
    if args.old:
        n = 20_000_000
        old = per_step(lambda s: old_shuffle(s, g, n, 0), 3)
        print(f"n={n:.3g} batch={g}: old permutation(n) per step {old:.1f} ms")
    if args.read:
        import h5py
        n, width = 20_000_000, 4
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "data.h5")
            with h5py.File(path, "w") as f:
                x = f.create_dataset("x", (n, width), dtype=np.float32)
                block = 1_000_000
                for a in range(0, n, block):
                    x[a:a + block] = np.full((block, width), a, np.float32)
            with h5py.File(path, "r") as f:
                x = f["x"]

                def read(s: int, shuffle: bool) -> None:
                    idx = step_samples(s, g, n, shuffle, 0)
                    uniq = np.unique(idx)
                    if uniq[-1] - uniq[0] + 1 == len(uniq):
                        x[int(uniq[0]):int(uniq[-1]) + 1]
                    else:
                        x[uniq]
                plain = per_step(lambda s: read(s, False), args.steps)
                shuffled = per_step(lambda s: read(s, True), args.steps)
            print(f"n={n:.3g} x {width} float32, batch={g}: order + read per step {plain:.2f} ms unshuffled, "
                  f"{shuffled:.2f} ms shuffled")


if __name__ == "__main__":
    main()
