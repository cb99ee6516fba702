"""Every schedule computes GPipe's gradients, on real MPI ranks, at several (dp, pp, virtual) layouts."""

import numpy as np
import pytest
from support.training import run_gradients, seed_draws, sub_world

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


def _random_16_layer(seed: int = 16):
    rng = np.random.default_rng(seed)
    dims = [int(d) for d in rng.integers(5, 20, size=17)]
    model = {"dims": dims, "bias": True, "activation": "tanh", "final_activation": False}
    weights = {i: {"weight": (rng.standard_normal((dims[i], dims[i + 1])) / np.sqrt(dims[i])).astype(np.float32),
                   "bias": (0.1 * rng.standard_normal(dims[i + 1])).astype(np.float32)} for i in range(16)}
    return rng, dims, model, weights


def _compare_zbv(comm, tmp, tag, model, weights, x, y, dp, pp, micro_batches, batch):
    """GPipe, then ZB-V (two chunks per rank in a V) at the same layout; compare on rank 0."""
    base = {"parallel": {"pp": pp, "dp": dp, "schedule": "gpipe"}, "model": model,
            "train": {"micro_batches": micro_batches, "micro_batch_size": batch}}
    _, ref, _ = run_gradients(comm, tmp, f"{tag}-gpipe", base, weights, x, y)
    sections = {**base, "parallel": {"pp": pp, "dp": dp, "schedule": "zb-v", "virtual_stages": 2}}
    _, grads, _ = run_gradients(comm, tmp, f"{tag}-zb-v", sections, weights, x, y)
    if comm.Get_rank() == 0:
        assert sorted(grads) == sorted(ref)
        rel = _max_rel_diff(grads, ref)
        assert rel <= 1e-5, f"zb-v dp={dp} pp={pp}: max |grad - gpipe| = {rel:.3g} x max |grad|"


# The seed model has 4 layers: ZB-V's 2 x pp stages fit only at pp = 2 (pp = 4 needs 8 layers).
@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("dp,pp", [(1, 2), (2, 2)])
def test_zbv_matches_gpipe_on_seed_example6(world, shared_tmp, dp, pp):
    comm = sub_world(world, dp * pp)
    if comm is None:
        return
    w, b, x, y = seed_draws(micro_batches=8)
    weights = {i: {"weight": w[i], "bias": b[i]} for i in range(4)}
    _compare_zbv(comm, shared_tmp, f"zbv-ex6-{dp}x{pp}", SEED_MODEL, weights, x.reshape(-1, 16),
                 y.reshape(-1, 16), dp, pp, 8, 4 // dp)
    comm.Free()


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("dp,pp,micro_batches", [(1, 2, 8), (2, 2, 5), (1, 4, 8), (2, 4, 3), (1, 8, 8)])
def test_zbv_matches_gpipe_on_random_16_layer_model(world, shared_tmp, dp, pp, micro_batches):
    comm = sub_world(world, dp * pp)
    if comm is None:
        return
    rng, dims, model, weights = _random_16_layer()
    batch = 3
    n = dp * micro_batches * batch
    x = rng.standard_normal((n, dims[0])).astype(np.float32)
    y = rng.standard_normal((n, dims[-1])).astype(np.float32)
    _compare_zbv(comm, shared_tmp, f"zbv-r16-{dp}x{pp}", model, weights, x, y, dp, pp, micro_batches, batch)
    comm.Free()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("micro_batches", [2, 6])
def test_engine_counts_stashed_activations_per_stage(world, micro_batches):
    """The engine's measured peak: GPipe holds m micro-batches, 1F1B min(pp - stage, m), as simulated."""
    from hpcpipe.config import from_dict
    from hpcpipe.schedule.event_sim import simulate_schedule
    from hpcpipe.train.setup import prepare
    from hpcpipe.train.trainer import Trainer

    comm = sub_world(world, 4)
    if comm is None:
        return
    for schedule, expected in (("gpipe", [micro_batches] * 4),
                               ("1f1b", [min(4 - s, micro_batches) for s in range(4)]),
                               ("zb-h1", simulate_schedule("zb-h1", 4, micro_batches).peak_stashed)):
        cfg = from_dict({"parallel": {"pp": 4, "dp": 1, "schedule": schedule},
                         "train": {"micro_batches": micro_batches, "micro_batch_size": 3}, "log": {"progress": False}})
        trainer = Trainer(prepare(cfg, 4), comm)
        trainer.compute_gradients(0)
        stats = trainer.last_stats
        stage = trainer.topo.pp_rank
        assert stats.peak_stashed_stage == {stage: expected[stage]}, (schedule, stage)
        # one 16-wide ReLU layer per stage: a micro-batch stashes its 3 x 16 float32 input and output
        assert stats.peak_stash_bytes == expected[stage] * 2 * 3 * 16 * 4, (schedule, stage)
        assert stats.peak_stash_bytes_stage == {stage: stats.peak_stash_bytes}
        trainer.close()
    comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("micro_batches", [2, 6])
def test_engine_counts_zbv_stash_as_simulated(world, micro_batches):
    """ZB-V on 2 ranks (4 one-layer stages in a V): the engine's per-stage and per-rank peaks are the simulator's."""
    from hpcpipe.config import from_dict
    from hpcpipe.schedule.event_sim import simulate_schedule
    from hpcpipe.train.setup import prepare
    from hpcpipe.train.trainer import Trainer

    comm = sub_world(world, 2)
    if comm is None:
        return
    sim = simulate_schedule("zb-v", 2, micro_batches, 2)
    cfg = from_dict({"parallel": {"pp": 2, "dp": 1, "schedule": "zb-v", "virtual_stages": 2},
                     "train": {"micro_batches": micro_batches, "micro_batch_size": 3}, "log": {"progress": False}})
    trainer = Trainer(prepare(cfg, 2), comm)
    trainer.compute_gradients(0)
    stats = trainer.last_stats
    rank = trainer.topo.pp_rank
    mine = {rank, 3 - rank}                       # stages r and 2p - 1 - r
    assert stats.peak_stashed_stage == {s: sim.peak_stashed_stage[s] for s in mine}
    assert stats.peak_stashed == sim.peak_stashed[rank]
    trainer.close()
    comm.Free()
