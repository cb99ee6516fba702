"""The same measurements through two source trees' compiled kernels, alternating, so a kernel change is compared
with what it replaced under the same machine conditions (this 2-core host's speed moves by a third between runs).

    python bench/bench_kernels_ab.py --trees /work/main,/work/wt/NAME [--rounds 2] [--formats stored,q8_0]
        [--pp-chunks 64,128,256] [--model-dir DIR] [--out FILE]

Each tree must have its kernels built in place (``python setup.py build_ext --inplace``); its commit is recorded.
Per round, per tree, per format, each in its own process: bench_weight_formats.py's one-rank 512-token prefill
and batch-1 decode (64 tokens after a 32-token prompt), then bench_pp_prefill.py's 522-token prompt through
``python -m hpcpipe.generate`` at pp = 2 with each ``serve.prefill_tokens`` of --pp-chunks (time to the first
token). The harness (these bench scripts) is this checkout's for both trees; only ``hpcpipe`` differs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def commit(tree: Path) -> str:
    """The tree's HEAD commit, with '+dirty' when it has uncommitted changes."""
    head = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return head + ("+dirty" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    """Run every row for each tree in turn, print it, write the JSON results."""
    import bench_pp_prefill
    import bench_weight_formats
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", required=True, help="two source trees with built kernels, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--formats", default="stored,q8_0")
    ap.add_argument("--pp-chunks", default="64,128", help="serve.prefill_tokens values at pp = 2 ('' = none)")
    ap.add_argument("--model-dir", default="/tmp/bench-smollm2-bf16")
    ap.add_argument("--out", default=str(HERE / "results" / f"{time.strftime('%Y-%m-%d')}-kernels-ab.json"))
    args = ap.parse_args(argv)
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    formats = args.formats.split(",")
    try:
        chunks = [int(c) for c in args.pp_chunks.split(",") if c]
    except ValueError:
        chunks = [-1]
    if not trees or any(not (t / "src" / "hpcpipe").is_dir() for t in trees) or args.rounds < 1 \
            or any(f not in bench_pp_prefill.FORMATS for f in formats) or any(c < 0 for c in chunks):
        ap.error("--trees takes source trees (each with src/hpcpipe), --rounds >= 1, --formats some of "
                 f"{', '.join(bench_pp_prefill.FORMATS)}, --pp-chunks integers >= 0")
    directory = Path(args.model_dir)
    if not (directory / "config.json").exists():
        bench_weight_formats.write_bf16_model(directory)
    prompt = " ".join(random.Random(0).choice(bench_pp_prefill.WORDS) for _ in range(141))
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(["python", *sys.argv]),
           "load_before": os.getloadavg(), "trees": {str(t): commit(t) for t in trees}, "rows": []}
    for rnd in range(args.rounds):
        for tree in trees:
            env = {"PYTHONPATH": str(tree / "src")}
            for fmt in formats:
                pre = bench_weight_formats.run_hpcpipe(directory, fmt, prefill=True, env=env)
                dec = bench_weight_formats.run_hpcpipe(directory, fmt, prefill=False, env=env)
                row = {"round": rnd, "tree": str(tree), "format": fmt, "prefill_512_s": pre["prefill_512_s"],
                       "decode_tok_s": dec["decode_tok_s"]}
                saved = os.environ.get("PYTHONPATH")
                os.environ["PYTHONPATH"] = env["PYTHONPATH"]          # generate's mpiexec inherits it
                try:
                    for chunk in chunks:
                        row[f"pp2_chunk{chunk}_s"] = bench_pp_prefill.generate(str(directory), prompt, fmt, 2,
                                                                               chunk)["seconds"]
                finally:
                    if saved is None:
                        os.environ.pop("PYTHONPATH")
                    else:
                        os.environ["PYTHONPATH"] = saved
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
    res["load_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
