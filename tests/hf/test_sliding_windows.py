"""Sliding-window attention as transformers computes it: a Mistral with a 16-token window over an 80-token context
greedy-generates transformers' text through the openai client and `generate` (pp=1 and pp=2, compiled and NumPy
stages) from a KV pool of one window's blocks (3 of 16 positions: the blocks before the window go back to the
pool), and gives its logits at every position; a Qwen3 whose layer_types mix windowed and full layers too (NumPy
and compiled stages alike)."""

from __future__ import annotations

import json
import time
import urllib.request

import numpy as np
import pytest
from support.hf import bytelevel_tokenizer, save_model, save_tokenizer, tiny_model
from support.serve import Server, generate

from hpcpipe.kernels import cpu

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CASES = {
    "mistral-window16": ("mistral", {"sliding_window": 16, "max_position_embeddings": 128,
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


WINDOW_BLOCKS = 3       # kv_pages.held_pages(128, 16, 16): the window's block, the one before it, a new one


def _windowed_pool_logits(directory, tokens, compiled):
    """Logits at every position of one sequence run through a whole-model DecodeStage whose pool holds
    WINDOW_BLOCKS KV blocks, its table kept by the serving ledger: prompt chunks as large as the room left,
    then one token a step, the blocks before the window given back after each step."""
    from hpcpipe.config import from_dict
    from hpcpipe.nn.core.decode import DecodeStage, Segment
    from hpcpipe.nn.core.kv_pages import sequence_window
    from hpcpipe.nn.registry import model_def
    from hpcpipe.serve.broker import Request
    from hpcpipe.serve.kv_ledger import KVLedger
    from hpcpipe.serve.sampling import SamplingParams
    from hpcpipe.serve.scheduler import Sequence
    from hpcpipe.state.sources import resolve_weights

    source = resolve_weights(directory).forward_only("float32")
    model = model_def(from_dict({"model": source.model, "parallel": {"pp": 1}}))
    window = sequence_window(model)
    stage = DecodeStage(model, range(model.n_layers), source.read(list(range(model.n_layers))), np, "float32", 1,
                        compiled=compiled, kv_block=16, kv_blocks=WINDOW_BLOCKS)
    ledger = KVLedger(WINDOW_BLOCKS, 16, model.shape.seq_len, prefix_cache=False, window=window)
    prompt = 40
    seq = Sequence(Request("w", list(tokens[:prompt]), len(tokens) - prompt, SamplingParams(), 0.0), 0, 0,
                   list(tokens[:prompt]))
    assert ledger.admit(seq)
    out, most = [], 0
    while seq.cached < len(tokens):
        end = min(len(tokens), ledger.room(seq), prompt if seq.cached < prompt else seq.cached + 1)
        for update in (ledger.redirect(seq), ledger.grow(seq, end)):
            if update is not None:
                stage.set_pages(*update)
        most = max(most, ledger.pool.in_use)
        n = end - seq.cached
        out.append(stage.forward(tokens[seq.cached:end], [Segment(0, seq.cached, n)], rows=list(range(n))))
        seq.cached = end
        ledger.trim(seq)
    return np.concatenate(out), stage, most, window


@pytest.mark.parametrize("compiled", [False, True])
def test_a_window_sized_pool_gives_transformers_logits_past_the_window(models, compiled):
    if compiled and cpu.library() is None:
        pytest.skip("the compiled kernels are not built")
    directory, model = models["mistral-window16"]
    tokens = np.random.default_rng(7).integers(0, model.config.vocab_size, 100)
    with torch.no_grad():
        want = model(torch.tensor(tokens[None])).logits.numpy()[0]
    got, stage, most, window = _windowed_pool_logits(directory, tokens, compiled)
    assert window == 16 and got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    # 100 positions from a cache of 3 blocks of 16 per layer: never more held at once
    assert most <= WINDOW_BLOCKS and stage.paged.pages == WINDOW_BLOCKS
    layers, kv, dh = model.config.num_hidden_layers, model.config.num_key_value_heads, model.config.head_dim
    assert stage.cache_bytes == layers * 2 * kv * WINDOW_BLOCKS * 16 * dh * 4


def _metrics(url):
    out = {}
    for line in urllib.request.urlopen(url + "/metrics", timeout=10).read().decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _pool_blocks(url):
    """The hpcpipe_kv_blocks gauge once the replicas have reported it (they report with their stats, which a
    busy machine may delay past the request's last event)."""
    return _reported(url, "hpcpipe_kv_blocks", 1)


def _reported(url, name, at_least):
    """The metric ``name`` once it reaches ``at_least`` (or, after 120 s, whatever it is then)."""
    deadline = time.monotonic() + 120
    while (value := _metrics(url)[name]) < at_least and time.monotonic() < deadline:
        time.sleep(0.2)
    return value


@pytest.mark.slow
@pytest.mark.parametrize("pp,kernels", [(1, "compiled"), (1, "numpy"), (2, "compiled"), (2, "numpy")])
def test_a_mistral_window_generates_transformers_text(models, pp, kernels):
    directory, model = models["mistral-window16"]
    fast = transformers.AutoTokenizer.from_pretrained(str(directory))
    ids = [int(i) for i in np.random.default_rng(2).integers(5, 250, 40)]      # 40 + 40 tokens: 5 windows
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, pad_token_id=0)
    want = fast.decode(out[0][len(ids):], skip_special_tokens=True)
    env = {"HPCPIPE_KERNELS": kernels}
    pool = ("--set", f"serve.kv_blocks={WINDOW_BLOCKS}")          # one window's blocks: 48 of the 80 positions
    with Server(pp, directory, "--set", f"parallel.pp={pp}", *pool, env=env) as server:
        held, text = [], []
        stream = server.client().completions.create(model=directory.name, prompt=ids, max_tokens=40,
                                                    temperature=0, stream=True)
        for chunk in stream:
            text.extend(c.text for c in chunk.choices)
            held.append(_metrics(server.url)["hpcpipe_kv_blocks_in_use"])
        assert "".join(text) == want
        assert max(held) <= WINDOW_BLOCKS and _pool_blocks(server.url) == WINDOW_BLOCKS
    # the default pool: max_sequences windows, not max_sequences contexts (8 blocks each); with prompt-lookup
    # speculation a window holds the 4 tokens verified past the next one too; a second request reuses the
    # prompt's cached blocks (those before its window are not even held)
    if pp == 2 and kernels == "numpy":
        from hpcpipe.nn.core.kv_pages import held_pages
        with Server(pp, directory, "--set", f"parallel.pp={pp}", "--set", "serve.max_sequences=4",
                    "--set", 'serve.speculate="ngram"', env=env) as server:
            for _ in range(2):
                got = server.client().completions.create(model=directory.name, prompt=ids, max_tokens=40,
                                                         temperature=0)
                assert got.choices[0].text == want
            assert _pool_blocks(server.url) == 4 * held_pages(128, 16, 16, 4) < 4 * 8
            assert _reported(server.url, "hpcpipe_prefix_cache_cached_tokens_total", 32) >= 32


@pytest.mark.slow
def test_generate_runs_a_window_past_its_pool_at_pp2(models, tmp_path):
    directory, model = models["mistral-window16"]
    fast = transformers.AutoTokenizer.from_pretrained(str(directory))
    prompt = fast.decode([int(i) for i in np.random.default_rng(4).integers(5, 250, 40)])
    ids = fast(prompt)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, pad_token_id=0)
    proc, result = generate(tmp_path, 2, directory, prompt, "--set", "parallel.pp=2", "--temperature", "0",
                            "--max-new-tokens", "40", "--set", f"serve.kv_blocks={WINDOW_BLOCKS}")
    assert proc.returncode == 0, proc.stderr
    assert result["completion"] == fast.decode(out[0][len(ids):], skip_special_tokens=True), json.dumps(result)
