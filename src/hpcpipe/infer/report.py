"""Inference report and trace: per-rank micro-batch timestamps -> throughput, latency, fill/drain, bubble.

Every rank hands in its (K, 5) timestamps (see
:data:`hpcpipe.infer.stream.EVENT_FIELDS`) already shifted to world rank
0's clock. Definitions (all wall clock):

* elapsed: from the first rank leaving the start barrier to the last rank
  finishing (last row written, last send completed); rows/s = N / elapsed.
* latency of micro-batch m: from its first stage starting to read it to its
  last stage having written it (p50, p99, max over all micro-batches).
* fill: per replica, from the first stage starting its first micro-batch to
  the last stage starting to compute it; drain: from the first stage
  finishing its last compute to the last stage having written the last
  micro-batch. Reported as the mean over replicas and, together, as a
  fraction of elapsed: with too few micro-batches for a steady state the
  two overlap (the first stage is done before the last one starts), and the
  overlap counts once, so the fraction never passes 100 %.
* idle (the report's ``bubble``): the share of rank time not spent
  computing, ``1 - sum(compute time over ranks) / (ranks x elapsed)``: the
  pipeline bubble plus reading, writing and messages, which dominate a
  small model; the ideal GPipe bubble ``(pp - 1) / (K + pp - 1)`` (K =
  micro-batches per replica) is printed beside it. With more ranks than cores, compute intervals include
  time a rank waited for a core, so the measured bubble shrinks toward 0
  while the throughput tells the truth.
* cpu_s: CPU seconds all ranks used while streaming; cpu_s / elapsed is
  how many cores the run actually got (less than expected = the machine
  was busy with something else).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def summarize(parts: list[dict[str, Any]], n_rows: int, batch: int, dp: int, pp: int) -> dict[str, Any]:
    """Return the report of one run from every rank's part (rank 0)."""
    start = min(p["start"] for p in parts)
    end = max(p["end"] for p in parts)
    elapsed = max(end - start, 1e-12)
    first_in: dict[int, float] = {}
    last_out: dict[int, float] = {}
    compute = 0.0
    stage_compute = np.zeros(pp)
    fills, drains = [], []
    by_cell = {(p["dp_rank"], p["pp_rank"]): p for p in parts}
    for p in parts:
        ev = p["events"]
        busy = float(np.sum(ev[:, 3] - ev[:, 2])) if len(ev) else 0.0
        compute += busy
        stage_compute[p["pp_rank"]] += busy / dp
        if p["pp_rank"] == 0:
            first_in.update(zip(p["mbs"], ev[:, 0], strict=True))
        if p["pp_rank"] == pp - 1:
            last_out.update(zip(p["mbs"], ev[:, 4], strict=True))
    spans = []
    for d in range(dp):
        head, tail = by_cell[(d, 0)]["events"], by_cell[(d, pp - 1)]["events"]
        if len(head):
            fill_at, drain_at = (head[0, 0], tail[0, 2]), (head[-1, 3], tail[-1, 4])
            fills.append(fill_at[1] - fill_at[0])
            drains.append(drain_at[1] - drain_at[0])
            # with few micro-batches the first stage finishes before the last starts: the two overlap, once
            overlap = max(0.0, min(fill_at[1], drain_at[1]) - max(fill_at[0], drain_at[0]))
            spans.append(fills[-1] + drains[-1] - overlap)
    latencies = np.array([last_out[m] - first_in[m] for m in sorted(first_in)]) * 1e3
    k = max((len(p["mbs"]) for p in parts), default=0)
    fill = float(np.mean(fills)) if fills else 0.0
    drain = float(np.mean(drains)) if drains else 0.0

    def pct(q: float) -> float:
        return float(np.percentile(latencies, q)) if len(latencies) else 0.0

    return {
        "rows": n_rows, "micro_batch_size": batch, "micro_batches": len(first_in), "micro_batches_per_replica": k,
        "dp": dp, "pp": pp, "ranks": len(parts), "elapsed_s": elapsed, "rows_per_s": n_rows / elapsed,
        "latency_ms": {"p50": pct(50), "p99": pct(99), "max": float(latencies.max()) if len(latencies) else 0.0,
                       "mean": float(latencies.mean()) if len(latencies) else 0.0},
        "fill_ms": fill * 1e3, "drain_ms": drain * 1e3,
        "fill_drain_fraction": min(1.0, float(np.mean(spans)) / elapsed) if spans else 0.0,
        "bubble": max(0.0, 1.0 - compute / (len(parts) * elapsed)),
        "ideal_bubble": (pp - 1) / (k + pp - 1) if k else 0.0,
        "stage_compute_s": [float(v) for v in stage_compute],
        "recv_wait_s": float(sum(p["recv_wait"] for p in parts)),
        "send_wait_s": float(sum(p["send_wait"] for p in parts)),
        "cpu_s": float(sum(p["cpu_s"] for p in parts)),
    }


def format_summary(report: dict[str, Any]) -> str:
    """Return the one-line human summary rank 0 prints."""
    r, lat = report, report["latency_ms"]
    return (f"hpcpipe: inferred {r['rows']} rows in {r['elapsed_s']:.3f} s: {r['rows_per_s']:.0f} rows/s "
            f"(dp={r['dp']} pp={r['pp']}, {r['micro_batches']} micro-batches of {r['micro_batch_size']}); "
            f"latency p50 {lat['p50']:.1f} ms p99 {lat['p99']:.1f} ms; fill {r['fill_ms']:.1f} ms "
            f"drain {r['drain_ms']:.1f} ms (together {100 * r['fill_drain_fraction']:.1f}% of the run); ranks "
            f"idle {100 * r['bubble']:.1f}% of the run (reading, writing, messages and the pipeline bubble, "
            f"ideally {100 * r['ideal_bubble']:.1f}%)")
