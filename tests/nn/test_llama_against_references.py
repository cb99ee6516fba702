"""The whole Llama against a PyTorch float64 autograd reference written from the contract's equations (float64
and float32), and its logits against Hugging Face transformers (Llama, Mistral, Qwen2)."""

import numpy as np
import pytest
from llama_layer_parts import CASES, LLAMA3, loaded_model, random_groups

from hpcpipe.nn.core.rope import inverse_frequencies
from hpcpipe.nn.llama.shape import LlamaShape

torch = pytest.importorskip("torch")
from support.llama_reference import torch_llama  # noqa: E402

# --- the independent reference (PyTorch autograd, straight from the contract): tests/support/llama_reference.py

@pytest.mark.parametrize("case", sorted(CASES))
def test_llama_matches_torch_float64(case):
    shape = CASES[case]
    rng = np.random.default_rng(sorted(CASES).index(case))
    groups = random_groups(shape, rng)
    tokens = rng.integers(0, shape.vocab, (2, shape.seq_len))
    targets = rng.integers(0, shape.vocab, (2, shape.seq_len))
    model = loaded_model(shape, groups)
    loss = model.loss_and_grad(tokens, targets)
    ref_loss, ref_grads, ref_logits = torch_llama(shape, groups, tokens, targets)
    np.testing.assert_allclose(model.forward(tokens)[0], ref_logits, rtol=0, atol=1e-10 * np.abs(ref_logits).max())
    assert abs(loss - ref_loss) <= 1e-12 * abs(ref_loss)
    largest = max(np.abs(v).max() for g in ref_grads for v in g.values())
    for i, ref in enumerate(ref_grads):
        assert set(ref) == set(model.grads[i])
        for name, want in ref.items():
            worst = np.abs(model.grads[i][name] - want).max()
            assert worst <= 1e-7 * largest, (case, i, name, worst, largest)


def test_rope_scaling_changes_the_model():
    """The scaled cases differ from unscaled RoPE (so the reference comparison covers the scaling)."""
    for scaling in (LLAMA3, {"rope_type": "linear", "factor": 2.0}):
        assert not np.allclose(inverse_frequencies(8, 10000.0, scaling), inverse_frequencies(8, 10000.0, None))
    inv = np.array(inverse_frequencies(8, 10000.0, LLAMA3))      # wavelengths 6.3 (kept), 63 (smoothed), 628 (/4)
    base = np.array(inverse_frequencies(8, 10000.0))
    assert inv[0] == base[0] and inv[2] == base[2] / 4 and base[1] / 4 < inv[1] < base[1]


def test_float32_stays_float32():
    shape = CASES["gqa_tied_bias"]
    rng = np.random.default_rng(3)
    groups = random_groups(shape, rng)
    model = loaded_model(shape, groups, "float32")
    tokens = rng.integers(0, shape.vocab, (2, 8))
    logits, caches = model.forward(tokens)
    assert logits.dtype == np.float32
    pending = list(caches)
    while pending:
        item = pending.pop()
        if isinstance(item, tuple | list):
            pending.extend(item)
        elif item is not None and item.dtype.kind == "f":
            assert item.dtype == np.float32
    loss = model.loss_and_grad(tokens, tokens)
    ref_loss, ref_grads, _ = torch_llama(shape, groups, tokens, tokens)
    assert model.grad.dtype == np.float32
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    largest = max(np.abs(v).max() for g in ref_grads for v in g.values())
    worst = max(np.abs(model.grads[i][k] - v).max() for i, g in enumerate(ref_grads) for k, v in g.items())
    assert worst <= 1e-4 * largest


# --- Hugging Face transformers

def _hf_groups(model, shape):
    """Our layer groups from a *ForCausalLM's state_dict: nn.Linear weights (out, in) -> (in, out)."""
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    groups = [{"tok_emb": sd["model.embed_tokens.weight"]}]
    for i in range(shape.n_blocks):
        pre = f"model.layers.{i}."
        g = {"attn_norm/weight": sd[pre + "input_layernorm.weight"],
             "mlp_norm/weight": sd[pre + "post_attention_layernorm.weight"]}
        for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj")):
            g[f"attn/{ours}/weight"] = sd[f"{pre}self_attn.{theirs}.weight"].T
            if shape.qkv_bias and ours != "o":
                g[f"attn/{ours}/bias"] = sd[f"{pre}self_attn.{theirs}.bias"]
        for ours in ("gate", "up", "down"):
            g[f"mlp/{ours}/weight"] = sd[f"{pre}mlp.{ours}_proj.weight"].T
        groups.append(g)
    final = {"norm/weight": sd["model.norm.weight"]}
    if not shape.tied:
        final["head/weight"] = sd["lm_head.weight"].T
    return groups + [final]


def _hf_case(family, tied, bias=False, rope=None, theta=10000.0, head_dim=None):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(17)
    common = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
                  tie_word_embeddings=tied, rope_parameters=dict(rope or {"rope_type": "default"}, rope_theta=theta))
    if head_dim:
        common["head_dim"] = head_dim
    if family == "llama":
        config, cls = transformers.LlamaConfig(attention_bias=bias, **common), transformers.LlamaForCausalLM
    elif family == "mistral":
        config, cls = transformers.MistralConfig(sliding_window=None, **common), transformers.MistralForCausalLM
    else:
        config, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():     # far from the init, so every term counts
            if name.endswith("o_proj.bias"):
                p.zero_()                          # Llama's attention_bias also biases o: not in the contract
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    shape = LlamaShape(vocab=97, seq_len=16, d_model=32, n_heads=4, n_blocks=2, d_ff=48, tied=tied, n_kv_heads=2,
                       head_dim=head_dim or 0, rope_theta=theta, rope_scaling=rope, norm_eps=1e-6,
                       qkv_bias=bias or family == "qwen2")
    ours = loaded_model(shape, _hf_groups(model, shape), "float32")
    tokens = np.random.default_rng(5).integers(0, 97, (2, 11))
    with torch.no_grad():
        want = model(torch.as_tensor(tokens)).logits.numpy()
    got = ours.forward(tokens)[0]
    assert got.dtype == np.float32
    return np.abs(got - want).max() / np.abs(want).max(), model


HF_CASES = [("llama", True, False, None, 10000.0, None), ("llama", False, False, None, 500000.0, None),
            ("llama", True, True, None, 10000.0, None), ("llama", False, True, None, 10000.0, None),
            ("llama", True, False, dict(LLAMA3, factor=8.0, original_max_position_embeddings=32), 500000.0, None),
            ("llama", False, False, {"rope_type": "linear", "factor": 3.0}, 10000.0, 12),
            ("mistral", False, False, None, 10000.0, None), ("mistral", True, False, None, 1e6, 12),
            ("qwen2", True, True, None, 1e6, None), ("qwen2", False, True, None, 10000.0, None)]


@pytest.mark.parametrize("case", HF_CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_logits_match_hugging_face(case):
    err, model = _hf_case(*case)
    assert err <= 1e-5, err
    if case[3] is not None:                        # the same inverse frequencies as transformers computes
        hf = model.model.rotary_emb.inv_freq.numpy()
        np.testing.assert_allclose(inverse_frequencies(case[5] or 8, case[4], case[3]), hf, rtol=1e-6, atol=0)
