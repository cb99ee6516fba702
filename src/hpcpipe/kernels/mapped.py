"""Host arrays in their own anonymous memory mappings, given back to the system when the array goes.

NumPy takes its arrays from the C heap (malloc). A model loaded a matrix at a time makes and frees many
arrays of a few hundred KiB around the ones it keeps (parts stacked into one q | k | v matrix, quantization
scratch), and glibc raises its mmap threshold as large blocks are freed, so those land in the heap: the freed
ones stay resident as holes between kept weights (~14 MiB for a 135 M-parameter q8_0 model). An array in its
own mapping is committed page by page as it is written and unmapped when freed, wherever it lies.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

HUGE = 2 << 20     # a mapping this large may use transparent huge pages (fewer TLB misses streaming weights)


def mapped_zeros(shape: tuple[int, ...], dtype: Any, huge: bool = True) -> np.ndarray:
    """A zeroed C-contiguous array of its own anonymous mapping (``huge`` False: 4 KiB pages only, so memory is
    committed only where written; True: huge pages allowed where the system offers them on request)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    nbytes = max(1, count * dtype.itemsize)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE" if huge and nbytes >= HUGE else "MADV_NOHUGEPAGE", None)
    if advice is not None:                          # Linux; elsewhere the system's default stands
        buffer.madvise(advice)
    return np.frombuffer(buffer, dtype=dtype, count=count).reshape(shape)
