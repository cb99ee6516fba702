"""``python -m hpcpipe.infer``: the stop handlers are installed by this file's first statement (see command.py)."""

from hpcpipe.runtime.stopsignal import StopSignals

EARLY_STOP = StopSignals().install()   # before anything slow is imported, on purpose

import sys  # noqa: E402

from hpcpipe.infer.command import main  # noqa: E402

sys.exit(main(stop=EARLY_STOP))
