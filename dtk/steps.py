"""Compiled train, eval and predict steps: the inner loop, correct on any mesh by construction.

Every step takes a batch ``(features, labels, weights)`` of DTensors, batch-sharded on the batch
axis, where ``weights`` is 1.0 for a real example and 0.0 for padding (``dtk.input`` pads the last
evaluation batch). The loss is normalized by the GLOBAL number of real examples::

    loss = sum_i(w_i * l_i) / sum_i(w_i)          (sums over the whole global batch)

so it does not depend on how the batch is split over devices, and equals the Keras
``SUM_OVER_BATCH_SIZE`` mean on an unpadded batch. DTensor inserts the all-reduces for the sums and
for the gradients of replicated weights.

Several steps per call (``steps_per_execution=N``): the input path stacks N batches into
``[n, B, ...]`` DTensors and one ``tf.function`` runs a ``tf.range`` loop that reads batch ``i`` with
``tf.gather`` (indexing ``x[i]`` fails under DTensor). The updates are bit-identical to N calls of
the one-step function, with less Python and dispatch per step.

Example::

    steps = dtk.steps.build_steps(model, loss="sparse_categorical_crossentropy",
                                  optimizer=dtk.make_optimizer("adam", mesh), metrics=[...],
                                  mesh=mesh)
    logs = steps.train(batch)        # one call; returns the last step's loss (a DTensor scalar)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor

from dtk.optimizers import make_loss, make_metrics, make_optimizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepConfig:
    """How steps are compiled.

    Attributes:
      jit_compile: compile with XLA (works on CPU under DTensor; no speed-up measured there).
      steps_per_execution: batches per compiled call; the input must then be stacked ``[n, B, ...]``.
    """

    jit_compile: bool = False
    steps_per_execution: int = 1

    def __post_init__(self):
        if not isinstance(self.steps_per_execution, int) or self.steps_per_execution < 1:
            raise ValueError(f"steps_per_execution must be a positive integer; got "
                             f"{self.steps_per_execution!r}")


def _scalar_zero(mesh: dtensor.Mesh) -> tf.Tensor:
    return dtensor.call_with_layout(tf.zeros, dtensor.Layout.replicated(mesh, 0), shape=[])


class Steps:
    """The compiled steps of one model: ``train``, ``evaluate`` and ``predict``.

    Metrics (including the running ``loss`` mean, weighted by the number of real examples in each
    batch) accumulate across calls until ``reset_metrics``; read them with ``results()``.

    Attributes:
      trace_counts: how many times each step function was traced (one per input shape).
    """

    def __init__(self, model: tf_keras.Model, *, loss: Any, optimizer: Any,
                 metrics: Sequence[Any] = (), mesh: dtensor.Mesh,
                 config: StepConfig = StepConfig()):
        self.model = model
        self.mesh = mesh
        self.config = config
        self.loss_fn = make_loss(loss)
        self.optimizer = make_optimizer(optimizer, mesh)
        self.metrics = make_metrics(list(metrics), mesh)
        self.loss_metric = tf_keras.metrics.Mean(name="loss", mesh=mesh)
        self.trace_counts = {"train": 0, "evaluate": 0, "predict": 0}
        # Build optimizer slots eagerly so checkpoints can restore them before the first step.
        self.optimizer.build(model.trainable_variables)
        self._train = self._compile(self._train_body, "train", stacked=config.steps_per_execution > 1)
        self._evaluate = self._compile(self._eval_body, "evaluate", stacked=False)
        self._predict = tf.function(self._predict_body, jit_compile=config.jit_compile)

    # -- bodies -----------------------------------------------------------------------------------
    def _weighted_loss(self, labels, predictions, weights):
        per_example = self.loss_fn(labels, predictions)
        per_example = tf.cast(per_example, tf.float32)
        if per_example.shape.rank != 1:
            per_example = tf.reshape(per_example, [tf.shape(per_example)[0], -1])
            per_example = tf.reduce_mean(per_example, axis=1)
        count = tf.reduce_sum(weights)
        return tf.math.divide_no_nan(tf.reduce_sum(per_example * weights), count), count

    def _update_metrics(self, loss, count, labels, predictions, weights):
        self.loss_metric.update_state(loss, sample_weight=count)
        for metric in self.metrics:
            metric.update_state(labels, predictions, sample_weight=weights)

    def _train_body(self, batch):
        features, labels, weights = batch
        with tf.GradientTape() as tape:
            predictions = self.model(features, training=True)
            loss, count = self._weighted_loss(labels, predictions, weights)
            total = loss + tf.add_n(self.model.losses) if self.model.losses else loss
        variables = self.model.trainable_variables
        grads = tape.gradient(total, variables)
        self.optimizer.apply_gradients(zip(grads, variables))
        self._update_metrics(loss, count, labels, predictions, weights)
        return loss

    def _eval_body(self, batch):
        features, labels, weights = batch
        predictions = self.model(features, training=False)
        loss, count = self._weighted_loss(labels, predictions, weights)
        self._update_metrics(loss, count, labels, predictions, weights)
        return loss

    def _predict_body(self, features):
        self.trace_counts["predict"] += 1
        return self.model(features, training=False)

    def _compile(self, body: Callable, name: str, *, stacked: bool) -> Callable:
        mesh = self.mesh

        def one(batch):
            self.trace_counts[name] += 1
            return body(batch)

        def many(stack):
            self.trace_counts[name] += 1
            n = tf.shape(stack[1])[0]
            loss = _scalar_zero(mesh)
            for i in tf.range(n):
                loss = body(tuple(tf.gather(t, i) for t in stack))
            return loss

        return tf.function(many if stacked else one, jit_compile=self.config.jit_compile)

    # -- public -----------------------------------------------------------------------------------
    def train(self, batch) -> tf.Tensor:
        """Runs one compiled call: one step, or ``n`` steps on a stacked ``[n, B, ...]`` batch."""
        return self._train(tuple(batch))

    def evaluate(self, batch) -> tf.Tensor:
        """Accumulates loss and metrics over one (unstacked) batch; updates nothing else."""
        return self._evaluate(tuple(batch))

    def predict(self, features) -> tf.Tensor:
        """The model's outputs for one (unstacked) batch of features, batch-sharded."""
        return self._predict(features)

    def reset_metrics(self) -> None:
        for metric in [self.loss_metric, *self.metrics]:
            metric.reset_state()

    def results(self) -> dict[str, float]:
        """Current metric values as Python floats (this waits for pending steps)."""
        return {m.name: float(m.result()) for m in [self.loss_metric, *self.metrics]}
