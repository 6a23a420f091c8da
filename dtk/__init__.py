"""dtk: a DTensor-first SPMD training toolkit for TensorFlow and tf_keras (Keras 2).

Importing dtk first puts DTensor's parity-safe settings in force (see ``dtk/_env.py``): it must happen
before TensorFlow traces anything, so dtk sets them here, before importing TensorFlow.
"""

from dtk import _env

_env.apply_safe_defaults()

# pylint: disable=g-import-not-at-top,wrong-import-position
from dtk._version import __version__
from dtk import models
from dtk.input import Batch, DistributedDataset, InputConfig, load_mnist, pack
from dtk.layouts import LayoutTable, build_model, explain, load_table, plan_layouts
from dtk.checkpoint import Checkpointer, export, gather_weights, global_value
from dtk.mesh import (
    BATCH_AXIS,
    MODEL_AXIS,
    MeshSpec,
    build_mesh,
    configure_virtual_cpus,
    describe_mesh,
    parse_mesh_spec,
)
from dtk.optimizers import make_loss, make_metrics, make_optimizer
from dtk.steps import StepConfig, Steps
from dtk.trainer import History, Trainer, TrainerConfig

__all__ = [
    "__version__",
    "BATCH_AXIS",
    "MODEL_AXIS",
    "Batch",
    "Checkpointer",
    "DistributedDataset",
    "InputConfig",
    "LayoutTable",
    "History",
    "MeshSpec",
    "StepConfig",
    "Steps",
    "Trainer",
    "TrainerConfig",
    "build_mesh",
    "build_model",
    "configure_virtual_cpus",
    "describe_mesh",
    "explain",
    "export",
    "gather_weights",
    "global_value",
    "load_mnist",
    "load_table",
    "make_loss",
    "make_metrics",
    "make_optimizer",
    "models",
    "pack",
    "parse_mesh_spec",
    "plan_layouts",
]
