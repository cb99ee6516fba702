"""``python -m hpcpipe.train``: the command line, the setup, the run and its summary.

    mpiexec -n 8 python -m hpcpipe.train                  # embedded default: dp=2 x pp=4
    mpiexec -n 8 python -m hpcpipe.train --config configs/default.toml --set train.steps=50 --set parallel.pp=2

Run as ``python -m hpcpipe.train`` or ``hpcpipe-train``, the SIGUSR1/SIGTERM
handlers are installed by :func:`hpcpipe.train.__main__.script` before
anything else is imported; :func:`main` installs them first otherwise. This module never loads NumPy or mpi4py (which
initialises MPI) at import. A stop signal during the slow start-up is thus
only recorded, and every rank learns of it at the first step decision: the
run stops after step 0 with a checkpoint and exit status 75.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from hpcpipe.cli import CommandParser, add_print_config, print_config
from hpcpipe.config import resolve_layout
from hpcpipe.errors import EXIT_CONFIG, EXIT_PREEMPTED, ConfigError
from hpcpipe.runtime.faults import write_pid
from hpcpipe.runtime.job import run_job
from hpcpipe.runtime.launcher import launcher_rank, launcher_size
from hpcpipe.runtime.signals import StopSignals
from hpcpipe.runtime.stop_marker import write_stop_marker
from hpcpipe.runtime.watchdog import Watchdog
from hpcpipe.train.loop import train

DESCRIPTION = """Train an MLP, a GPT, a Llama-family model or a mixture of experts (model.kind: mlp, gpt, llama,
moe) with pipeline (pp) x data (dp) x tensor (tp) parallelism over MPI. Run under mpiexec/srun; world size must
equal dp x pp x tp (parallel.tp, default 1, splits every stage's layers over tp ranks: attention by heads, the
MLP by columns, the vocabulary; parallel.ep spreads a moe model's experts over that many dp replicas).
Without --config the embedded default runs: dp=2 x pp=4 on 8 ranks, synthetic data."""


EPILOG = """examples:
  mpiexec -n 8 python -m hpcpipe.train
  mpiexec -n 4 python -m hpcpipe.train --config configs/example6.toml
  mpiexec -n 8 python -m hpcpipe.train --set train.steps=50 --set parallel.pp=2
  mpiexec -n 8 python -m hpcpipe.train --config configs/gpt-text.toml --set parallel.pp=2 --set parallel.tp=2
  mpiexec -n 8 python -m hpcpipe.train --set checkpoint.every=10 --resume   # continue the newest run in checkpoints/

exit status: 0 success, 1 a rank failed (the job is aborted), 2 bad configuration or input,
  75 stopped by SIGUSR1/SIGTERM after writing a checkpoint (resume with --resume),
  76 the watchdog saw no progress for run.stall_timeout seconds (stacks dumped, job aborted),
  77 train.max_bad_steps steps in a row had a non-finite loss or gradient, 130 interrupted (SIGINT).
  See docs/cluster.md."""


def synthetic_data_warning(config: Any) -> str:
    """What to say when a pretrained decoder (model.init) trains on synthetic tokens (no data.path): random ids
    teach it nothing and its checkpoint is saved as if it had learned ('' otherwise; the embedded MLP default and a
    decoder trained from scratch, a benchmark's way, run on synthetic data on purpose)."""
    if config.data.path or not config.model.init or config.model.kind == "mlp":
        return ""
    from hpcpipe.state.hf_source import is_hf_directory
    how = config.model.init if is_hf_directory(config.model.init) else "as the model's"
    return (f"data.path is empty: model.init {config.model.init!r} trains on synthetic random tokens, which teach "
            f"it nothing; set data.path to a token file (python examples/text_to_hdf5.py TEXT --tokenizer {how})")


def small_data_warning(p: Any) -> str:
    """What to say when the training set is smaller than one global batch: every step repeats samples in its batch
    (the stream wraps around into the next epoch), so the steps see fewer distinct samples than they count."""
    tr, where = p.config.train, (f"data.path {p.config.data.path!r} holds" if p.config.data.path
                                 else "data.synthetic_samples is")
    batch = p.dp * tr.micro_batches * tr.micro_batch_size
    if not 0 < p.samples < batch:
        return ""
    return (f"{where} {p.samples} samples, fewer than one global batch (dp x train.micro_batches x "
            f"train.micro_batch_size = {p.dp} x {tr.micro_batches} x {tr.micro_batch_size} = {batch}): every step "
            f"repeats samples within its batch")


def zero_warning(p: Any) -> str:
    """What to say when train.zero = 1 runs with one replica: the one replica holds the whole state anyway."""
    if not p.config.train.zero or p.dp > 1:
        return ""
    return ("train.zero = 1 with dp = 1: ZeRO-1 shards the optimizer state over data-parallel replicas, and this "
            "layout has one, which holds all of it (run with more replicas, or leave train.zero = 0)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line."""
    parser = CommandParser(prog="python -m hpcpipe.train", description=DESCRIPTION, epilog=EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="FILE", help="TOML config file (default: the embedded default)")
    parser.add_argument("--set", dest="overrides", metavar="SECTION.KEY=VALUE", action="append", default=[],
                        help="override one config key (TOML value syntax); repeatable")
    parser.add_argument("--resume", action="store_true",
                        help="continue from checkpoint.dir/latest, the newest checkpoint any run saved there, in "
                             "that run's directory (same as --set checkpoint.resume=true), under that run's saved "
                             "config with --config's and --set's keys on top; without it a run saves into a new "
                             "checkpoint.dir/run-NNNN")
    add_print_config(parser)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.resume:
        args.overrides.append("checkpoint.resume=true")
    return args


def ranks_needed(config: Any) -> int:
    """The fewest ranks the configured layout runs on (dp x pp x tp, an "auto" axis counted as 1)."""
    par = config.parallel
    dp = par.dp if isinstance(par.dp, int) else 1
    pp = par.pp if isinstance(par.pp, int) else 1
    return dp * pp * par.tp


def launcher_hint(config: Any, world_size: int, argv: list[str]) -> None:
    """Raise ConfigError, one line, when a process started without mpiexec cannot run the layout alone."""
    needed = ranks_needed(config)
    if world_size != 1 or launcher_size() or needed <= 1:
        return
    command = shlex.join(["mpiexec", "-n", str(needed), "python", "-m", "hpcpipe.train", *argv])
    par = config.parallel
    layout = f"parallel.dp = {par.dp!r}, parallel.pp = {par.pp!r}" + (f", parallel.tp = {par.tp}" if par.tp > 1 else "")
    raise ConfigError(f"this process runs alone (started without mpiexec, world size 1), and the layout "
                      f"({layout}) needs {needed} ranks or a multiple: run it under {command}")


def rss_text(by_rank: list[int] | None) -> str:
    """Return ', peak RSS <X> MiB per rank (max)' for the summary line ('' when not measured)."""
    return f", peak RSS {max(by_rank) / 2**20:.0f} MiB per rank (max)" if by_rank else ""


def report(p: Any, trainer: Any, summary: dict[str, Any]) -> None:
    """Print rank 0's end-of-run lines: what was trained, skipped, saved, and why it stopped early."""
    c = p.config
    resumed = f" (resumed at step {trainer.start_step})" if trainer.start_step else ""
    # no step, no loss: "loss nan -> nan" read as a diverged run
    losses = f"loss {summary['initial_loss']:.6g} -> {summary['final_loss']:.6g}" if summary["steps"] else \
        "no loss (no step ran)"
    print(f"hpcpipe: trained {summary['steps']} steps{resumed}, {losses}, {summary['samples_per_s']:.0f} samples/s "
          f"(dp={p.dp} pp={p.pp}{f' tp={c.parallel.tp}' if c.parallel.tp > 1 else ''} schedule={c.parallel.schedule} "
          f"stage_layers={[len(r) for r in p.stage_ranges]} "
          f"micro_batches={c.train.micro_batches}x{c.train.micro_batch_size}, "
          f"{summary['elapsed_s']:.2f} s){rss_text(summary.get('peak_rss_bytes_by_rank'))}", flush=True)
    if summary.get("eval"):
        held = summary["eval"]
        ppl = f" (perplexity {held['eval_perplexity']:.4g})" if "eval_perplexity" in held else ""
        print(f"hpcpipe: held-out loss {held['eval_loss']:.6g}{ppl} over data.eval_path {c.data.eval_path!r}",
              flush=True)
    if summary["skipped"]:
        print(f"hpcpipe: {summary['skipped']} step(s) skipped for a non-finite loss or gradient", flush=True)
    if summary["checkpoints"]:
        print(f"hpcpipe: {summary['checkpoints']} checkpoint(s) to {str(trainer.run_dir)!r} in "
              f"{summary['checkpoint_s']:.2f} s (latest: step {summary['saved_step']})", flush=True)
    if summary["stopped"]:
        where = (f"checkpoint of step {summary['saved_step']} in {str(trainer.run_dir)!r}" if trainer.run_dir
                 else "no checkpoint (checkpoint.dir is empty)")
        print(f"hpcpipe: stopped for {summary['stopped']} after step {trainer.start_step + summary['steps']} "
              f"of {c.train.steps}: {where}; exit status {EXIT_PREEMPTED} (continue with --resume)", flush=True)


def main(argv: list[str] | None = None, stop: StopSignals | None = None) -> int:
    """Entry point of ``python -m hpcpipe.train`` (``stop``: its early handlers); returns the exit status."""
    # Handlers first, before MPI and NumPy load: a signal during start-up, the setup or a resume
    # load is only recorded, and every rank learns of it at the first step decision.
    stop = stop or StopSignals().install()
    try:
        write_pid(launcher_rank())
        args = parse_args(argv)
        if args.print_config:
            return _print_config(args)
        return _main(args, stop)
    finally:
        stop.ignore()   # not restored: a second signal while the ranks shut down must not kill one


def run_layout(config: Any, world_size: int, resumed: bool) -> tuple[int, int]:
    """Return the run's (dp, pp), resolved once; a resumed run's layout that does not fit the world is one
    ConfigError line saying where the layout came from."""
    try:
        return resolve_layout(config, world_size)
    except ConfigError as exc:
        if not resumed:
            raise
        raise ConfigError(f"{exc} (resuming: the layout is the run's saved one where the command line does not give "
                          f"it; --set parallel.pp=N on the command line reshards the checkpoint)") from None


def _print_config(args: argparse.Namespace) -> int:
    """``--print-config``: the effective configuration (a resumed run's too) as TOML, without starting MPI."""
    from hpcpipe.train.setup import load_run_config

    try:
        config = load_run_config(args.config, args.overrides)
    except ConfigError as exc:
        if launcher_rank() == 0:
            print(f"hpcpipe: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    return print_config(config.to_dict(), "python -m hpcpipe.train")


def _main(args: argparse.Namespace, stop: StopSignals) -> int:
    import warnings

    from mpi4py import MPI

    # a diverging step's NumPy "overflow encountered in matmul" named a line of nn/core as if it had failed; every
    # non-finite step is found, skipped on every rank and said on the progress line (max_bad_steps: exit 77)
    warnings.filterwarnings("ignore", r"(overflow|invalid value|divide by zero) encountered", RuntimeWarning)

    from hpcpipe.train.setup import load_run_config, prepare
    from hpcpipe.train.trainer import Trainer

    world = MPI.COMM_WORLD
    holder: dict[str, Any] = {}
    notes: list[str] = []

    def setup():
        config = load_run_config(args.config, args.overrides, notes)
        launcher_hint(config, world.Get_size(), args.argv)
        layout = run_layout(config, world.Get_size(), resumed=bool(notes))   # notes: a resumed run's config
        return prepare(config, world.Get_size(), layout)

    def body(p) -> int:
        if world.Get_rank() == 0:
            for note in notes:       # which config a resumed run continues under
                print(note, file=sys.stderr, flush=True)
            from hpcpipe.train.lr_schedule import schedule_warning
            for warning in (schedule_warning(p.config.train), synthetic_data_warning(p.config), small_data_warning(p),
                            zero_warning(p)):
                if warning:
                    print(f"hpcpipe: warning: {warning}", file=sys.stderr, flush=True)
        if p.resume is not None and p.resume.step >= p.config.train.steps:
            # a finished run: nothing to train, nothing to save (every rank decides the same from the setup)
            if world.Get_rank() == 0:
                print(f"hpcpipe: nothing to do: {str(p.resume.path)!r} is already at train.steps = "
                      f"{p.config.train.steps} (raise train.steps to continue)", flush=True)
            return 0
        from hpcpipe.runtime.comm import abort
        watchdog = Watchdog(p.config.run.stall_timeout, label, lambda code: abort(world, code)).start()
        try:
            trainer = Trainer(p, world, record_events=bool(p.config.log.trace))
            holder["trainer"] = trainer
            summary = train(trainer, world, stop, watchdog)
        finally:
            watchdog.stop()
        if world.Get_rank() == 0:
            report(p, trainer, summary)
            if summary["stopped"]:   # the batch script's proof of exit 75, whatever the launcher returns
                write_stop_marker(summary["saved_step"] if p.config.checkpoint.dir else None, summary["stopped"],
                                  p.config.checkpoint.dir)
        trainer.close()
        return EXIT_PREEMPTED if summary["stopped"] else 0

    def label() -> str:
        trainer = holder.get("trainer")
        return trainer.topo.name if trainer else f"rank {world.Get_rank()}"

    return run_job(world, setup, body, label)
