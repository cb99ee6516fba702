"""Exception types that the command-line front ends turn into one clear message."""


class HpcpipeError(Exception):
    """Base class of errors that carry a message meant for the user."""


class ConfigError(HpcpipeError):
    """The configuration, command line or an input file is invalid; raised before any collective."""


class ScheduleError(HpcpipeError):
    """A schedule or its lowered program is malformed or would deadlock."""
