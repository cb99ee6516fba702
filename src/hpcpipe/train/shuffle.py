"""A seeded bijection of [0, n) evaluated only where it is asked: the per-epoch shuffled order of the data.

``EpochPermutation(n, seed, epoch)(positions)`` returns the sample index at
each position of that epoch's order. It is an (unbalanced) Feistel network
over the smallest power-of-two domain that covers n, with cycle walking for
values that land outside [0, n): a keyed permutation of the domain, walked
until it lands inside [0, n), is a permutation of [0, n).
The round keys come from ``numpy.random.default_rng([seed, epoch])``; the
round function is the SplitMix64 finaliser of (half xor key), so the order
depends on (seed, epoch, n) only.

Cost: O(len(positions)) time and memory, independent of n (no
``permutation(n)``); the domain is below 2n, so a position needs under two
passes on average (each pass 8 rounds of a few uint64 operations).
"""

from __future__ import annotations

import numpy as np

ROUNDS = 8
# the name of this order, recorded in checkpoints: a resume under another order warns (train.trainer)
ORDER = "feistel-splitmix64-8"
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser (a bijective 64-bit mixer) applied to a uint64 array, in place."""
    z ^= z >> np.uint64(30)
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    z ^= z >> np.uint64(31)
    return z


class EpochPermutation:
    """The shuffled order of one epoch: a keyed bijection of [0, n), evaluated position by position."""

    def __init__(self, n: int, seed: int, epoch: int):
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = int(n)
        bits = max(1, (self.n - 1).bit_length())   # domain 2**bits < 2n: under two passes per value on average
        self.lo = np.uint64(bits - bits // 2)
        self.lo_mask = np.uint64((1 << (bits - bits // 2)) - 1)
        self.hi_mask = np.uint64((1 << (bits // 2)) - 1)
        self.keys = np.random.default_rng([seed, epoch]).bit_generator.random_raw(ROUNDS).astype(np.uint64)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        # unbalanced Feistel: each round xors one half with a keyed hash of the other (invertible whatever
        # the widths), alternating halves
        hi, lo = x >> self.lo, x & self.lo_mask
        for r, key in enumerate(self.keys):
            if r % 2:
                hi ^= _mix(lo ^ key) & self.hi_mask
            else:
                lo ^= _mix(hi ^ key) & self.lo_mask
        return (hi << self.lo) | lo

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """Return the sample index (int64) at each position in [0, n) of this epoch's order."""
        out = self._encrypt(np.asarray(positions, dtype=np.uint64))
        n = np.uint64(self.n)
        pending = np.flatnonzero(out >= n)
        while len(pending):   # cycle walking: re-encrypt until the value falls inside [0, n)
            again = self._encrypt(out[pending])
            out[pending] = again
            pending = pending[again >= n]
        return out.astype(np.int64)
