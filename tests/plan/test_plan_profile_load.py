"""The machine's load is stored with a measured profile, and a profile taken or used on a busy machine is
warned about (issue #32: the cache is shared machine-wide and a profile measured under load was reused silently).

The measurements are replaced by a profile with chosen costs; os.getloadavg by the load the test wants.
"""

from __future__ import annotations

import copy
import json
import os
import time

import pytest
from support.plan import mlp_config, synthetic_profile

from hpcpipe.plan import profiling
from hpcpipe.profiles import cache as profile_cache
from hpcpipe.profiles.comm_model import CommModel

CONFIG = mlp_config([16, 24, 32, 16])


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """The layer bench and the calibration replaced by a chosen profile; the comm probe cached already."""
    layers = copy.deepcopy(synthetic_profile(CONFIG, {0: 1e-6, 1: 2e-6, 2: 1e-6}).data["layers"])
    calls = []

    def bench(config, sizes, threads, concurrent=1, timeout_s=600.0, tps=()):
        calls.append(sizes)
        return dict(layers, concurrent=concurrent)

    monkeypatch.setattr(profiling, "run_layer_profile", bench)
    monkeypatch.setattr(profiling, "_engine_factors", lambda *args: {"failed": "not run in this test"})
    profile_cache.write_comm(str(tmp_path), CommModel(1e-6, 1e-9, 1e-6, 1e-9, 50 << 20, "test").to_dict())
    return calls


def _load(monkeypatch, tmp_path, load: float, refresh: bool = False) -> list[str]:
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    said: list[str] = []
    profiling.load_profile(CONFIG, [1, 4, 16], 1, str(tmp_path), refresh, 1, log=said.append)
    return [line for line in said if "warning" in line]


def _stored_load(tmp_path) -> dict:
    return json.loads(next(tmp_path.glob("layers-*.json")).read_text())["load"]


def test_a_profile_measured_on_a_busy_machine_says_so_then_and_whenever_it_is_used(measured, monkeypatch, tmp_path):
    cores = len(os.sched_getaffinity(0))
    busy = cores + 1.5
    warned = _load(monkeypatch, tmp_path, busy)
    assert measured == [[1, 4, 16]]
    assert warned == [f"hpcpipe.plan: warning: this machine is busy (load {busy:g} on {cores} cores): the profile "
                      f"measured now may be slow and is cached for every later plan; measure again on a quiet "
                      f"machine with --refresh-profile"]
    record = _stored_load(tmp_path)
    assert record["load_1m"] == busy and record["cores"] == cores and abs(record["unix"] - time.time()) < 60
    # used again from the cache on a quiet machine: the warning names when and how busy it was
    again = _load(monkeypatch, tmp_path, 0.1)
    assert measured == [[1, 4, 16]]                                  # nothing measured
    assert len(again) == 1 and again[0].startswith("hpcpipe.plan: warning: the cached profile was measured on a "
                                                   f"busy machine (load {busy:g} on {cores} cores, ")
    assert again[0].endswith("its times may be slow: measure again on a quiet machine with --refresh-profile")
    # measured again on a quiet machine: no warning, and the quiet load is what is stored
    assert _load(monkeypatch, tmp_path, 0.1, refresh=True) == []
    assert _stored_load(tmp_path)["load_1m"] == 0.1
    assert _load(monkeypatch, tmp_path, 0.2) == []


def test_a_quiet_machine_gives_no_warning(measured, monkeypatch, tmp_path):
    assert _load(monkeypatch, tmp_path, 0.5) == []
    assert _stored_load(tmp_path)["load_1m"] == 0.5


def test_busy_means_more_load_than_cores():
    from hpcpipe.profiles.load import busier, busy_warning, is_busy

    assert is_busy({"load_1m": 2.5, "cores": 2}) and not is_busy({"load_1m": 2.0, "cores": 2})
    for damaged in (None, {}, {"load_1m": "high", "cores": 2}, {"load_1m": 9.0, "cores": 0}, [9, 2]):
        assert not is_busy(damaged)                # an old profile (no record) or a hand edit: no warning
    quiet, loaded = {"load_1m": 0.5, "cores": 2}, {"load_1m": 3.0, "cores": 2}
    assert busier(quiet, loaded) is loaded and busier(loaded, quiet) is loaded and busier(None, quiet) is quiet
    assert busy_warning(quiet, loaded, measuring=False) is None       # busy now, measuring nothing: no matter
