"""The memory check honours the address-space limit (``ulimit -v``, RLIMIT_AS), not only MemAvailable (issue #32).

``model.dims = [16, 30000000, 16]`` under ``ulimit -v`` passed the check (the node had the memory) and
then died in a MemoryError traceback at the first allocation. The share a rank may use is now the
smaller of its part of MemAvailable and what its address-space limit still lets it map.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys

from support.launch import command, one_error

GIB = 1 << 30
LIMIT = 3 * GIB


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))


PROBE = """
import json
from hpcpipe.runtime.host_memory import address_space_headroom, available_bytes, node_available_bytes
vm = [int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:")][0]
print(json.dumps({"available": available_bytes(), "node": node_available_bytes(),
                  "headroom": address_space_headroom(), "vm": vm}))
"""


def test_available_bytes_is_the_smaller_of_memavailable_and_the_address_space_headroom():
    from hpcpipe.runtime.host_memory import address_space_headroom, available_bytes, node_available_bytes

    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60,
                          preexec_fn=_limited, check=True)
    got = json.loads(proc.stdout)
    assert got["headroom"] is not None and 0 < got["headroom"] <= LIMIT - got["vm"] + (64 << 20)
    assert got["available"] == min(got["node"], got["headroom"]) and got["available"] < LIMIT
    if resource.getrlimit(resource.RLIMIT_AS)[0] == resource.RLIM_INFINITY:   # this process: no limit, ignored
        assert address_space_headroom() is None and available_bytes() == node_available_bytes()


def test_the_share_is_per_process_for_the_limit_and_per_node_for_memavailable():
    from hpcpipe.runtime.host_memory import rank_share

    assert rank_share(4, available=16 * GIB) == (4 * GIB, "this node has 16 GiB available for 4 rank(s) (4 GiB each)")
    share, text = rank_share(4, available=16 * GIB, headroom=GIB)
    assert share == GIB and text.startswith("each rank has 1 GiB left under its address-space limit (ulimit -v")
    assert rank_share(4, available=16 * GIB, headroom=8 * GIB)[0] == 4 * GIB     # the node's share is smaller
    assert rank_share(4, available=0, headroom=None)[0] is None                   # nothing known: no check


def test_a_model_beyond_ulimit_v_is_refused_before_step_0(tmp_path):
    argv = command(2, "hpcpipe.train", ["--set", "model.dims=[16, 30000000, 16]", "--set", "parallel.pp=2",
                                        "--set", "train.steps=1", "--set", "checkpoint.dir=\"\"",
                                        "--set", "log.progress=false"])
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path, preexec_fn=_limited)
    line = one_error(proc)             # was: a MemoryError traceback, exit 1
    assert "the model needs about 7.38 GiB per rank" in line
    assert "left under its address-space limit (ulimit -v, RLIMIT_AS)" in line
