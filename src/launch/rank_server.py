"""Imported once by the rank server (see `forking.start_rank_server`), the process that forks the
ranks `launch` starts: what every rank would otherwise import itself, taking seconds each.

It imports `torch._dynamo` too: a `torch.optim` optimizer imports it on construction, and it
takes about as long as torch itself.
"""

import os
import signal

# The environment its ranks are forked with; each swaps it for the launcher's at launch
# (`forking.take_launcher_environment`), keeping what changed since: what torch's agent set for
# the rank, and (taken before these imports) whatever the imports set.
ENVIRONMENT = dict(os.environ)

from src.runtime.forking import die_with_parent, import_rank_modules  # noqa: E402

import_rank_modules()

# The server dies with the launcher, and its ranks with it (`forking.end_with_launcher`). (By
# itself it would live on while a rank did: each holds its end of the pipe it watches.) Until
# it has run this line, no rank exists and that pipe tells it when the launcher has gone.
die_with_parent()
# A SIGTERM to the whole job (`kill -- -<pgid>`, a scheduler's cancel) asks the ranks to stop
# together and checkpoint (`src/runtime/stopping.py`): the server must outlive it. Its ranks set
# SIGTERM back to the default before they install their own handler.
signal.signal(signal.SIGTERM, signal.SIG_IGN)
