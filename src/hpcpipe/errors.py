"""Exception types that the command-line front ends turn into one clear message, and every exit status."""

# Exit statuses (documented in README.md and docs/cluster.md; keep the tables in step).
EXIT_OK = 0
EXIT_FAILURE = 1          # a rank failed; the job was aborted
EXIT_CONFIG = 2           # bad configuration or input; nothing ran
EXIT_PREEMPTED = 75       # EX_TEMPFAIL: stopped by SIGUSR1/SIGTERM, checkpoint written, resume/requeue me
EXIT_STALLED = 76         # the watchdog saw no progress for run.stall_timeout seconds; stacks dumped, job aborted
EXIT_DIVERGED = 77        # train.max_bad_steps steps in a row had a non-finite loss or gradient
EXIT_INTERRUPTED = 130    # SIGINT (Ctrl-C): stopped at once, no checkpoint (128 + SIGINT)
EXIT_BROKEN_PIPE = 141    # 128 + SIGPIPE: the reader of stdout left (`| head`), as a shell tool reports it



class HpcpipeError(Exception):
    """Base class of errors that carry a message meant for the user."""


class ConfigError(HpcpipeError):
    """The configuration, command line or an input file is invalid; raised before any collective."""


class UsageError(ConfigError):
    """Input that is fine but not what the command takes (a PEFT adapter given as a model): exit 2 even where a
    bad input file exits 1 (``python -m hpcpipe.checkpoint``)."""


class ScheduleError(HpcpipeError):
    """A schedule or its lowered program is malformed or would deadlock."""


class AgreedError(HpcpipeError):
    """An error every rank raises together after agreeing on it (no rank is left waiting).

    The front end prints it once (rank 0) and exits with ``code`` on every
    rank, without MPI_Abort. ``code`` is 2 for bad input (a corrupt or
    mismatched checkpoint) and 1 for a failure while running (a failed save).
    """

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


class DataError(HpcpipeError):
    """An input file changed or became unreadable while running (exit 1: the job is aborted, the file named)."""
