"""The planner's tests: a profile with chosen costs, so the search can be checked against hand arithmetic."""

from __future__ import annotations

from hpcpipe.config import from_dict
from hpcpipe.nn.registry import model_def
from hpcpipe.plan.layer_profile import group_signature
from hpcpipe.profiles.comm_model import CommModel
from hpcpipe.profiles.profile import Profile

SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


def mlp_config(dims, **train):
    """An MLP config (float32, SGD) with the given widths and [train] keys."""
    return from_dict({"model": {"dims": list(dims)}, "parallel": {"pp": 1}, "train": {"optimizer": "sgd", **train},
                      "checkpoint": {"dir": ""}})


def synthetic_profile(config, per_row: dict[int, float], stash_per_row: float = 1000.0,
                      latency: float = 0.0, per_byte: float = 0.0, baseline: int = 50 << 20) -> Profile:
    """A profile where group i's F costs per_row[i] seconds per row, I and W each as much, B twice; free messages."""
    model = model_def(config)
    groups = {}
    for i in range(model.n_layers):
        key = group_signature(model, i)
        f = per_row[i]
        groups[key] = {"index": i, "params": model.specs[i].n_params,
                       "F": {str(s): f * s for s in SIZES}, "I": {str(s): f * s for s in SIZES},
                       "W": {str(s): f * s for s in SIZES}, "B": {str(s): 2 * f * s for s in SIZES},
                       "stash_bytes": {str(s): stash_per_row * s for s in SIZES},
                       "work_bytes": {str(s): stash_per_row * s for s in SIZES}}
    optimizer = {"seconds_per_param": 0.0, "work_bytes_per_param": 0.0, "state_buffers": 0}
    layers = {"groups": groups, "signatures": [group_signature(model, i) for i in range(model.n_layers)],
              "optimizer": {name: optimizer for name in ("sgd", "sgd+momentum", "adam", "adamw")},
              "blas_rss_bytes": 0, "backend": "numpy"}
    comm = CommModel(latency, per_byte, latency, per_byte, baseline, "test")
    return Profile({"key": {}, "layers": layers, "comm": comm.to_dict()}, comm)
