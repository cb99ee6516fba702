"""Generation and serving on the device backend (CuPy) against the NumPy path, at pp = 2.

Greedy ``generate`` of a float64 GPT (tied head) and a float64 Llama (grouped-query attention, RoPE, untied
head) gives the same tokens on CuPy as on NumPy; one ``serve`` request (OpenAI /v1/completions, temperature 0)
on CuPy returns the text NumPy's ``generate`` wrote. Float64 keeps greedy choices away from ties, so the tokens
must be identical, not close. Without a GPU these skip (HPCPIPE_GPU_REHEARSE=1: rehearsed on NumPy)."""

import json
import urllib.request

import pytest
from support.gpu import device_backend, make_llama_weights
from support.serve import Server, generate, make_weights

pytestmark = pytest.mark.gpu

PROMPT = "hello world"
NEW = 16


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu-gen")
    gpt, llama = tmp / "gpt.h5", tmp / "llama.h5"
    make_weights(gpt, tied=True, dtype="float64")
    make_llama_weights(llama)
    return {"gpt": gpt, "llama": llama}


def _generate(tmp_path, path, backend: str) -> dict:
    proc, out = generate(tmp_path, 2, path, PROMPT, "--max-new-tokens", str(NEW), "--temperature", "0",
                         "--set", "parallel.pp=2", "--set", f"run.backend={backend}", timeout=300)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_greedy_generation_at_pp2_on_the_device_equals_numpy(weights, tmp_path, kind):
    device = device_backend()
    want = _generate(tmp_path, weights[kind], "numpy")
    got = _generate(tmp_path, weights[kind], device)
    assert len(want["tokens"]) == NEW
    assert got["tokens"] == want["tokens"], (kind, got["completion"], want["completion"])
    assert got["completion"] == want["completion"]


def test_one_serve_request_on_the_device_equals_numpy_generate(weights, tmp_path):
    device = device_backend()
    want = _generate(tmp_path, weights["gpt"], "numpy")
    with Server(2, weights["gpt"], "--set", "parallel.pp=2", "--set", f"run.backend={device}",
                log=tmp_path / "serve.log") as server:
        with urllib.request.urlopen(server.url + "/v1/models", timeout=60) as resp:
            model = json.loads(resp.read())["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": NEW, "temperature": 0}).encode()
        request = urllib.request.Request(server.url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as resp:
            answer = json.loads(resp.read())
        assert server.proc.poll() is None, server.output()
    choice = answer["choices"][0]
    assert choice["text"] == want["completion"], (choice, want)
    assert choice["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == NEW


LONG_PROMPT = "hello world, " * 4      # 52 tokens: a prefill past RowProduct's widening threshold (32 rows)


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory):
    """A Llama with room for the long prompt, as a Hugging Face directory in bfloat16 (the usual published form)."""
    from hpcpipe.state.hf_convert import export_hf
    from hpcpipe.state.sources import resolve_weights
    tmp = tmp_path_factory.mktemp("gpu-bf16")
    make_llama_weights(tmp / "llama.h5", seq_len=96)
    export_hf(resolve_weights(str(tmp / "llama.h5")), tmp / "llama-bf16", "bfloat16")
    return tmp / "llama-bf16"


@pytest.mark.parametrize("fmt", ["stored", "q8_0"])
def test_weights_kept_as_stored_on_the_device_generate_as_on_numpy(bf16_llama, tmp_path, fmt):
    """A bfloat16 checkpoint with model.weight_format stored (its bits on the GPU) or q8_0 (quantized there as on
    the CPU): the device's row products (hpcpipe.kernels.cuda) give the tokens of the CPU's compiled products,
    both multiplying float32 activations (HPCPIPE_Q8_ACTIVATIONS=float: the CPU's int8 path is another sum). The
    prompt's prefill takes the weights widened for the call (52 rows), each new token the row kernel (1 row)."""
    device = device_backend()
    runs = {}
    for backend in ("numpy", device):
        proc, runs[backend] = generate(tmp_path, 2, bf16_llama, LONG_PROMPT, "--max-new-tokens", str(NEW),
                                       "--temperature", "0", "--set", "parallel.pp=2", "--set",
                                       f"run.backend={backend}", "--set", "model.dtype=float32", "--set",
                                       f'model.weight_format="{fmt}"', timeout=300,
                                       env={"HPCPIPE_Q8_ACTIVATIONS": "float"})
        assert proc.returncode == 0, proc.stderr
    want, got = runs["numpy"], runs[device]
    assert len(want["tokens"]) == NEW
    assert got["tokens"] == want["tokens"], (fmt, got["completion"], want["completion"])
