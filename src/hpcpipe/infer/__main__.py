"""``python -m hpcpipe.infer``."""

import sys

from hpcpipe.infer.command import main

sys.exit(main())
