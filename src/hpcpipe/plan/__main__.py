"""``python -m hpcpipe.plan`` and the ``hpcpipe-plan`` console script: see :mod:`hpcpipe.plan.command`."""

import sys


def script() -> int:
    """Run the planner; return its exit status."""
    from hpcpipe.plan.command import main

    return main()


if __name__ == "__main__":
    sys.exit(script())
