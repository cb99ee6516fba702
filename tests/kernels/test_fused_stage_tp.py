"""The compiled decode stage under tensor parallelism (2 MPI ranks): each rank holds its heads' q|k|v rows and o
columns, its ff slice of gate|up (fc) and down (proj), its vocabulary rows; the two row-parallel partial sums of
every block are summed over the ranks from inside the C stage. Prefill of two sequences, decode steps of both
and a third prompt beside them: the gathered logits equal the NumPy steps at tp = 2 and the compiled stage at
tp = 1 within 1e-5 of the largest logit (and the NumPy steps with the weights kept as stored, as a GPU stage
keeps them, equal the widened ones), for a llama kind (GQA, with and without sliding windows) and a GPT, in
float32 weights, stored bfloat16 and q8_0 (whose rank slices are whole blocks of 32); a q8_0 split that is not
is refused with its reason."""

import numpy as np
import pytest
from mpi4py import MPI

from hpcpipe.kernels import cpu
from hpcpipe.kernels.formats import RowWeight
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

pytestmark = pytest.mark.skipif(cpu.library() is None, reason="compiled kernels not built (no C compiler)")

# o's input slice at tp = 2: 2 heads x 16 = 32, down's: ff / 2 = 32 or 64 (whole q8_0 blocks)
MODELS = {
    "llama_gqa_untied": lambda: LlamaModel(LlamaShape(41, 24, 64, 4, 3, d_ff=64, n_kv_heads=2, qkv_bias=True)),
    "llama_gqa_window_tied": lambda: LlamaModel(LlamaShape(43, 24, 64, 4, 3, d_ff=64, n_kv_heads=2, tied=True,
                                                           sliding_window=3, sliding_layers=(0, 2))),
    "gpt_tied": lambda: GPTModel(GPTShape(37, 24, 64, 4, 2, d_ff=128, tied=True)),
}


def _group():
    comm = MPI.COMM_WORLD.Split(0 if MPI.COMM_WORLD.Get_rank() < 2 else MPI.UNDEFINED, MPI.COMM_WORLD.Get_rank())
    return None if comm == MPI.COMM_NULL else TPGroup(comm, select_backend("numpy"), Poller())


def _calls(vocab, rng):
    """Two prompts, decode steps of both, then a third prompt beside a decode step (one call mixes them)."""
    calls = [(rng.integers(0, vocab, 9), [Segment(2, 0, 5), Segment(0, 0, 4)])]
    for t in range(5):
        calls.append((rng.integers(0, vocab, 2), [Segment(0, 4 + t, 1), Segment(2, 5 + t, 1)]))
    calls.append((rng.integers(0, vocab, 4), [Segment(1, 0, 3), Segment(0, 9, 1)]))
    return calls


def _stored(arrays):
    """Every matrix as a stored bfloat16 (out, in) RowWeight (tok_emb: (vocab, d) as it is), vectors float32."""
    out = {}
    for i, group in arrays.items():
        out[i] = {}
        for name, value in group.items():
            if value.ndim == 2 and name != "pos_emb":
                rows = value if name == "tok_emb" else value.T
                bits = (np.ascontiguousarray(rows, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
                out[i][name] = RowWeight("bfloat16", bits)
            else:
                out[i][name] = value
    return out


def _local(model, arrays, tp, rank):
    """Rank ``rank``'s parts (model.shards); a RowWeight is (out, in), so its cut axis is the other one."""
    out = {}
    for i, group in arrays.items():
        cut = model.shards(i, tp, rank)
        out[i] = {}
        for name, value in group.items():
            shard = cut[name]
            if isinstance(value, RowWeight):
                axis = shard.axis if shard.axis is None or name == "tok_emb" else 1 - shard.axis
                key = [slice(None)] * 2
                if axis is not None:
                    key[axis] = shard.index
                out[i][name] = RowWeight(value.kind, np.ascontiguousarray(value.data[tuple(key)]))
            else:
                out[i][name] = np.ascontiguousarray(shard.take(value))
    return out


def _run(model, arrays, fmt, compiled, group, calls, compact=False):
    """Every call through a whole-model stage; logits gathered over the tp ranks (on rank 0). ``compact``: the
    NumPy steps with the weights kept as stored (a GPU stage's way, hpcpipe.nn.core.stage_weights)."""
    shape = model.shape
    stage = DecodeStage(model, range(shape.n_groups), arrays, np, "float32", 3, tp=group, weight_format=fmt,
                        compiled=compiled, compact=compact)
    assert stage.compiled == compiled
    out = []
    for tokens, segments in calls:
        logits = stage.forward(tokens, segments)
        if group is not None:
            widths = [np.subtract(*vocab_range(shape.vocab, 2, r)[::-1]) for r in range(2)]
            logits = group.gather_columns(logits, widths)
        out.append(logits)
    return out


def _close(got, want, what):
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape, (what, step)
        assert np.abs(g - w).max() <= 1e-5 * np.abs(w).max(), (what, step, np.abs(g - w).max() / np.abs(w).max())


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("fmt", ["float32", "stored", "q8_0"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_compiled_tp_2_equals_numpy_tp_2_and_compiled_tp_1(name, fmt):
    group = _group()
    if group is None:
        MPI.COMM_WORLD.Barrier()
        return
    model = MODELS[name]()
    rng = np.random.default_rng(len(name))
    ref = Decoder(model, np, "float32", seed=3)
    arrays = {i: {k: np.array(v) + rng.standard_normal(v.shape).astype(np.float32) * 0.2 for k, v in g.items()}
              for i, g in enumerate(ref.params)}
    if fmt == "stored":
        arrays = _stored(arrays)
    calls = _calls(model.shape.vocab, rng)
    mine = lambda: _local(model, arrays, 2, group.rank)           # noqa: E731 - fresh parts for each stage
    before = group.calls
    int8 = cpu.int8_activations()
    cpu.int8_activations(False)     # q8_0 times float activations, as the NumPy steps; int8: test_q8_int8.py
    try:
        got = _run(model, mine(), fmt, True, group, calls)
        numpy_tp = _run(model, mine(), fmt, False, group, calls)
        compact_tp = _run(model, mine(), fmt, False, group, calls, compact=True) if fmt != "float32" else None
        whole = _run(model, arrays, fmt, True, None, calls) if group.rank == 0 else None
    finally:
        cpu.int8_activations(int8)
    blocks = model.shape.n_blocks
    # each call: the embedding's lookup and two sums a block, all through the tp group
    runs = 2 if compact_tp is None else 3                            # compiled, NumPy (widened, kept as stored)
    assert group.calls - before == runs * len(calls) * (1 + 2 * blocks)
    if group.rank == 0:
        _close(got, numpy_tp, (name, fmt, "numpy tp=2"))
        if compact_tp is not None:
            _close(compact_tp, numpy_tp, (name, fmt, "numpy tp=2, kept as stored"))
        _close(got, whole, (name, fmt, "compiled tp=1"))
    else:
        assert all(g is None for g in got)
    group.comm.Free()
    MPI.COMM_WORLD.Barrier()


@pytest.mark.mpi(min_size=2)
def test_q8_0_slices_not_in_whole_blocks_are_refused():
    group = _group()
    if group is None:
        MPI.COMM_WORLD.Barrier()
        return
    model = LlamaModel(LlamaShape(41, 24, 64, 4, 2, d_ff=80, n_kv_heads=2))        # ff parts of 40
    arrays = {i: {k: np.array(v) for k, v in g.items()} for i, g in enumerate(Decoder(model, np, "float32").params)}
    with pytest.raises(ValueError, match=r"q8_0 at tp = 2 needs .* whole blocks of 32.*ff parts are \[40, 40\]"):
        DecodeStage(model, range(model.shape.n_groups), _local(model, arrays, 2, group.rank), np, "float32", 2,
                    tp=group, weight_format="q8_0")
    stage = DecodeStage(model, range(model.shape.n_groups), _local(model, arrays, 2, group.rank), np, "float32", 2,
                        tp=group, weight_format="stored")
    assert stage.compiled
    group.comm.Free()
    MPI.COMM_WORLD.Barrier()
