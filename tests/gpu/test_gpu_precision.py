"""run.tf32 on a real GPU: select_backend(tf32=True) reaches both of CuPy 14's roads to cuBLAS (2-D products
through the float32 compute type, batched ones through the handle's math mode): float32 products then carry
TF32's error (~1e-4 .. 1e-3 relative to a float64 reference), and full float32 (~1e-6) once it is off again.
CuPy only: on NumPy there is nothing to rehearse (tests/runtime/test_backend_precision.py covers the note)."""

import numpy as np
import pytest
from support.gpu import device_backend

pytestmark = pytest.mark.gpu


def _relative(x, ref) -> float:
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def test_run_tf32_reaches_2d_and_batched_products_and_switches_back():
    if device_backend() != "cupy":
        pytest.skip("TF32 is a mode of the GPU's matrix units: nothing to rehearse on NumPy")
    import cupy

    from hpcpipe.runtime.backend import select_backend, set_tf32, tf32_state
    rng = np.random.default_rng(11)     # fresh random operands, never zeros (METHOD.md)
    a, b = rng.standard_normal((512, 1024)), rng.standard_normal((1024, 384))
    q, k = rng.standard_normal((6, 128, 64)), rng.standard_normal((6, 64, 128))
    want2, want3 = a @ b, q @ k
    da, db, dq, dk = (cupy.asarray(v, dtype=cupy.float32) for v in (a, b, q, k))
    try:
        backend = select_backend("cupy", node_rank=0, tf32=True)
        assert backend.tf32 and tf32_state(cupy)["tf32"], tf32_state(cupy)
        tf32 = (_relative((da @ db).get(), want2), _relative((dq @ dk).get(), want3))
        set_tf32(cupy, False)
        assert not tf32_state(cupy)["tf32"]
        full = (_relative((da @ db).get(), want2), _relative((dq @ dk).get(), want3))
    finally:
        set_tf32(cupy, False)
    print(f"relative error vs float64: TF32 2-D {tf32[0]:.2e}, batched {tf32[1]:.2e}; "
          f"float32 2-D {full[0]:.2e}, batched {full[1]:.2e}")
    assert max(full) < 1e-5, full
    assert tf32[0] > 10 * full[0], ("2-D products did not use TF32", tf32, full)
    assert tf32[1] > 10 * full[1], ("batched products did not use TF32 (the cuBLAS math mode)", tf32, full)
    assert max(tf32) < 5e-3, tf32
