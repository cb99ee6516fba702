"""The GPU kernels' CUDA sources (hpcpipe.kernels.cuda) compile with NVRTC for the H100/H200 (compute_90), with no
warning, for every weight kind: checked on the CPU, so the rare GPU lease is not spent on a compile error. Skips
where NVRTC is not installed (pip install nvidia-cuda-nvrtc; .ci/run does)."""

import pytest
from support import nvrtc

from hpcpipe.kernels import cuda

LIB = nvrtc.library()
pytestmark = pytest.mark.skipif(LIB is None, reason="NVRTC is not installed (pip install nvidia-cuda-nvrtc)")


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "float16", "q8_0"])
def test_the_row_product_compiles_for_the_gpu(kind):
    status, log, ptx = nvrtc.compile_ptx(LIB, cuda.kernel_source(kind), ["--gpu-architecture=compute_90"])
    assert status == 0, (nvrtc.version(LIB), log)
    assert "warning" not in log.lower(), log
    assert ptx > 0


def test_a_broken_source_is_reported():
    """The check can fail: a kernel with a type error does not compile, and the log says where."""
    source = cuda.kernel_source("float32").replace("float wv = weight_at", "float *wv = weight_at")
    status, log, _ = nvrtc.compile_ptx(LIB, source, ["--gpu-architecture=compute_90"])
    assert status != 0 and "error" in log
