"""Console scripts of the MPI commands install the stop handlers before anything slow loads (as `python -m`)."""

import configparser
import importlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from support import ROOT

from hpcpipe.state.weights import write_weights

SCRIPTS = {"hpcpipe-train": "hpcpipe.train.__main__", "hpcpipe-infer": "hpcpipe.infer.__main__"}


def test_setup_cfg_points_the_mpi_commands_at_the_early_handlers():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = dict(line.split(" = ") for line in cfg["options.entry_points"]["console_scripts"].split("\n") if line)
    for script, module in SCRIPTS.items():
        assert lines[script] == f"{module}:script"      # the same entry as python -m (was ...command:main)
        assert callable(importlib.import_module(module).script)


def test_the_script_module_loads_nothing_slow():
    code = ("import sys, hpcpipe.train.__main__, hpcpipe.infer.__main__; "
            "print(sorted(m for m in ('numpy', 'h5py', 'mpi4py', 'hpcpipe.train.command', 'hpcpipe.infer.command') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _status(pid: int) -> tuple[bool, bool]:
    """(the process catches SIGTERM, NumPy's core library is mapped into it)."""
    caught = False
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            caught = bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return caught, "_multiarray_umath" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.skipif(not Path(sys.executable).with_name("hpcpipe-infer").exists(), reason="package not installed")
def test_the_installed_infer_script_catches_sigterm_before_numpy_loads(tmp_path):
    script = Path(sys.executable).with_name("hpcpipe-infer")
    dims, rng = [64, 512, 64], np.random.default_rng(0)
    write_weights(tmp_path / "w.h5", {i: {"weight": rng.standard_normal(dims[i:i + 2]).astype(np.float32)}
                                      for i in range(2)}, n_layers=2,
                  model_config={"dims": dims, "bias": False, "activation": "relu", "dtype": "float32"})
    with h5py.File(tmp_path / "x.h5", "w") as f:
        f["x"] = rng.standard_normal((20_000, 64)).astype(np.float32)
    proc = subprocess.Popen([sys.executable, str(script), "--weights", str(tmp_path / "w.h5"), "--input",
                             str(tmp_path / "x.h5"), "--output", str(tmp_path / "y.h5"), "--set", "parallel.pp=1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 30
        while True:
            caught, numpy_loaded = _status(proc.pid)
            if caught:
                break
            assert proc.poll() is None and time.time() < deadline, "the script ended before it caught SIGTERM"
            time.sleep(0.0005)
        assert not numpy_loaded     # was: NumPy, h5py and mpi4py loaded first; a SIGTERM then killed the rank (15)
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 75 and "stopped by SIGTERM" in err, err     # the stop contract, as `python -m`
    assert not (tmp_path / "y.h5").exists()
