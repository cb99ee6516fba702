"""A cached profile that parses but is damaged inside is named and refused (train) instead of a traceback."""

import copy
import json
import os
import threading

import pytest
from support.plan import synthetic_profile

from hpcpipe.config import from_dict
from hpcpipe.errors import ConfigError
from hpcpipe.profiles import cache as profile_cache
from hpcpipe.profiles.check import profile_problem
from hpcpipe.profiles.stage_cut import stage_counts


def _whole():
    config = from_dict({"model": {"dims": [16, 24, 32, 40, 48]}, "parallel": {"pp": 2, "stage_layers": "profile"},
                        "train": {"optimizer": "sgd", "micro_batch_size": 8}, "checkpoint": {"dir": ""}})
    data = copy.deepcopy(synthetic_profile(config, {i: 1.0 for i in range(4)}).data)
    data["engine"] = {"replicas": {"forward": [1.0] * 4, "backward": [1.0] * 4, "sync_share": 0.1,
                                   "stage_layers": [4]}}
    return config, data


def _first_group(data):
    return data["layers"]["groups"][data["layers"]["signatures"][0]]


def _edit(path, value):
    def apply(data):
        *parents, last = path
        target = data
        for step in parents:
            target = target[step] if step != "<group>" else _first_group(data)
        if last == "<group>":
            raise AssertionError("edit a field of the group")
        target[last] = value
    return apply


# the edits an attacker or a hand edit made in the helpers' report, and what each must be called
DAMAGE = [
    (_edit(("layers", "groups"), {}), "no layer groups"),
    (_edit(("layers", "signatures"), []), "signatures"),
    (_edit(("layers", "<group>", "F"), {"8": "fast"}), "F at 8 rows is 'fast'"),
    (_edit(("layers", "<group>", "B"), {"8": -1.0}), "B at 8 rows is -1.0"),
    (_edit(("layers", "<group>", "F"), {"8": 1e308}), "F at 8 rows is 1e+308"),     # was an OverflowError
    (_edit(("layers", "<group>", "W"), {"eight": 1.0}), "micro-batch size 'eight'"),
    (_edit(("layers", "<group>", "params"), "many"), "has params 'many'"),
    (_edit(("layers", "optimizer"), {}), "optimizer 'sgd' is None"),
    (_edit(("engine", "replicas", "forward"), "x"), "engine replicas forward is 'x'"),
    (_edit(("engine", "replicas", "sync_share"), 3), "sync_share is 3"),
    (_edit(("comm",), None), "no communication model"),
]


def test_a_whole_profile_has_no_problem():
    _, data = _whole()
    assert profile_problem(data) is None
    data["engine"] = {"failed": "the calibration run could not start"}    # a profile without calibration
    assert profile_problem(data) is None


@pytest.mark.parametrize("damage,words", DAMAGE)
def test_each_damage_is_named(damage, words):
    _, data = _whole()
    damage(data)
    problem = profile_problem(data)
    assert problem is not None and words in problem, problem


@pytest.mark.parametrize("damage,words", DAMAGE[:5])
def test_training_by_the_profile_refuses_a_damaged_one_naming_the_file(tmp_path, monkeypatch, damage, words):
    config, data = _whole()
    key = profile_cache.layer_key(config, 1)
    damage(data)
    path = profile_cache.write(str(tmp_path), key, {**data, "key": key})
    monkeypatch.setenv("HPCPIPE_PROFILE_DIR", str(tmp_path))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with pytest.raises(ConfigError) as caught:
        stage_counts(config, 2, 8)
    assert str(path) in str(caught.value) and words in str(caught.value) and "--refresh-profile" in str(caught.value)


def test_training_by_a_whole_profile_cuts_by_it(tmp_path, monkeypatch):
    config, data = _whole()
    data["layers"]["groups"][data["layers"]["signatures"][3]]["F"] = {k: v * 100 for k, v in
                                                                     _first_group(data)["F"].items()}
    key = profile_cache.layer_key(config, 1)
    profile_cache.write(str(tmp_path), key, {**data, "key": key})
    (tmp_path / "unrelated.json").write_text(json.dumps({"not": "a profile"}))
    monkeypatch.setenv("HPCPIPE_PROFILE_DIR", str(tmp_path))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert stage_counts(config, 2, 8) == [3, 1]


@pytest.mark.parametrize("spoil,words", [
    (lambda p: p.write_text(""), "is empty"),
    (lambda p: p.write_text('{"key": {"model": '), "is not valid JSON (truncated or damaged"),
    (lambda p: p.write_text("[1, 2]"), "is JSON but not an object"),
    (lambda p: (p.unlink(), p.mkdir()), "is a directory, not a profile file"),
])
def test_an_unreadable_profile_file_is_named_with_what_is_wrong(tmp_path, spoil, words):
    config, data = _whole()
    key = profile_cache.layer_key(config, 1)
    path = profile_cache.write(str(tmp_path), key, {**data, "key": key})
    spoil(path)                         # was "is not a JSON object" for each
    cached, problem = profile_cache.inspect(str(tmp_path), key)
    assert cached is None and problem.startswith(f"{str(path)!r} {words}"), problem


def test_a_profile_that_is_a_named_pipe_is_named_not_opened(tmp_path):
    """Every rank reads its profile in the setup, before any watchdog: opening a named pipe blocked them all.

    (A link to /dev/zero is refused by the same check; it is not tried here: a reader that opened it would
    fill this machine's memory, not fail.)"""
    config, data = _whole()
    key = profile_cache.layer_key(config, 1)
    path = profile_cache.write(str(tmp_path), key, {**data, "key": key})
    path.unlink()
    os.mkfifo(path)
    found: list = []
    reader = threading.Thread(target=lambda: found.append(profile_cache.inspect(str(tmp_path), key)), daemon=True)
    reader.start()
    reader.join(60)                     # about a millisecond; before the fix, never
    assert found, f"reading {path} did not return within 60 s (it opened the named pipe)"
    cached, problem = found[0]
    assert cached is None and problem == f"{str(path)!r} cannot be read: it is a named pipe, not a profile file", \
        problem
