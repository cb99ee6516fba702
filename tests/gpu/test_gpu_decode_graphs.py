"""Decode steps replayed from CUDA graphs (hpcpipe.nn.core.decode_graphs) on the device equal the device's eager
steps and NumPy's: a Llama (grouped-query attention, RoPE) and a GPT stage, weights widened (float32) and kept
as stored (bfloat16 row products), four sequences prefilled, then decoding with sequences joining and leaving
and positions crossing KV blocks and the power-of-two buckets. A rehearsal (no GPU) replays on NumPy."""

import contextlib

import numpy as np
import pytest
from support.gpu import device_backend

from hpcpipe.kernels.formats import RowWeight
from hpcpipe.nn.core.decode import DecodeStage, Segment
from hpcpipe.nn.core.decode_graphs import GraphedStage
from hpcpipe.nn.core.decoder_model import Decoder
from hpcpipe.nn.gpt.model import GPTModel
from hpcpipe.nn.gpt.shape import GPTShape
from hpcpipe.nn.llama.model import LlamaModel
from hpcpipe.nn.llama.shape import LlamaShape

pytestmark = pytest.mark.gpu

MODELS = {"llama": lambda: LlamaModel(LlamaShape(96, 96, 128, 8, 3, d_ff=256, n_kv_heads=2)),
          "gpt": lambda: GPTModel(GPTShape(96, 96, 128, 4, 3, tied=True))}


def _arrays(model, stored: bool):
    """Random parameters; ``stored``: the matrices as bfloat16 (out, in) RowWeights, as a bf16 checkpoint reads."""
    ref = Decoder(model, np, "float32", seed=7)
    out = {}
    for i, group in enumerate(ref.params):
        out[i] = {}
        for name, value in group.items():
            v = np.array(value)
            if stored and v.ndim == 2 and name.endswith("/weight"):
                bits = (np.ascontiguousarray(v.T).view(np.uint32) >> 16).astype(np.uint16)
                out[i][name] = RowWeight("bfloat16", np.ascontiguousarray(bits))
            else:
                out[i][name] = v
    return out


def _calls(vocab, rng):
    calls = [(rng.integers(0, vocab, 4 * 9), [Segment(s, 0, 9) for s in range(4)])]
    length = [9, 9, 9, 9]
    for t in range(40):
        live = [s for s in range(4) if not (s == 3 and 10 <= t < 20)]       # sequence 3 leaves, then returns
        calls.append((rng.integers(0, vocab, len(live)), [Segment(s, length[s], 1) for s in live]))
        for s in live:
            length[s] += 1
    return calls


def _run(stages, calls, xp):
    """Each call's output through the stages in turn, on the host."""
    out = []
    for x, segments in calls:
        for stage in stages:
            x = stage.forward(x, segments)
        out.append(np.asarray(x.get() if hasattr(x, "get") else x))
    return out


def _stages(model, arrays, xp, stored: bool, compact=None):
    """The model as two decode stages on ``xp`` (4 slots, KV blocks of 8)."""
    fmt = {"weight_format": "stored"} if stored else {}      # a GPU stage keeps stored matrices as stored
    n = model.shape.n_groups
    tok = arrays[0]["tok_emb"] if model.shape.tied else None
    return [DecodeStage(model, g, arrays, xp, "float32", 4, compiled=False, kv_block=8,
                        tok_emb=tok if 0 not in g else None, compact=compact, **fmt)
            for g in (range(0, 2), range(2, n))]


@pytest.mark.parametrize("stored", [False, True])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_replayed_decode_steps_equal_eager_and_numpy(kind, stored):
    backend = device_backend()
    if backend == "cupy":
        import cupy as xp
    else:
        from hpcpipe.kernels import cpu
        if stored and cpu.library() is None:
            pytest.skip("rehearsal: no compiled CPU row products")
        xp = np
    model = MODELS[kind]()
    arrays = _arrays(model, stored)
    calls = _calls(model.shape.vocab, np.random.default_rng(3))
    compact = True if stored else None     # the rehearsal too keeps them as stored (compiled CPU row products)

    def stages(backend_xp, compact=None):
        return _stages(model, arrays, backend_xp, stored, compact)

    eager = _run(stages(xp, compact), calls, xp)
    graphed_stages = [GraphedStage(s) for s in stages(xp, compact)]
    assert all(s.compact == stored for s in graphed_stages)
    graphed = _run(graphed_stages, calls, xp)
    reference = _run(stages(np), calls, np)          # the widened NumPy steps
    for step, (g, e, r) in enumerate(zip(graphed, eager, reference, strict=True)):
        assert np.abs(g - e).max() <= 1e-5 * np.abs(e).max(), (kind, stored, step)
        assert np.abs(e - r).max() <= 1e-4 * np.abs(r).max(), (kind, stored, step)
    assert all(s.replayed == 40 and 2 <= s.captured <= 8 for s in graphed_stages), \
        [(s.replayed, s.captured) for s in graphed_stages]


def test_replays_follow_the_callers_own_stream():
    """Called under a stream of the caller's own (not CuPy's default stream), replays still come after its work
    (prompts' cache writes, the previous stage's rows) and before its reads of their output: a graph ordered by
    the legacy default stream's implicit synchronization alone would race here. The rehearsal has no streams."""
    if device_backend() == "cupy":
        import cupy as xp
        own = xp.cuda.Stream(non_blocking=True)
    else:
        xp, own = np, contextlib.nullcontext()
    model = MODELS["llama"]()
    arrays = _arrays(model, False)
    calls = _calls(model.shape.vocab, np.random.default_rng(4))
    eager = _run(_stages(model, arrays, xp, False), calls, xp)
    graphed_stages = [GraphedStage(s) for s in _stages(model, arrays, xp, False)]
    if xp is not np:       # the weights and zeroed caches, made on the default stream, before the caller's stream
        xp.cuda.Device().synchronize()
    with own:
        graphed = _run(graphed_stages, calls, xp)
    for step, (g, e) in enumerate(zip(graphed, eager, strict=True)):
        assert np.abs(g - e).max() <= 1e-5 * np.abs(e).max(), step
    assert all(s.replayed == 40 for s in graphed_stages)
