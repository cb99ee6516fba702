"""``mpiexec -n N python -m hpcpipe.plan.calibration_runs SPEC.json``: the engine calibration's runs, in one launch.

SPEC lists runs, each a full config (``hpcpipe.train``'s, with ``train.steps``) and the
trace file to write. They run in the given order, each with the real engine (the train
command's Plan and Trainer, traced), one after the other in the same processes. On
this VM one launch of a job computes 10-30 % faster or slower than the next launch of
the same job (which physical pages its arrays get), and starting the ranks costs about
two seconds: in one launch that speed falls on every layout alike, so the layouts'
factors compare like with like, and the planner can afford two runs of each.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str] | None = None) -> int:
    """Run every calibration run of SPEC.json in turn; any rank's failure aborts the launch (exit 1)."""
    args = sys.argv[1:] if argv is None else argv
    with open(args[0]) as f:
        spec = json.load(f)
    from mpi4py import MPI

    from hpcpipe.config import from_dict
    from hpcpipe.runtime.comm import abort
    from hpcpipe.train.loop import write_trace
    from hpcpipe.train.trainer import Trainer, plan

    world = MPI.COMM_WORLD
    try:
        for run in spec["runs"]:
            config = from_dict(run["config"])
            trainer = Trainer(plan(config, world.Get_size()), world, record_events=True)
            traced = []
            for step in range(config.train.steps):
                trainer.train_step(step)
                traced.append((step, trainer.last_stats.events))
            write_trace(run["trace"], world, traced, trainer.topo.name)
            trainer.close()
    except Exception as exc:   # one rank's failure must not leave the others waiting in a collective
        print(f"hpcpipe.plan.calibration_runs: rank {world.Get_rank()}: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)
        abort(world, 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
