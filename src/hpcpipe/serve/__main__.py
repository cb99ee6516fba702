"""``python -m hpcpipe.serve`` and the ``hpcpipe-serve`` console script."""

import sys


def script() -> int:
    """Run the serve command; return its exit status."""
    from hpcpipe.serve.command import main

    return main()


if __name__ == "__main__":
    sys.exit(script())
