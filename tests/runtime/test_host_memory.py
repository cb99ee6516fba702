"""runtime.host_memory: freed large arrays are reused by the next allocation, not faulted in again."""

import os
import platform
import subprocess
import sys

import pytest

PROBE = r"""
import resource, sys
from hpcpipe.runtime.host_memory import keep_freed_memory
import numpy as np
kept = keep_freed_memory()
for _ in range(2):                       # warm-up: the heap grows to hold one array
    a = np.ones(8 << 20); del a
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):                      # a 64 MiB temporary, made and freed as a step's logits are
    a = np.ones(8 << 20); del a
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                           reason="glibc's malloc only")


def _faults(extra_env: dict[str, str]) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**env, **extra_env}, capture_output=True,
                         text=True, check=True, timeout=120).stdout.split()
    return out[0], int(out[1])


@glibc
def test_a_freed_large_array_is_reused_without_new_page_faults():
    kept, faults = _faults({})
    assert kept == "True"
    assert faults < 10, f"{faults} page faults for 10 reused 64 MiB arrays"


@glibc
def test_a_users_malloc_tuning_is_left_alone_and_then_every_array_faults_anew():
    kept, faults = _faults({"MALLOC_TOP_PAD_": "131072"})
    assert kept == "False"
    # glibc's defaults mmap each 64 MiB array afresh: at least one fault per 2 MiB page of each
    assert faults >= 10 * 32, faults
