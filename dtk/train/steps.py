"""Compiled train, eval and predict steps: the inner loop, correct on any mesh by construction.

Every step takes a batch ``(features, labels, weights)`` of DTensors, batch-sharded on the batch
axis, where ``weights`` is 1.0 for a real example and 0.0 for padding (``dtk.data.input`` pads the last
evaluation batch). The loss is normalized by the GLOBAL number of real examples::

    loss = sum_i(w_i * l_i) / sum_i(w_i)          (sums over the whole global batch)

so it does not depend on how the batch is split over devices, and equals the Keras
``SUM_OVER_BATCH_SIZE`` mean on an unpadded batch. DTensor inserts the all-reduces for the sums and
for the gradients of replicated weights.

Several steps per call (``steps_per_execution=N``): the input path stacks N batches into
``[n, B, ...]`` DTensors and one ``tf.function`` runs a ``tf.while_loop`` that reads batch ``i`` with
``tf.gather`` (indexing ``x[i]`` fails under DTensor). The updates are bit-identical to N calls of
the one-step function, with less Python and dispatch per step.

Example::

    steps = dtk.Steps(model, loss="sparse_categorical_crossentropy",
                      optimizer=dtk.make_optimizer("adam", mesh), metrics=["accuracy"], mesh=mesh)
    loss = steps.train(batch)        # one call; returns the last step's loss (a DTensor scalar)
    print(steps.results())           # {'loss': ..., 'accuracy': ...}
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor

from dtk.parallel import fsdp, materialize, ops, randomness, remat
from dtk.parallel.mesh import BATCH_AXIS, as_mesh, check_batch_axis
from dtk.train import sparse as sparse_lib
from dtk.train.input_checks import check_accumulation  # noqa: F401  (dtk.steps's name)
from dtk.train.mesh_optimizer import auto_shard_optimizer_state, update_layout
from dtk.train.optimizers import keras_loss, make_loss, make_metrics, make_optimizer

_log = logging.getLogger("dtk")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepConfig:
    """How steps are compiled.

    Attributes:
      jit_compile: compile with XLA (works on CPU under DTensor; no speed-up measured there).
      steps_per_execution: batches per compiled call; the input must then be stacked ``[n, B, ...]``.
      shard_optimizer_state: ZeRO-style weight update: True, False or ``"auto"`` (the default).
        Replicated weights make every device run the whole optimizer update and hold all of its
        state. With this option the optimizer state and the update of each weight of
        ``layouts.SHARDED_UPDATE_MIN_ELEMENTS`` elements a device or more are sharded over
        ``batch_axis`` (each device updates its slice, on the first dim not already sharded
        that the axis size divides), then those weights are all-gathered; smaller weights are
        updated in place (their all-gathers would cost more than they save). Same numbers
        (parity-tested); those weights' optimizer memory per device drops by the axis size.
        ``"auto"`` turns it on when the batch axis has more than one device and at least one
        weight can be sharded on it (see ``auto_shard_optimizer_state``): measured faster on
        every workload of ``scripts/bench.py`` (BUILD.md), and a memory saving besides.
      batch_axis: the data-parallel mesh axis.
      gradient_accumulation_steps: k > 1 splits each batch into k microbatches of B/k, run one
        after the other (a loop, so one microbatch's activations are live at a time), and makes
        one optimizer update from the sum of their gradients: the update of one batch of B
        (parity-tested at 1e-5, dropout included: microbatch rows draw the whole batch's
        masks). Microbatch j holds the rows ``r * k + j`` of each device's slice, so no example
        moves between devices. BatchNormalization then normalizes over microbatches (as in
        every framework). Each device's share of the batch must be divisible by k.
      remat: regular expressions naming layers whose activations are recomputed in the
        backward pass (``dtk.parallel.remat``); () for none.
      sparse_tables: True updates only the rows a step touched of the Embedding tables sharded
        on their rows or columns (``dtk.train.sparse``): SGD and Adagrad with the dense update's
        numbers, Adam as lazy Adam (TorchRec's choice, other numbers); other optimizers are
        refused. Its step time is flat in the table size (faster than dense from about 2^20
        rows; slower on small tables). False (the default) updates every row, as Keras does.
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


def _function(fn: Callable, *, jit_compile: bool, reduce_retracing: bool = False) -> Callable:
    """``tf.function`` of dtk's step code: no AutoGraph for it, AutoGraph for the user code it calls.

    See ``_user_code_autograph``. The result retraces (at most twice per call) when DTensor
    cannot register a function of its compilation (``_StaleFunctionRetry``).
    """
    @functools.wraps(fn)
    def traced(*args):
        with _user_code_autograph(), ops.during_steps():
            return fn(*args)
    return _StaleFunctionRetry(lambda: tf.function(traced, jit_compile=jit_compile,
                                                   autograph=False,
                                                   reduce_retracing=reduce_retracing))


# DTensor's SPMD compilation outlines control flow into functions named after the op
# ('dtk_accumulate_12_body', 'while6_cond') and registers them in the process's eager context.
# When DTensor compiles a step function a second time (its cache key changed: for instance a
# small integer input it folded as a constant on the first call changed), the second one can
# produce a function of the same name with other contents, and the call fails before it runs:
# "Cannot add function 'X' because a different function with the same name already exists"
# (seen in long test processes, about once per full suite). Nothing has run at that point, so
# retracing (new op names, see ``_loop_name``) and calling again is safe.
_STALE_FUNCTION = re.compile(r"Cannot add function '([^']+)' because a different function with "
                             r"the same name already exists")
_STALE_RETRIES = 2


class _StaleFunctionRetry:
    """A ``tf.function`` made by ``factory``, made again (a fresh trace) and called again when a
    call fails on a stale DTensor function name (``_STALE_FUNCTION``); other errors propagate."""

    def __init__(self, factory: Callable[[], Callable]):
        self._factory = factory
        self._fn = factory()

    def __call__(self, *args):
        retries = 0
        while True:
            try:
                return self._fn(*args)
            except tf.errors.InvalidArgumentError as e:
                found = _STALE_FUNCTION.search(str(e))
                if found is None or retries == _STALE_RETRIES:
                    raise
                retries += 1
                from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
                context.async_clear_error()
                _log.info("DTensor could not register function %r of a recompiled step (a "
                          "name from an earlier compilation); retracing the step and calling "
                          "again", found.group(1))
                self._fn = self._factory()


def _user_code_autograph():
    """Marks AutoGraph as enabled for the user code that dtk's steps call.

    AutoGraph rewrites a function's source before tracing; converting dtk's step bodies cost about
    0.5 s of a 2.3 s first step and buys nothing (they have no Python control flow on tensors), so
    ``_function`` turns it off. Keras converts a layer's ``call`` and a function loss only when
    the AutoGraph status is enabled, so the bodies run under that status: user code gets converted
    exactly as under ``Model.fit``, while dtk's code, like Keras's own, is not.
    """
    from tensorflow.python.autograph.core import ag_ctx  # pylint: disable=g-import-not-at-top
    return ag_ctx.ControlStatusCtx(status=ag_ctx.Status.ENABLED)


def overridden_steps(model: tf_keras.Model) -> tuple[str, ...]:
    """Which of ``train_step`` / ``test_step`` the model's class overrides (keras.io,
    "Customizing what happens in fit()"): dtk then runs the model's own step on the mesh."""
    return tuple(name for name in ("train_step", "test_step")
                 if getattr(type(model), name, None) is not getattr(tf_keras.Model, name))


_LOOPS = itertools.count()


def _loop_name(kind: str) -> str:
    """A name no other while loop of the process has: tf.while_loop names its cond and body
    functions after a per-graph counter ('while6_cond'), and two step functions traced in one
    process could register different bodies under one name in the eager context ("Cannot add
    function 'while6_cond' because a different function with the same name already exists",
    seen under DTensor when many steps are traced in one process)."""
    return f"dtk_{kind}_{next(_LOOPS)}"


def _parts(batch: Any) -> tuple:
    """``(features, labels, weights, examples)`` of a batch of 3 or 4 parts
    (``dtk.data.input.Batch``: ``examples`` only for data that carries sample weights)."""
    parts = tuple(batch)
    return parts + (None,) * (4 - len(parts))


def _step_of(stack: Any, i: Any) -> tuple:
    """Batch ``i`` of a stack ``[n, B, ...]`` (``tf.gather``: indexing fails under DTensor)."""
    return tuple(None if part is None else tf.nest.map_structure(lambda t: tf.gather(t, i), part)
                 for part in stack)


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


def _metric_weights(weights: tf.Tensor, mask: tf.Tensor | None) -> tf.Tensor:
    """A metric's sample weights: the examples' (0 on padding), times the output mask where the
    output carries one (as Keras's compiled metrics apply it)."""
    if mask is None:
        return weights
    return mask * tf.reshape(weights, [-1] + [1] * (mask.shape.rank - 1))


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
        mesh = as_mesh(mesh, "mesh")
        self.model = model
        self.mesh = mesh
        self.config = config
        self.loss_fn = make_loss(loss)
        self.optimizer = make_optimizer(optimizer, mesh)
        self.metrics = make_metrics(metrics, mesh)
        self.loss_metric = tf_keras.metrics.Mean(name="loss", mesh=mesh)
        check_batch_axis(mesh, config.batch_axis, what="StepConfig.batch_axis")
        self.trace_counts = {"train": 0, "evaluate": 0, "predict": 0}
        self._random_ops_checked = False
        self._masters = None
        self._split: list[bool] = []
        self.remat_layers = remat.apply(model, config.remat) if config.remat else []
        # A model that overrides train_step / test_step runs its own step (see _custom_train).
        self.custom = overridden_steps(model)
        self._last_custom = False
        self._logs: dict[str, dict[str, tf.Variable]] = {}  # a model's own step's logs
        if self.custom:
            self._prepare_custom_steps(loss, config)
        self.sparse, why_dense = sparse_lib.choose(
            model, self.optimizer, config.sparse_tables, batch_axis=config.batch_axis,
            accumulation=config.gradient_accumulation_steps, custom_step="train_step" in self.custom)
        for layer in sparse_lib.tables_of(model) if self.sparse is None else ():
            ops.warn_dense_table_update(layer, why_dense)
        # What the model's optimizer updates: every trainable weight but the sparse tables.
        self._dense_variables = [v for v in model.trainable_variables
                                 if self.sparse is None or not self.sparse.is_table(v)]
        shard = config.shard_optimizer_state
        if any(isinstance(getattr(v, "_variable", v), fsdp.GatheredVariable)
               for v in model.trainable_variables) or "train_step" in self.custom:
            # FSDP: weights and state are stored sharded, the update is too. A model's own
            # train_step applies its gradients itself, to the model's variables.
            shard = False
        elif shard == "auto":
            shard = auto_shard_optimizer_state(self._dense_variables, mesh, config.batch_axis)
        self.shard_optimizer_state = shard
        with materialize.shared_handle_compilation():  # masters and slots: one compile a shape
            self._create_state(shard)
        materialize.release_free_memory()  # what building the state freed (dtk.parallel.materialize)
        train_body = self._custom_train_body if "train_step" in self.custom else self._train_body
        self._train_one = self._compile(train_body, "train", stacked=False)
        self._train_many = self._compile(train_body, "train", stacked=True)
        self._evaluate = self._compile(
            self._custom_eval_body if "test_step" in self.custom else self._eval_body,
            "evaluate", stacked=False)
        self._predict = _function(self._predict_body, jit_compile=config.jit_compile)
        self._take = tf.function(autograph=False, func=lambda stack, i: _step_of(stack, i))

    def _create_state(self, shard: bool) -> None:
        """The sharded update's float32 masters (where ``shard``) and the optimizer's slots.

        Under ``shard`` the weights that ``update_layout`` splits get a master laid out like their
        state; the others are their own (updated in place, as without ``shard``).
        """
        # Under mixed precision the weights are AutoCastVariables: the float32 DVariables are
        # what the optimizer updates and builds its slots on.
        own = [getattr(v, "_variable", v) for v in self._dense_variables]
        if shard:
            variables = self._dense_variables
            self._model_layouts = [dtensor.fetch_layout(v) for v in variables]
            self._master_layouts = [update_layout(v, self.mesh, self.config.batch_axis)
                                    for v in variables]
            self._split = [master.sharding_specs != model.sharding_specs for master, model
                           in zip(self._master_layouts, self._model_layouts)]
            self._masters = [
                dtensor.DVariable(dtensor.relayout(v.read_value(), layout), trainable=False,
                                  name=v._shared_name)  # pylint: disable=protected-access
                if split else weight
                for v, weight, layout, split in zip(variables, own, self._master_layouts,
                                                    self._split)]
        # Build optimizer slots eagerly so checkpoints can restore them before the first step.
        self.optimizer.build(self._masters or own)

    # -- a model's own train_step / test_step ----------------------------------------------------
    def _prepare_custom_steps(self, loss, config: StepConfig) -> None:
        """Compiles the laid-out model as ``Model.fit`` would see it: the mesh-bound optimizer,
        loss and metrics (Keras's compile containers are bound to the model's mesh), so that its
        own ``train_step`` (``self.compute_loss``, ``self.optimizer``, ``self.metrics``) runs on
        the mesh. What such a step cannot honour is refused here, before the first step.

        Raises:
          ValueError: FSDP, gradient accumulation or several steps per call with the model's own
            ``train_step``, naming the method and the fix.
        """
        model = self.model
        name = type(model).__name__
        if "train_step" in self.custom:
            refused = [what for what, on in (
                ("gradient_accumulation_steps > 1", config.gradient_accumulation_steps > 1),
                ("steps_per_execution > 1", config.steps_per_execution > 1),
                ("FSDP", any(isinstance(getattr(v, "_variable", v), fsdp.GatheredVariable)
                             for v in model.trainable_variables))) if on]
            if refused:
                raise ValueError(
                    f"model {name} overrides train_step, which dtk runs as written (its own "
                    f"gradients and update); {' and '.join(refused)} would change that step. "
                    "Drop them for this model (steps_per_execution=1, no accumulation, no FSDP), "
                    "or move the custom logic into call()/add_loss() and use dtk's step")
        model.compile(optimizer=self.optimizer, loss=keras_loss(loss), metrics=self.metrics)
        _log.info("dtk runs %s's own %s on the mesh", name, " and ".join(self.custom))

    def _custom_train_body(self, batch):
        features, labels, weights, examples = _parts(batch)  # no padding (remainder checked)
        data = (features, labels) if examples is None else (features, labels, weights)
        with randomness.step_scope(self.optimizer.iterations.read_value()):
            logs = self.model.train_step(data)
        self._warn_uncovered_random_ops()
        self._keep_logs("train", logs)
        return self._loss_of(logs)

    def _custom_eval_body(self, batch):
        features, labels, weights, examples = _parts(batch)  # Trainer.evaluate refuses padding
        data = (features, labels) if examples is None else (features, labels, weights)
        logs = self.model.test_step(data)
        self._keep_logs("evaluate", logs)
        return self._loss_of(logs)

    def _keep_logs(self, kind: str, logs: Any) -> None:
        """Keeps a model's own step's scalar logs (keras.io's Distiller returns
        ``student_loss`` and ``distillation_loss``, no metric's) in variables on the mesh, as
        Keras's fit reports the last step's logs; ``results()`` reads them."""
        if not isinstance(logs, dict):
            return
        kept = self._logs.setdefault(kind, {})
        for name, value in logs.items():
            if not isinstance(value, tf.Tensor) or value.shape.num_elements() != 1:
                continue
            if name not in kept:
                with tf.init_scope():  # made once, on the mesh, in the first trace
                    kept[name] = dtensor.DVariable(dtensor.call_with_layout(
                        tf.zeros, dtensor.Layout.replicated(self.mesh, 0), shape=[],
                        dtype=tf.float32), trainable=False)
            kept[name].assign(tf.cast(tf.reshape(value, []), tf.float32))

    def _loss_of(self, logs) -> tf.Tensor:
        """The scalar a compiled call returns: the step's ``loss`` log, else 0."""
        value = logs.get("loss") if isinstance(logs, dict) else None
        if value is None:
            return _scalar_zero(self.mesh)
        return tf.cast(tf.reshape(value, []), tf.float32)

    # -- bodies -----------------------------------------------------------------------------------
    def _weighted_loss(self, labels, predictions, weights, examples=None):
        return weighted_loss(self.loss_fn, labels, predictions, weights, examples)

    def _normalized(self, total, count):
        return normalized_loss(self.loss_fn, total, count)

    def _update_metrics(self, loss, count, labels, predictions, weights, mask=None):
        self.loss_metric.update_state(loss, sample_weight=count)
        for metric in self.metrics:
            metric.update_state(self._metric_labels(labels), predictions,
                                sample_weight=_metric_weights(weights, mask))

    def _metric_labels(self, labels):
        """Labels laid out on the batch axis only (a no-op unless sharded along the sequence too,
        ``InputConfig.sequence_axis``): Keras metrics' broadcasts of the sample weights fail in
        DTensor's SPMD expansion on labels sharded on dim 1."""
        if len(self.mesh.dim_names) == 1 or self.config.batch_axis not in self.mesh.dim_names:
            return labels
        return tf.nest.map_structure(
            lambda t: dtensor.relayout(t, dtensor.Layout.batch_sharded(
                self.mesh, self.config.batch_axis, t.shape.rank)) if t.shape.rank >= 2 else t,
            labels)

    def _forward_backward(self, batch, count, variables, extra_losses_scale=1.0):
        """Loss (weighted sum over ``batch``, divided by the whole batch's ``count``) and its
        gradients, with the predictions for the metrics and the model's own losses
        (regularization, ``add_loss``; scaled by ``extra_losses_scale``), which Keras adds to
        the loss it reports."""
        features, labels, weights, examples = _parts(batch)
        if self.sparse is not None:
            self.sparse.start_recording()
        with tf.GradientTape() as tape:
            # Random layers draw for this step (the counter before its update): the same masks
            # on every mesh, and again after a resume (dtk.parallel.randomness). FSDP weights are read
            # gathered (dtk.parallel.fsdp).
            with fsdp.gather_scope(), fsdp.recording() as gathered:
                predictions = self.model(features, training=True)
            self._warn_uncovered_random_ops()
            total, masked, mask = self._weighted_loss(labels, predictions, weights, examples)
            if mask is not None:  # the loss is over the unmasked elements (_weighted_loss)
                count = masked
            loss = self._normalized(total, count)
            penalty = self._model_losses() * extra_losses_scale
            loss = loss + penalty
        mark = fsdp.graph_mark() if gathered else 0
        if self.sparse is not None:  # the tables' gradients as rows: w.r.t. their lookups' outputs
            recorded = self.sparse.lookups()
            grads = tape.gradient(loss, [*variables, *self.sparse.outputs(recorded)])
            grads, row_grads = grads[:len(variables)], grads[len(variables):]
            self._sparse_pending = (recorded, row_grads)
        else:
            grads = tape.gradient(loss, variables)
        if gathered:  # FSDP: the backward pass gathers again rather than hold the forward's
            grads = fsdp.own_buffers(grads, variables, gathered)
            fsdp.regather_for_backward(gathered, mark, {id(v): g for v, g in zip(variables, grads)})
        # Embedding gradients arrive as IndexedSlices, whose scatter update DTensor cannot lay
        # out (ResourceScatterAdd): apply them dense.
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        return total, grads, predictions, penalty, (count, mask)

    def _model_losses(self):
        """The sum of the model's own losses of this call (a float32 scalar; 0 when none)."""
        if not self.model.losses:
            return _scalar_zero(self.mesh)
        return tf.cast(tf.add_n([tf.cast(l, tf.float32) for l in self.model.losses]), tf.float32)

    def _train_body(self, batch):
        features, labels, weights, examples = _parts(batch)
        variables = self._dense_variables
        count = tf.reduce_sum(weights if examples is None else examples)
        k = self.config.gradient_accumulation_steps
        with randomness.step_scope(self.optimizer.iterations.read_value()):
            mask = None
            if k == 1:
                total, grads, predictions, penalty, (normalizer, mask) = self._forward_backward(
                    batch, count, variables)
            else:
                total, grads, penalty = self._accumulate(batch, count, variables, k)
                predictions, normalizer = None, count
        # The reported loss is Keras's: the data loss plus the model's regularization losses.
        loss = self._normalized(total, normalizer) + penalty
        if self.sparse is not None:  # first: lazy Adam reads the step before its increment
            # The touched rows' changes, added in place after the step (Steps.train).
            self._sparse_changes = self.sparse.apply(*self._sparse_pending)

        def update():
            if self._masters is None:
                self.optimizer.apply_gradients(zip(grads, variables))
            else:
                self._sharded_update(grads, variables)
            self.loss_metric.update_state(loss, sample_weight=count)
            if predictions is not None:
                for metric in self.metrics:
                    metric.update_state(self._metric_labels(labels), predictions,
                                        sample_weight=_metric_weights(
                                            weights if examples is None else examples, mask))
            return tf.identity(loss)

        # The update runs in a region of its own (a cond that is always true; no measurable cost):
        # DTensor's all-reduce combining (DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION=1),
        # applied to one block, lets an optimizer slot's read move before its assign (SGD and
        # Adam 20-25% off in 5 steps); in its own region the update keeps its order, and the
        # step matches one device with combining on (BUILD.md, "DTensor settings").
        always = dtensor.call_with_layout(tf.ones, dtensor.Layout.replicated(self.mesh, 0),
                                          shape=[], dtype=tf.bool)
        return tf.cond(always, update, lambda: tf.identity(loss))

    def _accumulate(self, batch, count, variables, k):
        """Sum of the loss and gradients of ``k`` microbatches, run in a loop (one live at a time).

        Each device's rows are viewed as ``[rows / k, k]``; microbatch j takes column j, so the
        split moves no example between devices. Metrics are updated per microbatch (sums, so
        the same as one update on the whole batch).
        """
        check_accumulation(int(tf.nest.flatten(batch[0])[0].shape[0]), self.mesh, k,
                           self.config.batch_axis)

        def split(t):
            rows = t.shape[0]
            return tf.reshape(t, [rows // k, k, *t.shape[1:]])

        parts = tuple(None if part is None else tf.nest.map_structure(split, part)
                      for part in _parts(batch))  # features may be a dict

        def body(j, total, penalty, *acc):
            micro = tuple(None if part is None else tf.nest.map_structure(
                lambda t: tf.gather(t, j, axis=1), part) for part in parts)
            with randomness.microbatch_scope(k, j):
                part_total, grads, predictions, part_penalty, (_, mask) = self._forward_backward(
                    micro, count, variables, extra_losses_scale=1.0 / k)
            if mask is not None:
                raise ValueError(
                    f"gradient_accumulation_steps={k} on a model whose output carries a Keras "
                    "mask: the loss is the mean over the whole batch's unmasked elements, which "
                    "no microbatch knows; drop gradient_accumulation_steps for this model")
            for metric in self.metrics:
                metric.update_state(self._metric_labels(micro[1]), predictions,
                                    sample_weight=micro[2] if micro[3] is None else micro[3])
            return (j + 1, total + part_total, penalty + part_penalty,
                    *[a + g for a, g in zip(acc, grads)])

        zero = tf.zeros_like(count)
        acc = [tf.zeros_like(v.read_value()) for v in variables]
        out = tf.while_loop(lambda j, *_: j < k, body,
                            (tf.constant(0), zero, _scalar_zero(self.mesh), *acc),
                            name=_loop_name("accumulate"))
        return out[1], list(out[3:]), out[2]

    def _warn_uncovered_random_ops(self):
        # Once per Steps: random ops of the forward pass that dtk.parallel.randomness did not build (a
        # layer calling tf.random.* itself) draw per device, so their values depend on the mesh.
        if self._random_ops_checked:
            return
        self._random_ops_checked = True
        found = randomness.uncovered_random_ops(tf.compat.v1.get_default_graph())
        if found:
            where = "; ".join(f"{scope} ({', '.join(types)})" for scope, types in found.items())
            _log.warning(
                "random ops not covered by dtk.parallel.randomness: %s. Their values depend on the mesh "
                "(each device draws with its own seed), so training with them does not match one "
                "device; draw through the layer's self._random_generator (a tf_keras "
                "BaseRandomLayer) to get mesh-independent values", where)

    def _sharded_update(self, grads, variables):
        # Pin each gradient to its weight's layout first: otherwise layout propagation pushes the
        # sharded layout into the gradient's producer (Conv2DBackpropFilter cannot produce it).
        # A weight the update does not split is its own master: its gradient goes as it is.
        grads = [dtensor.relayout(dtensor.relayout(g, model_layout), layout) if split else g
                 for g, model_layout, layout, split in zip(grads, self._model_layouts,
                                                           self._master_layouts, self._split)]
        self.optimizer.apply_gradients(zip(grads, self._masters))
        for variable, master, layout, split in zip(variables, self._masters, self._model_layouts,
                                                   self._split):
            if split:
                variable.assign(dtensor.relayout(master, layout))  # all-gather over the batch axis

    def sync_update_state(self) -> None:
        """Copies the model's weights into the sharded update copies (after restoring weights)."""
        for master, variable, layout, split in zip(
                self._masters or (), self._dense_variables,
                self._master_layouts if self._masters else (), self._split):
            if split:
                master.assign(dtensor.relayout(variable.read_value(), layout))

    def _eval_body(self, batch):
        features, labels, weights, examples = _parts(batch)
        with fsdp.gather_scope():
            predictions = self.model(features, training=False)
            penalty = self._model_losses()
        total, normalizer, mask = self._weighted_loss(labels, predictions, weights, examples)
        loss = self._normalized(total, normalizer) + penalty
        real = weights if examples is None else examples
        # compile(metrics=...) are not weighted by the sample weights in Keras (that is
        # weighted_metrics): they count each real example once.
        self._update_metrics(loss, tf.reduce_sum(real), labels, predictions, real, mask)
        return loss

    def _predict_body(self, features):
        self.trace_counts["predict"] += 1
        with fsdp.gather_scope():
            return self.model(features, training=False)

    def _compile(self, body: Callable, name: str, *, stacked: bool) -> Callable:
        mesh = self.mesh

        def one(batch):
            self.trace_counts[name] += 1
            out = body(batch)
            if name == "train" and self.sparse is not None:
                return out, self._sparse_changes
            return out

        def many(stack):
            self.trace_counts[name] += 1
            n = tf.shape(tf.nest.flatten(stack[1])[0])[0]

            def step(i, loss):  # pylint: disable=unused-argument
                # features and labels may be nests (a dict of inputs, several outputs)
                return i + 1, body(_step_of(stack, i))

            _, loss = tf.while_loop(lambda i, _: i < n, step,
                                    (tf.zeros_like(n), _scalar_zero(mesh)),
                                    name=_loop_name("steps"))
            return loss

        # One trace per stack length (reduce_retracing's generalized trace of this while loop
        # failed under DTensor now and then: "Cannot add function 'while8_body'").
        return _function(many if stacked else one, jit_compile=self.config.jit_compile)

    # -- public -----------------------------------------------------------------------------------
    def train(self, batch, *, stacked: bool | None = None) -> tf.Tensor:
        """Runs one compiled call: one step, or ``n`` steps on a stacked ``[n, B, ...]`` batch.

        ``stacked`` says which (default: ``config.steps_per_execution > 1``).
        """
        if stacked is None:
            stacked = self.config.steps_per_execution > 1
        if stacked and "train_step" in self.custom:
            raise ValueError(f"model {type(self.model).__name__} overrides train_step, which dtk "
                             "runs one step per call: give unstacked batches "
                             "(steps_per_execution=1)")
        self._last_custom = "train" if "train_step" in self.custom else False
        if self.sparse is None:
            return (self._train_many if stacked else self._train_one)(tuple(batch))
        # Sparse tables: each step's touched rows are added in place between compiled calls
        # (dtk.train.sparse), so a stack runs as one call per step.
        if not stacked:
            loss, changes = self._train_one(tuple(batch))
            self.sparse.scatter(changes)
            return loss
        count = int(tf.nest.flatten(batch[1])[0].shape[0])
        for i in range(count):
            index = dtensor.copy_to_mesh(tf.constant(i), dtensor.Layout.replicated(self.mesh, 0))
            loss, changes = self._train_one(self._take(tuple(batch), index))
            self.sparse.scatter(changes)
        return loss

    def evaluate(self, batch) -> tf.Tensor:
        """Accumulates loss and metrics over one (unstacked) batch; updates nothing else."""
        self._last_custom = "evaluate" if "test_step" in self.custom else False
        return self._evaluate(tuple(batch))

    def predict(self, features) -> tf.Tensor:
        """The model's outputs for one (unstacked) batch of features, batch-sharded."""
        return self._predict(features)

    def reset_metrics(self) -> None:
        for metric in [self.loss_metric, *self.metrics]:
            metric.reset_state()
        if self.custom:
            self.model.reset_metrics()

    def results(self) -> dict[str, float]:
        """Current metric values as Python floats (this waits for pending steps).

        After the model's own ``train_step`` / ``test_step``: the last step's logs, as
        ``Model.fit`` reports them (its metrics' results, and any other scalar it returns).
        """
        if self._last_custom:
            logs = {m.name: float(m.result()) for m in self.model.metrics}
            logs.update({name: float(v.numpy())
                         for name, v in self._logs.get(self._last_custom, {}).items()})
            return logs
        return {m.name: float(m.result()) for m in [self.loss_metric, *self.metrics]}
