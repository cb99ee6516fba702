"""The NumPy steps of a decode stage with its weights kept as stored (RowProduct: what a GPU stage does with
model.weight_format stored or q8_0, here through the compiled CPU products) equal the same steps with the weights
widened at load (the reference): GPT and llama variants from a bfloat16 checkpoint (matrices as RowWeights, the
embedding a 16-bit table) and from a float32 one ((in, out) arrays, a float table), split stages with a tied head on
either side, prompts and decode steps mixed."""

import numpy as np
import pytest
from test_fused_stage import MODELS, _calls, _outputs, _stages

from hpcpipe.kernels import cpu
from hpcpipe.kernels.formats import RowWeight, row_weight
from hpcpipe.kernels.row_product import RowProduct
from hpcpipe.nn.core.decode import DecodeStage
from hpcpipe.nn.core.decoder_model import Decoder
from hpcpipe.nn.core.half_table import HalfTable

pytestmark = pytest.mark.skipif(cpu.library() is None, reason="compiled kernels not built (no C compiler)")


def _bf16_checkpoint(model, rng):
    """The decoder's parameters, perturbed, as a bfloat16 checkpoint loads them: (out, in) RowWeights of bits for
    the matrices, a HalfTable for the embedding, float32 vectors."""
    ref = Decoder(model, np, "float32", seed=3)
    out = {}
    for i, group in enumerate(ref.params):
        out[i] = {}
        for name, value in group.items():
            v = np.array(value) + rng.standard_normal(value.shape).astype(np.float32) * 0.2
            bits = (np.ascontiguousarray(v).view(np.uint32) >> 16).astype(np.uint16)
            if name == "tok_emb":
                out[i][name] = HalfTable(bits, "bfloat16")
            elif v.ndim == 2 and name.endswith("/weight"):
                out[i][name] = RowWeight("bfloat16", np.ascontiguousarray(bits.T))
            else:
                out[i][name] = v
    return out


def _run(model, arrays, splits, fmt, compact, calls):
    stages = _stages(model, arrays, splits, compiled=False, weight_format=fmt, compact=compact)
    return _outputs(stages, calls), stages


@pytest.mark.parametrize("fmt", ["stored", "q8_0"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_weights_kept_as_stored_equal_the_widened_steps(name, fmt):
    int8 = cpu.int8_activations()
    cpu.int8_activations(False)     # q8_0 times float activations, as the GPU kernels and the widened steps
    try:
        model = MODELS[name]()
        rng = np.random.default_rng(len(name))
        arrays = _bf16_checkpoint(model, rng)
        calls = _calls(model.shape.vocab, rng)
        n = model.shape.n_groups
        for splits in ([range(n)], [range(0, 2), range(2, n)], [range(0, n - 1), range(n - 1, n)]):
            want, _ = _run(model, arrays, splits, fmt, False, calls)
            got, stages = _run(model, arrays, splits, fmt, True, calls)
            kept = [b for s in stages for b in s.steps.blocks]
            products = [b.attn.o.weight for b in kept]
            assert products and all(isinstance(p, RowProduct) for p in products)
            # q8_0 where the input width is whole blocks of 32 (as GGUF), else as stored
            assert all(p.kind == ("q8_0" if fmt == "q8_0" and p.shape[0] % 32 == 0 else "bfloat16")
                       for p in products)
            head = stages[-1].steps.head.weight
            assert isinstance(head, RowProduct)
            for step, (g, w) in enumerate(zip(got, want, strict=True)):
                assert g.shape == w.shape
                assert np.abs(g - w).max() <= 1e-5 * np.abs(w).max(), (name, fmt, len(splits), step)
    finally:
        cpu.int8_activations(int8)


def test_compact_is_refused_where_it_does_not_apply():
    model = MODELS["llama_gqa_bias_tied"]()
    arrays = _bf16_checkpoint(model, np.random.default_rng(0))
    groups = range(model.shape.n_groups)
    with pytest.raises(ValueError, match="weight format stored or q8_0, not 'float32' float32 uncompiled"):
        DecodeStage(model, groups, arrays, np, "float32", 2, compiled=False, weight_format="float32", compact=True)
    with pytest.raises(ValueError, match="not 'stored' float32 compiled"):
        DecodeStage(model, groups, arrays, np, "float32", 2, compiled=True, weight_format="stored", compact=True)
    stage = DecodeStage(model, groups, arrays, np, "float32", 2, compiled=False, weight_format="stored")
    assert not stage.compact        # on NumPy the widened steps stay the default (the reference)


def _float_checkpoint(model, rng):
    """The bfloat16 checkpoint's values as a float32 checkpoint holds them (an hpcpipe HDF5 file, a merged LoRA):
    (in, out) float matrices and a float (vocab, d) embedding table."""
    out = {}
    for i, group in _bf16_checkpoint(model, rng).items():
        out[i] = {name: (np.ascontiguousarray(v.dense().T) if isinstance(v, RowWeight) else
                         RowWeight(v.kind, v.bits).dense() if isinstance(v, HalfTable) else v)
                  for name, v in group.items()}
    return out


@pytest.mark.parametrize("fmt", ["stored", "q8_0"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_float32_checkpoint_kept_as_stored_equals_the_widened_steps(name, fmt):
    """Float (in, out) matrices become float32 or q8_0 row products; a tied head on a stage of its own keeps the
    handed table in the weight format as the blocks do (q8_0 when d is whole blocks of 32, not widened floats)."""
    int8 = cpu.int8_activations()
    cpu.int8_activations(False)
    try:
        model = MODELS[name]()
        rng = np.random.default_rng(len(name) + 1)
        arrays = _float_checkpoint(model, rng)
        calls = _calls(model.shape.vocab, rng)
        n, d = model.shape.n_groups, model.shape.d_model
        for splits in ([range(n)], [range(0, n - 1), range(n - 1, n)]):
            want, _ = _run(model, arrays, splits, fmt, False, calls)
            got, stages = _run(model, arrays, splits, fmt, True, calls)
            products = [b.attn.o.weight for s in stages for b in s.steps.blocks]
            assert all(p.kind == ("q8_0" if fmt == "q8_0" and p.shape[0] % 32 == 0 else "float32")
                       for p in products)
            head = stages[-1].steps.head.weight
            if model.shape.tied and len(splits) > 1:
                assert head.kind == ("q8_0" if fmt == "q8_0" and d % 32 == 0 else "float32"), (name, fmt)
            for step, (g, w) in enumerate(zip(got, want, strict=True)):
                assert np.abs(g - w).max() <= 1e-5 * np.abs(w).max(), (name, fmt, len(splits), step)
    finally:
        cpu.int8_activations(int8)


@pytest.mark.parametrize("name", [n for n in sorted(MODELS) if MODELS[n]().shape.tied])
def test_a_tied_table_kept_as_stored_is_shared_by_the_embedding_and_the_head(name):
    """A stage that embeds and holds the tied head, its tok_emb a bfloat16 RowWeight (how serve reads a stored
    checkpoint there): one copy of the table's bits, gathered from and multiplied by (not a float32 widening, which
    would take twice a bfloat16 model's bytes for a small model's largest matrix)."""
    model = MODELS[name]()
    rng = np.random.default_rng(len(name) + 2)
    arrays = _bf16_checkpoint(model, rng)
    arrays[0]["tok_emb"] = RowWeight("bfloat16", arrays[0]["tok_emb"].bits)
    calls = _calls(model.shape.vocab, rng)
    splits = [range(model.shape.n_groups)]
    want, _ = _run(model, arrays, splits, "stored", False, calls)
    got, (stage,) = _run(model, arrays, splits, "stored", True, calls)
    head, table = stage.steps.head.weight, stage.steps.tok_emb
    assert head.kind == "bfloat16" and isinstance(table, HalfTable)
    assert np.shares_memory(head.weight.data, table.bits)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert np.abs(g - w).max() <= 1e-5 * np.abs(w).max(), (name, step)


@pytest.mark.parametrize("widen_from", [None, 1, 4])
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "float16", "q8_0"])
def test_a_row_product_multiplies_as_the_matrix_it_stands_for(kind, widen_from):
    """``x @ product`` equals ``x @ W.T`` for rows of any leading shape (none, one, two axes, strided, float64, no
    rows at all: what a widened (in, out) array takes), and refuses rows of the wrong width; through the compiled
    product, or (``widen_from``: from that many rows, as a GPU's prefill) the weight widened for the call and the
    backend's BLAS."""
    int8 = cpu.int8_activations()
    cpu.int8_activations(False)
    try:
        rng = np.random.default_rng(7)
        w = rng.standard_normal((48, 64)).astype(np.float32)
        weight = {"float32": RowWeight("float32", w),
                  "bfloat16": RowWeight("bfloat16", (w.view(np.uint32) >> 16).astype(np.uint16)),
                  "float16": RowWeight("float16", w.astype(np.float16).view(np.uint16)),
                  "q8_0": row_weight(RowWeight("float32", w), "q8_0")}[kind]
        product, dense = RowProduct(weight, np, widen_from), weight.dense()
        assert product.widen_from == widen_from
        assert product.shape == (64, 48) and product.kind == kind
        for x in (rng.standard_normal(64).astype(np.float32), rng.standard_normal((2, 3, 64)),
                  rng.standard_normal((5, 128)).astype(np.float32)[:, ::2], np.zeros((0, 64), np.float32),
                  np.zeros((2, 0, 64), np.float32)):
            got, want = x @ product, x.astype(np.float32) @ dense.T
            assert got.shape == want.shape and got.dtype == np.float32
            assert np.abs(got - want).max(initial=0) <= 1e-5 * np.abs(want).max(initial=1)
        with pytest.raises(ValueError, match="input rows of 63 values for a"):
            np.ones((2, 63), np.float32) @ product
    finally:
        cpu.int8_activations(int8)


@pytest.mark.parametrize("name", ["gpt_untied", "llama_mqa_head_dim_scaled", "llama_gqa_bias_tied"])
def test_a_16_bit_table_read_as_stored_is_gathered_from_as_stored(name):
    """tok_emb read as a bfloat16 RowWeight (serve's stored read gives every matrix so, the embedding's too) on a
    compact stage that embeds, with or without the head: kept as its bits (a HalfTable), not widened to float32."""
    model = MODELS[name]()
    rng = np.random.default_rng(len(name) + 3)
    arrays = _bf16_checkpoint(model, rng)
    arrays[0]["tok_emb"] = RowWeight("bfloat16", arrays[0]["tok_emb"].bits)
    calls = _calls(model.shape.vocab, rng)
    n = model.shape.n_groups
    for splits in ([range(n)], [range(0, 2), range(2, n)]):
        want, _ = _run(model, arrays, splits, "stored", False, calls)
        got, stages = _run(model, arrays, splits, "stored", True, calls)
        assert isinstance(stages[0].steps.tok_emb, HalfTable), (name, len(splits))
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            assert np.abs(g - w).max() <= 1e-5 * np.abs(w).max(), (name, len(splits), step)
