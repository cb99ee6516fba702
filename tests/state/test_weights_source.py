"""One weights-source protocol: every source (weights file, checkpoint, Hugging Face directory) implements
WeightsSource with the same signatures, is fixed when built, and reads alike through collective.load."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest
from support import DATA

from hpcpipe.config import from_dict
from hpcpipe.errors import ConfigError
from hpcpipe.nn.registry import model_def
from hpcpipe.state.hdf5_source import HDF5Source
from hpcpipe.state.hf_source import HFSource
from hpcpipe.state.sources import resolve_weights
from hpcpipe.state.tokenizer import StoredTokenizer, Tokenizer
from hpcpipe.state.weights import write_weights
from hpcpipe.state.weights_source import WeightsSource

SOURCES = (HDF5Source, HFSource)
GPT = {"model": {"kind": "gpt", "vocab_size": 256, "seq_len": 16, "d_model": 16, "n_heads": 2, "n_blocks": 2},
       "parallel": {"pp": 1}}


def _protocol_members() -> dict[str, object]:
    """The protocol's own members: its properties and methods, by name."""
    return {name: value for name, value in vars(WeightsSource).items()
            if isinstance(value, property) or (inspect.isfunction(value) and not name.startswith("_"))}


def test_the_protocol_names_what_every_reader_uses():
    assert set(_protocol_members()) == {"path", "kind", "step", "n_layers", "model", "model_kind", "describe",
                                        "check", "tokenizer", "read", "read_optimizer", "forward_only",
                                        "matrix_itemsize"}


@pytest.mark.parametrize("cls", SOURCES, ids=lambda c: c.__name__)
def test_every_source_has_the_protocols_methods_with_the_same_signatures(cls):
    fields = {f.name for f in dataclasses.fields(cls)}
    for name, member in _protocol_members().items():
        if isinstance(member, property):    # a field or a property of the source
            assert name in fields or isinstance(getattr(cls, name, None), property), f"{cls.__name__}.{name}"
            continue
        theirs = inspect.signature(getattr(cls, name))
        ours = inspect.signature(member)
        # the same parameters: names, kinds, defaults and annotations (the return types are each source's own)
        assert list(theirs.parameters.values()) == list(ours.parameters.values()), f"{cls.__name__}.{name}"


def test_read_and_read_optimizer_take_the_same_arguments_everywhere():
    for name in ("read", "read_optimizer"):
        params = [list(inspect.signature(getattr(cls, name)).parameters) for cls in SOURCES]
        assert params == [["self", "indices", "shards"]] * len(SOURCES), name


def _weights_file(tmp_path):
    config = from_dict(GPT)
    model = model_def(config)
    path = tmp_path / "gpt.h5"
    write_weights(path, model.init_arrays(list(range(model.n_layers)), 0, "float32"), n_layers=model.n_layers,
                  model_config=config.to_dict()["model"], tokenizer=StoredTokenizer(Tokenizer("bytes").to_json()))
    return path, model


def test_a_weights_file_a_checkpoint_and_a_hugging_face_directory_are_each_a_weights_source(tmp_path):
    pytest.importorskip("tokenizers")
    from hpcpipe.state.hf_convert import export_hf

    path, model = _weights_file(tmp_path)
    export_hf(resolve_weights(path), tmp_path / "gpt-hf")
    sources = [resolve_weights(path), resolve_weights(DATA / "old-layout-checkpoint"),
               resolve_weights(tmp_path / "gpt-hf")]
    assert [s.kind for s in sources] == ["file", "checkpoint", "hf"]
    for source in sources:
        assert isinstance(source, WeightsSource), source.describe()
    stored, hf = sources[0], sources[2]
    mine = stored.read([1], None)
    theirs = hf.read([1], None)
    for name, array in mine[1].items():     # the same layer through either source
        np.testing.assert_allclose(theirs[1][name], array, rtol=1e-6, atol=1e-7)
    with pytest.raises(ConfigError, match="holds no optimizer state"):
        hf.read_optimizer([0], None)
    with pytest.raises(ConfigError, match="holds no optimizer state"):
        stored.read_optimizer([0], None)


def test_a_source_is_fixed_when_built_and_forward_only_makes_a_new_one(tmp_path):
    pytest.importorskip("tokenizers")
    from hpcpipe.state.hf_convert import export_hf

    path, _ = _weights_file(tmp_path)
    export_hf(resolve_weights(path), tmp_path / "gpt-hf", dtype="bfloat16")
    hf = resolve_weights(tmp_path / "gpt-hf")
    with pytest.raises(dataclasses.FrozenInstanceError):
        hf.dtype = "float64"
    wide = hf.forward_only("float64")
    half = hf.forward_only("float32", half_embedding=True)
    assert (hf.dtype, hf.half_embedding) == ("float32", False)            # the shared source is unchanged
    assert wide.read([1])[1]["ln1/weight"].dtype == np.float64
    assert type(half.read([0])[0]["tok_emb"]).__name__ == "HalfTable"   # 16 bits kept as stored
    assert isinstance(hf.read([0])[0]["tok_emb"], np.ndarray)
    stored = resolve_weights(path)
    assert stored.forward_only("float64", half_embedding=True) is stored  # float32 arrays come as stored
