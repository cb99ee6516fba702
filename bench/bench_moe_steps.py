"""What the NumPy steps cost a mixture-of-experts decode: one rank's decode step of bench_ep's Qwen3-MoE shape
against a dense Qwen3 of the same attention, head and active MLP width (d_ff = 8 x 128), NumPy steps and
compiled stage.

    python bench/bench_moe_steps.py [--out FILE]

One process, one BLAS thread (set before NumPy loads), a whole-model DecodeStage per case: a 16-token prompt,
then 256 single-token decode steps, timed together; best of 3 per case. The MoE model runs the NumPy steps only
(the compiled stage computes dense blocks); the dense model runs both, so (MoE NumPy - dense compiled) is what
a compiled MoE stage could at most save and (MoE NumPy - dense NumPy) what routing and per-expert products add.
Results go to bench/results/<today>-moe-steps.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "HPCPIPE_THREADS"):
    os.environ[_name] = "1"

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from bench_ep import SHAPE, write_model  # noqa: E402
from bench_schedules import dated_out, write_results  # noqa: E402

STEPS = 256


def write_dense(directory: Path) -> None:
    """A random dense Qwen3 with the MoE shape's attention and head, d_ff = top-k x expert width."""
    import torch
    import transformers as T
    torch.manual_seed(0)
    keys = {k: v for k, v in SHAPE.items() if k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                      "num_attention_heads", "num_key_value_heads", "head_dim",
                                                      "max_position_embeddings", "tie_word_embeddings")}
    ff = SHAPE["num_experts_per_tok"] * SHAPE["moe_intermediate_size"]
    T.Qwen3ForCausalLM(T.Qwen3Config(**keys, intermediate_size=ff)).eval().save_pretrained(str(directory))


def decode_seconds(directory: Path, compiled: bool) -> float:
    """Seconds per decode step (prompt and steps timed together, the prompt's share under 7 %)."""
    import numpy as np

    from hpcpipe.config import from_dict
    from hpcpipe.nn.core.decode import DecodeStage, Segment
    from hpcpipe.nn.registry import model_def
    from hpcpipe.state.sources import resolve_weights

    source = resolve_weights(directory).forward_only("float32")
    model = model_def(from_dict({"model": source.model, "parallel": {"pp": 1}}))
    groups = range(model.n_layers)
    best = float("inf")
    for _ in range(3):
        stage = DecodeStage(model, groups, source.read(list(groups)), np, "float32", 1, compiled=compiled)
        tokens = np.random.default_rng(0).integers(0, 8000, 16 + STEPS)
        start = time.perf_counter()
        logits = stage.forward(tokens[:16], [Segment(0, 0, 16)])
        for t in range(16, 16 + STEPS):
            logits = stage.forward(tokens[t:t + 1], [Segment(0, t, 1)])
        best = min(best, (time.perf_counter() - start) / STEPS)
        assert np.isfinite(logits).all()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=dated_out("moe-steps"))
    args = parser.parse_args()
    from hpcpipe.kernels import cpu
    if cpu.library() is None:
        raise SystemExit("the compiled kernels are not built (python setup.py build_ext --inplace)")
    with tempfile.TemporaryDirectory() as tmp:
        moe, dense = Path(tmp) / "moe", Path(tmp) / "dense"
        write_model(moe)
        write_dense(dense)
        load = os.getloadavg()[0]
        started = time.strftime("%Y-%m-%dT%H:%M:%S")
        rows = {"moe_numpy": decode_seconds(moe, False), "dense_numpy": decode_seconds(dense, False),
                "dense_compiled": decode_seconds(dense, True)}
    for name, seconds in rows.items():
        print(f"{name}: {seconds * 1e3:.2f} ms / decode step ({1 / seconds:.1f} tokens/s)", flush=True)
    write_results(args.out, {"bench": "moe-steps", "command": " ".join(["python", *sys.argv]), "started": started,
                             "load_average_1m_before": load, "model": SHAPE, "steps": STEPS,
                             "seconds_per_step": rows,
                             "note": "one process, one BLAS thread, best of 3; dense: the MoE shape's attention "
                                     "and head with d_ff = experts_per_token x moe_intermediate_size"})
    print(f"written {args.out}", flush=True)


if __name__ == "__main__":
    main()
