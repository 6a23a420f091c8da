"""dtk: a DTensor-first SPMD training toolkit for TensorFlow and tf_keras (Keras 2).

Importing dtk first puts DTensor's parity-safe settings in force (see ``dtk/_env.py``): they must
be set before TensorFlow traces anything, so dtk sets them here, before TensorFlow is imported.

The package face is lazy: ``import dtk`` loads only the standard library, and each public name
imports its module (and TensorFlow) on first use. So ``python -m dtk.launch``, which needs no
TensorFlow, starts in milliseconds, and ``import dtk`` before ``import tensorflow`` is cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dtk import _env
from dtk._version import __version__

_env.apply_safe_defaults()

# public name -> module that defines it
_EXPORTS = {
    "BATCH_AXIS": "dtk.mesh",
    "MODEL_AXIS": "dtk.mesh",
    "MeshSpec": "dtk.mesh",
    "build_mesh": "dtk.mesh",
    "configure_virtual_cpus": "dtk.mesh",
    "describe_mesh": "dtk.mesh",
    "parse_mesh_spec": "dtk.mesh",
    "Batch": "dtk.input",
    "ClientShard": "dtk.input",
    "DataSource": "dtk.input",
    "DistributedDataset": "dtk.input",
    "InputConfig": "dtk.input",
    "pack": "dtk.input",
    "load_mnist": "dtk.mnist",
    "LayoutTable": "dtk.layouts",
    "build_model": "dtk.layouts",
    "explain": "dtk.layouts",
    "load_table": "dtk.layouts",
    "plan_layouts": "dtk.layouts",
    "Checkpointer": "dtk.checkpoint",
    "export": "dtk.checkpoint",
    "gather_weights": "dtk.checkpoint",
    "global_value": "dtk.checkpoint",
    "make_loss": "dtk.optimizers",
    "make_metrics": "dtk.optimizers",
    "make_optimizer": "dtk.optimizers",
    "StepConfig": "dtk.steps",
    "Steps": "dtk.steps",
    "History": "dtk.trainer",
    "Trainer": "dtk.trainer",
    "TrainerConfig": "dtk.trainer",
    "ModelSpec": "dtk.models",
    "Plan": "dtk.planner",
    "PlanError": "dtk.planner",
    "plan": "dtk.planner",
}
_SUBMODULES = ("checkpoint", "cluster", "fsdp", "input", "launch", "layouts", "mesh", "mnist",
               "models", "optimizers", "planner", "remat", "steps", "trainer")

__all__ = ["__version__", *sorted(_EXPORTS), "models"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"dtk.{name}")
    raise AttributeError(f"module 'dtk' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))


if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load lazily
    from dtk import models  # noqa: F401
    from dtk.checkpoint import Checkpointer, export, gather_weights, global_value  # noqa: F401
    from dtk.input import (Batch, ClientShard, DataSource, DistributedDataset,  # noqa: F401
                           InputConfig, pack)
    from dtk.layouts import (LayoutTable, build_model, explain, load_table,  # noqa: F401
                             plan_layouts)
    from dtk.mesh import (BATCH_AXIS, MODEL_AXIS, MeshSpec, build_mesh,  # noqa: F401
                          configure_virtual_cpus, describe_mesh, parse_mesh_spec)
    from dtk.mnist import load_mnist  # noqa: F401
    from dtk.models import ModelSpec  # noqa: F401
    from dtk.optimizers import make_loss, make_metrics, make_optimizer  # noqa: F401
    from dtk.planner import Plan, PlanError, plan  # noqa: F401
    from dtk.steps import StepConfig, Steps  # noqa: F401
    from dtk.trainer import History, Trainer, TrainerConfig  # noqa: F401
