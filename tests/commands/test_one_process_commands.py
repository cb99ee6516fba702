"""evaluate and checkpoint run on one process: started as N > 1 ranks of mpiexec they are refused in one line
(exit 2, nothing written). Before, `mpiexec -n 2 python -m hpcpipe.evaluate ...` evaluated twice and printed two
JSON lines, and `mpiexec -n 2 python -m hpcpipe.checkpoint import DIR out.h5` imported twice: one rank wrote out.h5,
the other exited 2 leaving '.out.h5.tmp-...' behind."""

from __future__ import annotations

import sys

import numpy as np
from support import launchers
from support.launch import one_error, run, run_command

from hpcpipe.runtime.launcher import one_process_problem
from hpcpipe.state.weights import write_weights

MODEL = {"dims": [4, 3], "bias": True, "activation": "tanh", "final_activation": False}


def _weights(path):
    rng = np.random.default_rng(0)
    write_weights(path, {0: {"weight": rng.standard_normal((4, 3)).astype(np.float32),
                             "bias": np.zeros(3, np.float32)}}, n_layers=1, model_config=MODEL)
    return path


def test_only_ranks_the_launcher_started_count():
    env = {"PMI_SIZE": "2", "PMI_RANK": "0"}
    assert "launcher started 2" in one_process_problem("hpcpipe.evaluate", env, parent_has=False)
    assert "launcher started 3" in one_process_problem("hpcpipe.evaluate", {"OMPI_COMM_WORLD_SIZE": "3"},
                                                       parent_has=False)
    assert one_process_problem("hpcpipe.evaluate", env, parent_has=True) is None         # a rank's child process
    assert one_process_problem("hpcpipe.evaluate", {"PMI_SIZE": "1"}, parent_has=False) is None
    # a Slurm batch script's plain python sees the job's task count: not a launch of N copies
    assert one_process_problem("hpcpipe.evaluate", {"SLURM_NTASKS": "4"}, parent_has=False) is None


def test_evaluate_and_checkpoint_under_mpiexec_are_refused_once_and_write_nothing(tmp_path):
    weights = _weights(tmp_path / "w.h5")
    data = tmp_path / "d.h5"
    import h5py
    with h5py.File(data, "w") as f:
        f["x"] = np.zeros((4, 4), np.float32)
        f["y"] = np.zeros(4, np.int64)
    proc = run_command(2, "hpcpipe.evaluate", ["--weights", str(weights), "--data", str(data)])
    one_error(proc, "runs on one process", "started 2", "without mpiexec", quiet=True)
    out = tmp_path / "out.h5"
    proc = run_command(2, "hpcpipe.checkpoint", ["export", str(weights), str(out)])
    one_error(proc, "python -m hpcpipe.checkpoint runs on one process", quiet=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.h5", "w.h5"]


def test_a_rank_s_child_process_still_runs_the_command(tmp_path):
    """The variables a rank inherits from the launcher reach its children: those run alone, as before."""
    weights = _weights(tmp_path / "w.h5")
    script = ("import subprocess, sys; r = subprocess.run([sys.executable, '-m', 'hpcpipe.checkpoint', 'info', "
              f"{str(weights)!r}], capture_output=True, text=True); print(r.returncode, 'weights file' in r.stdout)")
    proc = run([*launchers.prefix(2), sys.executable, "-c", script])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0", "True", "0", "True"], (proc.stdout, proc.stderr)
