"""Serving at parallel.ep = 2: the two data-parallel replicas hold half of every block's experts each and step
together (a replica with no request joins its peer's all-to-alls with zero rows). Greedy text through the official
openai client (completions, several at once, and chat) equals transformers' greedy generate for tiny Qwen3-MoE
and Mixtral models at ep=2 (dp=2) and pp=2 x ep=2."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from support.hf import bytelevel_tokenizer, save_model, save_tokenizer, tiny_model
from support.serve import Server, generate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CHAT = ("{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|start|>", "<|end|>"]
MODELS = {"mixtral": ("mixtral", {"tie_word_embeddings": False}),
          "qwen3-moe": ("qwen3_moe", {"tie_word_embeddings": True})}
PROMPTS = ["The quick brown fox", "pipeline stage", "tensor shard", "the lazy dog"]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-models")
    out = {}
    for name, (arch, overrides) in MODELS.items():
        tok = bytelevel_tokenizer(SPECIALS, vocab_size=300)
        model = tiny_model(arch, vocab_size=tok.get_vocab_size(), bos_token_id=tok.token_to_id("<|start|>"),
                           eos_token_id=tok.token_to_id("<|end|>"), **overrides)
        save_model(model, root / name)
        save_tokenizer(tok, root / name, {"chat_template": CHAT}, bos_token="<|start|>", eos_token="<|end|>")
        out[name] = (root / name, model, transformers.AutoTokenizer.from_pretrained(str(root / name)))
    return out


def _greedy(model, fast, ids: list[int]) -> str:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=fast.eos_token_id)
    return fast.decode(out[0][len(ids):], skip_special_tokens=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("n,pp", [(2, 1), (4, 2)])
def test_expert_parallel_greedy_text_equals_transformers(models, name, n, pp):
    directory, model, fast = models[name]
    with Server(n, directory, "--set", f"parallel.pp={pp}", "--set", "parallel.ep=2") as server:
        client = server.client()
        want = {p: _greedy(model, fast, fast(p)["input_ids"]) for p in PROMPTS}
        first = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=NEW_TOKENS, temperature=0)
        assert first.choices[0].text == want[PROMPTS[0]]           # one request: the other replica only joins

        def complete(prompt: str) -> str:
            got = client.completions.create(model=name, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
            return got.choices[0].text
        with ThreadPoolExecutor(len(PROMPTS)) as pool:             # both replicas busy, rows of both at once
            assert dict(zip(PROMPTS, pool.map(complete, PROMPTS), strict=True)) == want
        messages = [{"role": "user", "content": PROMPTS[0]}]
        ids = fast.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        got = client.chat.completions.create(model=name, messages=messages, max_tokens=NEW_TOKENS, temperature=0)
        assert got.choices[0].message.content == _greedy(model, fast, list(ids))


@pytest.mark.slow
@pytest.mark.parametrize("n,ep", [(1, 1), (2, 2)])
def test_generate_reports_the_all_to_all_seconds(models, tmp_path, n, ep):
    directory, model, fast = models["qwen3-moe"]
    proc, result = generate(tmp_path, n, directory, PROMPTS[1], "--temperature", "0", "--max-new-tokens",
                            str(NEW_TOKENS), "--set", "parallel.pp=1", "--set", f"parallel.ep={ep}")
    assert proc.returncode == 0, proc.stderr
    assert result["completion"] == _greedy(model, fast, fast(PROMPTS[1])["input_ids"])
    # ep = 2: every sparse block's exchanges are timed (a share of the run); ep = 1 has none
    assert (0 < result["ep_comm_s"] < result["seconds"]) if ep > 1 else result["ep_comm_s"] == 0
