"""How every MPI command runs: each rank sets up alone, all agree, then the work; one message and the right exit.

Every rank does its setup on its own (config, data, checkpoints, profile
cache), then all ranks agree in one small exchange: if a setup failed
anywhere, the first failing rank prints its message (naming itself when
others succeeded) and every rank exits with its status (2 for a ConfigError);
if the ranks cut the model differently, nobody runs. Any exception after
that may be on one rank only while the others wait in a collective, so the
failing rank prints its message and calls MPI_Abort, which ends the whole
job at once. An AgreedError is the exception: every rank raised it together
after an agreement (e.g. a corrupt checkpoint), so rank 0 prints it and all
exit.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hpcpipe.errors import (
    EXIT_CONFIG,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_STALLED,
    AgreedError,
    ConfigError,
    HpcpipeError,
)

if TYPE_CHECKING:
    from mpi4py.MPI import Comm

SETUP_TIMEOUT_S = 600.0     # as run.stall_timeout's default: the watchdog starts only after the setup


def setup_outcome(every: list[tuple[int, str | None]], rank: int, message: str = "") -> tuple[int, str | None]:
    """Given every rank's (exit code, stage cut) after its setup, return (this rank's exit code, what it prints).

    Code 0 means the rank's setup succeeded; ``message`` is this rank's own
    error when it did not. If any rank failed, every rank exits with the first
    failing rank's code and that rank alone speaks, naming itself when others
    succeeded (the difference is then in its files or environment). If all succeeded
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
            message = f"{head} (on rank {first}; setup failed on {len(failed)} of {len(every)} ranks){newline}{rest}"
        return every[first][0], message
    cuts = sorted({cut for _, cut in every if cut is not None})
    if len(cuts) > 1:
        return EXIT_CONFIG, (f"hpcpipe: error: the ranks chose different stage cuts ({'; '.join(cuts)}): they "
                             f"read different files (parallel.stage_layers = \"profile\" with another profile on "
                             f"some host or in some HPCPIPE_PROFILE_DIR?); give every rank the same profile, or "
                             f"give parallel.stage_layers as layer counts") if rank == 0 else None
    return 0, None


def _cut_text(prepared: Any) -> str | None:
    ranges = getattr(prepared, "stage_ranges", None)
    return None if ranges is None else str([len(r) for r in ranges])


def run_job(world: Comm, setup: Callable[[], Any], body: Callable[[Any], int], label: Callable[[], str]) -> int:
    """Run setup (local checks) on every rank, agree on the outcome, then body(its result); one message, right exit."""
    # comm (mpi4py) is imported here, not at module level: a command parses its arguments before MPI starts
    from hpcpipe.runtime.comm import Poller, abort, gather_everyone
    from hpcpipe.runtime.launcher import launcher_mismatch, launcher_rank
    from hpcpipe.runtime.mpi_probes import library_line

    rank = world.Get_rank()
    mismatch = "" if world.Get_size() > 1 else \
        launcher_mismatch(1, library_line(world).removeprefix("hpcpipe: MPI: "))
    if mismatch:    # every singleton would fail its setup alone with a layout message: say the cause, once
        if launcher_rank() == 0:
            print(f"hpcpipe: error: {mismatch}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    failure: tuple[int, str] = (0, "")
    try:
        try:
            prepared = setup()
        except ConfigError as exc:
            failure = (EXIT_CONFIG, f"hpcpipe: error: {exc}")
        except Exception as exc:  # noqa: BLE001 - setup failed on this rank: agreed on below, reported once
            failure = (EXIT_FAILURE, f"hpcpipe: error: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        # setup reads files on every rank (config, data, checkpoints, the profile cache); a rank that sees other
        # files must neither leave the others waiting in the first collective nor train another cut of the model
        mine = (failure[0], None if failure[0] else _cut_text(prepared))
        every = gather_everyone(world, Poller(), mine, SETUP_TIMEOUT_S)
    except KeyboardInterrupt:   # the others wait for this rank in the setup agreement: end the job now
        print(f"hpcpipe: [{label()}] interrupted (SIGINT) while setting up; ending the job "
              f"(exit status {EXIT_INTERRUPTED})", file=sys.stderr, flush=True)
        if world.Get_size() > 1:
            abort(world, EXIT_INTERRUPTED)
        return EXIT_INTERRUPTED
    if every is None:     # no watchdog runs yet: a rank stuck reading a file would hang the job for good
        print(f"hpcpipe: [rank {rank}] error: not every rank finished its setup within {SETUP_TIMEOUT_S:.0f} s "
              f"(one may be stuck reading its config, data, checkpoint or profile from a file system); "
              f"aborting the job", file=sys.stderr, flush=True)
        abort(world, EXIT_STALLED)
        return EXIT_STALLED
    code, text = setup_outcome(every, rank, failure[1])
    if code:
        if text:
            print(text, file=sys.stderr, flush=True)
        return code
    if rank == 0:   # which MPI the job really runs on: a wheel's MPI and the site's are easy to mix up
        print(library_line(world), flush=True)
    try:
        return body(prepared)
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
            abort(world, code)
        return code
