"""The watchdog of serve and generate (issue 32), without MPI: it fires only while work is pending and has not
progressed for run.stall_timeout seconds, never on an idle rank, whatever the wall clock did meanwhile."""

import io
import time

from hpcpipe import errors
from hpcpipe.runtime.watchdog import Watchdog
from hpcpipe.serve.stall import Heartbeat


def _dog(timeout=0.2):
    fired, out = [], io.StringIO()
    return Watchdog(timeout, lambda: "dp00-pp01", fired.append, stream=out, grace=0.0), fired, out


def test_an_idle_watchdog_never_fires():
    dog, fired, _ = _dog()
    dog.start()
    try:
        dog.idle("serving: idle")
        time.sleep(0.8)
        assert fired == []
    finally:
        dog.stop()


def test_pending_work_that_does_not_progress_fires_with_76_and_the_stacks():
    dog, fired, out = _dog()
    dog.start()
    try:
        dog.idle("serving: idle")
        time.sleep(0.4)
        dog.progressed("serving: waiting for the pipeline", time.monotonic())
        deadline = time.monotonic() + 3
        while not fired and time.monotonic() < deadline:
            time.sleep(0.02)
        assert fired == [errors.EXIT_STALLED]
        assert "[dp00-pp01] watchdog: no progress for" in out.getvalue()
        assert "in serving: waiting for the pipeline" in out.getvalue() and "Thread" in out.getvalue()
    finally:
        dog.stop()


def test_the_heartbeat_starts_the_clock_when_work_arrives_not_at_the_last_progress():
    dog, fired, _ = _dog(timeout=0.3)
    state = {"pending": False, "last": time.monotonic() - 100.0}    # the last progress was long ago
    beat = Heartbeat(dog, lambda: state["pending"], lambda: state["last"], "serving")
    dog.start()
    try:
        assert beat() is False
        state["pending"] = True
        beat()
        time.sleep(0.15)
        beat()
        assert fired == []                          # pending for 0.15 s only: no fire for old progress
        time.sleep(0.5)
        assert fired == [errors.EXIT_STALLED]
    finally:
        dog.stop()


def test_the_heartbeat_follows_progress_while_pending():
    dog, fired, _ = _dog(timeout=0.3)
    state = {"pending": True, "last": time.monotonic()}
    beat = Heartbeat(dog, lambda: state["pending"], lambda: state["last"], "serving")
    dog.start()
    try:
        for _ in range(10):
            state["last"] = time.monotonic()
            beat()
            time.sleep(0.1)
        assert fired == []
        state["pending"] = False
        beat()
        time.sleep(0.6)
        assert fired == []
    finally:
        dog.stop()


CHILD = """
import os, sys, time
from hpcpipe.runtime.watchdog import Watchdog
dog = Watchdog(0.5, lambda: "child", lambda code: os._exit(code), grace=0.0).start()
dog.progressed("serving: a message on its way", time.monotonic())      # pending, as a follower between messages
print("ready", flush=True)
last = time.monotonic()
while True:
    time.sleep(0.05)
    now = time.monotonic()
    if now - last > 1.0:          # resumed: the main thread gets to its message a little after the watchdog wakes
        time.sleep(0.3)
        dog.idle("serving: idle")
        print("idle", flush=True)
        time.sleep(1.0)
        sys.exit(0)
    last = now
    dog.progressed("serving: a message on its way", now)
"""


def test_time_the_whole_process_spent_stopped_is_not_a_stall():
    """A rank stopped (SIGSTOP, scontrol suspend) and resumed gets a full timeout again: it was frozen, not stuck."""
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        proc.send_signal(signal.SIGSTOP)
        time.sleep(2.0)                                 # four timeouts
        proc.send_signal(signal.SIGCONT)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and "idle" in out, (proc.returncode, err)     # was: 76 right after SIGCONT
