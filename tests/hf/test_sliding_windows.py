"""Sliding-window attention as transformers computes it: a Mistral with a 16-token window over a 64-token context
greedy-generates transformers' text through the openai client (pp=1 and pp=2) and gives its logits at every
position; a Qwen3 whose layer_types mix windowed and full layers too (NumPy and compiled stages alike)."""

from __future__ import annotations

import numpy as np
import pytest
from support.hf import bytelevel_tokenizer, save_model, save_tokenizer, tiny_model
from support.serve import Server

from hpcpipe.kernels import cpu

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CASES = {
    "mistral-window16": ("mistral", {"sliding_window": 16, "max_position_embeddings": 64,
                                     "tie_word_embeddings": False}),
    "qwen3-mixed-windows": ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "num_hidden_layers": 3,
                                      "max_position_embeddings": 64,
                                      "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("windows")
    tok = bytelevel_tokenizer(["<|endoftext|>"], vocab_size=300)
    out = {}
    for name, (arch, overrides) in CASES.items():
        model = tiny_model(arch, vocab_size=tok.get_vocab_size(), **overrides)
        directory = save_model(model, root / name)
        save_tokenizer(tok, directory)
        out[name] = (directory, model)
    return out


def _stage_logits(directory, tokens, compiled):
    """Logits at every position, the rows fed one token a step through a whole-model DecodeStage."""
    from hpcpipe.config import from_dict
    from hpcpipe.nn.core.decode import DecodeStage, Segment
    from hpcpipe.nn.registry import model_def
    from hpcpipe.state.sources import resolve_weights

    source = resolve_weights(directory).forward_only("float32")
    model = model_def(from_dict({"model": source.model, "parallel": {"pp": 1}}))
    stage = DecodeStage(model, range(model.n_layers), source.read(list(range(model.n_layers))), np, "float32",
                        len(tokens), compiled=compiled)
    first = stage.forward(tokens[:, :5].reshape(-1), [Segment(r, 0, 5) for r in range(len(tokens))],
                          rows=[r * 5 + t for r in range(len(tokens)) for t in range(5)])
    out = [first.reshape(len(tokens), 5, -1)]
    for t in range(5, tokens.shape[1]):
        out.append(stage.forward(tokens[:, t], [Segment(r, t, 1) for r in range(len(tokens))])[:, None])
    return np.concatenate(out, axis=1), source.model


@pytest.mark.parametrize("name", sorted(CASES))
def test_windowed_logits_equal_transformers(models, name):
    directory, model = models[name]
    tokens = np.random.default_rng(5).integers(0, model.config.vocab_size, (2, 60))
    with torch.no_grad():
        want = model(torch.tensor(tokens)).logits.numpy()
    for compiled in ([False, True] if cpu.library() is not None else [False]):
        got, keys = _stage_logits(directory, tokens, compiled)
        assert keys["sliding_window"] in (8, 16)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), (name, compiled)
    # the window matters: the same model attending to everything gives other logits late in the sequence
    full = transformers.AutoModelForCausalLM.from_config(
        model.config.__class__(**{**model.config.to_dict(), "sliding_window": None, "use_sliding_window": False,
                                  "layer_types": None})).eval()
    full.load_state_dict(model.state_dict())
    with torch.no_grad():
        other = full(torch.tensor(tokens)).logits.numpy()
    assert np.abs(other[:, -1] - want[:, -1]).max() > 1e-3 * np.abs(want).max()


@pytest.mark.slow
@pytest.mark.parametrize("pp", [1, 2])
def test_a_mistral_window_generates_transformers_text(models, pp):
    directory, model = models["mistral-window16"]
    fast = transformers.AutoTokenizer.from_pretrained(str(directory))
    ids = [int(i) for i in np.random.default_rng(2).integers(5, 250, 30)]      # 30 + 20 tokens: past the window
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, pad_token_id=0)
    want = fast.decode(out[0][len(ids):], skip_special_tokens=True)
    with Server(pp, directory, "--set", f"parallel.pp={pp}") as server:
        got = server.client().completions.create(model=directory.name, prompt=ids, max_tokens=20, temperature=0)
        assert got.choices[0].text == want
