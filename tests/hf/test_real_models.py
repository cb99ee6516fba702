"""Hugging Face models served by hpcpipe as they are: greedy text through the real openai client (completions and
chat) equals transformers' greedy generate on the same directory, for tiny random models of every supported
model_type (GQA and MQA, tied and untied, q/k/v biases, two RoPE thetas) at pp=1, pp=2 and dp=2 x pp=2; logits of
the model hpcpipe reads from safetensors (float32, float16, bfloat16, sharded) within 1e-5 of transformers'."""

from __future__ import annotations

import numpy as np
import pytest
from support.hf import bytelevel_tokenizer, save_model, save_tokenizer, tiny_model
from support.serve import Server

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CHAT = ("{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|start|>", "<|end|>"]
# (model_type, transformers config overrides): every case of the contract at least once
MODELS = {
    "gpt2": ("gpt2", {}),
    "llama-gqa-untied-bias": ("llama", {"attention_bias": True, "tie_word_embeddings": False}),
    "llama-mqa-tied-theta5e5": ("llama", {"num_key_value_heads": 1, "tie_word_embeddings": True,
                                          "rope_theta": 500000.0}),
    "mistral": ("mistral", {"tie_word_embeddings": False}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {"tie_word_embeddings": False}),
    "mixtral": ("mixtral", {"tie_word_embeddings": False}),
    "qwen3-moe": ("qwen3_moe", {"tie_word_embeddings": True}),
}
PROMPTS = ["The quick brown fox", "pipeline stage"]
NEW_TOKENS = 12


def _tokenizer():
    return bytelevel_tokenizer(SPECIALS, vocab_size=300)


def _model_dir(root, name: str):
    """Write model + tokenizer (with a chat template) of case name once; return (dir, model, tokenizer)."""
    arch, overrides = MODELS[name]
    tok = _tokenizer()
    vocab = tok.get_vocab_size()
    eos = tok.token_to_id("<|end|>")
    model = tiny_model(arch, vocab_size=vocab, bos_token_id=tok.token_to_id("<|start|>"), eos_token_id=eos,
                       **overrides)
    directory = root / name
    save_model(model, directory)
    save_tokenizer(tok, directory, {"chat_template": CHAT}, bos_token="<|start|>", eos_token="<|end|>")
    return directory, model, transformers.AutoTokenizer.from_pretrained(str(directory))


def _greedy(model, fast, prompt_ids: list[int]) -> str:
    """transformers' greedy continuation (stopping at eos) decoded as decode(ids, skip_special_tokens=True)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=fast.eos_token_id)
    return fast.decode(out[0][len(prompt_ids):], skip_special_tokens=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-models")
    return {name: _model_dir(root, name) for name in MODELS}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("n,layout", [(1, "1"), (2, "2"), (4, "2")])
def test_greedy_text_through_the_openai_client_equals_transformers(models, name, n, layout):
    directory, model, fast = models[name]
    with Server(n, directory, "--set", f"parallel.pp={layout}") as server:
        client = server.client()
        for prompt in PROMPTS:
            want = _greedy(model, fast, fast(prompt)["input_ids"])
            got = client.completions.create(model=name, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
            assert got.choices[0].text == want, (name, n, prompt)
            assert got.choices[0].finish_reason in ("stop", "length")
        messages = [{"role": "user", "content": PROMPTS[0]}]
        chat_ids = fast.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        chat_ids = chat_ids["input_ids"] if isinstance(chat_ids, dict) or hasattr(chat_ids, "keys") else chat_ids
        want = _greedy(model, fast, list(chat_ids))
        got = client.chat.completions.create(model=name, messages=messages, max_tokens=NEW_TOKENS, temperature=0)
        assert got.choices[0].message.content == want and got.choices[0].message.role == "assistant"
        assert got.usage.prompt_tokens == len(chat_ids)
        stream = client.chat.completions.create(model=name, messages=messages, max_tokens=NEW_TOKENS,
                                                temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want


def _logits(source_dir, tokens, dtype="float64"):
    """hpcpipe's logits of the model it reads from a Hugging Face directory (the sequential reference)."""
    from hpcpipe.config import from_dict
    from hpcpipe.evaluate import load_decoder, logits_of
    from hpcpipe.nn.registry import model_def
    from hpcpipe.state.sources import resolve_weights

    source = resolve_weights(source_dir).forward_only(dtype)
    config = from_dict({"model": {**source.model, "dtype": dtype}, "parallel": {"pp": 1}})
    model = load_decoder(source, model_def(config), dtype)
    return logits_of(model, tokens)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_logits_of_the_model_read_from_safetensors_are_transformers_logits(models, name, tmp_path):
    directory, model, _ = models[name]
    tokens = np.random.default_rng(1).integers(0, model.config.vocab_size, (2, 11))
    with torch.no_grad():
        want = model(torch.tensor(tokens)).logits.numpy()
    got = _logits(directory, tokens, "float32")
    assert np.abs(got - want).max() / np.abs(want).max() <= 1e-5
    # bf16 and f16 on disk, sharded: read exactly, computed in float64 against the same rounded weights (1e-6:
    # transformers keeps RoPE's inverse frequencies in float32 even in a float64 model; a wrongly widened bf16
    # value would be off by 1e-2)
    for dtype, shard in (("bfloat16", "20KB"), ("float16", None)):
        other = save_model(model, tmp_path / f"{name}-{dtype}", dtype, shard)
        for file in ("tokenizer.json", "tokenizer_config.json"):
            (other / file).write_bytes((directory / file).read_bytes())
        # transformers' experts multiply in float32 at most (grouped products): the moe kinds compare there
        wide, tol = ("float32", 1e-5) if MODELS[name][0] in ("mixtral", "qwen3_moe") else ("float64", 1e-6)
        rounded = transformers.AutoModelForCausalLM.from_pretrained(str(other), dtype=getattr(torch, wide)).eval()
        with torch.no_grad():
            want = rounded(torch.tensor(tokens)).logits.numpy()
        got = _logits(other, tokens, wide)
        assert np.abs(got - want).max() / np.abs(want).max() <= tol, (name, dtype)
