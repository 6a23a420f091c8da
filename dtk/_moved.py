"""The module paths dtk had before its folders (``dtk.launch``, ``dtk.layouts``, ...): each
still imports, for this release, as the module it became, with a ``DeprecationWarning`` that
names the new path.

Each old path is a two-line file (``dtk/launch.py``) that calls ``redirect``: the old name then
is the new module itself in ``sys.modules``, so ``from dtk.layouts import explain``,
``dtk.ray.DTensorTrainer`` and ``python -m dtk.launch`` behave as the new paths do.
"""

from __future__ import annotations

import importlib
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


def redirect(old: str, spec_name: str | None = None) -> ModuleType | None:
    """Makes the module file of ``old`` (a key of ``MOVED``) stand for its new module.

    Imported (``__name__`` is ``old``): warns and puts the new module in ``sys.modules[old]``.
    Run as ``python -m old`` (``__name__`` is ``"__main__"``, ``spec_name`` is ``old``): says so
    on stderr and runs the new module as ``__main__``.
    """
    if old == "__main__":
        old = spec_name or ""
        new = MOVED[old]
        print(f"warning: python -m {old} moved to python -m {new} (the old path goes in the next "
              "release)", file=sys.stderr, flush=True)
        runpy.run_module(new, run_name="__main__", alter_sys=True)
        return None
    new = MOVED[old]
    warnings.warn(message(old, new), DeprecationWarning, stacklevel=3)
    module = importlib.import_module(new)
    sys.modules[old] = module
    return module
