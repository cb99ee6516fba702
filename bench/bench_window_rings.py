"""KV memory of a long context on a model mixing sliding-window and full-attention blocks, with and without rings.

    python bench/bench_window_rings.py [--context 8192] [--out bench/results/YYYY-MM-DD-window-rings.json]

A random float32 Llama-kind model (d 256, 8 query and 8 key-value heads of 32, ff 512, 8 blocks; blocks 2-7
with a 512-token sliding window, blocks 0-1 full: Qwen2's max_window_layers = 2) runs one sequence of
``--context`` positions through one whole-model compiled DecodeStage of 8 slots, as serving does: its prompt
in chunks of serve.prefill_tokens (64, the default) cut at the room the serving ledger leaves
(hpcpipe.serve.kv_ledger), then 32 decoded tokens. Each mode runs in its own process: ``rings`` (the windowed
blocks' keys in a ring of held_pages(window + prefill_tokens) KV blocks per slot,
hpcpipe.nn.core.kv_pages.ring_layout) and ``whole`` (every block's keys in the pool of 8 whole contexts, as
before). Reported per mode: the stage's KV bytes (reserved), the peak resident memory (VmHWM) and its rise
over the process before the stage was built (the host cache is committed as it is written: the rise is the
KV written plus scratch), and the memory check's KV bytes per rank (hpcpipe.nn.memory.decode_rank_bytes) for
serve.max_sequences = 8.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np
from bench_schedules import dated_out, write_results

MODEL = {"kind": "llama", "vocab_size": 256, "d_model": 256, "n_heads": 8, "n_kv_heads": 8, "n_blocks": 8,
         "d_ff": 512, "sliding_window": 512, "sliding_layers": [2, 3, 4, 5, 6, 7]}
SLOTS, PAGE, NEW = 8, 16, 32


def _kib(field: str) -> int:
    """A /proc/self/status memory field, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _config(context: int, window: bool = True):
    from hpcpipe.config import load_config

    keys = {**MODEL, "seq_len": context} if window else \
        {k: v for k, v in {**MODEL, "seq_len": context}.items() if k not in ("sliding_window", "sliding_layers")}
    return load_config(None, [f"model.{k}={v!r}".replace("'", '"') for k, v in keys.items()]
                       + [f"serve.max_sequences={SLOTS}", f"serve.kv_block={PAGE}", "parallel.pp=1"])


def run_mode(mode: str, context: int) -> dict:
    """One sequence of ``context`` positions through the stage in ``mode`` (rings | whole); its numbers."""
    from hpcpipe.nn.core.decode import DecodeStage, Segment
    from hpcpipe.nn.memory import ring_pages, ring_window
    from hpcpipe.nn.registry import model_def
    from hpcpipe.serve.broker import Request
    from hpcpipe.serve.kv_ledger import KVLedger
    from hpcpipe.serve.sampling import SamplingParams
    from hpcpipe.serve.scheduler import Sequence

    config = _config(context)
    model = model_def(config)
    chunk = config.serve.prefill_tokens
    rng = np.random.default_rng(0)
    arrays = {i: {name: (np.ones(shape, np.float32) if "norm" in name else
                         (rng.standard_normal(shape, dtype=np.float32) * 0.05))
                  for name, shape in spec.shapes.items()} for i, spec in enumerate(model.specs)}
    window = ring_window(config, model) if mode == "rings" else 0
    ring = ring_pages(config, model) if mode == "rings" else 0
    whole = -(-context // PAGE)
    before = _kib("VmRSS")
    stage = DecodeStage(model, range(model.n_layers), arrays, np, "float32", SLOTS, compiled=True, kv_block=PAGE,
                        kv_blocks=SLOTS * whole, kv_ring=ring)
    del arrays
    ledger = KVLedger(SLOTS * whole, PAGE, context, prefix_cache=False, ring=window, ring_span=ring)
    tokens = rng.integers(0, MODEL["vocab_size"], context).tolist()
    prompt = context - NEW
    seq = Sequence(Request("b", tokens[:prompt], NEW, SamplingParams(), 0.0), 0, 0, tokens[:prompt])
    assert ledger.admit(seq)
    items = 0
    while seq.cached < context:
        end = min(context, ledger.room(seq), seq.cached + chunk if seq.cached < prompt else seq.cached + 1,
                  prompt if seq.cached < prompt else context)
        update = ledger.grow(seq, end)
        if seq.cached == 0:
            update = ledger.first_table(seq)
        if update is not None:
            stage.set_pages(*update)
        stage.forward(np.asarray(tokens[seq.cached:end], dtype=np.int64), [Segment(0, seq.cached, end - seq.cached)])
        seq.cached, items = end, items + 1
    peak = _kib("VmHWM")
    return {"mode": mode, "ring_blocks_per_slot": ring, "kv_bytes_reserved": stage.cache_bytes,
            "ring_bytes_reserved": stage.ring_bytes, "work_items": items,
            "rss_before_stage": before, "peak_rss": peak, "peak_rss_rise": peak - before}


def main(argv: list[str] | None = None) -> int:
    """Run both modes in child processes and write the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--out", default=dated_out("window-rings"))
    parser.add_argument("--mode", choices=("rings", "whole"), help=argparse.SUPPRESS)   # a child's one run
    args = parser.parse_args(argv)
    if args.mode:
        print(json.dumps(run_mode(args.mode, args.context)))
        return 0
    from hpcpipe.nn.memory import decode_rank_bytes

    runs = []
    for mode in ("rings", "whole"):
        out = subprocess.run([sys.executable, __file__, "--mode", mode, "--context", str(args.context)],
                             capture_output=True, text=True, check=True, env=dict(os.environ))
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(runs[-1], flush=True)
    layout = [range(0, MODEL["n_blocks"] + 2)]
    results = {
        "command": "python bench/bench_window_rings.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "load_1min": os.getloadavg()[0], "model": MODEL, "context": args.context, "slots": SLOTS, "kv_block": PAGE,
        "prefill_chunk": _config(args.context).serve.prefill_tokens, "new_tokens": NEW, "runs": runs,
        "memory_check_kv_bytes": {"rings": decode_rank_bytes(_config(args.context), layout)[1],
                                  "whole": decode_rank_bytes(_config(args.context, window=False), layout)[1]},
    }
    write_results(args.out, results)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
