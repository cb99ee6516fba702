"""The compiled SwiGLU and GELU (csrc/ops.c) against float64 NumPy of the layers' formulas, at ragged widths, on the
AVX-512 paths (sigmoid and tanh from one vector exp) and the portable ones (tanhf)."""

import numpy as np
import pytest

from hpcpipe.kernels import cpu

needs_kernels = pytest.mark.skipif(cpu.library() is None, reason="compiled kernels not built (no C compiler)")


@pytest.fixture(params=["vector", "portable"])
def paths(request):
    if request.param == "vector" and cpu.vector_paths() != "avx512":
        pytest.skip("this CPU has no AVX-512: the portable paths are the only ones")
    cpu.use_portable(request.param == "portable")
    yield request.param
    cpu.use_portable(False)


def _values(rng, shape):
    x = (rng.standard_normal(shape) * 4).astype(np.float32)
    edges = np.array([0.0, -0.0, 30.0, -30.0, 100.0, -100.0], np.float32)[:x.size]   # tails where exp under/overflows
    x.flat[:edges.size] = edges
    return x


@needs_kernels
@pytest.mark.parametrize("ff", [1, 15, 16, 17, 100, 1536])
def test_swiglu_equals_silu_gate_times_up(paths, ff):
    rng = np.random.default_rng(ff)
    gate_up = _values(rng, (3, 2 * ff))
    g, u = gate_up[:, :ff].astype(np.float64), gate_up[:, ff:].astype(np.float64)
    want = g * (0.5 * (1.0 + np.tanh(0.5 * g))) * u
    got = cpu.swiglu(gate_up)
    assert got.shape == (3, ff)
    assert np.all(np.abs(got - want) <= 1e-6 * np.abs(g * u) + 1e-30), paths


@needs_kernels
@pytest.mark.parametrize("n", [1, 7, 16, 33, 1000])
def test_gelu_equals_the_tanh_approximation(paths, n):
    z = _values(np.random.default_rng(n), (n,)).astype(np.float64)
    want = 0.5 * z * (1.0 + np.tanh(0.7978845608028654 * (z + 0.044715 * z ** 3)))
    got = cpu.gelu(z.astype(np.float32))
    assert np.all(np.abs(got - want) <= 1e-6 * np.abs(z) + 1e-30), paths
