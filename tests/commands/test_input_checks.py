"""Unit tests of the start-up checks (issue #11): config files and floats, weights datasets, output paths,
rank-0-only command-line messages, early stop handlers, simulate --plot without matplotlib.

The memory check's tests are in test_memory_check.py.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
from support import ROOT

from hpcpipe.cli import CommandParser
from hpcpipe.config import from_dict, load_config
from hpcpipe.errors import ConfigError
from hpcpipe.nn.mlp.model import initial_arrays, layer_specs
from hpcpipe.runtime.launcher import launcher_rank
from hpcpipe.state.outputs import check_writable
from hpcpipe.state.weights import check_weights, read_layers, read_optimizer, write_weights
from hpcpipe.train.preflight import check_metrics_file
from hpcpipe.train.setup import prepare

CFG = from_dict({"model": {"dims": [6, 5, 4, 3]}, "parallel": {"pp": 1}})
SPECS = layer_specs(CFG)


def _digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


# -- config files and float keys ---------------------------------------------------------------------

def test_config_file_not_utf8_is_named_and_left_intact(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes("[train]\nlr = 0.1   # r\xe9glage\n".encode("latin-1"))
    before = _digest(path)
    with pytest.raises(ConfigError, match=r"config file '.*latin1\.toml' is not UTF-8 text \(byte 22: b'\\xe9'\)"):
        load_config(path)
    assert _digest(path) == before


def test_directory_as_config_says_directory_not_missing(tmp_path):
    with pytest.raises(ConfigError, match=r"config file '.*' is a directory, not a TOML file"):
        load_config(tmp_path)


@pytest.mark.parametrize("override, message", [
    ("train.lr=inf", "train.lr must be a finite number, got inf"),
    ("train.weight_decay=inf", "train.weight_decay must be a finite number, got inf"),
    ("train.momentum=nan", "train.momentum must be a finite number, got nan"),
    ("train.grad_clip=+inf", "train.grad_clip must be a finite number, got inf"),
    ("train.beta2=-inf", "train.beta2 must be a finite number, got -inf"),
    ("train.eps=nan", "train.eps must be a finite number, got nan"),
    ("train.lr=1e400", "train.lr must be a finite number, got inf"),        # overflows to inf in TOML
    ("run.stall_timeout=inf", "run.stall_timeout must be a finite number, got inf"),
    ("run.poll_max_us=nan", "run.poll_max_us must be a finite number, got nan"),
    ("train.eps=0", r"train.eps must be > 0, got 0.0"),
    ("train.eps=-1e-8", r"train.eps must be > 0, got -1e-08"),
    ("model.seed=-1", "model.seed must be >= 0, got -1"),
    ("data.seed=-3", "data.seed must be >= 0, got -3"),
    ("model.dims=[16, 1e9, 16]", r"model.dims must be list\[int\], got \[16, 1000000000.0, 16\]"),
])
def test_every_float_key_must_be_finite_and_in_range(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_finite_floats_still_accepted():
    config = load_config(None, ["train.lr=1e-3", "train.weight_decay=0", "train.eps=1e-12", "run.stall_timeout=0"])
    assert config.train.eps == 1e-12 and config.run.stall_timeout == 0.0


# -- weights datasets: types, dtypes, shapes, finiteness ----------------------------------------------

def _write(path, change=None):
    write_weights(path, initial_arrays(SPECS, [0, 1, 2], seed=3, dtype="float32"), n_layers=3)
    if change is not None:
        with h5py.File(path, "r+") as f:
            change(f)
    return path


def _replace(name, value):
    def change(f):
        del f[name]
        if isinstance(value, str) and value == "group":
            f.create_group(name).create_dataset("x", data=np.zeros(3, np.float32))
        else:
            f[name] = value
    return change


@pytest.mark.parametrize("change, message", [
    (_replace("layers/0001/bias", "group"), r"layers/0001/bias is a group, not a dataset"),
    (_replace("layers/0001/bias", np.bytes_(b"abcd")), r"layers/0001/bias holds \|S4 values, not real floating"),
    (_replace("layers/0001/bias", np.array([b"ab", b"cd", b"ef", b"gh"])), r"holds \|S2 values"),
    (_replace("layers/0001/bias", "four"), r"layers/0001/bias holds object values"),
    (_replace("layers/0001/bias", np.zeros(4, [("a", "f4"), ("b", "f4")])),
     r"holds \[\('a', '<f4'\), \('b', '<f4'\)\] values"),
    (_replace("layers/0001/bias", np.zeros(4, np.complex64)), r"holds complex64 values"),
    (_replace("layers/0001/bias", np.arange(4)), r"layers/0001/bias holds int64 values"),
    (_replace("layers/0001/bias", np.float32(1.0)), r"layers/0001/bias has shape \(\), the model needs \(4,\)"),
    (_replace("layers/0001", np.zeros(3, np.float32)),
     r"layers/0001 is a dataset, not a group holding weight and bias"),
    (_replace("layers", np.zeros(3, np.float32)), r"layers is a dataset, not a group of layers"),
    (lambda f: f.create_group("layers/abc"), r"layers/abc is not a layer"),
])
def test_malformed_weights_datasets_are_refused_naming_file_and_dataset(tmp_path, change, message):
    path = _write(tmp_path / "w.h5", change)
    before = _digest(path)
    with pytest.raises(ConfigError, match=r"w\.h5.*" + message):
        check_weights(path, SPECS)
    assert _digest(path) == before


def test_non_finite_weights_are_refused_on_read_with_a_count(tmp_path):
    def poison(f):
        w = f["layers/0002/weight"][...]
        w[0, :3] = [np.nan, np.inf, -np.inf]
        f["layers/0002/weight"][...] = w
    path = _write(tmp_path / "w.h5", poison)
    check_weights(path, SPECS)    # metadata is fine: the values are only known when read
    with pytest.raises(ConfigError, match=r"weights file '.*w\.h5': layers/0002/weight holds 3 non-finite "
                                          r"value\(s\) \(NaN or Inf\) of 12"):
        read_layers(path, [2])
    read_layers(path, [0, 1])


def test_non_finite_optimizer_state_is_refused(tmp_path):
    arrays = initial_arrays(SPECS, [0], seed=3, dtype="float32")
    opt = {0: {"exp_avg": {k: np.full_like(v, np.nan) for k, v in arrays[0].items()}}}
    path = tmp_path / "c.h5"
    write_weights(path, arrays, n_layers=3, optimizer=opt, optimizer_attrs={"name": "adam", "steps": 1})
    with pytest.raises(ConfigError, match=r"optimizer/layers/0000/exp_avg/bias holds 5 non-finite"):
        read_optimizer(path, [0])


# -- output paths --------------------------------------------------------------------------------------

def test_output_file_checks(tmp_path):
    check_writable(str(tmp_path / "m.jsonl"), "log.metrics", append=True)          # new file: fine
    (tmp_path / "old.jsonl").write_text("kept\n")
    check_writable(str(tmp_path / "old.jsonl"), "log.metrics", append=True)        # appended to: fine
    assert (tmp_path / "old.jsonl").read_text() == "kept\n"
    with pytest.raises(ConfigError, match=r"log.metrics directory '.*/nodir' does not exist \(for log.metrics "):
        check_writable(str(tmp_path / "nodir" / "m.jsonl"), "log.metrics", append=True)
    with pytest.raises(ConfigError, match=r"log.trace '.*' is a directory"):
        check_writable(str(tmp_path), "log.trace")
    with pytest.raises(ConfigError, match=r"log.trace '.*old.jsonl/t.json' is not writable: '.*old.jsonl' is not"):
        check_writable(str(tmp_path / "old.jsonl" / "t.json"), "log.trace")
    assert sorted(os.listdir(tmp_path)) == ["old.jsonl"]


def test_metrics_are_appended_only_to_a_metrics_file(tmp_path):
    check_metrics_file(str(tmp_path / "new.jsonl"))
    (tmp_path / "empty.jsonl").write_text("")
    check_metrics_file(str(tmp_path / "empty.jsonl"))
    (tmp_path / "run.jsonl").write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "loss": 0.9}\n')
    check_metrics_file(str(tmp_path / "run.jsonl"))          # an earlier run's: continued
    write_weights(tmp_path / "w.h5", initial_arrays(SPECS, [0, 1, 2], seed=3, dtype="float32"), n_layers=3)
    (tmp_path / "notes.txt").write_text("my notes\n")
    (tmp_path / "list.json").write_text("[1, 2]\n")
    for name in ("w.h5", "notes.txt", "list.json"):
        before = (tmp_path / name).read_bytes()
        with pytest.raises(ConfigError, match=f"log.metrics '.*{name}' exists and is not a metrics file"):
            check_metrics_file(str(tmp_path / name))
        assert (tmp_path / name).read_bytes() == before


def test_plan_refuses_bad_log_paths_before_anything_is_written(tmp_path):
    with pytest.raises(ConfigError, match="log.metrics .* does not exist"):
        prepare(from_dict({"parallel": {"pp": 1}, "log": {"metrics": str(tmp_path / "a" / "m.jsonl")}}), 1)
    with pytest.raises(ConfigError, match="log.trace .* is a directory"):
        prepare(from_dict({"parallel": {"pp": 1}, "log": {"trace": str(tmp_path)}}), 1)
    assert os.listdir(tmp_path) == []


# -- command line: rank 0 speaks ------------------------------------------------------------------------

def _parser():
    parser = CommandParser(prog="python -m hpcpipe.x")
    parser.add_argument("--config")
    return parser


@pytest.mark.parametrize("variable", ["PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"])
def test_only_rank_0_prints_usage_errors_but_every_rank_exits_2(monkeypatch, capsys, variable):
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, "3")
    assert launcher_rank() == 3
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["--bogus"])
    assert exc.value.code == 2
    assert capsys.readouterr() == ("", "")
    monkeypatch.setenv(variable, "0")
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["--bogus"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("usage:") == 1
    assert "hpcpipe: error: unrecognized arguments: --bogus (see python -m hpcpipe.x --help)" in err


def test_help_on_rank_0_only(monkeypatch, capsys):
    monkeypatch.setenv("PMI_RANK", "1")
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["--help"])
    assert exc.value.code == 0 and capsys.readouterr().out == ""
    monkeypatch.setenv("PMI_RANK", "0")
    with pytest.raises(SystemExit):
        _parser().parse_args(["--help"])
    assert capsys.readouterr().out.count("usage:") == 1


# -- stop handlers before the slow imports -----------------------------------------------------------------

def test_importing_train_loads_neither_numpy_nor_mpi():
    code = ("import sys, hpcpipe.train; "
            "print(sorted(m for m in ('numpy', 'mpi4py', 'h5py') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_python_m_train_installs_handlers_before_numpy_and_mpi_load():
    # run hpcpipe.train as __main__ (what python -m does) with an import hook that sends SIGUSR1 to
    # the process when NumPy or mpi4py start loading: it must be recorded, not kill the process
    code = """
import os, runpy, signal, sys, time
class Hook:
    def find_spec(self, name, path=None, target=None):
        if name in ("numpy", "mpi4py"):
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.05)
            print("recorded", repr(signal.getsignal(signal.SIGUSR1).__self__.name), "while importing", name, flush=True)
            raise SystemExit(9)
sys.meta_path.insert(0, Hook())
sys.argv = ["hpcpipe.train", "--set", "parallel.pp=1"]
runpy.run_module("hpcpipe.train", run_name="__main__", alter_sys=True)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 9, (proc.returncode, proc.stderr)
    assert "recorded 'SIGUSR1' while importing" in proc.stdout


# -- simulate --plot without matplotlib --------------------------------------------------------------------

def test_simulate_plot_without_matplotlib_fails_before_simulating(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from hpcpipe.simulate import main\n"
            "sys.exit(main(['--schedule', 'zb-h1', '--pp', '256', '--micro-batches', '2048', '--plot', sys.argv[1]]))")
    out = tmp_path / "t.png"
    proc = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 2
    assert proc.stdout == ""     # nothing simulated, nothing printed
    assert proc.stderr.count("error:") == 1 and "--plot needs matplotlib" in proc.stderr
    assert "pip install matplotlib" in proc.stderr
    assert not out.exists()


# -- examples/digits_to_hdf5.py ----------------------------------------------------------------------------

def test_the_digits_example_refuses_a_file_as_its_output_folder(tmp_path):
    # was a FileExistsError traceback (--out README.md)
    pytest.importorskip("sklearn")
    kept = tmp_path / "notes.txt"
    kept.write_text("keep me")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "digits_to_hdf5.py"), "--out", str(kept)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and "exists and is not a directory" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and kept.read_text() == "keep me"


def test_the_digits_example_replaces_only_its_own_output(tmp_path):
    # was: a file of the user's named data/digits-train.h5 replaced without a word
    pytest.importorskip("sklearn")
    out = tmp_path / "data"
    out.mkdir()
    (out / "digits-train.h5").write_text("my own data")
    argv = [sys.executable, str(ROOT / "examples" / "digits_to_hdf5.py"), "--out", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and f"{out / 'digits-train.h5'} exist(s) and were not written by this example" \
        in proc.stderr, proc.stderr
    assert (out / "digits-train.h5").read_text() == "my own data" and not (out / "digits-test.h5").exists()
    (out / "digits-train.h5").unlink()
    for _ in range(2):                                   # its own earlier output is replaced: a rerun works
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 0, proc.stderr
    (out / "digits-test.h5").write_text("mine again")
    assert subprocess.run(argv + ["--force"], capture_output=True, text=True, timeout=120).returncode == 0


def test_a_training_set_smaller_than_one_global_batch_is_warned_about(tmp_path):
    # was silent: 1437 digits at micro_batch_size 200 repeated samples in every batch
    from support.launch import train
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        f["x"], f["y"] = np.ones((10, 4), np.float32), np.zeros(10, np.int64)
    config = {"model": {"dims": [4, 4, 3]}, "parallel": {"pp": 2}, "train": {"steps": 1, "loss": "cross_entropy",
              "micro_batches": 2, "micro_batch_size": 8}, "checkpoint": {"dir": ""}, "log": {"progress": False},
              "data": {"path": str(path)}}
    proc = train(2, config)
    assert proc.returncode == 0, proc.stderr
    assert (f"hpcpipe: warning: data.path {str(path)!r} holds 10 samples, fewer than one global batch (dp x "
            f"train.micro_batches x train.micro_batch_size = 1 x 2 x 8 = 16): every step repeats samples within its "
            f"batch") in proc.stderr.splitlines()
    config["train"]["micro_batch_size"] = 5                    # exactly the file: no warning
    proc = train(2, config)
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr


def test_cupy_without_a_gpu_is_one_line_from_rank_0(tmp_path):
    # was every rank's '[rank N] error: ConfigError: ...' line and MPI_Abort, from inside the Trainer
    from support.launch import one_error, train

    from hpcpipe.runtime.backend import _gpu_count
    if _gpu_count():
        pytest.skip("CuPy sees a GPU here: run.backend = cupy is valid")
    proc = train(2, {"parallel": {"pp": 2}, "train": {"steps": 1}, "checkpoint": {"dir": ""},
                     "run": {"backend": "cupy"}})
    one_error(proc, 'run.backend = "cupy" but CuPy is not installed or sees no GPU', alone=True)


def test_a_set_value_the_shell_split_at_a_space_says_to_quote_it():
    # was "unrecognized arguments: 8]" alone
    proc = subprocess.run([sys.executable, "-m", "hpcpipe.train", "--print-config", "--set", "model.dims=[8,",
                           "8]"], capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == 2, proc.stderr
    assert ("hpcpipe: error: unrecognized arguments: 8]; the shell split a value at its spaces: quote it whole, "
            "--set 'model.dims=[8, 8]' (see python -m hpcpipe.train --help)") in proc.stderr.splitlines()


def test_a_run_of_zero_steps_reports_no_loss_not_nan():
    # was "trained 0 steps, loss nan -> nan": a diverged run's look for a run that did nothing
    from support.launch import train
    proc = train(2, {"parallel": {"pp": 2}, "train": {"steps": 0}, "checkpoint": {"dir": ""},
                     "log": {"progress": False}})
    assert proc.returncode == 0, proc.stderr
    assert "hpcpipe: trained 0 steps, no loss (no step ran), 0 samples/s" in proc.stdout and "nan" not in proc.stdout


def test_zero_1_with_one_replica_is_warned_about():
    # was silent: ZeRO-1 over dp = 1 shards nothing
    from support.launch import train
    config = {"parallel": {"pp": 2}, "train": {"steps": 1, "zero": 1, "optimizer": "adam"},
              "checkpoint": {"dir": ""}, "log": {"progress": False}}
    proc = train(2, config)
    assert proc.returncode == 0, proc.stderr
    assert "hpcpipe: warning: train.zero = 1 with dp = 1: ZeRO-1 shards the optimizer state over data-parallel " \
           "replicas, and this layout has one" in proc.stderr, proc.stderr
    config["parallel"] = {"pp": 1}                         # dp = 2: nothing to say
    proc = train(2, config)
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr
