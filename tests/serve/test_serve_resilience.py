"""`python -m hpcpipe.serve` that cannot be hung or killed from outside (issue 32), end to end under mpiexec.

A stopped rank (SIGSTOP) while a request is in flight: /health turns 503 with the reason, then the
watchdog dumps every thread's stack and ends the job with exit 76; an idle server with a stopped rank
is never aborted. No request ends the job: a temperature of 1e-308 is greedy, a request whose logits are
not finite fails alone (500) while the others go on, and weights that overflow in the forward are refused
at load. A non-loopback bind without an API key is warned about; an empty API key is refused.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from support.launch import command, one_error, run, wait_until_gone
from support.serve import CHARS, Server, encode, make_weights

from hpcpipe import errors
from hpcpipe.nn.core.decoder_model import Decoder
from hpcpipe.runtime.launcher import RANK_VARIABLES, launcher_rank
from hpcpipe.serve.reference import reference_generate
from hpcpipe.serve.sampling import SamplingParams
from hpcpipe.state.weights import write_weights

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("resilience") / "gpt.h5"
    return path, make_weights(path)


def text_of(tokens):
    return "".join(CHARS[t] for t in tokens)


def post(url, body, path="/v1/completions", timeout=30):
    """POST a JSON body; return (status, parsed JSON body)."""
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def health(url):
    """(status, body) of GET /health."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def rank_pids(marker: str, n: int, seconds: float = 30) -> dict[int, int]:
    """{world rank: pid} of the n ranks whose environment holds marker (found through /proc, launcher-neutral)."""
    deadline = time.time() + seconds
    while True:
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                environ = (entry / "environ").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if marker not in environ:
                continue
            env = dict(item.split("=", 1) for item in environ.split("\0") if "=" in item)
            if any(name in env for name in RANK_VARIABLES) and env.get("HPCPIPE_TEST_MARK") == marker:
                found[launcher_rank(env)] = int(entry.name)
        if len(found) >= n or time.time() > deadline:
            return found
        time.sleep(0.1)


def _write(path: Path, model: Decoder, tokenizer: dict) -> None:
    shape = model.shape
    groups = {i: {name: np.array(view) for name, view in model.params[i].items()} for i in range(shape.n_groups)}
    config = {"kind": "gpt", "vocab_size": shape.vocab, "seq_len": shape.seq_len, "d_model": shape.d_model,
              "n_heads": shape.n_heads, "n_blocks": shape.n_blocks, "d_ff": 0, "tie_embeddings": shape.tied,
              "dtype": str(model.flat.dtype)}
    write_weights(path, groups, n_layers=shape.n_groups, model_config=config,
                  attrs={"tokenizer": json.dumps(tokenizer)})


def poisoned(path: Path, rows: list[int] | None, tied: bool = True) -> Decoder:
    """Float32 weights whose embedding rows (all when rows is None) are 3e38: finite, but they overflow."""
    model = make_weights(path, dtype="float32", tied=tied)
    model.params[0]["tok_emb"][slice(None) if rows is None else rows] = 3e38
    _write(path, model, {"kind": "chars", "chars": CHARS})
    return model


# ---- item 1: the watchdog and /health ---------------------------------------------------------------------

def test_a_stopped_rank_turns_health_503_then_the_watchdog_ends_the_job_with_76(model, tmp_path):
    timeout = 4.0
    marker = str(tmp_path)
    with Server(2, model[0], "--set", "parallel.pp=2", "--set", f"run.stall_timeout={timeout}",
                env={"HPCPIPE_TEST_MARK": marker, "HPCPIPE_STEP_SLEEP": "0.05"}) as s:
        pids = rank_pids(marker, 2)
        assert sorted(pids) == [0, 1], pids
        stream = iter(s.client(timeout=60).completions.create(model="gpt.h5", prompt="abc", max_tokens=25,
                                                               temperature=0, stream=True))
        next(stream)
        assert health(s.url) == (200, {"status": "ok"})          # a request in flight, tokens coming
        os.kill(pids[1], signal.SIGSTOP)                          # the last stage stops mid-request
        t0 = time.time()
        try:
            status, body = health(s.url)
            while status == 200 and time.time() - t0 < timeout:
                time.sleep(0.05)
                status, body = health(s.url)
            seen = time.time() - t0
            assert status == 503 and body["status"] == "stalled", (status, body)    # was: 200 for ever
            assert seen < timeout, seen
            assert "pending" in body["reason"] and f"run.stall_timeout = {timeout:g} s" in body["reason"], body
            with pytest.raises(Exception) as caught:            # the connection closes: never a hang
                for _ in stream:
                    pass
            assert not isinstance(caught.value, StopIteration)
            assert s.wait(timeout + 30) == errors.EXIT_STALLED, s.output()
            assert time.time() - t0 < timeout + 20
        finally:
            try:
                os.kill(pids[1], signal.SIGCONT)
            except ProcessLookupError:
                pass
        out = s.output()
        assert "[dp00-pp00] watchdog: no progress for" in out, out
        assert "run.stall_timeout = 4 s" in out and "exit status 76" in out, out
        assert any(line.startswith("[dp00-pp00] ") and "Thread" in line for line in out.splitlines()), out
    assert wait_until_gone(marker, 10) == []


def test_an_idle_server_with_a_stopped_rank_is_never_aborted(model, tmp_path):
    marker = str(tmp_path)
    with Server(2, model[0], "--set", "parallel.pp=2", "--set", "run.stall_timeout=1",
                env={"HPCPIPE_TEST_MARK": marker}) as s:
        pids = rank_pids(marker, 2)
        done = s.client().completions.create(model="gpt.h5", prompt="abc", max_tokens=3, temperature=0)
        assert done.choices[0].finish_reason == "length"
        os.kill(pids[1], signal.SIGSTOP)
        try:
            time.sleep(3)                                      # three stall timeouts with nothing pending
            assert health(s.url) == (200, {"status": "ok"})
            assert s.proc.poll() is None
        finally:
            os.kill(pids[1], signal.SIGCONT)
        time.sleep(2)                                          # both watchdog threads run again: still idle
        done = s.client().completions.create(model="gpt.h5", prompt="abc", max_tokens=4, temperature=0)
        assert done.choices[0].text == text_of(reference_generate(model[1], encode("abc"), 4, GREEDY))
        s.signal()
        assert s.stopped_cleanly(), s.output()


def test_a_stopped_rank_ends_generate_with_76(model, tmp_path):
    import subprocess

    from support import ROOT
    marker = str(tmp_path)
    argv = command(2, "hpcpipe.generate", ["--weights", str(model[0]), "--prompt", "ab", "--max-new-tokens", "29",
                                           "--set", "parallel.pp=2", "--set", "run.stall_timeout=3"])
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=dict(os.environ, HPCPIPE_TEST_MARK=marker, HPCPIPE_STEP_SLEEP="0.3"))
    pids = rank_pids(marker, 2)
    try:
        assert proc.stdout.read(1), proc.stderr.read()          # the first token: generating
        os.kill(pids[1], signal.SIGSTOP)
        _, err = proc.communicate(timeout=40)          # was: never ends
        assert proc.returncode == errors.EXIT_STALLED, err
        assert "watchdog: no progress for" in err, err
    finally:
        try:
            os.kill(pids[1], signal.SIGCONT)
        except ProcessLookupError:
            pass
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert wait_until_gone(marker, 10) == []


# ---- item 2: no request ends the job ----------------------------------------------------------------------

def test_a_temperature_of_1e_308_is_greedy_and_the_server_carries_on(model):
    with Server(2, model[0], "--set", "parallel.pp=2") as s:
        status, body = post(s.url, {"prompt": "x", "max_tokens": 1, "temperature": 1e-308})   # was: exit 1
        assert status == 200, body
        assert body["choices"][0]["text"] == text_of(reference_generate(model[1], encode("x"), 1, GREEDY))
        status, body = post(s.url, {"prompt": "abc", "max_tokens": 4, "temperature": 1e-5, "seed": 1})
        assert status == 200 and body["choices"][0]["text"] == text_of(
            reference_generate(model[1], encode("abc"), 4, GREEDY))
        s.signal()
        assert s.stopped_cleanly(), s.output()


@pytest.mark.parametrize("tp", [1, 2])
def test_a_request_whose_logits_are_not_finite_fails_alone(tmp_path, tp):
    from hpcpipe.serve.probe import probe_ids

    good = {"the cat": 12, "ab": 6, "the cat sat on": 6}
    clean = make_weights(tmp_path / "clean.h5", dtype="float32", tied=False)
    used = set(probe_ids(len(CHARS), 32))             # the load probe reads these rows: they must stay sound
    for prompt, n in good.items():                   # and so must every row the good requests read
        used |= set(encode(prompt)) | set(reference_generate(clean, encode(prompt), n, GREEDY))
    bad = min(set(range(len(CHARS))) - used)
    path = tmp_path / "gpt.h5"
    model = poisoned(path, [bad], tied=False)
    with Server(2 * tp, path, "--set", "parallel.pp=2", "--set", f"parallel.tp={tp}",
                env={"HPCPIPE_STEP_SLEEP": "0.02"}) as s:      # tp: the slot is cleared on every tp rank
        answers = {}

        def ask():
            answers["good"] = post(s.url, {"prompt": "the cat", "max_tokens": 12, "temperature": 0})
        t = threading.Thread(target=ask)
        t.start()
        status, body = post(s.url, {"prompt": "the " + CHARS[bad], "max_tokens": 5, "temperature": 0})
        assert status == 500 and body["error"]["type"] == "server_error", body        # was: exit 1
        t.join(60)
        status, body = answers["good"]
        assert status == 200 and body["choices"][0]["text"] == text_of(
            reference_generate(model, encode("the cat"), 12, GREEDY)), body
        for prompt in ("ab", "the cat sat on"):                # the failed request's slot serves again
            status, body = post(s.url, {"prompt": prompt, "max_tokens": 6, "temperature": 0})
            assert status == 200 and body["choices"][0]["text"] == text_of(
                reference_generate(model, encode(prompt), 6, GREEDY)), (prompt, body)
        assert s.proc.poll() is None
        s.signal()
        assert s.stopped_cleanly(), s.output()


@pytest.mark.parametrize("module", ["hpcpipe.generate", "hpcpipe.serve"])
def test_weights_that_overflow_in_the_forward_are_refused_at_load(tmp_path, module):
    path = tmp_path / "huge.h5"
    poisoned(path, None)
    args = ["--weights", str(path), "--set", "parallel.pp=2"]
    args += ["--prompt", "abc", "--max-new-tokens", "2"] if module == "hpcpipe.generate" else ["--port", "0"]
    proc = run(command(2, module, args), timeout=60)     # serve: was serving, then exit 1 on the first request
    line = one_error(proc, "not finite", str(path))
    assert "hpcpipe: serving" not in proc.stdout, line


@pytest.mark.parametrize("ranks,pp", [(2, 1), (4, 2)])
def test_weights_that_overflow_are_refused_at_load_under_tensor_parallelism(tmp_path, ranks, pp):
    """Issue 40: at parallel.tp > 1 the probe was skipped and generate exited 0 with finish_reason error."""
    path = tmp_path / "huge.h5"
    poisoned(path, None)
    args = ["--weights", str(path), "--prompt", "abc", "--max-new-tokens", "2", "--set", f"parallel.pp={pp}",
            "--set", "parallel.tp=2"]
    proc = run(command(ranks, "hpcpipe.generate", args), timeout=120)
    one_error(proc, "not finite", str(path), "stage 0")
    assert "finish_reason" not in proc.stderr


# ---- item 5: who may reach the server -----------------------------------------------------------------------

def test_a_non_loopback_bind_without_an_api_key_is_warned_about(model):
    with Server(1, model[0], "--set", "parallel.pp=1", "--host", "0.0.0.0") as s:
        deadline = time.time() + 10
        while "hpcpipe: warning:" not in s.output() and time.time() < deadline:
            time.sleep(0.05)
        warnings = [line for line in s.output().splitlines() if line.startswith("hpcpipe: warning:")]
        assert len(warnings) == 1, s.output()                     # was: silent
        assert "0.0.0.0" in warnings[0] and "HPCPIPE_API_KEY" in warnings[0]
    with Server(1, model[0], "--set", "parallel.pp=1", "--host", "0.0.0.0", env={"HPCPIPE_API_KEY": "k-1"}) as s:
        assert "hpcpipe: warning:" not in s.output()
    with Server(1, model[0], "--set", "parallel.pp=1") as s:
        assert "hpcpipe: warning:" not in s.output()


def test_an_empty_api_key_is_refused(model):
    proc = run(command(2, "hpcpipe.serve", ["--weights", str(model[0]), "--port", "0", "--set", "parallel.pp=2"]),
               timeout=60, env={"HPCPIPE_API_KEY": ""})         # was: served with no key checked
    one_error(proc, "HPCPIPE_API_KEY is set but empty")
