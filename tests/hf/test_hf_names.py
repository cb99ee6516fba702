"""hf/names.py with real transformers models: read_groups reproduces every tensor (float32, float16, bfloat16; one
file or 3+ shards), a rank reading group k touches only group k's tensors, and hf_state + hf_config_dict + the
writer give a directory AutoModelForCausalLM loads with identical tensors and outputs (gpt2, llama, qkv bias)."""

import copy
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
T = pytest.importorskip("transformers")

from support.hf import save_model, tiny_model  # noqa: E402

from hpcpipe.errors import ConfigError  # noqa: E402
from hpcpipe.hf.config import read_hf_config  # noqa: E402
from hpcpipe.hf.names import hf_config_dict, hf_state, read_groups  # noqa: E402
from hpcpipe.hf.safetensors import INDEX, SINGLE, open_tensors, write_safetensors, write_sharded  # noqa: E402

CASES = {"gpt2": ("gpt2", {}), "gpt2-untied": ("gpt2", {"tie_word_embeddings": False}),
         "llama": ("llama", {}), "llama-tied": ("llama", {"tie_word_embeddings": True}),
         "llama-bias": ("llama", {"attention_bias": True}), "mistral": ("mistral", {"head_dim": 16}),
         "qwen2": ("qwen2", {"head_dim": 16, "tie_word_embeddings": True}),
         "llama-rope": ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 16}})}
SHARD = "6KB"   # a few tensors per file: 3 or more shards for every case


@pytest.fixture(scope="module")
def models():
    return {name: tiny_model(arch, seed=i, **overrides) for i, (name, (arch, overrides)) in enumerate(CASES.items())}


def expected_groups(model, kind):
    """{group: {hpcpipe name: float32 array}} written out by hand from the torch modules (not from names.py)."""
    t = lambda p: p.detach().float().numpy()              # noqa: E731
    tt = lambda p: p.detach().float().numpy().T           # noqa: E731
    cfg = model.config
    if kind == "gpt":
        base = model.transformer
        out = {0: {"tok_emb": t(base.wte.weight), "pos_emb": t(base.wpe.weight)}}
        for i, h in enumerate(base.h):
            out[i + 1] = {"ln1/weight": t(h.ln_1.weight), "ln1/bias": t(h.ln_1.bias),
                          "attn/qkv/weight": t(h.attn.c_attn.weight), "attn/qkv/bias": t(h.attn.c_attn.bias),
                          "attn/proj/weight": t(h.attn.c_proj.weight), "attn/proj/bias": t(h.attn.c_proj.bias),
                          "ln2/weight": t(h.ln_2.weight), "ln2/bias": t(h.ln_2.bias),
                          "mlp/fc/weight": t(h.mlp.c_fc.weight), "mlp/fc/bias": t(h.mlp.c_fc.bias),
                          "mlp/proj/weight": t(h.mlp.c_proj.weight), "mlp/proj/bias": t(h.mlp.c_proj.bias)}
        final = {"ln_f/weight": t(base.ln_f.weight), "ln_f/bias": t(base.ln_f.bias)}
    else:
        base = model.model
        out = {0: {"tok_emb": t(base.embed_tokens.weight)}}
        for i, layer in enumerate(base.layers):
            a, m = layer.self_attn, layer.mlp
            g = {"attn_norm/weight": t(layer.input_layernorm.weight), "attn/q/weight": tt(a.q_proj.weight),
                 "attn/k/weight": tt(a.k_proj.weight), "attn/v/weight": tt(a.v_proj.weight),
                 "attn/o/weight": tt(a.o_proj.weight), "mlp_norm/weight": t(layer.post_attention_layernorm.weight),
                 "mlp/gate/weight": tt(m.gate_proj.weight), "mlp/up/weight": tt(m.up_proj.weight),
                 "mlp/down/weight": tt(m.down_proj.weight)}
            if a.q_proj.bias is not None:
                g.update({"attn/q/bias": t(a.q_proj.bias), "attn/k/bias": t(a.k_proj.bias),
                          "attn/v/bias": t(a.v_proj.bias)})
            out[i + 1] = g
        final = {"norm/weight": t(base.norm.weight)}
    if not cfg.tie_word_embeddings:
        final["head/weight"] = tt(model.lm_head.weight)
    out[len(out)] = final
    return out


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shard", [None, SHARD])
@pytest.mark.parametrize("case", list(CASES))
def test_read_groups_reproduces_every_tensor(tmp_path, models, case, dtype, shard):
    model = models[case]
    d = save_model(model, tmp_path / case, dtype, shard)
    assert (d / INDEX).exists() == bool(shard)
    if shard:
        assert len(set(json.loads((d / INDEX).read_text())["weight_map"].values())) >= 3
    hf = read_hf_config(d)
    assert hf.dtype == dtype and hf.kind == ("gpt" if case.startswith("gpt2") else "llama")
    got = read_groups(hf, open_tensors(d), range(hf.n_groups), np.float32)
    want = expected_groups(copy.deepcopy(model).to(getattr(torch, dtype)), hf.kind)   # the file's values, widened
    assert got.keys() == want.keys()
    for index in want:
        assert got[index].keys() == want[index].keys(), index
        for name, value in want[index].items():
            assert got[index][name].dtype == np.float32 and got[index][name].flags.c_contiguous
            assert np.array_equal(got[index][name], value), (index, name)


def test_a_stage_reads_only_its_own_tensors(tmp_path, models):
    d = save_model(models["llama"], tmp_path / "m", "bfloat16", SHARD)
    weight_map = json.loads((d / INDEX).read_text())["weight_map"]
    hf = read_hf_config(d)
    for k in range(hf.n_groups):
        if k == 0:
            mine = ["model.embed_tokens.weight"]
        elif k <= hf.model["n_blocks"]:
            mine = [n for n in weight_map if n.startswith(f"model.layers.{k - 1}.")]
        else:
            mine = ["model.norm.weight", "lm_head.weight"]
        tensors = open_tensors(d)
        group = read_groups(hf, tensors, [k], np.float32)[k]
        assert len(group) == len(mine)
        assert sorted(tensors.opened) == sorted({weight_map[n] for n in mine})
        assert tensors.bytes_read == sum(tensors.info(n).end - tensors.info(n).begin for n in mine)
        assert tensors.bytes_read == 2 * sum(a.size for a in group.values())


def _export(hf, groups, out, dtype="float32"):
    state = hf_state(hf.kind, hf.model, groups)
    out.mkdir()
    (out / "config.json").write_text(json.dumps(hf_config_dict(hf.kind, hf.model, dtype, hf.eos_ids, hf.bos_id)))
    write_sharded(out, state, 8000, dtype=dtype)
    return state


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_through_transformers(tmp_path, models, case):
    model = models[case]
    d = save_model(model, tmp_path / "in")
    hf = read_hf_config(d)
    _export(hf, read_groups(hf, open_tensors(d), range(hf.n_groups)), tmp_path / "out")
    again = read_hf_config(tmp_path / "out")
    assert again.model == hf.model and again.eos_ids == hf.eos_ids and again.kind == hf.kind
    loaded = T.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    expected_class = {"llama-bias": "Qwen2ForCausalLM", "mistral": "LlamaForCausalLM"}.get(case, type(model).__name__)
    assert type(loaded).__name__ == expected_class
    theirs, ours = model.state_dict(), loaded.state_dict()
    assert set(ours) <= set(theirs)
    assert sorted(set(theirs) - set(ours)) == ([f"model.layers.{i}.self_attn.o_proj.bias" for i in range(2)]
                                               if case == "llama-bias" else [])
    for name, value in ours.items():
        assert torch.equal(value, theirs[name]), name
    ids = torch.randint(0, 100, (2, 17))
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)


def test_round_trip_in_bfloat16(tmp_path, models):
    model = models["llama"]
    d = save_model(model, tmp_path / "in", "bfloat16")
    hf = read_hf_config(d)
    _export(hf, read_groups(hf, open_tensors(d), range(hf.n_groups)), tmp_path / "out", "bfloat16")
    loaded = T.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.dtype == torch.bfloat16
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, model.state_dict()[name].to(torch.bfloat16)), name


def _rewrite(d, change):
    """Rewrite a single-file model's tensors through change({name: array}) -> {name: array}."""
    st = pytest.importorskip("safetensors.numpy")
    write_safetensors(d / SINGLE, change(st.load_file(str(d / SINGLE))))


def _failure(action, *words):
    with pytest.raises(ConfigError) as info:
        action()
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message
    return message


def test_untied_config_without_lm_head(tmp_path, models):
    d = save_model(models["llama"], tmp_path / "m")
    _rewrite(d, lambda s: {k: v for k, v in s.items() if k != "lm_head.weight"})
    hf = read_hf_config(d)
    _failure(lambda: read_groups(hf, open_tensors(d), [0]), "lm_head.weight", str(d / SINGLE),
             str(d / "config.json"), "tie_word_embeddings false")


def test_shape_missing_tensor_nan_and_o_bias(tmp_path, models):
    d = save_model(models["llama"], tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "intermediate_size": 40}))
    hf = read_hf_config(d)
    _failure(lambda: read_groups(hf, open_tensors(d), [1]), "'model.layers.0.mlp.gate_proj.weight'",
             str(d / SINGLE), "(48, 32)", "(40, 32)")
    (d / "config.json").write_text(json.dumps(config))
    hf = read_hf_config(d)
    _rewrite(d, lambda s: {k: v for k, v in s.items() if k != "model.layers.1.input_layernorm.weight"})
    _failure(lambda: read_groups(hf, open_tensors(d), [0]), "'model.layers.1.input_layernorm.weight'",
             str(d / SINGLE), "group 2")

    d = save_model(models["llama"], tmp_path / "nan")
    _rewrite(d, lambda s: {**s, "model.norm.weight": np.full(32, np.nan, np.float32)})
    _failure(lambda: read_groups(read_hf_config(d), open_tensors(d), [3]), "'model.norm.weight'", "32 non-finite")

    d = save_model(models["llama-bias"], tmp_path / "bias")
    hf = read_hf_config(d)
    assert read_groups(hf, open_tensors(d), [1])[1]["attn/q/bias"].shape == (32,)
    _rewrite(d, lambda s: {**s, "model.layers.1.self_attn.o_proj.bias": np.ones(32, np.float32)})
    _failure(lambda: read_groups(hf, open_tensors(d), [2]), "'model.layers.1.self_attn.o_proj.bias'",
             "not zero", "o_proj")


def test_names_without_the_base_model_prefix(tmp_path, models):
    d = save_model(models["llama"], tmp_path / "m")
    hf = read_hf_config(d)
    want = read_groups(hf, open_tensors(d), range(hf.n_groups))
    _rewrite(d, lambda s: {k.removeprefix("model."): v for k, v in s.items()})
    got = read_groups(hf, open_tensors(d), range(hf.n_groups))
    assert all(np.array_equal(got[i][n], want[i][n]) for i in want for n in want[i])

    g = save_model(models["gpt2"], tmp_path / "g")   # the original GPT-2 file: no prefix, attention mask buffers
    hf = read_hf_config(g)
    want = read_groups(hf, open_tensors(g), range(hf.n_groups))
    _rewrite(g, lambda s: {**{k.removeprefix("transformer."): v for k, v in s.items()},
                           "h.0.attn.bias": np.tril(np.ones((1, 1, 64, 64), np.float32))})
    got = read_groups(hf, open_tensors(g), range(hf.n_groups))
    assert all(np.array_equal(got[i][n], want[i][n]) for i in want for n in want[i])


def test_hf_state_refuses_a_wrong_group(models):
    keys = {"vocab_size": 100, "seq_len": 64, "d_model": 32, "n_heads": 4, "n_blocks": 1, "d_ff": 0,
            "tie_embeddings": True}
    with pytest.raises(ConfigError, match="tok_emb"):
        hf_state("gpt", keys, {0: {"pos_emb": np.zeros((64, 32))}})
    with pytest.raises(ConfigError, match=r"\(100, 32\)"):
        hf_state("gpt", keys, {0: {"pos_emb": np.zeros((64, 32)), "tok_emb": np.zeros((32, 100))}})
    config = hf_config_dict("gpt", keys)
    assert config["n_inner"] == 128 and config["activation_function"] == "gelu_new"
    assert config["resid_pdrop"] == config["embd_pdrop"] == config["attn_pdrop"] == 0.0


@pytest.mark.parametrize("case", list(CASES))
def test_the_groups_are_the_nn_kinds_groups(tmp_path, models, case):
    """The names and shapes read_groups gives are the ones hpcpipe's gpt and llama kinds declare."""
    d = save_model(models[case], tmp_path / "m")
    hf = read_hf_config(d)
    m = hf.model
    if hf.kind == "gpt":
        params = pytest.importorskip("hpcpipe.nn.gpt.shape")
        shape = params.GPTShape(vocab=m["vocab_size"], seq_len=m["seq_len"], d_model=m["d_model"],
                                n_heads=m["n_heads"], n_blocks=m["n_blocks"], d_ff=m["d_ff"], tied=m["tie_embeddings"])
    else:
        params = pytest.importorskip("hpcpipe.nn.llama.shape")
        shape = params.LlamaShape(vocab=m["vocab_size"], seq_len=m["seq_len"], d_model=m["d_model"],
                                  n_heads=m["n_heads"], n_blocks=m["n_blocks"], d_ff=m["d_ff"],
                                  tied=m["tie_embeddings"], n_kv_heads=m["n_kv_heads"], head_dim=m["head_dim"],
                                  rope_theta=m["rope_theta"], rope_scaling=m["rope_scaling"], norm_eps=m["norm_eps"],
                                  qkv_bias=m["qkv_bias"])
    groups = read_groups(hf, open_tensors(d), range(hf.n_groups))
    for index, arrays in groups.items():
        assert {n: a.shape for n, a in arrays.items()} == dict(params.group_params(shape, index)), index


def test_llama_ff_default_is_the_nn_kinds():
    # d_ff 0 written out as config.json's intermediate_size is the width the llama kind computes with
    from hpcpipe.nn.llama.hf import dims_of
    from hpcpipe.nn.llama.shape import LlamaShape
    for d in (32, 64, 100, 4096, 5120, 8192):
        keys = {"d_ff": 0, "d_model": d, "n_heads": 4}
        assert dims_of(keys)[0] == LlamaShape(16, 8, d, 4, 1, head_dim=2).ff
