"""Build hpcpipe's optional compiled CPU kernels; everything else is in setup.cfg and pyproject.toml.

The kernels are plain C (no Python headers) loaded with ctypes, compiled for a generic x86-64 and
choosing their AVX-512 paths at run time, so a wheel built on one node runs on another. ``optional``:
without a C compiler the install still succeeds and hpcpipe computes with NumPy (the reference path).
"""

from setuptools import Extension, setup

SOURCES = ["matmul.c", "convert.c", "gemm.c", "ops.c", "attend.c", "q8_vnni.c", "stage.c"]
FLAGS = ["-O3", "-std=gnu11", "-fno-math-errno", "-Wall"]

setup(ext_modules=[Extension(
    "hpcpipe.kernels._cpu", sources=[f"src/hpcpipe/kernels/csrc/{name}" for name in SOURCES],
    depends=["src/hpcpipe/kernels/csrc/hp.h", "src/hpcpipe/kernels/csrc/hp_vec.h"], extra_compile_args=FLAGS,
    libraries=["m"], optional=True)])
