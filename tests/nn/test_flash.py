"""Tiled causal attention (hpcpipe.nn.core.flash) against the untiled softmax in float64 (1e-12): every tile size,
grouped query heads, queries that start later than key 0 (a prompt's chunk), sliding windows smaller and larger
than a tile, forward and backward; and the
memory it saves: a GPT at seq_len 4096 stashes at most 4.5x what it stashes at 1024 (no T x T array kept)."""

import numpy as np
import pytest

from hpcpipe.nn.core.flash import flash_backward, flash_forward


def _dense(q, k, v, scale, group, offset, window=0):
    """Softmax attention written out in full: returns (out, p, lse)."""
    rows, n_keys = q.shape[-2], k.shape[-2]
    s = q @ k.swapaxes(-1, -2) * scale
    q_pos = (np.arange(rows) // group + offset)[:, None]
    hidden = np.arange(n_keys)[None, :] > q_pos
    if window:
        hidden |= np.arange(n_keys)[None, :] <= q_pos - window
    s = np.where(hidden, -np.inf, s)
    top = s.max(-1, keepdims=True)
    e = np.exp(s - top)
    p = e / e.sum(-1, keepdims=True)
    return p @ v, p, (top + np.log(e.sum(-1, keepdims=True)))[..., 0]


@pytest.mark.parametrize("lead,group,t_q,offset,hd,tile,window", [
    ((2, 3), 2, 37, 0, 8, 8, 0), ((3,), 3, 5, 11, 4, 4, 0), ((1, 1), 1, 20, 0, 6, 128, 0), ((2,), 4, 9, 30, 8, 4, 0),
    ((2, 2), 1, 17, 0, 8, 1, 0), ((1,), 2, 64, 0, 16, 16, 0),
    ((2, 3), 2, 37, 0, 8, 8, 5), ((3,), 3, 5, 11, 4, 4, 3), ((1, 1), 1, 40, 0, 6, 16, 16), ((2,), 4, 9, 30, 8, 4, 1),
    ((1,), 1, 33, 0, 8, 8, 40)])
def test_tiles_equal_the_untiled_softmax(lead, group, t_q, offset, hd, tile, window):
    rng = np.random.default_rng(t_q + tile)
    n_keys = offset + t_q
    q = rng.standard_normal((*lead, t_q * group, hd))
    k, v = rng.standard_normal((*lead, n_keys, hd)), rng.standard_normal((*lead, n_keys, hd))
    scale = 1 / np.sqrt(hd)
    out, lse = flash_forward(np, q, k, v, scale, group, offset, tile, window)
    want, p, want_lse = _dense(q, k, v, scale, group, offset, window)
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=0, atol=1e-12)
    g = rng.standard_normal(out.shape)
    dq, dk, dv = flash_backward(np, q, k, v, lse, g, (g * out).sum(-1, keepdims=True), scale, group, offset, tile,
                                window)
    dp = g @ v.swapaxes(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * scale
    np.testing.assert_allclose(dv, p.swapaxes(-1, -2) @ g, rtol=0, atol=1e-12)
    np.testing.assert_allclose(dq, ds @ k, rtol=0, atol=1e-12)
    np.testing.assert_allclose(dk, ds.swapaxes(-1, -2) @ q, rtol=0, atol=1e-12)


def _stash(seq_len):
    from mpi4py import MPI

    from hpcpipe.config import from_dict
    from hpcpipe.train.setup import prepare
    from hpcpipe.train.trainer import Trainer
    cfg = from_dict({"parallel": {"pp": 1, "dp": 1}, "checkpoint": {"dir": ""}, "log": {"progress": False},
                     "model": {"kind": "gpt", "vocab_size": 64, "seq_len": seq_len, "d_model": 32, "n_heads": 4,
                               "n_blocks": 2},
                     "data": {"synthetic_samples": 4},
                     "train": {"micro_batches": 1, "micro_batch_size": 1}})
    trainer = Trainer(prepare(cfg, 1), MPI.COMM_SELF)
    try:
        trainer.compute_gradients(0)
        return trainer.engine.stats.peak_stash_bytes
    finally:
        trainer.close()


def test_the_training_stash_grows_linearly_with_the_context():
    short, long = _stash(1024), _stash(4096)
    assert long <= 4.5 * short, (short, long)
