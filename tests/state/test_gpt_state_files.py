"""GPT state files: nested parameter names below /layers/NNNN/, the model-kind check, the tokenizer attribute."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
from support import DATA
from support.state import checkpoint_cli

from hpcpipe.checkpoint import export, info, verify
from hpcpipe.config import from_dict
from hpcpipe.errors import ConfigError
from hpcpipe.nn.gpt.model import GPTModel
from hpcpipe.nn.gpt.shape import GPTShape, group_params
from hpcpipe.nn.mlp.model import layer_specs
from hpcpipe.nn.registry import model_specs
from hpcpipe.state.kinds import check_kind, stored_config, stored_kind, stored_specs
from hpcpipe.state.manifest import check_stage_file
from hpcpipe.state.sources import resolve_weights
from hpcpipe.state.weights import check_weights, read_layers, read_optimizer, write_weights

SHAPE = GPTShape(vocab=13, seq_len=6, d_model=8, n_heads=2, n_blocks=2, d_ff=12, tied=True)
MODEL = {"kind": "gpt", "vocab_size": 13, "seq_len": 6, "d_model": 8, "n_heads": 2, "n_blocks": 2, "d_ff": 12,
         "tie_embeddings": True, "dtype": "float32"}
SPECS = model_specs(from_dict({"model": MODEL, "parallel": {"pp": 1}}))
TOKENIZER = json.dumps({"kind": "chars", "chars": "abcdefghijklm"})
MLP_SPECS = layer_specs(from_dict({"model": {"dims": [16, 16, 16, 16, 16]}, "parallel": {"pp": 1}}))


def _arrays(shape: GPTShape = SHAPE) -> dict[int, dict[str, np.ndarray]]:
    return {i: GPTModel(shape).init_group(i, seed=4) for i in range(shape.n_groups)}


def _write(path: Path, arrays=None, model=None, **more) -> Path:
    arrays = _arrays() if arrays is None else arrays
    write_weights(path, arrays, n_layers=len(arrays), model_config=MODEL if model is None else model, **more)
    return path


def test_specs_follow_the_hdf5_contract():
    assert [s.index for s in SPECS] == [0, 1, 2, 3]
    assert SPECS[0].shapes == {"tok_emb": (13, 8), "pos_emb": (6, 8)}
    assert SPECS[1].shapes["attn/qkv/weight"] == (8, 24) and SPECS[1].shapes["mlp/proj/weight"] == (12, 8)
    assert SPECS[3].shapes == {"ln_f/weight": (8,), "ln_f/bias": (8,)}          # tied: no head
    untied = stored_specs(dict(MODEL, tie_embeddings=False), "w.h5")
    assert untied[3].shapes["head/weight"] == (8, 13)
    assert SPECS[1].n_params == sum(int(np.prod(d)) for _, d in group_params(SHAPE, 1))
    assert MLP_SPECS[0].shapes == {"weight": (16, 16), "bias": (16,)}


def test_gpt_weights_round_trip_with_nested_names_and_optimizer_state(tmp_path):
    arrays = _arrays()
    opt = {i: {"exp_avg": {k: v + 1 for k, v in group.items()}, "exp_avg_sq": {k: v * 0 for k, v in group.items()}}
           for i, group in arrays.items()}
    path = _write(tmp_path / "w.h5", arrays, step=5, optimizer=opt, optimizer_attrs={"name": "adam", "steps": 5},
                  attrs={"tokenizer": TOKENIZER})
    with h5py.File(path) as f:   # the contract's layout, every dataset checksummed
        assert f["layers/0001/attn/qkv/weight"].shape == (8, 24) and f["layers/0001/attn/qkv/weight"].fletcher32
        assert f["layers/0000/tok_emb"].shape == (13, 8)
        assert f["optimizer/layers/0001/exp_avg/attn/qkv/weight"].shape == (8, 24)
        assert f.attrs["tokenizer"] == TOKENIZER and f.attrs["n_layers"] == 4
    check_weights(path, SPECS)
    back = read_layers(path, [0, 1, 2, 3])
    for i, group in arrays.items():
        assert sorted(back[i]) == sorted(group)
        for name, value in group.items():
            assert np.array_equal(back[i][name], value), (i, name)
    attrs, state = read_optimizer(path, [1, 3])
    assert attrs == {"name": "adam", "steps": 5}
    assert sorted(state[1]) == ["exp_avg", "exp_avg_sq"]
    assert np.array_equal(state[1]["exp_avg"]["mlp/fc/weight"], arrays[1]["mlp/fc/weight"] + 1)
    source = resolve_weights(path)
    assert source.model_kind == "gpt" and source.tokenizer().attr == TOKENIZER
    source.check(SPECS)


def _set(name, value):
    def change(arrays):
        group, param = name.split(":")
        arrays[int(group)][param] = value
    return change


def _drop(name):
    def change(arrays):
        group, param = name.split(":")
        del arrays[int(group)][param]
    return change


@pytest.mark.parametrize("change, message", [
    (_set("1:attn/qkv/weight", np.zeros((8, 16), np.float32)),
     r"layers/0001/attn/qkv/weight has shape \(8, 16\), the model needs \(8, 24\)"),
    (_drop("2:ln1/bias"), r"layer 2 \(layers/0002\) lacks \['ln1/bias'\]"),
    (_set("1:attn/extra/weight", np.zeros(3, np.float32)),
     r"layer 1 \(layers/0001\) holds \['attn/extra/weight'\], which the model does not have"),
    (_set("1:mlp/fc/bias", np.arange(12)), r"layers/0001/mlp/fc/bias holds int64 values"),
    (_drop("0:pos_emb"), r"layer 0 holds \['tok_emb'\], the model needs \['pos_emb', 'tok_emb'\]"),
])
def test_check_weights_names_a_nested_mismatch(tmp_path, change, message):
    arrays = _arrays()
    change(arrays)
    path = _write(tmp_path / "w.h5", arrays)
    with pytest.raises(ConfigError, match=r"weights file '.*w\.h5': " + message):
        check_weights(path, SPECS)


def _edit(path, edit):
    with h5py.File(path, "r+") as f:
        edit(f)
    return path


@pytest.mark.parametrize("edit, message", [
    (lambda f: (f.__delitem__("layers/0001/ln2/weight"), f.create_group("layers/0001/ln2/weight/x")),
     r"layers/0001/ln2/weight is a group, not a dataset"),
    (lambda f: (f.__delitem__("layers/0001/ln2"), f.create_dataset("layers/0001/ln2", data=np.zeros(8, "f4"))),
     r"layer 1 \(layers/0001\) lacks \['ln2/bias', 'ln2/weight'\] and holds \['ln2'\]"),
    (lambda f: (f.__delitem__("layers/0001/mlp/fc/bias"),
                f.__setitem__("layers/0001/mlp/fc/bias", h5py.SoftLink("/nowhere"))),
     r"layers/0001/mlp/fc/bias is a soft link to '/nowhere', which names nothing in the file \(a dangling link\)"),
    (lambda f: (f.__delitem__("layers/0003"), f.create_dataset("layers/0003", data=np.zeros(3, "f4"))),
     r"layers/0003 is a dataset, not a group holding its parameters"),
])
def test_malformed_nested_groups_are_refused_naming_the_dataset(tmp_path, edit, message):
    path = _edit(_write(tmp_path / "w.h5"), edit)
    before = path.read_bytes()
    with pytest.raises(ConfigError, match=r"w\.h5': " + message):
        check_weights(path, SPECS)
    assert path.read_bytes() == before


def test_a_cycle_of_hard_links_is_refused_not_followed_forever(tmp_path):
    path = _edit(_write(tmp_path / "w.h5"), lambda f: f["layers/0001/attn"].__setitem__("loop", f["layers/0001"]))
    with pytest.raises(ConfigError, match=r"holds \['attn/loop/attn', 'attn/loop/ln1', .*which the model does not"):
        check_weights(path, SPECS)
    with pytest.raises(ConfigError, match=r"layers/0001/attn/loop/attn is a group, not a dataset"):
        read_layers(path, [1])


def test_non_finite_nested_value_is_refused_on_read(tmp_path):
    arrays = _arrays()
    arrays[2]["attn/proj/weight"][0, :2] = [np.nan, np.inf]
    path = _write(tmp_path / "w.h5", arrays)
    with pytest.raises(ConfigError, match=r"layers/0002/attn/proj/weight holds 2 non-finite value\(s\)"):
        read_layers(path, [2])


# --- the kind check -----------------------------------------------------------------------------------

def test_gpt_file_where_an_mlp_is_expected_is_one_message_about_the_kind(tmp_path):
    source = resolve_weights(_write(tmp_path / "w.h5"))
    with pytest.raises(ConfigError) as exc:
        source.check(MLP_SPECS, "model.init")
    assert str(exc.value) == (f"model.init {str(tmp_path / 'w.h5')!r} holds a GPT model (model.kind = \"gpt\", "
                              f"4 layer groups); this run has model.kind = \"mlp\"")
    with pytest.raises(ConfigError, match=r"^weights file '.*w\.h5' holds a GPT model \(model\.kind = \"gpt\", "
                                          r"4 layer groups\); this run has model\.kind = \"mlp\"$"):
        source.check(MLP_SPECS)


def test_mlp_file_without_a_kind_is_an_mlp_and_refused_where_a_gpt_is_expected():
    weights = DATA / "old-layout-step4.h5"      # written before model kinds: no kind in its model attribute
    source = resolve_weights(weights)
    assert "kind" not in source.model and source.model_kind == "mlp" and source.tokenizer() is None
    source.check(stored_specs(source.model, "w"))
    assert stored_specs(source.model, "w")[0].shapes == {"weight": (8, 8), "bias": (8,)}
    with pytest.raises(ConfigError) as exc:
        source.check(SPECS, "model.init")
    assert str(exc.value) == (f"model.init {str(weights)!r} holds an MLP model (model.kind = \"mlp\", 4 layers); "
                              f"this run has model.kind = \"gpt\"")


def test_mlp_checkpoint_where_a_gpt_is_expected_is_refused_by_kind(tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(DATA / "old-layout-checkpoint", ck)
    source = resolve_weights(ck)
    assert source.kind == "checkpoint" and source.model_kind == "mlp"
    with pytest.raises(ConfigError, match=r"^checkpoint.dir '.*step-\d+' holds an MLP model \(model\.kind = "
                                          r"\"mlp\", 4 layers\); this run has model\.kind = \"gpt\"$"):
        source.check(SPECS, "checkpoint.dir")


def test_unknown_or_incomplete_stored_models_are_named():
    with pytest.raises(ConfigError, match=r"w\.h5 records model\.kind = 'rnn'; this hpcpipe knows 'mlp', 'gpt', 'llam"):
        stored_kind({"kind": "rnn"}, "w.h5")
    with pytest.raises(ConfigError, match=r"w\.h5 records model.kind = 'rnn'"):
        check_kind({"kind": "rnn"}, 3, MLP_SPECS, "w.h5")
    with pytest.raises(ConfigError, match=r"w\.h5 holds a GPT model without n_heads, d_ff in its model attribute"):
        stored_config({k: v for k, v in MODEL.items() if k not in ("n_heads", "d_ff")}, "w.h5")
    with pytest.raises(ConfigError, match=r"w\.h5 records an invalid model: model.n_heads \(3\) does not divide "
                                          r"model.d_model \(8\)"):
        stored_config(dict(MODEL, n_heads=3), "w.h5")
    with pytest.raises(ConfigError, match=r"w\.h5 records an invalid model: model.tie_embeddings must be bool"):
        stored_specs(dict(MODEL, tie_embeddings=1), "w.h5")
    assert [s.shapes for s in stored_specs(MODEL, "w.h5")] == [s.shapes for s in SPECS]


# --- the tokenizer attribute, export, info, verify -----------------------------------------------------

def test_export_copies_the_tokenizer_and_info_shows_kind_shape_and_tokenizer(tmp_path):
    path = _write(tmp_path / "w.h5", step=9, attrs={"tokenizer": TOKENIZER})
    out = tmp_path / "out.h5"
    export(path, out)
    with h5py.File(out) as f:
        assert f.attrs["tokenizer"] == TOKENIZER and f.attrs["step"] == 9
        assert json.loads(f.attrs["model"])["kind"] == "gpt"
    check_weights(out, SPECS)
    text = info(out)
    assert "step 9, 4 layer groups, gpt vocab_size=13 seq_len=6 d_model=8 n_heads=2 n_blocks=2 d_ff=12 " \
           "tie_embeddings=true" in text
    assert f"  tokenizer {TOKENIZER}" in text.splitlines()
    assert "layer 1: attn/proj/bias (8,), attn/proj/weight (8, 8), attn/qkv/bias (24,)" in text
    assert verify(out).n_layers == 4
    plain = export(_write(tmp_path / "plain.h5"), tmp_path / "plain-out.h5")   # no tokenizer: none is written
    assert plain.tokenizer() is None
    with h5py.File(tmp_path / "plain-out.h5") as f:
        assert "tokenizer" not in f.attrs


@pytest.mark.parametrize("value, message", [
    ("not json", r"root attribute tokenizer: the attribute is not valid JSON"),
    (json.dumps({"kind": "words"}), r"root attribute tokenizer: unknown kind 'words'"),
])
def test_an_invalid_tokenizer_attribute_is_refused_by_export_and_verify(tmp_path, value, message):
    path = _write(tmp_path / "w.h5", attrs={"tokenizer": value})
    with pytest.raises(ConfigError, match=r"weights file '.*w\.h5': " + message):
        export(path, tmp_path / "out.h5")
    assert not (tmp_path / "out.h5").exists()
    with pytest.raises(ConfigError, match=message):
        verify(path)
    assert "\n  tokenizer unreadable: weights file " in info(path)      # info still describes the file


def test_verify_checks_a_gpt_file_against_its_stored_shape(tmp_path):
    arrays = _arrays()
    arrays[1]["mlp/fc/weight"] = np.zeros((8, 16), np.float32)     # d_ff 16 in the file, 12 in its model
    path = _write(tmp_path / "w.h5", arrays)
    with pytest.raises(ConfigError, match=r"layers/0001/mlp/fc/weight has shape \(8, 16\), the model needs \(8, 12\)"):
        verify(path)


def _stage_file(tmp_path: Path, opt_change=None) -> tuple[Path, dict, dict]:
    """One stage file holding groups 1 and 2 with Adam state, its manifest entry and a manifest (no config)."""
    step_dir = tmp_path / "step-00000003"
    step_dir.mkdir()
    arrays = {i: group for i, group in _arrays().items() if i in (1, 2)}
    opt = {i: {"exp_avg": dict(group), "exp_avg_sq": dict(group)} for i, group in arrays.items()}
    if opt_change:
        opt_change(opt)
    path = step_dir / "stage-001.h5"
    write_weights(path, arrays, n_layers=4, model_config=MODEL, step=3, optimizer=opt,
                  optimizer_attrs={"name": "adam", "steps": 3}, attrs={"pp_rank": 1, "tokenizer": TOKENIZER})
    data = path.read_bytes()
    entry = {"name": path.name, "pp_rank": 1, "layers": [1, 2], "bytes": len(data),
             "sha256": hashlib.sha256(data).hexdigest()}
    return step_dir, entry, {"step": 3, "optimizer": {"name": "adam", "steps": 3, "state": ["exp_avg", "exp_avg_sq"]}}


def test_stage_file_with_nested_optimizer_state_passes_its_checks(tmp_path):
    step_dir, entry, manifest = _stage_file(tmp_path)
    assert check_stage_file(step_dir, entry, manifest, SPECS) == step_dir / "stage-001.h5"


def test_stage_file_whose_optimizer_state_does_not_mirror_the_parameters_is_refused(tmp_path):
    def change(opt):
        opt[2]["exp_avg_sq"]["attn/qkv/weight"] = np.zeros((8, 8), np.float32)
    step_dir, entry, manifest = _stage_file(tmp_path, change)
    with pytest.raises(ConfigError, match=r"stage-001\.h5': optimizer/layers/0002/exp_avg_sq/attn/qkv/weight has "
                                          r"shape \(8, 8\), the model needs \(8, 24\)"):
        check_stage_file(step_dir, entry, manifest, SPECS)

    def missing(opt):
        del opt[1]["exp_avg"]["ln1/bias"]
    (tmp_path / "b").mkdir()
    step_dir, entry, manifest = _stage_file(tmp_path / "b", missing)
    with pytest.raises(ConfigError, match=r"the exp_avg state of layer 1 \(optimizer/layers/0001/exp_avg\) lacks "
                                          r"\['ln1/bias'\]"):
        check_stage_file(step_dir, entry, manifest, SPECS)


def test_checkpoint_command_verifies_exports_and_describes_a_gpt_file(tmp_path):
    path = _write(tmp_path / "w.h5", step=4, attrs={"tokenizer": TOKENIZER})
    proc = checkpoint_cli("verify", path)
    assert proc.returncode == 0 and proc.stdout.strip() == f"ok: weights file {str(path)!r} step 4, 4 layer groups", \
        proc.stdout + proc.stderr
    out = tmp_path / "out.h5"
    proc = checkpoint_cli("export", path, out)
    assert proc.returncode == 0, proc.stderr
    with h5py.File(out) as f:
        assert f.attrs["tokenizer"] == TOKENIZER
    proc = checkpoint_cli("info", out)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].endswith("step 4, 4 layer groups, gpt vocab_size=13 seq_len=6 d_model=8 n_heads=2 n_blocks=2 "
                             "d_ff=12 tie_embeddings=true")
    assert lines[1] == f"  tokenizer {TOKENIZER}"
    assert lines[2] == "  layer 0: pos_emb (6, 8), tok_emb (13, 8)"
    # a shape that disagrees with the stored model is a bad file: status 1, one line naming it
    arrays = _arrays()
    arrays[3]["ln_f/bias"] = np.zeros(9, np.float32)
    bad = _write(tmp_path / "bad.h5", arrays)
    proc = checkpoint_cli("verify", bad)
    assert proc.returncode == 1 and proc.stderr.strip() == (
        f"hpcpipe: error: weights file {str(bad)!r}: layers/0003/ln_f/bias has shape (9,), the model "
        f"needs (8,)")
