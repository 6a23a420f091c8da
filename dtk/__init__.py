"""dtk: a DTensor-first SPMD training toolkit for TensorFlow and tf_keras (Keras 2).

Importing dtk first puts DTensor's parity-safe settings in force (see ``dtk/_env.py``): they must
be set before TensorFlow traces anything, so dtk sets them here, before TensorFlow is imported.

The package face is lazy: ``import dtk`` loads only the standard library, and each public name
imports its module (and TensorFlow) on first use. So ``python -m dtk.cluster.launch``, which needs no
TensorFlow, starts in milliseconds, and ``import dtk`` before ``import tensorflow`` is cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dtk import _env, _import_hooks, _moved
from dtk._version import __version__

_env.apply_safe_defaults()
_env.apply_library_log_defaults()
_moved.install()  # the old module paths (dtk.launch, ...): one import hook, no files


def _bind_custom_loop_metrics(metrics_utils) -> None:
    from dtk.train import custom_loops  # TensorFlow is loaded by now (tf_keras imports it)
    custom_loops.install_metric_hook(metrics_utils)


# A custom training loop's own metric objects are moved onto the mesh at their first update on it
# (dtk.train.custom_loops); tf_keras wraps update_state when a metric is made, so dtk's wrapper
# goes in as tf_keras loads.
_import_hooks.when_imported("tf_keras.src.utils.metrics_utils", _bind_custom_loop_metrics)

# public name -> module that defines it
_EXPORTS = {
    "BATCH_AXIS": "dtk.parallel.mesh",
    "MODEL_AXIS": "dtk.parallel.mesh",
    "MeshSpec": "dtk.parallel.mesh",
    "build_mesh": "dtk.parallel.mesh",
    "configure_virtual_cpus": "dtk.parallel.mesh",
    "describe_mesh": "dtk.parallel.mesh",
    "parse_mesh_spec": "dtk.parallel.mesh",
    "Batch": "dtk.data.input",
    "ClientShard": "dtk.data.input",
    "DataSource": "dtk.data.input",
    "DistributedDataset": "dtk.data.input",
    "InputConfig": "dtk.data.input",
    "pack": "dtk.data.input",
    "load_mnist": "dtk.data.mnist",
    "LayoutTable": "dtk.parallel.layouts",
    "build_model": "dtk.parallel.layouts",
    "explain": "dtk.train.keras3",
    "load_table": "dtk.parallel.layouts",
    "plan_layouts": "dtk.parallel.layouts",
    "Checkpointer": "dtk.train.checkpoint",
    "export": "dtk.train.checkpoint",
    "gather_weights": "dtk.train.checkpoint",
    "global_value": "dtk.train.checkpoint",
    "make_loss": "dtk.train.optimizers",
    "make_metrics": "dtk.train.optimizers",
    "make_optimizer": "dtk.train.optimizers",
    "StepConfig": "dtk.train.steps",
    "Steps": "dtk.train.steps",
    "distribute": "dtk.train.distribute",
    "CheckpointCallback": "dtk.train.callbacks",
    "MaxSteps": "dtk.train.callbacks",
    "ProgressCallback": "dtk.train.progress",
    "Preempted": "dtk.train.preemption",
    "enable_keras_distribution": "dtk.train.keras3",
    "batches_on_mesh": "dtk.train.keras3",
    "layout_map": "dtk.train.keras3",
    "History": "dtk.train.trainer",
    "Trainer": "dtk.train.trainer",
    "TrainerConfig": "dtk.train.trainer",
    "ModelSpec": "dtk.models",
    "Plan": "dtk.planning.planner",
    "PlanError": "dtk.planning.planner",
    "plan": "dtk.planning.planner",
}
# Modules reachable as attributes of the package (``dtk.layouts.explain``), wherever they live.
# dtk's folders (parallel/, train/, data/, cluster/, planning/) are imported by their full names.
_SUBMODULES = {
    "checkpoint": "dtk.train.checkpoint",
    "fsdp": "dtk.parallel.fsdp",
    "input": "dtk.data.input",
    "launch": "dtk.cluster.launch",
    "layouts": "dtk.parallel.layouts",
    "mesh": "dtk.parallel.mesh",
    "mnist": "dtk.data.mnist",
    "models": "dtk.models",
    "optimizers": "dtk.train.optimizers",
    "planner": "dtk.planning.planner",
    "ray": "dtk.cluster.ray",
    "remat": "dtk.parallel.remat",
    "steps": "dtk.train.steps",
    "trainer": "dtk.train.trainer",
}

__all__ = ["__version__", *sorted(_EXPORTS), "models"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(_SUBMODULES[name])
    raise AttributeError(f"module 'dtk' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))


if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load lazily
    from dtk import models  # noqa: F401
    from dtk.train.checkpoint import Checkpointer, export, gather_weights, global_value  # noqa: F401
    from dtk.data.input import (Batch, ClientShard, DataSource, DistributedDataset,  # noqa: F401
                                InputConfig, pack)
    from dtk.parallel.layouts import (LayoutTable, build_model, load_table,  # noqa: F401
                                      plan_layouts)
    from dtk.train.keras3 import (batches_on_mesh, enable_keras_distribution,  # noqa: F401
                                  explain, layout_map)
    from dtk.parallel.mesh import (BATCH_AXIS, MODEL_AXIS, MeshSpec, build_mesh,  # noqa: F401
                                   configure_virtual_cpus, describe_mesh, parse_mesh_spec)
    from dtk.data.mnist import load_mnist  # noqa: F401
    from dtk.models import ModelSpec  # noqa: F401
    from dtk.train.optimizers import make_loss, make_metrics, make_optimizer  # noqa: F401
    from dtk.planning.planner import Plan, PlanError, plan  # noqa: F401
    from dtk.train.steps import StepConfig, Steps  # noqa: F401
    from dtk.train.callbacks import CheckpointCallback, MaxSteps  # noqa: F401
    from dtk.train.progress import ProgressCallback  # noqa: F401
    from dtk.train.distribute import distribute  # noqa: F401
    from dtk.train.preemption import Preempted  # noqa: F401
    from dtk.train.trainer import History, Trainer, TrainerConfig  # noqa: F401
