"""KV-cached decoding split over tensor-parallel MPI ranks (hpcpipe.nn.core.decode with a TPGroup): every rank holds
its heads, key/value heads, MLP columns and vocabulary rows; the gathered logits of prefill and decode steps
equal one rank's whole stage (float64, 1e-12 relative) for GPT and llama (tied and untied heads, kv heads split
and kv heads held by several ranks), on the stage holding everything and on split stages."""

import numpy as np
import pytest
from mpi4py import MPI

from hpcpipe.nn.core.decode import DecodeStage, Segment
from hpcpipe.nn.core.decoder_model import Decoder
from hpcpipe.nn.core.sharding import vocab_range
from hpcpipe.nn.gpt.model import GPTModel
from hpcpipe.nn.gpt.shape import GPTShape
from hpcpipe.nn.llama.model import LlamaModel
from hpcpipe.nn.llama.shape import LlamaShape
from hpcpipe.runtime.backend import select_backend
from hpcpipe.runtime.comm import Poller
from hpcpipe.runtime.tp_group import TPGroup

SHAPES = {
    "gpt_tied": GPTModel(GPTShape(vocab=37, seq_len=16, d_model=16, n_heads=4, n_blocks=2, d_ff=24, tied=True)),
    "llama_gqa_untied": LlamaModel(LlamaShape(vocab=31, seq_len=16, d_model=16, n_heads=4, n_blocks=2, d_ff=24,
                                              n_kv_heads=2, qkv_bias=True)),
    "llama_mqa_tied": LlamaModel(LlamaShape(vocab=29, seq_len=16, d_model=16, n_heads=4, n_blocks=2, d_ff=16,
                                            n_kv_heads=1, tied=True)),
}


def _arrays(model):
    rng = np.random.default_rng(5)
    out = {}
    for i, group in enumerate(model.params):
        out[i] = {name: np.array(v) + rng.standard_normal(v.shape) * 0.3 for name, v in group.items()}
    return out


def _local(arrays, model, tp, rank):
    out = {}
    for i, group in arrays.items():
        cut = model.shards(i, tp, rank)
        out[i] = {name: np.ascontiguousarray(cut[name].take(a)) for name, a in group.items()}
    return out


def _run(stage, group, shape, steps):
    """Prefill two sequences, then decode both for ``steps`` tokens; return the gathered logits of each call."""
    rng = np.random.default_rng(3)
    first = rng.integers(0, shape.vocab, 5)
    second = rng.integers(0, shape.vocab, 3)
    calls = [(np.concatenate([first, second]), [Segment(1, 0, 5), Segment(0, 0, 3)])]
    for t in range(steps):
        calls.append((rng.integers(0, shape.vocab, 2), [Segment(0, 3 + t, 1), Segment(1, 5 + t, 1)]))
    out = []
    for tokens, segments in calls:
        logits = stage.forward(tokens, segments)
        if group is not None:
            widths = [vocab_range(shape.vocab, group.size, r)[1] - vocab_range(shape.vocab, group.size, r)[0]
                      for r in range(group.size)]
            logits = group.gather_columns(logits, widths)
        out.append(logits)
    return out


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_tp_decode_logits_equal_one_rank(kind):
    world = MPI.COMM_WORLD
    size = 4 if world.Get_size() >= 4 else 2
    comm = world.Split(0 if world.Get_rank() < size else MPI.UNDEFINED, world.Get_rank())
    if comm == MPI.COMM_NULL:
        world.Barrier()
        return
    model = SHAPES[kind]
    shape = model.shape
    arrays = _arrays(Decoder(model, dtype="float64", seed=1))
    backend = select_backend("numpy")
    group = TPGroup(comm, backend, Poller())
    rank = comm.Get_rank()
    whole = range(shape.n_groups)
    got = _run(DecodeStage(model, whole, _local(arrays, model, size, rank), np, "float64", 2, tp=group),
               group, shape, 4)
    # a split stage too: the blocks and the head without the embedding (a tied head gets the rank's table rows)
    tail = range(1, shape.n_groups)
    mine = _local(arrays, model, size, rank)
    table = mine[0]["tok_emb"] if shape.tied else None
    head_only = DecodeStage(model, tail, mine, np, "float64", 2, tok_emb=table, tp=group)
    emb = DecodeStage(model, range(0, 1), mine, np, "float64", 2, tp=group)
    tokens = np.array([3, 1, 4, 1, 5], dtype=np.int64)
    split = group.gather_columns(head_only.forward(emb.forward(tokens, [Segment(0, 0, 5)]), [Segment(0, 0, 5)]),
                                 [vocab_range(shape.vocab, size, r)[1] - vocab_range(shape.vocab, size, r)[0]
                                  for r in range(size)])
    if rank == 0:
        ref = DecodeStage(model, whole, arrays, np, "float64", 2)
        want = _run(ref, None, shape, 4)
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g.shape == w.shape, (step, g.shape, w.shape)
            assert np.abs(g - w).max() <= 1e-12 * np.abs(w).max(), (kind, step, np.abs(g - w).max())
        whole_split = DecodeStage(model, whole, arrays, np, "float64", 2).forward(tokens, [Segment(0, 0, 5)])
        assert np.abs(split - whole_split).max() <= 1e-12 * np.abs(whole_split).max()
    else:
        assert all(g is None for g in got) and split is None
    kv_whole = shape.n_heads if isinstance(shape, GPTShape) else shape.n_kv_heads
    stage = DecodeStage(model, whole, _local(arrays, model, size, rank), np, "float64", 2, tp=group)
    assert stage.n_kv_heads == max(1, kv_whole // size), (stage.n_kv_heads, kv_whole, size)   # the cache's heads
    positions = -(-shape.seq_len // 16) * 16           # whole KV blocks of 16
    assert stage.cache_bytes == 2 * shape.n_blocks * 2 * stage.n_kv_heads * positions * stage.head_dim * 8
    comm.Free()
    world.Barrier()
