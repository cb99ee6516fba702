"""Arrays in their own mappings (hpcpipe.kernels.mapped): zeroed, writable, and resident only where written,
which is what keeps a KV cache sized for the whole context from occupying it (hpcpipe.nn.core.kv_pages)."""

import sys
from pathlib import Path

import numpy as np
import pytest

from hpcpipe.kernels.mapped import mapped_zeros
from hpcpipe.nn.core.kv_pages import PagedLayout


def _anon_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0


def test_mapped_zeros_are_zero_writable_and_contiguous():
    a = mapped_zeros((3, 5, 7), np.float32)
    assert a.shape == (3, 5, 7) and a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable
    assert not a.any()
    a[1, 2] = 4.0
    assert a.sum() == 28.0
    assert mapped_zeros((0, 4), np.int8).shape == (0, 4)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_host_kv_cache_is_resident_only_where_written():
    # 256 MiB of cache (4 blocks of 2 x 4 heads x 8192 positions x 256 floats); one sequence writes 32
    # positions: 4 x 2 x 4 KV blocks of 16 positions x 256 floats, 16 KiB each, about 1 MiB in all
    paged = PagedLayout(1, 8192, page=16)
    before = _anon_kib()
    cache = paged.allocate(np, np.float32, 4, 4, 256)
    assert cache.nbytes == 256 << 20 and not cache[:, :, :, 1].any()
    cache[:, :, :, :2] = 1.0
    grown = _anon_kib() - before
    assert grown < 32 << 10, f"{grown} KiB resident for 1 MiB written"     # all of it would be 262144 KiB
    assert cache.sum() == 4 * 2 * 4 * 32 * 256
