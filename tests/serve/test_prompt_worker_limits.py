"""A prompt worker started under an address-space limit (a job's ulimit -v) below what it would cap itself at: it
set RLIMIT_AS to what it maps + its budget, above the hard limit, and every prompt failed with "a prompt worker
cannot build the tokenizer: ValueError: not allowed to raise maximum limit" (generate and serve alike)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")

TESTS = Path(__file__).resolve().parents[1]
GIB = 1 << 30


def test_a_worker_under_a_lower_hard_limit_keeps_it_and_tokenizes():
    # the child process takes the limit (the test's own process must keep its own); the pool's budget (16 GiB)
    # exceeds the hard limit (8 GiB, room enough for Python and tokenizers) whatever the worker maps
    script = textwrap.dedent(f"""
        import json, resource, sys
        sys.path.insert(0, {str(TESTS)!r})
        resource.setrlimit(resource.RLIMIT_AS, ({8 * GIB}, {8 * GIB}))
        from support.hf import bytelevel_tokenizer
        from hpcpipe.hf.tokenizer import from_files
        from hpcpipe.serve.prompt_pool import PromptPool
        doc = bytelevel_tokenizer(["<|endoftext|>"], vocab_size=300).to_str()
        tok = from_files({{"tokenizer.json": doc.encode(), "tokenizer_config.json": b"{{}}"}}, "test tokenizer")
        with PromptPool(tok, 1, memory={16 * GIB}) as pool:
            pool.start()
            ids = pool.run([{{"text": "the quick brown fox", "where": "prompt"}}])[0]
        print(json.dumps({{"ids": [int(i) for i in ids], "want": [int(i) for i in tok.encode("the quick brown fox")]}}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ids"] == list(out["want"]) and out["ids"], out
