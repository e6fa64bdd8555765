"""Run a script as `python SCRIPT ARGS...` would, but with torch unimportable, as in a Python
environment without it (a login node): for the tests that show a tool needs no torch.
$HIDE_MODULES (comma-separated) hides other packages instead (e.g. tensorboard).

    python tests/no_torch.py collect_results.py runs/study-cpu --out /tmp/results
    HIDE_MODULES=tensorboard python tests/no_torch.py ddp_train.py --tensorboard
"""

from __future__ import annotations

import os
import runpy
import sys


HIDDEN = tuple(os.environ.get("HIDE_MODULES", "torch").split(","))


class NoTorch:
    """An import finder that answers for torch (or HIDDEN) and its submodules: not
    installed."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r} (tests/no_torch.py)", name=name)
        return None  # everything else: the usual finders


sys.meta_path.insert(0, NoTorch())
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # what `python SCRIPT` puts there
runpy.run_path(sys.argv[0], run_name="__main__")
