"""Chat templates and prompts from hostile authors and users, end to end (issue 40): `serve` refuses at start a
template that cannot serve, /health says ok only once the server serves, and `generate` (with and without
--chat) answers every bad prompt with one line and exit 2 under the server's budgets."""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from support.hf import bytelevel_tokenizer, save_model, save_tokenizer, tiny_model
from support.launch import command, one_error, run_command

from hpcpipe.serve.prompt_pool import PROBE

pytest.importorskip("torch")
pytest.importorskip("transformers")

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "<|im_start|>assistant\n")
HOSTILE = ("{% set c = messages[-1].content %}"
           "{% if c == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
           "{% elif c == 'big' %}{{ 'x' * 10**9 }}"
           "{% elif c == 'nothing' %}"
           "{% else %}" + CHATML + "{% endif %}")


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """One tiny llama directory whose tokenizer has the HOSTILE chat template."""
    tok = bytelevel_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], vocab_size=300)
    model = tiny_model("llama", vocab_size=tok.get_vocab_size(), eos_token_id=0, bos_token_id=0)
    directory = save_model(model, tmp_path_factory.mktemp("hf") / "llama")
    save_tokenizer(tok, directory, {"chat_template": HOSTILE}, eos_token="<|endoftext|>")
    return directory


@pytest.fixture
def hf(made, tmp_path) -> Path:
    """A fresh copy of the tiny llama directory, to change."""
    return Path(shutil.copytree(made, tmp_path / "llama"))


def _template(directory: Path, template) -> None:
    path = directory / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "chat_template": template}))


def _generate(hf: Path, prompt: str, *args: str):
    return run_command(1, "hpcpipe.generate", ["--weights", str(hf), "--prompt", prompt, "--max-new-tokens", "2",
                                               *args], timeout=180)


@pytest.mark.parametrize("template, words", [
    ("{% for m in messages %}", ["the model's chat template is invalid", "line 1"]),
    ([{"name": ["default"], "template": CHATML}], ["chat_template[0] must be an object with a string name"]),
    ("{% for m in messages %}{% endfor %}", ["cannot serve the conversation", repr(PROBE),
                                             "no tokens in the messages rendered"]),
])
def test_serve_refuses_at_start_a_template_that_cannot_serve(hf, template, words):
    """A syntax error was a 400 blamed on every client; a name that is no string a 500 on every chat request."""
    _template(hf, template)
    proc = run_command(1, "hpcpipe.serve", ["--weights", str(hf), "--port", "0"], timeout=180)
    assert "serving" not in proc.stdout
    one_error(proc, *words)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_health_says_ok_only_once_the_serving_line_is_printed(hf, tmp_path):
    """/health answered ok while the ranks were still loading their stages, before the "serving" line."""
    port, log = _free_port(), tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(command(1, "hpcpipe.serve", ["--weights", str(hf), "--port", str(port)]),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    seen, deadline = [], time.monotonic() + 180
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                resp = conn.getresponse()
                status, body = resp.status, json.loads(resp.read())
                conn.close()
            except OSError:
                time.sleep(0.01)
                continue
            if status == 200:
                assert "hpcpipe: serving" in log.read_text(), (seen, log.read_text())
                break
            seen.append(body["status"])
            time.sleep(0.01)
        else:
            raise AssertionError(f"no ok from /health: {seen}\n{log.read_text()}")
        assert set(seen) <= {"starting"}, seen
    finally:
        proc.terminate()
        proc.wait(60)


def test_generate_refuses_a_prompt_that_is_not_utf8_in_one_line(hf):
    """The terminal's bytes that are not UTF-8 reached the tokenizer: a TypeError traceback."""
    one_error(_generate(hf, "a\udcffb"), "--prompt is not valid UTF-8 text: byte 0xFF at position 1")


def test_generate_refuses_a_prompt_its_tokenizer_fails_on_in_one_line(hf):
    """A pre-tokenizer regex that backtracks catastrophically made tokenizers panic: a Rust backtrace."""
    path = hf / "tokenizer.json"
    doc = json.loads(path.read_text())
    doc["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "(a|aa)+b"}, "behavior": "Isolated", "invert": False},
        doc["pre_tokenizer"]]}
    path.write_text(json.dumps(doc))
    proc = _generate(hf, "a" * 40 + "c")
    one_error(proc, "--prompt cannot be encoded: the tokenizer failed on it", "retry-limit-in-match")
    assert "panicked" not in proc.stderr


@pytest.mark.parametrize("content, words", [
    ("nothing", ["--chat: no tokens in the messages rendered with the model's chat template"]),
    ("big", ["--chat: the model's chat template renders more than 4194304 characters", "1000000000 items"]),
    ("loop", ["--chat: rendering the messages with the model's chat template and tokenizing them took longer "
              "than 10 s", "prompt_seconds"]),
])
def test_generate_chat_is_held_to_the_server_s_budgets(hf, content, words):
    """--chat hung on an endless template, took gigabytes on a huge one and started a prompt of no tokens."""
    start = time.monotonic()
    one_error(_generate(hf, content, "--chat"), *words)
    assert time.monotonic() - start < 120


@pytest.mark.parametrize("template, words", [
    (None, ["--chat: this model has no chat template (no chat_template in tokenizer_config.json"]),
    ([{"name": "tool_use", "template": CHATML}], ["--chat: the model has chat templates ['tool_use'] but none "
                                                  "named 'default'"]),
])
def test_generate_chat_without_a_template_says_to_leave_out_chat(hf, template, words):
    """A Hugging Face model without a (default) chat template: --chat gave the server's advice (use the
    completions endpoint) where the command's way is to leave out --chat."""
    _template(hf, template)
    message = one_error(_generate(hf, "hello", "--chat"), *words, "leave out --chat to continue --prompt as plain")
    assert "completions endpoint" not in message
