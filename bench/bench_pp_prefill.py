"""A ~512-token prompt through ``python -m hpcpipe.generate`` at pp = 1 and pp = 2 (two ranks), per weight format
and serve.prefill_tokens (the chunk a pipeline work item carries; 0 = the whole prompt at once).

    python bench/bench_pp_prefill.py [--model-dir DIR] [--out FILE] [--formats float32,stored,q8_0]
        [--runs 1:0,1:64,2:64,2:128,2:256]

One new token, greedy, so the generate's own ``seconds`` (its --json) is the prompt's time to the first token.
The model is bench_weight_formats.py's SmolLM2-135M-shaped bf16 directory; its byte-level tokenizer makes 141
words 522 tokens. Each run is its own mpiexec with OMP / OpenBLAS at one thread.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORDS = ("the of and to in is was for on that with as by at from his her an were are which this be or had it not "
         "but first one their its new after who they have been also into two has other some more").split()
RUNS = "1:0,1:64,2:64,2:128,2:256"                    # pp:prefill_tokens
FORMATS = ("float32", "stored", "q8_0")


def generate(directory: str, prompt: str, fmt: str, pp: int, chunk: int) -> dict:
    """One generate run; its --json's prompt length and seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        argv = ["mpiexec", "-n", str(pp), sys.executable, "-m", "hpcpipe.generate", "--weights", directory,
                "--prompt", prompt, "--max-new-tokens", "1", "--temperature", "0", "--json", str(out),
                "--set", f'model.weight_format="{fmt}"', "--set", f"parallel.pp={pp}",
                "--set", f"serve.prefill_tokens={chunk}"]
        subprocess.run(argv, env=env, check=True, capture_output=True, timeout=600)
        doc = json.loads(out.read_text())
    return {"format": fmt, "pp": pp, "prefill_tokens": chunk, "prompt_tokens": len(doc["prompt_tokens"]),
            "seconds": doc["seconds"]}


def main(argv: list[str] | None = None) -> int:
    """Run every row, print it, write the JSON results."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default="/tmp/bench-smollm2-bf16")
    ap.add_argument("--out", default=str(HERE / "results" / f"{time.strftime('%Y-%m-%d')}-pp-prefill.json"))
    ap.add_argument("--formats", default=",".join(FORMATS), help="weight formats, some of " + ", ".join(FORMATS))
    ap.add_argument("--runs", default=RUNS, help="pp:prefill_tokens pairs, comma-separated (0: the whole prompt)")
    args = ap.parse_args(argv)
    formats = args.formats.split(",")
    try:
        runs = [tuple(int(v) for v in pair.split(":")) for pair in args.runs.split(",")]
    except ValueError:
        runs = []
    if any(f not in FORMATS for f in formats) or not runs or any(len(r) != 2 or r[0] < 1 or r[1] < 0 for r in runs):
        ap.error(f"--formats takes some of {', '.join(FORMATS)}; --runs pp:prefill_tokens pairs like {RUNS}")
    rng = random.Random(0)
    prompt = " ".join(rng.choice(WORDS) for _ in range(141))
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "load_before": os.getloadavg(),
           "command": " ".join(["python bench/bench_pp_prefill.py", *(argv or sys.argv[1:])]), "rows": []}
    for fmt in formats:
        for pp, chunk in runs:
            row = generate(args.model_dir, prompt, fmt, pp, chunk)
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
    res["load_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
