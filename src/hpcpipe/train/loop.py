"""The training loop: steps, the agreed per-step decision, checkpoints, progress, metrics and traces."""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING, Any

from hpcpipe.errors import EXIT_DIVERGED, AgreedError, HpcpipeError
from hpcpipe.runtime.faults import fault_injection, stall_injection, step_sleep
from hpcpipe.runtime.progress import Progress as LineProgress
from hpcpipe.runtime.rss import peak_rss_bytes
from hpcpipe.runtime.signals import StopSignals
from hpcpipe.runtime.watchdog import Watchdog
from hpcpipe.runtime.wire import link_bytes
from hpcpipe.trace import rank_events, training_trace, write_json
from hpcpipe.train.evaluation import due

if TYPE_CHECKING:
    from mpi4py.MPI import Comm

    from hpcpipe.train.trainer import StepResult


def logged_step(step: int, every: int, total: int) -> bool:
    """Whether step (0-based) gets a metrics line: the first, every ``every``-th after it, and the last."""
    return step % every == 0 or step + 1 == total


class Progress:
    """Rank-0 progress line (stdout, redrawn in place on a terminal) and JSON-lines metrics.

    The line is :class:`hpcpipe.runtime.progress.Progress`'s, written every
    ``log.every`` steps, with the elapsed time and the ETA of this run's steps
    (a resumed run's from its first step). Redrawing with '\\r' only where a
    person watches a terminal: under Open MPI every rank's stdout is a pty even
    when mpirun writes to a file, so runenv.stdout_is_terminal asks mpirun's
    own stdout instead.
    """

    def __init__(self, config: Any, trainer: Any):
        self.cfg = config
        self.trainer = trainer
        self.total = config.train.steps
        self.first = trainer.start_step
        self.line = LineProgress(sys.stdout, every_s=0, enabled=True)
        path = config.log.metrics
        self.metrics = open(path, "a") if path else None

    def log(self, step: int, result: StepResult, seconds: float, peaks: list | None = None,
            rss_by_rank: list[int] | None = None, tp_comm_s: float | None = None,
            memory_by_rank: list[tuple[int, int]] | None = None, evaluated: dict | None = None,
            ep_comm_s: float | None = None, wire_by_rank: list[tuple[int, int]] | None = None) -> None:
        """Record one step's result: metrics line always, console line every log.every steps."""
        tr, stats, decision, loss = self.trainer, result.stats, result.decision, result.loss
        record = {"step": step, "loss": loss, "step_time_s": seconds,
                  "samples_per_s": tr.global_batch / seconds if seconds > 0 else 0.0,
                  "grad_norm": decision.grad_norm, "peak_stashed_microbatches": stats.peak_stashed,
                  "peak_stash_bytes": stats.peak_stash_bytes, "comm_wait_s": tr.poller.waited_s,
                  "host_device_bytes": result.host_device_bytes, "lr": result.lr}
        skipped = bool(decision and decision.skip)
        if skipped:   # strict JSON has no NaN: a skipped step's non-finite loss is null
            record.update(loss=loss if loss == loss and abs(loss) != float("inf") else None, grad_norm=None,
                          skipped=True, bad_ranks=decision.bad_ranks)
        if peaks is not None:
            # measured on every rank: per stage, the most micro-batches (and bytes) held at once
            record["peak_stashed_by_stage"] = {str(s): n for p in peaks for s, n in sorted(p[0].items())}
            record["peak_stash_bytes_by_stage"] = {str(s): n for p in peaks for s, n in sorted(p[1].items())}
        if tp_comm_s is not None:    # the slowest rank's seconds in tp collectives (on its critical path)
            record["tp_comm_s"] = tp_comm_s
        if ep_comm_s is not None:    # the slowest rank's seconds in the experts' all-to-alls
            record["ep_comm_s"] = ep_comm_s
        if wire_by_rank is not None:   # bytes in MPI messages this step; per node, those that left it (its link)
            record["sent_bytes"] = sum(sent for sent, _ in wire_by_rank)
            if tr.nodes.count > 1:
                record["link_bytes"] = link_bytes(tr.nodes.hosts, [off for _, off in wire_by_rank])
        if rss_by_rank is not None:
            record["peak_rss_bytes"] = max(rss_by_rank)
            record["peak_rss_bytes_by_rank"] = rss_by_rank
        if evaluated:    # the held-out loss of the parameters after this step's update (data.eval_path)
            record.update(evaluated)
        if memory_by_rank is not None:   # what the arrays of parameters and optimizer state hold (train.zero, LoRA)
            record["parameter_bytes"] = max(m[0] for m in memory_by_rank)
            record["peak_optimizer_bytes"] = max(m[1] for m in memory_by_rank)
            record["optimizer_bytes_by_rank"] = [m[1] for m in memory_by_rank]
        if self.metrics and (logged_step(step, self.cfg.log.every, self.total) or evaluated):
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()
        done = step + 1
        if self.cfg.log.progress and (done % self.cfg.log.every == 0 or done == self.total or evaluated):
            width = 20
            bar = "#" * (width * done // max(self.total, 1))
            scheduled = self.cfg.train.lr_schedule != "constant" or self.cfg.train.warmup_steps   # the rate moves
            rate = f" lr {result.lr:.3g}" if scheduled and result.lr is not None else ""
            line = (f"[{bar:<{width}}] step {done}/{self.total} loss {loss:.6g}{rate} "
                    f"{seconds * 1e3:.1f} ms/step {record['samples_per_s']:.0f} samples/s")
            if evaluated:
                line += f" eval_loss {evaluated['eval_loss']:.6g}"
            if skipped:
                line += f" SKIPPED (non-finite loss or gradient on {decision.bad_ranks} rank(s))"
            self.line.show(line, (done - self.first) / max(self.total - self.first, 1), force=True)

    def close(self) -> None:
        """Close the metrics file; end a line redrawn on a terminal."""
        self.line.close()
        if self.metrics:
            self.metrics.close()


def train(trainer: Any, world: Comm, stop: StopSignals | None = None,
          watchdog: Watchdog | None = None) -> dict[str, Any]:
    """Run steps start_step .. train.steps-1, checkpointing every checkpoint.every steps and at the end.

    Every step ends with one agreed decision (``trainer.run_step``'s): a step with a
    non-finite loss or gradient on any rank is skipped everywhere (the data position
    still advances), train.max_bad_steps of them in a row stop the run (AgreedError,
    exit 77), and a stop signal on any rank makes every rank checkpoint and return
    with summary["stopped"] set. Returns a summary (rank 0 logs; its peak_rss_bytes_by_rank is
    None on the other ranks).
    """
    from hpcpipe.runtime.comm import gather_to_root

    cfg = trainer.config
    rank = world.Get_rank()
    progress = Progress(cfg, trainer) if rank == 0 else None
    losses: list[float] = []
    every, saved = cfg.checkpoint.every, trainer.start_step
    saves, save_s = 0, 0.0
    bad_run: list[int] = []
    # NaN/Inf rows are refused when read; huge finite values can still overflow
    data_hint = f", or look for extreme values in data.path {cfg.data.path!r}" if cfg.data.path else ""
    skipped = 0
    stopped = ""
    last_eval: dict | None = None
    beat = watchdog.beat if watchdog else (lambda phase: None)

    def stop_requested() -> bool:
        """Asked at each step's agreement: whether a stop signal arrived on this rank."""
        if stop is None:
            return False
        stop.check_interrupt()   # a dropped Ctrl-C still stops the job at the next step
        return stop.requested
    traced: list[tuple[int, list]] = []
    tp, ep = trainer.tp, trainer.ep
    for group in (tp, ep):
        if group is not None:
            group.take_seconds()      # the steps' own collectives only, not those of setting up
            if cfg.log.trace:
                group.events = []
    dp0 = trainer.topo.dp_rank == 0
    start = time.perf_counter()
    try:
        for step in range(trainer.start_step, cfg.train.steps):
            beat(f"step {step}")
            fault_injection(rank, step)
            stall_injection(rank, step)
            step_sleep()
            t0 = time.perf_counter()
            result = trainer.run_step(step, stop_requested)
            seconds = time.perf_counter() - t0
            decision, stats = result.decision, result.stats
            losses.append(result.loss)
            evaluated = None
            if trainer.evaluator is not None and due(cfg, step + 1):   # after the update, before the next step
                beat(f"held-out loss after step {step + 1}")
                evaluated = last_eval = trainer.evaluator.run()
            tp_s = tp.take_seconds() if tp is not None else None
            ep_s = ep.take_seconds() if ep is not None else None
            wire = trainer.wire.take()
            if cfg.log.trace:
                traced.append((step, stats.events + tp_trace_events(tp) + tp_trace_events(ep, "ep all-to-all")))
            peaks = rss_by_rank = tp_comm_s = ep_comm_s = memory = wire_by_rank = None
            if cfg.log.metrics and logged_step(step, cfg.log.every, cfg.train.steps):
                # one small gather per logged step: replica 0's stages cover the pipeline, every rank its RSS
                mine = (stats.peak_stashed_stage, stats.peak_stash_bytes_stage) if dp0 else None
                gathered = gather_to_root(world, (mine, peak_rss_bytes(), tp_s, trainer.memory_bytes(), ep_s, wire),
                                          0)
                if gathered:
                    peaks = [g[0] for g in gathered if g[0] is not None]
                    rss_by_rank = [g[1] for g in gathered]
                    tp_comm_s = None if tp_s is None else max(g[2] for g in gathered)
                    memory = [g[3] for g in gathered]
                    ep_comm_s = None if ep_s is None else max(g[4] for g in gathered)
                    wire_by_rank = [g[5] for g in gathered]
            if progress:
                progress.log(step, result, seconds, peaks, rss_by_rank, tp_comm_s, memory, evaluated, ep_comm_s,
                             wire_by_rank)
            bad_run = bad_run + [step] if decision.skip else []
            skipped += int(decision.skip)
            if len(bad_run) >= cfg.train.max_bad_steps:
                # numbered as the progress lines above it (from 1), and as the metrics' "step" (from 0)
                raise AgreedError(f"{len(bad_run)} steps in a row (steps {bad_run[0] + 1}..{bad_run[-1] + 1}, the "
                                  f"metrics' \"step\" {bad_run[0]}..{bad_run[-1]}) had a non-finite loss or gradient "
                                  f"(train.max_bad_steps = {cfg.train.max_bad_steps}); the parameters are still "
                                  f"{f'those after step {bad_run[0]}' if bad_run[0] else 'those the run started with'}"
                                  f"; no checkpoint written "
                                  f"(lower train.lr or set train.grad_clip{data_hint})", code=EXIT_DIVERGED)
            done = step + 1
            if cfg.checkpoint.dir and every and done % every == 0:
                beat(f"checkpoint save of step {done}")
                save_s += timed_save(trainer, done)
                saves, saved = saves + 1, done
            if decision.stop and done < cfg.train.steps:
                here = f"{stop.name} here" if stop is not None and stop.requested else "not here"
                stopped = f"a stop signal on {decision.stop_ranks} of {world.Get_size()} rank(s) ({here})"
                if cfg.checkpoint.dir and saved != done:
                    beat(f"checkpoint save of step {done} (stopping)")
                    save_s += timed_save(trainer, done)
                    saves, saved = saves + 1, done
                break
        else:
            if cfg.checkpoint.dir and saved != cfg.train.steps:
                beat(f"checkpoint save of step {cfg.train.steps}")
                save_s += timed_save(trainer, cfg.train.steps)
                saves, saved = saves + 1, cfg.train.steps
    finally:
        if progress:
            progress.close()
    if cfg.log.trace:
        write_trace(cfg.log.trace, world, traced, trainer.topo.name)
    elapsed = time.perf_counter() - start
    # one small gather per run (after the timing): every rank's peak RSS for the summary line
    rss = gather_to_root(world, peak_rss_bytes(), 0)
    steps = len(losses)
    return {"steps": steps, "initial_loss": losses[0] if losses else float("nan"),
            "final_loss": losses[-1] if losses else float("nan"),
            "samples_per_s": steps * trainer.global_batch / elapsed if elapsed > 0 else 0.0,
            "elapsed_s": elapsed, "checkpoints": saves, "checkpoint_s": save_s, "skipped": skipped,
            "stopped": stopped, "saved_step": saved, "peak_rss_bytes_by_rank": rss, "eval": last_eval}


def tp_trace_events(tp: Any, name: str = "tp allreduce") -> list[tuple[str, float, float]]:
    """The tp (or ep) collectives of the last step as trace events (name, start, end[, cpu]); [] without them or
    tracing."""
    if tp is None or tp.events is None:
        return []
    events, tp.events = [(name, *event) for event in tp.events], []
    return events


def write_trace(path: str, world: Comm, events_by_step: list[tuple[int, list]], label: str = "") -> None:
    """Gather every rank's timed actions on world rank 0 and write one Chrome-trace JSON file (collective)."""
    from hpcpipe.runtime.comm import gather_to_root
    rank = world.Get_rank()
    parts = gather_to_root(world, (rank, label or f"rank {rank}", rank_events(events_by_step, rank)), 0)
    if parts is not None:
        try:
            write_json(path, training_trace(parts), "trace", "log.trace")
        except (OSError, HpcpipeError) as exc:   # the run is done and saved: a lost trace is not worth failing for
            print(f"hpcpipe: warning: trace not written: {exc}", file=sys.stderr, flush=True)


def timed_save(trainer: Any, step: int) -> float:
    """Save a checkpoint of `step` completed steps; return the seconds it took (collective)."""
    t0 = time.perf_counter()
    trainer.save_checkpoint(step)
    return time.perf_counter() - t0
