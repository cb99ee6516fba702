"""Host memory: how much this node and this process can still get, and keeping freed memory for reuse.

What a rank may use is the smaller of its share of the node's available memory and
what its address-space limit (``ulimit -v``, RLIMIT_AS) still lets it map
(:func:`rank_share`): the start-up checks of training and inference refuse a run
that needs more, instead of dying in a MemoryError.

A step's large temporaries should reuse pages instead of faulting new ones.

glibc's malloc serves every block above its mmap threshold (at most 32 MiB) with a
fresh ``mmap`` and gives it back with ``munmap`` when NumPy frees it, and trims its
heap's free top above 128 KiB. A training step allocates and frees the same large
arrays every micro-batch (a GPT's logits and their gradient: micro-batch x T x vocab),
so each one faults in freshly zeroed pages again. Measured here (GPT, vocab 8192,
16 x 64 tokens per micro-batch, dp=2): 410-500 ms per step with glibc's defaults,
310-365 ms with every block from the heap and 1 GiB of free top kept, peak RSS the same.

Any ``MALLOC_*`` tuning variable in the environment means the user has chosen:
then nothing is changed. Other C libraries (musl, macOS) are left alone.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

M_TRIM_THRESHOLD = -1     # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_MAX = -4
KEEP_FREE_BYTES = 1 << 30
USER_TUNING = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


@functools.cache
def keep_freed_memory() -> bool:
    """Make glibc serve every block from its heap and keep up to 1 GiB freed; True if this process now does."""
    done = False
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc" \
            and not any(name in os.environ for name in USER_TUNING):
        try:
            mallopt = ctypes.CDLL(None).mallopt
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            # the trim threshold first: with mmap off and the default threshold every free would trim
            done = mallopt(M_TRIM_THRESHOLD, KEEP_FREE_BYTES) == 1 and mallopt(M_MMAP_MAX, 0) == 1
        except (OSError, AttributeError):
            done = False
    return done


def node_available_bytes() -> int:
    """Return the memory this node can still give (MemAvailable; else physical memory), in bytes; 0 if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def address_space_headroom() -> int | None:
    """Return how many more bytes this process may map under its address-space limit (``ulimit -v``), None if none.

    RLIMIT_AS caps each process's virtual size whatever the node has free: past it every
    allocation fails with a MemoryError. The headroom is the soft limit minus the current
    VmSize (0 when already past it).
    """
    try:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError):
        return None
    if soft == resource.RLIM_INFINITY or soft < 0:
        return None
    return max(0, soft - _vm_size())


def _vm_size() -> int:
    """This process's virtual size in bytes (VmSize of /proc/self/status; 0 when unknown)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def available_bytes() -> int:
    """Return the memory this process can still get: the node's MemAvailable, less if ``ulimit -v`` leaves less."""
    node, headroom = node_available_bytes(), address_space_headroom()
    if headroom is None:
        return node
    return min(node, headroom) if node > 0 else headroom


def rank_share(ranks_here: int, available: int | None = None,
               headroom: int | None = None) -> tuple[int | None, str]:
    """Return (bytes, how they were found) that each of ``ranks_here`` ranks of this node may use; None if unknown.

    The node's available memory is shared by its ranks, an address-space limit is per
    process: the share is the smaller of available / ranks_here and this process's headroom.
    Pass ``available`` (and ``headroom``) to decide instead of measuring; 0 available means unknown.
    The text reads e.g. "this node has 22.1 GiB available for 8 rank(s) (2.76 GiB each)".
    """
    if available is None:
        available, headroom = node_available_bytes(), address_space_headroom()
    ranks_here = max(1, ranks_here)
    share = available // ranks_here if available > 0 else None
    text = f"this node has {_gib(available)} available for {ranks_here} rank(s) ({_gib(available / ranks_here)} each)"
    if headroom is not None and (share is None or headroom < share):
        limit = f"each rank has {_gib(headroom)} left under its address-space limit (ulimit -v, RLIMIT_AS)"
        return headroom, limit if share is None else f"{limit}; {text}"
    return share, text


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.3g} GiB"
