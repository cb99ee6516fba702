"""Ranks that plan differently (one fails, or they cut the model differently) stop together, fast, with one message."""

import json
import os
import subprocess
import sys
import time

import pytest
from support import launchers
from support.plan import synthetic_profile

from hpcpipe.config import load_config
from hpcpipe.errors import EXIT_CONFIG, EXIT_FAILURE
from hpcpipe.profiles import cache as profile_cache
from hpcpipe.runtime.job import setup_outcome

MLP = """
[model]
dims = [64, 64, 64, 64, 64]
[parallel]
pp = 2
stage_layers = "profile"
[train]
steps = 2
micro_batches = 2
micro_batch_size = 8
optimizer = "sgd"
[run]
stall_timeout = 120
[checkpoint]
dir = "ck"
[log]
progress = false
"""

# every rank reads the profile directory given for its own rank, as ranks on two nodes read two node-local caches
BY_RANK = """
import os, runpy, sys
from hpcpipe.runtime.launcher import launcher_rank
os.environ["HPCPIPE_PROFILE_DIR"] = sys.argv.pop(1).split(",")[launcher_rank()]
sys.argv[0] = "hpcpipe.train"
runpy.run_module("hpcpipe.train", run_name="__main__", alter_sys=True)
"""


def test_every_rank_takes_the_first_failing_ranks_code_and_only_it_speaks():
    every = [(0, "[2, 2]"), (EXIT_CONFIG, None), (EXIT_FAILURE, None)]
    assert setup_outcome(every, 0) == (EXIT_CONFIG, None)
    assert setup_outcome(every, 2, "hpcpipe: error: other") == (EXIT_CONFIG, None)
    code, text = setup_outcome(every, 1, "hpcpipe: error: no profile\nmore")
    assert code == EXIT_CONFIG
    assert text == "hpcpipe: error: no profile (on rank 1; setup failed on 2 of 3 ranks)\nmore"


def test_when_every_rank_fails_rank_0_speaks_as_before():
    every = [(EXIT_CONFIG, None)] * 3
    assert setup_outcome(every, 0, "hpcpipe: error: bad key") == (EXIT_CONFIG, "hpcpipe: error: bad key")
    assert setup_outcome(every, 1, "hpcpipe: error: bad key") == (EXIT_CONFIG, None)


def test_different_cuts_stop_every_rank_and_rank_0_names_them():
    every = [(0, "[2, 2]"), (0, "[3, 1]"), (0, "[2, 2]")]
    code, text = setup_outcome(every, 0)
    assert code == EXIT_CONFIG and "different stage cuts ([2, 2]; [3, 1])" in text
    assert setup_outcome(every, 1) == (EXIT_CONFIG, None)
    assert setup_outcome([(0, "[2, 2]")] * 2, 0) == (0, None)
    assert setup_outcome([(0, None)] * 2, 1) == (0, None)       # commands that cut nothing


def _profiles(tmp_path):
    """Two profile directories that cut the 4-layer MLP [2, 2] and [3, 1], and an empty one."""
    (tmp_path / "mlp.toml").write_text(MLP)
    config = load_config(tmp_path / "mlp.toml")
    key = profile_cache.layer_key(config, 1)
    for name, last in (("even", 1.0), ("heavy", 100.0)):
        profile = synthetic_profile(config, {0: 1.0, 1: 1.0, 2: 1.0, 3: last})
        profile_cache.write(str(tmp_path / name), key, {**profile.data, "key": key})
    (tmp_path / "empty").mkdir()
    (tmp_path / "by_rank.py").write_text(BY_RANK)


def _train_reading_profiles(tmp_path, dirs):
    """Train the MLP on 2 ranks, rank r reading profiles from dirs[r]; return the process and its seconds."""
    start = time.perf_counter()
    proc = subprocess.run([*launchers.prefix(2), sys.executable, "by_rank.py",
                           ",".join(str(tmp_path / d) for d in dirs), "--config", "mlp.toml"],
                          capture_output=True, text=True, timeout=100, cwd=tmp_path,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, time.perf_counter() - start


def _errors(proc):
    return [line for line in proc.stderr.splitlines() if "error" in line]


@pytest.mark.parametrize("dirs,failing", [(("even", "empty"), 1), (("empty", "even"), 0)])
def test_a_rank_without_its_profile_stops_the_job_at_once(tmp_path, dirs, failing):
    _profiles(tmp_path)
    proc, seconds = _train_reading_profiles(tmp_path, dirs)
    assert proc.returncode == 2, proc.stderr
    errors = _errors(proc)
    assert len(errors) == 1, proc.stderr
    assert "needs a profile of this model" in errors[0]
    assert f"(on rank {failing}; setup failed on 1 of 2 ranks)" in errors[0]
    assert "watchdog" not in proc.stderr and seconds < 60     # not the stall watchdog: the old hang lasted 600 s
    assert not (tmp_path / "ck").exists()


def test_ranks_that_cut_the_model_differently_do_not_train(tmp_path):
    _profiles(tmp_path)
    proc, _ = _train_reading_profiles(tmp_path, ("even", "heavy"))
    assert proc.returncode == 2, proc.stderr
    errors = _errors(proc)
    assert len(errors) == 1 and "the ranks chose different stage cuts ([2, 2]; [3, 1])" in errors[0], proc.stderr
    assert "trained" not in proc.stdout
    assert not (tmp_path / "ck").exists()


def test_ranks_that_read_equal_profiles_train(tmp_path):
    _profiles(tmp_path)
    (tmp_path / "copy").mkdir()
    for f in (tmp_path / "heavy").iterdir():
        (tmp_path / "copy" / f.name).write_bytes(f.read_bytes())
    proc, _ = _train_reading_profiles(tmp_path, ("heavy", "copy"))
    assert proc.returncode == 0, proc.stderr
    assert "stage_layers=[3, 1]" in proc.stdout       # the summary says which cut was trained
    manifest = json.loads(next((tmp_path / "ck").rglob("manifest.json")).read_text())
    assert [len(r) for r in manifest["layout"]["stage_layers"]] == [3, 1]


class _NeverArrives:
    """A 2-rank communicator whose other rank never reaches the exchange (stuck in a file system)."""

    def Get_size(self):
        return 2

    def Ibarrier(self):
        return type("Request", (), {"Test": lambda self: False})()

    def allgather(self, obj):
        raise AssertionError("no exchange may start before every rank arrived")


def test_a_rank_that_never_finishes_planning_is_given_up_on_after_the_timeout():
    from hpcpipe.runtime.comm import Poller, gather_everyone

    start = time.perf_counter()
    assert gather_everyone(_NeverArrives(), Poller(), (0, "[4]"), timeout_s=0.2) is None
    assert 0.2 <= time.perf_counter() - start < 5
