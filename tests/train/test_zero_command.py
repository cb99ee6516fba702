"""ZeRO-1 through the train command (issue #38): the metrics' peak optimizer bytes per rank are 1/dp of zero = 0's,
the loss and the bytes sent the same; zero = 1 with nothing to shard is one line, exit 2."""

from __future__ import annotations

import json

from support.configs import sets
from support.launch import one_error, run_command

LLAMA = {"kind": "llama", "vocab_size": 13, "seq_len": 6, "d_model": 8, "n_heads": 4, "n_kv_heads": 2, "n_blocks": 2,
         "d_ff": 12, "seed": 7}
RUN = {"model": LLAMA, "data": {"synthetic_samples": 64}, "parallel": {"pp": 1},
       "train": {"steps": 2, "micro_batches": 2, "micro_batch_size": 2, "optimizer": "adam"},
       "checkpoint": {"dir": ""}, "log": {"progress": False}}


def _last_record(tmp_path, zero: int, dp: int) -> dict:
    metrics = tmp_path / f"m-{zero}-{dp}.jsonl"
    proc = run_command(dp, "hpcpipe.train", sets(**RUN) + ["--set", f"train.zero={zero}",
                                                           "--set", f'log.metrics="{metrics}"'], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return json.loads(metrics.read_text().splitlines()[-1])


def test_peak_optimizer_bytes_per_rank_are_one_over_dp(tmp_path):
    whole = _last_record(tmp_path, 0, 4)
    for dp in (2, 4):
        sharded = _last_record(tmp_path, 1, dp)
        assert len(sharded["optimizer_bytes_by_rank"]) == dp
        # Adam's two moments of every parameter, 4 bytes each, over dp replicas (a block one element longer at most)
        assert whole["peak_optimizer_bytes"] // dp <= sharded["peak_optimizer_bytes"] <= \
            whole["peak_optimizer_bytes"] // dp + 2 * 4
        if dp == 4:
            assert abs(sharded["loss"] - whole["loss"]) <= 1e-6 * abs(whole["loss"])
            # a reduce-scatter and an allgather send what one allreduce does (ring counts, rounded per buffer)
            assert abs(sharded["sent_bytes"] - whole["sent_bytes"]) <= 1e-3 * whole["sent_bytes"]
    assert whole["optimizer_bytes_by_rank"] == [whole["peak_optimizer_bytes"]] * 4


def test_zero_with_plain_sgd_has_nothing_to_shard(tmp_path):
    proc = run_command(2, "hpcpipe.train", sets(**RUN) + ["--set", "train.zero=1", "--set", 'train.optimizer="sgd"'],
                       cwd=tmp_path)
    one_error(proc, "train.zero = 1", "train.momentum = 0.0", "nothing to shard")
