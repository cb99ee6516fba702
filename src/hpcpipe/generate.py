"""``python -m hpcpipe.generate`` and the ``hpcpipe-generate`` console script: text from a GPT (see serve/)."""

import sys


def script() -> int:
    """Run the generate command; return its exit status."""
    from hpcpipe.serve.generate_command import main

    return main()


if __name__ == "__main__":
    sys.exit(script())
