"""``python -m hpcpipe.serve``."""

import sys

from hpcpipe.serve.command import main

sys.exit(main())
