"""Held-out loss while training (issue #38): data.eval_path every train.eval_every steps, a forward-only pass of every
stage; the loss logged after step k equals transformers' no-grad forward of that step's checkpoint; bad files and
keys are one line, exit 2."""

from __future__ import annotations

import json
import math

import h5py
import numpy as np
import pytest
from support.hf import bytelevel_tokenizer, save_model, save_tokenizer, tiny_model
from support.launch import one_error, run_command, run_module

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SEQ = 8


def _tokens(path, n: int, vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    with h5py.File(path, "w") as f:
        f["x"] = rng.integers(0, vocab, (n, SEQ)).astype(np.int32)
        f["y"] = rng.integers(0, vocab, (n, SEQ)).astype(np.int32)
    return path


def _model(tmp_path):
    tok = bytelevel_tokenizer(["<|endoftext|>"], vocab_size=300)
    model = tiny_model("llama", vocab_size=tok.get_vocab_size(), eos_token_id=0, bos_token_id=0)
    directory = save_model(model, tmp_path / "hf")
    save_tokenizer(tok, directory, eos_token="<|endoftext|>")
    return directory, tok.get_vocab_size()


def _args(tmp_path, hf, train, held, *more):
    return ["--set", f'model.init="{hf}"', "--set", f"model.seq_len={SEQ}", "--set", f'data.path="{train}"',
            "--set", f'data.eval_path="{held}"', "--set", "parallel.pp=2", "--set", "train.micro_batches=2",
            "--set", "train.micro_batch_size=2", "--set", 'train.optimizer="adam"', "--set", "train.lr=0.01",
            "--set", f'checkpoint.dir="{tmp_path / "ck"}"', "--set", "log.progress=true", *more]


@pytest.mark.slow
def test_held_out_loss_equals_transformers_no_grad_forward_of_the_same_weights(tmp_path):
    hf, vocab = _model(tmp_path)
    train = _tokens(tmp_path / "train.h5", 32, vocab, 0)
    held = _tokens(tmp_path / "held.h5", 13, vocab, 1)     # 13 windows: the first 8 (one global batch) count
    metrics = tmp_path / "m.jsonl"
    proc = run_command(4, "hpcpipe.train", _args(tmp_path, hf, train, held, "--set", "train.steps=3",
                                                 "--set", "train.eval_every=2", "--set", "checkpoint.every=2",
                                                 "--set", f'log.metrics="{metrics}"'), timeout=180)
    assert proc.returncode == 0, proc.stderr
    records = {r["step"]: r for r in map(json.loads, metrics.read_text().splitlines())}
    assert "eval_loss" in records[1] and "eval_loss" in records[2] and "eval_loss" not in records[0]
    assert records[1]["eval_perplexity"] == pytest.approx(math.exp(records[1]["eval_loss"]), rel=1e-12)
    assert f"eval_loss {records[1]['eval_loss']:.6g}" in proc.stdout
    assert f"hpcpipe: held-out loss {records[2]['eval_loss']:.6g}" in proc.stdout
    out = tmp_path / "step2-hf"
    exported = run_module("hpcpipe.checkpoint", "export", tmp_path / "ck" / "run-0001" / "step-00000002", out,
                          "--format", "hf")
    assert exported.returncode == 0, exported.stderr
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with h5py.File(held) as f:
        x, y = f["x"][:8].astype(np.int64), f["y"][:8].astype(np.int64)
    with torch.no_grad():
        logits = model(torch.tensor(x)).logits
        want = float(torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), torch.tensor(y).reshape(-1)))
    assert records[1]["eval_loss"] == pytest.approx(want, rel=1e-5)
    assert records[2]["eval_loss"] != records[1]["eval_loss"]          # the weights of step 3 are other


def test_a_held_out_file_that_does_not_fit_is_one_line_exit_2(tmp_path):
    hf, vocab = _model(tmp_path)
    train = _tokens(tmp_path / "train.h5", 32, vocab, 0)
    short = _tokens(tmp_path / "short.h5", 5, vocab, 1)
    proc = run_command(4, "hpcpipe.train", _args(tmp_path, hf, train, short, "--set", "train.steps=1"))
    one_error(proc, "data.eval_path", "holds 5 samples", "fewer than one global batch", "= 8")
    wide = tmp_path / "wide.h5"
    with h5py.File(wide, "w") as f:
        f["x"] = np.zeros((8, SEQ + 3), np.int32)
        f["y"] = np.zeros((8, SEQ + 3), np.int32)
    proc = run_command(4, "hpcpipe.train", _args(tmp_path, hf, train, wide, "--set", "train.steps=1"))
    one_error(proc, "data.eval_path")
    proc = run_command(4, "hpcpipe.train", ["--set", "train.eval_every=5"])
    one_error(proc, "train.eval_every = 5 needs data.eval_path")
