"""Generation and serving with tensor parallelism (parallel.tp): greedy tokens at tp = 2 and 4 equal tp = 1 (the
no-cache reference) for a GPT, tied and untied, alone and combined with pp and dp up to dp x pp x tp = 2 x 2 x 2 on
8 ranks; a Hugging Face llama (GQA, kv heads split, and kv heads held by two ranks at tp = 4) through the openai
client equals transformers' greedy text; a tp that does not divide the heads is one line, exit 2."""

from __future__ import annotations

import pytest
from support.hf import bytelevel_tokenizer, save_model, save_tokenizer, tiny_model
from support.launch import one_error
from support.serve import Server, encode, generate, make_weights

from hpcpipe.serve.reference import reference_generate
from hpcpipe.serve.sampling import SamplingParams

PROMPT = "hello world"


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp-gen")
    tied, untied = tmp / "tied.h5", tmp / "untied.h5"
    return {"tied": (tied, make_weights(tied, n_heads=4)),
            "untied": (untied, make_weights(untied, tied=False, seed=5, n_heads=4))}


# (ranks, dp, pp, tp)
LAYOUTS = [(2, 1, 1, 2), (4, 1, 1, 4), (4, 1, 2, 2), (8, 2, 2, 2)]


@pytest.mark.parametrize("n,dp,pp,tp", LAYOUTS)
def test_greedy_generation_at_tp_equals_tp_1(weights, tmp_path, n, dp, pp, tp):
    for kind in ("tied", "untied") if n < 8 else ("untied",):
        path, model = weights[kind]
        proc, out = generate(tmp_path, n, path, PROMPT, "--max-new-tokens", "14", "--temperature", "0",
                             "--set", f"parallel.pp={pp}", "--set", f"parallel.dp={dp}", "--set", f"parallel.tp={tp}",
                             timeout=240)
        assert proc.returncode == 0, proc.stderr
        expected = reference_generate(model, encode(PROMPT), 14, SamplingParams(temperature=0.0))
        assert out["tokens"] == expected, (kind, n, dp, pp, tp)


def test_seeded_sampling_at_tp_2_equals_tp_1(weights, tmp_path):
    path, model = weights["tied"]
    proc, out = generate(tmp_path, 2, path, PROMPT, "--max-new-tokens", "12", "--temperature", "0.9",
                         "--top-k", "8", "--seed", "11", "--set", "parallel.tp=2", "--set", "parallel.pp=1")
    assert proc.returncode == 0, proc.stderr
    assert out["tokens"] == reference_generate(model, encode(PROMPT), 12,
                                               SamplingParams(temperature=0.9, top_k=8, seed=11))


def test_tp_that_does_not_divide_the_heads_is_one_line(weights, tmp_path):
    path, _ = weights["tied"]
    proc, _ = generate(tmp_path, 3, path, PROMPT, "--max-new-tokens", "2", "--set", "parallel.tp=3",
                       "--set", "parallel.pp=1")
    one_error(proc, "parallel.tp = 3", "n_heads")


@pytest.mark.slow
@pytest.mark.parametrize("n,tp,pp", [(2, 2, 1), (4, 4, 1), (4, 2, 2)])
def test_hf_llama_served_at_tp_equals_transformers(tmp_path_factory, n, tp, pp):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    directory = tmp_path_factory.mktemp("tp-llama") / "llama"
    tok = bytelevel_tokenizer(["<|endoftext|>"], vocab_size=300)
    model = tiny_model("llama", vocab_size=tok.get_vocab_size(), eos_token_id=10**6, bos_token_id=0,
                       attention_bias=True, tie_word_embeddings=False)    # 4 heads, 2 kv heads
    save_model(model, directory)
    save_tokenizer(tok, directory)
    fast = transformers.AutoTokenizer.from_pretrained(str(directory))
    prompt = "The quick brown fox"
    ids = fast(prompt)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, pad_token_id=0)
    want = fast.decode(out[0][len(ids):], skip_special_tokens=True)
    with Server(n, directory, "--set", f"parallel.tp={tp}", "--set", f"parallel.pp={pp}") as server:
        got = server.client().completions.create(model="llama", prompt=prompt, max_tokens=10, temperature=0)
        assert got.choices[0].text == want
