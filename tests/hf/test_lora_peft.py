"""LoRA adapters in and out through the real commands (issue #38): a PEFT adapter on a Hugging Face llama trains
further at dp=2 x pp=2 (model.adapter; train.lora_* read from its adapter_config.json) -> ``checkpoint export
--format peft`` -> ``peft.PeftModel.from_pretrained`` gives hpcpipe's logits; ``--merge-adapter`` writes a model
transformers loads with the same logits; ``generate --adapter`` on the base equals generate on the merged model;
what does not fit is one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from support.launch import one_error, run_command, run_module
from support.lora import make_model_and_adapter

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

SEQ = 8


def _tokens(path: Path, vocab: int) -> Path:
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f["x"] = rng.integers(0, vocab, (16, SEQ)).astype(np.int32)
        f["y"] = rng.integers(0, vocab, (16, SEQ)).astype(np.int32)
    return path


def _hpcpipe_logits(weights: Path, tokens: np.ndarray) -> np.ndarray:
    """hpcpipe's sequential forward of stored weights as forward-only readers see them (a LoRA run's: merged)."""
    from hpcpipe.config import from_dict
    from hpcpipe.evaluate import load_decoder, logits_of
    from hpcpipe.nn.registry import model_def
    from hpcpipe.state.sources import resolve_weights
    source = resolve_weights(weights).forward_only("float32")
    config = from_dict({"model": source.model, "parallel": {"pp": 1}})
    return logits_of(load_decoder(source, model_def(config), "float32"), tokens)


def _train(tmp_path: Path, hf: Path, adapter: Path, data: Path, *more: str):
    return run_command(4, "hpcpipe.train", [
        "--set", f'model.init="{hf}"', "--set", f'model.adapter="{adapter}"', "--set", f"model.seq_len={SEQ}",
        "--set", f'data.path="{data}"', "--set", "parallel.pp=2", "--set", "train.steps=2",
        "--set", "train.micro_batches=2", "--set", "train.micro_batch_size=2", "--set", 'train.optimizer="adam"',
        "--set", "train.lr=0.01", "--set", f'checkpoint.dir="{tmp_path / "ck"}"', "--set", "log.progress=false",
        *more], timeout=180)


@pytest.mark.slow
def test_a_peft_adapter_trains_further_and_goes_out_as_peft_and_merged(tmp_path):
    hf, adapter = make_model_and_adapter(tmp_path, targets=["q_proj", "v_proj", "down_proj"])
    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
    data = _tokens(tmp_path / "tokens.h5", vocab)
    proc = _train(tmp_path, hf, adapter, data)
    assert proc.returncode == 0, proc.stderr
    ck = tmp_path / "ck"
    manifest = json.loads(next(ck.glob("run-*/step-00000002/manifest.json")).read_text())
    assert manifest["config"]["train"]["lora_rank"] == 4 and manifest["config"]["train"]["lora_alpha"] == 8.0
    tokens = np.random.default_rng(2).integers(0, vocab, (2, SEQ))
    mine = _hpcpipe_logits(ck, tokens)

    out = tmp_path / "trained-adapter"
    proc = run_module("hpcpipe.checkpoint", "export", ck, out, "--format", "peft")
    assert proc.returncode == 0, proc.stderr
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    assert config["base_model_name_or_path"] == str(hf)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(hf)).eval()
    tuned = peft.PeftModel.from_pretrained(base, str(out)).eval()
    with torch.no_grad():
        theirs = tuned(torch.tensor(tokens)).logits.numpy()
        untrained = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(str(hf)).eval(), str(adapter)).eval()
        before = untrained(torch.tensor(tokens)).logits.numpy()
    assert np.abs(mine - theirs).max() / np.abs(theirs).max() <= 1e-5
    assert np.abs(mine - before).max() > 1e-4                 # the export holds the trained adapters

    merged = tmp_path / "merged"
    proc = run_module("hpcpipe.checkpoint", "export", ck, merged, "--format", "hf", "--merge-adapter")
    assert proc.returncode == 0, proc.stderr
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(merged)).eval()
    with torch.no_grad():
        plain = loaded(torch.tensor(tokens)).logits.numpy()
    assert np.abs(plain - theirs).max() / np.abs(theirs).max() <= 1e-5

    # one context for all three: the merged export keeps the base model's (longer) context
    prompt = ["--prompt", "the fox", "--max-new-tokens", "4", "--temperature", "0", "--set", "parallel.pp=2",
              "--set", f"model.seq_len={SEQ}"]
    on_base = run_command(2, "hpcpipe.generate", ["--weights", str(hf), "--adapter", str(out), *prompt])
    on_merged = run_command(2, "hpcpipe.generate", ["--weights", str(merged), *prompt])
    of_checkpoint = run_command(2, "hpcpipe.generate", ["--weights", str(ck), *prompt])
    assert on_base.returncode == 0 and on_merged.returncode == 0, on_base.stderr + on_merged.stderr
    assert of_checkpoint.returncode == 0, of_checkpoint.stderr
    assert on_base.stdout == on_merged.stdout == of_checkpoint.stdout and on_base.stdout.strip()

    refused = run_module("hpcpipe.checkpoint", "export", ck, tmp_path / "flat.h5")
    one_error(refused, "holds LoRA adapters", "--format peft", "--merge-adapter")
    flat = run_module("hpcpipe.checkpoint", "export", ck, tmp_path / "flat.h5", "--merge-adapter")
    assert flat.returncode == 0, flat.stderr
    assert np.abs(_hpcpipe_logits(tmp_path / "flat.h5", tokens) - mine).max() <= 1e-6 * np.abs(mine).max()


def test_an_adapter_for_another_base_is_one_line_exit_2(tmp_path):
    hf, _ = make_model_and_adapter(tmp_path / "a")
    _, wider = make_model_and_adapter(tmp_path / "b", hidden_size=48, num_attention_heads=4)
    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
    data = _tokens(tmp_path / "tokens.h5", vocab)
    one_error(_train(tmp_path, hf, wider, data), "made for another base model", "has shape", "this model's needs")
    proc = run_command(2, "hpcpipe.generate", ["--weights", str(hf), "--adapter", str(wider), "--prompt", "x",
                                               "--set", "parallel.pp=2"])
    one_error(proc, "made for another base model")
    _, deeper = make_model_and_adapter(tmp_path / "c", num_hidden_layers=3)
    one_error(_train(tmp_path, hf, deeper, data), "layers.2", "a block this model does not have")
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((wider / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    (dora / "adapter_model.safetensors").write_bytes((wider / "adapter_model.safetensors").read_bytes())
    one_error(_train(tmp_path, hf, dora, data), "use_dora = true is not supported")
    one_error(_train(tmp_path, hf, wider, data, "--set", "train.lora_rank=8"), "train.lora_rank = 8",
              "does not match model.adapter")


def test_lora_on_a_kind_without_those_modules_is_one_line_exit_2(tmp_path):
    proc = run_command(2, "hpcpipe.train", ["--set", "train.lora_rank=4", "--set", "parallel.pp=2"], cwd=tmp_path)
    one_error(proc, "train.lora_rank", 'model.kind = "mlp"', "no modules LoRA can target")
    proc = run_command(2, "hpcpipe.train", ["--set", 'model.kind="gpt"', "--set", "train.lora_rank=4",
                                            "--set", 'train.lora_targets=["q_proj"]', "--set", "parallel.pp=2"],
                       cwd=tmp_path)
    one_error(proc, "'q_proj' is not a module of model.kind = \"gpt\"", "c_attn, c_proj, c_fc")
    proc = run_module("hpcpipe.checkpoint", "export", tmp_path, tmp_path / "x", "--format", "peft",
                      "--merge-adapter")
    assert proc.returncode == 2
