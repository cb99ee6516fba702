"""logprobs, echo, token-id prompts and n > 1 of a tiny Hugging Face llama served at pp = 2 and at tp = 2, through the
real openai client: every reported log-probability (the prompt's with echo, the generated tokens', the top
alternatives) equals transformers' float32 log_softmax of the same model on the same ids within 1e-5, streamed
as whole; greedy choices of n > 1 are identical, seeded ones differ from each other and repeat run to run."""

from __future__ import annotations

import numpy as np
import pytest
from support.hf import bytelevel_tokenizer, save_model, save_tokenizer, tiny_model
from support.serve import Server

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CHAT = ("{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")
NAME = "llama"
NEW = 6


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    tok = bytelevel_tokenizer(["<|endoftext|>", "<|start|>", "<|end|>"], vocab_size=300)
    model = tiny_model("llama", vocab_size=tok.get_vocab_size(), bos_token_id=tok.token_to_id("<|start|>"),
                       eos_token_id=tok.token_to_id("<|end|>"), tie_word_embeddings=False)
    directory = tmp_path_factory.mktemp("lp") / NAME
    save_model(model, directory)
    save_tokenizer(tok, directory, {"chat_template": CHAT}, bos_token="<|start|>", eos_token="<|end|>")
    return directory, model, transformers.AutoTokenizer.from_pretrained(str(directory))


def _reference(model, fast, prompt: list[int], new: int = NEW) -> tuple[list[int], np.ndarray]:
    """transformers' greedy ids after prompt (prompt included) and float32 log_softmax of its logits over them."""
    with torch.no_grad():
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                             pad_token_id=fast.eos_token_id)[0].tolist()
        lp = torch.log_softmax(model(torch.tensor([ids])).logits.float(), dim=-1)[0].numpy()
    return ids, lp


def _check_rows(values: list, tops: list, ids: list[int], lp: np.ndarray, first: int) -> None:
    """Reported value i and its top alternatives are those of token ids[first + i] (predicted by row first + i - 1)."""
    for i, (value, top) in enumerate(zip(values, tops, strict=True)):
        t = first + i
        assert abs(value - lp[t - 1, ids[t]]) <= 1e-5, (t, value, lp[t - 1, ids[t]])
        want = np.sort(lp[t - 1])[::-1][:len(top)]
        assert np.allclose(np.sort(top)[::-1], want, rtol=0, atol=1e-5), (t, top, want)


def _completions(client, fast, model):
    prompts = [fast("The quick brown fox jumps")["input_ids"], fast("pipeline stage rank")["input_ids"]]
    # lm-eval's shape: token-id prompts in a batch, echo, logprobs, greedy
    got = client.completions.create(model=NAME, prompt=prompts, max_tokens=NEW, temperature=0, logprobs=3, echo=True)
    assert [c.index for c in got.choices] == [0, 1]
    for prompt, choice in zip(prompts, got.choices, strict=True):
        ids, lp = _reference(model, fast, prompt)
        p = len(prompt)
        out = choice.logprobs
        assert len(out.tokens) == len(ids) and out.token_logprobs[0] is None and out.top_logprobs[0] is None
        assert choice.text.startswith(fast.decode(prompt))
        # the top dicts hold the 3 most likely and the token itself (up to 4 keys)
        assert all(3 <= len(top) <= 4 and max(top.values()) <= 0 for top in out.top_logprobs[1:])
        _check_rows(out.token_logprobs[1:], [sorted(t.values(), reverse=True)[:3] for t in out.top_logprobs[1:]],
                    ids, lp, 1)
        assert got.usage.completion_tokens >= len(ids) - p
    # streamed: the same rows, chunk by chunk (alone, not batched beside another prompt: equal to rounding)
    whole = got.choices[0].logprobs
    chunks = list(client.completions.create(model=NAME, prompt=prompts[0], max_tokens=NEW, temperature=0, logprobs=3,
                                            echo=True, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    values = [v for s in streamed for v in s.token_logprobs]
    assert values[0] is None and np.allclose(values[1:], whole.token_logprobs[1:], rtol=0, atol=1e-5)
    assert [t for s in streamed for t in s.tokens] == whole.tokens
    assert [o for s in streamed for o in s.text_offset] == whole.text_offset
    assert "".join(c.choices[0].text for c in chunks if c.choices) == got.choices[0].text
    # max_tokens 0 with echo: the prompt alone, with its log-probabilities
    alone = client.completions.create(model=NAME, prompt=prompts[1], max_tokens=0, echo=True, logprobs=0)
    ids, lp = _reference(model, fast, prompts[1], 1)
    assert alone.choices[0].logprobs.token_logprobs[0] is None and alone.usage.completion_tokens == 0
    _check_rows(alone.choices[0].logprobs.token_logprobs[1:], [[]] * (len(prompts[1]) - 1), ids, lp, 1)
    # without echo: the generated tokens' only
    plain = client.completions.create(model=NAME, prompt=prompts[0], max_tokens=NEW, temperature=0, logprobs=2)
    ids, lp = _reference(model, fast, prompts[0])
    assert len(plain.choices[0].logprobs.tokens) == len(ids) - len(prompts[0])
    _check_rows(plain.choices[0].logprobs.token_logprobs, [sorted(t.values(), reverse=True)[:2]
                                                           for t in plain.choices[0].logprobs.top_logprobs],
                ids, lp, len(prompts[0]))


def _chat(client, fast, model):
    messages = [{"role": "user", "content": "the quick brown fox"}]
    chat_ids = fast.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    chat_ids = list(chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids)
    ids, lp = _reference(model, fast, chat_ids)
    got = client.chat.completions.create(model=NAME, messages=messages, max_tokens=NEW, temperature=0, logprobs=True,
                                         top_logprobs=4)
    content = got.choices[0].logprobs.content
    assert len(content) == len(ids) - len(chat_ids)
    _check_rows([c.logprob for c in content], [[t.logprob for t in c.top_logprobs] for c in content], ids, lp,
                len(chat_ids))
    assert all(len(c.top_logprobs) == 4 and bytes(c.bytes).decode("utf-8", "replace") for c in content)
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=NEW, temperature=0,
                                            logprobs=True, stream=True)
    streamed = [e.logprob for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == [c.logprob for c in content]


def _choices(client):
    greedy = client.completions.create(model=NAME, prompt="the quick", max_tokens=8, temperature=0, n=3)
    assert len(greedy.choices) == 3 and len({c.text for c in greedy.choices}) == 1
    sampled = [client.completions.create(model=NAME, prompt=["the quick", "lazy dog"], max_tokens=8, n=3, seed=5,
                                         temperature=1.0) for _ in range(2)]
    texts = [[c.text for c in sorted(r.choices, key=lambda c: c.index)] for r in sampled]
    assert texts[0] == texts[1]                          # reproducible
    assert len(set(texts[0][:3])) == 3 and len(set(texts[0][3:])) == 3, texts[0]     # distinct per choice
    alone = client.completions.create(model=NAME, prompt="the quick", max_tokens=8, seed=5, temperature=1.0)
    assert alone.choices[0].text == texts[0][0]          # choice 0 samples with the request's own seed
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          n=2, seed=3)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content != chat.choices[1].message.content


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pp=2", "tp=2"])
def test_logprobs_equal_transformers_log_softmax(llama, layout):
    directory, model, fast = llama
    sets = ["--set", "parallel.pp=2"] if layout == "pp=2" else ["--set", "parallel.pp=1", "--set", "parallel.tp=2"]
    # small prefill chunks: an echoed prompt's rows come back over several work items
    with Server(2, directory, *sets, "--set", "serve.prefill_tokens=4") as server:
        client = server.client()
        _completions(client, fast, model)
        if layout == "pp=2":
            _chat(client, fast, model)
            _choices(client)
