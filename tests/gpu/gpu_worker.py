"""The GPU checks' worker, run under mpiexec by tests/gpu (through tests/support/gpu.run_worker):

    mpiexec -n N python tests/gpu/gpu_worker.py TASK SPEC.json OUT_DIR

gradients   for each run of the spec (config sections + backend): one step's loss and gradients at the run's
            layout; rank 0 writes OUT_DIR/<run>.npz ('group/name' keys) and the result JSON (losses, backends
            really used, host<->device bytes of the step summed over ranks)
checkpoint  for each (saver, loader) backend pair: train 2 steps on the saver, save, resume on the loader;
            rank 0 writes whether parameters and optimizer state came back bit for bit

Every rank takes part in every Trainer (collectives); only rank 0 writes files.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np


def _trainer(world, sections: dict, backend: str, keep_input_grads: bool = False):
    from hpcpipe.config import from_dict
    from hpcpipe.train.setup import prepare
    from hpcpipe.train.trainer import Trainer
    sections = {k: dict(v) for k, v in sections.items()}
    sections.setdefault("run", {})["backend"] = backend
    sections.setdefault("log", {})["progress"] = False
    trainer = Trainer(prepare(from_dict(sections), world.Get_size()), world, keep_input_grads=keep_input_grads)
    if trainer.backend.name != backend:
        raise SystemExit(f"asked for run.backend {backend!r}, the trainer computes on {trainer.backend.name!r}")
    return trainer


def _flat(nested: dict, prefix: str = "") -> dict[str, np.ndarray]:
    """{group: {name: array}} (or deeper) as {'group/name': array}."""
    out = {}
    for key, value in nested.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, name + "/"))
        else:
            out[name] = np.asarray(value)
    return out


def gradients(world, spec: dict, out: str) -> dict:
    """One step's loss and gradients of every run in the spec; arrays into OUT_DIR/<run>.npz."""
    result = {}
    for run in spec["runs"]:
        trainer = _trainer(world, run["sections"], run["backend"], run.get("keep_input_grads", False))
        try:
            loss = trainer.compute_gradients(0)
            grads = trainer.gather("grads")
            moved = world.reduce(trainer.last_host_device_bytes, root=0)
            inputs = trainer.input_gradients() if run.get("keep_input_grads") and trainer.first else None
            parts = world.gather((trainer.topo.dp_rank, inputs) if inputs is not None else None, root=0)
        finally:
            trainer.close()
        if world.Get_rank() == 0:
            arrays = _flat(grads)
            for dp_rank, per_mb in (p for p in parts if p is not None):
                for m, g in enumerate(per_mb):
                    arrays[f"input/{dp_rank}/{m}"] = np.asarray(g)
            np.savez(os.path.join(out, f"{run['name']}.npz"), **arrays)
            result[run["name"]] = {"loss": loss, "backend": run["backend"], "host_device_bytes": moved}
    return result


def _equal(a: dict, b: dict) -> list[str]:
    """Keys whose arrays differ in shape, dtype or any bit (missing keys count)."""
    fa, fb = _flat(a), _flat(b)
    bad = sorted(set(fa) ^ set(fb))
    for key in sorted(set(fa) & set(fb)):
        x, y = fa[key], fb[key]
        if x.shape != y.shape or x.dtype != y.dtype or x.tobytes() != y.tobytes():
            bad.append(key)
    return bad


def checkpoint(world, spec: dict, out: str) -> dict:
    """Save on one backend, resume on the other: which parameters and optimizer states differ (none, we hope)."""
    result = {}
    for index, (saver, loader) in enumerate(spec["pairs"]):
        directory = os.path.join(out, f"ck{index}-{saver}-to-{loader}")
        sections = {k: dict(v) for k, v in spec["sections"].items()}
        sections["checkpoint"] = {"dir": directory, "keep": 2}
        sections.setdefault("train", {})["steps"] = 3
        first = _trainer(world, sections, saver)
        try:
            losses = [first.train_step(s) for s in range(2)]
            first.save_checkpoint(2)
            want = (first.gather("params"), first.gather("optimizer"))
        finally:
            first.close()
        world.Barrier()     # rank 0 has released the run directory's lock before any rank checks it again
        sections["checkpoint"]["resume"] = True
        second = _trainer(world, sections, loader)
        try:
            got = (second.gather("params"), second.gather("optimizer"))
            step = second.start_step
        finally:
            second.close()
        if world.Get_rank() == 0:
            result[f"{index}: {saver} -> {loader}"] = {"losses": losses, "resumed_at": step,
                                            "params_differ": _equal(got[0], want[0]),
                                            "optimizer_differ": _equal(got[1], want[1]),
                                            "params": len(_flat(want[0]))}
    return result


TASKS = {"gradients": gradients, "checkpoint": checkpoint}


def main() -> None:
    """Run the task the command line names; rank 0 writes OUT_DIR/<task>-result.json."""
    task, spec_path, out = sys.argv[1:4]
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    with open(spec_path) as f:
        spec = json.load(f)
    try:
        result = TASKS[task](world, spec, out)
    except BaseException:   # one rank's failure must end the job, not leave the others waiting in a collective
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        world.Abort(3)
    if world.Get_rank() == 0:
        with open(os.path.join(out, f"{task}-result.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
