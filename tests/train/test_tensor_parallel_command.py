"""The real training command at tp = 2: the metrics report the seconds of tensor-parallel collectives per step
(``tp_comm_s``, the slowest rank's), the trace holds them as spans, the losses equal the tp = 1 run's, and
``train --help`` tells how to ask for tensor parallelism."""

from __future__ import annotations

import json

from support.launch import run_module, train
from support.state import metrics_losses

GPT = {"kind": "gpt", "vocab_size": 13, "seq_len": 6, "d_model": 8, "n_heads": 4, "n_blocks": 2, "d_ff": 12,
       "dtype": "float64"}


def _sections(tmp, tp: int, trace: bool) -> dict:
    log = {"progress": False, "metrics": str(tmp / f"m{tp}.jsonl")} | ({"trace": str(tmp / "t.json")} if trace else {})
    return {"parallel": {"dp": 1, "pp": 1, "tp": tp}, "model": GPT, "data": {"synthetic_samples": 16},
            "train": {"micro_batches": 2, "micro_batch_size": 2, "steps": 3}, "checkpoint": {"dir": ""}, "log": log}


def test_tp_comm_seconds_in_metrics_and_trace_and_losses_equal_tp_1(tmp_path):
    one = train(1, _sections(tmp_path, 1, False), cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    two = train(2, _sections(tmp_path, 2, True), cwd=tmp_path)
    assert two.returncode == 0, two.stderr
    records = [json.loads(line) for line in open(tmp_path / "m2.jsonl")]
    assert len(records) == 3 and all(r["tp_comm_s"] > 0 for r in records)
    assert all("tp_comm_s" not in json.loads(line) for line in open(tmp_path / "m1.jsonl"))
    want, got = metrics_losses(tmp_path / "m1.jsonl"), metrics_losses(tmp_path / "m2.jsonl")
    assert all(abs(got[s] - want[s]) <= 1e-12 * abs(want[s]) for s in want)
    spans = [e for e in json.load(open(tmp_path / "t.json"))["traceEvents"] if e.get("name") == "tp allreduce"]
    # per step and rank, micro-batch: a block's two sums forward and two backward (2 blocks), plus the embedding
    # lookup's, the loss's and the head's; the same on both ranks every step
    counts = {(e["tid"], e["args"]["step"]): 0 for e in spans}
    for e in spans:
        counts[(e["tid"], e["args"]["step"])] += 1
    assert sorted(counts) == [(t, s) for t in (0, 1) for s in (0, 1, 2)], counts
    assert len(set(counts.values())) == 1 and min(counts.values()) > 2 * 2 * 2 * 2, counts


def test_train_help_names_tensor_parallelism():
    proc = run_module("hpcpipe.train", "--help")
    assert proc.returncode == 0 and "parallel.tp" in proc.stdout
