"""End to end: a GPT checkpoint written by the real trainer through verify, info, export, evaluate; files of the
other model kind refused by train (model.init, --resume) and infer with one message, exit 2, before any collective."""

from __future__ import annotations

import json
import math

import h5py
import numpy as np
import pytest
from support import DATA
from support.launch import one_error, run_command, run_module, train

GPT = {"kind": "gpt", "vocab_size": 11, "seq_len": 6, "d_model": 8, "n_heads": 2, "n_blocks": 2}


def _train(cwd, *more, model=None, steps=2, ck="ck"):
    # train.loss stated: a GPT config's default loss ("mse") is written to the manifest and then refused
    # when the manifest is read (reported to the lead; see the final report)
    sections = {"model": model or GPT, "parallel": {"pp": 2},
                "train": {"steps": steps, "micro_batches": 2, "micro_batch_size": 2, "optimizer": "adam",
                          **({"loss": "cross_entropy"} if (model or GPT).get("kind") == "gpt" else {})},
                "checkpoint": {"dir": ck}, "data": {"synthetic_samples": 64}, "log": {"progress": False}}
    return train(2, sections, *more, cwd=cwd, timeout=120)


@pytest.fixture(scope="module")
def gpt_checkpoint(tmp_path_factory):
    """A checkpoint root holding one GPT run (dp=1 x pp=2, Adam, 2 steps) and a token file for it."""
    root = tmp_path_factory.mktemp("gpt")
    proc = _train(root)
    assert proc.returncode == 0, proc.stderr
    rng = np.random.default_rng(0)
    with h5py.File(root / "t.h5", "w") as f:
        f["x"] = rng.integers(0, 11, (9, 6))
        f["y"] = rng.integers(0, 11, (9, 6))
    return root


def _refused_before_any_collective(proc) -> str:
    """One error line, all of stderr, exit 2; refused while planning: no rank reached a collective."""
    line = one_error(proc, alone=True)
    assert "hpcpipe: MPI:" not in proc.stdout
    return line


def test_gpt_checkpoint_verifies_describes_exports_and_evaluates(gpt_checkpoint):
    root = gpt_checkpoint
    proc = run_module("hpcpipe.checkpoint", "verify", "ck", cwd=root)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("step 2, 2 files, 4 layer groups"), proc.stderr
    info = run_module("hpcpipe.checkpoint", "info", "ck", cwd=root).stdout
    assert "step 2, 4 layer groups, gpt vocab_size=11 seq_len=6 d_model=8 n_heads=2 n_blocks=2 d_ff=0 " \
           "tie_embeddings=true" in info
    proc = run_module("hpcpipe.checkpoint", "export", "ck", "all.h5", cwd=root)
    assert proc.returncode == 0 and "(4 layer groups)" in proc.stdout, proc.stderr
    with h5py.File(root / "all.h5") as f:
        assert f["layers/0002/attn/qkv/weight"].shape == (8, 24) and "layers/0003/head" not in f
        assert json.loads(f.attrs["model"])["kind"] == "gpt"
    from_ck = run_module("hpcpipe.evaluate", "--weights", "ck", "--data", "t.h5", cwd=root)
    from_file = run_module("hpcpipe.evaluate", "--weights", "all.h5", "--data", "t.h5", cwd=root)
    assert from_ck.returncode == 0 and from_file.returncode == 0, from_ck.stderr + from_file.stderr
    a, b = json.loads(from_ck.stdout), json.loads(from_file.stdout)
    assert a["loss_nats"] == b["loss_nats"] and a["step"] == b["step"] == 2 and a["n"] == 9 and a["tokens"] == 54
    # the same number from the exported groups through the sequential model, by hand
    from hpcpipe.nn.core.decoder_model import Decoder
    from hpcpipe.nn.gpt.model import GPTModel
    from hpcpipe.nn.gpt.shape import GPTShape
    from hpcpipe.state.weights import read_layers
    shape = GPTShape(11, 6, 8, 2, 2)
    model = Decoder(GPTModel(shape), np, "float32")
    for i, group in read_layers(root / "all.h5", [0, 1, 2, 3]).items():
        model.load_group(i, group)
    with h5py.File(root / "t.h5") as f:
        x, y = f["x"][...], f["y"][...]
    logits, _ = model.forward(x)
    logits = logits.astype(np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    expected = -np.take_along_axis(logp, y[..., None], -1).mean()
    assert a["loss_nats"] == pytest.approx(expected, rel=1e-5)
    assert a["loss_bits"] == pytest.approx(a["loss_nats"] / math.log(2), rel=1e-15)


def test_gpt_checkpoint_as_model_init_of_an_mlp_run_is_refused(gpt_checkpoint, tmp_path):
    proc = _train(tmp_path, "--set", f"model.init={json.dumps(str(gpt_checkpoint / 'ck'))}",
                  model={"dims": [16, 16, 16]}, ck="ck2")
    line = _refused_before_any_collective(proc)
    assert "holds a GPT model (model.kind = \"gpt\", 4 layer groups); this run has model.kind = \"mlp\"" in line
    assert not (tmp_path / "ck2").exists()
    # with the GPT's token file as data.path too: the model is named first (was: "dataset 'x' in 't.h5' has shape
    # (9, 6); model.dims[0] = 16 needs (N, 16)", advice to change the MLP the user never meant)
    proc = _train(tmp_path, "--set", f"model.init={json.dumps(str(gpt_checkpoint / 'ck'))}", "--set",
                  f"data.path={json.dumps(str(gpt_checkpoint / 't.h5'))}", model={"dims": [16, 16, 16]}, ck="ck2")
    line = _refused_before_any_collective(proc)
    assert "holds a GPT model (model.kind = \"gpt\", 4 layer groups); this run has model.kind = \"mlp\"" in line


def test_mlp_weights_as_model_init_of_a_gpt_run_are_refused(tmp_path):
    weights = DATA / "old-layout-step4.h5"          # an MLP file written before model kinds (no kind recorded)
    proc = _train(tmp_path, "--set", f"model.init={json.dumps(str(weights))}", ck="ck2")
    line = _refused_before_any_collective(proc)
    assert line.endswith(f"{str(weights)!r} holds an MLP model (model.kind = \"mlp\", 4 layers); this run has "
                         f"model.kind = \"gpt\"")
    assert not (tmp_path / "ck2").exists()


def test_resuming_a_gpt_checkpoint_as_an_mlp_is_refused(gpt_checkpoint):
    before = sorted(str(p) for p in (gpt_checkpoint / "ck").rglob("*"))
    proc = _train(gpt_checkpoint, "--resume", model={"dims": [16, 16, 16]}, steps=3)
    line = _refused_before_any_collective(proc)
    assert "model.kind" in line and "gpt" in line and "mlp" in line
    assert sorted(str(p) for p in (gpt_checkpoint / "ck").rglob("*")) == before


def test_infer_refuses_a_gpt_checkpoint(gpt_checkpoint):
    proc = run_command(2, "hpcpipe.infer", ["--weights", "ck", "--input", "t.h5", "--output", "o.h5",
                                            "--set", "parallel.pp=2"], cwd=gpt_checkpoint, timeout=60)
    line = _refused_before_any_collective(proc)
    assert line == ("hpcpipe: error: --weights 'ck' holds a GPT model (model.kind = \"gpt\", 4 layer groups): batch "
                    "inference (python -m hpcpipe.infer) covers MLP models; text generation is python -m "
                    "hpcpipe.generate (one prompt) or python -m hpcpipe.serve (HTTP)")
    assert not (gpt_checkpoint / "o.h5").exists()


def test_a_file_of_a_checkpoint_step_directory_names_the_directory(gpt_checkpoint):
    step = next((gpt_checkpoint / "ck").glob("run-*/step-*"))
    stage = sorted(step.glob("stage-*.h5"))[0]
    for module, args in (("hpcpipe.generate", ["--prompt", "ab"]), ("hpcpipe.evaluate", ["--data", "t.h5"])):
        proc = run_module(module, "--weights", stage, *args, cwd=gpt_checkpoint)
        # was: "weights file '...stage-000.h5' has layers [0, 1] but the model has 4 layer groups [0, 1, 2, 3]"
        one_error(proc, f"'{stage}' holds only layers [0, 1] of 4, one stage's file of the checkpoint '{step}': ",
                  f"reads a whole model; pass the step directory '{step}'")
    proc = run_module("hpcpipe.generate", "--weights", step / "manifest.json", "--prompt", "ab")
    one_error(proc, f"--weights '{step / 'manifest.json'}' is not an HDF5 weights file; it is a file of the checkpoint "
                    f"step directory '{step}': give the directory itself")


def test_model_init_alone_takes_the_stored_model_kind_and_shape(gpt_checkpoint, tmp_path):
    """model.init = an hpcpipe weights file or checkpoint, no other [model] key: the run trains that GPT (it was
    refused as "holds a GPT model ...; this run has model.kind = "mlp"", the user had to restate every shape key)."""
    exported = run_module("hpcpipe.checkpoint", "export", gpt_checkpoint / "ck", tmp_path / "w.h5")
    assert exported.returncode == 0, exported.stderr
    for init, ck in ((tmp_path / "w.h5", "from-file"), (gpt_checkpoint / "ck", "from-ck")):
        proc = _train(tmp_path, "--set", "train.loss=\"cross_entropy\"", model={"init": str(init)}, ck=ck)
        assert proc.returncode == 0, proc.stderr
        manifest = json.loads(next((tmp_path / ck).glob("run-*/step-*/manifest.json")).read_text())
        assert {k: manifest["config"]["model"][k] for k in GPT} == GPT
    # the config may restate the stored model, not contradict it; the dtype is only a default
    proc = _train(tmp_path, model={"init": str(tmp_path / "w.h5"), "n_heads": 4}, ck="bad")
    line = _refused_before_any_collective(proc)
    assert f"model.n_heads = 4 in the configuration does not match weights file {str(tmp_path / 'w.h5')!r}" in line
    proc = _train(tmp_path, "--set", "train.loss=\"cross_entropy\"",
                  model={"init": str(tmp_path / "w.h5"), "dtype": "float64", "n_blocks": 2}, ck="f64")
    assert proc.returncode == 0, proc.stderr
