"""End-to-end runs of `python -m hpcpipe.plan` (real profiling, the real MPI probe) and of the configs it writes."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
from support import ROOT
from support.launch import run_command

from hpcpipe.profiles.check import profile_problem

ROOT_CONFIGS = ROOT / "configs"

MLP = """
[model]
dims = [64, 64, 64, 64, 64]
[parallel]
pp = 2
[train]
steps = 3
micro_batches = 4
micro_batch_size = 8
[checkpoint]
dir = ""
[log]
progress = false
"""

GPT = """
[model]
kind = "gpt"
vocab_size = 4096
seq_len = 8
d_model = 32
n_heads = 2
n_blocks = 2
tie_embeddings = false
[parallel]
pp = 2
[train]
steps = 2
micro_batches = 2
micro_batch_size = 4
optimizer = "adam"
[data]
synthetic_samples = 64
[checkpoint]
dir = ""
[log]
progress = false
"""


def _plan(args, profile_dir, cwd, timeout=240):
    env = {"HPCPIPE_PROFILE_DIR": str(profile_dir), "PYTHONUNBUFFERED": "1"}
    import os
    return subprocess.run([sys.executable, "-m", "hpcpipe.plan", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env={**os.environ, **env})


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """One measured plan of a small MLP on 2 ranks (the profile is shared by the tests below)."""
    tmp = tmp_path_factory.mktemp("plan")
    (tmp / "mlp.toml").write_text(MLP)
    proc = _plan(["--config", "mlp.toml", "--ranks", "2", "--write", "best.toml", "--json", "plans.json",
                  "--max-micro-batches", "8"], tmp / "profiles", tmp)
    return tmp, proc


def test_plan_measures_prints_and_writes_the_best(planned):
    tmp, proc = planned
    assert proc.returncode == 0, proc.stderr
    assert "profile: measured" in proc.stdout and "within the budget" in proc.stdout
    assert "best: " in proc.stdout and "wrote best.toml" in proc.stdout
    header = (tmp / "best.toml").read_text().splitlines()[0]
    assert header.startswith("# written by python -m hpcpipe.plan --config mlp.toml --ranks 2 --write best.toml")
    doc = json.loads((tmp / "plans.json").read_text())
    plans = doc["plans"]
    assert doc["ranks"] == 2 and doc["global_batch"] == 4 * 8      # pp = 2 on 2 ranks: dp = 1
    times = [p["step_time_s"] for p in plans]
    assert times == sorted(times) and all(t > 0 for t in times)
    assert all(p["dp"] * p["micro_batches"] * p["micro_batch_size"] == doc["global_batch"] for p in plans)
    assert all(p["peak_bytes_per_rank"] <= doc["budget_bytes"] for p in plans)
    assert {(p["dp"], p["pp"], p["tp"]) for p in plans} == {(1, 2, 1), (2, 1, 1), (1, 1, 2)}
    assert list((tmp / "profiles").glob("layers-*.json")) and list((tmp / "profiles").glob("comm-*.json"))


def test_the_profile_is_calibrated_against_real_runs_of_the_engine(planned):
    tmp, proc = planned
    engine = json.loads(next((tmp / "profiles").glob("layers-*.json")).read_text())["engine"]
    assert "failed" not in engine, engine
    replicas, pipeline, zero_bubble = engine["replicas"], engine["pipeline"], engine["pipeline_zb"]
    assert engine["ranks"] == 2 and replicas["stage_layers"] == [4] and sum(pipeline["stage_layers"]) == 4
    assert zero_bubble["stage_layers"] == pipeline["stage_layers"]        # the same cut under ZB-H1
    for run in (replicas, pipeline, zero_bubble):
        # 4 layer groups, one factor each, from the measured seconds per micro-batch of each stage
        assert len(run["forward"]) == len(run["backward"]) == 4
        assert all(0.5 <= f <= 2.0 for f in run["forward"] + run["backward"])
        assert len(run["forward_s"]) == len(run["stage_layers"]) and all(t > 0 for t in run["forward_s"])
    assert 0.0 <= replicas["sync_share"] <= 0.5
    assert "engine over bench, replicas (cut [4])" in proc.stderr


def test_second_plan_reads_the_cache(planned):
    tmp, _ = planned
    proc = _plan(["--config", "mlp.toml", "--ranks", "2", "--max-micro-batches", "8"], tmp / "profiles", tmp)
    assert proc.returncode == 0, proc.stderr
    assert "profile: cached" in proc.stdout
    assert "profiling" not in proc.stderr


def test_emulated_nodes_on_this_host_plan_with_the_profile_of_ranks_side_by_side(planned, tmp_path):
    # 2 nodes x 1 rank in network namespaces of this host: both ranks still share its cores and memory, so the
    # plan takes the profile measured with 2 ranks side by side (the one-node plan's, cached), not one alone
    tmp, _ = planned
    sizes = [4096, 65536, 1 << 20, 16 << 20]
    probe = {"p2p": [[n, 2e-5 + n / 1e9] for n in sizes], "allreduce": [[n, 4e-5 + 2 * n / 1e9] for n in sizes],
             "baseline_rss_bytes": 70_000_000, "mpi": "hpcpipe: MPI: test", "ranks": 2}
    (tmp_path / "probe.json").write_text(json.dumps(probe))
    (tmp_path / "mlp.toml").write_text(MLP)
    shutil.copytree(tmp / "profiles", tmp_path / "profiles")
    proc = _plan(["--config", "mlp.toml", "--ranks", "2", "--nodes", "2", "--network", "probe.json", "--host-shared",
                  "--max-micro-batches", "8"], tmp_path / "profiles", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "profile: cached" in proc.stdout and "2 rank(s) side by side" in proc.stdout, proc.stdout
    assert "between nodes (2 x 1 ranks" in proc.stdout


def test_a_damaged_cached_profile_is_measured_again(planned, tmp_path):
    tmp, _ = planned
    shutil.copytree(tmp / "profiles", tmp_path / "profiles")
    layers = next((tmp_path / "profiles").glob("layers-*.json"))
    data = json.loads(layers.read_text())
    data["layers"]["groups"] = {}                      # parses, right key, nothing inside: once a traceback
    layers.write_text(json.dumps(data))
    (tmp_path / "mlp.toml").write_text(MLP)
    proc = _plan(["--config", "mlp.toml", "--ranks", "2", "--max-micro-batches", "8"], tmp_path / "profiles", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "is damaged: it holds no layer groups: measuring it again" in proc.stderr and "Traceback" not in proc.stderr
    assert profile_problem(json.loads(layers.read_text())) is None


def test_written_config_trains_as_planned(planned):
    tmp, _ = planned
    best = json.loads((tmp / "plans.json").read_text())["plans"][0]
    proc = run_command(2, "hpcpipe.train", ["--config", "best.toml"], cwd=tmp)
    assert proc.returncode == 0, proc.stderr
    tp = f" tp={best['tp']}" if best["tp"] > 1 else ""
    assert f"dp={best['dp']} pp={best['pp']}{tp} schedule={best['schedule']}" in proc.stdout
    assert f"micro_batches={best['micro_batches']}x{best['micro_batch_size']}" in proc.stdout


def test_too_small_a_budget_names_the_smallest_feasible_one(planned):
    tmp, _ = planned
    # 8 MiB holds the parameters and the synthetic data (6.4 MB), so only the profile can tell (1 MiB: test below)
    proc = _plan(["--config", "mlp.toml", "--ranks", "2", "--memory-per-rank", "8MiB", "--max-micro-batches", "8",
                  "--write", "never.toml"], tmp / "profiles", tmp)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.strip().splitlines() if "warning:" not in line]   # a busy machine's
    assert len(lines) == 1 and lines[0].startswith("hpcpipe: error: no plan for 2 ranks fits 8 MiB per rank")
    assert not (tmp / "never.toml").exists()
    smallest = int(lines[0].split("smallest feasible budget is ")[1].split("(")[1].split(" bytes")[0])
    # exactly that budget is feasible, one byte less is not
    ok = _plan(["--config", "mlp.toml", "--ranks", "2", "--memory-per-rank", str(smallest),
                "--max-micro-batches", "8"], tmp / "profiles", tmp)
    assert ok.returncode == 0, ok.stderr
    short = _plan(["--config", "mlp.toml", "--ranks", "2", "--memory-per-rank", str(smallest - 1),
                   "--max-micro-batches", "8"], tmp / "profiles", tmp)
    assert short.returncode == 2 and "smallest feasible budget" in short.stderr


def test_a_budget_below_what_the_model_alone_needs_is_refused_before_measuring(tmp_path):
    """Issue #32: the floor (parameters, gradients, optimizer state, data) is known without a profile."""
    (tmp_path / "mlp.toml").write_text(MLP)
    proc = _plan(["--config", "mlp.toml", "--ranks", "2", "--memory-per-rank", "1MiB"], tmp_path / "profiles",
                 tmp_path, timeout=30)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpcpipe: error: no plan for 2 ranks fits 1 MiB per rank "
                                                   "(--memory-per-rank): the busiest rank of any plan needs at least ")
    assert "nothing was measured" in lines[0] and not (tmp_path / "profiles").exists()


@pytest.mark.parametrize("args,words", [
    (["--ranks", "0"], "--ranks must be a positive integer"),
    (["--ranks", "2", "--memory-per-rank", "lots"], "is not a size"),
    # was: "expected one argument"
    (["--ranks", "2", "--memory-per-rank", "-1GiB"], "--memory-per-rank '-1GiB' is a negative budget"),
    (["--ranks", "2", "--memory-per-rank=-8G"], "--memory-per-rank '-8G' is a negative budget"),
    (["--ranks", "2", "--set", "train.setps=5"], "unknown key train.setps: did you mean train.steps?"),
    (["--ranks", "2", "--top", "0"], "--top must be a positive integer"),
    (["--ranks", "2", "--set", "model.depth=3"], "unknown key model.depth"),
    (["--ranks", "2", "--config", "missing.toml"], "does not exist"),
    (["--ranks", "2", "--write", "exists.toml"], "exists; the planner does not overwrite"),
    (["--ranks", "2", "--json", "nodir/plans.json"], "--json directory 'nodir' does not exist"),
    (["--ranks", "2", "--write", "exists.toml/plan.toml"],                 # was: "directory ... does not exist"
     "--write 'exists.toml/plan.toml' is not writable: 'exists.toml' is not a directory"),
    (["--ranks", "2", "--write", "dangling.toml"], "exists; the planner does not overwrite"),
    (["--ranks", "2", "--write", "p.out", "--json", "./p.out"], "--write and --json name the same file"),
    (["--ranks", "99999999999"], "more than the planner searches"),
    (["--ranks", "2", "--cores", "100000"], "more than this machine's"),       # was: 50000 BLAS threads a rank
    (["--ranks", "2", "--write", ""], "--write needs a file name"),           # was: exit 0, nothing written
    (["--ranks", "2", "--json", ""], "--json needs a file name"),
    (["--ranks", "2", "--write", "/proc/plan.toml"], "cannot create a file in '/proc'"),   # was: after planning
    (["--ranks", "2", "--profile-dir", "exists.toml"], "--profile-dir 'exists.toml' is not a directory"),
    (["--ranks", "2", "--profile-dir", "/proc/hpcpipe-profiles"],       # was: after the MPI probe's measurements
     "--profile-dir '/proc/hpcpipe-profiles' cannot be created"),
    (["--ranks", "2", "--write", "ck/plan.toml"], "is inside the checkpoint directory"),   # was: written there
    (["--ranks", "2", "--nodes", "0"], "--nodes must be a positive integer"),
    (["--ranks", "3", "--nodes", "2", "--network", "exists.toml"], "--ranks 3 is not a multiple of --nodes 2"),
    (["--ranks", "2", "--nodes", "2"], "--nodes 2 needs --network PROBE.json"),
    (["--ranks", "2", "--host-shared"], "--host-shared says the --nodes are emulated on this host"),
    (["--ranks", "2", "--network", "exists.toml"], "--network is the link between nodes: give --nodes"),
    (["--ranks", "2", "--nodes", "2", "--network", "missing.json"], "--network 'missing.json': cannot read it"),
    (["--ranks", "2", "--nodes", "2", "--network", "exists.toml"], "--network 'exists.toml' is not JSON"),
    (["--ranks", "2", "--nodes", "2", "--network", "probe.json"], "--network 'probe.json': communication probe"),
    (["--ranks", "2", "--nodes", "2", "--network", "fifo"], "--network 'fifo' is a named pipe, not a probe result"),
    (["--ranks", "2", "--nodes", "2", "--network", "ck"], "--network 'ck' is a directory, not a probe result"),
    # was: planned, and wrote a config the printed `mpiexec ... hpcpipe.train --config` refused
    (["--ranks", "2", "--set", 'model.weight_format="q8_0"', "--write", "p.out"],
     "model.weight_format = 'q8_0': training keeps float32 weights"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, words):
    (tmp_path / "exists.toml").write_text("# mine\n")
    (tmp_path / "dangling.toml").symlink_to(tmp_path / "target.toml")
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "manifest.json").write_text("{}")      # a checkpoint step directory, as far as paths go
    (tmp_path / "probe.json").write_text('{"p2p": [[4096, 1e-5]]}')     # a probe needs 2 sizes and more
    os.mkfifo(tmp_path / "fifo")                                       # opening it waited for a writer, for good
    proc = _plan(args, tmp_path / "profiles", tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("hpcpipe: error:")
    assert words in proc.stderr
    assert "Traceback" not in proc.stderr
    assert (tmp_path / "exists.toml").read_text() == "# mine\n"
    assert not (tmp_path / "target.toml").exists() and not (tmp_path / "p.out").exists()
    assert not (tmp_path / "profiles").exists()     # refused before any measurement


def test_missing_ranks_is_a_usage_error(tmp_path):
    proc = _plan([], tmp_path / "profiles", tmp_path)
    assert proc.returncode == 2 and "--ranks" in proc.stderr


def test_profile_cut_needs_a_profile(tmp_path):
    (tmp_path / "mlp.toml").write_text(MLP)
    proc = run_command(2, "hpcpipe.train", ["--config", "mlp.toml", "--set", "parallel.stage_layers=\"profile\""],
                       cwd=tmp_path, env={"HPCPIPE_PROFILE_DIR": str(tmp_path / "none")})
    assert proc.returncode == 2
    assert "needs a profile of this model" in proc.stderr and "python -m hpcpipe.plan" in proc.stderr


def test_head_heavy_gpt_plan_cuts_by_measured_cost_and_trains_with_it(tmp_path, monkeypatch):
    (tmp_path / "gpt.toml").write_text(GPT)
    proc = _plan(["--config", "gpt.toml", "--ranks", "2", "--json", "plans.json", "--max-micro-batches", "4"],
                 tmp_path / "profiles", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "tokens/s" in proc.stdout
    profile = json.loads(next((tmp_path / "profiles").glob("layers-*.json")).read_text())
    groups, sigs = profile["layers"]["groups"], profile["layers"]["signatures"]
    fb = [groups[s]["F"]["4"] + groups[s]["B"]["4"] for s in sigs]
    assert fb[-1] > fb[1]                # the 4096-word head costs more than a block
    # train with the measured cut: every rank reads the same profile and the checkpoint records the cut
    run = run_command(2, "hpcpipe.train", ["--config", "gpt.toml", "--set", "parallel.stage_layers=\"profile\"",
                                           "--set", "checkpoint.dir=\"ck\""],
                      cwd=tmp_path, env={"HPCPIPE_PROFILE_DIR": str(tmp_path / "profiles")})
    assert run.returncode == 0, run.stderr
    manifest = json.loads(next((tmp_path / "ck").rglob("manifest.json")).read_text())
    cut = [len(r) for r in manifest["layout"]["stage_layers"]]
    # the cut the profile's calibrated (pipelined) seconds give: what every rank computed from the same file (the
    # raw F + B above can rank two close cuts the other way when the calibration ran on a loaded machine)
    from hpcpipe.config import load_config
    from hpcpipe.profiles.stage_cut import stage_counts
    monkeypatch.setenv("HPCPIPE_PROFILE_DIR", str(tmp_path / "profiles"))
    config = load_config(str(tmp_path / "gpt.toml"), ['parallel.stage_layers="profile"'])
    assert cut == stage_counts(config, 2, 4)


def test_ranks_beyond_this_machine_are_called_predictions(planned):
    tmp, _ = planned
    proc = _plan(["--config", "mlp.toml", "--ranks", "64", "--max-micro-batches", "8", "--json", "wide.json",
                  "--memory-per-rank", "4GiB"], tmp / "profiles", tmp)
    assert proc.returncode == 0, proc.stderr
    assert "PREDICTION: 64 ranks are more than this machine's" in proc.stdout
    doc = json.loads((tmp / "wide.json").read_text())
    assert doc["prediction_only"] is True
    assert all(p["dp"] * p["pp"] * p["tp"] == 64 and p["pp"] <= 4 for p in doc["plans"])
    assert all(p["dp"] * p["micro_batches"] * p["micro_batch_size"] == doc["global_batch"] for p in doc["plans"])


def test_a_reader_that_left_stops_the_plan_quietly(planned):
    """`python -m hpcpipe.plan ... | head -1`: the reader may be gone before the table is printed."""
    import os

    tmp, _ = planned
    read_end, write_end = os.pipe()
    os.close(read_end)                    # nobody reads: every write fails with EPIPE
    try:
        proc = subprocess.run([sys.executable, "-m", "hpcpipe.plan", "--config", "mlp.toml", "--ranks", "2",
                               "--max-micro-batches", "8"], stdout=write_end, stderr=subprocess.PIPE, text=True,
                              timeout=120, cwd=tmp, env={**os.environ, "HPCPIPE_PROFILE_DIR": str(tmp / "profiles")})
    finally:
        os.close(write_end)
    assert proc.returncode == 141
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr


@pytest.mark.parametrize("sig,status,words", [(signal.SIGTERM, 143, "terminated (SIGTERM)"),
                                             (signal.SIGINT, 130, "interrupted (Ctrl-C)")])
def test_a_signal_while_profiling_kills_the_children_and_leaves_no_files(tmp_path, sig, status, words):
    """SIGTERM used to end the planner alone: its profiling children ran on, orphaned, and left their directory."""
    import os
    import time

    scratch, profiles = tmp_path / "tmp", tmp_path / "profiles"
    scratch.mkdir()
    config = tmp_path / "plan-mlp.toml"
    shutil.copy(ROOT_CONFIGS / "plan-mlp.toml", config)
    env = dict(os.environ, TMPDIR=str(scratch), HPCPIPE_PROFILE_DIR=str(profiles))
    proc = subprocess.Popen([sys.executable, "-m", "hpcpipe.plan", "--config", str(config), "--ranks", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not list(scratch.glob("hpcpipe-profile-*/request.json")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        time.sleep(1.0)                                   # the layer profiles are computing now
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == status, err
    assert err.strip().splitlines()[-1] == f"hpcpipe.plan: {words}" and "Traceback" not in err, err
    assert list(scratch.iterdir()) == []                  # the profiling directory is gone
    children = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p).find(str(scratch)) >= 0]
    assert children == [], [_cmdline(p) for p in children]


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
