"""run.tf32 through runtime.backend (NumPy: ignored with a note; CuPy: both cuBLAS paths set, checked on a stand-in
module here and on the real CuPy in tests/gpu), the trainer's per-step host<->device bytes, and the squared
gradient norm under tensor parallelism taken with one host copy instead of one per parameter."""

from types import SimpleNamespace

import numpy as np
import pytest

from hpcpipe.runtime import backend as backend_mod
from hpcpipe.runtime.backend import (
    CUBLAS_DEFAULT_MATH,
    CUBLAS_TF32_TENSOR_OP_MATH,
    TF32_IGNORED,
    select_backend,
    set_tf32,
    tf32_state,
)


def test_numpy_ignores_tf32_with_a_note():
    assert set_tf32(np, True) == TF32_IGNORED
    assert set_tf32(np, False) == ""
    on = select_backend("numpy", tf32=True)
    assert on.name == "numpy" and not on.tf32 and on.notes == (TF32_IGNORED,)
    off = select_backend("numpy")
    assert off.notes == () and not off.tf32
    assert tf32_state(np) == {"backend": "numpy", "tf32": False}


class _FakeCupy:
    """Just what set_tf32 and tf32_state reach of CuPy 14: the float32 compute type and the handle's math mode."""

    __name__ = "cupy"

    def __init__(self):
        self.compute = {}
        self.mode = {7: CUBLAS_DEFAULT_MATH}
        linalg = SimpleNamespace(COMPUTE_TYPE_DEFAULT=1, COMPUTE_TYPE_TF32=7,
                                 compute_type_to_str=lambda t: {1: "COMPUTE_TYPE_DEFAULT", 7: "COMPUTE_TYPE_TF32"}[t])
        self._core = SimpleNamespace(_routines_linalg=linalg,
                                     set_compute_type=lambda dtype, t: self.compute.__setitem__(np.dtype(dtype), t),
                                     get_compute_type=lambda dtype: self.compute.get(np.dtype(dtype), 1))
        cublas = SimpleNamespace(setMathMode=lambda h, m: self.mode.__setitem__(h, m),
                                 getMathMode=lambda h: self.mode[h])
        self.cuda = SimpleNamespace(cublas=cublas, get_cublas_handle=lambda: 7)


def test_cupy_tf32_sets_compute_type_and_math_mode_and_back():
    cp = _FakeCupy()
    assert set_tf32(cp, True) == ""
    assert cp.compute[np.dtype(np.float32)] == 7 and cp.mode[7] == CUBLAS_TF32_TENSOR_OP_MATH
    assert tf32_state(cp) == {"backend": "cupy", "compute_type": "COMPUTE_TYPE_TF32", "math_mode": 3, "tf32": True}
    set_tf32(cp, False)
    assert cp.compute[np.dtype(np.float32)] == 1 and cp.mode[7] == CUBLAS_DEFAULT_MATH
    assert tf32_state(cp)["tf32"] is False


def test_select_backend_passes_tf32_to_cupy(monkeypatch):
    """With a GPU visible, select_backend applies run.tf32 (on and off) to the CuPy module it returns."""
    import sys
    cp = _FakeCupy()
    cp.cuda.Device = lambda i: SimpleNamespace(use=lambda: None)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(backend_mod, "_gpu_count", lambda: 1)
    on = select_backend("cupy", node_rank=0, tf32=True)
    assert on.name == "cupy" and on.tf32 and on.notes == () and cp.mode[7] == CUBLAS_TF32_TENSOR_OP_MATH
    off = select_backend("auto", node_rank=0)
    assert not off.tf32 and cp.mode[7] == CUBLAS_DEFAULT_MATH


class _NoFloat(np.ndarray):
    """A 0-d result that refuses float(): a conversion per parameter would be a host sync per parameter on a GPU."""

    def __float__(self):
        raise AssertionError("float() of one parameter's term: one host sync per parameter")


def _tp_params():
    from hpcpipe.config import from_dict
    from hpcpipe.nn.rank_parameters import RankParameters
    from hpcpipe.nn.registry import model_def
    cfg = from_dict({"model": {"kind": "gpt", "vocab_size": 12, "seq_len": 4, "d_model": 8, "n_heads": 2,
                               "n_blocks": 2, "dtype": "float32"}, "parallel": {"pp": 1}})
    model = model_def(cfg)
    tp = SimpleNamespace(size=2, rank=0, sum_=lambda x: x, max_=lambda x: x)
    params = RankParameters(model, {0: range(model.n_layers)}, np, "float32", tp=tp)
    params.grad[...] = np.random.default_rng(3).standard_normal(params.grad.size).astype(np.float32)
    return params


def test_tp_norm_sq_one_host_copy_same_sum():
    params = _tp_params()
    expected = 0.0
    for i in params.layer_indices():
        for name in params.views[i]:
            if params.shards[i][name].counts_on(params.tp.rank):
                g = params.grad_of(i, name)
                expected += float(np.vdot(g, g))
    assert params.norm_sq() == expected      # the same float64 additions in the same order: bit for bit
    params.xp = SimpleNamespace(vdot=lambda a, b: np.asarray(np.vdot(a, b)).view(_NoFloat), stack=np.stack)
    assert params.norm_sq() == expected


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_trainer_counts_no_host_device_bytes_on_numpy(kind, tmp_path):
    """The step's host<->device bytes are 0 on the CPU (nothing is staged); the field exists for metrics."""
    from mpi4py import MPI
    from support.training import make_trainer
    model = {"kind": "gpt", "vocab_size": 12, "seq_len": 4, "d_model": 8, "n_heads": 2, "n_blocks": 2} \
        if kind == "gpt" else {"dims": [4, 4, 4]}
    sections = {"parallel": {"pp": 1}, "model": model, "train": {"micro_batches": 2, "micro_batch_size": 2},
                "checkpoint": {"dir": ""}, "log": {"progress": False}, "run": {"backend": "numpy"}}
    trainer = make_trainer(MPI.COMM_SELF, sections)
    try:
        trainer.train_step(0)
        assert trainer.last_host_device_bytes == 0
    finally:
        trainer.close()


def test_mpix_cuda_support_is_read_from_the_loaded_library(tmp_path):
    """mpi4py 4.1 has no Query_cuda_support: the loaded libmpi's MPIX_Query_cuda_support answers (MPICH's wheel and
    a CPU Open MPI: no CUDA), and a process without MPI mapped has no answer."""
    from mpi4py import MPI  # noqa: F401  (loads and initialises the library)

    from hpcpipe.runtime.mpix import library_cuda_support, loaded_libmpi
    path = loaded_libmpi()
    assert path is not None and "libmpi" in path
    assert library_cuda_support() in (False, None)
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n")
    assert loaded_libmpi(str(maps)) is None
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /opt/mpi/lib/libmpi.so.40.30.0\n")
    assert loaded_libmpi(str(maps)) == "/opt/mpi/lib/libmpi.so.40.30.0"
