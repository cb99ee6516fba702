"""The commands that read weights, on a file whose links lead nowhere: one line naming the file and the link.

Issue #32: ``checkpoint info``/``verify`` and ``generate`` (serve reads weights the same way) ended in an
h5py traceback on a soft-link loop. ``checkpoint`` keeps its documented status for a bad file (1);
the other commands exit 2.
"""

from __future__ import annotations

import h5py
import pytest
from support.launch import one_error
from support.serve import generate, make_weights
from support.state import checkpoint_cli

pytestmark = pytest.mark.slow

LOOP = "is a soft link to '/cycle' that loops back on itself (a cycle of soft links)"


@pytest.fixture
def looping(tmp_path):
    """A GPT weights file whose layers/0001/attn group is a soft link into a cycle."""
    path = tmp_path / "gpt.h5"
    make_weights(path)
    with h5py.File(path, "r+") as f:
        del f["layers/0001/attn"]
        f["layers/0001/attn"] = h5py.SoftLink("/cycle")
        f["cycle"] = h5py.SoftLink("/layers/0001/attn")
    return path


@pytest.mark.parametrize("verb", ["info", "verify"])
def test_checkpoint_info_and_verify(looping, verb):
    line = one_error(checkpoint_cli(verb, looping), code=1)
    assert line == f"hpcpipe: error: weights file {str(looping)!r}: layers/0001/attn {LOOP}"


def test_generate(looping, tmp_path):
    proc, result = generate(tmp_path, 2, looping, "hello", "--max-new-tokens", "2", "--set", "parallel.pp=2")
    line = one_error(proc)
    assert result is None
    assert line == f"hpcpipe: error: weights file {str(looping)!r}: layers/0001/attn {LOOP}"
