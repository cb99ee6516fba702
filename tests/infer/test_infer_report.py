"""The inference summary's arithmetic (issue 40): fill and drain that overlap (too few micro-batches for a steady
state) are counted once, never "117.7% of the run", and the idle share is called what it is."""

from __future__ import annotations

import numpy as np

from hpcpipe.infer.report import format_summary, summarize


def _parts(pp: int, k: int, compute: float = 1.0, link: float = 0.5) -> list[dict]:
    """One replica of pp stages streaming k micro-batches: read (link), compute, write/send (link) each."""
    parts, free = [], [0.0] * pp
    for s in range(pp):
        events = []
        for m in range(k):
            ready = max(free[s], (parts[s - 1]["events"][m, 4] if s else 0.0))
            start = ready + link
            events.append([ready, start, start, start + compute, start + compute + link])
            free[s] = start + compute
        parts.append({"dp_rank": 0, "pp_rank": s, "mbs": list(range(k)), "events": np.array(events),
                      "start": 0.0, "end": events[-1][4], "recv_wait": 0.0, "send_wait": 0.0, "cpu_s": 0.0})
    return parts


def test_fill_and_drain_together_never_pass_the_run():
    one = summarize(_parts(pp=4, k=1), n_rows=4, batch=4, dp=1, pp=4)
    assert one["fill_ms"] + one["drain_ms"] > one["elapsed_s"] * 1e3      # they overlap: the first stage is done early
    assert 0 < one["fill_drain_fraction"] <= 1.0                          # was (fill + drain) / elapsed: 1.4 here
    many = summarize(_parts(pp=4, k=32), n_rows=128, batch=4, dp=1, pp=4)
    assert many["fill_drain_fraction"] == (many["fill_ms"] + many["drain_ms"]) / 1e3 / many["elapsed_s"]


def test_the_summary_calls_non_compute_time_idle_beside_the_ideal_bubble():
    line = format_summary({**summarize(_parts(pp=4, k=1), n_rows=4, batch=4, dp=1, pp=4)})
    assert "(together 100.0% of the run)" in line
    assert "ranks idle" in line and "the pipeline bubble, ideally 75.0%" in line
