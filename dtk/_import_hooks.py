"""Run a function on a module as soon as it is imported, without importing it (or TensorFlow)
now: ``import dtk`` stays cheap, and a seam dtk needs in tf_keras is in place before any user
object that goes through it is made.

Used for the metrics of custom training loops (``dtk.train.custom_loops``): tf_keras wraps each
metric's ``update_state`` when the metric is made, so the wrapper must be dtk's before the user's
first ``keras.metrics.Mean()``, which may come before ``dtk.distribute``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType

_PENDING: dict[str, list[Callable[[ModuleType], None]]] = {}


def when_imported(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Calls ``callback(module)`` right after module ``name`` executes (now, if it has)."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    _PENDING.setdefault(name, []).append(callback)
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):  # pylint: disable=unused-argument
        if fullname not in _PENDING:
            return None
        sys.meta_path.remove(self)  # the real finders find it; this one wraps their loader
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, callbacks = spec.loader, _PENDING.pop(fullname)

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                for callback in callbacks:
                    callback(module)

        spec.loader = _Loader()
        return spec
