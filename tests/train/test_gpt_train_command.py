"""GPT end to end: `mpiexec -n N python -m hpcpipe.train` with model.kind = "gpt"; bad input is one line, exit 2."""

import json
import re

import h5py
import numpy as np
import pytest
from support.launch import run_command

SMALL = ["--set", "model.kind=\"gpt\"", "--set", "model.vocab_size=32", "--set", "model.seq_len=16",
         "--set", "model.d_model=16", "--set", "model.n_heads=2", "--set", "model.n_blocks=2",
         "--set", "log.progress=false"]


def _set(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def _tokens(path, n=64, t=16, vocab=32, x_name="x", y_name="y", bad=None):
    rng = np.random.default_rng(0)
    stream = rng.integers(0, vocab, (n, t + 1))
    x, y = stream[:, :-1].copy(), stream[:, 1:].copy()
    if bad is not None:
        x[bad] = vocab + 3
    with h5py.File(path, "w") as f:
        f[x_name], f[y_name] = x.astype(np.int32), y.astype(np.int32)
    return path


def test_gpt_trains_at_dp2_pp2_and_resumes_to_the_same_state(tmp_path):
    args = SMALL + _set("parallel.pp=2", "train.optimizer=\"adam\"", "train.lr=0.01", "train.steps=30",
                        "parallel.schedule=\"1f1b\"", f"log.metrics=\"{tmp_path / 'm.jsonl'}\"",
                        f"checkpoint.dir=\"{tmp_path / 'ck'}\"", "checkpoint.every=10")
    proc = run_command(4, "hpcpipe.train", args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    first, last = (float(v) for v in re.search(r"loss ([\d.]+) -> ([\d.]+)", proc.stdout).groups())
    assert first == pytest.approx(np.log(32), rel=0.05)       # uniform over the vocabulary at the start
    assert last < first - 0.5                                  # the synthetic Markov chain is learnable
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert len(records) == 30 and all(r["peak_stash_bytes"] > 0 for r in records)
    assert set(records[0]["peak_stash_bytes_by_stage"]) == {"0", "1"}
    with h5py.File(next((tmp_path / "ck").glob("run-0001/step-00000030/stage-000.h5")), "r") as f:
        assert f["layers/0001/attn/qkv/weight"].shape == (16, 48)
        assert "layers/0000/tok_emb" in f and json.loads(f.attrs["model"])["kind"] == "gpt"


def test_recompute_reports_smaller_stash(tmp_path):
    def peak(recompute):
        metrics = tmp_path / f"{recompute}.jsonl"
        args = SMALL + _set("parallel.pp=2", "train.steps=2", f"train.recompute=\"{recompute}\"",
                            "checkpoint.dir=\"\"", f"log.metrics=\"{metrics}\"")
        proc = run_command(2, "hpcpipe.train", args, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        return json.loads(metrics.read_text().splitlines()[-1])["peak_stash_bytes_by_stage"]

    full, light = peak("none"), peak("stage")
    for stage in ("0", "1"):
        assert light[stage] * 4 <= full[stage], (full, light)


def _refused(tmp_path, args, n=2):
    proc = run_command(n, "hpcpipe.train", args, cwd=tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "step 1/" not in proc.stdout
    return lines[0]


def test_token_id_outside_the_vocabulary_names_file_and_row(tmp_path):
    data = _tokens(tmp_path / "t.h5", bad=(slice(37, 39), 4))
    line = _refused(tmp_path, SMALL + _set("parallel.pp=2", f"data.path=\"{data}\""))
    assert "t.h5" in line and "'x' row 37" in line and "35" in line and "[0, 32)" in line


def test_window_width_other_than_seq_len(tmp_path):
    data = _tokens(tmp_path / "t.h5", t=12)
    line = _refused(tmp_path, SMALL + _set("parallel.pp=2", f"data.path=\"{data}\""))
    assert "(64, 12)" in line and "seq_len = 16" in line


def test_n_heads_not_dividing_d_model(tmp_path):
    line = _refused(tmp_path, SMALL + _set("parallel.pp=2", "model.n_heads=3"))
    assert "model.n_heads (3) does not divide model.d_model (16)" in line


def test_more_stages_than_layer_groups(tmp_path):
    line = _refused(tmp_path, SMALL + _set("parallel.pp=8"), n=8)
    assert "parallel.pp (8)" in line and "exceeds the number of layers (4)" in line and "n_blocks 2 + 2" in line


def test_mlp_key_with_gpt(tmp_path):
    line = _refused(tmp_path, SMALL + _set("parallel.pp=2", "model.dims=[4, 4]"))
    assert "model.dims is a key of an MLP and cannot be set with model.kind = 'gpt'" in line


def test_loss_other_than_token_cross_entropy(tmp_path):
    line = _refused(tmp_path, SMALL + _set("parallel.pp=2", "train.loss=\"mse\""))
    assert "cross-entropy over tokens" in line


def test_float_tokens_are_refused(tmp_path):
    path = tmp_path / "f.h5"
    with h5py.File(path, "w") as f:
        f["x"], f["y"] = np.zeros((8, 16), np.float32), np.zeros((8, 16), np.float32)
    line = _refused(tmp_path, SMALL + _set("parallel.pp=2", f"data.path=\"{path}\""))
    assert "f.h5" in line and "must be integers" in line


def test_checkpoints_carry_the_data_files_tokenizer(tmp_path):
    data = _tokens(tmp_path / "t.h5")
    chars = "".join(chr(ord("a") + i) for i in range(26)) + " .,;:!?\n"     # 34 characters
    with h5py.File(data, "a") as f:
        f.attrs["tokenizer"] = json.dumps({"kind": "chars", "chars": chars[:30]})
    args = SMALL + _set("parallel.pp=2", f"data.path=\"{data}\"", "train.steps=2",
                        f"checkpoint.dir=\"{tmp_path / 'ck'}\"")
    proc = run_command(2, "hpcpipe.train", args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for stage_file in (tmp_path / "ck").glob("run-0001/step-00000002/stage-*.h5"):
        with h5py.File(stage_file, "r") as f:
            assert json.loads(f.attrs["tokenizer"]) == {"kind": "chars", "chars": chars[:30]}
    # a tokenizer with more ids than the model's vocabulary is refused before step 0
    with h5py.File(data, "a") as f:
        f.attrs["tokenizer"] = json.dumps({"kind": "chars", "chars": chars})
    line = _refused(tmp_path, SMALL + _set("parallel.pp=2", f"data.path=\"{data}\"", "checkpoint.dir=\"\""))
    assert "vocabulary of 34" in line and "model.vocab_size = 32" in line
