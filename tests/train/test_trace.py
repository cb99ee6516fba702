"""Chrome traces from real ranks: one track per rank, every action of the program once per step."""

import json
import os

import pytest
from support.training import sub_world


@pytest.mark.mpi(min_size=2)
def test_trace_has_one_track_per_rank_and_every_action(world, shared_tmp):
    from hpcpipe.config import from_dict
    from hpcpipe.schedule.calibrate import costs_from_trace
    from hpcpipe.trace import measured_events
    from hpcpipe.train.loop import write_trace
    from hpcpipe.train.setup import prepare
    from hpcpipe.train.trainer import Trainer

    comm = sub_world(world, 2)
    if comm is None:
        return
    cfg = from_dict({"parallel": {"pp": 2, "dp": 1, "schedule": "zb-h1"},
                     "train": {"micro_batches": 4, "micro_batch_size": 2}, "log": {"progress": False}})
    p = prepare(cfg, 2)
    trainer = Trainer(p, comm, record_events=True)
    traced = []
    for step in range(2):
        trainer.train_step(step)
        traced.append((step, trainer.last_stats.events))
    path = os.path.join(shared_tmp, "trace.json")
    write_trace(path, comm, traced, trainer.topo.name)
    trainer.close()
    if comm.Get_rank() == 0:
        data = json.load(open(path))["traceEvents"]
        names = {e["tid"]: e["args"]["name"] for e in data if e["ph"] == "M"}
        assert names == {0: "dp00-pp00", 1: "dp00-pp01"}
        for rank in (0, 1):
            for step in (0, 1):
                got = [e["name"] for e in data if e["ph"] == "X" and e["tid"] == rank and e["args"]["step"] == step]
                assert got == [str(a) for a in p.programs[rank]]
        assert all(e["dur"] >= 0 and e["args"]["cpu_us"] >= 0 for e in data if e["ph"] == "X")
        assert costs_from_trace(path).forward > 0
        assert len(measured_events(path)) == 2
    comm.Free()
