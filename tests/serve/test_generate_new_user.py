"""What a new user of generate and serve got wrong or was told wrong: weights paths (each message names the
setting the path came from and the fix) and the --help text."""

from __future__ import annotations

import json

import pytest
from support.launch import one_error, run_module
from support.serve import make_weights

from hpcpipe.errors import ConfigError
from hpcpipe.serve.setup import prepare


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("paths") / "model.h5"
    make_weights(path, dtype="float32")
    return path


def _draft(model, draft):
    return prepare(model, 1, None, ['serve.speculate="draft"', f'serve.draft="{draft}"'])


def test_a_draft_path_is_named_as_serve_draft_not_as_weights(model, tmp_path):
    with pytest.raises(ConfigError, match=r"^serve\.draft '[^']*nope' does not exist") as e:   # was: --weights 'nope'
        _draft(model, tmp_path / "nope")
    assert "--weights" not in str(e.value)
    text = tmp_path / "notes.txt"
    text.write_text("not weights")
    with pytest.raises(ConfigError, match=r"^serve\.draft '[^']*notes\.txt' is not an HDF5 weights file$"):
        _draft(model, text)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"^serve\.draft '[^']*empty' is neither a checkpoint directory"):
        _draft(model, tmp_path / "empty")
    assert _draft(model, model).draft is not None                        # a good draft path still serves


def test_a_file_of_a_hugging_face_directory_names_the_directory(tmp_path):
    hf = tmp_path / "tiny-llama"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama"}')
    (hf / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    for name in ("config.json", "model.safetensors"):      # was: "weights file '...' is not an HDF5 file" alone
        proc = run_module("hpcpipe.generate", "--weights", hf / name, "--prompt", "hi")
        line = one_error(proc, f"--weights '{hf / name}' is not an HDF5 weights file",
                         f"it is a file of the Hugging Face model directory '{hf}': give the directory itself")
        assert "Traceback" not in line


def test_generate_help_lists_every_key_of_its_json(model, tmp_path):
    out = tmp_path / "out.json"
    proc = run_module("hpcpipe.generate", "--weights", model, "--prompt", "ab", "--max-new-tokens", "2",
                      "--json", out)
    assert proc.returncode == 0, proc.stderr
    helped = " ".join(run_module("hpcpipe.generate", "--help").stdout.split())
    listed = helped.split("--json FILE also writes {")[1].split("}")[0]
    assert listed == ", ".join(f'"{k}"' for k in json.loads(out.read_text()))   # was: without "writer"


def test_one_new_token_is_one_token(model, tmp_path):
    proc = run_module("hpcpipe.generate", "--weights", model, "--prompt", "ab", "--max-new-tokens", "1")
    assert proc.returncode == 0 and "hpcpipe: generated 1 token in " in proc.stderr, proc.stderr   # was: 1 tokens
    proc = run_module("hpcpipe.generate", "--weights", model, "--prompt", "a" * 31, "--max-new-tokens", "5")
    assert "generated 1 token in " in proc.stderr
    assert "(the context is full: 31 prompt + 1 new token = model.seq_len 32, short of --max-new-tokens 5)" \
        in proc.stderr, proc.stderr


def test_the_serving_line_of_an_ipv6_host_is_a_url_the_client_takes(model, tmp_path):
    import os
    import re
    import signal
    import socket
    import subprocess
    import sys
    import time

    import openai
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "hpcpipe.serve", "--weights", str(model), "--host", "::1",
                                 "--port", "0"], stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        deadline = time.time() + 60     # start-up takes a few seconds; 60 under load
        while not (found := re.search(r"serving 'model.h5' on (\S+) ", log.read_text())) and time.time() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.1)
        assert found, log.read_text()
        url = found.group(1)
        assert re.fullmatch(r"http://\[::1\]:\d+/v1", url), url          # was: http://::1:PORT/v1, no URL
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=20)
        assert client.models.list().data[0].id == "model.h5"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_ctrl_c_ends_serve_with_130_as_its_help_says(model, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time
    helped = " ".join(run_module("hpcpipe.serve", "--help").stdout.split())
    assert "130 interrupted (SIGINT, Ctrl-C" in helped          # was: not among the exit statuses
    log = tmp_path / "serve.log"
    with open(log, "w") as out:      # SIGINT as a terminal delivers it (a background job would ignore it)
        proc = subprocess.Popen([sys.executable, "-m", "hpcpipe.serve", "--weights", str(model), "--port", "0"],
                                stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ),
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 60      # start-up takes a few seconds; 60 under load
    while "serving 'model.h5'" not in log.read_text() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 130, log.read_text()
    assert "interrupted (SIGINT); ending the job (exit status 130)" in log.read_text()
