"""Inference pieces on one process: row assignment, output file, forward chain, no allocation, config merge."""

import tracemalloc

import h5py
import numpy as np
import pytest

from hpcpipe.config import from_dict, load_config
from hpcpipe.errors import ConfigError
from hpcpipe.evaluate import forward as reference_forward
from hpcpipe.infer.rows import (
    RowReader,
    RowWriter,
    create_output,
    micro_batch_rows,
    n_micro_batches,
    replica_micro_batches,
)
from hpcpipe.infer.setup import model_from_weights, prepare
from hpcpipe.infer.stream import ForwardChain, StreamStage
from hpcpipe.nn.core.activations import make_activation
from hpcpipe.state.weights import write_weights


@pytest.mark.parametrize("n,batch,dp", [(37, 5, 1), (37, 5, 2), (40, 5, 3), (3, 8, 2), (128, 128, 4), (0, 4, 2)])
def test_replicas_cover_every_row_once_in_round_robin(n, batch, dp):
    seen = []
    for d in range(dp):
        mbs = replica_micro_batches(n, batch, dp, d)
        assert all(m % dp == d for m in mbs) and mbs == sorted(mbs)
        for m in mbs:
            start, rows = micro_batch_rows(m, n, batch)
            assert 1 <= rows <= batch
            seen.extend(range(start, start + rows))
    assert sorted(seen) == list(range(n))
    assert n_micro_batches(n, batch) == -(-n // batch)


def test_output_rows_written_out_of_order_land_in_place(tmp_path):
    path = tmp_path / "o.h5"
    offset = create_output(path, 10, 3, "float64", "out", {"k": "v"})
    writer = RowWriter(path, offset, 3 * 8)
    y = np.arange(30, dtype=np.float64).reshape(10, 3)
    writer.write(8, y[8:])
    writer.write(0, y[:4])
    writer.write(4, y[4:8])
    writer.close()
    with h5py.File(path, "r") as f:
        np.testing.assert_array_equal(f["out"][...], y)
        assert f["out"].dtype == np.float64 and f["out"].chunks is None
        assert f.attrs["k"] == "v"


def _layers(dims, acts, bias, seed=0):
    rng = np.random.default_rng(seed)
    out, arrays = [], {}
    for i, act in enumerate(acts):
        w = rng.standard_normal((dims[i], dims[i + 1])).astype(np.float32) / np.sqrt(dims[i])
        b = rng.standard_normal(dims[i + 1]).astype(np.float32) if bias else None
        out.append((w, b, make_activation(act)))
        arrays[i] = {"weight": w} if b is None else {"weight": w, "bias": b}
    return out, arrays


@pytest.mark.parametrize("activation", ["relu", "gelu", "tanh", "identity"])
@pytest.mark.parametrize("n_layers", [1, 2, 3])
def test_forward_chain_matches_the_evaluate_reference(activation, n_layers):
    dims = [7, 12, 5, 9][:n_layers + 1]
    layers, arrays = _layers(dims, [activation] * n_layers, bias=True)
    batch, tail = 6, 4
    ins = [np.zeros((batch, dims[0]), np.float32) for _ in range(2)]
    outs = [np.zeros((batch, dims[-1]), np.float32) for _ in range(2)]
    chain = ForwardChain(layers, batch, tail, ins, outs, np.float32)
    x = np.random.default_rng(1).standard_normal((batch, dims[0])).astype(np.float32)
    ref = reference_forward(arrays, {"activation": activation, "final_activation": True}, x)
    for slot in (0, 1):
        ins[slot][...] = x
        chain.compute(slot, batch, lambda: None)
        np.testing.assert_allclose(outs[slot], ref, rtol=1e-6, atol=1e-6)
        outs[slot][...] = -1
        chain.compute(slot, tail, lambda: None)     # a partial micro-batch touches only its rows
        np.testing.assert_allclose(outs[slot][:tail], ref[:tail], rtol=1e-6, atol=1e-6)
        assert np.all(outs[slot][tail:] == -1)


def _single_rank_stage(tmp_path, n_rows, batch=32, width=64, n_layers=3, activation="gelu", slots=2):
    dims = [width] * (n_layers + 1)
    layers, arrays = _layers(dims, [activation] * n_layers, bias=True)
    data = tmp_path / f"in-{n_rows}.h5"
    x = np.random.default_rng(2).standard_normal((n_rows, width)).astype(np.float32)
    with h5py.File(data, "w") as f:
        f["x"] = x
    out = tmp_path / f"out-{n_rows}.h5"
    offset = create_output(out, n_rows, width, "float32", "y", {})
    stage = StreamStage(layers=layers, micro_batches=list(range(n_micro_batches(n_rows, batch))), n_rows=n_rows,
                        batch=batch, slots=slots, dtype=np.float32, in_width=width, out_width=width,
                        reader=RowReader(data, "x", batch, np.float32), writer=RowWriter(out, offset, width * 4),
                        pp_comm=None, prev=-1, next=-1, poller=None)
    return stage, arrays, x, out


def test_streaming_stage_writes_every_row_in_order(tmp_path):
    stage, arrays, x, out = _single_rank_stage(tmp_path, 100)   # 3 full micro-batches and a partial one
    size = out.stat().st_size
    events = stage.run()
    stage.close()
    assert out.stat().st_size == size      # rows land inside the allocated dataset, nothing past it
    with h5py.File(out, "r") as f:
        y = f["y"][...]
    np.testing.assert_allclose(y, reference_forward(arrays, {"activation": "gelu"}, x), rtol=1e-5, atol=1e-6)
    assert events.shape == (4, 5) and np.all(np.diff(events, axis=1) >= 0)


def test_a_stage_holds_no_more_buffer_slots_than_micro_batches(tmp_path):
    stage, arrays, x, out = _single_rank_stage(tmp_path, 40, slots=64)     # 2 micro-batches of 32 rows
    assert stage.slots == 2 and len(stage.in_bufs) == len(stage.out_bufs) == 2
    stage.run()
    stage.close()
    with h5py.File(out, "r") as f:
        np.testing.assert_allclose(f["y"][...], reference_forward(arrays, {"activation": "gelu"}, x), rtol=1e-5,
                                   atol=1e-6)


def test_steady_state_allocates_nothing_per_micro_batch(tmp_path):
    """Peak traced memory while streaming stays far below one micro-batch buffer, whatever the count."""
    batch, width = 32, 64
    buffer_bytes = batch * width * 4
    peaks = []
    for n_rows in (batch * 4, batch * 40):
        stage, _, _, _ = _single_rank_stage(tmp_path, n_rows, batch, width)
        tracemalloc.start()
        stage.run()
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        stage.close()
    assert max(peaks) < buffer_bytes / 2, peaks


def test_buffers_are_sized_by_the_rows_there_are_not_the_micro_batch_size(tmp_path):
    """infer.micro_batch_size = 5e6 over 300 rows used to allocate 2.4 GB; now every buffer holds <= 300 rows."""
    tracemalloc.start()
    stage, arrays, x, out = _single_rank_stage(tmp_path, 300, batch=5_000_000, width=16)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1_000_000, peak
    assert all(b.shape == (300, 16) for b in stage.in_bufs + stage.out_bufs)
    assert all(buf.size <= 300 * 16 for buf in stage.chain.inter + stage.chain.bias_rows)
    stage.run()
    stage.close()
    with h5py.File(out, "r") as f:
        np.testing.assert_allclose(f["y"][...], reference_forward(arrays, {"activation": "gelu"}, x), rtol=1e-5,
                                   atol=1e-6)


def test_input_truncated_while_streaming_is_an_error_naming_the_file(tmp_path):
    import os

    from hpcpipe.errors import DataError
    stage, _, _, _ = _single_rank_stage(tmp_path, 100, batch=32, width=16)
    data = tmp_path / "in-100.h5"
    os.truncate(data, 4000)
    with pytest.raises(DataError, match=f"input file '{data}' changed size during the run \\(4000 bytes"):
        stage.run()
    stage.close()


def test_model_comes_from_the_weights_and_contradictions_name_both_values():
    stored = {"dims": [4, 8, 2], "bias": False, "activation": "tanh", "final_activation": False,
              "dtype": "float32", "seed": 3, "init": ""}
    raw = model_from_weights({"parallel": {"pp": 1}}, stored, "weights file 'w.h5'")
    cfg = from_dict(raw)
    assert (cfg.model.dims, cfg.model.bias, cfg.model.activation, cfg.model.final_activation) == \
        ([4, 8, 2], False, "tanh", False)
    restated = {"model": {"dims": [4, 8, 2]}, "parallel": {"pp": 2}}
    assert from_dict(model_from_weights(restated, stored, "w")).model.dims == [4, 8, 2]
    assert from_dict(model_from_weights({"parallel": {"pp": 1}}, {}, "w")).model.dims == [16] * 5  # none stored
    with pytest.raises(ConfigError, match=r"model.dims = \[4, 8, 3\] in the configuration does not match "
                                          r"weights file 'w.h5', which was saved with model.dims = \[4, 8, 2\]"):
        model_from_weights({"model": {"dims": [4, 8, 3]}}, stored, "weights file 'w.h5'")
    with pytest.raises(ConfigError, match="model.activation = 'relu'.*saved with model.activation = 'tanh'"):
        model_from_weights({"model": {"activation": "relu"}}, stored, "w")


def test_infer_section_is_validated():
    assert load_config(None, ["infer.micro_batch_size=64"]).infer.micro_batch_size == 64
    with pytest.raises(ConfigError, match="infer.micro_batch_size must be >= 1, got 0"):
        load_config(None, ["infer.micro_batch_size=0"])
    with pytest.raises(ConfigError, match="unknown key infer.batch"):
        load_config(None, ["infer.batch=3"])


def test_plan_refuses_interleaved_stages_and_layouts_the_model_cannot_fill(tmp_path):
    weights = tmp_path / "w.h5"
    write_weights(weights, {i: {"weight": np.zeros((4, 4), np.float32)} for i in range(2)}, n_layers=2,
                  model_config={"dims": [4, 4, 4], "bias": False})
    data = tmp_path / "in.h5"
    with h5py.File(data, "w") as f:
        f["x"] = np.zeros((3, 4), np.float32)
    p = prepare(weights, data, tmp_path / "o.h5", 2, overrides=["parallel.pp=2"])
    assert (p.dp, p.pp, p.n_rows, [list(r) for r in p.stage_ranges]) == (1, 2, 3, [[0], [1]])
    with pytest.raises(ConfigError, match="parallel.virtual_stages must be 1, got 2"):
        prepare(weights, data, tmp_path / "o.h5", 1, overrides=["parallel.pp=1", "parallel.virtual_stages=2"])
    with pytest.raises(ConfigError, match=r"parallel.pp \(4\) x parallel.virtual_stages \(1\) exceeds the number "
                                          r"of layers \(2\)"):
        prepare(weights, data, tmp_path / "o.h5", 4)


def _gpt_weights(path):
    from hpcpipe.nn.gpt.model import GPTModel
    from hpcpipe.nn.gpt.shape import GPTShape
    shape = GPTShape(vocab=7, seq_len=4, d_model=4, n_heads=2, n_blocks=1)
    model = {"kind": "gpt", "vocab_size": 7, "seq_len": 4, "d_model": 4, "n_heads": 2, "n_blocks": 1, "d_ff": 0,
             "tie_embeddings": True, "dtype": "float32"}
    write_weights(path, {i: GPTModel(shape).init_group(i, 0) for i in range(3)}, n_layers=3, model_config=model)
    return path


def test_plan_refuses_gpt_weights_pointing_at_generation(tmp_path):
    weights = _gpt_weights(tmp_path / "w.h5")
    data = tmp_path / "in.h5"
    with h5py.File(data, "w") as f:
        f["x"] = np.zeros((3, 4), np.int64)
    with pytest.raises(ConfigError) as exc:
        prepare(weights, data, tmp_path / "o.h5", 1, overrides=["parallel.pp=1"])
    assert str(exc.value) == (f"--weights {str(weights)!r} holds a GPT model (model.kind = \"gpt\", 3 layer groups): "
                              f"batch inference (python -m hpcpipe.infer) covers MLP models; text generation is "
                              f"python -m hpcpipe.generate (one prompt) or python -m hpcpipe.serve (HTTP)")
    assert not (tmp_path / "o.h5").exists()


def test_a_config_kind_that_contradicts_the_weights_is_refused():
    stored = {"dims": [4, 8, 2]}      # written before model kinds: an MLP
    with pytest.raises(ConfigError, match=r"model.kind = 'gpt' in the configuration does not match weights file "
                                          r"'w.h5', which holds model.kind = 'mlp' \(batch inference covers MLP"):
        model_from_weights({"model": {"kind": "gpt"}}, stored, "weights file 'w.h5'")
