"""`python -m hpcpipe.serve` end to end: the official openai client against the real MPI engine."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from support.serve import Server, encode, make_weights

from hpcpipe.serve.reference import reference_generate
from hpcpipe.serve.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve") / "gpt.h5"
    return path, make_weights(path)


@pytest.fixture(scope="module")
def server(model):
    with Server(4, model[0], "--set", "parallel.pp=2") as s:     # dp = 2 x pp = 2
        yield s


def text_of(tokens):
    from support.serve import CHARS
    return "".join(CHARS[t] for t in tokens)


def post(url, body, raw=False):
    """POST body (JSON unless raw bytes); return (status, parsed JSON body)."""
    data = body if raw else json.dumps(body).encode()
    request = urllib.request.Request(url + "/v1/completions", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def metric(url, name):
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics:\n{text}")


def test_openai_client_completes_and_streams_the_reference_text(server, model):
    client = server.client()
    expected = text_of(reference_generate(model[1], encode("hello world"), 12, GREEDY))
    done = client.completions.create(model="gpt.h5", prompt="hello world", max_tokens=12, temperature=0)
    assert done.choices[0].text == expected and done.choices[0].finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (11, 12)
    chunks = list(client.completions.create(model="gpt.h5", prompt="hello world", max_tokens=12, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"
    assert [m.id for m in client.models.list().data] == ["gpt.h5"]


def test_a_list_of_prompts_gives_one_choice_each_in_order(server, model):
    prompts = ["abc", "the cat", "zz"]
    done = server.client().completions.create(model="gpt.h5", prompt=prompts, max_tokens=6, temperature=0)
    got = {c.index: c.text for c in done.choices}
    for i, prompt in enumerate(prompts):
        assert got[i] == text_of(reference_generate(model[1], encode(prompt), 6, GREEDY))


def test_concurrent_clients_get_their_own_seeded_answers(server, model):
    jobs = [(f"the {'abcdefgh'[i % 8]} sat", 9 + i, 0.8 + 0.02 * i) for i in range(12)]
    answers = {}

    def ask(i):
        prompt, seed, temperature = jobs[i]
        done = server.client().completions.create(model="gpt.h5", prompt=prompt, max_tokens=14, seed=seed,
                                                  temperature=temperature, top_p=0.95, stream=i % 2 == 1)
        answers[i] = "".join(c.choices[0].text for c in done) if i % 2 else done.choices[0].text
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, (prompt, seed, temperature) in enumerate(jobs):
        params = SamplingParams(temperature=temperature, top_p=0.95, seed=seed)
        assert answers[i] == text_of(reference_generate(model[1], encode(prompt), 14, params)), i


def test_stop_string_cuts_the_text_and_frees_the_slot(server, model):
    full = text_of(reference_generate(model[1], encode("hello world"), 20, GREEDY))
    stop = full[5:7]
    done = server.client().completions.create(model="gpt.h5", prompt="hello world", max_tokens=20, temperature=0,
                                              stop=[stop])
    assert done.choices[0].finish_reason == "stop"
    assert done.choices[0].text == full[:full.index(stop)]
    deadline = time.time() + 5
    while metric(server.url, "hpcpipe_running_sequences") and time.time() < deadline:
        time.sleep(0.1)
    assert metric(server.url, "hpcpipe_running_sequences") == 0


@pytest.mark.parametrize("body,status,words", [
    (b"{not json", 400, "JSON"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": "HELLO", "max_tokens": 3}, 400, "'H'"),
    ({"prompt": "hello", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hello world", "max_tokens": 30}, 400, "32"),
])
def test_bad_requests_get_openai_error_bodies(server, body, status, words):
    code, reply = post(server.url, body, raw=isinstance(body, bytes))
    assert code == status
    assert reply["error"]["type"] == "invalid_request_error" and words in reply["error"]["message"]


@pytest.mark.parametrize("n,pp", [(1, 1), (2, 2), (4, 4)])
def test_greedy_through_serve_equals_the_reference_at_pp_1_2_4(model, n, pp):
    with Server(n, model[0], "--set", f"parallel.pp={pp}") as s:
        done = s.client().completions.create(model="gpt.h5", prompt="once upon", max_tokens=15, temperature=0)
        assert done.choices[0].text == text_of(reference_generate(model[1], encode("once upon"), 15, GREEDY))
        s.signal()
        assert s.stopped_cleanly(), s.output()


@pytest.fixture
def slow_server(model):
    """One pipeline of 2 stages, one slot and one queue place, 50 ms per work item: requests stay in flight."""
    with Server(2, model[0], "--set", "parallel.pp=2", "--set", "serve.max_sequences=1",
                "--set", "serve.max_queue=1", env={"HPCPIPE_STEP_SLEEP": "0.05"}) as s:
        yield s


def test_full_queue_is_429_and_a_disconnect_frees_the_slot(slow_server):
    client = slow_server.client()
    first = client.completions.create(model="gpt.h5", prompt="abc", max_tokens=25, temperature=0, stream=True)
    next(iter(first))                                          # running: the only slot
    second = client.completions.create(model="gpt.h5", prompt="abc", max_tokens=25, temperature=0, stream=True)
    code, reply = post(slow_server.url, {"prompt": "abc", "max_tokens": 3})
    assert code == 429, reply
    first.close()                                              # the client goes away mid-stream
    second.close()
    # generous: on 2 busy cores the server notices a disconnect at its next token write, and the cancelled
    # waiting request leaves the outstanding count only once the engine takes it (serve/broker.py)
    deadline = time.time() + 30
    while metric(slow_server.url, "hpcpipe_running_sequences") and time.time() < deadline:
        time.sleep(0.05)
    assert metric(slow_server.url, "hpcpipe_running_sequences") == 0
    assert metric(slow_server.url, "hpcpipe_client_disconnects_total") >= 1
    while True:
        try:
            done = client.completions.create(model="gpt.h5", prompt="abc", max_tokens=3, temperature=0)
            break
        except openai.RateLimitError:          # the cancelled request still counted: it must leave in time
            if time.time() > deadline:
                raise
            time.sleep(0.1)
    assert done.choices[0].finish_reason == "length"


def test_sigterm_finishes_the_requests_in_flight_then_exits_0(slow_server, model):
    stream = slow_server.client().completions.create(model="gpt.h5", prompt="abc", max_tokens=20, temperature=0,
                                                     stream=True)
    chunks = [next(iter(stream))]
    slow_server.signal(signal.SIGTERM)
    refused, deadline = False, time.time() + 10     # the launcher forwards the signal within moments
    while not refused and time.time() < deadline:
        refused = not _listening(slow_server) or post(slow_server.url, {"prompt": "abc", "max_tokens": 1})[0] == 503
    assert refused
    chunks += list(stream)
    assert "".join(c.choices[0].text for c in chunks) == text_of(reference_generate(model[1], encode("abc"), 20,
                                                                                      GREEDY))
    assert slow_server.stopped_cleanly(), slow_server.output()
    assert "stopped (SIGTERM)" in slow_server.output()


def _listening(server) -> bool:
    try:
        urllib.request.urlopen(server.url + "/health", timeout=5)
        return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def test_a_failing_rank_ends_the_job_and_the_client_sees_a_closed_connection(model):
    with Server(2, model[0], "--set", "parallel.pp=2", env={"HPCPIPE_FAULT": "rank=1,step=6",
                                                            "HPCPIPE_STEP_SLEEP": "0.02"}) as s:
        t0 = time.time()
        with pytest.raises((openai.APIError, openai.APIConnectionError)):
            list(s.client(timeout=30).completions.create(model="gpt.h5", prompt="abc", max_tokens=20, stream=True))
        assert s.wait(30) == 1
        assert time.time() - t0 < 15
        assert "injected fault" in s.output()


def test_a_taken_port_or_a_bad_one_is_one_line_and_exit_2(model):
    import socket
    import subprocess

    from support import ROOT
    from support.launch import command
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for value, words in ((str(port), f"cannot listen on 127.0.0.1:{port}: Address already in use"),
                             ("70000", "--port must be in 0..65535, got 70000")):
            proc = subprocess.run(command(2, "hpcpipe.serve", ["--weights", str(model[0]), "--port", value,
                                                               "--set", "parallel.pp=2"]),
                                  capture_output=True, text=True, timeout=60, cwd=ROOT)
            errors = [line for line in proc.stderr.splitlines() if line.startswith("hpcpipe: error:")]
            assert proc.returncode == 2 and len(errors) == 1 and words in errors[0], proc.stderr
            assert "Traceback" not in proc.stderr


def test_hpcpipe_api_key_from_the_environment_guards_the_real_server(model):
    with Server(2, model[0], "--set", "parallel.pp=2", env={"HPCPIPE_API_KEY": "k-3f9a"}) as s:
        assert "API key required (HPCPIPE_API_KEY)" in s.output()
        ok = openai.OpenAI(base_url=s.url + "/v1", api_key="k-3f9a", max_retries=0, timeout=30)
        r = ok.completions.create(model="gpt.h5", prompt="abc", max_tokens=4, temperature=0)
        assert r.choices[0].text == text_of(reference_generate(model[1], encode("abc"), 4, GREEDY))
        with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
            s.client(timeout=30).completions.create(model="gpt.h5", prompt="abc", max_tokens=4)
        assert urllib.request.urlopen(s.url + "/health", timeout=10).status == 200


def test_an_api_key_no_header_can_carry_is_one_line_and_exit_2(model):
    import os
    import subprocess

    from support import ROOT
    from support.launch import command
    proc = subprocess.run(command(2, "hpcpipe.serve", ["--weights", str(model[0]), "--port", "0",
                                                       "--set", "parallel.pp=2"]),
                          capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, "HPCPIPE_API_KEY": "two words"})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hpcpipe: error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert errors and all("HPCPIPE_API_KEY must be printable ASCII without spaces" in e for e in errors)
