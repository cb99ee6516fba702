"""HDF5 links that lead nowhere inside weights and checkpoint files: one ConfigError naming the file and the link.

Issue #32: a soft link that loops (``a -> /b -> /a``) or names nothing, or an external link to a file that
cannot be opened, anywhere a reader walks (``/layers``, a layer group, a parameter, ``/optimizer``, the
tokenizer files), used to end in an h5py traceback (RuntimeError "too many links", KeyError) or in a
message that did not say it was a link. The commands that read these files are run in
``test_link_error_commands.py``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest
from support import DATA

from hpcpipe.checkpoint import info, verify
from hpcpipe.errors import ConfigError
from hpcpipe.state import directory_protocol as cf
from hpcpipe.state.sources import resolve_weights
from hpcpipe.state.tokenizer import read_stored
from hpcpipe.state.weights import read_layers, read_optimizer, write_weights

MODEL = {"dims": [4, 4, 4], "bias": True, "activation": "relu", "final_activation": True}


def _weights(path: Path, optimizer: bool = False) -> Path:
    rng = np.random.default_rng(0)
    arrays = {i: {"weight": rng.standard_normal((4, 4)).astype("f4"), "bias": np.zeros(4, "f4")} for i in range(2)}
    opt = {i: {"momentum": {k: np.zeros_like(v) for k, v in group.items()}} for i, group in arrays.items()}
    write_weights(path, arrays, n_layers=2, model_config=MODEL, optimizer=opt if optimizer else None,
                  optimizer_attrs={"name": "sgd", "steps": 0} if optimizer else None)
    return path


def _loop(name: str) -> Callable[[h5py.File], None]:
    """Replace name by a soft link into a cycle: name -> /cycle -> name."""
    def edit(f: h5py.File) -> None:
        del f[name]
        f[name] = h5py.SoftLink("/cycle")
        f["cycle"] = h5py.SoftLink(f"/{name}")
    return edit


def _external(name: str) -> Callable[[h5py.File], None]:
    """Replace name by an external link into a file that does not exist."""
    def edit(f: h5py.File) -> None:
        del f[name]
        f[name] = h5py.ExternalLink("missing.h5", "/x")
    return edit


def _dangling(name: str) -> Callable[[h5py.File], None]:
    def edit(f: h5py.File) -> None:
        del f[name]
        f[name] = h5py.SoftLink("/nowhere")
    return edit


LOOP = "is a soft link to '/cycle' that loops back on itself (a cycle of soft links)"
EXTERNAL = "is an external link to '/x' in 'missing.h5', which cannot be resolved (can't open file)"
DANGLING = "is a soft link to '/nowhere', which names nothing in the file (a dangling link)"

CASES = {   # edit, the link it breaks, how the message says so
    "layers loops": (_loop("layers"), "layers", LOOP),
    "a layer group loops": (_loop("layers/0001"), "layers/0001", LOOP),
    "a parameter loops": (_loop("layers/0000/bias"), "layers/0000/bias", LOOP),
    "a parameter is an external link to a missing file": (_external("layers/0001/weight"), "layers/0001/weight",
                                                           EXTERNAL),
    "a layer group is a dangling link": (_dangling("layers/0000"), "layers/0000", DANGLING),
}


def _broken(path: Path, edit: Callable[[h5py.File], None]) -> Path:
    with h5py.File(path, "r+") as f:
        edit(f)
    return path


def _read_everything(path: Path) -> None:
    """What model.init, infer --weights, evaluate and generate do with a weights file: resolve, check, read."""
    from hpcpipe.config import from_dict
    from hpcpipe.nn.mlp.model import layer_specs

    source = resolve_weights(path, "--weights")
    source.check(layer_specs(from_dict({"model": MODEL, "parallel": {"pp": 1}})), "--weights")
    source.read([0, 1])


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("reader", [_read_everything, lambda p: read_layers(p, [0, 1]), verify, info])
def test_a_broken_link_in_a_weights_file_is_one_error_naming_the_file_and_the_link(tmp_path, case, reader):
    edit, link, words = CASES[case]
    path = _broken(_weights(tmp_path / "w.h5"), edit)
    before = path.read_bytes()
    with pytest.raises(ConfigError) as caught:
        reader(path)
    message = str(caught.value)
    assert f"'{path}'" in message and f"{link} {words}" in message, message
    assert "\n" not in message and path.read_bytes() == before


@pytest.mark.parametrize("edit, link, words", [
    (_loop("optimizer"), "optimizer", LOOP),
    (_loop("optimizer/layers/0001"), "optimizer/layers/0001", LOOP),
    (_external("optimizer/layers/0000/momentum/bias"), "optimizer/layers/0000/momentum/bias", EXTERNAL),
])
def test_a_broken_link_in_the_optimizer_state_is_named(tmp_path, edit, link, words):
    path = _broken(_weights(tmp_path / "w.h5", optimizer=True), edit)
    with pytest.raises(ConfigError, match=f"'{path}'.*{link} {words.replace('(', '.').replace(')', '.')}"):
        read_optimizer(path, [0, 1])


def test_a_broken_link_among_the_tokenizer_files_is_named(tmp_path):
    path = _weights(tmp_path / "w.h5")
    with h5py.File(path, "r+") as f:
        f.attrs["tokenizer"] = json.dumps({"kind": "hf"})
        f["tokenizer/tokenizer.json"] = np.frombuffer(b"{}", np.uint8)
        f["tokenizer/special_tokens_map.json"] = h5py.SoftLink("/tokenizer/special_tokens_map.json")
    with h5py.File(path, "r") as f, pytest.raises(ConfigError) as caught:
        read_stored(f, f"weights file {str(path)!r}")
    assert str(caught.value) == (f"weights file {str(path)!r}: tokenizer/special_tokens_map.json is a soft link to "
                                 f"'/tokenizer/special_tokens_map.json' that loops back on itself (a cycle of soft "
                                 f"links)")


def test_a_broken_link_in_a_checkpoint_stage_file_is_named_by_every_reader(tmp_path):
    """A stage file whose manifest hash matches (forged with it) but whose optimizer group is a cycle."""
    root = tmp_path / "ck"
    shutil.copytree(DATA / "old-layout-checkpoint", root)
    step = root / "step-00000002"
    stage = step / "stage-001.h5"
    with h5py.File(stage, "r+") as f:
        layer = sorted(f["optimizer/layers"].keys())[0]
        _loop(f"optimizer/layers/{layer}")(f)
    manifest = json.loads((step / cf.MANIFEST).read_text())
    for entry in manifest["files"]:
        if entry["name"] == stage.name:
            entry.update(bytes=stage.stat().st_size, sha256=hashlib.sha256(stage.read_bytes()).hexdigest())
    (step / cf.MANIFEST).write_text(json.dumps(manifest))
    for reader in (verify, lambda p: resolve_weights(p).read_optimizer([0, 1, 2, 3])):
        with pytest.raises(ConfigError, match=rf"checkpoint file '{stage}': optimizer/layers/{layer} {LOOP[:40]}"):
            reader(root)


def test_a_stage_file_that_is_a_symbolic_link_loop_is_named_as_one(tmp_path):
    root = tmp_path / "ck"
    shutil.copytree(DATA / "old-layout-checkpoint", root)
    stage = root / "step-00000002" / "stage-001.h5"
    stage.unlink()
    stage.symlink_to(stage.name)
    for reader in (verify, resolve_weights):
        with pytest.raises(ConfigError) as caught:
            reader(root)
        assert str(caught.value) == (f"checkpoint file {str(stage)!r} is a symbolic link loop (ELOOP: too many "
                                     f"levels of symbolic links)")                  # was: "... is missing"
