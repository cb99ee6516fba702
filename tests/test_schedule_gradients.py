"""Every schedule computes GPipe's gradients, on real MPI ranks, at several (dp, pp, virtual) layouts."""

import numpy as np
import pytest

from helpers import run_gradients, seed_draws, sub_world

SEED_MODEL = {"dims": [16] * 5, "bias": True, "activation": "relu", "final_activation": True}
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")


def _max_rel_diff(grads, ref):
    """Largest |difference| over every layer's weight and bias, over the largest |reference| value."""
    scale = max(float(np.max(np.abs(v))) for layer in ref.values() for v in layer.values())
    diff = max(float(np.max(np.abs(grads[i][k] - ref[i][k]))) for i in ref for k in ref[i])
    return diff / scale


def _compare_schedules(comm, tmp, tag, model, weights, x, y, dp, pp, micro_batches, batch, virtuals):
    """Run GPipe then every other schedule (interleaved at each virtual count); compare on rank 0."""
    base = {"parallel": {"pp": pp, "dp": dp, "schedule": "gpipe"}, "model": model,
            "train": {"micro_batches": micro_batches, "micro_batch_size": batch}}
    _, ref, _ = run_gradients(comm, tmp, f"{tag}-gpipe", base, weights, x, y)
    runs = [(s, 1) for s in SCHEDULES[1:]] + [("interleaved-1f1b", v) for v in virtuals]
    for schedule, v in runs:
        sections = {**base, "parallel": {"pp": pp, "dp": dp, "schedule": schedule, "virtual_stages": v}}
        loss, grads, _ = run_gradients(comm, tmp, f"{tag}-{schedule}-{v}", sections, weights, x, y)
        if comm.Get_rank() == 0:
            assert sorted(grads) == sorted(ref)
            rel = _max_rel_diff(grads, ref)
            assert rel <= 1e-5, f"{schedule} v={v} dp={dp} pp={pp}: max |grad - gpipe| = {rel:.3g} x max |grad|"


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("dp,pp,virtuals", [(1, 4, ()), (2, 2, (2,)), (1, 2, (2,)), (2, 4, ())])
def test_seed_example6_every_schedule_matches_gpipe(world, shared_tmp, dp, pp, virtuals):
    comm = sub_world(world, dp * pp)
    if comm is None:
        return
    w, b, x, y = seed_draws(micro_batches=8)
    weights = {i: {"weight": w[i], "bias": b[i]} for i in range(4)}
    # 32 samples: 8 micro-batches of 4 (dp=1) or of 2 per replica (dp=2)
    _compare_schedules(comm, shared_tmp, f"ex6-{dp}x{pp}", SEED_MODEL, weights, x.reshape(-1, 16),
                       y.reshape(-1, 16), dp, pp, 8, 4 // dp, virtuals)
    comm.Free()


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("dp,pp,virtuals", [(1, 8, (2,)), (2, 4, (2, 3)), (4, 2, (3,)), (8, 1, (2,))])
def test_random_16_layer_model_every_schedule_matches_gpipe(world, shared_tmp, dp, pp, virtuals):
    comm = sub_world(world, dp * pp)
    if comm is None:
        return
    rng = np.random.default_rng(16)
    dims = [int(d) for d in rng.integers(5, 20, size=17)]
    model = {"dims": dims, "bias": True, "activation": "tanh", "final_activation": False}
    weights = {i: {"weight": (rng.standard_normal((dims[i], dims[i + 1])) / np.sqrt(dims[i])).astype(np.float32),
                   "bias": (0.1 * rng.standard_normal(dims[i + 1])).astype(np.float32)} for i in range(16)}
    micro_batches, batch = 8, 3
    n = dp * micro_batches * batch
    x = rng.standard_normal((n, dims[0])).astype(np.float32)
    y = rng.standard_normal((n, dims[-1])).astype(np.float32)
    _compare_schedules(comm, shared_tmp, f"r16-{dp}x{pp}", model, weights, x, y, dp, pp, micro_batches, batch,
                       virtuals)
    comm.Free()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("micro_batches", [2, 6])
def test_engine_counts_stashed_activations_per_stage(world, micro_batches):
    """The engine's measured peak: GPipe holds m micro-batches, 1F1B min(pp - stage, m), as simulated."""
    from hpcpipe.config import from_dict
    from hpcpipe.simulate import simulate_schedule
    from hpcpipe.trainer import Trainer, plan

    comm = sub_world(world, 4)
    if comm is None:
        return
    for schedule, expected in (("gpipe", [micro_batches] * 4),
                               ("1f1b", [min(4 - s, micro_batches) for s in range(4)]),
                               ("zb-h1", simulate_schedule("zb-h1", 4, micro_batches).peak_stashed)):
        cfg = from_dict({"parallel": {"pp": 4, "dp": 1, "schedule": schedule},
                         "train": {"micro_batches": micro_batches, "micro_batch_size": 3}, "log": {"progress": False}})
        trainer = Trainer(plan(cfg, 4), comm)
        trainer.compute_gradients(0)
        stats = trainer.last_stats
        stage = trainer.topo.pp_rank
        assert stats.peak_stashed_stage == {stage: expected[stage]}, (schedule, stage)
        # one 16-wide ReLU layer per stage: a micro-batch stashes its 3 x 16 float32 input and output
        assert stats.peak_stash_bytes == expected[stage] * 2 * 3 * 16 * 4, (schedule, stage)
        assert stats.peak_stash_bytes_stage == {stage: stats.peak_stash_bytes}
        trainer.close()
    comm.Free()
