"""hf/config.py: config.json of gpt2, llama, mistral and qwen2 in the transformers 4.x and 5.x styles -> the hpcpipe
kind and [model] keys, and every refusal as a one-line ConfigError naming the file and the values."""

import json

import pytest

from hpcpipe.errors import ConfigError
from hpcpipe.hf.config import read_hf_config

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
         "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
         "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "hidden_act": "silu", "tie_word_embeddings": False,
         "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "attention_bias": False, "mlp_bias": False}
LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
GPT2 = {"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024,
        "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-05, "bos_token_id": 50256,
        "eos_token_id": 50256, "torch_dtype": "float32"}


def write(directory, config, generation=None):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation))
    return directory


def error(tmp_path, config, name="m"):
    d = write(tmp_path / name, config)
    with pytest.raises(ConfigError) as info:
        read_hf_config(d)
    message = str(info.value)
    assert "\n" not in message
    assert str(d / "config.json") in message
    return message


def test_llama31_in_the_4x_style(tmp_path):
    cfg = {**LLAMA, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA3_ROPE},
           "torch_dtype": "bfloat16"}
    hf = read_hf_config(write(tmp_path / "m", cfg))
    assert (hf.model_type, hf.kind, hf.dtype) == ("llama", "llama", "bfloat16")
    assert hf.model == {"vocab_size": 128256, "seq_len": 131072, "d_model": 4096, "n_heads": 32, "n_kv_heads": 8,
                        "n_blocks": 32, "d_ff": 14336, "tie_embeddings": False, "rope_theta": 500000.0,
                        "rope_scaling": {"rope_type": "llama3", **LLAMA3_ROPE}, "norm_eps": 1e-05,
                        "qkv_bias": False, "head_dim": 128, "qk_norm": False, "sliding_window": 0,
                        "sliding_layers": []}
    assert hf.eos_ids == (128001, 128008, 128009) and hf.bos_id == 128000 and hf.n_groups == 34


def test_the_5x_style_gives_the_same_keys(tmp_path):
    four = {**LLAMA, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA3_ROPE},
            "torch_dtype": "float16"}
    five = {**LLAMA, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_ROPE},
            "dtype": "float16"}
    a, b = read_hf_config(write(tmp_path / "a", four)), read_hf_config(write(tmp_path / "b", five))
    assert a.model == b.model and a.dtype == b.dtype == "float16"


def test_legacy_type_key_and_defaults(tmp_path):
    cfg = {**LLAMA, "rope_scaling": {"type": "linear", "factor": 2.0}}
    del cfg["num_key_value_heads"], cfg["rms_norm_eps"]
    m = read_hf_config(write(tmp_path / "m", cfg)).model
    assert m["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert m["rope_theta"] == 10000.0 and m["n_kv_heads"] == 32 and m["norm_eps"] == 1e-6
    plain = read_hf_config(write(tmp_path / "p", {**LLAMA, "rope_parameters": {"rope_type": "default",
                                                                              "rope_theta": 1e6}})).model
    assert plain["rope_scaling"] is None and plain["rope_theta"] == 1e6


def test_rope_keys_agree_with_transformers(tmp_path):
    T = pytest.importorskip("transformers")
    small = {**LLAMA, "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 16384,
             "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **LLAMA3_ROPE}, "bos_token_id": 1,
             "eos_token_id": 2}
    d = write(tmp_path / "m", small)
    m = read_hf_config(d).model
    params = dict(T.AutoConfig.from_pretrained(d).rope_parameters)
    params.pop("type", None)
    assert params == {"rope_theta": m["rope_theta"], **m["rope_scaling"]}


@pytest.mark.parametrize("scaling", [{"rope_type": "linear", "factor": 2.0},
                                     {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}, None, {}])
def test_rope_scaling_beside_rope_parameters_reads_as_transformers(tmp_path, scaling):
    """A 5.x config.json (rope_parameters) to which the user added rope_scaling, as Qwen3's model card says for
    YaRN: transformers computes rope_scaling's rope; reading rope_parameters' default rope was another model."""
    T = pytest.importorskip("transformers")
    small = {**LLAMA, "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "bos_token_id": 1,
             "eos_token_id": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
             "rope_scaling": scaling}
    d = write(tmp_path / "m", small)
    m = read_hf_config(d).model
    params = dict(T.AutoConfig.from_pretrained(d).rope_parameters)
    assert params == {"rope_theta": m["rope_theta"], **(m["rope_scaling"] or {"rope_type": "default"})}


def test_unsupported_rope_scaling_beside_rope_parameters_is_refused(tmp_path):
    message = error(tmp_path, {**LLAMA, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
                               "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                "original_max_position_embeddings": 32768}})
    assert "'yarn'" in message and "rope_scaling" in message, message


def test_qwen2_mistral_and_head_dim(tmp_path):
    qwen = {**LLAMA, "model_type": "qwen2", "tie_word_embeddings": True, "head_dim": 64, "use_sliding_window": False,
            "sliding_window": 4096, "max_window_layers": 28, "dtype": "bfloat16"}
    m = read_hf_config(write(tmp_path / "q", qwen)).model
    assert m["qkv_bias"] is True and m["tie_embeddings"] is True and m["head_dim"] == 64
    mistral = {**LLAMA, "model_type": "mistral", "sliding_window": None, "head_dim": 128}
    del mistral["tie_word_embeddings"], mistral["attention_bias"]
    m = read_hf_config(write(tmp_path / "mi", mistral)).model
    assert m["qkv_bias"] is False and m["tie_embeddings"] is False
    at_context = {**mistral, "sliding_window": 131072}
    assert read_hf_config(write(tmp_path / "w", at_context)).model == m
    biased = read_hf_config(write(tmp_path / "b", {**LLAMA, "attention_bias": True})).model
    assert biased["qkv_bias"] is True


def test_sliding_windows_are_read_per_layer(tmp_path):
    # Mistral: one window on every layer; Qwen2/3: on the layers layer_types (or max_window_layers) name; a window
    # that covers the whole context hides nothing and reads as none
    n = LLAMA["num_hidden_layers"]
    mistral = read_hf_config(write(tmp_path / "m", {**LLAMA, "model_type": "mistral", "sliding_window": 4096})).model
    assert (mistral["sliding_window"], mistral["sliding_layers"]) == (4096, [])
    qwen = {**LLAMA, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4096}
    by_count = read_hf_config(write(tmp_path / "q", {**qwen, "max_window_layers": 4})).model
    assert (by_count["sliding_window"], by_count["sliding_layers"]) == (4096, list(range(4, n)))
    types = ["full_attention", "sliding_attention"] * (n // 2)
    by_type = read_hf_config(write(tmp_path / "t", {**qwen, "model_type": "qwen3", "layer_types": types})).model
    assert by_type["sliding_layers"] == list(range(1, n, 2)) and by_type["qk_norm"] is True
    off = read_hf_config(write(tmp_path / "o", {**qwen, "use_sliding_window": False})).model
    assert (off["sliding_window"], off["sliding_layers"]) == (0, [])


def test_gpt2(tmp_path):
    hf = read_hf_config(write(tmp_path / "g", GPT2))
    assert (hf.kind, hf.dtype, hf.eos_ids, hf.bos_id) == ("gpt", "float32", (50256,), 50256)
    assert hf.model == {"vocab_size": 50257, "seq_len": 1024, "d_model": 768, "n_heads": 12, "n_blocks": 12,
                        "d_ff": 3072, "tie_embeddings": True}
    other = read_hf_config(write(tmp_path / "h", {**GPT2, "n_inner": 1000, "activation_function": "gelu_pytorch_tanh",
                                                  "tie_word_embeddings": False})).model
    assert other["d_ff"] == 1000 and other["tie_embeddings"] is False


def test_generation_config_names_the_stop_ids(tmp_path):
    d = write(tmp_path / "m", LLAMA, {"eos_token_id": [7, 9], "bos_token_id": 5})
    hf = read_hf_config(d)
    assert hf.eos_ids == (7, 9) and hf.bos_id == 5
    d = write(tmp_path / "n", {**LLAMA, "eos_token_id": 3}, {"temperature": 0.6})
    assert read_hf_config(d).eos_ids == (3,)


@pytest.mark.parametrize("config, words", [
    ({**LLAMA, "model_type": "bert"}, ["'bert'", "gpt2, llama, mistral, qwen2"]),
    ({"vocab_size": 3}, ["None", "gpt2, llama, mistral, qwen2"]),
    ({**GPT2, "activation_function": "relu"}, ["activation_function", "'relu'", "gelu_new"]),
    ({**GPT2, "layer_norm_epsilon": 1e-6}, ["layer_norm_epsilon", "1e-06", "1e-05"]),
    ({**LLAMA, "hidden_act": "gelu"}, ["hidden_act", "'gelu'", "silu"]),
    ({**LLAMA, "mlp_bias": True}, ["mlp_bias"]),
    ({k: v for k, v in LLAMA.items() if k != "hidden_size"}, ["lacks", "'hidden_size'"]),
    ({k: v for k, v in GPT2.items() if k != "n_layer"}, ["lacks", "'n_layer'"]),
    ({**LLAMA, "num_hidden_layers": 0}, ["num_hidden_layers", "0"]),
    ({**LLAMA, "num_key_value_heads": 5}, ["num_attention_heads 32", "num_key_value_heads 5"]),
    ({**LLAMA, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, ["'dynamic'", "default, linear, llama3"]),
    ({**LLAMA, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, ["'yarn'"]),
    ({**LLAMA, "rope_parameters": {"rope_type": "linear", "rope_theta": 1e6}}, ["'linear'", "factor", "None"]),
    ({**LLAMA, "partial_rotary_factor": 0.5}, ["partial_rotary_factor", "0.5"]),
    ({**LLAMA, "rope_scaling": {"rope_type": "llama3", **LLAMA3_ROPE, "high_freq_factor": 1.0}},
     ["high_freq_factor (1.0)", "low_freq_factor (1.0)"]),
    ({**LLAMA, "head_dim": 63}, ["head_dim 63", "odd"]),
    ({**LLAMA, "model_type": "mistral", "sliding_window": -4}, ["sliding_window", "-4"]),
    ({**LLAMA, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4096,
      "layer_types": ["sliding_attention", "local"]}, ["layer_types", "'local'"]),
    ({**LLAMA, "torch_dtype": "int8"}, ["'int8'"]),
    ({**LLAMA, "quantization_config": {"quant_method": "gptq"}}, ["quantized", "'gptq'"]),
    ({**LLAMA, "eos_token_id": "two"}, ["eos_token_id", "'two'"]),
    # a reward model: it said "holds no lm_head.weight" (tie_word_embeddings false), as if the file were damaged
    ({**LLAMA, "architectures": ["LlamaForSequenceClassification"]}, ["LlamaForSequenceClassification",
                                                                      "causal language models"]),
    ({**LLAMA, "model_type": "qwen2", "architectures": ["Qwen2ForTokenClassification"]}, ["TokenClassification"]),
])
def test_refusals_name_file_and_values(tmp_path, config, words):
    message = error(tmp_path, config)
    for word in words:
        assert word in message, message


def test_directory_and_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist") as info:
        read_hf_config(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in str(info.value)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is not a directory"):
        read_hf_config(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="config.json' does not exist"):
        read_hf_config(tmp_path / "empty")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(ConfigError, match="is not valid JSON") as info:
        read_hf_config(bad)
    assert str(bad / "config.json") in str(info.value) and "\n" not in str(info.value)
    (bad / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        read_hf_config(bad)
    (bad / "config.json").write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_hf_config(bad)
    (bad / "config.json").write_text(json.dumps(LLAMA))
    (bad / "generation_config.json").write_text("{")
    with pytest.raises(ConfigError, match="generation_config.json' is not valid JSON"):
        read_hf_config(bad)
