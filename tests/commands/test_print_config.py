"""`--print-config` prints the effective configuration as TOML and exits 0 without MPI work (issue #32)."""

from __future__ import annotations

import sys
import tomllib

import pytest
from support import ROOT
from support.launch import run

from hpcpipe.cli import CommandParser
from hpcpipe.config import load_config


@pytest.mark.parametrize("module,extra", [("hpcpipe.train", []), ("hpcpipe.plan", [])])
def test_print_config_is_the_effective_config_as_toml(tmp_path, module, extra):
    args = ["--config", str(ROOT / "configs" / "digits.toml"), "--set", "train.steps=7", "--set", "log.every=3"]
    proc = run([sys.executable, "-m", module, "--print-config", *args, *extra], cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    expected = load_config(ROOT / "configs" / "digits.toml", ["train.steps=7", "log.every=3"]).to_dict()
    assert tomllib.loads(proc.stdout) == expected
    assert proc.stdout.startswith(f"# the effective configuration of python -m {module}\n")
    assert "hpcpipe: MPI:" not in proc.stdout and proc.stderr == "" and list(tmp_path.iterdir()) == []


def test_print_config_of_a_llama_reads_back(tmp_path):
    """A table value (model.rope_scaling) has a TOML form too: the planner's writer had none."""
    sets = ["--set", "model.kind=\"llama\"", "--set", "model.rope_scaling={rope_type = \"linear\", factor = 2.0}",
            "--set", "parallel.pp=2"]
    proc = run([sys.executable, "-m", "hpcpipe.train", "--print-config", *sets], cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    shown = tomllib.loads(proc.stdout)
    assert shown["model"]["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert load_config(None, [s for s in sets if s != "--set"]).to_dict() == shown


def test_print_config_of_a_bad_config_is_one_error(tmp_path):
    proc = run([sys.executable, "-m", "hpcpipe.train", "--print-config", "--set", "train.setps=5"], cwd=tmp_path,
               timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == ("hpcpipe: error: unknown key train.setps: did you mean train.steps? (known keys "
                                   "in [train]: beta1, beta2, eps, eval_every, grad_clip, lora_alpha, lora_rank, "
                                   "lora_targets, loss, lr, lr_schedule, max_bad_steps, micro_batch_size, "
                                   "micro_batches, min_lr_ratio, momentum, optimizer, recompute, steps, "
                                   "warmup_steps, weight_decay, zero)")


def test_an_option_declared_so_takes_a_value_starting_with_a_dash():
    """`--memory-per-rank -1GiB` was argparse's "expected one argument"; the command now sees the value."""
    parser = CommandParser(prog="t")
    parser.add_argument("--size", dash_value=True)
    parser.add_argument("--other")
    parser.add_argument("rest", nargs="*")
    assert parser.parse_args(["--size", "-1GiB", "x"]).size == "-1GiB"
    assert parser.parse_args(["--size=-2"]).size == "-2" and parser.parse_args(["--size", "3"]).size == "3"
    assert parser.parse_args(["--", "--size", "-1"]).rest == ["--size", "-1"]     # after --: positional
    with pytest.raises(SystemExit):
        parser.parse_args(["--other", "-1GiB"])                                  # only where declared
