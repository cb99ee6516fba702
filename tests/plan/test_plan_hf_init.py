"""`python -m hpcpipe.plan --set model.init=HF_DIR` plans the Hugging Face model, as train reads it (a new-user
trial: the planner planned the default MLP and wrote kind = "mlp" beside the HF init, which train refused)."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from support.hf import bytelevel_tokenizer, save_model, save_tokenizer, tiny_model
from support.launch import run_command

from hpcpipe.config import load_config
from hpcpipe.plan.engine_calibration import _run_config

pytest.importorskip("torch")
pytest.importorskip("transformers")

KINDS = {"llama": "llama", "mixtral": "moe"}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """A tiny llama and a tiny mixtral, each with a 300-token tokenizer, side by side in one folder."""
    folder = tmp_path_factory.mktemp("hf")
    tok = bytelevel_tokenizer(["<|endoftext|>"], vocab_size=300)
    for arch in KINDS:
        model = tiny_model(arch, vocab_size=tok.get_vocab_size(), eos_token_id=0, bos_token_id=0)
        save_tokenizer(tok, save_model(model, folder / arch), eos_token="<|endoftext|>")
    return folder


def _plan(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HPCPIPE_PROFILE_DIR": str(cwd / "profiles"), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "hpcpipe.plan", *args], capture_output=True, text=True,
                          timeout=600, cwd=cwd, env=env)


@pytest.mark.parametrize("arch", list(KINDS))
def test_plan_restates_the_hugging_face_model_and_train_runs_the_plan(models, arch):
    proc = _plan(["--set", f'model.init="{arch}"', "--ranks", "2", "--memory-per-rank", "1GiB", "--write",
                  f"{arch}.toml", "--max-micro-batches", "4"], models)
    assert proc.returncode == 0, proc.stderr
    planned = tomllib.loads((models / f"{arch}.toml").read_text())
    model = planned["model"]
    assert (model["kind"], model["vocab_size"], model["init"]) == (KINDS[arch], 300, arch)
    assert (model["d_model"], model["n_blocks"], model["d_ff"], model["tie_embeddings"]) == (32, 2, 48, False)
    assert "dims" not in model
    if arch == "mixtral":
        assert (model["n_experts"], model["experts_per_token"]) == (4, 2)
        assert planned["parallel"]["ep"] in (1, 2)          # the planned ep is written (docs/moe.md)
    run = run_command(2, "hpcpipe.train", ["--config", f"{arch}.toml", "--set", "train.steps=2",
                                           "--set", 'checkpoint.dir=""', "--set", "log.progress=false"],
                      cwd=models, timeout=300)
    assert run.returncode == 0, run.stderr
    assert f"model.kind = '{KINDS[arch]}'" not in run.stderr


def test_print_config_restates_the_hugging_face_model(models):
    proc = _plan(["--set", 'model.init="mixtral"', "--print-config"], models)
    assert proc.returncode == 0, proc.stderr
    model = tomllib.loads(proc.stdout)["model"]
    assert (model["kind"], model["vocab_size"], model["n_experts"]) == ("moe", 300, 4)


def test_a_key_that_contradicts_the_hugging_face_model_is_one_line_exit_2(models):
    proc = _plan(["--set", 'model.init="llama"', "--set", 'model.kind="gpt"', "--ranks", "2"], models)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.kind" in lines[0] and "llama" in lines[0], proc.stderr


def test_the_calibration_run_finds_files_named_relative_to_the_planner(tmp_path, monkeypatch):
    """The calibration runs train in a temporary folder: a relative model.init was not found there."""
    monkeypatch.chdir(tmp_path)
    config = load_config(None, ['model.init="w.h5"', 'data.path="d.h5"'])
    out = _run_config(config, 2, 1, [5], 4, "trace.json")
    assert out["model"]["init"] == str(tmp_path / "w.h5") and out["data"]["path"] == str(tmp_path / "d.h5")
    assert out["data"]["eval_path"] == "" and out["model"]["adapter"] == ""
