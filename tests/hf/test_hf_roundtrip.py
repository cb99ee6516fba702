"""A Hugging Face model in and out through the real commands: checkpoint import -> train 2 steps at dp=2 x pp=2 ->
export --format hf -> transformers loads it, and its logits equal hpcpipe's; a model trained here from a bytes
tokenizer goes out with a tokenizer.json that encodes alike; bad Hugging Face input is one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from support.hf import bytelevel_tokenizer, save_model, save_tokenizer, tiny_model
from support.launch import one_error, run_command, run_module

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _hf_dir(tmp: Path, arch: str = "llama", **overrides) -> Path:
    tok = bytelevel_tokenizer(["<|endoftext|>"], vocab_size=300)
    model = tiny_model(arch, vocab_size=tok.get_vocab_size(), eos_token_id=0, bos_token_id=0, **overrides)
    directory = save_model(model, tmp / f"hf-{arch}")
    save_tokenizer(tok, directory, eos_token="<|endoftext|>")
    return directory


def _tokens(path: Path, vocab: int, seq_len: int, n: int = 32) -> Path:
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f["x"] = rng.integers(0, vocab, (n, seq_len)).astype(np.int32)
        f["y"] = rng.integers(0, vocab, (n, seq_len)).astype(np.int32)
    return path


def _hpcpipe_logits(weights: Path, tokens: np.ndarray) -> np.ndarray:
    from hpcpipe.config import from_dict
    from hpcpipe.evaluate import load_decoder, logits_of
    from hpcpipe.nn.registry import model_def
    from hpcpipe.state.sources import resolve_weights
    source = resolve_weights(weights)
    config = from_dict({"model": source.model, "parallel": {"pp": 1}})
    return logits_of(load_decoder(source, model_def(config), "float32"), tokens)


@pytest.mark.slow
@pytest.mark.parametrize("arch,overrides", [("llama", {"tie_word_embeddings": False}),
                                            ("qwen2", {"tie_word_embeddings": True}), ("gpt2", {}),
                                            ("qwen3", {"tie_word_embeddings": True}), ("mixtral", {}),
                                            ("qwen3_moe", {})])
def test_import_train_export_and_transformers_loads_the_trained_model(tmp_path, arch, overrides):
    hf = _hf_dir(tmp_path, arch, **overrides)
    imported = tmp_path / "imported.h5"
    proc = run_module("hpcpipe.checkpoint", "import", hf, imported)
    assert proc.returncode == 0, proc.stderr
    with h5py.File(imported) as f:
        model = json.loads(f.attrs["model"])
        assert json.loads(f.attrs["tokenizer"]) == {"kind": "hf"} and "tokenizer.json" in f["tokenizer"]
    data = _tokens(tmp_path / "tokens.h5", model["vocab_size"], model["seq_len"])
    args = ["--set", f'model.init="{imported}"', "--set", f'data.path="{data}"', "--set", "parallel.pp=2",
            "--set", "train.steps=2", "--set", "train.micro_batches=2", "--set", "train.micro_batch_size=2",
            "--set", 'train.optimizer="adam"', "--set", "train.lr=0.01", "--set", f'checkpoint.dir="{tmp_path / "ck"}"',
            "--set", "log.progress=false"]
    for key, value in model.items():          # the imported model's keys, restated (TOML: JSON's scalars and lists)
        if key not in ("init", "seed", "dtype", "weight_format", "rope_scaling"):
            args += ["--set", f"model.{key}={json.dumps(value)}"]
    trained = run_command(4, "hpcpipe.train", args, timeout=180)
    assert trained.returncode == 0, trained.stderr
    out = tmp_path / "exported"
    proc = run_module("hpcpipe.checkpoint", "export", tmp_path / "ck", out, "--format", "hf")
    assert proc.returncode == 0, proc.stderr
    tokens = np.random.default_rng(2).integers(0, model["vocab_size"], (2, 9))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        theirs = loaded(torch.tensor(tokens)).logits.numpy()
    mine = _hpcpipe_logits(tmp_path / "ck", tokens)
    assert np.abs(mine - theirs).max() / np.abs(theirs).max() <= 1e-5
    before = _hpcpipe_logits(imported, tokens)
    assert np.abs(mine - before).max() > 1e-4            # the export holds the trained weights, not the imported
    text = "the quick brown fox 😀"
    assert transformers.AutoTokenizer.from_pretrained(str(out))(text)["input_ids"] == \
        transformers.AutoTokenizer.from_pretrained(str(hf))(text)["input_ids"]


def test_model_from_hf_init_trains_without_restating_the_model(tmp_path):
    """model.init = HF_DIR alone: the kind and shape come from config.json; model.seq_len may be shorter; without
    data.path a warning says the model trains on synthetic tokens (it did so silently)."""
    hf = _hf_dir(tmp_path)
    data = _tokens(tmp_path / "tokens.h5", 300, 16)
    proc = run_command(2, "hpcpipe.train", ["--set", f'model.init="{hf}"', "--set", "model.seq_len=16",
                                            "--set", f'data.path="{data}"', "--set", "parallel.pp=2",
                                            "--set", "train.steps=1", "--set", 'checkpoint.dir=""',
                                            "--set", "log.progress=false"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "synthetic" not in proc.stderr
    # without data.path a pretrained model trains on random tokens: said, once, with the way to make real data
    synthetic = run_command(2, "hpcpipe.train", ["--set", f'model.init="{hf}"', "--set", "model.seq_len=16",
                                                 "--set", "parallel.pp=2", "--set", "train.steps=1",
                                                 "--set", 'checkpoint.dir=""', "--set", "log.progress=false"],
                            timeout=120)
    assert synthetic.returncode == 0, synthetic.stderr
    warning = (f"hpcpipe: warning: data.path is empty: model.init {str(hf)!r} trains on synthetic random tokens, "
               f"which teach it nothing; set data.path to a token file (python examples/text_to_hdf5.py TEXT "
               f"--tokenizer {hf})")
    assert synthetic.stderr.count(warning) == 1, synthetic.stderr
    refused = run_command(2, "hpcpipe.train", ["--set", f'model.init="{hf}"', "--set", "model.d_model=64",
                                               "--set", "parallel.pp=2"], timeout=60)
    one_error(refused, "model.d_model = 64", "does not match")


def test_a_bytes_gpt_trained_here_exports_a_tokenizer_that_encodes_alike(tmp_path):
    from hpcpipe.config import from_dict
    from hpcpipe.nn.registry import model_def
    from hpcpipe.state.tokenizer import StoredTokenizer, Tokenizer
    from hpcpipe.state.weights import write_weights

    config = from_dict({"model": {"kind": "gpt", "vocab_size": 256, "seq_len": 16, "d_model": 16, "n_heads": 2,
                                  "n_blocks": 2}, "parallel": {"pp": 1}})
    model = model_def(config)
    weights = tmp_path / "gpt.h5"
    write_weights(weights, model.init_arrays(list(range(model.n_layers)), 0, "float32"), n_layers=model.n_layers,
                  model_config=config.to_dict()["model"], tokenizer=StoredTokenizer(Tokenizer("bytes").to_json()))
    out = tmp_path / "gpt-hf"
    proc = run_module("hpcpipe.checkpoint", "export", weights, out, "--format", "hf")
    assert proc.returncode == 0, proc.stderr
    text = "héllo wörld 😀\n"
    assert transformers.AutoTokenizer.from_pretrained(str(out))(text)["input_ids"] == list(text.encode())
    tokens = np.arange(12).reshape(1, 12)
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out))(torch.tensor(tokens)).logits.numpy()
    assert np.abs(_hpcpipe_logits(weights, tokens) - theirs).max() / np.abs(theirs).max() <= 1e-5
    again = run_module("hpcpipe.checkpoint", "export", weights, out, "--format", "hf")
    one_error(again, "already exists", "never writes into an existing one")


def _break(directory: Path, how: str) -> None:
    if how == "model_type":
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, "model_type": "falcon"}))
    elif how == "truncated":
        path = directory / "model.safetensors"
        path.write_bytes(path.read_bytes()[:-100])
    elif how == "missing":
        (directory / "model.safetensors").unlink()
    elif how == "shape":
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, "intermediate_size": 64}))
    elif how == "tokenizer":
        (directory / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 3}}')


@pytest.mark.parametrize("how,words", [
    ("model_type", ["model_type 'falcon'", "gpt2, llama, mistral, qwen2"]),
    ("truncated", ["model.safetensors", "truncated"]),
    ("missing", ["neither model.safetensors nor model.safetensors.index.json"]),
    ("shape", ["mlp.gate_proj.weight", "(48, 32)", "(64, 32)"]),
    ("tokenizer", ["tokenizer.json"]),
])
def test_bad_hugging_face_input_is_one_line_exit_2(tmp_path, how, words):
    hf = _hf_dir(tmp_path)
    _break(hf, how)
    proc = run_command(1, "hpcpipe.generate", ["--weights", str(hf), "--prompt", "the", "--max-new-tokens", "2",
                                               "--set", "parallel.pp=1"], timeout=60)
    one_error(proc, *words)


def test_chat_without_a_template_is_a_400_naming_it(tmp_path):
    from support.serve import Server
    hf = _hf_dir(tmp_path)
    with Server(1, hf, "--set", "parallel.pp=1") as server:
        import openai
        model = server.client().models.list().data[0].id
        with pytest.raises(openai.BadRequestError) as caught:
            server.client().chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
        assert "no chat template" in str(caught.value)
        ok = server.client().completions.create(model=model, prompt="the", max_tokens=2, temperature=0)
        assert ok.choices[0].finish_reason in ("stop", "length")
