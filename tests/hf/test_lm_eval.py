"""lm-evaluation-harness against ``python -m hpcpipe.serve`` (``--model local-completions``: token-id prompts, echo,
logprobs, stop strings) on a multiple-choice and a generate_until task from local files (tests/data/lm_eval, no
hub), against lm-eval's own ``hf`` model on the same weights: the same scores, per-sample log-likelihoods within
1e-4 (and the same is-greedy flags), the same generated texts. The command is the one docs/serve.md gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import ROOT
from support.hf import bytelevel_tokenizer, save_model, save_tokenizer, tiny_model
from support.serve import Server

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

TASKS = "hpcpipe_tiny_mc,hpcpipe_tiny_gen"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}


def _lm_eval(model: str, model_args: str, out: Path, *more: str) -> tuple[dict, dict[str, list[dict]]]:
    """Run `python -m lm_eval run` from the repository root; return (results by task, samples by task)."""
    argv = [sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args", model_args, "--tasks", TASKS,
            "--include_path", "tests/data/lm_eval", "--batch_size", "4", "--output_path", str(out), "--log_samples",
            *more]
    env = dict(os.environ, **OFFLINE, HF_DATASETS_CACHE=str(out / "datasets"))
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    samples = {task: [json.loads(line) for line in next(out.rglob(f"samples_{task}_*.jsonl")).read_text().splitlines()]
               for task in TASKS.split(",")}
    return results, samples


@pytest.mark.slow
def test_lm_eval_local_completions_against_hpcpipe_serve_equals_lm_eval_hf(tmp_path):
    tok = bytelevel_tokenizer(["<|endoftext|>", "<|start|>", "<|end|>"], vocab_size=300)
    model = tiny_model("llama", vocab_size=tok.get_vocab_size(), bos_token_id=tok.token_to_id("<|start|>"),
                       eos_token_id=tok.token_to_id("<|end|>"), max_position_embeddings=256)
    directory = save_model(model, tmp_path / "tiny")
    save_tokenizer(tok, directory, bos_token="<|start|>", eos_token="<|end|>")
    with Server(2, directory, "--set", "parallel.pp=2") as server:
        served = _lm_eval("local-completions", f"model=tiny,base_url={server.url}/v1/completions,"
                          f"tokenizer_backend=huggingface,tokenizer={directory},max_length=256,num_concurrent=1,"
                          f"max_retries=1", tmp_path / "served")
    reference = _lm_eval("hf", f"pretrained={directory},dtype=float32,max_length=256", tmp_path / "hf",
                         "--device", "cpu")
    for task in TASKS.split(","):
        got, want = served[0][task], reference[0][task]
        assert {k: v for k, v in got.items() if "," in k} == {k: v for k, v in want.items() if "," in k}, task
        a, b = served[1][task], reference[1][task]
        assert [s["doc_id"] for s in a] == [s["doc_id"] for s in b] and len(a) > 0
        for x, y in zip(a, b, strict=True):
            if task.endswith("_mc"):
                for (ll, greedy), (ll_ref, greedy_ref) in zip(x["filtered_resps"], y["filtered_resps"], strict=True):
                    assert abs(float(ll) - float(ll_ref)) <= 1e-4 and greedy == greedy_ref, (x["doc_id"], ll, ll_ref)
            else:
                assert x["filtered_resps"] == y["filtered_resps"], x["doc_id"]
