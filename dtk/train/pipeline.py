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
microbatches, averaged. Clipping to a global norm (``global_clipnorm``) sums every stage's
squares on the host and scales each stage's gradients by the one factor.

**Across clients** (stages on different clients' devices, ``python -m dtk.cluster.launch``):
every client runs the same driver; a client runs only its own stages' functions, and every
transfer between stages is a collective of the whole mesh that all clients join in the same
order (``_Exchange``). What crosses is laid out batch-sharded, its shape and dtype known from
the model's graph, so a client that holds neither end still takes part. Every transfer is traced
before any stage's step (``global_batch_size``): a client traces only its own stages' collectives,
and the whole mesh's collectives traced after them got keys that differed between the clients
and hung (measured); traced first, they agree, and 2 clients give one process's numbers.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from dtk.data import input as input_lib
from dtk.parallel import pipeline, randomness
from dtk.parallel.mesh import BATCH_AXIS
from dtk.train.optimizers import make_loss, make_optimizer


def _output_mask(predictions: Any, losses: tf.Tensor) -> tf.Tensor | None:
    """The Keras mask a model's (single) output carries, as float32 of the losses' shape; None
    when it carries none."""
    mask = getattr(predictions, "_keras_mask", None)
    if mask is None:
        return None
    mask = tf.cast(mask, tf.float32)
    if mask.shape.rank != losses.shape.rank:
        raise ValueError(
            f"the model's output mask has shape {mask.shape} but its per-element losses "
            f"{losses.shape}; Keras weights each loss element by the mask, so they must match "
            "(e.g. a per-token loss [batch, time] for a mask [batch, time])")
    return mask


def weighted_loss(loss_fn, labels, predictions, weights, examples=None):
    """The batch's weighted loss sum and what it is divided by, Keras's way: the count of
    real examples (``examples``, else the 0/1 ``weights``), not the sample weights' sum;
    with an output mask, the count of unmasked elements of real examples."""
    # Like Keras's LossFunctionWrapper: AutoGraph converts a user's loss function, not Keras's.
    converted = tf.__internal__.autograph.tf_convert(
        loss_fn, tf.__internal__.autograph.control_status_ctx())
    per_example = converted(labels, predictions)
    if per_example.shape.rank == 0:
        raise ValueError(
            f"the loss function {getattr(loss_fn, '__name__', loss_fn)!r} returned a "
            "scalar; dtk needs per-example losses (shape [batch]) to weight padding and "
            "normalize by the global batch. Return the unreduced losses (e.g. no "
            "tf.reduce_mean at the end), or pass a tf_keras.losses.Loss")
    per_example = tf.cast(per_example, tf.float32)
    mask = _output_mask(predictions, per_example)
    if mask is not None:
        # As Keras's Loss with an output mask (Embedding(mask_zero=True), compute_mask): the
        # mean over the unmasked elements of the real examples, sum(loss * mask) /
        # sum(mask), not over every element.
        shape = [-1] + [1] * (per_example.shape.rank - 1)
        rows = tf.reshape(weights, shape)
        real = rows if examples is None else tf.reshape(examples, shape)
        return (tf.reduce_sum(per_example * mask * rows),
                tf.reduce_sum(mask * real), mask)
    if per_example.shape.rank != 1:
        per_example = tf.reshape(per_example, [tf.shape(per_example)[0], -1])
        per_example = tf.reduce_mean(per_example, axis=1)
    count = tf.reduce_sum(weights if examples is None else examples)
    total = tf.reduce_sum(per_example * weights)
    return total, count, None


def normalized_loss(loss_fn, total, count):
    """The batch loss from its weighted sum: the mean over real examples (``count``), or the
    sum itself for a loss with ``reduction="sum"`` (make_loss)."""
    if getattr(loss_fn, "sum_over_batch", False):
        return total
    return tf.math.divide_no_nan(total, count)


def _is_local(mesh: dtensor.Mesh) -> bool:
    return bool(mesh.local_devices())


def _replicated(value, mesh: dtensor.Mesh, dtype) -> tf.Tensor:
    return dtensor.call_with_layout(tf.fill, dtensor.Layout.replicated(mesh, 0), dims=[],
                                    value=tf.constant(value, dtype))


def _dense(grads):
    return [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]


class _Exchange:
    """Moves tensors between stages: device to device where every stage is this process's;
    across clients, through the whole mesh (stage x the stages' axes), where DTensor's
    collectives reach every client: each stage's shards in its slot of a ``[stages, ...]``
    tensor sharded over ``stage``, gathered over ``stage``, and the slot of the sending stage
    read by the receiving stage's devices. Every client calls every transfer, in the same order
    (each runs the same schedule); a client without the sending stage's devices sends zeros,
    one without the receiving stage's gets None."""

    def __init__(self, pipe: pipeline.Pipeline):
        self.pipe = pipe
        self.direct = all(_is_local(m) for m in pipe.meshes)
        full = pipe.mesh
        names = list(full.dim_names)
        ids = np.moveaxis(np.asarray(full.global_device_ids()).reshape(
            [full.dim_size(n) for n in names]), names.index(pipeline.STAGE_AXIS), 0)
        self._where = {int(i): (s, p) for s in range(ids.shape[0])
                       for p, i in enumerate(ids[s].reshape(-1))}
        self._full_id = {(s, p): i for i, (s, p) in self._where.items()}
        self._take = {}

    def _gathered(self, rank: int, source: int):
        if (rank, source) not in self._take:
            # over the stage axis only (gathering it with the batch axis in one relayout fails
            # to lower across clients: measured)
            layout = dtensor.Layout([dtensor.UNSHARDED, *self._specs(rank)], self.pipe.mesh)

            @tf.function
            def take(x):
                return tf.gather(dtensor.relayout(x, layout), source, axis=0)
            self._take[(rank, source)] = take
        return self._take[(rank, source)]

    def _specs(self, rank: int) -> list[str]:
        return [BATCH_AXIS] + [dtensor.UNSHARDED] * (rank - 1) if rank else []

    def _on_full_mesh(self, t, source: int, shape, dtype) -> tf.Tensor:
        """``t`` (batch-sharded on stage ``source``'s mesh, or None on a client without it) on
        every stage's devices of the whole mesh, each device holding its rows."""
        full, rank = self.pipe.mesh, len(shape)
        specs = self._specs(rank)
        shard = list(shape)
        if rank:
            shard[0] //= full.dim_size(BATCH_AXIS)
        mine = {}
        if t is not None and _is_local(self.pipe.meshes[source]):
            mine = dict(zip(self.pipe.meshes[source].local_device_ids(), dtensor.unpack(t)))
        parts = []
        for i in full.local_device_ids():
            s, p = self._where[int(i)]
            part = mine.get(p) if s == source else None
            parts.append(tf.zeros([1, *shard], dtype) if part is None else part[None])
        # The collective of the whole mesh starts only once the stage's own work (and its
        # collectives) is done, and ends before the next: collectives of two device groups in
        # flight at once on the same devices deadlocked here (TensorFlow's CPU collectives
        # hold a thread while they wait for their peers).
        for part in parts:
            part.numpy()
        stacked = dtensor.pack(parts, dtensor.Layout([pipeline.STAGE_AXIS, *specs], full))
        out = self._gathered(rank, source)(stacked)
        for part in dtensor.unpack(out):
            part.numpy()
        return out

    def move(self, t, source: int, target: int, shape, dtype):
        """``t`` (batch-sharded, ``shape``) from stage ``source``'s mesh to ``target``'s."""
        mesh = self.pipe.meshes[target]
        specs = self._specs(len(shape))
        if self.direct:  # each shard to its device on the other stage, sharded as it is
            return dtensor.pack(dtensor.unpack(t), dtensor.Layout(
                dtensor.fetch_layout(t).sharding_specs, mesh))
        out = self._on_full_mesh(t, source, shape, dtype)
        if not _is_local(mesh):  # a stand-in for the stage of another client
            return dtensor.call_with_layout(tf.zeros, dtensor.Layout(specs, mesh), shape=shape,
                                            dtype=dtype)
        full = self.pipe.mesh
        parts = dict(zip((int(i) for i in full.local_device_ids()), dtensor.unpack(out)))
        return dtensor.pack([parts[self._full_id[(target, int(p))]]
                             for p in mesh.local_device_ids()], dtensor.Layout(specs, mesh))

    def value(self, t, source: int) -> float:
        """A replicated scalar of stage ``source`` (None on a client without it), on every
        client (each client joins the gather, whether it holds the stage or not)."""
        if self.direct:
            return float(dtensor.unpack(t)[0].numpy())
        out = self._on_full_mesh(t, source, (), tf.float32)
        return float(dtensor.unpack(out)[0].numpy())


class PipelineSteps:
    """Trains a ``dtk.parallel.pipeline.Pipeline``: one optimizer per stage, on its sub-mesh.

    Args:
      pipe: the stages (``dtk.parallel.pipeline.build``).
      loss: as for ``dtk.Steps`` (a name, a ``tf_keras.losses.Loss``, a function).
      optimizer: a name (each stage gets its own, bound to its sub-mesh, with
        ``optimizer_kwargs``) or a function ``mesh -> optimizer``.
      config: microbatches and schedule.
      global_batch_size: the rows of every batch ``train``, ``evaluate`` and ``predict_value``
        will get; required when stages are on other clients' devices (every transfer between
        clients is traced up front, so that the collectives' keys agree on every client).
    """

    def __init__(self, pipe: pipeline.Pipeline, *, loss: Any, optimizer: Any = "adam",
                 config: pipeline.PipelineConfig = pipeline.PipelineConfig(),
                 optimizer_kwargs: dict | None = None, global_batch_size: int | None = None):
        self.pipe, self.config = pipe, config
        if not all(_is_local(m) for m in pipe.meshes) and not global_batch_size:
            raise ValueError(
                f"mesh {pipeline.mesh_spec(pipe.mesh)} puts pipeline stages on other clients' "
                "devices: give PipelineSteps(global_batch_size=...), the rows of every batch, so "
                "that the transfers between clients are traced before the stages' steps (their "
                "collectives' keys must agree on every client)")
        self._traced_rows: set[int] = set()
        self.loss_fn = make_loss(loss)
        stages = len(pipe.models)
        self.local = [_is_local(m) for m in pipe.meshes]
        # Every client makes every stage's optimizer and calls every stage's functions (on
        # another client's devices they compute nothing): DTensor's collectives of a device
        # group wait for every client's call (a client that skipped them hung the group).
        self.optimizers = [optimizer(m) if callable(optimizer) else
                           make_optimizer(optimizer, m, **(optimizer_kwargs or {}))
                           for m in pipe.meshes]
        # Clipping to the global norm needs every stage's gradients: each stage's sum of
        # squares goes to the host, and each stage scales its own by the one factor.
        clips = {opt.global_clipnorm for opt in self.optimizers if opt is not None}
        if len(clips) > 1:
            raise ValueError(f"the stages' optimizers clip to different global norms {clips}; "
                             "give every stage the same optimizer settings")
        self.global_clipnorm = clips.pop() if clips else None
        for opt, model in zip(self.optimizers, pipe.models):
            if opt is not None:
                opt.global_clipnorm = None
                opt.build(model.trainable_variables)
        self.order = pipeline.dispatch_order(config.schedule, stages, config.microbatches)
        m = config.microbatches
        self._index = [[_replicated(j, mesh, tf.int32) for j in range(m)] for mesh in pipe.meshes]
        self.exchange = _Exchange(pipe)
        self._whole = tf.function(lambda t: dtensor.relayout(  # then over batch: every row
            t, dtensor.Layout.replicated(pipe.mesh, t.shape.rank)))
        if global_batch_size and not self.exchange.direct:
            self._trace_exchanges(global_batch_size)
        self._forward = [self._compile_forward(s) for s in range(stages - 1)]
        self._backward = [self._compile_backward(s) for s in range(stages - 1)]
        self._last = self._compile_last()
        self._apply = [self._compile_apply(s) for s in range(stages)]
        self._squares = [tf.function(lambda grads: tf.add_n(
            [tf.reduce_sum(tf.square(g)) for g in grads])) for _ in range(stages)]
        self._infer = [self._compile_infer(s) for s in range(stages)]
        self._eval_loss = tf.function(lambda labels, y, weights: weighted_loss(
            self.loss_fn, labels, y, weights)[:2])
        self.timeline: list[tuple[str, int, int, float, float]] = []  # with record=True

    def _trace_exchanges(self, rows: int) -> None:
        """Traces every transfer between clients before any stage's function: the whole mesh's
        collectives then get the same keys on every client (a client traces only its own
        stages' collectives, so keys made after them differed, and the gather hung)."""
        m, stages = self.config.microbatches, len(self.pipe.meshes)
        last = stages - 1
        self._traced_rows = {rows // m, rows, self.pipe.meshes[0].dim_size(BATCH_AXIS)}
        for n in sorted(self._traced_rows):
            for s in range(stages - 1):
                shape, dtype = self._crossing(s, n)
                self.exchange.move(None, s, s + 1, shape, dtype)
                self.exchange.move(None, s + 1, s, shape, dtype)
            shape = (n, *self.pipe.models[-1].output_shape[1:])  # predict_value's
            self._whole(self.exchange._on_full_mesh(None, last, shape, tf.float32))  # pylint: disable=protected-access
        for s in range(stages):
            self.exchange.value(None, s)

    # -- compiled parts ---------------------------------------------------------------------------
    def _scopes(self, s, j):
        step = self.optimizers[s].iterations.read_value()
        return randomness.step_scope(step), randomness.microbatch_scope(self.config.microbatches, j)

    def _penalty(self, model, mesh):
        if not model.losses:
            return dtensor.call_with_layout(tf.zeros, dtensor.Layout.replicated(mesh, 0), shape=[])
        return tf.add_n([tf.cast(l, tf.float32) for l in model.losses]) / self.config.microbatches

    def _out(self, s, y):
        """What leaves stage ``s``: batch-sharded, the one layout every client expects."""
        if self.exchange.direct:
            return y
        mesh = self.pipe.meshes[s]
        return dtensor.relayout(y, dtensor.Layout.batch_sharded(mesh, BATCH_AXIS, y.shape.rank))

    def _compile_forward(self, s):
        model = self.pipe.models[s]

        @tf.function
        def forward(x, j):
            step, micro = self._scopes(s, j)
            with step, micro:
                return self._out(s, model(x, training=True))
        return forward

    def _gradients(self, s, x, j, acc, objective):
        """Stage ``s``'s forward recomputed from ``x`` under a tape; ``objective(y)`` of its
        output; the weights' gradients added to ``acc``, and the input's (None on stage 0).
        Returns (what ``objective`` returned besides the scalar, the input's gradient, acc)."""
        model = self.pipe.models[s]
        variables = model.trainable_variables
        needs_dx = s > 0
        step, micro = self._scopes(s, j)
        with tf.GradientTape() as tape:
            if needs_dx:
                tape.watch(x)
            with step, micro:
                y = model(x, training=True)
            value, extra = objective(y)
            penalty = self._penalty(model, self.pipe.meshes[s])
            value += penalty
        grads = _dense(tape.gradient(value, [*variables, *([x] if needs_dx else [])]))
        acc = [a + g for a, g in zip(acc, grads)]
        return extra, (self._out(s, grads[-1]) if needs_dx else None), acc, penalty

    def _compile_backward(self, s):
        @tf.function
        def backward(x, dy, j, acc):
            _, dx, acc, penalty = self._gradients(s, x, j, acc, lambda y: (tf.reduce_sum(
                tf.cast(y, tf.float32) * tf.cast(dy, tf.float32)), None))
            return dx, acc, penalty
        return backward

    def _compile_last(self):
        s = len(self.pipe.models) - 1

        def objective(y, labels, weights, count):
            total, _, mask = weighted_loss(self.loss_fn, labels, y, weights)
            if mask is not None:
                raise ValueError(
                    "a pipelined model whose output carries a Keras mask: the loss is the mean "
                    "over the whole batch's unmasked elements, which no microbatch knows; train "
                    "it without a stage axis")
            return normalized_loss(self.loss_fn, total, count), total

        @tf.function
        def last(x, labels, weights, count, j, acc):
            total, dx, acc, penalty = self._gradients(
                s, x, j, acc, lambda y: objective(y, labels, weights, count))
            return total, penalty, dx, acc
        return last

    def _compile_apply(self, s):
        model, opt = self.pipe.models[s], self.optimizers[s]
        variables = model.trainable_variables

        @tf.function
        def apply(grads, scale):
            opt.apply_gradients(zip([g * scale for g in grads], variables))
        return apply

    def _compile_infer(self, s):
        model = self.pipe.models[s]
        return tf.function(lambda x: self._out(s, model(x, training=False)))

    # -- the step ---------------------------------------------------------------------------------
    def _crossing(self, s: int, rows: int):
        shape, dtype = self.pipe.crossing[s]
        return (rows, *shape), tf.as_dtype(dtype)

    def train(self, features, labels, sample_weight=None, *, record: bool = False) -> float:
        """One step on a global batch (numpy arrays); returns the batch loss.

        ``record=True`` keeps when each op was issued and when its result was ready
        (``timeline``), for measuring the bubble; it waits on each op, so it serializes them.

        Raises:
          ValueError: a batch the microbatches and the batch axis do not divide.
        """
        pipe, m = self.pipe, self.config.microbatches
        stages, last = len(pipe.models), len(pipe.models) - 1
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
        micro = rows // m
        self._check_traced(rows // m)
        # Microbatch j: rows r * M + j (as gradient accumulation splits it; the draws follow).
        inputs = {(0, j): _place(first, features[j::m]) for j in range(m)}
        targets = {j: _place(final, (labels[j::m], weights[j::m])) for j in range(m)}
        count = _replicated(float(weights.sum()), final, tf.float32)
        acc = [[tf.zeros_like(v.read_value()) for v in model.trainable_variables]
               for model in pipe.models]
        grads_in: dict[tuple[int, int], Any] = {}
        totals, penalties = [], []
        self.timeline = []
        for kind, s, j in self.order:
            start = time.perf_counter()
            mine, out = self.local[s], None
            index = self._index[s][j]
            if kind == "F":
                if s < last:  # the last stage's forward runs with its backward
                    y = self._forward[s](inputs[(s, j)], index)
                    inputs[(s + 1, j)] = self.exchange.move(y, s, s + 1,
                                                            *self._crossing(s, micro))
                    out = y
            else:
                x = inputs.pop((s, j))
                if s == last:
                    total, penalty, dx, acc[s] = self._last(x, *targets.pop(j), count, index,
                                                            acc[s])
                    totals.append(total)
                    penalties.append((s, penalty))
                    out = total
                else:
                    dx, acc[s], penalty = self._backward[s](x, grads_in.pop((s, j)), index,
                                                            acc[s])
                    penalties.append((s, penalty))
                    out = acc[s][0]
                if s:
                    grads_in[(s - 1, j)] = self.exchange.move(dx, s, s - 1,
                                                              *self._crossing(s - 1, micro))
            if record:
                if out is not None and mine:
                    _wait(out)
                self.timeline.append((kind, s, j, start, time.perf_counter()))
        scale = 1.0
        if self.global_clipnorm:  # tf.clip_by_global_norm's factor, over every stage's gradients
            norm = float(np.sqrt(sum(self.exchange.value(self._squares[s](acc[s]), s)
                                     for s in range(stages))))
            scale = self.global_clipnorm / max(norm, self.global_clipnorm)
        for s in range(stages):
            self._apply[s](acc[s], _replicated(scale, pipe.meshes[s], tf.float32))
        total = sum(self.exchange.value(t, last) for t in totals)
        loss = total / float(weights.sum()) if not getattr(self.loss_fn, "sum_over_batch",
                                                           False) else total
        # Every stage's extra losses (add_loss, regularizers), each microbatch's a 1/M share,
        # as Keras reports them: part of the loss (stages in order: the same gathers everywhere)
        return loss + sum(self.exchange.value(p, s) for s, p in sorted(penalties,
                                                                       key=lambda sp: sp[0]))

    def _predict(self, features):
        """The last stage's output for a global batch (None on a client without it)."""
        features = np.asarray(features)
        rows = features.shape[0]
        self._check_traced(rows)
        x = _place(self.pipe.meshes[0], features)
        for s, infer in enumerate(self._infer):
            if s:
                x = self.exchange.move(x, s - 1, s, *self._crossing(s - 1, rows))
            x = infer(x)
        return x

    def predict_value(self, features) -> np.ndarray:
        """The model's output for a global batch (numpy), through every stage (no dropout), on
        every client."""
        y = self._predict(features)
        last = len(self.pipe.meshes) - 1
        if self.exchange.direct:
            # One sharded dim at a time (global_value): the logits of a stage with a model axis
            # ([batch, unsharded, model]) gathered over both axes at once failed in DTensor's
            # lowering ("'tf.Reshape' op requires 'output' number of elements to match").
            from dtk.train import checkpoint  # pylint: disable=g-import-not-at-top
            return checkpoint.global_value(y)
        shape = (np.asarray(features).shape[0], *self.pipe.models[-1].output_shape[1:])
        out = self.exchange._on_full_mesh(y, last, shape, tf.float32)  # pylint: disable=protected-access
        return dtensor.unpack(self._whole(out))[0].numpy()

    def evaluate(self, features, labels, sample_weight=None) -> tuple[float, float]:
        """The weighted loss sum over a global batch and its count of real examples (0/1
        ``sample_weight`` marks padding), for a held-out mean over batches."""
        rows = np.asarray(features).shape[0]
        weights = (np.ones(rows, np.float32) if sample_weight is None
                   else np.asarray(sample_weight, np.float32))
        last = len(self.pipe.meshes) - 1
        y = self._predict(features)
        labels, weights = _place(self.pipe.meshes[last], (np.asarray(labels), weights))
        total, count = self._eval_loss(labels, y, weights)
        return self.exchange.value(total, last), self.exchange.value(count, last)

    def _check_traced(self, rows: int) -> None:
        if not self.exchange.direct and rows not in self._traced_rows:
            raise ValueError(
                f"a batch of {rows} rows through stages on several clients: only "
                f"{sorted(self._traced_rows)} were traced (PipelineSteps(global_batch_size=...), "
                "its microbatches and the batch axis); a new size would trace collectives whose "
                "keys differ between the clients. Use the global batch size given")

    # -- checkpoints ------------------------------------------------------------------------------
    def checkpoint_objects(self) -> tuple[Any, Any]:
        """The whole model and its optimizer as ``dtk.Trainer`` checkpoints them, holding the
        stages' variables.

        ``tf.train.Checkpoint(model=m, optimizer=o)`` of the pair writes the checkpoint a Trainer
        of the whole model writes: the same object graph (the whole model's, from its lazy build;
        the optimizer's as it builds on the whole model's weights), each value a stage's. So it
        resumes on any mesh, with stages or without, and restores a Trainer's checkpoint into the
        stages. After a restore, call ``restored()``.

        Raises:
          ValueError: stages on other clients' devices (not yet: TensorFlow's checkpoint
            serializer packs every variable, which fails on a mesh with no local devices), a
            weight of the whole model that no stage holds, or optimizer state that cannot be
            told apart by name.
        """
        from tf_keras.src.dtensor import lazy_variable  # pylint: disable=g-import-not-at-top
        from dtk.parallel import layouts  # pylint: disable=g-import-not-at-top
        whole = self.pipe.whole
        if not all(self.local):
            raise ValueError(
                f"checkpoints of pipeline stages on several clients (mesh "
                f"{pipeline.mesh_spec(self.pipe.mesh)}) are not supported yet: TensorFlow's "
                "checkpoint serializer cannot describe another client's stage. Train the stages "
                "in one process to checkpoint them, or without checkpoints")
        if whole is None:
            raise ValueError("this Pipeline keeps no whole model (Pipeline.whole); build it with "
                             "dtk.parallel.pipeline.build")
        replace = self._stage_weights()
        model_view = _mirror(whole, replace, {}, "model", _ModelView)
        # Not an attribute AutoTrackable would track (the checkpoint would hold them twice).
        object.__setattr__(model_view, "_dtk_weights",
                           [replace[id(v)] for _, v in layouts.weight_paths(whole)])

        # The optimizer the Trainer builds on the whole model's weights (lazy: no storage) gives
        # the graph and the order of its slots; each slot is then the stage's of the same name.
        first, local = self.optimizers[0], self.local_optimizer
        with lazy_variable.lazy_init_scope():
            twin = type(local).from_config(local.get_config())
            twin.build(whole.trainable_variables)
        slots: dict[str, tf.Variable] = {}
        for opt in self.optimizers:
            for variable in opt.variables:
                if variable is opt.iterations or variable is opt._learning_rate:  # pylint: disable=protected-access
                    continue
                if variable.name in slots:
                    raise ValueError(f"two stages' optimizer state named {variable.name}: a "
                                     "checkpoint cannot tell them apart; name the model's layers")
                slots[variable.name] = variable
        plan = {id(twin.iterations): first.iterations}
        rate = getattr(twin, "_learning_rate", None)
        if isinstance(rate, tf.Variable):
            plan[id(rate)] = first._learning_rate  # pylint: disable=protected-access
        for variable in twin.variables:
            if id(variable) not in plan:
                if variable.name not in slots:
                    raise ValueError(f"optimizer state {variable.name} is in no stage")
                plan[id(variable)] = slots[variable.name]
        return model_view, _mirror(twin, plan, {}, "optimizer", _Node)

    def export(self, model_factory, export_dir: str, *, formats=("keras", "saved_model")
               ) -> dict[str, str]:
        """Writes the whole model, its weights the stages', as plain tf_keras
        (``dtk.train.checkpoint.export``: ``model.keras`` and a SavedModel).

        Raises:
          ValueError: stages on other clients' devices (not yet: their weights are not
            readable here), or a factory that builds another model.
        """
        from dtk.train import checkpoint  # pylint: disable=g-import-not-at-top
        if not all(self.local):
            raise ValueError(
                f"export of pipeline stages on several clients (mesh "
                f"{pipeline.mesh_spec(self.pipe.mesh)}) is not supported yet: each client reads "
                "its own stages' weights only. Train the stages in one process to export them")
        stage_of = self._stage_weights()
        trained = {key: stage_of[id(variable)] for key, variable in
                   checkpoint._weights_by_identity(self.pipe.whole).items()}  # pylint: disable=protected-access
        return checkpoint.export(trained, model_factory, export_dir, formats=formats)

    def _stage_weights(self) -> dict[int, tf.Variable]:
        """Each weight of the whole (lazy) model, by ``id`` (its own and its inner variable's),
        mapped to the stage's variable of the same path.

        Raises:
          ValueError: a weight of the whole model that no stage holds.
        """
        from dtk.parallel import layouts  # pylint: disable=g-import-not-at-top
        held = {}
        for model in self.pipe.models:
            held.update(layouts.weight_paths(model))
        out = {}
        for path, variable in layouts.weight_paths(self.pipe.whole):
            if path not in held:
                raise ValueError(f"weight {path} of the whole model is in no stage")
            out[id(variable)] = out[id(getattr(variable, "_variable", variable))] = held[path]
        return out

    def restored(self) -> None:
        """After restoring ``checkpoint_objects``: every stage's step counter and learning
        rate are stage 0's (the checkpoint holds one of each, as a Trainer's does)."""
        first = self.optimizers[0]
        step = int(self.exchange.value(tf.cast(first.iterations.read_value(), tf.float32), 0))
        rate = first._learning_rate  # pylint: disable=protected-access
        value = (self.exchange.value(rate.read_value(), 0) if isinstance(rate, tf.Variable)
                 else None)
        for opt in self.optimizers[1:]:
            opt.iterations.assign(step)
            if value is not None:
                opt._learning_rate.assign(value)  # pylint: disable=protected-access

    @property
    def local_optimizer(self):
        """A stage's optimizer on this client's devices: its settings (the learning rate) can be
        read here, another client's cannot."""
        return next(opt for opt, mine in zip(self.optimizers, self.local) if mine)

    @property
    def iterations(self) -> int:
        return int(self.exchange.value(tf.cast(self.optimizers[-1].iterations.read_value(),
                                               tf.float32), len(self.optimizers) - 1))


class _Node(tf.__internal__.tracking.AutoTrackable):
    """A node of a checkpoint's object graph, its children named as another object's."""


class _ModelView(_Node):
    """The whole model's node; ``weights`` (the stages' variables in the whole model's order)
    is what ``dtk.train.checkpoint.Checkpointer`` compares a checkpoint's shapes with."""

    @property
    def weights(self) -> list:
        return self.__dict__.get("_dtk_weights", [])


def _mirror(obj, replace: dict[int, tf.Variable], memo: dict[int, Any], where: str,
            kind: type) -> Any:
    """A node whose checkpoint is ``obj``'s, with each variable ``v`` saved as
    ``replace[id(v)]``; None where no variable is below. ``memo`` keeps an object reached by two
    paths one node (a checkpoint saves it once).

    Raises:
      ValueError: a variable below ``obj`` that ``replace`` lacks (it would not be saved).
    """
    if id(obj) in memo:
        return memo[id(obj)]
    node = memo[id(obj)] = kind()
    found = False
    for name, child in tf.train.TrackableView(obj).children(obj).items():
        if id(child) in replace:
            target = replace[id(child)]
        elif isinstance(child, tf.Variable):
            raise ValueError(f"{where}/{name}: a variable no stage holds")
        else:
            target = _mirror(child, replace, memo, f"{where}/{name}", _Node)
        if target is not None:
            node._track_trackable(target, name=name)  # pylint: disable=protected-access
            found = True
    if not found:
        memo[id(obj)] = None
    return node if found else None


def _place(mesh: dtensor.Mesh, tree):
    """Global numpy arrays sharded over ``mesh``'s batch axis; on a mesh of another client's
    devices, stand-ins of the same shapes."""
    if _is_local(mesh):
        return input_lib.pack(mesh, tree)
    return tf.nest.map_structure(lambda a: dtensor.call_with_layout(
        tf.zeros, dtensor.Layout.batch_sharded(mesh, BATCH_AXIS, a.ndim), shape=a.shape,
        dtype=tf.as_dtype(a.dtype)), tree)


def _wait(t: tf.Tensor) -> None:
    for component in dtensor.unpack(t):
        component.numpy()
