"""`evaluate` on a Hugging Face model checks the token file as train does: data written with another tokenizer
(bytes, or another model's) is refused in one line naming both and the fix, not scored (it gave a loss about
nothing, exit 0); windows longer than the model's context say so (they were 'expected (N, 256)'); data written
with the model's own tokenizer is scored."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import ROOT
from support.hf import bytelevel_tokenizer, save_model, save_tokenizer, tiny_model
from support.launch import one_error, run_module

pytest.importorskip("torch")
pytest.importorskip("transformers")

TEXT = "the pipeline keeps every stage busy while tokens stream to many users at once. " * 30


def _hf_dir(tmp: Path, name: str, seed: int) -> Path:
    words = ["<|endoftext|>"] if seed == 0 else ["<|endoftext|>", "<|other|>"]
    tok = bytelevel_tokenizer(words, vocab_size=300)
    model = tiny_model("llama", seed=seed, vocab_size=300, eos_token_id=0, bos_token_id=0,
                       max_position_embeddings=64)
    directory = save_model(model, tmp / name)
    save_tokenizer(tok, directory, eos_token="<|endoftext|>")
    return directory


def _tokens(tmp: Path, name: str, tokenizer: str, seq_len: int) -> Path:
    text = tmp / "text.txt"
    text.write_text(TEXT)
    out = tmp / name
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "text_to_hdf5.py"), str(text), "--out", str(out),
                           "--seq-len", str(seq_len), "--tokenizer", tokenizer], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return next(out.glob("*train*.h5"))


def _evaluate(weights: Path, data: Path):
    return run_module("hpcpipe.evaluate", "--weights", weights, "--data", data)


def test_evaluate_scores_only_data_written_with_the_model_s_tokenizer(tmp_path):
    model = _hf_dir(tmp_path, "llama", 0)
    own = _tokens(tmp_path, "own", str(model), 32)
    proc = _evaluate(model, own)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tokens"] > 0
    message = one_error(_evaluate(model, _tokens(tmp_path, "bytes", "bytes", 32)),
                        "was tokenized with the bytes tokenizer", "has its own Hugging Face tokenizer",
                        f"python examples/text_to_hdf5.py TEXT --tokenizer {model}")
    assert "text-train.h5" in message
    other = _hf_dir(tmp_path, "other", 1)
    one_error(_evaluate(model, _tokens(tmp_path, "other-data", str(other), 32)),
              "was tokenized with another Hugging Face tokenizer")


def test_windows_longer_than_the_context_are_refused_saying_so(tmp_path):
    model = _hf_dir(tmp_path, "llama", 0)
    one_error(_evaluate(model, _tokens(tmp_path, "long", str(model), 96)),
              "holds windows of 96 tokens, longer than the model's context of 64",
              "write windows of at most 64", "--seq-len 64")


def test_bytes_data_on_a_checkpoint_names_a_tokenizer_that_text_to_hdf5_takes(tmp_path):
    """The advice was `--tokenizer ck/run-0001/step-00000001`, a directory text_to_hdf5 refuses (no tokenizer.json):
    it is now the export that writes one, and following it gives data evaluate scores."""
    from support.launch import run_command
    model = _hf_dir(tmp_path, "llama", 0)
    own = _tokens(tmp_path, "own", str(model), 32)
    proc = run_command(1, "hpcpipe.train", ["--set", f"model.init={json.dumps(str(model))}", "--set",
                                            f"data.path={json.dumps(str(own))}", "--set", "model.seq_len=32",
                                            "--set", "parallel.pp=1", "--set", "train.steps=1", "--set",
                                            f"checkpoint.dir={json.dumps(str(tmp_path / 'ck'))}",
                                            "--set", "log.progress=false"], timeout=240)
    assert proc.returncode == 0, proc.stderr
    step = tmp_path / "ck" / "run-0001" / "step-00000001"
    one_error(_evaluate(step, _tokens(tmp_path, "bytes", "bytes", 32)), "was tokenized with the bytes tokenizer",
              f"--tokenizer HF_DIR, after python -m hpcpipe.checkpoint export {step} HF_DIR --format hf")
    exported = run_module("hpcpipe.checkpoint", "export", step, tmp_path / "hf-out", "--format", "hf")
    assert exported.returncode == 0, exported.stderr
    proc = _evaluate(step, _tokens(tmp_path, "exported", str(tmp_path / "hf-out"), 32))
    assert proc.returncode == 0 and json.loads(proc.stdout)["step"] == 1, proc.stderr
