"""``python -m hpcpipe.plan``: see :mod:`hpcpipe.plan.command`."""

import sys

from hpcpipe.plan.command import main

sys.exit(main())
