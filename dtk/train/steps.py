"""One compiled call at a time: Keras's own train, test and predict functions of a laid-out
model, called on batches already packed on the mesh.

dtk has one training step, Keras's (``dtk.distribute``). ``Steps`` is what
``Model.train_on_batch`` is for host arrays, for batches packed on the mesh
(``dtk.data.input.pack``, a ``DistributedDataset``'s ``Batch``): it gives the model the options
and seams ``dtk.Trainer`` gives it (``dtk.train.distribute.prepare``: remat, the sharded update,
sparse tables, gradient accumulation), compiles it with the loss, optimizer and metrics (dtk's
names: a named loss is on logits), and calls Keras's compiled functions. Code that times a
step (the planner's calibration, ``scripts/bench*.py``) or drives steps one by one uses it; a
training run uses ``model.fit`` (``dtk.distribute``, ``dtk.Trainer``).

Until 0.3 ``Steps`` compiled a step of its own (its loss normalization, metrics, sharded update
and accumulation); that step is gone, and with it its differences from Keras's: a call's loss
is Keras's (the mean over the batch's rows, weighted by the sample weights a batch of
``(features, labels, weights, examples)`` carries), and the padding rows of a padded batch
count as examples (Keras's ``evaluate`` on a ``DistributedDataset`` counts every example
once, with no padding).

Example::

    steps = dtk.Steps(model, loss="sparse_categorical_crossentropy",
                      optimizer=dtk.make_optimizer("adam", mesh), metrics=["accuracy"], mesh=mesh)
    loss = steps.train(batch)        # one call; returns its loss (a DTensor scalar)
    print(steps.results())           # {'loss': ..., 'accuracy': ...}
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor

from dtk.parallel.mesh import BATCH_AXIS, as_mesh, check_batch_axis
from dtk.train import distribute as distribute_lib
from dtk.train import keras_data
from dtk.train.optimizers import keras_loss, make_metrics, make_optimizer

_log = logging.getLogger("dtk")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepConfig:
    """How the model is prepared and compiled (``dtk.TrainerConfig`` holds the same options).

    Attributes:
      jit_compile: must stay False: DTensor's SPMD expansion compiles the step, which dtk does
        not combine with XLA (kept so that old configs fail with that reason).
      steps_per_execution: batches per compiled call (Keras's ``compile()`` option); a call
        then takes a stack ``[n, B, ...]`` of them.
      shard_optimizer_state: the ZeRO-style sharded update: True, False or ``"auto"`` (the
        default; ``dtk.train.mesh_optimizer.auto_shard_optimizer_state``).
      batch_axis: the data-parallel mesh axis.
      gradient_accumulation_steps: k > 1 splits each batch into k microbatches, one update
        from the sum of their gradients (``dtk.train.distribute``).
      remat: regular expressions naming layers whose activations are recomputed in the
        backward pass (``dtk.parallel.remat``); () for none.
      sparse_tables: True updates only the rows a step touched of the Embedding tables sharded
        on their rows or columns (``dtk.train.sparse``).
    """

    jit_compile: bool = False
    steps_per_execution: int = 1
    shard_optimizer_state: bool | str = "auto"
    batch_axis: str = BATCH_AXIS
    gradient_accumulation_steps: int = 1
    remat: tuple[str, ...] = ()
    sparse_tables: bool = False

    def __post_init__(self):
        k = self.gradient_accumulation_steps
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"gradient_accumulation_steps must be a positive integer; got {k!r}")
        if isinstance(self.remat, str):
            raise ValueError(f"remat must be a tuple of layer-name patterns, e.g. "
                             f"(r'block\\d+_attn',); got the string {self.remat!r}")
        if self.shard_optimizer_state not in (True, False, "auto"):
            raise ValueError(f"shard_optimizer_state must be True, False or 'auto'; got "
                             f"{self.shard_optimizer_state!r}")
        if not isinstance(self.sparse_tables, bool):
            raise ValueError(f"sparse_tables must be True or False; got {self.sparse_tables!r}")
        if not isinstance(self.steps_per_execution, int) or self.steps_per_execution < 1:
            raise ValueError(f"steps_per_execution must be a positive integer; got "
                             f"{self.steps_per_execution!r}")
        if self.jit_compile:
            raise ValueError("StepConfig(jit_compile=True): a laid-out model's step is compiled "
                             "by DTensor's SPMD expansion, which dtk does not combine with XLA; "
                             "drop jit_compile")


def _keras_data(batch: Any) -> tuple:
    """A packed batch as Keras's step takes it. dtk's batches are ``(features, labels,
    weights[, examples])`` (``dtk.data.input.Batch``): with ``examples`` (data that carries
    sample weights) ``weights`` are the sample weights, given to Keras; without, ``weights``
    only mark the real examples (1.0; 0.0 on padding) and Keras's step counts every row."""
    parts = tuple(batch) + (None,) * (4 - len(tuple(batch)))
    features, labels, weights, examples = parts[:4]
    return (features, labels) if examples is None else (features, labels, weights)


class Steps:
    """Keras's compiled steps of one laid-out model: ``train``, ``evaluate`` and ``predict``.

    Each call runs Keras's compiled function once on its batch (or its stack of
    ``steps_per_execution`` batches), as ``train_on_batch`` does: the metrics are reset before
    a ``train`` call and report that call; ``evaluate`` accumulates until ``reset_metrics``.

    Attributes:
      model: the model, compiled with the loss, optimizer and metrics.
      optimizer: its optimizer, bound to the mesh.
      sparse: the row-sparse update of its tables (``dtk.train.sparse``), or None.
      shard_optimizer_state: whether the sharded update is on.
      remat_layers: the layers that recompute their activations.
    """

    def __init__(self, model: tf_keras.Model, *, loss: Any, optimizer: Any,
                 metrics: Sequence[Any] = (), mesh: dtensor.Mesh,
                 config: StepConfig = StepConfig()):
        mesh = as_mesh(mesh, "mesh")
        check_batch_axis(mesh, config.batch_axis, what="StepConfig.batch_axis")
        self.model, self.mesh, self.config = model, mesh, config
        built_fsdp = distribute_lib.check_own_train_step(
            model, gradient_accumulation_steps=config.gradient_accumulation_steps)
        custom = distribute_lib._overrides(model, "train_step")  # pylint: disable=protected-access
        distribute_lib.prepare(
            model, mesh, remat=tuple(config.remat), fsdp=built_fsdp,
            gradient_accumulation_steps=config.gradient_accumulation_steps,
            shard_optimizer_state=False if custom else config.shard_optimizer_state,
            batch_axis=config.batch_axis, sparse_tables=config.sparse_tables)
        with dtensor.default_mesh(mesh):
            model.compile(optimizer=make_optimizer(optimizer, mesh), loss=keras_loss(loss),
                          metrics=make_metrics(metrics, mesh),
                          steps_per_execution=config.steps_per_execution)
            # Its state exists before the first step, for a checkpoint to restore into.
            model.optimizer.build(model.trainable_variables)
        state = model._dtk_mesh_state  # pylint: disable=protected-access
        self.optimizer = model.optimizer
        self.sparse = state.sparse
        self.shard_optimizer_state = state.sharded is not None
        self.remat_layers = list(state.remat_layers)
        self._functions: dict[str, Any] = {}

    def _function(self, kind: str):
        if kind not in self._functions:
            make = {"train": self.model.make_train_function,
                    "evaluate": self.model.make_test_function,
                    "predict": self.model.make_predict_function}[kind]
            self._functions[kind] = make()
        return self._functions[kind]

    @property
    def trace_counts(self) -> dict[str, int]:
        """How many times each compiled function was traced (one per batch shape)."""
        return {kind: sum(f.traced.experimental_get_tracing_count() +
                          f.traced_many.experimental_get_tracing_count() for f in [
                              getattr(self._functions.get(kind), "calls", None)] if f is not None)
                for kind in ("train", "evaluate", "predict")}

    def train(self, batch, *, stacked: bool | None = None,
              reset_metrics: bool = True) -> tf.Tensor:
        """Runs one compiled call: one step, or ``n`` steps on a stacked ``[n, B, ...]`` batch
        (``stacked``; default: ``config.steps_per_execution > 1``). Returns the call's loss:
        Keras's, the mean over its steps (``reset_metrics=False``: over every step since the
        last reset, as ``fit`` reports it within an epoch)."""
        if stacked is None:
            stacked = self.config.steps_per_execution > 1
        data = _keras_data(batch)
        n = int(tf.nest.flatten(data[1])[0].shape[0]) if stacked else 1
        if reset_metrics:
            self.model.reset_metrics()
        return self._function("train")(keras_data.OneItem((n, data)))["loss"]

    def evaluate(self, batch) -> tf.Tensor:
        """Accumulates loss and metrics over one (unstacked) batch; returns the running loss."""
        return self._function("evaluate")(keras_data.OneItem((1, _keras_data(batch))))["loss"]

    def predict(self, features) -> tf.Tensor:
        """The model's outputs for one (unstacked) batch of features, replicated."""
        return self._function("predict")(keras_data.OneItem((1, (features,))))

    def reset_metrics(self) -> None:
        self.model.reset_metrics()

    def results(self) -> dict[str, float]:
        """The metrics' values as Python floats (this waits for pending steps)."""
        return {name: float(value) for name, value in self.model.get_metrics_result().items()}
