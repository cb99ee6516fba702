"""infer.buffers is bounded by the memory it implies, before any collective (issue #32).

``--set infer.buffers=100000000`` used to allocate slot after slot on every rank (gigabytes each),
ignore SIGTERM for most of a minute and leave the temporary output behind when killed; under
``ulimit -v`` it ended in a segmentation fault. Now the need (buffers x rows x the stage's in and out
widths x itemsize, plus each slot's bookkeeping, plus parameters and scratch) is compared with the
rank's share of the node, as training's check does: one line naming the key and the bytes, exit 2.
"""

from __future__ import annotations

import os
import resource
import subprocess

import h5py
import numpy as np
import pytest
from support.launch import command, one_error, run

from hpcpipe.config import from_dict
from hpcpipe.errors import ConfigError
from hpcpipe.infer.memory import SLOT_BYTES, SLOT_LAYER_BYTES, SLOT_LINK_BYTES, check_memory, stage_bytes
from hpcpipe.infer.setup import prepare
from hpcpipe.nn.mlp.model import layer_specs
from hpcpipe.nn.partition import partition
from hpcpipe.state.weights import write_weights

GIB = 1 << 30
MODEL = {"dims": [16, 16, 16, 16, 16], "bias": False, "activation": "relu", "final_activation": True}


@pytest.fixture
def files(tmp_path):
    """Four 16 x 16 layers and 32 input rows: (weights, input)."""
    rng = np.random.default_rng(0)
    weights, data = tmp_path / "w.h5", tmp_path / "in.h5"
    write_weights(weights, {i: {"weight": rng.standard_normal((16, 16)).astype("f4")} for i in range(4)},
                  n_layers=4, model_config=MODEL)
    with h5py.File(data, "w") as f:
        f["x"] = rng.standard_normal((32, 16)).astype("f4")
    return weights, data


def test_the_need_is_buffers_times_rows_times_widths_plus_bookkeeping():
    config = from_dict({"model": dict(MODEL, bias=True), "parallel": {"pp": 2},
                        "infer": {"buffers": 3, "micro_batch_size": 8}})
    ranges = partition(layer_specs(config), 2)
    middle = stage_bytes(config, ranges, 1, n_rows=20)      # micro-batches of 8, 8, 4: two row counts
    layers = len(ranges[1])
    assert middle.rows == 8 and (middle.in_width, middle.out_width) == (16, 16)
    assert middle.buffers == 3 * (8 * (16 + 16) * 4 + SLOT_BYTES + SLOT_LINK_BYTES + SLOT_LAYER_BYTES * layers * 2)
    assert middle.parameters == layers * (16 * 16 + 16) * 4
    small = stage_bytes(config, ranges, 0, n_rows=5)         # buffers as tall as the rows there are
    assert small.rows == 5 and small.buffers == 3 * (5 * 32 * 4 + SLOT_BYTES + SLOT_LINK_BYTES +
                                                     SLOT_LAYER_BYTES * len(ranges[0]))


def test_a_share_too_small_is_refused_naming_the_key_and_the_bytes():
    config = from_dict({"model": MODEL, "parallel": {"pp": 4}, "infer": {"buffers": 100_000_000,
                                                                       "micro_batch_size": 4}})
    ranges = partition(layer_specs(config), 4)
    with pytest.raises(ConfigError) as caught:
        check_memory(config, ranges, 32, 4, available=16 * GIB, ranks_here=4)
    message = str(caught.value)
    need = stage_bytes(config, ranges, 1, 32).total
    assert message.startswith(f"inference needs about 429 GiB ({need} bytes) per rank: infer.buffers = 100000000 "
                              f"slot buffers of 4 row(s) (infer.micro_batch_size = 4) x (16 + 16) values x 4 bytes")
    assert "this node has 16 GiB available for 4 rank(s) (4 GiB each): lower infer.buffers" in message
    with pytest.raises(ConfigError, match=r"each rank has 1 GiB left under its address-space limit \(ulimit -v"):
        check_memory(config, ranges, 32, 4, available=16 * GIB, ranks_here=4, headroom=GIB)
    default = from_dict({"model": MODEL, "parallel": {"pp": 4}})
    assert check_memory(default, ranges, 32, 4, available=GIB, ranks_here=4).total < 64 * 1024


def test_prepare_refuses_before_any_collective(tmp_path, files):
    weights, data = files
    with pytest.raises(ConfigError, match=r"infer.buffers = 100000000 slot buffers"):
        prepare(weights, data, tmp_path / "out.h5", 4, {"infer": {"buffers": 100_000_000, "micro_batch_size": 4}})
    assert prepare(weights, data, tmp_path / "out.h5", 4, {"infer": {"buffers": 64}}).config.infer.buffers == 64


def _address_space_limit() -> None:
    """2 GiB of address space per process: what a batch system's ``ulimit -v`` gives (the old code crashed in it)."""
    resource.setrlimit(resource.RLIMIT_AS, (2 * GIB, 2 * GIB))


@pytest.mark.slow
def test_the_command_refuses_a_huge_buffers_in_one_line_and_writes_nothing(tmp_path, files):
    weights, data = files
    out = tmp_path / "out.h5"
    argv = command(4, "hpcpipe.infer", ["--weights", str(weights), "--input", str(data), "--output", str(out),
                                        "--set", "infer.buffers=100000000", "--set", "infer.micro_batch_size=4"])
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          preexec_fn=_address_space_limit, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    line = one_error(proc)
    assert "infer.buffers = 100000000" in line and "bytes) per rank" in line
    assert "address-space limit (ulimit -v, RLIMIT_AS)" in line
    assert sorted(os.listdir(tmp_path)) == ["in.h5", "w.h5"]            # no output, no temporary left behind
    assert run(command(4, "hpcpipe.infer", ["--weights", str(weights), "--input", str(data), "--output", str(out),
                                            "--set", "infer.buffers=8"]), cwd=tmp_path).returncode == 0
