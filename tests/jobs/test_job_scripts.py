"""The Slurm batch scripts refuse a bad HPCPIPE_PP before any arithmetic or launch (no Slurm, no MPI needed)."""

from __future__ import annotations

import os
import subprocess

import pytest
from support import ROOT

SCRIPTS = ["train.sbatch", "infer.sbatch", "serve.sbatch"]


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("pp", ["0", "-2", "abc", "3x", "", "PATH[$(touch {marker})]"])
def test_a_bad_pipeline_depth_is_exit_2_and_never_evaluated(tmp_path, script, pp):
    marker = tmp_path / "evaluated"
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "SLURM_NTASKS": "4", "HPCPIPE_WEIGHTS": "w.h5",
           "HPCPIPE_INPUT": "in.h5", "HPCPIPE_PP": pp.format(marker=marker),
           "HPCPIPE_LAUNCHER": str(tmp_path / "no-such-launcher")}
    result = subprocess.run(["bash", str(ROOT / "jobs" / script)], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=60, check=False)
    out = result.stdout + result.stderr
    if pp == "":          # empty means unset: the default depth 4 divides 4 tasks, so the script goes on
        assert "HPCPIPE_PP must be" not in out
        return
    assert result.returncode == 2, out
    assert f"HPCPIPE_PP must be a positive integer (pipeline stages); got '{env['HPCPIPE_PP']}'" in out
    assert "((" not in out and "syntax error" not in out      # refused before bash's arithmetic saw it
    assert not marker.exists()                               # was: the $(...) ran inside (( ))


@pytest.mark.parametrize("script", ["train.sbatch", "serve.sbatch"])
@pytest.mark.parametrize("tp,words", [("0", "HPCPIPE_TP must be a positive integer"),
                                      ("$(touch {marker})", "HPCPIPE_TP must be a positive integer"),
                                      ("3", "is not a multiple of HPCPIPE_PP=2 x HPCPIPE_TP=3")])
def test_a_bad_tensor_parallel_width_is_exit_2_and_never_evaluated(tmp_path, script, tp, words):
    marker = tmp_path / "evaluated"
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "SLURM_NTASKS": "4", "HPCPIPE_WEIGHTS": "w.h5",
           "HPCPIPE_PP": "2", "HPCPIPE_TP": tp.format(marker=marker),
           "HPCPIPE_LAUNCHER": str(tmp_path / "no-such-launcher")}
    result = subprocess.run(["bash", str(ROOT / "jobs" / script)], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=60, check=False)
    out = result.stdout + result.stderr
    assert result.returncode == 2 and words in out, out
    assert not marker.exists()
