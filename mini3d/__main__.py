"""`python -m mini3d`. A SIGINT or SIGTERM that arrives before a command installs its own handlers
(while Python imports torch, seconds; `mini3d train` installs its own, mini3d.run.stop, once its
ranks start) ends the process with 130 / 143 and one line, not a KeyboardInterrupt traceback or a
bare death by the signal: no training job was running, nothing is left to stop."""

import os
import signal
import sys


def _early(signum, frame):
    os.write(2, f"mini3d: stopped by {signal.Signals(signum).name} (no training job was running)\n"
             .encode())
    os._exit(128 + int(signum))


for _s in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_s, _early)

from mini3d.cli import main  # noqa: E402  (after the handlers: importing torch takes seconds)

sys.exit(main())
