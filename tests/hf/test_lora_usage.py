"""What a new user does wrong with LoRA checkpoints and PEFT adapters, through the real commands: a PEFT
directory given where a model belongs says what it is and how to use it (exit 2; ``checkpoint info`` describes
it); ``--adapter`` on a LoRA run's own checkpoint is refused (it would apply the adapters twice); an exported
adapter names its base by absolute path and honours ``--dtype``; one stage's file is named as such; ``info``
shows a LoRA run's rank, alpha and targets."""

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


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A tiny HF llama and a PEFT adapter in models/, and a LoRA run (pp=2, 1 step) started in job/ with a relative
    model.init ../models/base and checkpoint.dir ck."""
    tmp = tmp_path_factory.mktemp("lora-usage")
    hf, adapter = make_model_and_adapter(tmp / "models", targets=["q_proj", "v_proj"])
    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
    job = tmp / "job"
    job.mkdir()
    rng = np.random.default_rng(0)
    with h5py.File(job / "tokens.h5", "w") as f:
        f["x"] = rng.integers(0, vocab, (8, SEQ)).astype(np.int32)
        f["y"] = rng.integers(0, vocab, (8, SEQ)).astype(np.int32)
    proc = run_command(2, "hpcpipe.train", [
        "--set", 'model.init="../models/base"', "--set", f"model.seq_len={SEQ}", "--set", 'data.path="tokens.h5"',
        "--set", "parallel.pp=2", "--set", "train.steps=1", "--set", "train.micro_batches=2",
        "--set", "train.micro_batch_size=2", "--set", "train.lora_rank=4", "--set", "train.lora_alpha=16",
        "--set", 'train.lora_targets=["q_proj", "v_proj"]', "--set", 'checkpoint.dir="ck"',
        "--set", "log.progress=false"], timeout=240, cwd=job)
    assert proc.returncode == 0, proc.stderr
    return tmp, hf, adapter, job / "ck"


def test_a_peft_adapter_where_a_model_belongs_says_what_it_is(lora_run):
    tmp, _, adapter, _ = lora_run
    info = run_module("hpcpipe.checkpoint", "info", adapter)
    assert info.returncode == 0, info.stderr
    assert "PEFT adapter directory" in info.stdout and "r = 4" in info.stdout and "q_proj, v_proj" in info.stdout
    assert "--adapter" in info.stdout
    for args in (["verify", adapter], ["verify", "--all", adapter], ["import", adapter, tmp / "x.h5"],
                 ["export", adapter, tmp / "x.h5"]):
        one_error(run_module("hpcpipe.checkpoint", *args), "is a PEFT adapter directory", "--adapter",
                  "model.adapter")
    assert not (tmp / "x.h5").exists()
    data = tmp / "job" / "tokens.h5"
    one_error(run_module("hpcpipe.evaluate", "--weights", adapter, "--data", data, timeout=120),
              "--weights", "is a PEFT adapter directory", "--adapter")


def test_adapter_on_a_lora_checkpoint_is_refused(lora_run):
    tmp, _, _, ck = lora_run
    out = tmp / "own-adapter"
    proc = run_module("hpcpipe.checkpoint", "export", ck, out, "--format", "peft")
    assert proc.returncode == 0, proc.stderr
    refused = run_command(2, "hpcpipe.generate", ["--weights", str(ck), "--adapter", str(out), "--prompt", "x",
                                                  "--max-new-tokens", "2", "--set", "parallel.pp=2"])
    one_error(refused, "trained with LoRA", "already includes its adapters", "--adapter is for a base model")


def test_peft_export_names_its_base_absolutely_and_takes_dtype(lora_run, monkeypatch):
    tmp, hf, _, ck = lora_run
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    out = elsewhere / "bf16-adapter"
    proc = run_module("hpcpipe.checkpoint", "export", Path("..") / "job" / "ck", out.name, "--format", "peft",
                      "--dtype", "bfloat16", cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(hf.resolve())
    raw = (out / "adapter_model.safetensors").read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    monkeypatch.chdir(tmp / "job")                      # neither where the run started nor where it was exported
    model = peft.AutoPeftModelForCausalLM.from_pretrained(str(out))
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and torch.equal(lora_b[0], lora_b[0].to(torch.bfloat16).float())    # bf16 values, loaded

    one_error(run_module("hpcpipe.checkpoint", "export", ck, tmp / "w.h5", "--dtype", "bfloat16"),
              "--dtype bfloat16 is for --format hf or peft")
    assert not (tmp / "w.h5").exists()


def test_info_shows_lora_and_one_stage_file_is_named(lora_run):
    tmp, _, _, ck = lora_run
    info = run_module("hpcpipe.checkpoint", "info", ck)
    assert info.returncode == 0, info.stderr
    assert "LoRA adapters r = 4, lora_alpha = 16, targets q_proj, v_proj" in info.stdout
    stage = sorted(ck.glob("run-*/step-*/stage-001.h5"))[0]
    proc = run_module("hpcpipe.checkpoint", "export", stage, tmp / "st.h5", "--merge-adapter")
    one_error(proc, "one stage's file of the checkpoint", "pass the step directory", str(stage.parent))
    assert "lora_rank = 0" not in proc.stderr and not (tmp / "st.h5").exists()
    info = run_module("hpcpipe.checkpoint", "info", stage)
    assert info.returncode == 0, info.stderr
    first = info.stdout.splitlines()[0]
    listed = [line for line in info.stdout.splitlines() if line.startswith("  layer ")]
    held = [int(line.split()[1].rstrip(":")) for line in listed]
    assert f"holds only layers {held} of" in first and "one stage's file" in first


def test_set_of_an_unquoted_list_hints_at_toml_quotes():
    from hpcpipe.config import from_dict, load_raw
    from hpcpipe.errors import ConfigError
    with pytest.raises(ConfigError) as caught:
        from_dict(load_raw(None, ["train.lora_targets=[q_proj, v_proj]"]))
    assert "--set 'train.lora_targets=[\"q_proj\", \"v_proj\"]'" in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        from_dict(load_raw(None, ["train.lora_targets=5"]))
    assert "quotes" not in str(caught.value)


def test_resume_refuses_a_model_init_of_another_model(lora_run):
    """--resume --set model.init=<a GPT-2> used to train on and save that path as the run's base: the PEFT export
    of the llama's adapters then named the GPT-2 as base_model_name_or_path."""
    from support.hf import save_model, tiny_model
    tmp, _, _, ck = lora_run
    other = save_model(tiny_model("gpt2"), tmp / "models" / "gpt2")
    before = sorted(p.name for p in (ck / "run-0001").iterdir())
    proc = run_command(2, "hpcpipe.train", ["--resume", "--set", 'checkpoint.dir="ck"', "--set", "train.steps=2",
                                            "--set", f"model.init={json.dumps(str(other))}", "--set",
                                            "log.progress=false"], timeout=240, cwd=ck.parent)
    one_error(proc, f"model.init {str(other)!r} holds a GPT model", 'this run has model.kind = "llama"',
              "saved with model.init = '../models/base'", "leave model.init out")
    assert sorted(p.name for p in (ck / "run-0001").iterdir()) == before


def test_a_model_directory_given_as_the_adapter_says_what_it_is(lora_run):
    """model.adapter = the base model's own directory said only that adapter_config.json does not exist."""
    from hpcpipe.errors import ConfigError
    from hpcpipe.state.peft import read_adapter
    _, hf, _, _ = lora_run
    with pytest.raises(ConfigError) as info:
        read_adapter(hf)
    assert str(info.value) == (f"model.adapter {str(hf)!r} is a model directory (config.json), not a PEFT adapter (a "
                               f"directory with adapter_config.json and adapter_model.safetensors): give the model as "
                               f"model.init (train) or --weights (generate, serve)")


def test_resume_refuses_a_model_adapter_it_would_ignore(lora_run):
    """--resume --set model.adapter=<a PEFT directory> trained on from the checkpoint's own adapters and said only
    "except model.adapter '' -> '...'": the adapter given was never read."""
    _, _, adapter, ck = lora_run
    before = sorted(p.name for p in (ck / "run-0001").iterdir())
    proc = run_command(2, "hpcpipe.train", ["--resume", "--set", 'checkpoint.dir="ck"', "--set", "train.steps=2",
                                            "--set", f"model.adapter={json.dumps(str(adapter))}", "--set",
                                            "log.progress=false"], timeout=240, cwd=ck.parent)
    one_error(proc, "it was saved with model.adapter = ''", f"this run has {str(adapter)!r}",
              "leave model.adapter out")
    assert sorted(p.name for p in (ck / "run-0001").iterdir()) == before
