"""Exception types that the command-line front ends turn into one clear message."""


class HpcpipeError(Exception):
    """Base class of errors that carry a message meant for the user."""


class ConfigError(HpcpipeError):
    """The configuration, command line or an input file is invalid; raised before any collective."""


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
