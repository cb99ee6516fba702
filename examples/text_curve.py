"""Held-out loss curve of a GPT text run: evaluate every checkpoint of the run, plot it with the training loss.

    python examples/text_curve.py --run checkpoints/gpt-text/run-0001 --metrics gpt-text-metrics.jsonl \\
        --data data/text-test.h5 --out docs/img/gpt-text.png [--json gpt-text-curve.json]

The x axis is training time: the sum of the steps' ``step_time_s`` from the
metrics file (saves and start-up excluded). Held-out points are
``python -m hpcpipe.evaluate`` of each committed checkpoint (loss per token in
nats over the whole held-out file). The dashed line is the target: 0.6 x the
unigram entropy of the held-out targets. Needs matplotlib (``pip install ".[plot]"``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import h5py
import numpy as np


def unigram_entropy(data: Path, y_name: str = "y") -> float:
    """Return the entropy (nats) of the held-out targets' token frequencies."""
    with h5py.File(data, "r") as f:
        counts = np.bincount(np.asarray(f[y_name]).reshape(-1))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def held_out_points(run: Path, data: Path) -> list[dict]:
    """Evaluate every committed checkpoint of a run directory; return [{"step", "loss_nats", "loss_bits"}]."""
    from hpcpipe.evaluate import evaluate

    points = []
    for step_dir in sorted(run.glob("step-*")):
        if step_dir.name.endswith(".tmp") or not (step_dir / "manifest.json").is_file():
            continue
        result = evaluate(step_dir, data)
        points.append({"step": result["step"], "loss_nats": result["loss_nats"], "loss_bits": result["loss_bits"]})
        print(f"step {result['step']}: held-out {result['loss_nats']:.4f} nats per token", flush=True)
    return points


def main(argv: list[str] | None = None) -> int:
    """Evaluate, write the curve's numbers as JSON and draw the plot."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="run directory (checkpoint.dir/run-NNNN)")
    ap.add_argument("--metrics", type=Path, required=True, help="the run's log.metrics file (JSON lines)")
    ap.add_argument("--data", type=Path, required=True, help="held-out token file")
    ap.add_argument("--out", type=Path, required=True, help="PNG to write")
    ap.add_argument("--json", type=Path, help="also write the numbers here")
    args = ap.parse_args(argv)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("error: the plot needs matplotlib: pip install \".[plot]\"", file=sys.stderr)
        return 2
    records = [json.loads(line) for line in args.metrics.read_text().splitlines() if line.strip()]
    # metrics are written every log.every steps: scale each record's step time to the steps it stands for
    every = records[1]["step"] - records[0]["step"] if len(records) > 1 else 1
    minutes, elapsed = {}, 0.0
    for r in records:
        elapsed += r["step_time_s"] * every
        minutes[r["step"]] = elapsed / 60
    points = held_out_points(args.run, args.data)
    entropy = unigram_entropy(args.data)
    target = 0.6 * entropy
    summary = {"unigram_entropy_nats": entropy, "target_nats": target, "train_minutes": elapsed / 60,
               "steps": records[-1]["step"] + 1, "held_out": points}
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([minutes[r["step"]] for r in records], [r["loss"] for r in records], lw=0.8, alpha=0.6,
            label="training loss (batch)")
    steps = sorted(minutes)
    at = [minutes[min(steps, key=lambda s, p=p: abs(s - (p["step"] - 1)))] for p in points]
    ax.plot(at, [p["loss_nats"] for p in points], "o-", label="held-out loss")
    ax.axhline(target, ls="--", color="k", lw=0.8, label=f"target 0.6 x unigram entropy = {target:.3f}")
    ax.axhline(entropy, ls=":", color="gray", lw=0.8, label=f"unigram entropy = {entropy:.3f}")
    ax.set_xlabel("training time (minutes, sum of step times)")
    ax.set_ylabel("loss per token (nats)")
    ax.set_ylim(1.0, max(4.0, entropy + 0.3))
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    best = min(points, key=lambda p: p["loss_nats"]) if points else None
    if best:
        print(f"best held-out {best['loss_nats']:.4f} nats ({best['loss_nats'] / entropy:.3f} x unigram entropy "
              f"{entropy:.4f}) at step {best['step']}; {elapsed / 60:.1f} min of steps; wrote {args.out}")
    return 0 if math.isfinite(elapsed) else 1


if __name__ == "__main__":
    sys.exit(main())
