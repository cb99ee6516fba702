"""Expert parallelism and files: a rank reads only its own experts' tensors from a Hugging Face directory;
import -> 2 training steps at ep=2 -> export, and transformers loads the trained model (logits within 1e-5); bad
expert-parallel input is one line, exit 2, before any collective."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from support.launch import one_error, run_command, run_module

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _moe_dir(tmp: Path, arch: str = "qwen3_moe") -> Path:
    from support.moe_reference import moe_directory
    return moe_directory(arch, tmp / f"hf-{arch}")[1]


def test_each_rank_reads_only_its_own_experts(tmp_path):
    """ep rank 1 of 2 asks for block 1's experts 2 and 3: only their tensors are read, and they equal the whole."""
    from hpcpipe.config import from_dict
    from hpcpipe.nn.registry import model_def
    from hpcpipe.state.hf_source import hf_source
    source = hf_source(_moe_dir(tmp_path))
    model = model_def(from_dict({"model": source.model, "parallel": {"pp": 1}}))
    whole = source.read([1])[1]
    read: list[str] = []
    original = source.tensors.read

    def spy(name, *args, **kwargs):
        read.append(name)
        return original(name, *args, **kwargs)
    source.tensors.read = spy
    part = source.read([1], shards=lambda i, names: model.expert_shards(i, 2, 1))[1]
    experts = [name for name in read if ".experts." in name]
    assert experts and all(".experts.2." in name or ".experts.3." in name for name in experts), experts
    for name in ("mlp/experts/gate", "mlp/experts/up", "mlp/experts/down"):
        np.testing.assert_array_equal(part[name], whole[name][2:4])
    np.testing.assert_array_equal(part["mlp/router/weight"], whole["mlp/router/weight"])


def _without_expert(hf: Path, expert: int) -> Path:
    """Rewrite the directory's safetensors file without expert ``expert`` of block 0."""
    from safetensors.numpy import load_file, save_file
    path = next(hf.glob("*.safetensors"))
    tensors = load_file(str(path))
    save_file({k: v for k, v in tensors.items() if f"layers.0.mlp.experts.{expert}." not in k}, str(path),
              metadata={"format": "pt"})
    return hf


@pytest.mark.parametrize("case,ranks,sets,words", [
    ("experts", 1, ["parallel.ep=3"], ["parallel.ep (3)", "model.n_experts (4)"]),
    ("dp", 2, ["parallel.ep=2", "parallel.pp=2"], ["parallel.ep (2)", "parallel.dp (1)"]),
    ("kind", 2, ["parallel.ep=2", 'model.kind="llama"'], ["parallel.ep = 2", "no experts"]),
    ("missing", 2, ["parallel.ep=2", "parallel.pp=1"], ["experts.3"]),
])
def test_bad_expert_parallel_input_is_one_line_exit_2(tmp_path, case, ranks, sets, words):
    """ep not dividing the experts or the replicas, ep with a kind without experts, a directory missing an expert."""
    hf = _moe_dir(tmp_path)
    if case == "missing":
        _without_expert(hf, 3)
    if case == "kind":
        args = ["--set", "model.vocab_size=13", "--set", "model.seq_len=6", "--set", "model.d_model=8",
                "--set", "model.n_heads=2", "--set", "model.n_blocks=2", "--set", "parallel.pp=1"]
    else:
        args = ["--set", f'model.init="{hf}"', "--set", "model.seq_len=8"]
    for key in sets:
        args += ["--set", key]
    proc = run_command(ranks, "hpcpipe.train", args + ["--set", "train.steps=1", "--set", 'checkpoint.dir=""'],
                       timeout=120)
    one_error(proc, *words)


def _tokens(path: Path, vocab: int, seq_len: int, n: int = 16) -> Path:
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f["x"] = rng.integers(0, vocab, (n, seq_len)).astype(np.int32)
        f["y"] = rng.integers(0, vocab, (n, seq_len)).astype(np.int32)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_import_train_at_ep_2_export_and_transformers_loads_it(tmp_path, arch):
    """checkpoint import -> 2 adam steps at dp=2 (ep=2) x pp=2 -> export --format hf: transformers' logits equal
    hpcpipe's within 1e-5, and the experts moved."""
    from hpcpipe.config import from_dict
    from hpcpipe.evaluate import load_decoder, logits_of
    from hpcpipe.nn.registry import model_def
    from hpcpipe.state.sources import resolve_weights
    hf = _moe_dir(tmp_path, arch)
    imported = tmp_path / "imported.h5"
    assert run_module("hpcpipe.checkpoint", "import", hf, imported).returncode == 0
    with h5py.File(imported) as f:
        model = json.loads(f.attrs["model"])
    data = _tokens(tmp_path / "tokens.h5", model["vocab_size"], 16)
    args = ["--set", f'model.init="{imported}"', "--set", f'data.path="{data}"', "--set", "parallel.pp=2",
            "--set", "parallel.ep=2", "--set", "train.steps=2", "--set", "train.micro_batches=2",
            "--set", "train.micro_batch_size=2", "--set", 'train.optimizer="adam"', "--set", "train.lr=0.01",
            "--set", f'checkpoint.dir="{tmp_path / "ck"}"', "--set", "log.progress=false",
            "--set", f'log.metrics="{tmp_path / "metrics.jsonl"}"']
    for key, value in model.items():
        if key not in ("init", "seed", "dtype", "weight_format", "rope_scaling"):
            args += ["--set", f"model.{key}={json.dumps(16 if key == 'seq_len' else value)}"]
    trained = run_command(4, "hpcpipe.train", args, timeout=240)
    assert trained.returncode == 0, trained.stderr
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(m["ep_comm_s"] > 0 for m in metrics), metrics
    out = tmp_path / "exported"
    proc = run_module("hpcpipe.checkpoint", "export", tmp_path / "ck", out, "--format", "hf")
    assert proc.returncode == 0, proc.stderr
    tokens = np.random.default_rng(2).integers(0, model["vocab_size"], (2, 9))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        theirs = loaded(torch.tensor(tokens)).logits.numpy()

    def logits(weights):
        source = resolve_weights(weights)
        config = from_dict({"model": source.model, "parallel": {"pp": 1}})
        return logits_of(load_decoder(source, model_def(config), "float32"), tokens)
    mine = logits(tmp_path / "ck")
    assert np.abs(mine - theirs).max() / np.abs(theirs).max() <= 1e-5
    with h5py.File(imported) as before, h5py.File(next((tmp_path / "ck").glob("**/step-00000002/*0.h5"))) as after:
        moved = np.abs(after["layers/0001/mlp/experts/up"][...] - before["layers/0001/mlp/experts/up"][...])
        assert moved[0].max() > 1e-4 and moved[-1].max() > 1e-4       # both ep ranks' experts trained and saved
