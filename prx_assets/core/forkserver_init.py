"""Imported first in the per-image pool's forkserver (``workers._PRELOAD``), never elsewhere.

Lance warns before every ``fork`` of a process that imported it ("lance is not fork-safe"),
because forking while its runtime threads run can deadlock the child. The forkserver only
imports the stages' modules (Lance among them) and never opens a dataset, so no Lance
thread exists when it forks a worker; each worker starts its own runtime after the fork.
The warning there is therefore noise, printed once per worker on the user's console, and
is silenced in that process only: any other process that forks after using Lance still
warns.
"""

import warnings

warnings.filterwarnings("ignore", message="lance is not fork-safe", category=UserWarning)
