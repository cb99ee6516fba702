"""``python -m hpcpipe.train``: pipeline-parallel training over MPI.

    mpiexec -n 8 python -m hpcpipe.train                  # embedded default: dp=2 x pp=4
    mpiexec -n 8 python -m hpcpipe.train --config configs/X.toml --set train.steps=50 --set parallel.pp=2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from .cli import fault_injection, run_planned
from .config import load_config

DESCRIPTION = """Train an MLP with pipeline (pp) x data (dp) parallelism over MPI.
Run under mpiexec/srun; world size must equal dp x pp. Without --config the
embedded default runs: dp=2 x pp=4 on 8 ranks, synthetic data."""

EPILOG = """examples:
  mpiexec -n 8 python -m hpcpipe.train
  mpiexec -n 4 python -m hpcpipe.train --config configs/example6.toml
  mpiexec -n 8 python -m hpcpipe.train --set train.steps=50 --set parallel.pp=2

exit status: 0 success, 1 a rank failed (the job is aborted), 2 bad configuration or input."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(prog="python -m hpcpipe.train", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="FILE", help="TOML config file (default: the embedded default)")
    parser.add_argument("--set", dest="overrides", metavar="SECTION.KEY=VALUE", action="append", default=[],
                        help="override one config key (TOML value syntax); repeatable")
    return parser.parse_args(argv)


class Progress:
    """Rank-0 progress line and JSON-lines metrics."""

    def __init__(self, config: Any, trainer: Any):
        self.cfg = config
        self.trainer = trainer
        self.total = config.train.steps
        self.tty = sys.stderr.isatty()
        path = config.log.metrics
        self.metrics = open(path, "a") if path else None

    def log(self, step: int, loss: float, seconds: float, peaks: list | None = None) -> None:
        """Record one step: metrics line always, console line every log.every steps."""
        tr = self.trainer
        stats = tr.last_stats
        record = {"step": step, "loss": loss, "step_time_s": seconds,
                  "samples_per_s": tr.global_batch / seconds if seconds > 0 else 0.0,
                  "grad_norm": tr.last_grad_norm, "peak_stashed_microbatches": stats.peak_stashed,
                  "peak_stash_bytes": stats.peak_stash_bytes, "comm_wait_s": tr.poller.waited_s}
        if peaks is not None:
            # measured on every rank: per stage, the most micro-batches (and bytes) held at once
            record["peak_stashed_by_stage"] = {str(s): n for p in peaks for s, n in sorted(p[0].items())}
            record["peak_stash_bytes_by_stage"] = {str(s): n for p in peaks for s, n in sorted(p[1].items())}
        if self.metrics and step % self.cfg.log.every == 0:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()
        done = step + 1
        if self.cfg.log.progress and (done % self.cfg.log.every == 0 or done == self.total):
            width = 20
            bar = "#" * (width * done // max(self.total, 1))
            line = (f"[{bar:<{width}}] step {done}/{self.total} loss {loss:.6g} "
                    f"{seconds * 1e3:.1f} ms/step {record['samples_per_s']:.0f} samples/s")
            if self.tty:
                print("\r" + line, end="" if done < self.total else "\n", file=sys.stderr, flush=True)
            else:
                print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        """Close the metrics file."""
        if self.metrics:
            self.metrics.close()


def train(trainer: Any, world: Any) -> dict[str, Any]:
    """Run config.train.steps steps; return a summary (rank 0 logs)."""
    cfg = trainer.config
    rank = world.Get_rank()
    progress = Progress(cfg, trainer) if rank == 0 else None
    losses: list[float] = []
    traced: list[tuple[int, list]] = []
    dp0 = trainer.topo.dp_rank == 0
    start = time.perf_counter()
    try:
        for step in range(cfg.train.steps):
            fault_injection(rank, step)
            t0 = time.perf_counter()
            loss = trainer.train_step(step)
            seconds = time.perf_counter() - t0
            losses.append(loss)
            if cfg.log.trace:
                traced.append((step, trainer.last_stats.events))
            peaks = None
            if cfg.log.metrics and step % cfg.log.every == 0:
                # one small gather per logged step: replica 0's stages cover the pipeline
                stats = trainer.last_stats
                mine = (stats.peak_stashed_stage, stats.peak_stash_bytes_stage) if dp0 else None
                gathered = world.gather(mine, root=0)
                peaks = [g for g in gathered if g is not None] if gathered else None
            if progress:
                progress.log(step, loss, seconds, peaks)
    finally:
        if progress:
            progress.close()
    if cfg.log.trace:
        from .trace import write_trace
        write_trace(cfg.log.trace, world, traced, trainer.topo.name)
    elapsed = time.perf_counter() - start
    steps = len(losses)
    return {"steps": steps, "initial_loss": losses[0] if losses else float("nan"),
            "final_loss": losses[-1] if losses else float("nan"),
            "samples_per_s": steps * trainer.global_batch / elapsed if elapsed > 0 else 0.0,
            "elapsed_s": elapsed}


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m hpcpipe.train``; returns the exit status."""
    args = parse_args(argv)
    from mpi4py import MPI

    from .trainer import Trainer, plan

    world = MPI.COMM_WORLD
    holder: dict[str, Any] = {}

    def planner():
        config = load_config(args.config, args.overrides)
        return plan(config, world.Get_size())

    def body(p) -> int:
        trainer = Trainer(p, world, record_events=bool(p.config.log.trace))
        holder["trainer"] = trainer
        summary = train(trainer, world)
        if world.Get_rank() == 0:
            c = p.config
            print(f"hpcpipe: trained {summary['steps']} steps, loss {summary['initial_loss']:.6g} -> "
                  f"{summary['final_loss']:.6g}, {summary['samples_per_s']:.0f} samples/s "
                  f"(dp={p.dp} pp={p.pp} schedule={c.parallel.schedule} "
                  f"micro_batches={c.train.micro_batches}x{c.train.micro_batch_size}, "
                  f"{summary['elapsed_s']:.2f} s)", flush=True)
        trainer.close()
        return 0

    def label() -> str:
        trainer = holder.get("trainer")
        return trainer.topo.name if trainer else f"rank {world.Get_rank()}"

    return run_planned(world, planner, body, label)


if __name__ == "__main__":
    sys.exit(main())
