"""The compiled attention step (csrc/attend.c) against float64 NumPy of softmax(q k / sqrt(hd)) v over each row's
sequence, on the AVX-512 and the portable paths: prompt chunks (query tiles) of 1..70 rows, decode rows, both
mixed in one call, GQA / MQA, sliding windows, a prefix already cached, scattered KV blocks (float32: within
1e-5 of the largest value)."""

import numpy as np
import pytest

from hpcpipe.kernels import cpu
from hpcpipe.kernels.stage import attend

pytestmark = pytest.mark.skipif(cpu.library() is None, reason="compiled kernels not built (no C compiler)")

PAGE, SEQ_LEN = 8, 160


@pytest.fixture(params=["vector", "portable"])
def paths(request):
    if request.param == "vector" and cpu.vector_paths() != "avx512":
        pytest.skip("this CPU has no AVX-512: the portable paths are the only ones")
    cpu.use_portable(request.param == "portable")
    yield request.param
    cpu.use_portable(False)


def _reference(cache, tables, slots, positions, q, n_kv, window):
    """Each row's heads in float64 from the cache as the call left it (keys and values of the call's rows in it)."""
    _, kv, _, page, hd = cache.shape
    m, n_heads = q.shape[0], q.shape[1] // hd
    out = np.zeros((m, n_heads, hd))
    for r in range(m):
        p = positions[r]
        first = p - window + 1 if window and p >= window else 0
        seq = np.arange(first, p + 1)
        at = tables[slots[r], seq // page], seq % page
        for h in range(n_heads):
            j = h // (n_heads // n_kv)
            keys, values = cache[0, j][at].astype(np.float64), cache[1, j][at].astype(np.float64)
            s = keys @ q[r, h * hd:(h + 1) * hd].astype(np.float64) / np.sqrt(hd)
            w = np.exp(s - s.max())
            out[r, h] = w @ values / w.sum()
    return out.reshape(m, -1)


def _check(rng, n_heads, n_kv, hd, window, rows):
    """One call of ``rows`` (slot, first position, count) over a cache whose earlier positions hold a prefix."""
    slots_n, pages = 4, 4 * SEQ_LEN // PAGE
    tables = rng.permutation(pages)[:slots_n * SEQ_LEN // PAGE].reshape(slots_n, -1).astype(np.int64)
    cache = rng.standard_normal((2, n_kv, pages, PAGE, hd)).astype(np.float32)     # the prefixes: cached
    slots = np.concatenate([np.full(n, s) for s, _, n in rows]).astype(np.int64)
    positions = np.concatenate([np.arange(p, p + n) for _, p, n in rows]).astype(np.int64)
    qkv = (rng.standard_normal((len(slots), (n_heads + 2 * n_kv) * hd)) * 2).astype(np.float32)
    got = attend(qkv, cache, tables, slots, positions, n_heads, n_kv, SEQ_LEN, window)
    k = qkv[:, n_heads * hd:].reshape(len(slots), 2, n_kv, hd)
    for r, (s, p) in enumerate(zip(slots, positions, strict=True)):      # the rows' keys and values written
        np.testing.assert_array_equal(cache[:, :, tables[s, p // PAGE], p % PAGE], k[r])
    want = _reference(cache, tables, slots, positions, qkv[:, :n_heads * hd], n_kv, window)
    err = np.abs(got - want).max()
    assert err <= 1e-5 * np.abs(cache[1]).max(), (n_heads, n_kv, hd, window, rows, err)


@pytest.mark.parametrize("heads", [(4, 4), (6, 3), (9, 3), (8, 2), (8, 1), (16, 1), (3, 1)])
@pytest.mark.parametrize("hd", [16, 64, 48, 128, 12])
def test_prompt_chunks_at_ragged_lengths_equal_the_reference(paths, heads, hd):
    rng = np.random.default_rng(hd * 100 + heads[0] * 10 + heads[1])
    for m in (1, 2, 3, 5, 7, 15, 16, 17, 33, 70):
        start = int(rng.integers(0, SEQ_LEN - m + 1))
        _check(rng, *heads, hd, 0, [(int(rng.integers(0, 4)), start, m)])


@pytest.mark.parametrize("window", [0, 1, 3, 17])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 2)])
def test_mixed_calls_with_windows_and_cached_prefixes_equal_the_reference(paths, heads, window):
    rng = np.random.default_rng(window * 7 + heads[0])
    calls = [
        [(0, 0, 37), (1, 12, 1), (2, 5, 1), (3, 40, 9)],      # a prompt, two decode rows, a later chunk
        [(2, 90, 1), (0, 64, 64), (1, 0, 1)],                  # a 64-row chunk after a cached prefix of 64
        [(3, 100, 3), (1, 3, 20), (0, 150, 10)],               # short chunks, the last reaching seq_len
        [(1, 7, 70)],
        [(0, 15, 1), (1, 16, 1), (2, 31, 1), (3, 47, 1)],       # decode rows over 16, 17, 32 and 48 keys
    ]
    for rows in calls:
        _check(rng, *heads, 64, window, rows)
    _check(rng, *heads, 48, window, calls[0])


def test_attend_refuses_rows_outside_the_cache():
    cache = np.zeros((2, 1, 4, PAGE, 16), np.float32)
    tables = np.arange(4, dtype=np.int64).reshape(1, 4)
    qkv = np.zeros((1, 3 * 16), np.float32)
    with pytest.raises(ValueError, match="outside the cache"):
        attend(qkv, cache, tables, np.array([0]), np.array([32]), 1, 1, SEQ_LEN)
    with pytest.raises(ValueError, match="do not hold"):
        attend(qkv, cache, tables, np.array([0]), np.array([0]), 2, 1, SEQ_LEN)
