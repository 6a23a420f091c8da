"""The train step of a pipelined model (``dtk.parallel.pipeline``): compiled stages, a schedule.

Each stage has three compiled functions on its own sub-mesh: its forward (the output goes to the
next stage), its backward (the forward recomputed under a tape from the stage's input, then the
gradients of the weights and of the input for the incoming output gradient), and its update.
The last stage's forward and backward are one function that also computes the loss. Python
issues them in the schedule's order (``dtk.parallel.pipeline.dispatch_order``); TensorFlow runs
eager ops asynchronously per device, so one stage's work can run while the driver issues the
next stage's.

The loss is Keras's: the weighted sum over the whole batch divided by its count of real
examples (each microbatch's sum is divided by the whole batch's count, so the summed gradients
are the whole batch's), plus each stage's own losses (``add_loss``, regularizers) over
microbatches, averaged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor

from dtk.data import input as input_lib
from dtk.parallel import pipeline, randomness
from dtk.parallel.mesh import BATCH_AXIS
from dtk.train.optimizers import make_loss, make_optimizer
from dtk.train.steps import normalized_loss, weighted_loss


def _move(t: tf.Tensor, mesh: dtensor.Mesh) -> tf.Tensor:
    """``t`` on ``mesh`` with the same sharding: each shard copied to its device there."""
    layout = dtensor.fetch_layout(t)
    return dtensor.pack(dtensor.unpack(t), dtensor.Layout(layout.sharding_specs, mesh))


def _replicated(value, mesh: dtensor.Mesh, dtype) -> tf.Tensor:
    return dtensor.copy_to_mesh(tf.constant(value, dtype), dtensor.Layout.replicated(mesh, 0))


def _dense(grads):
    return [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]


class PipelineSteps:
    """Trains a ``dtk.parallel.pipeline.Pipeline``: one optimizer per stage, on its sub-mesh.

    Args:
      pipe: the stages (``dtk.parallel.pipeline.build``).
      loss: as for ``dtk.Steps`` (a name, a ``tf_keras.losses.Loss``, a function).
      optimizer: a name (each stage gets its own, bound to its sub-mesh, with
        ``optimizer_kwargs``) or a function ``mesh -> optimizer``. The optimizer must update each
        weight from its own gradient alone: ``global_clipnorm`` would need every stage's norm.
      config: microbatches and schedule.
    """

    def __init__(self, pipe: pipeline.Pipeline, *, loss: Any, optimizer: Any = "adam",
                 config: pipeline.PipelineConfig = pipeline.PipelineConfig(),
                 optimizer_kwargs: dict | None = None):
        self.pipe, self.config = pipe, config
        self.loss_fn = make_loss(loss)
        self.optimizers = [optimizer(m) if callable(optimizer) else
                           make_optimizer(optimizer, m, **(optimizer_kwargs or {}))
                           for m in pipe.meshes]
        # Clipping by the global norm needs every stage's gradients: each stage's sum of
        # squares goes to the host, and each stage scales its own by the one factor.
        clips = {opt.global_clipnorm for opt in self.optimizers}
        if len(clips) > 1:
            raise ValueError(f"the stages' optimizers clip to different global norms {clips}; "
                             "give every stage the same optimizer settings")
        self.global_clipnorm = clips.pop()
        for opt in self.optimizers:
            opt.global_clipnorm = None
        for opt, model in zip(self.optimizers, pipe.models):
            opt.build(model.trainable_variables)
        self.order = pipeline.dispatch_order(config.schedule, len(pipe.models),
                                             config.microbatches)
        m = config.microbatches
        self._index = [[_replicated(j, mesh, tf.int32) for j in range(m)] for mesh in pipe.meshes]
        self._forward = [self._compile_forward(s) for s in range(len(pipe.models) - 1)]
        self._backward = [self._compile_backward(s) for s in range(len(pipe.models) - 1)]
        self._last = self._compile_last()
        self._apply = [self._compile_apply(s) for s in range(len(pipe.models))]
        self._squares = [tf.function(lambda grads: tf.add_n(
            [tf.reduce_sum(tf.square(g)) for g in grads])) for _ in pipe.models]
        self._infer = [tf.function(lambda x, model=model: model(x, training=False))
                       for model in pipe.models]
        self._eval_loss = tf.function(lambda labels, y, weights: weighted_loss(
            self.loss_fn, labels, y, weights)[:2])
        self.timeline: list[tuple[str, int, int, float, float]] = []  # with record=True

    # -- compiled parts ---------------------------------------------------------------------------
    def _scopes(self, s, j):
        step = self.optimizers[s].iterations.read_value()
        return randomness.step_scope(step), randomness.microbatch_scope(self.config.microbatches, j)

    def _penalty(self, model, mesh):
        if not model.losses:
            return dtensor.call_with_layout(tf.zeros, dtensor.Layout.replicated(mesh, 0), shape=[])
        return tf.add_n([tf.cast(l, tf.float32) for l in model.losses]) / self.config.microbatches

    def _compile_forward(self, s):
        model = self.pipe.models[s]

        @tf.function
        def forward(x, j):
            step, micro = self._scopes(s, j)
            with step, micro:
                return model(x, training=True)
        return forward

    def _compile_backward(self, s):
        model, mesh = self.pipe.models[s], self.pipe.meshes[s]
        variables = model.trainable_variables
        needs_dx = s > 0

        @tf.function
        def backward(x, dy, j, acc):
            step, micro = self._scopes(s, j)
            with tf.GradientTape() as tape:
                if needs_dx:
                    tape.watch(x)
                with step, micro:
                    y = model(x, training=True)
                objective = tf.reduce_sum(tf.cast(y, tf.float32) * tf.cast(dy, tf.float32))
                objective += self._penalty(model, mesh)
            grads = _dense(tape.gradient(objective, [*variables, *([x] if needs_dx else [])]))
            acc = [a + g for a, g in zip(acc, grads)]
            return (grads[-1] if needs_dx else None), acc
        return backward

    def _compile_last(self):
        s = len(self.pipe.models) - 1
        model, mesh = self.pipe.models[s], self.pipe.meshes[s]
        variables = model.trainable_variables
        needs_dx = s > 0

        @tf.function
        def last(x, labels, weights, count, j, acc):
            step, micro = self._scopes(s, j)
            with tf.GradientTape() as tape:
                if needs_dx:
                    tape.watch(x)
                with step, micro:
                    y = model(x, training=True)
                total, masked, mask = weighted_loss(self.loss_fn, labels, y, weights)
                if mask is not None:
                    raise ValueError(
                        "a pipelined model whose output carries a Keras mask: the loss is the "
                        "mean over the whole batch's unmasked elements, which no microbatch "
                        "knows; train it without a stage axis")
                penalty = self._penalty(model, mesh)
                objective = normalized_loss(self.loss_fn, total, count) + penalty
            grads = _dense(tape.gradient(objective, [*variables, *([x] if needs_dx else [])]))
            acc = [a + g for a, g in zip(acc, grads)]
            return total, penalty, (grads[-1] if needs_dx else None), acc
        return last

    def _compile_apply(self, s):
        model, opt = self.pipe.models[s], self.optimizers[s]
        variables = model.trainable_variables

        @tf.function
        def apply(grads, scale):
            opt.apply_gradients(zip([g * scale for g in grads], variables))
        return apply

    # -- the step ---------------------------------------------------------------------------------
    def train(self, features, labels, sample_weight=None, *, record: bool = False) -> float:
        """One step on a global batch (numpy arrays); returns the batch loss.

        ``record=True`` keeps when each op was issued and when its result was ready
        (``timeline``), for measuring the bubble; it waits on each op, so it serializes them.

        Raises:
          ValueError: a batch the microbatches and the batch axis do not divide.
        """
        pipe, m = self.pipe, self.config.microbatches
        stages = len(pipe.models)
        features, labels = np.asarray(features), np.asarray(labels)
        rows = features.shape[0]
        size = pipe.meshes[0].dim_size(BATCH_AXIS)
        if rows % (m * size):
            raise ValueError(
                f"global batch {rows} is not divisible by microbatches {m} x mesh axis "
                f"'{BATCH_AXIS}' of size {size}; use a global batch that is a multiple of "
                f"{m * size}, or other --microbatches")
        weights = (np.ones(rows, np.float32) if sample_weight is None
                   else np.asarray(sample_weight, np.float32))
        first, final = pipe.meshes[0], pipe.meshes[-1]
        count = _replicated(float(weights.sum()), final, tf.float32)
        # Microbatch j: rows r * M + j (as gradient accumulation splits it; the draws follow).
        inputs = {(0, j): input_lib.pack(first, features[j::m]) for j in range(m)}
        targets = {j: input_lib.pack(final, (labels[j::m], weights[j::m])) for j in range(m)}
        acc = [[tf.zeros_like(v.read_value()) for v in model.trainable_variables]
               for model in pipe.models]
        grads_in: dict[tuple[int, int], tf.Tensor] = {}
        totals, penalties = [], []
        self.timeline = []
        for kind, s, j in self.order:
            start = time.perf_counter()
            index = self._index[s][j]
            if kind == "F":
                if s < stages - 1:
                    y = self._forward[s](inputs[(s, j)], index)
                    inputs[(s + 1, j)] = _move(y, pipe.meshes[s + 1])
                    out = y
                else:
                    out = None  # the last stage's forward runs with its backward
            elif s == stages - 1:
                total, penalty, dx, acc[s] = self._last(inputs.pop((s, j)), *targets.pop(j),
                                                        count, index, acc[s])
                totals.append(total)
                penalties.append(penalty)
                if s:
                    grads_in[(s - 1, j)] = _move(dx, pipe.meshes[s - 1])
                out = total
            else:
                dx, acc[s] = self._backward[s](inputs.pop((s, j)), grads_in.pop((s, j)), index,
                                               acc[s])
                if s:
                    grads_in[(s - 1, j)] = _move(dx, pipe.meshes[s - 1])
                out = acc[s][0]
            if record:
                if out is not None:
                    _wait(out)
                self.timeline.append((kind, s, j, start, time.perf_counter()))
        scale = 1.0
        if self.global_clipnorm:  # tf.clip_by_global_norm's factor, over every stage's gradients
            norm = float(np.sqrt(sum(float(self._squares[s](acc[s])) for s in range(stages))))
            scale = self.global_clipnorm / max(norm, self.global_clipnorm)
        for s in range(stages):
            self._apply[s](acc[s], _replicated(scale, pipe.meshes[s], tf.float32))
        total = float(sum(float(t) for t in totals))
        loss = total / float(weights.sum()) if not getattr(self.loss_fn, "sum_over_batch",
                                                           False) else total
        return loss + float(sum(float(p) for p in penalties))

    def predict(self, features) -> tf.Tensor:
        """The model's output for a global batch (numpy), through every stage (no dropout), on
        the last stage's sub-mesh."""
        x = input_lib.pack(self.pipe.meshes[0], np.asarray(features))
        for s, infer in enumerate(self._infer):
            if s:
                x = _move(x, self.pipe.meshes[s])
            x = infer(x)
        return x

    def evaluate(self, features, labels, sample_weight=None) -> tuple[float, float]:
        """The weighted loss sum over a global batch and its count of real examples (0/1
        ``sample_weight`` marks padding), for a held-out mean over batches."""
        rows = np.asarray(features).shape[0]
        weights = (np.ones(rows, np.float32) if sample_weight is None
                   else np.asarray(sample_weight, np.float32))
        final = self.pipe.meshes[-1]
        y = self.predict(features)
        labels, weights = input_lib.pack(final, (np.asarray(labels), weights))
        total, count = self._eval_loss(labels, y, weights)
        return float(total), float(count)

    @property
    def iterations(self) -> int:
        return int(self.optimizers[0].iterations)


def _wait(t: tf.Tensor) -> None:
    for component in dtensor.unpack(t):
        component.numpy()
