"""Processes, clients and schedulers: the multi-client environment (``env``), the local launcher
(``launch``, also ``dtk-launch``) and the Ray Train backend (``ray``).

Nothing here imports TensorFlow at module level: the launcher starts in milliseconds.
"""


def __getattr__(name: str):
    """``dtk.cluster.<name>`` from before dtk's folders, when ``dtk.cluster`` was the module ``dtk.cluster.env``
    is now: still found there for this release, with a ``DeprecationWarning`` (``dtk._moved``)."""
    import importlib  # pylint: disable=g-import-not-at-top
    import warnings  # pylint: disable=g-import-not-at-top
    from dtk import _moved  # pylint: disable=g-import-not-at-top
    env = importlib.import_module(_moved.CLUSTER_MODULE)
    if name.startswith("__") or not hasattr(env, name):
        raise AttributeError(f"module 'dtk.cluster' has no attribute {name!r}")
    warnings.warn(_moved.message(f"dtk.cluster.{name}", f"{_moved.CLUSTER_MODULE}.{name}"),
                  DeprecationWarning, stacklevel=2)
    return getattr(env, name)
