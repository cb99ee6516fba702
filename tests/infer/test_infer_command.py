"""End-to-end runs of the real command: `mpiexec -n N python -m hpcpipe.infer`.

Seed example 8 on 4 and 8 ranks, the report and the trace, every error of
the issue with its exit status and message, and nothing (half-)written at
the output path when it fails.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from support.launch import one_error, run_command
from support.state import flip_byte_in_dataset, small_tmpfs
from support.training import seed_draws

from hpcpipe.state.weights import write_weights

pytestmark = pytest.mark.slow

SEED8_MODEL = {"dims": [16] * 5, "bias": False, "activation": "relu", "final_activation": True}


@pytest.fixture
def seed8(tmp_path):
    """Seed example 8's weights (with its model stored) and inputs as files: (weights, input, reference)."""
    w, _, x, _ = seed_draws(micro_batches=8, bias=False)
    weights, data = tmp_path / "w.h5", tmp_path / "in.h5"
    write_weights(weights, {i: {"weight": w[i]} for i in range(4)}, n_layers=4, model_config=SEED8_MODEL)
    with h5py.File(data, "w") as f:
        f["x"] = x.reshape(-1, 16)
    ref = x.reshape(-1, 16)
    for s in range(4):
        ref = np.maximum(ref @ w[s], 0)
    return weights, data, ref


def _args(weights, data, out, *more):
    return ["--weights", str(weights), "--input", str(data), "--output", str(out), *map(str, more)]


@pytest.mark.parametrize("n", [4, 8])
def test_seed_example8_command(tmp_path, seed8, n):
    weights, data, ref = seed8
    out, trace, report = tmp_path / "out.h5", tmp_path / "trace.json", tmp_path / "report.json"
    proc = run_command(n, "hpcpipe.infer", _args(weights, data, out, "--set", "infer.micro_batch_size=4",
                                                 "--trace", trace, "--report", report), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]       # which MPI the job ran on, before anything else
    assert first.startswith("hpcpipe: MPI: ") and "(libmpi at /" in first and first.endswith(f", {n} ranks"), first
    with h5py.File(out, "r") as f:
        y = f["y"][...]
        assert f.attrs["weights"] == str(weights)
    assert (f"{y.min():.4f}", f"{y.max():.4f}") == ("0.0000", "417.7554")
    assert np.max(np.abs(y - ref)) < 1e-4
    dp = n // 4
    assert "inferred 32 rows" in proc.stdout and f"(dp={dp} pp=4, 8 micro-batches of 4)" in proc.stdout
    for field in ("rows/s", "latency p50", "p99", "fill", "drain", "bubble"):
        assert field in proc.stdout
    r = json.loads(report.read_text())
    assert r["rows"] == 32 and r["micro_batches_per_replica"] == 8 // dp
    assert r["ideal_bubble"] == pytest.approx(3 / (8 // dp + 3))
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["tid"] for e in events if e["ph"] == "M"} == set(range(n))
    assert len([e for e in events if e.get("cat") == "compute"]) == 8 * 4
    assert sorted(os.listdir(tmp_path)) == ["in.h5", "out.h5", "report.json", "trace.json", "w.h5"]


def _no_output(tmp_path, out):
    assert not Path(out).exists()
    assert not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]


def _wide_input(tmp_path):
    path = tmp_path / "wide.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.zeros((8, 12), np.float32)
    return path


def _other_dataset(tmp_path):
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as f:
        f["inputs"] = np.zeros((8, 16), np.float32)
    return path


def _bare_weights(tmp_path):
    """Seed weights written without a stored model config: the config decides the model."""
    w, _, _, _ = seed_draws(micro_batches=8, bias=False)
    path = tmp_path / "bare.h5"
    write_weights(path, {i: {"weight": w[i]} for i in range(4)}, n_layers=4)
    return path


def _gpt_weights(tmp_path):
    """A GPT's weights file (model.kind = "gpt"): batch inference refuses it."""
    from hpcpipe.nn.gpt.model import GPTModel
    from hpcpipe.nn.gpt.shape import GPTShape
    shape = GPTShape(vocab=16, seq_len=16, d_model=8, n_heads=2, n_blocks=2)
    model = {"kind": "gpt", "vocab_size": 16, "seq_len": 16, "d_model": 8, "n_heads": 2, "n_blocks": 2, "d_ff": 0,
             "tie_embeddings": True, "dtype": "float32"}
    path = tmp_path / "gpt.h5"
    write_weights(path, {i: GPTModel(shape).init_group(i, 0) for i in range(4)}, n_layers=4, model_config=model)
    return path


CASES = {
    "GPT weights": (lambda t, w: (_gpt_weights(t), t / "in.h5", t / "out.h5", []),
                    "hpcpipe: error: --weights '{weights}' holds a GPT model (model.kind = \"gpt\", 4 layer groups): "
                    "batch inference (python -m hpcpipe.infer) covers MLP models; text generation is "
                    "python -m hpcpipe.generate (one prompt) or python -m hpcpipe.serve (HTTP)"),
    "input width": (lambda t, w: (w, _wide_input(t), t / "out.h5", []),
                    "dataset 'x' in '{input}' has shape (8, 12); model.dims[0] = 16 needs (N, 16)"),
    "missing dataset": (lambda t, w: (w, _other_dataset(t), t / "out.h5", []),
                        "input file '{input}' has no dataset 'x' (it has: ['inputs']); set infer.x to choose "
                        "another"),
    "missing input": (lambda t, w: (w, t / "nope.h5", t / "out.h5", []), "input file '{input}' does not exist"),
    "dims contradict the weights": (
        lambda t, w: (w, t / "in.h5", t / "out.h5", ["--set", "model.dims=[16, 16, 16, 16, 8]"]),
        "model.dims = [16, 16, 16, 16, 8] in the configuration does not match weights file '{weights}', which was "
        "saved with model.dims = [16, 16, 16, 16, 16]"),
    "weights shapes": (
        lambda t, w: (_bare_weights(t), t / "in.h5", t / "out.h5",
                      ["--set", "model.bias=false", "--set", "model.dims=[16, 16, 16, 16, 8]"]),
        "weights file '{weights}': layers/0003/weight has shape (16, 16), the model needs (16, 8)"),
    "weights without bias": (
        lambda t, w: (_bare_weights(t), t / "in.h5", t / "out.h5", []),
        "weights file '{weights}': layer 0 holds ['weight'], the model needs ['bias', 'weight']"),
    "missing weights": (lambda t, w: (t / "none", t / "in.h5", t / "out.h5", []),
                        "--weights '{weights}' does not exist"),
    "output parent is a file": (lambda t, w: (w, t / "in.h5", t / "in.h5" / "out.h5", []),
                                "output path '{output}' is not writable: '{input}' is not a directory"),
    "output directory missing": (lambda t, w: (w, t / "in.h5", t / "no" / "out.h5", []),
                                 "output directory '{parent}' does not exist (for output '{output}')"),
    "output is a directory": (lambda t, w: (w, t / "in.h5", t, []), "output path '{output}' is a directory"),
    "tensor parallel": (lambda t, w: (w, t / "in.h5", t / "out.h5", ["--set", "parallel.tp=2", "--set",
                                                                     "parallel.pp=1"]),
                        "parallel.tp must be 1, got 2"),   # was "... x tp (1) = 1" from rank 0 and MPI_Abort
    "output folder refuses files": (lambda t, w: (w, t / "in.h5", Path("/proc/hpcpipe-out.h5"), []),
                                    "output path '{output}': cannot create a file in '/proc'"),   # root passed it
    "output is the input": (lambda t, w: (w, t / "in.h5", t / "in.h5", []), "output path '{output}' is the input file"),
    "trace directory missing": (lambda t, w: (w, t / "in.h5", t / "out.h5", ["--trace", t / "no" / "t.json"]),
                                "trace directory '{tmp}/no' does not exist (for trace '{tmp}/no/t.json')"),
    "report path is a directory": (lambda t, w: (w, t / "in.h5", t / "out.h5", ["--report", t]),
                                   "report path '{tmp}' is a directory"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_clear_message_exit_2_and_no_output(tmp_path, seed8, case):
    weights, _, _ = seed8
    make, template = CASES[case]
    w, data, out, more = make(tmp_path, weights)
    before = sorted(p.name for p in tmp_path.iterdir())
    proc = run_command(4, "hpcpipe.infer", _args(w, data, out, *more), cwd=tmp_path, timeout=60)
    line = one_error(proc)
    assert template.format(input=data, weights=w, output=out, parent=Path(out).parent, tmp=tmp_path) in line
    if not Path(out).is_dir() and out != data:
        _no_output(tmp_path, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into any directory")
def test_read_only_output_directory(tmp_path, seed8):
    weights, data, _ = seed8
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    proc = run_command(4, "hpcpipe.infer", _args(weights, data, locked / "out.h5"), cwd=tmp_path, timeout=60)
    assert f"output path '{locked / 'out.h5'}' is not writable: no write permission on '{locked}'" in one_error(proc)


def test_corrupt_weights_are_refused_by_all_ranks_and_the_old_output_is_kept(tmp_path, seed8):
    weights, data, _ = seed8
    out = tmp_path / "out.h5"
    with h5py.File(out, "w") as f:        # an earlier run's output, which a successful run would replace
        f.attrs["format"] = "hpcpipe-infer"
        f["y"] = np.arange(4.0)
    previous = out.read_bytes()
    flip_byte_in_dataset(weights, "layers/0002/weight")
    proc = run_command(4, "hpcpipe.infer", _args(weights, data, out), cwd=tmp_path, timeout=60)
    line = one_error(proc)
    assert f"weights file '{weights}': cannot read layers/0002 (corrupt:" in line
    assert out.read_bytes() == previous
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_only_an_earlier_infer_output_trace_or_report_is_replaced(tmp_path, seed8):
    weights, data, _ = seed8
    out, trace, report = tmp_path / "out.h5", tmp_path / "trace.json", tmp_path / "report.json"
    args = _args(weights, data, out, "--trace", trace, "--report", report)
    notes = tmp_path / "notes.txt"
    notes.write_text("someone's notes\n")
    # someone's notes at each path in turn, then someone's HDF5 dataset (not an inference output) at --output
    for source, path, what in ((notes, out, "output path"), (notes, trace, "trace path"),
                               (notes, report, "report path"), (_other_dataset(tmp_path), out, "output path")):
        os.link(source, path)
        before = path.read_bytes()
        proc = run_command(4, "hpcpipe.infer", args, cwd=tmp_path, timeout=60)
        assert f"{what} {str(path)!r} already exists and is not" in one_error(proc)
        assert path.read_bytes() == before
        path.unlink()
    first = run_command(4, "hpcpipe.infer", args, cwd=tmp_path, timeout=60)
    assert first.returncode == 0, first.stderr
    assert report.read_text().startswith('{"writer": "hpcpipe') and trace.read_text().startswith('{"writer": "hpcpipe')
    with h5py.File(out, "r+") as f:
        f["y"][0, 0] = -1.0                   # to see that the rerun wrote it anew
    again = run_command(4, "hpcpipe.infer", args, cwd=tmp_path, timeout=60)   # a rerun, e.g. a requeued job
    assert again.returncode == 0, again.stderr
    with h5py.File(out, "r") as f:
        assert f["y"][0, 0] != -1.0 and f.attrs["format"] == "hpcpipe-infer"
    assert json.loads(report.read_text())["rows"] == 32


def test_a_rank_failing_mid_stream_ends_the_job_fast_and_leaves_no_output(tmp_path, seed8):
    weights, data, _ = seed8
    out = tmp_path / "out.h5"
    start = time.monotonic()
    proc = run_command(4, "hpcpipe.infer", _args(weights, data, out, "--set", "infer.micro_batch_size=4"),
                       env={"HPCPIPE_FAULT": "rank=2,step=3"}, cwd=tmp_path, timeout=60)
    assert proc.returncode != 0
    assert time.monotonic() - start < 30
    assert "[dp00-pp02] error while streaming: RuntimeError: injected fault before micro-batch 3" in proc.stderr
    assert not out.exists()
    # the failing rank removes the preallocated temporary output before it aborts every rank (was left behind)
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_an_output_disk_too_small_is_one_error_before_any_row_and_leaves_nothing(tmp_path, seed8):
    weights, _, _ = seed8
    data = tmp_path / "big.h5"
    with h5py.File(data, "w") as f:
        f["x"] = np.ones((40_000, 16), np.float32)               # 2.4 MiB of float32 rows out
    with small_tmpfs(tmp_path / "full", "256k") as full:
        proc = run_command(4, "hpcpipe.infer", _args(weights, data, full / "out.h5"), cwd=tmp_path, timeout=60)
        assert proc.returncode == 2, proc.stderr                  # was: ENOSPC in a writer mid-stream, exit 1
        assert "cannot create output file" in one_error(proc) and "No space left on device" in proc.stderr
        assert list(full.iterdir()) == []                          # no temporary output fills the disk


def test_library_call_in_one_process_without_mpiexec(tmp_path, seed8):
    weights, data, ref = seed8
    out = tmp_path / "lib.h5"
    script = ("import json, sys\nfrom hpcpipe import infer\n"
              f"r = infer.run({str(weights)!r}, {str(data)!r}, {str(out)!r}, config={{'parallel': {{'pp': 1}}}},"
              " overrides=['infer.micro_batch_size=5'])\nprint(json.dumps(r))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (report["rows"], report["micro_batches"], report["dp"], report["pp"]) == (32, 7, 1, 1)
    with h5py.File(out, "r") as f:
        assert np.max(np.abs(f["y"][...] - ref)) < 1e-4


def test_help_lists_the_options():
    proc = subprocess.run([sys.executable, "-m", "hpcpipe.infer", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    for option in ("--weights PATH", "--input IN.h5", "--output OUT.h5", "--config FILE",
                   "--set SECTION.KEY=VALUE", "--trace FILE", "--report FILE"):
        assert option in proc.stdout


@pytest.fixture(scope="module")
def trained_checkpoint(tmp_path_factory):
    """A checkpoint root written by one training step of the default model (dims 16 x 5, like seed 8's input)."""
    base = tmp_path_factory.mktemp("ck")
    proc = run_command(4, "hpcpipe.train", ["--set", "train.steps=1", "--set", "log.progress=false",
                                            "--set", f"checkpoint.dir={json.dumps(str(base / 'ck'))}"], cwd=base)
    assert proc.returncode == 0, proc.stderr
    return base / "ck"


def _intact_checkpoint(root):
    from hpcpipe.checkpoint import verify
    return verify(root).step


def _clobber_cases(root):
    from hpcpipe.state.sources import resolve_weights
    step_dir = resolve_weights(root).path
    stage_file = min(step_dir.glob("*.h5"))
    return {   # weights given as, output path, words of the refusal
        "output is latest": (root, root / "latest",
                             f"is inside the checkpoint directory '{root}' that holds the weights"),
        "output is a stage file": (root, stage_file, "is inside the checkpoint directory"),
        "output is the manifest": (step_dir, step_dir / "manifest.json",
                                   f"is inside the checkpoint directory '{step_dir}' that holds the weights"),
        "output is a new file in the root": (root, root / "out.h5", f"checkpoint directory '{root}'"),
        "weights given as latest": (root / "latest", root / "out.h5", f"checkpoint directory '{root}'"),
        "output is the step directory's new file": (root, step_dir / "out.h5", f"checkpoint directory '{root}'"),
    }


@pytest.mark.parametrize("case", ["output is latest", "output is a stage file", "output is the manifest",
                                  "output is a new file in the root", "weights given as latest",
                                  "output is the step directory's new file"])
def test_output_inside_the_checkpoint_is_refused_and_the_checkpoint_kept(tmp_path, seed8, trained_checkpoint, case):
    _, data, _ = seed8
    weights, out, words = _clobber_cases(trained_checkpoint)[case]
    before = {p: p.stat().st_mtime_ns for p in trained_checkpoint.rglob("*")}
    proc = run_command(4, "hpcpipe.infer", _args(weights, data, out), cwd=tmp_path, timeout=60)
    line = one_error(proc)
    assert f"output path '{out}' " in line and words in line and "choose a path outside it" in line
    assert {p: p.stat().st_mtime_ns for p in trained_checkpoint.rglob("*")} == before
    assert _intact_checkpoint(trained_checkpoint) == 1


@pytest.mark.parametrize("how", ["same path", "symlink", "hard link", "trace", "report"])
def test_output_that_is_the_weights_file_is_refused_and_the_weights_still_load(tmp_path, seed8, how):
    from hpcpipe.state.sources import resolve_weights
    weights, data, _ = seed8
    out = {"same path": weights, "symlink": tmp_path / "link.h5", "hard link": tmp_path / "hard.h5"}.get(
        how, tmp_path / "out.h5")
    if how == "symlink":
        out.symlink_to(weights)
    elif how == "hard link":
        os.link(weights, out)
    more = {"trace": ["--trace", weights], "report": ["--report", weights]}.get(how, [])
    content = weights.read_bytes()
    proc = run_command(4, "hpcpipe.infer", _args(weights, data, out, *more), cwd=tmp_path, timeout=60)
    line = one_error(proc)
    what = {"trace": "trace path", "report": "report path"}.get(how, "output path")
    written = weights if how in ("trace", "report") else out
    assert f"{what} '{written}' is the weights file '{weights}'; writing there would destroy it" in line
    assert weights.read_bytes() == content
    assert resolve_weights(weights).read([0, 1, 2, 3])[3]["weight"].shape == (16, 16)
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_trace_or_report_on_the_output_or_input_is_refused(tmp_path, seed8):
    weights, data, _ = seed8
    out = tmp_path / "out.h5"
    proc = run_command(4, "hpcpipe.infer", _args(weights, data, out, "--trace", out), cwd=tmp_path, timeout=60)
    assert f"trace path '{out}' is the output file '{out}'; writing there would destroy it" in one_error(proc)
    proc = run_command(4, "hpcpipe.infer", _args(weights, data, out, "--report", data), cwd=tmp_path, timeout=60)
    assert f"report path '{data}' is the input file" in one_error(proc)
    _no_output(tmp_path, out)


def test_huge_micro_batch_size_on_a_small_input_runs_in_small_memory(tmp_path, seed8):
    """infer.micro_batch_size = 5e6 over 32 rows: one micro-batch of 32 rows, buffers of 32 rows (was GBs)."""
    weights, data, ref = seed8
    out = tmp_path / "out.h5"
    proc = run_command(4, "hpcpipe.infer", _args(weights, data, out, "--set", "infer.micro_batch_size=5000000"),
                       cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "inferred 32 rows" in proc.stdout and "1 micro-batches of 5000000" in proc.stdout
    with h5py.File(out, "r") as f:
        assert np.max(np.abs(f["y"][...] - ref)) < 1e-4
