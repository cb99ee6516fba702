"""A Hugging Face directory through the commands a new user types first (issue 40): `checkpoint info` and `verify`
describe it, generate needs no --set parallel.pp on few ranks, a fine-tuned export keeps the model's context,
--resume with nothing saved yet names that, and data tokenized otherwise than the model is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
from support.hf import bytelevel_tokenizer, save_model, save_tokenizer, tiny_model
from support.launch import one_error, run_command, run_module

pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    tok = bytelevel_tokenizer(["<|endoftext|>"], vocab_size=300)
    model = tiny_model("llama", vocab_size=tok.get_vocab_size(), eos_token_id=0, bos_token_id=0)
    directory = save_model(model, tmp_path_factory.mktemp("hf") / "llama")
    save_tokenizer(tok, directory, eos_token="<|endoftext|>")
    return directory


@pytest.fixture
def hf(made, tmp_path) -> Path:
    return Path(shutil.copytree(made, tmp_path / "llama"))


def _tokens(path: Path, tokenizer: dict | None = None, files: dict | None = None) -> Path:
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f["x"] = rng.integers(0, 256, (16, 16)).astype(np.int32)
        f["y"] = rng.integers(0, 256, (16, 16)).astype(np.int32)
        if files is not None:
            from hpcpipe.state.tokenizer import write_tokenizer_group
            write_tokenizer_group(f, files)
        elif tokenizer is not None:
            f.attrs["tokenizer"] = json.dumps(tokenizer)
    return path


def test_info_and_verify_describe_a_hugging_face_directory(hf):
    """Both said "no config.json" (exit 1) while it was there."""
    proc = run_module("hpcpipe.checkpoint", "info", hf, timeout=120)
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first.startswith(f"Hugging Face model directory {str(hf)!r} (model_type llama") and "4 layer groups" in first
    assert "21 tensors in model.safetensors" in proc.stdout and "tokenizer hf (300 tokens" in proc.stdout
    proc = run_module("hpcpipe.checkpoint", "verify", hf, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith(f"ok: Hugging Face model {str(hf)!r}"), proc.stderr
    path = hf / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    one_error(run_module("hpcpipe.checkpoint", "verify", hf, timeout=120), "truncated", code=1)


def test_export_help_says_out_is_a_directory_with_format_hf():
    proc = run_module("hpcpipe.checkpoint", "export", "--help")
    assert proc.returncode == 0 and "with --format hf or peft a new directory" in " ".join(proc.stdout.split())


@pytest.mark.parametrize("ranks", [2, 3])
def test_generate_on_few_ranks_needs_no_parallel_setting(hf, ranks):
    """Without a [parallel] key every rank is a stage (training's default pp = 4 refused 2 or 3 ranks)."""
    proc = run_command(ranks, "hpcpipe.generate", ["--weights", str(hf), "--prompt", "hi", "--max-new-tokens", "2",
                                                   "--temperature", "0"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "finish_reason length" in proc.stderr


def test_a_fine_tuned_export_keeps_the_models_context(hf, tmp_path):
    """Training at model.seq_len = 16 wrote max_position_embeddings = 16 into the export (the model's was 64)."""
    from hpcpipe.hf.tokenizer import tokenizer_files
    data = _tokens(tmp_path / "tokens.h5", files=tokenizer_files(hf))     # the model's own tokenizer: accepted
    ck = tmp_path / "ck"
    proc = run_command(1, "hpcpipe.train", ["--set", f'model.init="{hf}"', "--set", "model.seq_len=16",
                                            "--set", f'data.path="{data}"', "--set", "train.steps=1",
                                            "--set", "parallel.pp=1", "--set", f'checkpoint.dir="{ck}"',
                                            "--set", "log.progress=false"],
                       timeout=180)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "tuned"
    proc = run_module("hpcpipe.checkpoint", "export", ck, out, "--format", "hf", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 64


def test_resume_with_nothing_saved_yet_reads_the_hugging_face_model_and_says_so(hf, tmp_path):
    """--resume on an empty root ignored model.init's config.json: "model.seq_len ... model.kind = 'mlp'"."""
    (tmp_path / "ck").mkdir()
    proc = run_command(1, "hpcpipe.train", ["--resume", "--set", f'model.init="{hf}"', "--set", "model.seq_len=16",
                                            "--set", f'checkpoint.dir="{tmp_path / "ck"}"', "--set", "parallel.pp=1"],
                       timeout=120)
    line = one_error(proc, "checkpoint.dir", "nothing to resume")
    assert "mlp" not in line


@pytest.mark.parametrize("tokenizer", [{"kind": "bytes"}, {"kind": "chars", "chars": "abc"}])
def test_data_tokenized_otherwise_than_the_model_is_refused(hf, tmp_path, tokenizer):
    """The run's checkpoints silently carried the data's bytes tokenizer instead of the model's."""
    data = _tokens(tmp_path / "tokens.h5", tokenizer)
    proc = run_command(1, "hpcpipe.train", ["--set", f'model.init="{hf}"', "--set", "model.seq_len=16",
                                            "--set", f'data.path="{data}"', "--set", 'checkpoint.dir=""',
                                            "--set", "parallel.pp=1"],
                       timeout=120)
    one_error(proc, f"data.path {str(data)!r}", f"the {tokenizer['kind']} tokenizer", "its own Hugging Face tokenizer",
              f"--tokenizer {hf}")


def test_an_export_the_model_has_no_form_for_is_a_usage_error(hf, tmp_path):
    """Were exit 1 ("the checkpoint is bad"): an MLP asked as --format hf, a model without adapters as peft."""
    from hpcpipe.config import from_dict
    from hpcpipe.nn.mlp.model import initial_arrays, layer_specs
    from hpcpipe.state.weights import write_weights
    mlp = tmp_path / "mlp.h5"
    specs = layer_specs(from_dict({"model": {"dims": [6, 5, 3]}, "parallel": {"pp": 1}}))
    write_weights(mlp, initial_arrays(specs, [0, 1], seed=3, dtype="float32"), n_layers=2)
    for source, fmt, words in ((mlp, "hf", "holds an MLP"), (hf, "peft", "holds no LoRA adapters")):
        out = tmp_path / f"out-{fmt}"
        one_error(run_module("hpcpipe.checkpoint", "export", source, out, "--format", fmt), words)
        assert not out.exists()


def test_a_model_directory_without_a_tokenizer_trains_on_token_data(hf, tmp_path):
    """Weights alone (no tokenizer.json) were refused for training on token ids: "'llama' has no tokenizer.json"."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (hf / name).unlink(missing_ok=True)
    data = _tokens(tmp_path / "tokens.h5")
    ck = tmp_path / "ck"
    proc = run_command(1, "hpcpipe.train", ["--set", f'model.init="{hf}"', "--set", "model.seq_len=16",
                                            "--set", f'data.path="{data}"', "--set", "train.steps=1",
                                            "--set", "parallel.pp=1", "--set", f'checkpoint.dir="{ck}"',
                                            "--set", "log.progress=false"], timeout=180)
    assert proc.returncode == 0, proc.stderr
    info = run_module("hpcpipe.checkpoint", "verify", ck)
    assert info.returncode == 0, info.stderr
    # generating from it still needs a tokenizer, and says so
    one_error(run_module("hpcpipe.generate", "--weights", ck, "--prompt", "hi", timeout=120),
              "has no tokenizer attribute")
