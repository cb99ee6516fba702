"""Unit tests of the run guards: signal flags, the watchdog, the step decision, the test hooks, config keys."""

from __future__ import annotations

import io
import math
import os
import signal
import time

import numpy as np
import pytest

from hpcpipe import errors
from hpcpipe.config import from_dict
from hpcpipe.errors import ConfigError
from hpcpipe.runtime import faults, step_health, watchdog
from hpcpipe.runtime.signals import StopSignals


def test_stop_signals_only_record_and_restore():
    before = signal.getsignal(signal.SIGUSR1)
    stop = StopSignals().install()
    try:
        assert not stop.requested and stop.name == ""
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.time() + 5
        while not stop.requested and time.time() < deadline:
            time.sleep(0.01)
        assert stop.requested and stop.name == "SIGUSR1"
        os.kill(os.getpid(), signal.SIGTERM)       # the process survives: only a flag is set
        time.sleep(0.05)
        assert stop.name == "SIGTERM"
    finally:
        stop.close()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_a_ctrl_c_whose_keyboardinterrupt_python_dropped_is_still_seen():
    before = signal.getsignal(signal.SIGINT)
    stop = StopSignals().install()
    try:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                time.sleep(0.001)
            raise AssertionError("SIGINT must still raise KeyboardInterrupt")
        except KeyboardInterrupt:
            pass                    # what Python does with it inside a weakref callback or __del__: dropped
        with pytest.raises(KeyboardInterrupt):
            stop.check_interrupt()  # what the training loop asks at every step
    finally:
        stop.close()
    assert signal.getsignal(signal.SIGINT) is before


def test_an_ignored_sigint_stays_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        stop = StopSignals().install()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        stop.close()
    finally:
        signal.signal(signal.SIGINT, previous)


def test_watchdog_dumps_every_thread_with_the_rank_name_then_aborts():
    out, codes = io.StringIO(), []
    dog = watchdog.Watchdog(0.3, lambda: "dp01-pp02", codes.append, stream=out, grace=0.0).start()
    dog.beat("step 7")
    deadline = time.time() + 10
    while not codes and time.time() < deadline:
        time.sleep(0.05)
    dog.stop()
    text = out.getvalue()
    assert codes == [errors.EXIT_STALLED]
    assert "[dp01-pp02] watchdog: no progress" in text and "in step 7" in text and "run.stall_timeout = 0.3" in text
    lines = text.splitlines()[1:]
    assert lines and all(line.startswith("[dp01-pp02] ") for line in lines)
    assert any("test_watchdog_dumps_every_thread" in line for line in lines)      # the main thread's stack
    assert any("hpcpipe/runtime/watchdog.py" in line and "_run" in line for line in lines)   # and the watchdog's own


def test_watchdog_stays_quiet_while_beats_come_and_when_off():
    codes = []
    dog = watchdog.Watchdog(0.4, lambda: "r", codes.append, stream=io.StringIO(), grace=0.0).start()
    for i in range(10):
        dog.beat(f"step {i}")
        time.sleep(0.1)
    dog.stop()
    off = watchdog.Watchdog(0.0, lambda: "r", codes.append).start()
    assert off._thread is None
    off.stop()
    assert codes == []


def test_decision_sums_norm_once_per_stage_and_flags_non_finite():
    # two replicas x two stages: norm counted on replica 0 only, loss from the last stage
    parts = [step_health.local_decision(4.0, 0.0, True, False), step_health.local_decision(4.0, 0.0, False, False),
             step_health.local_decision(5.0, 3.0, True, False), step_health.local_decision(5.0, 2.0, False, True)]
    d = step_health.decide(np.sum(parts, axis=0))
    assert d.grad_norm == 3.0 and d.loss_sum == 5.0 and not d.skip and d.stop and d.stop_ranks == 1
    parts[1] = step_health.local_decision(float("nan"), 0.0, False, False)
    parts[2] = step_health.local_decision(5.0, float("inf"), True, False)
    d = step_health.decide(np.sum(parts, axis=0))
    assert d.skip and d.bad_ranks == 2 and math.isnan(d.grad_norm)


def test_hooks_parse_rank_step_and_count(monkeypatch):
    monkeypatch.setenv("HPCPIPE_NAN", "rank=3,step=5,count=2,what=loss")
    assert [faults.nan_injection(3, s) for s in (4, 5, 6, 7)] == [None, "loss", "loss", None]
    assert faults.nan_injection(2, 5) is None
    monkeypatch.setenv("HPCPIPE_STALL", "rank=1,step=2,seconds=0.2")
    t0 = time.perf_counter()
    faults.stall_injection(1, 1)
    faults.stall_injection(0, 2)
    assert time.perf_counter() - t0 < 0.1
    faults.stall_injection(1, 2)
    assert time.perf_counter() - t0 >= 0.2


def test_exit_statuses_are_distinct():
    codes = [errors.EXIT_OK, errors.EXIT_FAILURE, errors.EXIT_CONFIG, errors.EXIT_PREEMPTED, errors.EXIT_STALLED,
             errors.EXIT_DIVERGED, errors.EXIT_INTERRUPTED]
    assert len(set(codes)) == len(codes) and errors.EXIT_PREEMPTED == 75


@pytest.mark.parametrize("section, key, value, message", [
    ("run", "stall_timeout", -1.0, "run.stall_timeout must be >= 0"),
    ("train", "max_bad_steps", 0, "train.max_bad_steps must be >= 1"),
])
def test_new_config_keys_are_validated(section, key, value, message):
    with pytest.raises(ConfigError, match=message):
        from_dict({section: {key: value}})


def test_new_config_keys_defaults():
    cfg = from_dict({})
    assert cfg.run.stall_timeout == 600.0 and cfg.train.max_bad_steps == 5
