"""The progress line every long command shares (runtime/progress.py), and `evaluate`'s (issue #32).

`evaluate` ran a minute without output, the planner showed three lines in four minutes and training's
line had no elapsed time or ETA: now each reports through one helper, on stderr, redrawn with '\\r' only
on a terminal and as plain lines at most every few seconds elsewhere.
"""

from __future__ import annotations

import io
import json

import h5py
import numpy as np

from hpcpipe import evaluate
from hpcpipe.runtime import progress as progress_module
from hpcpipe.runtime.progress import Progress, clock_text, eta_seconds, timing_text
from hpcpipe.state.weights import write_weights


class Clock:
    """A clock the test moves."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_elapsed_and_eta_texts():
    assert clock_text(0) == "0:00" and clock_text(75.4) == "1:15" and clock_text(3 * 3600 + 62) == "3:01:02"
    assert eta_seconds(10.0, 0.25) == 30.0 and eta_seconds(10.0, 0.0) is None and eta_seconds(5.0, None) is None
    assert timing_text(12, 0.5) == "elapsed 0:12 ETA 0:12" and timing_text(12, None) == "elapsed 0:12"


def test_plain_lines_wait_a_few_seconds_then_come_at_most_every_few_seconds(monkeypatch):
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE", raising=False)
    clock, out = Clock(), io.StringIO()
    p = Progress(out, every_s=5.0, enabled=True, clock=clock)
    for step in range(1, 31):           # 30 updates, one every half second: 15 s
        clock.now += 0.5
        p.show(f"work {step}/30", step / 30)
    p.close("work done")
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines == ["work 10/30 elapsed 0:05 ETA 0:10", "work 20/30 elapsed 0:10 ETA 0:05",
                     "work 30/30 elapsed 0:15 ETA 0:00", "work done elapsed 0:15 ETA 0:00"]


def test_a_quick_job_prints_nothing():
    clock, out = Clock(), io.StringIO()
    p = Progress(out, every_s=5.0, enabled=True, clock=clock)
    clock.now += 1.0
    p.show("work 1/1", 1.0)
    p.close("work done")
    assert out.getvalue() == ""


def test_a_terminal_is_redrawn_in_place_and_the_line_ended(monkeypatch):
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE", raising=False)
    clock, out = Clock(), Terminal()
    p = Progress(out, every_s=1.0, enabled=True, clock=clock)
    assert p.tty
    for step in range(1, 9):
        clock.now += 0.5
        p.show(f"step {step}/8", step / 8)
    p.close()
    text = out.getvalue()
    assert text.startswith("\rstep 2/8 elapsed 0:01 ETA 0:03") and text.endswith("\n") and text.count("\n") == 1
    assert text.count("\r") == 7           # after the first second, every update (at most 4 a second) redraws


def test_other_ranks_write_nothing(monkeypatch):
    monkeypatch.setenv("PMI_RANK", "3")
    out = io.StringIO()
    p = Progress(out, every_s=0)
    p.show("step 1/1", 1.0, force=True)
    p.close("done")
    assert out.getvalue() == ""


def test_evaluate_shows_its_progress_on_stderr(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(progress_module, "PLAIN_EVERY_S", 0.0)      # every chunk gets its line
    monkeypatch.setattr(evaluate, "CHUNK_ROWS", 10)
    monkeypatch.delenv("PMI_RANK", raising=False)
    rng = np.random.default_rng(0)
    weights = tmp_path / "w.h5"
    write_weights(weights, {0: {"weight": rng.standard_normal((4, 3)).astype(np.float32),
                                "bias": np.zeros(3, np.float32)}}, n_layers=1)
    data = tmp_path / "d.h5"
    with h5py.File(data, "w") as f:
        f["x"] = rng.standard_normal((25, 4)).astype(np.float32)
        f["y"] = rng.integers(0, 3, 25)
    assert evaluate.main(["--weights", str(weights), "--data", str(data)]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["n"] == 25
    lines = err.splitlines()
    assert [line.split(" elapsed")[0] for line in lines] == [
        "hpcpipe.evaluate: 10/25 rows", "hpcpipe.evaluate: 20/25 rows", "hpcpipe.evaluate: 25/25 rows",
        "hpcpipe.evaluate: 25 rows"]
    assert "ETA" in lines[0]
