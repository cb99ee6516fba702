"""The GPT's shape, parameter groups (the HDF5 contract), initial values and layer kinds, the xp-only compute
modules, and the model definition the engine uses: specs, the stage cut, the stash formula."""

import math

import numpy as np
import pytest
from gpt_layer_parts import gpt_head
from support import ROOT

from hpcpipe.nn.core.decoder import Block, Embedding, OutputHead
from hpcpipe.nn.core.decoder_model import Decoder
from hpcpipe.nn.gpt.model import GPTModel
from hpcpipe.nn.gpt.shape import GPTShape, block_params, group_params

# --- parameter groups and initial values

def test_param_groups_follow_the_hdf5_contract():
    shape = GPTShape(vocab=50, seq_len=16, d_model=8, n_heads=2, n_blocks=3, d_ff=20, tied=False)
    groups = [group_params(shape, i) for i in range(shape.n_groups)]
    assert len(groups) == 5
    assert groups[0] == [("tok_emb", (50, 8)), ("pos_emb", (16, 8))]
    expect_block = {"ln1/weight": (8,), "ln1/bias": (8,), "attn/qkv/weight": (8, 24), "attn/qkv/bias": (24,),
                    "attn/proj/weight": (8, 8), "attn/proj/bias": (8,), "ln2/weight": (8,), "ln2/bias": (8,),
                    "mlp/fc/weight": (8, 20), "mlp/fc/bias": (20,), "mlp/proj/weight": (20, 8),
                    "mlp/proj/bias": (8,)}
    assert all(dict(groups[i]) == expect_block for i in (1, 2, 3))
    assert dict(groups[4]) == {"ln_f/weight": (8,), "ln_f/bias": (8,), "head/weight": (8, 50)}
    tied = GPTShape(50, 16, 8, 2, 3, tied=True)
    assert dict([group_params(tied, i) for i in range(tied.n_groups)][4]) == {"ln_f/weight": (8,), "ln_f/bias": (8,)}
    assert dict(block_params(tied))["mlp/fc/weight"] == (8, 32)          # d_ff 0 -> 4 * d_model


@pytest.mark.parametrize("bad", [dict(d_model=10, n_heads=4), dict(n_blocks=0), dict(vocab=-1), dict(d_ff=-2),
                                 dict(seq_len=2.0)])
def test_shape_rejects_bad_values(bad):
    fields = dict(vocab=5, seq_len=4, d_model=8, n_heads=2, n_blocks=1) | bad
    with pytest.raises(ValueError, match="GPT"):
        GPTShape(**fields)


def test_init_depends_on_seed_and_group_only_and_is_gpt2_style():
    shape = GPTShape(vocab=300, seq_len=64, d_model=64, n_heads=4, n_blocks=8)
    a = GPTModel(shape).init_group(2, seed=5)
    b = GPTModel(shape).init_group(2, seed=5)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["attn/qkv/weight"], GPTModel(shape).init_group(3, seed=5)["attn/qkv/weight"])
    assert not np.array_equal(a["attn/qkv/weight"], GPTModel(shape).init_group(2, seed=6)["attn/qkv/weight"])
    assert a["attn/qkv/weight"].dtype == np.float32
    assert {k: v.shape for k, v in a.items()} == dict(block_params(shape))
    assert (a["ln1/weight"] == 1).all() and not a["ln1/bias"].any() and not a["attn/qkv/bias"].any()
    assert a["attn/qkv/weight"].std() == pytest.approx(0.02, rel=0.05)
    assert a["mlp/fc/weight"].std() == pytest.approx(0.02, rel=0.05)
    for proj in ("attn/proj/weight", "mlp/proj/weight"):
        assert a[proj].std() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    emb = GPTModel(shape).init_group(0, seed=5)
    assert emb["tok_emb"].std() == pytest.approx(0.02, rel=0.05) and emb["pos_emb"].shape == (64, 64)
    final = GPTModel(GPTShape(300, 64, 64, 4, 8, tied=False)).init_group(9, seed=5)
    assert (final["ln_f/weight"] == 1).all() and final["head/weight"].std() == pytest.approx(0.02, rel=0.05)
    model = Decoder(GPTModel(shape), np, "float32", seed=5)         # the model starts from these values
    assert np.array_equal(model.params[2]["mlp/proj/weight"], a["mlp/proj/weight"])


def test_build_layer_kinds_by_group():
    shape = GPTShape(vocab=9, seq_len=4, d_model=8, n_heads=2, n_blocks=2, tied=True)
    model = Decoder(GPTModel(shape), np, "float64")
    kinds = [type(layer) for layer in model.layers]
    assert kinds == [Embedding, Block, Block, OutputHead]
    assert gpt_head(shape, model.params[3], model.grads[3], np, model.params[0]["tok_emb"],
                 model.grads[0]["tok_emb"]).tied
    with pytest.raises(ValueError, match="tied output head needs tok_emb"):
        gpt_head(shape, model.params[3], model.grads[3], np)
    with pytest.raises(ValueError, match="longer than the 4 positions"):
        model.forward(np.zeros((1, 5), dtype=np.int64))


def test_compute_modules_use_only_xp():
    # the layers run unchanged on CuPy: no NumPy import in a compute path (host-side init lives in the models)
    import ast
    nn = ROOT / "src" / "hpcpipe" / "nn"
    for name in ("core/norms", "core/attention", "core/activations", "core/decoder", "core/mlps",
                 "core/decode_steps", "token_loss"):
        for node in ast.walk(ast.parse((nn / f"{name}.py").read_text())):
            if isinstance(node, ast.Import):
                assert all(a.name.split(".")[0] != "numpy" for a in node.names), name
            if isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] != "numpy", name


# --- the model definition the engine uses: groups, costs, stage cut

def _config(**model):
    from hpcpipe.config import from_dict
    return from_dict({"model": {"kind": "gpt", **model}, "parallel": {"pp": 1}})


def test_gpt_specs_follow_the_hdf5_contract():
    from hpcpipe.nn.registry import model_def
    m = model_def(_config(vocab_size=50, seq_len=8, d_model=16, n_heads=2, n_blocks=3, tie_embeddings=False))
    assert m.n_layers == 5 and [s.index for s in m.specs] == list(range(5))
    assert m.specs[0].shapes == {"tok_emb": (50, 16), "pos_emb": (8, 16)}
    assert m.specs[2].shapes["attn/qkv/weight"] == (16, 48) and m.specs[2].shapes["mlp/proj/weight"] == (64, 16)
    assert m.specs[4].shapes == {"ln_f/weight": (16,), "ln_f/bias": (16,), "head/weight": (16, 50)}
    assert m.boundary(0, 3) == ((3, 8), "int64") and m.boundary(2, 3) == ((3, 8, 16), None)
    assert m.boundary(5, 3) == ((3, 8, 50), None) and m.samples_norm(6) == 48


def test_partition_counts_the_head_of_a_large_vocabulary():
    """vocab 8192, d 64: the head costs as much as ~13 blocks, so it gets a stage of its own."""
    from hpcpipe.nn.partition import partition
    from hpcpipe.nn.registry import model_def
    specs = model_def(_config(vocab_size=8192, seq_len=64, d_model=64, n_heads=4, n_blocks=6)).specs
    ranges = partition(specs, 4)
    assert list(ranges[-1]) == [7]                     # the final norm + head alone
    assert sum(len(r) for r in ranges) == 8 and min(len(r) for r in ranges) >= 1
    by_params = [s.n_params for s in specs]            # parameter counts would put the embedding alone instead
    assert by_params[0] > 10 * by_params[1]


def test_stash_formula_matches_what_the_engine_counts():
    """The engine's peak stash of one GPipe step at pp = 1 equals the per-group formula (within 0.1 %)."""
    from mpi4py import MPI

    from hpcpipe.config import from_dict
    from hpcpipe.train.setup import prepare
    from hpcpipe.train.trainer import Trainer
    for recompute in ("none", "stage"):
        cfg = from_dict({"parallel": {"pp": 1, "dp": 1}, "checkpoint": {"dir": ""}, "log": {"progress": False},
                         "model": {"kind": "gpt", "vocab_size": 50, "seq_len": 16, "d_model": 32, "n_heads": 4,
                                   "n_blocks": 3},
                         "train": {"micro_batches": 3, "micro_batch_size": 5, "recompute": recompute}})
        trainer = Trainer(prepare(cfg, 1), MPI.COMM_SELF)
        try:
            trainer.compute_gradients(0)
            measured = trainer.engine.stats.peak_stash_bytes
        finally:
            trainer.close()
        if recompute == "none":
            formula = sum(s.act_elements for s in trainer.specs) * 3 * 5 * 4
            assert abs(measured - formula) <= 1e-3 * formula, (measured, formula)
        else:
            assert measured == 3 * 5 * 16 * 8        # the token ids (int64) of the 3 micro-batches
