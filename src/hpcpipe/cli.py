"""What every command does around its work: argument parsing helpers, one clear error, abort on failure.

Every rank plans on its own (config, data, checkpoints, profile cache), then
all ranks agree in one small exchange: if planning failed anywhere, the first
failing rank prints its message (naming itself when others planned fine) and
every rank exits with its status (2 for a ConfigError); if the ranks cut the
model differently, nobody trains. Any exception after that may be on one rank
only while the others wait in a collective, so the failing rank prints its
message and calls MPI_Abort, which ends the whole job at once. An
AgreedError is the exception: every rank raised it together after an
agreement (e.g. a corrupt checkpoint), so rank 0 prints it and all exit.

The command line is parsed before MPI is initialised (importing mpi4py is
slow and a usage error should not need MPI), so :class:`CommandParser`
learns the world rank from the launcher's environment and lets only rank 0
print usage, help and errors; every rank exits with the same status.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from hpcpipe.errors import (
    EXIT_BROKEN_PIPE,
    EXIT_CONFIG,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_STALLED,
    AgreedError,
    ConfigError,
    HpcpipeError,
)

# world rank as set by MPICH/Hydra (PMI), Open MPI, PMIx launchers and srun, in that order of trust
PLANNING_TIMEOUT_S = 600.0     # as run.stall_timeout's default: the watchdog starts only after planning
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")


def launcher_rank() -> int:
    """Return this process's world rank from the launcher's environment (0 when not launched by one)."""
    for name in RANK_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return 0


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage, help and errors are printed by world rank 0 only.

    Under ``mpiexec -n 8`` every rank parses the same command line; without
    this a typo prints the usage eight times. Errors read ``hpcpipe: error: ...``
    and exit with status 2 on every rank.
    """

    def _print_message(self, message: str, file=None) -> None:
        if launcher_rank() == 0:
            super()._print_message(message, file)

    def error(self, message: str):
        """Print the usage and one ``hpcpipe: error:`` line (rank 0), then exit 2 (every rank)."""
        self.print_usage(sys.stderr)
        self.exit(EXIT_CONFIG, f"hpcpipe: error: {message} (see {self.prog} --help)\n")


def reader_left() -> int:
    """After a BrokenPipeError on stdout (``| head`` closed it): stop quietly, return 141 as SIGPIPE would."""
    # stdout is pointed at /dev/null so that the interpreter's final flush finds nothing to complain about
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_BROKEN_PIPE


def planning_outcome(every: list[tuple[int, str | None]], rank: int, message: str = "") -> tuple[int, str | None]:
    """Given every rank's (exit code, stage cut) after planning, return (this rank's exit code, what it prints).

    Code 0 means the rank planned; ``message`` is this rank's own error when
    it did not. If any rank failed, every rank exits with the first failing
    rank's code and that rank alone speaks, naming itself when others planned
    fine (the difference is then in its files or environment). If all planned
    but cut the model differently, every rank exits 2 and rank 0 says so:
    training on would run a different model on each rank.
    """
    failed = [r for r, (code, _) in enumerate(every) if code]
    if failed:
        first = failed[0]
        if rank != first:
            return every[first][0], None
        if len(failed) < len(every):
            head, newline, rest = message.partition("\n")
            message = f"{head} (on rank {first}; planning failed on {len(failed)} of {len(every)} ranks){newline}{rest}"
        return every[first][0], message
    cuts = sorted({cut for _, cut in every if cut is not None})
    if len(cuts) > 1:
        return EXIT_CONFIG, (f"hpcpipe: error: the ranks planned different stage cuts ({'; '.join(cuts)}): they "
                             f"read different files (parallel.stage_layers = \"profile\" with another profile on "
                             f"some host or in some HPCPIPE_PROFILE_DIR?); give every rank the same profile, or "
                             f"give parallel.stage_layers as layer counts") if rank == 0 else None
    return 0, None


def _cut_text(planned: Any) -> str | None:
    ranges = getattr(planned, "stage_ranges", None)
    return None if ranges is None else str([len(r) for r in ranges])


def run_planned(world: Any, planner: Callable[[], Any], body: Callable[[Any], int], label: Callable[[], str]) -> int:
    """Run planner (local checks) on every rank, agree on the outcome, then body(plan); one message, right exit."""
    from hpcpipe.runtime.comm import Poller, gather_everyone

    rank = world.Get_rank()
    failure: tuple[int, str] = (0, "")
    try:
        try:
            planned = planner()
        except ConfigError as exc:
            failure = (EXIT_CONFIG, f"hpcpipe: error: {exc}")
        except Exception as exc:  # noqa: BLE001 - planning failed on this rank: agreed on below, reported once
            failure = (EXIT_FAILURE, f"hpcpipe: error: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        # planning reads files on every rank (config, data, checkpoints, the profile cache); a rank that sees other
        # files must neither leave the others waiting in the first collective nor train another cut of the model
        mine = (failure[0], None if failure[0] else _cut_text(planned))
        every = gather_everyone(world, Poller(), mine, PLANNING_TIMEOUT_S)
    except KeyboardInterrupt:   # the others wait for this rank in the planning agreement: end the job now
        print(f"hpcpipe: [{label()}] interrupted (SIGINT) while planning; ending the job "
              f"(exit status {EXIT_INTERRUPTED})", file=sys.stderr, flush=True)
        if world.Get_size() > 1:
            from hpcpipe.runtime.comm import abort
            abort(world, EXIT_INTERRUPTED)
        return EXIT_INTERRUPTED
    if every is None:     # no watchdog runs yet: a rank stuck reading a file would hang the job for good
        from hpcpipe.runtime.comm import abort
        print(f"hpcpipe: [rank {rank}] error: not every rank finished planning within {PLANNING_TIMEOUT_S:.0f} s "
              f"(one may be stuck reading its config, data, checkpoint or profile from a file system); "
              f"aborting the job", file=sys.stderr, flush=True)
        abort(world, EXIT_STALLED)
        return EXIT_STALLED
    code, text = planning_outcome(every, rank, failure[1])
    if code:
        if text:
            print(text, file=sys.stderr, flush=True)
        return code
    if rank == 0:   # which MPI the job really runs on: a wheel's MPI and the site's are easy to mix up
        from hpcpipe.runtime.comm import library_line
        print(library_line(world), flush=True)
    try:
        return body(planned)
    except AgreedError as exc:   # raised by every rank together: one message, no abort needed
        if rank == 0:
            print(f"hpcpipe: error: {exc}", file=sys.stderr, flush=True)
        return exc.code
    except BaseException as exc:  # noqa: BLE001 - every failure must end the whole job
        if isinstance(exc, SystemExit) and not exc.code:
            raise
        name = label()
        if isinstance(exc, KeyboardInterrupt):   # Ctrl-C is no error: say what happens next
            print(f"hpcpipe: [{name}] interrupted (SIGINT); ending the job (exit status {EXIT_INTERRUPTED})",
                  file=sys.stderr, flush=True)
        else:
            detail = "" if isinstance(exc, HpcpipeError) else "\n" + traceback.format_exc()
            print(f"hpcpipe: [{name}] error: {type(exc).__name__}: {exc}{detail}", file=sys.stderr, flush=True)
        code = EXIT_CONFIG if isinstance(exc, ConfigError) else \
            EXIT_INTERRUPTED if isinstance(exc, KeyboardInterrupt) else EXIT_FAILURE
        if world.Get_size() > 1:
            from hpcpipe.runtime.comm import abort
            abort(world, code)
        return code


def _script(command: str) -> int:
    """Run an MPI command's main with the stop handlers installed first, as its ``python -m`` form does.

    A console script imports its target's module before calling it: pointed at the command module, it
    installed the SIGUSR1/SIGTERM handlers only after NumPy, h5py and mpi4py had loaded, and a batch
    system's signal during start-up killed the rank (exit 15 instead of the stop contract's 75).
    """
    from hpcpipe.runtime.stopsignal import StopSignals
    stop = StopSignals().install()
    if command == "train":
        from hpcpipe.train.command import main
    else:
        from hpcpipe.infer.command import main
    return main(stop=stop)


def train_script() -> int:
    """``hpcpipe-train``: the same as ``python -m hpcpipe.train``."""
    return _script("train")


def infer_script() -> int:
    """``hpcpipe-infer``: the same as ``python -m hpcpipe.infer``."""
    return _script("infer")
