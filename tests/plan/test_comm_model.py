"""The planner's communication model: the fit on synthetic probe data, measure_comm's failures, the real probe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from support.launch import run_command

from hpcpipe.errors import ConfigError
from hpcpipe.plan.launch import measure_comm
from hpcpipe.profiles.comm_model import CommModel, fit_line

SIZES = [4096 * 4 ** k for k in range(8)]     # 4 KiB .. 64 MiB, as the probe measures
LATENCY, PER_BYTE = 5e-6, 1 / 10e9             # 5 us, 10 GB/s
AR_LATENCY, AR_PER_BYTE = 20e-6, 1 / 3e9       # 20 us, 3 GB/s


def synthetic(noise: list[float] | None = None, p2p=(LATENCY, PER_BYTE), ar=(AR_LATENCY, AR_PER_BYTE)) -> dict:
    """A probe result whose times lie on known lines, each times (1 + noise[i])."""
    noise = noise or [0.0] * len(SIZES)
    return {"p2p": [[n, (p2p[0] + p2p[1] * n) * (1 + e)] for n, e in zip(SIZES, noise, strict=True)],
            "allreduce": [[n, (ar[0] + ar[1] * n) * (1 + e)] for n, e in zip(SIZES, noise, strict=True)],
            "baseline_rss_bytes": 70_000_000, "mpi": "hpcpipe: MPI: test", "ranks": 2}


def test_fit_recovers_known_latency_and_bandwidth():
    model = CommModel.from_probe(synthetic())
    assert model.latency_s == pytest.approx(LATENCY, rel=1e-9)
    assert model.seconds_per_byte == pytest.approx(PER_BYTE, rel=1e-9)
    assert model.allreduce_latency_s == pytest.approx(AR_LATENCY, rel=1e-9)
    assert model.allreduce_seconds_per_byte == pytest.approx(AR_PER_BYTE, rel=1e-9)
    assert model.baseline_rss_bytes == 70_000_000 and model.mpi == "hpcpipe: MPI: test"
    assert model.bandwidth_bytes_per_s == pytest.approx(10e9, rel=1e-9)


def test_fit_with_noise_keeps_the_microsecond_latency():
    # +-10 % noise: a fit on absolute errors would let the 64 MiB point's 0.7 ms of noise swamp the 5 us latency
    model = CommModel.from_probe(synthetic([0.1, -0.1, 0.05, -0.05, 0.1, -0.1, 0.1, -0.1]))
    assert model.latency_s == pytest.approx(LATENCY, rel=0.25)
    assert model.seconds_per_byte == pytest.approx(PER_BYTE, rel=0.15)


def test_fit_is_never_negative():
    # times that fall on a line with a negative intercept (-50 us): the fit stays at latency 0
    a, b = fit_line([(n, -50e-6 + n / 1e9) for n in SIZES[3:]])
    assert a == 0.0 and b > 0
    # times that shrink with size (noise only): no negative per-byte cost either
    a, b = fit_line([(4096, 3e-5), (65536, 2e-5), (1 << 20, 1e-5)])
    assert a > 0 and b == 0.0


def test_allreduce_of_one_rank_is_free_and_the_ring_scales_from_two():
    model = CommModel.from_probe(synthetic())
    line = CommModel(LATENCY, PER_BYTE, AR_LATENCY, AR_PER_BYTE, 1)   # no measured points: the line itself
    n = 8 << 20
    for m in (model, line):
        assert m.allreduce(n, 1) == 0.0
        assert m.allreduce(n, 2) == pytest.approx(AR_LATENCY + AR_PER_BYTE * n, rel=1e-9)
        # ring: (r-1) latencies, 2(r-1)/r of the bytes
        assert m.allreduce(n, 8) == pytest.approx(7 * AR_LATENCY + 2 * 7 / 8 * n * AR_PER_BYTE, rel=1e-9)
    assert line.p2p(n) == pytest.approx(LATENCY + PER_BYTE * n, rel=1e-12)


def test_predictions_follow_the_measured_points_where_the_line_does_not():
    # caches: 4 MiB and below move at 10 GB/s, bigger messages at half that speed
    probe = synthetic()
    probe["allreduce"] = [[n, AR_LATENCY + n * (AR_PER_BYTE if n <= 4 << 20 else 2 * AR_PER_BYTE)] for n in SIZES]
    model = CommModel.from_probe(probe)
    for n, t in probe["allreduce"]:
        assert model.allreduce(n, 2) == pytest.approx(t, rel=1e-9)
    big = 256 << 20    # beyond the measured range: the last segment's slope, not the whole line's
    assert model.allreduce(big, 2) == pytest.approx(AR_LATENCY + 2 * AR_PER_BYTE * big, rel=0.05)


def test_predictions_never_decrease_with_bytes():
    # noisy and non-monotone measurements (4 KiB slower than 16 KiB, 1 MiB slower than 4 MiB)
    noise = [1.5, -0.2, 0.0, 0.3, 0.9, -0.3, 0.1, 0.0]
    models = [CommModel.from_probe(synthetic(noise)), CommModel(LATENCY, PER_BYTE, AR_LATENCY, AR_PER_BYTE, 1)]
    grid = [0] + [int(1.3 ** k) for k in range(1, 85)]      # 0 bytes .. ~4 GiB, inside and outside the points
    for model in models:
        for fn in (model.p2p, lambda n, m=model: m.allreduce(n, 2), lambda n, m=model: m.allreduce(n, 6)):
            times = [fn(n) for n in grid]
            assert all(t >= 0 for t in times)
            assert all(b >= a for a, b in zip(times, times[1:], strict=False)), times


def test_round_trip_through_a_dict_and_json():
    model = CommModel.from_probe(synthetic([0.1, -0.1, 0, 0, 0, 0, 0.2, 0]))
    again = CommModel.from_dict(json.loads(json.dumps(model.to_dict())))
    assert again == model
    assert again.p2p(3 << 20) == model.p2p(3 << 20)


def test_bad_probe_or_cache_data_is_a_config_error_naming_the_key():
    probe = synthetic()
    probe["p2p"] = [[4096, 1e-6]]
    with pytest.raises(ConfigError, match="'p2p' needs at least 2 different message sizes"):
        CommModel.from_probe(probe)
    probe = synthetic()
    probe["allreduce"][2][1] = float("nan")
    with pytest.raises(ConfigError, match="'allreduce' must be a list of"):
        CommModel.from_probe(probe)
    data = CommModel.from_probe(synthetic()).to_dict()
    del data["seconds_per_byte"]
    with pytest.raises(ConfigError, match="cached communication model: 'seconds_per_byte'"):
        CommModel.from_dict(data)


def test_a_launcher_that_does_not_exist_is_named(monkeypatch, tmp_path):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with pytest.raises(ConfigError, match="cannot start the MPI launcher '/nonexistent/mpiexec-x'.*HPCPIPE_MPIEXEC"):
        measure_comm(launcher="/nonexistent/mpiexec-x")
    monkeypatch.setenv("HPCPIPE_MPIEXEC", "/nonexistent/mpirun --oversubscribe")
    with pytest.raises(ConfigError, match="'/nonexistent/mpirun'"):
        measure_comm()
    assert os.listdir(tmp_path) == []           # no temporary file left behind


def test_no_launcher_anywhere_says_how_to_set_one(monkeypatch, tmp_path):
    monkeypatch.delenv("HPCPIPE_MPIEXEC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))   # no mpiexec beside it either
    with pytest.raises(ConfigError, match="mpiexec is not on PATH; set HPCPIPE_MPIEXEC"):
        measure_comm()


def _script(folder, name: str, body: str) -> str:
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        f.write("#!/bin/sh\n" + body + "\n")
    os.chmod(path, 0o755)
    return path


def test_a_failing_launcher_shows_its_command_and_stderr(monkeypatch, tmp_path):
    scripts = tmp_path / "bin"
    scripts.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    failing = _script(scripts, "failing", 'echo "ranks lost: no such host" >&2; exit 3')
    with pytest.raises(ConfigError) as err:
        measure_comm(launcher=failing)
    text = str(err.value)
    assert "exit status 3" in text and f"{failing} -n 2 " in text and "-m hpcpipe.plan.probe --out" in text
    assert "ranks lost: no such host" in text
    silent = _script(scripts, "silent", "exit 0")                    # succeeds without writing the result
    with pytest.raises(ConfigError, match="wrote no usable result"):
        measure_comm(launcher=silent)
    garbage = _script(scripts, "garbage", 'while [ "$1" != --out ]; do shift; done; echo "{not json" > "$2"')
    with pytest.raises(ConfigError, match="wrote no usable result"):
        measure_comm(launcher=garbage)
    assert os.listdir(tmp_path) == ["bin"]


def test_a_hanging_launcher_is_killed_at_the_timeout(monkeypatch, tmp_path):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    marker = tmp_path / "child.pid"
    hanging = _script(tmp_path, "hanging", f"sleep 60 & echo $! > {marker}; wait")
    start = time.monotonic()
    with pytest.raises(ConfigError, match="did not finish in 1 s"):
        measure_comm(timeout_s=1, launcher=hanging)
    assert time.monotonic() - start < 10
    child = int(marker.read_text())
    time.sleep(0.2)
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(child)], capture_output=True, text=True).stdout.strip()
    assert state in ("", "Z"), f"the launcher's child {child} survived the timeout ({state})"
    assert sorted(os.listdir(tmp_path)) == ["child.pid", "hanging"]


def test_the_probe_refuses_a_job_not_of_two_ranks(tmp_path):
    out = tmp_path / "p.json"
    proc = run_command(3, "hpcpipe.plan.probe", ["--out", str(out)], timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "needs exactly 2 ranks" in lines[0] and "this job has 3" in lines[0], proc.stderr
    assert not out.exists()


def test_the_probe_never_overwrites_its_out_file(tmp_path):
    out = tmp_path / "p.json"
    out.write_text("mine")
    proc = subprocess.run([sys.executable, "-m", "hpcpipe.plan.probe", "--out", str(out)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "already exists" in proc.stderr and "hpcpipe: error:" in proc.stderr
    assert out.read_text() == "mine"


def test_the_probe_refuses_a_folder_that_takes_no_file_before_measuring():
    # as root /proc passes the permission bits: the probe measured, then rank 0 failed to write
    # ("[probe rank 0] error: FileNotFoundError: ... '/proc/.p.json.tmp-...'", MPI_Abort, exit 1)
    proc = run_command(2, "hpcpipe.plan.probe", ["--out", "/proc/hpcpipe-p.json"], timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "--out '/proc/hpcpipe-p.json': cannot create a file in '/proc'" in proc.stderr, proc.stderr


@pytest.mark.parametrize("sizes, words", [(["2", "4096"], "--sizes 2: every size must be between 4 and"),
                                          (["4096", "4096"], "give at least 2 different sizes")])
def test_the_probe_refuses_bad_sizes_before_mpi(tmp_path, sizes, words):
    out = tmp_path / "p.json"
    proc = subprocess.run([sys.executable, "-m", "hpcpipe.plan.probe", "--out", str(out), "--sizes", *sizes],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and words in proc.stderr, proc.stderr
    assert not out.exists()


def test_measure_comm_end_to_end_with_the_mpich_wheel():
    from support import launchers
    start = time.monotonic()
    probe = measure_comm(timeout_s=120, launcher=launchers.mpich_mpiexec())
    wall = time.monotonic() - start
    model = CommModel.from_probe(probe)
    assert probe["ranks"] == 2 and "MPICH" in probe["mpi"]
    sizes = [n for n, _ in probe["p2p"]]
    assert sizes[0] == 4096 and sizes[-1] == 64 << 20 and 6 <= len(sizes) <= 8
    assert 0 < model.latency_s < 1e-3
    assert model.bandwidth_bytes_per_s > 100e6
    assert 20e6 < probe["baseline_rss_bytes"] < 2e9
    big = [t for _, t in probe["p2p"][-3:]]                 # 4, 16 and 64 MiB: clearly slower each time
    assert big[0] < big[1] < big[2], probe["p2p"]
    assert all(t > 0 for _, t in probe["allreduce"])
    assert wall < 30, f"the probe took {wall:.1f} s"
