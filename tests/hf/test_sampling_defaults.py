"""A model's sampling defaults (generation_config.json's temperature, top_p, top_k) through the real serve and
generate commands: a request or a generate run that leaves them out samples with them (vLLM's and transformers'
behaviour); given ones win; serve.generation_config = "none" serves OpenAI's defaults; the serving line names
them; a value no request could carry is one line, exit 2."""

from __future__ import annotations

import json
import shutil

import pytest
from support.hf import bytelevel_tokenizer, save_model, save_tokenizer, tiny_model
from support.launch import one_error
from support.serve import Server, generate

from hpcpipe.errors import ConfigError
from hpcpipe.hf.sampling_defaults import describe, sampling_defaults
from hpcpipe.serve.openai_schema import parse_sampling

pytest.importorskip("torch")
pytest.importorskip("transformers")

CHAT = ("{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")
# top_k 1 is greedy whatever the temperature: a request that takes the model's defaults gives the greedy text
MODEL_DEFAULTS = {"temperature": 0.7, "top_p": 0.9, "top_k": 1}
PROMPT, NEW = "The quick brown fox", 8


def _with_defaults(directory, values):
    path = directory / "generation_config.json"
    gen = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**gen, **values}))
    return directory


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    tok = bytelevel_tokenizer(["<|endoftext|>", "<|start|>", "<|end|>"], vocab_size=300)
    model = tiny_model("llama", vocab_size=tok.get_vocab_size(), bos_token_id=tok.token_to_id("<|start|>"),
                       eos_token_id=tok.token_to_id("<|end|>"), tie_word_embeddings=False)
    directory = save_model(model, tmp_path_factory.mktemp("sampling") / "llama")
    save_tokenizer(tok, directory, {"chat_template": CHAT}, bos_token="<|start|>", eos_token="<|end|>")
    return _with_defaults(directory, MODEL_DEFAULTS)


def test_the_keys_the_file_sets_are_taken_and_checked():
    assert sampling_defaults({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True}, "g", 300) == \
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert sampling_defaults({"eos_token_id": 2}, "g", 300) == {} and sampling_defaults([1], "g", 300) == {}
    assert describe({"top_k": 20, "temperature": 0.6}) == "temperature 0.6, top_k 20" and describe({}) == ""
    for key, value in (("temperature", 2.5), ("temperature", "hot"), ("top_p", 0), ("top_k", 301), ("top_k", 2.0),
                       ("top_k", True)):
        with pytest.raises(ConfigError, match=rf"^g: {key} = .* is not .*serve.generation_config = \"none\""):
            sampling_defaults({key: value}, "g", 300)


def test_a_request_takes_what_it_leaves_out_from_the_model():
    class Vocab:
        vocab_size = 300
    model = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    taken = parse_sampling({"seed": 1}, Vocab(), model)
    assert (taken.temperature, taken.top_p, taken.top_k) == (0.6, 0.95, 20)
    given = parse_sampling({"temperature": 0, "top_p": 1, "top_k": 0, "top_p_": None, "seed": 1}, Vocab(), model)
    assert (given.temperature, given.top_p, given.top_k) == (0.0, 1.0, 0)
    null = parse_sampling({"temperature": None, "seed": 1}, Vocab(), model)     # the openai client's "not given"
    assert null.temperature == 0.6
    wider = parse_sampling({"seed": 1}, Vocab(), {"top_k": 301})     # the model's vocabulary passes the tokenizer's
    assert wider.top_k == 0
    openai = parse_sampling({"seed": 1}, Vocab())
    assert (openai.temperature, openai.top_p, openai.top_k) == (1.0, 1.0, 0)


def test_serve_samples_with_the_models_defaults_unless_a_request_says_otherwise(llama):
    with Server(1, llama) as server:
        client = server.client()
        greedy = client.completions.create(model="llama", prompt=PROMPT, max_tokens=NEW, temperature=0).choices[0].text
        taken = {client.completions.create(model="llama", prompt=PROMPT, max_tokens=NEW, seed=s).choices[0].text
                 for s in range(3)}
        assert taken == {greedy}
        sampled = {client.completions.create(model="llama", prompt=PROMPT, max_tokens=NEW, seed=s,
                                             extra_body={"top_k": 0}).choices[0].text for s in range(4)}
        assert sampled != {greedy}
        messages = [{"role": "user", "content": "hi"}]
        chat_greedy = client.chat.completions.create(model="llama", messages=messages, max_tokens=NEW, temperature=0)
        chat = client.chat.completions.create(model="llama", messages=messages, max_tokens=NEW, seed=5)
        assert chat.choices[0].message.content == chat_greedy.choices[0].message.content
        assert "sampling defaults temperature 0.7, top_p 0.9, top_k 1 (generation_config.json)" in server.output()


def test_generate_takes_the_models_defaults_and_none_turns_them_off(llama, tmp_path):
    _, greedy = generate(tmp_path, 1, llama, PROMPT, "--temperature", "0", "--max-new-tokens", str(NEW))
    for seed in ("1", "2"):
        proc, taken = generate(tmp_path, 1, llama, PROMPT, "--seed", seed, "--max-new-tokens", str(NEW))
        assert proc.returncode == 0, proc.stderr
        assert taken["completion"] == greedy["completion"]
    off = [generate(tmp_path, 1, llama, PROMPT, "--seed", str(s), "--max-new-tokens", str(NEW), "--set",
                    'serve.generation_config="none"')[1]["completion"] for s in range(4)]
    assert set(off) != {greedy["completion"]}


def test_a_value_no_request_could_carry_is_one_line_unless_turned_off(llama, tmp_path):
    bad = _with_defaults(shutil.copytree(llama, tmp_path / "bad"), {"top_p": 1.5})
    proc, _ = generate(tmp_path, 1, bad, PROMPT, "--max-new-tokens", "2")
    one_error(proc, "generation_config.json: top_p = 1.5 is not a number in (0, 1]", "serve.generation_config")
    proc, out = generate(tmp_path, 1, bad, PROMPT, "--max-new-tokens", "2", "--set", 'serve.generation_config="none"')
    assert proc.returncode == 0 and out is not None, proc.stderr


def test_a_checkpoint_trained_from_the_model_keeps_its_defaults(llama, tmp_path):
    """generation_config.json travels with the tokenizer's files into the run's checkpoints."""
    from support.launch import run_command
    ck = tmp_path / "ck"
    proc = run_command(1, "hpcpipe.train", ["--set", f"model.init={json.dumps(str(llama))}", "--set",
                                            "model.seq_len=16", "--set", "train.steps=1", "--set", "parallel.pp=1",
                                            "--set", f"checkpoint.dir={json.dumps(str(ck))}", "--set",
                                            "log.progress=false"], timeout=180)
    assert proc.returncode == 0, proc.stderr
    _, greedy = generate(tmp_path, 1, ck, PROMPT, "--temperature", "0", "--max-new-tokens", str(NEW))
    proc, taken = generate(tmp_path, 1, ck, PROMPT, "--seed", "3", "--max-new-tokens", str(NEW))
    assert proc.returncode == 0, proc.stderr
    assert taken["completion"] == greedy["completion"]
