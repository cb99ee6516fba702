"""The command line every hpcpipe command shares: one parser, one error format, a quiet end on a closed pipe.

The command line is parsed before MPI is initialised (importing mpi4py is
slow and a usage error should not need MPI), so :class:`CommandParser`
learns the world rank from the launcher's environment and lets only rank 0
print usage, help and errors; every rank exits with the same status. The
single-process commands (simulate, checkpoint, evaluate, plan) use the same
parser, so every usage error reads ``hpcpipe: error: ...`` and exits 2.
Options declared with ``dash_value=True`` take a value that starts with "-"
(``--memory-per-rank -1GiB`` reaches the command's own check instead of
argparse's "expected one argument"), and ``--print-config`` prints the
effective configuration as TOML (:func:`add_print_config`, :func:`print_config`).
"""

from __future__ import annotations

import argparse
import os
import sys

from hpcpipe.errors import EXIT_BROKEN_PIPE, EXIT_CONFIG
from hpcpipe.runtime.launcher import launcher_rank


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage, help and errors are printed by world rank 0 only.

    Under ``mpiexec -n 8`` every rank parses the same command line; without
    this a typo prints the usage eight times. Errors read ``hpcpipe: error: ...``
    and exit with status 2 on every rank.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)
        self.dash_options: set[str] = set()

    def add_argument(self, *args, dash_value: bool = False, **kwargs):
        """Add an option; ``dash_value=True``: its value may start with "-" (a negative size, say)."""
        action = super().add_argument(*args, **kwargs)
        if dash_value:
            self.dash_options.update(action.option_strings)
        return action

    def parse_known_args(self, args=None, namespace=None):
        """Parse as argparse does, a "-"-led value of a ``dash_value`` option joined to it as ``--option=value``."""
        words = list(sys.argv[1:] if args is None else args)
        joined: list[str] = []
        i = 0
        while i < len(words):
            word = words[i]
            if word == "--":          # what follows is positional, as argparse reads it
                joined.extend(words[i:])
                break
            if word in self.dash_options and i + 1 < len(words) and words[i + 1].startswith("-"):
                joined.append(f"{word}={words[i + 1]}")
                i += 2
                continue
            joined.append(word)
            i += 1
        self.words = joined
        return super().parse_known_args(joined, namespace)

    def _print_message(self, message: str, file=None) -> None:
        if launcher_rank() == 0:
            super()._print_message(message, file)

    def error(self, message: str):
        """Print the usage and one ``hpcpipe: error:`` line (rank 0), then exit 2 (every rank)."""
        self.print_usage(sys.stderr)
        hint = split_value_hint(getattr(self, "words", [])) if message.startswith("unrecognized arguments") else ""
        self.exit(EXIT_CONFIG, f"hpcpipe: error: {message}{hint} (see {self.prog} --help)\n")


def split_value_hint(words: list[str]) -> str:
    """'; quote it whole ...' when the shell split a value at its spaces (--set model.dims=[8, 8]), else ''."""
    def still_open(text: str) -> bool:
        return text.count("[") + text.count("{") > text.count("]") + text.count("}")

    for i, word in enumerate(words):
        if "=" in word and still_open(word):
            for end in range(i + 1, len(words)):
                text = " ".join(words[i:end + 1])
                if not still_open(text):
                    value = text.removeprefix("--set=")
                    return f"; the shell split a value at its spaces: quote it whole, --set '{value}'"
    return ""


def add_print_config(parser: argparse.ArgumentParser) -> None:
    """Add ``--print-config``: print the effective configuration as TOML and exit 0, starting nothing."""
    parser.add_argument("--print-config", action="store_true",
                        help="print the effective configuration (file, --set, defaults) as TOML and exit")


def with_adapter(args: argparse.Namespace) -> argparse.Namespace:
    """``--adapter DIR`` as the override ``model.adapter = DIR`` (generate and serve merge it into --weights)."""
    if getattr(args, "adapter", None):
        import json
        args.overrides.append(f"model.adapter={json.dumps(args.adapter)}")
    return args


def print_config(config_dict: dict, what: str) -> int:
    """Print a configuration as TOML on stdout (world rank 0 only); return exit status 0."""
    from hpcpipe.config_toml import to_toml

    if launcher_rank() == 0:
        print(to_toml(config_dict, f"the effective configuration of {what}"), end="", flush=True)
    return 0


def reader_left() -> int:
    """After a BrokenPipeError on stdout (``| head`` closed it): stop quietly, return 141 as SIGPIPE would."""
    # stdout is pointed at /dev/null so that the interpreter's final flush finds nothing to complain about
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_BROKEN_PIPE
