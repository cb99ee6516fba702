"""`python -m hpcpipe.generate` end to end: token for token equal to the no-cache reference at every layout."""

from __future__ import annotations

import h5py
import pytest
from support.launch import one_error
from support.serve import CHARS, encode, generate, make_weights

from hpcpipe.serve.reference import reference_generate
from hpcpipe.serve.sampling import SamplingParams

PROMPT = "hello world"
LAYOUTS = [(1, 1), (2, 2), (4, 4), (4, 2)]     # (ranks, pp): pp = 1, 2, 4 and dp = 2 x pp = 2


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gen")
    tied, untied = tmp / "tied.h5", tmp / "untied.h5"
    return {"tied": (tied, make_weights(tied)), "untied": (untied, make_weights(untied, tied=False, seed=5))}


@pytest.mark.parametrize("n,pp", LAYOUTS)
def test_greedy_equals_the_no_cache_reference_at_every_layout(weights, tmp_path, n, pp):
    for kind in ("tied", "untied") if pp == 2 else ("tied",):
        path, model = weights[kind]
        proc, out = generate(tmp_path, n, path, PROMPT, "--max-new-tokens", "16", "--temperature", "0",
                             "--set", f"parallel.pp={pp}")
        assert proc.returncode == 0, proc.stderr
        expected = reference_generate(model, encode(PROMPT), 16, SamplingParams(temperature=0.0))
        assert out["tokens"] == expected, kind
        assert out["prompt_tokens"] == encode(PROMPT)
        assert out["finish_reason"] == "length"
        assert out["completion"] in proc.stdout        # streamed to stdout as generated


@pytest.mark.parametrize("n,pp", LAYOUTS)
def test_seeded_sampling_gives_the_same_text_at_every_layout(weights, tmp_path, n, pp):
    path, model = weights["tied"]
    proc, out = generate(tmp_path, n, path, PROMPT, "--max-new-tokens", "18", "--temperature", "0.9",
                         "--top-k", "8", "--top-p", "0.95", "--seed", "11", "--set", f"parallel.pp={pp}")
    assert proc.returncode == 0, proc.stderr
    params = SamplingParams(temperature=0.9, top_k=8, top_p=0.95, seed=11)
    assert out["tokens"] == reference_generate(model, encode(PROMPT), 18, params)


def test_generation_stops_when_the_context_is_full(weights, tmp_path):
    path, model = weights["tied"]
    prompt = "the quick brown fox jumps over"           # 30 of 32 positions
    proc, out = generate(tmp_path, 2, path, prompt, "--max-new-tokens", "20", "--temperature", "0",
                         "--set", "parallel.pp=2")
    assert proc.returncode == 0, proc.stderr
    assert len(out["tokens"]) == 2 and out["finish_reason"] == "length"
    assert "the context is full: 30 prompt + 2 new tokens = model.seq_len 32, short of --max-new-tokens 20" \
        in proc.stderr
    assert out["tokens"] == reference_generate(model, encode(prompt), 20, SamplingParams(temperature=0.0))


def test_no_kv_cache_baseline_gives_the_same_tokens(weights, tmp_path):
    path, model = weights["tied"]
    proc, out = generate(tmp_path, 2, path, PROMPT, "--max-new-tokens", "10", "--temperature", "0",
                         "--set", "parallel.pp=2", "--set", "serve.kv_cache=false")
    assert proc.returncode == 0, proc.stderr
    assert out["tokens"] == reference_generate(model, encode(PROMPT), 10, SamplingParams(temperature=0.0))


@pytest.mark.parametrize("args,message", [
    (["--prompt", "HELLO"], "character 'H'"),
    (["--prompt", ""], "--prompt is empty"),
    (["--json", ""], "--json path is empty: name the file to write"),          # was: exit 0, nothing written
    (["--prompt", "a" * 33], "33 tokens long but the model's context is model.seq_len = 32"),
    (["--prompt", "a" * 32], "32 tokens long but the model's context is model.seq_len = 32 tokens, which it fills: "
                             "no token can follow it (at most 31 prompt tokens)"),    # was: 1 token, "32 + 1 = 32"
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--set", "parallel.pp=3"], "world size 2 is not divisible by parallel.pp (3)"),
    (["--set", "model.n_heads=4"], "model.n_heads = 4 in the configuration does not match"),
    (["--chat"], "no chat template; leave out --chat"),         # was the server's advice (/v1/completions)
])
def test_bad_input_is_one_line_and_exit_2(weights, tmp_path, args, message):
    path, _ = weights["tied"]
    proc, _ = _run_bad(tmp_path, path, args)
    assert message in one_error(proc)


def test_a_model_with_more_ids_than_its_tokenizer_samples_only_decodable_ids(tmp_path):
    path = tmp_path / "wide.h5"
    make_weights(path, vocab=2 * len(CHARS))           # 32 ids beyond the 32 characters the tokenizer names
    proc, out = generate(tmp_path, 2, path, "the cat", "--max-new-tokens", "20", "--temperature", "3",
                         "--set", "parallel.pp=2")
    assert proc.returncode == 0, proc.stderr         # was: exit 1, "id 37 is outside the vocabulary [0, 32)"
    assert len(out["tokens"]) == 20 and all(0 <= t < len(CHARS) for t in out["tokens"])


def test_json_output_never_replaces_the_weights_and_is_checked_before_generating(weights, tmp_path):
    path, _ = weights["tied"]
    before = path.read_bytes()
    proc, _ = _run_bad(tmp_path, path, ["--json", str(path)])
    assert f"--json path {str(path)!r} is the input file" in one_error(proc)
    assert path.read_bytes() == before
    proc, _ = _run_bad(tmp_path, path, ["--json", str(tmp_path / "nodir" / "out.json")])
    assert "does not exist" in one_error(proc) and "generated" not in proc.stderr
    # /proc passes the permission bits as root: was exit 1 after generating ("[rank 0] error: HpcpipeError:
    # cannot write --json '/proc/x'")
    proc, _ = _run_bad(tmp_path, path, ["--json", "/proc/hpcpipe-x.json"])
    assert "--json path '/proc/hpcpipe-x.json': cannot create a file in '/proc'" in one_error(proc)
    assert "generated" not in proc.stderr
    notes = tmp_path / "notes.json"        # a file the run did not write: never replaced
    notes.write_text('{"mine": 1}\n')
    proc, _ = _run_bad(tmp_path, path, ["--json", str(notes)])
    message = one_error(proc)
    assert f"--json path {str(notes)!r} already exists and is not a file hpcpipe wrote as a generate" in message
    assert notes.read_text() == '{"mine": 1}\n'


def _run_bad(tmp_path, path, args):
    prompt = "hello"
    rest = list(args)
    if "--prompt" in rest:
        i = rest.index("--prompt")
        prompt = rest[i + 1]
        del rest[i:i + 2]
    return generate(tmp_path, 2, path, prompt, "--max-new-tokens", "4", "--set", "parallel.pp=2", *rest)


def test_weights_without_a_tokenizer_or_of_an_mlp_are_refused(weights, tmp_path):
    bare = tmp_path / "bare.h5"
    make_weights(bare)
    with h5py.File(bare, "a") as f:
        del f.attrs["tokenizer"]
    proc, _ = generate(tmp_path, 1, bare, "hi", "--set", "parallel.pp=1")
    assert "has no tokenizer attribute" in one_error(proc)
    from hpcpipe.config import load_config
    from hpcpipe.nn.mlp.model import init_layer, layer_specs
    from hpcpipe.state.weights import write_weights
    cfg = load_config(None, ["parallel.pp=1"])
    arrays = {s.index: dict(zip(("weight", "bias"), init_layer(s, 0), strict=True)) for s in layer_specs(cfg)}
    mlp = tmp_path / "mlp.h5"
    write_weights(mlp, arrays, n_layers=len(arrays), model_config={"dims": cfg.model.dims, "kind": "mlp"})
    proc, _ = generate(tmp_path, 1, mlp, "hi", "--set", "parallel.pp=1")
    assert "holds an MLP model" in one_error(proc)


def test_a_failing_rank_ends_the_job_with_exit_1(weights, tmp_path):
    path, _ = weights["tied"]
    proc, out = generate(tmp_path, 2, path, PROMPT, "--max-new-tokens", "16", "--set", "parallel.pp=2",
                         env={"HPCPIPE_FAULT": "rank=1,step=3"}, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "injected fault" in proc.stderr and out is None


@pytest.mark.parametrize("pp,chunk", [(2, 3), (4, 1)])
def test_a_prompt_prefilled_in_chunks_gives_the_same_tokens(weights, tmp_path, pp, chunk):
    # the chunks of one prompt travel the stages back to back (up to pp of them in flight): at pp = 4 and
    # one-token chunks every stage holds one while the next is sent
    path, model = weights["tied"]
    proc, out = generate(tmp_path, pp, path, PROMPT, "--max-new-tokens", "12", "--temperature", "0.9", "--seed", "4",
                         "--set", f"parallel.pp={pp}", "--set", f"serve.prefill_tokens={chunk}")
    assert proc.returncode == 0, proc.stderr
    params = SamplingParams(temperature=0.9, seed=4)
    assert out["tokens"] == reference_generate(model, encode(PROMPT), 12, params)


# ---- issue 32 ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["inf", "nan"])
def test_a_temperature_that_is_not_a_finite_number_is_one_line_and_exit_2(weights, tmp_path, value):
    path, _ = weights["tied"]
    proc, out = _run_bad(tmp_path, path, ["--temperature", value])        # was: a traceback and exit 1
    assert f"--temperature must be a finite number >= 0 (0 = greedy), got {value}" in one_error(proc)
    assert out is None


def test_a_tiny_temperature_is_greedy(weights, tmp_path):
    path, model = weights["tied"]
    proc, out = generate(tmp_path, 2, path, PROMPT, "--max-new-tokens", "8", "--temperature", "1e-308",
                         "--set", "parallel.pp=2")                         # was: a traceback and exit 1
    assert proc.returncode == 0, proc.stderr
    assert out["tokens"] == reference_generate(model, encode(PROMPT), 8, SamplingParams(temperature=0.0))


def test_stdout_holds_the_completion_alone(weights, tmp_path):
    path, _ = weights["tied"]
    proc, out = generate(tmp_path, 2, path, PROMPT, "--max-new-tokens", "10", "--temperature", "0",
                         "--set", "parallel.pp=2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == out["completion"] + "\n", proc.stdout          # was: the "hpcpipe: MPI:" banner first
    assert "hpcpipe: MPI:" in proc.stderr


@pytest.mark.parametrize("how", ["TERM to mpiexec", "USR1 to mpiexec"])
def test_a_stop_signal_ends_generate_with_75_and_writes_nothing(weights, tmp_path, how):
    import os
    import signal
    import subprocess
    import time

    from support import ROOT
    from support.launch import command, wait_until_gone
    path, _ = weights["tied"]
    out = tmp_path / "out.json"
    argv = command(2, "hpcpipe.generate", ["--weights", str(path), "--prompt", "ab", "--max-new-tokens", "29",
                                           "--json", str(out), "--set", "parallel.pp=2"])
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=dict(os.environ, HPCPIPE_STEP_SLEEP="0.3", PYTHONUNBUFFERED="1",
                                     HPCPIPE_TEST_MARK=str(tmp_path)))
    try:
        first = proc.stdout.read(1)                  # the first token's text: generating
        assert first, proc.stderr.read()
        t0 = time.time()
        proc.send_signal(signal.SIGTERM if how.startswith("TERM") else signal.SIGUSR1)
        rest, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 75, err                # was: ignored, all 29 tokens and exit 0
    assert time.time() - t0 < 5, err
    name = "SIGTERM" if how.startswith("TERM") else "SIGUSR1"
    stops = [line for line in err.splitlines() if line.startswith("hpcpipe: stopped")]
    assert len(stops) == 1 and name in stops[0] and "nothing written" in stops[0], err
    assert "Traceback" not in err and not out.exists()
    assert len(first + rest) < 20
    assert wait_until_gone(str(tmp_path), 10) == []
