"""Config parsing, overrides, validation and partitioning: errors name the values."""

import pytest

from hpcpipe.config import Config, load_config, resolve_layout
from hpcpipe.errors import ConfigError
from hpcpipe.nn.mlp.model import init_layer, layer_specs
from hpcpipe.nn.partition import partition


def test_embedded_default_is_dp2_by_pp4_on_8_ranks():
    config = load_config()
    assert config == Config()
    assert resolve_layout(config, 8) == (2, 4)
    assert config.model.dims == [16] * 5 and config.parallel.schedule == "gpipe"


def test_file_and_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[parallel]\npp = 2\n[train]\nsteps = 5\nlr = 1\n')
    config = load_config(path, ["train.steps=7", "model.dims=[4, 8, 2]", "train.optimizer=adam",
                                "model.bias=false", "parallel.dp=\"auto\""])
    assert config.parallel.pp == 2 and config.train.steps == 7 and config.train.lr == 1.0
    assert config.model.dims == [4, 8, 2] and config.train.optimizer == "adam" and config.model.bias is False


@pytest.mark.parametrize("overrides,message", [
    (["train.stepz=3"], "unknown key train.stepz"),
    (["trian.steps=3"], r"unknown section \[trian\]"),
    (["train.steps=ten"], r"train.steps must be int, got 'ten' \(str\)"),
    (["train.lr=true"], r"train.lr must be float, got True \(bool\)"),
    (["model.dims=[16, 0]"], r"model.dims needs at least two positive widths, got \[16, 0\]"),
    (["parallel.pp=8"], r"parallel.pp \(8\) x parallel.virtual_stages \(1\) exceeds the number of layers \(4\)"),
    (["train.loss=hinge"], "train.loss 'hinge' is not one of mse, cross_entropy"),
    (["model.activation=swish"], "model.activation 'swish' is not one of relu, gelu, tanh, identity"),
    (["parallel.schedule=foo"], "parallel.schedule 'foo' is not one of"),
    (["train.momentum=1.5"], r"train.momentum must be in \[0, 1\), got 1.5"),
    (["steps=3"], "--set key must be section.key, got 'steps'"),
    (["train.steps"], "--set expects section.key=value"),
    (["parallel.pp=\"auto\""], "parallel.pp and parallel.dp cannot both be \"auto\""),
    (["parallel.pp=2.0"], r'parallel.pp must be a positive integer or "auto", got 2.0 \(float\)'),   # was "int | str"
    (["parallel.stage_layers=2.5"], r'parallel.stage_layers must be a list of layer counts or "profile", got 2.5'),
    (["model.kind=moe", "parallel.pp=1", "parallel.dp=2", "parallel.ep=2", "train.zero=1", "train.optimizer=adam"],
     r"train.zero = 1 with parallel.ep = 2 is not supported"),
])
def test_bad_values_are_refused_with_a_message_naming_them(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


@pytest.mark.parametrize("overrides,toml,message", [
    (["train.setps=5"], "", "unknown key train.setps: did you mean train.steps? (known keys in [train]: "),
    (["model.dimz=[4, 4]"], "", "unknown key model.dimz: did you mean model.dims? (known keys"),
    (["model.steps=5"], "", "unknown key model.steps: did you mean train.steps? (known keys in [model]: "),
    ([], "[trian]\nsteps = 5\n", "unknown section [trian]: did you mean [train]? (known sections: "),
    (["train.xyzzy=1"], "", "unknown key train.xyzzy (known keys in [train]: "),      # nothing close: no guess
    # another case: no guess was made ("unknown section [TRAIN] (known sections: ...")
    (["TRAIN.STEPS=3"], "", "unknown section [TRAIN]: did you mean [train]? (known sections: "),
    (["train.STEPS=3"], "", "unknown key train.STEPS: did you mean train.steps? (known keys in [train]: "),
    ([], "[Train]\nsteps = 5\n", "unknown section [Train]: did you mean [train]? (known sections: "),
    # a key above the first header: was "unknown section [steps]"
    ([], "steps = 5\n[train]\nlr = 0.1\n", "key 'steps' is outside any section: write it under [train] (TOML"),
])
def test_a_misspelled_key_suggests_the_closest_known_one(tmp_path, overrides, toml, message):
    """Issue #32: `--set train.setps=5` and `[trian]` name the key meant, in the same one line."""
    path = tmp_path / "c.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_config(path if toml else None, overrides)
    assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="config file .*nope.toml' does not exist"):
        load_config(tmp_path / "nope.toml")


def test_a_config_path_that_is_a_symlink_loop_or_dangling_says_so(tmp_path):
    # was: "does not exist" for both, which sends the user looking for a missing file
    (tmp_path / "loop.toml").symlink_to(tmp_path / "loop.toml")
    with pytest.raises(ConfigError, match=r"loop.toml' is a symbolic link loop \(ELOOP"):
        load_config(tmp_path / "loop.toml")
    (tmp_path / "gone.toml").symlink_to(tmp_path / "moved.toml")
    with pytest.raises(ConfigError, match=r"gone.toml' is a symbolic link to '.*moved.toml', which does not exist"):
        load_config(tmp_path / "gone.toml")


def test_world_size_mismatch_names_the_sizes():
    config = load_config(None, ["parallel.dp=2"])
    with pytest.raises(ConfigError, match=r"world size 6 does not equal parallel.dp \(2\) x parallel.pp \(4\) = 8"):
        resolve_layout(config, 6)
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by parallel.pp \(4\)"):
        resolve_layout(load_config(), 6)


def test_partition_balances_flops_and_honours_explicit_counts():
    config = load_config(None, ["model.dims=[8, 64, 64, 8, 8, 8]"])
    specs = layer_specs(config)
    # costs 512, 4096, 512, 64, 64: the 4096 layer alone is the bottleneck stage
    assert [list(r) for r in partition(specs, 2)] == [[0], [1, 2, 3, 4]] or \
        [list(r) for r in partition(specs, 2)] == [[0, 1], [2, 3, 4]]
    assert max(sum(specs[i].fan_in * specs[i].fan_out for i in r) for r in partition(specs, 3)) == 4096
    assert [len(r) for r in partition(specs, 2, [1, 4])] == [1, 4]
    with pytest.raises(ConfigError, match=r"stage layer counts \[2, 2\] do not split 5 layers into 2 stages"):
        partition(specs, 2, [2, 2])


def test_initial_weights_depend_only_on_seed_and_layer_index():
    specs = layer_specs(load_config(None, ["model.dims=[4, 5, 6]", "parallel.pp=1"]))
    w1, _ = init_layer(specs[1], seed=3)
    w1_again, _ = init_layer(specs[1], seed=3)
    w0, _ = init_layer(specs[0], seed=3)
    assert (w1 == w1_again).all() and w1.shape == (5, 6) and w0.shape == (4, 5)
    assert not (init_layer(specs[1], seed=4)[0] == w1).all()


@pytest.mark.parametrize("override,message", [
    ("train.lr=.1", "train.lr must be float, got '.1' (str) (not a TOML number; write --set train.lr=0.1, or "
                    "lr = 0.1 in the file)"),
    ('train.lr="0.1"', "train.lr must be float, got '0.1' (str) (not a TOML number; write --set train.lr=0.1, or "
                       "lr = 0.1 in the file)"),
    ("train.steps=1.", "train.steps must be int, got '1.' (str) (not a TOML number; write --set train.steps=1, or "
                       "steps = 1 in the file)"),
    ("train.steps=ten", "train.steps must be int, got 'ten' (str)"),          # no number: no hint
])
def test_a_number_toml_cannot_read_says_how_to_write_it(override, message):
    # was only "must be float, got '.1' (str)": .1 looks like a number to anyone but TOML
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert str(info.value) == message


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_16_bit_model_dtype_points_at_the_weight_format(dtype):
    """A bf16 checkpoint's user sets model.dtype = "bfloat16": the refusal named only float32 and float64."""
    with pytest.raises(ConfigError) as info:
        load_config(None, [f'model.dtype="{dtype}"'])
    message = str(info.value)
    assert "float32, float64" in message and 'model.weight_format = "stored"' in message and "\n" not in message
    with pytest.raises(ConfigError) as info:
        load_config(None, ['model.dtype="int8"'])
    assert "weight_format" not in str(info.value)
