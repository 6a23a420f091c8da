"""The module paths dtk had before its folders (``dtk.launch``, ``dtk.layouts``, ...): each
still imports, for this release, as the module it became, with a ``DeprecationWarning`` that
names the new path.

One import hook, no files: ``import dtk`` puts ``_Finder`` on ``sys.meta_path``, which answers
for the old names only (``MOVED``). Imported, an old name is the new module itself in
``sys.modules``, so ``from dtk.layouts import explain``, ``dtk.ray.DTensorTrainer`` and
``python -m dtk.launch`` behave as the new paths do.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import runpy
import sys
import warnings
from types import ModuleType

# old module path -> new module path (dtk/ in folders, style.md)
MOVED = {
    "dtk.checkpoint": "dtk.train.checkpoint",
    "dtk.fsdp": "dtk.parallel.fsdp",
    "dtk.input": "dtk.data.input",
    "dtk.launch": "dtk.cluster.launch",
    "dtk.layouts": "dtk.parallel.layouts",
    "dtk.materialize": "dtk.parallel.materialize",
    "dtk.mesh": "dtk.parallel.mesh",
    "dtk.mnist": "dtk.data.mnist",
    "dtk.op_support": "dtk.parallel.ops",
    "dtk.optimizers": "dtk.train.optimizers",
    "dtk.planner": "dtk.planning.planner",
    "dtk.randomness": "dtk.parallel.randomness",
    "dtk.ray": "dtk.cluster.ray",
    "dtk.remat": "dtk.parallel.remat",
    "dtk.resume": "dtk.train.resume",
    "dtk.steps": "dtk.train.steps",
    "dtk.text": "dtk.data.text",
    "dtk.trainer": "dtk.train.trainer",
}
# ``dtk.cluster`` was the module ``dtk.cluster.env`` is now; its names are reached through the
# package ``dtk.cluster`` (its ``__getattr__``).
CLUSTER_MODULE = "dtk.cluster.env"


def message(old: str, new: str) -> str:
    return f"{old} moved to {new}; import {new} instead ({old} goes in the next release)"


def run_as_main(old: str) -> None:
    """``python -m old``: says so on stderr and runs the new module as ``__main__``."""
    new = MOVED[old]
    print(f"warning: python -m {old} moved to python -m {new} (the old path goes in the next "
          "release)", file=sys.stderr, flush=True)
    runpy.run_module(new, run_name="__main__", alter_sys=True)


class _Loader(importlib.abc.Loader):
    """Loads an old path as its new module (warning once per import of the old name)."""

    def __init__(self, old: str):
        self.old = old
        self._spec = None

    def create_module(self, spec) -> ModuleType:
        new = MOVED[self.old]
        warnings.warn(message(self.old, new), DeprecationWarning, stacklevel=4)
        module = importlib.import_module(new)
        self._spec = module.__spec__  # importlib sets the old spec on it next: put back below
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._spec  # the module keeps its own name, file and spec

    def get_code(self, fullname: str):  # runpy: python -m <old path>
        return compile(f"from dtk import _moved\n_moved.run_as_main({fullname!r})\n",
                       f"<{fullname}: moved to {MOVED[fullname]}>", "exec")

    def is_package(self, fullname: str) -> bool:  # pylint: disable=unused-argument
        return False


class _Finder(importlib.abc.MetaPathFinder):
    """Answers ``find_spec`` for the old paths in ``MOVED``; None for every other name."""

    def find_spec(self, fullname, path=None, target=None):  # pylint: disable=unused-argument
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, _Loader(fullname),
                                               origin=f"moved to {MOVED[fullname]}")


def install() -> None:
    """Puts the finder on ``sys.meta_path`` once (``import dtk`` calls it)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
