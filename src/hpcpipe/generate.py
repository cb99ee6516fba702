"""``python -m hpcpipe.generate``: text generation from a trained GPT through the KV-cached pipeline (see serve/)."""

import sys

from hpcpipe.serve.generate_command import main

if __name__ == "__main__":
    sys.exit(main())
