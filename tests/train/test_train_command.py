"""End-to-end runs of the real command: `mpiexec -n N python -m hpcpipe.train`."""

import json
import re
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
from support.launch import run_command


def _summary(stdout: str) -> tuple[float, float]:
    match = re.search(r"loss ([-\d.e+]+) -> ([-\d.e+]+)", stdout)
    assert match, stdout
    return float(match.group(1)), float(match.group(2))


def test_default_job_on_8_ranks_trains_and_writes_metrics(tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = run_command(8, "hpcpipe.train", ["--set", f"log.metrics=\"{metrics}\""], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    first, last = _summary(proc.stdout)
    assert last < 0.9 * first
    assert "dp=2 pp=4 schedule=gpipe" in proc.stdout
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(100))
    assert records[0]["loss"] == pytest.approx(first, rel=1e-5)
    for key in ("loss", "step_time_s", "samples_per_s"):
        assert all(isinstance(r[key], float) and r[key] >= 0 for r in records)
    # GPipe stashes every micro-batch on every stage
    assert records[-1]["peak_stashed_microbatches"] == 8


def test_metrics_every_n_steps_keep_the_first_and_the_last_step(tmp_path):
    metrics = tmp_path / "m.jsonl"
    args = ["--set", "model.dims=[16, 16, 16, 16, 16]", "--set", "parallel.pp=2", "--set", "train.steps=10",
            "--set", "log.every=4", "--set", f"log.metrics=\"{metrics}\"", "--set", "checkpoint.dir=\"\""]
    proc = run_command(2, "hpcpipe.train", args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 4, 8, 9]      # 0-based; the final step was once never written
    assert all("peak_rss_bytes" in r for r in records)
    _, last = _summary(proc.stdout)
    assert records[-1]["loss"] == pytest.approx(last, rel=1e-5)


def _peak_rss_run(tmp_path, name: str, dims: list[int]) -> tuple[list[dict], str]:
    """Train 3 steps of an MLP with dims at dp=1 x pp=2 with Adam; return its metrics records and stdout."""
    metrics = tmp_path / f"{name}.jsonl"
    args = ["--set", f"model.dims={dims}", "--set", "parallel.pp=2", "--set", "train.steps=3",
            "--set", "train.optimizer=\"adam\"", "--set", f"log.metrics=\"{metrics}\"",
            "--set", "checkpoint.dir=\"\"", "--set", "log.progress=false"]
    proc = run_command(2, "hpcpipe.train", args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in metrics.read_text().splitlines()], proc.stdout


def test_metrics_and_summary_carry_every_ranks_peak_rss(tmp_path):
    tiny, tiny_out = _peak_rss_run(tmp_path, "tiny", [16] * 5)
    # 4 Linear layers of 2048 x 2048 float32: per rank 2 x 16 MiB of weights, as much of gradients and
    # twice that of Adam moments: at least 128 MiB more than the tiny model
    big, big_out = _peak_rss_run(tmp_path, "big", [2048] * 5)
    for records in (tiny, big):
        assert [r["step"] for r in records] == [0, 1, 2]
        for r in records:
            by_rank = r["peak_rss_bytes_by_rank"]
            assert len(by_rank) == 2 and all(isinstance(v, int) for v in by_rank)
            assert isinstance(r["peak_rss_bytes"], int) and r["peak_rss_bytes"] == max(by_rank)
            assert 20e6 < r["peak_rss_bytes"] < 4e9
        # a peak never goes down
        assert records[0]["peak_rss_bytes"] <= records[-1]["peak_rss_bytes"]
    assert big[-1]["peak_rss_bytes"] > tiny[-1]["peak_rss_bytes"] + 100 * 2**20
    for records, out in ((tiny, tiny_out), (big, big_out)):
        match = re.search(r"s\), peak RSS (\d+) MiB per rank \(max\)$", out, re.M)
        assert match, out
        # the summary's value is taken after the last step: at least the last logged peak
        assert int(match.group(1)) >= records[-1]["peak_rss_bytes"] // 2**20


@pytest.mark.parametrize("optimizer,extra", [("sgd", ["train.momentum=0.9", "train.weight_decay=1e-4"]),
                                             ("adam", []), ("adamw", ["train.weight_decay=0.01"])])
def test_every_optimizer_lowers_the_loss(tmp_path, optimizer, extra):
    args = ["--set", f"train.optimizer=\"{optimizer}\"", "--set", "train.lr=0.01", "--set", "train.steps=40",
            "--set", "train.grad_clip=1.0", "--set", "log.progress=false", "--set", "parallel.pp=2"]
    for item in extra:
        args += ["--set", item]
    proc = run_command(4, "hpcpipe.train", args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    first, last = _summary(proc.stdout)
    assert last < 0.8 * first


def test_help_lists_the_options():
    proc = subprocess.run([sys.executable, "-m", "hpcpipe.train", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    assert "--config FILE" in proc.stdout and "--set SECTION.KEY=VALUE" in proc.stdout


def _bad_data(tmp_path):
    path = tmp_path / "bad.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.zeros((10, 8), np.float32)
        f["y"] = np.zeros((10, 16), np.float32)
    return str(path)


@pytest.mark.parametrize("n,args,message", [
    (2, ["--set", "train.stepz=1"], "unknown key train.stepz"),
    (2, ["--set", "train.steps=\"x\""], "train.steps must be int, got 'x' (str)"),
    (2, ["--set", "parallel.pp=8"],
     "parallel.pp (8) x parallel.virtual_stages (1) exceeds the number of layers (4) in model.dims "
     "[16, 16, 16, 16, 16]"),
    (6, [], "world size 6 is not divisible by parallel.pp (4)"),
    (6, ["--set", "parallel.dp=2"], "world size 6 does not equal parallel.dp (2) x parallel.pp (4) = 8"),
    (2, ["--set", "parallel.pp=2", "--set", "data.path=\"/nonexistent/d.h5\""],
     "data.path '/nonexistent/d.h5' does not exist"),
    (2, ["--set", "parallel.pp=2", "--set", "data.path=\"/tmp\""], "data.path '/tmp' is a directory, not an HDF5 file"),
    (2, ["--set", "parallel.pp=2", "--set", "data.path=\"BAD\""],
     "dataset 'x' in 'BAD' has shape (10, 8); model.dims[0] = 16 needs (N, 16)"),
    (2, ["--config", "/nonexistent/c.toml"], "config file '/nonexistent/c.toml' does not exist"),
    (2, ["--set", "parallel.pp=2", "--set", "model.init=\"/nonexistent/w.h5\""],
     "model.init '/nonexistent/w.h5' does not exist (give a weights file, a checkpoint directory or a Hugging Face "
     "model directory)"),
    (2, ["--set", "parallel.pp=2", "--set", "checkpoint.dir=\"nock\"", "--resume"],
     "checkpoint.dir 'nock' does not exist: nothing to resume (without --resume a fresh run starts there)"),
])
def test_bad_input_gives_one_clear_message_and_exit_2(tmp_path, n, args, message):
    bad = _bad_data(tmp_path)
    args = [a.replace("BAD", bad) for a in args]
    message = message.replace("BAD", bad)
    start = time.monotonic()
    proc = run_command(n, "hpcpipe.train", args, cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("hpcpipe: error:") == 1, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - start < 30


def test_exception_on_one_rank_ends_the_whole_job_fast(tmp_path):
    # the clock starts when the failing rank reports its exception (start-up time under load does not count)
    import os
    import threading

    from support import launchers
    args = [*launchers.prefix(8), sys.executable, "-m", "hpcpipe.train", "--set", "train.steps=100000",
            "--set", "log.progress=false", "--set", "checkpoint.dir=\"\""]
    env = dict(os.environ, HPCPIPE_FAULT="rank=5,step=3", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    seen: dict[str, float] = {}
    lines: list[str] = []

    def read():
        for line in proc.stderr:
            lines.append(line)
            if "injected fault" in line and "fault" not in seen:
                seen["fault"] = time.monotonic()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    ended = time.monotonic()
    reader.join(timeout=10)
    stderr = "".join(lines)
    assert proc.returncode != 0
    assert "fault" in seen, f"exit {proc.returncode}, stderr:\n{stderr}"
    assert ended - seen["fault"] < 30, f"job took {ended - seen['fault']:.1f} s to end after the fault"
    assert "[dp01-pp01] error: RuntimeError: injected fault" in stderr

# -- issue #11: start-up hardening, end to end (one message from rank 0, exit 2, nothing written) ----------

def _files(root):
    """Every file under root with its bytes (to show that a refused run changed nothing)."""
    import os
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                out[path] = f.read()
    return out


def _init_file(tmp_path, change):
    """A model.init file for dims [16]*3 (pp=2) with one dataset changed by change(h5py.File)."""
    from hpcpipe.config import from_dict
    from hpcpipe.nn.mlp.model import initial_arrays, layer_specs
    from hpcpipe.state.weights import write_weights
    specs = layer_specs(from_dict({"model": {"dims": [16, 16, 16]}, "parallel": {"pp": 2}}))
    path = tmp_path / "w.h5"
    write_weights(path, initial_arrays(specs, [0, 1], 0, "float32"), n_layers=2)
    with h5py.File(path, "r+") as f:
        change(f)
    return str(path)


def _nan_weights(f):
    w = f["layers/0001/weight"][...]
    w[2, 3:6] = [np.nan, np.inf, np.nan]
    f["layers/0001/weight"][...] = w


def _bias_group(f):
    del f["layers/0000/bias"]
    f.create_group("layers/0000/bias")


def _bias_bytes(f):
    del f["layers/0000/bias"]
    f["layers/0000/bias"] = np.bytes_(b"not numbers")


INIT = ["--set", "model.dims=[16, 16, 16]", "--set", "parallel.pp=2", "--set", "model.init=\"INIT\""]


@pytest.mark.parametrize("n,args,change,message", [
    (2, ["--config", "DIR"], None, "config file 'DIR' is a directory, not a TOML file"),
    (2, ["--config", "LATIN1"], None, "config file 'LATIN1' is not UTF-8 text (byte 20: b'\\xe9')"),
    (2, ["--set", "train.lr=inf"], None, "train.lr must be a finite number, got inf"),
    (2, ["--set", "train.weight_decay=inf"], None, "train.weight_decay must be a finite number, got inf"),
    (2, ["--set", "parallel.pp=2", "--set", "log.metrics=\"nodir/m.jsonl\""], None,
     "log.metrics directory 'nodir' does not exist (for log.metrics 'nodir/m.jsonl')"),
    (2, ["--set", "parallel.pp=2", "--set", "log.metrics=\"LATIN1\""], None,
     "log.metrics 'LATIN1' exists and is not a metrics file (JSON lines)"),
    (2, ["--set", "parallel.pp=2", "--set", "log.trace=\"DIR\""], None,
     "log.trace 'DIR' is a directory"),
    (2, ["--set", "parallel.pp=2", "--set", "log.trace=\"LATIN1\""], None,
     "log.trace 'LATIN1' already exists and is not a file hpcpipe wrote as a trace"),
    (2, ["--set", "model.dims=[16, 1e9, 16]"], None, "model.dims must be list[int], got [16, 1000000000.0, 16]"),
    (2, ["--set", "model.dims=[16, 1000000000, 16]", "--set", "parallel.pp=2"], None,
     "the model needs about "),
    (8, INIT[:2] + ["--set", "parallel.dp=4"] + INIT[2:], _nan_weights,
     "model.init: weights file 'INIT': layers/0001/weight holds 3 non-finite value(s) (NaN or Inf) of 256"),
    (2, INIT, _bias_group, "weights file 'INIT': layers/0000/bias is a group, not a dataset"),
    (2, INIT, _bias_bytes, "weights file 'INIT': layers/0000/bias holds |S11 values, not real floating-point numbers"),
])
def test_startup_attacks_end_in_one_message_exit_2_before_step_0(tmp_path, n, args, change, message):
    (tmp_path / "cfgdir").mkdir()
    (tmp_path / "latin1.toml").write_bytes("[train]\nsteps = 3 # \xe9t\xe9\n".encode("latin-1"))
    init = _init_file(tmp_path, change) if change else ""
    subst = {"DIR": "cfgdir", "LATIN1": "latin1.toml", "INIT": init}
    for key, value in subst.items():
        args = [a.replace(key, value) for a in args]
    message = message.replace("'DIR'", "'cfgdir'").replace("LATIN1", "latin1.toml").replace("INIT", init)
    before = _files(tmp_path)
    proc = run_command(n, "hpcpipe.train", args, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("hpcpipe: error:") == 1, proc.stderr
    assert message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "BAD TERMINATION" not in proc.stdout + proc.stderr
    assert "step 1/" not in proc.stdout                  # refused before step 0
    assert _files(tmp_path) == before                    # nothing created (no checkpoints/), inputs intact


@pytest.mark.parametrize("module", ["hpcpipe.train", "hpcpipe.infer"])
def test_usage_error_and_help_are_printed_once_on_8_ranks(tmp_path, module):
    required = ["--weights", "w.h5", "--input", "in.h5", "--output", "out.h5"] if module.endswith("infer") else []
    proc = run_command(8, module, required + ["--bogus"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("usage:") == 1, proc.stderr
    assert proc.stderr.count("hpcpipe: error: unrecognized arguments: --bogus") == 1, proc.stderr
    assert "BAD TERMINATION" not in proc.stdout + proc.stderr
    helped = run_command(8, module, ["--help"], cwd=tmp_path, timeout=120)
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.count("usage:") == 1 and helped.stderr == ""
    assert list(tmp_path.iterdir()) == []


def test_the_progress_line_has_the_elapsed_time_and_an_eta(tmp_path):
    """Issue #32: the line kept its format and gained `elapsed M:SS ETA M:SS` (this run's steps)."""
    args = ["--set", "model.dims=[8, 8, 8, 8]", "--set", "parallel.pp=2", "--set", "train.steps=4",
            "--set", "log.progress=true", "--set", "checkpoint.dir=\"\""]
    proc = run_command(2, "hpcpipe.train", args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    assert len(lines) == 4 and "\r" not in proc.stdout
    pattern = (r"\[#*\s*\] step (\d)/4 loss [-\d.e+]+ [\d.]+ ms/step \d+ samples/s elapsed \d+:\d\d "
               r"ETA \d+:\d\d$")
    assert [int(re.match(pattern, line).group(1)) for line in lines] == [1, 2, 3, 4], lines
    assert lines[-1].endswith("ETA 0:00")


def _alone_env() -> dict:
    """This environment without what a launcher sets: the process is a singleton, as without mpiexec."""
    import os

    launched = ("PMI_", "OMPI_", "PMIX_", "SLURM_", "MPI_LOCAL", "HYDRA_")
    return {k: v for k, v in os.environ.items() if not k.startswith(launched)}


@pytest.mark.parametrize("args,hint", [
    ([], "run it under mpiexec -n 4 python -m hpcpipe.train"),
    (["--set", "parallel.dp=2", "--set", "train.steps=3"],
     "run it under mpiexec -n 8 python -m hpcpipe.train --set parallel.dp=2 --set train.steps=3"),
])
def test_started_without_mpiexec_the_error_says_how_to_launch(tmp_path, args, hint):
    """Issue #32: `python -m hpcpipe.train` alone on a layout of several ranks hints at mpiexec, in one line."""
    proc = subprocess.run([sys.executable, "-m", "hpcpipe.train", *args], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path, env=_alone_env())
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpcpipe: error: this process runs alone (started without "
                                                   "mpiexec, world size 1)") and lines[0].endswith(hint), lines
    assert list(tmp_path.iterdir()) == []
