"""Mesh-bound optimizers, metrics and losses: made by name or checked when given as instances.

Why: an optimizer or a metric that is not bound to the mesh (created without ``mesh=``) runs without
error under DTensor and gives wrong numbers (dtensor-notes, trap 3: accuracy 0.017 instead of 0.094
on the same predictions). ``tf_keras.optimizers.legacy.*`` cannot be bound at all. So dtk creates
these objects itself, bound to the mesh, or refuses an instance that is not.

Example::

    opt = dtk.make_optimizer("adam", mesh, learning_rate=1e-3)
    metrics = dtk.make_metrics(["accuracy"], mesh)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, Union

import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor

from dtk.keras_check import require_keras2
from dtk.parallel.mesh import as_mesh

_log = logging.getLogger("dtk")

OPTIMIZERS: dict[str, str] = {
    "sgd": "SGD",
    "adam": "Adam",
    "adamw": "AdamW",
    "rmsprop": "RMSprop",
    "adagrad": "Adagrad",
    "adadelta": "Adadelta",
    "adamax": "Adamax",
    "ftrl": "Ftrl",
    "lion": "Lion",
    "adafactor": "Adafactor",
}
# State tensors per weight of each optimizer with its defaults, for memory estimates (the plan).
SLOTS: dict[str, int] = {"sgd": 0, "adam": 2, "adamw": 2, "rmsprop": 1, "adagrad": 1,
                         "adadelta": 2, "adamax": 2, "ftrl": 2, "lion": 1, "adafactor": 2}
# Optimizers that run under DTensor but do not match single-device training (dtensor-notes).
_UNSUPPORTED_OPTIMIZERS = {
    "nadam": "it keeps a plain tf.Variable (its momentum-decay product) that DTensor does not "
             "replicate, so its updates differ from single-device training by up to 0.4",
}

def check_supported(optimizer: Any, argument: str) -> None:
    """Refuses an optimizer class that runs under DTensor but does not match one device.

    Raises:
      ValueError: naming ``argument``, the class, the reason and the fix.
    """
    reason = _UNSUPPORTED_OPTIMIZERS.get(type(optimizer).__name__.lower())
    if reason:
        raise ValueError(f"{argument} {type(optimizer).__name__} is not supported under DTensor: "
                         f"{reason}; use Adam or AdamW")


METRICS: dict[str, str] = {
    "sparse_categorical_accuracy": "SparseCategoricalAccuracy",
    "top5": "SparseTopKCategoricalAccuracy",
    "sparse_top_k_categorical_accuracy": "SparseTopKCategoricalAccuracy",
    "sparse_categorical_crossentropy": "SparseCategoricalCrossentropy",
    "mae": "MeanAbsoluteError",
    "mean_absolute_error": "MeanAbsoluteError",
    "mse": "MeanSquaredError",
    "mean_squared_error": "MeanSquaredError",
}

LOSSES: dict[str, Callable[[], tf_keras.losses.Loss]] = {
    "sparse_categorical_crossentropy": lambda: tf_keras.losses.SparseCategoricalCrossentropy(
        from_logits=True),
    "categorical_crossentropy": lambda: tf_keras.losses.CategoricalCrossentropy(from_logits=True),
    "binary_crossentropy": lambda: tf_keras.losses.BinaryCrossentropy(from_logits=True),
    "mse": tf_keras.losses.MeanSquaredError,
    "mean_squared_error": tf_keras.losses.MeanSquaredError,
    "mae": tf_keras.losses.MeanAbsoluteError,
}

OptimizerLike = Union[str, tf_keras.optimizers.Optimizer]
MetricLike = Union[str, tf_keras.metrics.Metric]


def _same_mesh(a: Any, mesh: dtensor.Mesh) -> bool:
    return a is not None and (a is mesh or a == mesh)


def make_optimizer(optimizer: OptimizerLike, mesh: dtensor.Mesh, **kwargs: Any
                   ) -> tf_keras.optimizers.Optimizer:
    """Returns an optimizer bound to ``mesh``: made from a name, or checked if given as an instance.

    Args:
      optimizer: a name (``sgd``, ``adam``, ``adamw``, ``rmsprop``, ``adagrad``, ...) or an instance
        of a non-legacy ``tf_keras.optimizers.Optimizer`` created with ``mesh=mesh``.
      mesh: the mesh the model's weights live on.
      **kwargs: constructor arguments for a named optimizer (``learning_rate``, ``momentum``,
        ``clipnorm``, ``global_clipnorm``, ``weight_decay`` ...). ``None`` values are dropped.

    Raises:
      ValueError: an unknown or unsupported name, a legacy optimizer, an instance not bound to the
        mesh, or kwargs given together with an instance.
    """
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    mesh = as_mesh(mesh, "mesh")
    require_keras2(optimizer, "optimizer")
    rate = kwargs.get("learning_rate")
    if isinstance(rate, (int, float)) and not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"learning_rate must be a positive, finite number; got {rate!r}")
    if isinstance(optimizer, str):
        key = optimizer.strip().lower()
        if key in _UNSUPPORTED_OPTIMIZERS:
            raise ValueError(f"optimizer {optimizer!r} is not supported under DTensor: "
                             f"{_UNSUPPORTED_OPTIMIZERS[key]}; use 'adam' or 'adamw'")
        if key not in OPTIMIZERS:
            raise ValueError(f"optimizer {optimizer!r} is unknown; choose one of "
                             f"{', '.join(sorted(OPTIMIZERS))}, or pass an instance created with "
                             "mesh=mesh")
        cls = getattr(tf_keras.optimizers, OPTIMIZERS[key])
        try:
            return keep_ema_on_mesh(cls(mesh=mesh, **kwargs))
        except TypeError as e:
            raise ValueError(f"optimizer {optimizer!r}: bad arguments {kwargs}: {e}") from e
    if kwargs:
        raise ValueError(f"optimizer arguments {sorted(kwargs)} only apply to an optimizer given by "
                         f"name; {type(optimizer).__name__} is already constructed")
    if isinstance(optimizer, tf_keras.optimizers.legacy.Optimizer):
        raise ValueError(
            f"optimizer {type(optimizer).__name__} is a legacy tf_keras optimizer, which cannot be "
            "bound to a DTensor mesh (it rejects mesh=); use tf_keras.optimizers."
            f"{type(optimizer).__name__}(mesh=mesh, ...) or pass its name")
    if not isinstance(optimizer, tf_keras.optimizers.Optimizer):
        raise TypeError(f"optimizer must be a name or a tf_keras.optimizers.Optimizer; got "
                        f"{type(optimizer).__name__}")
    check_supported(optimizer, "optimizer")
    if not _same_mesh(getattr(optimizer, "_mesh", None), mesh):
        raise ValueError(
            f"optimizer {type(optimizer).__name__} is not bound to the mesh: without mesh= it runs "
            "under DTensor but computes wrong updates. Create it with "
            f"tf_keras.optimizers.{type(optimizer).__name__}(mesh=mesh, ...) or pass its name")
    return keep_ema_on_mesh(optimizer)


def keep_ema_on_mesh(optimizer: tf_keras.optimizers.Optimizer) -> tf_keras.optimizers.Optimizer:
    """Makes a mesh-bound optimizer with ``use_ema=True`` keep its moving average of the weights.

    tf_keras's DTensor path (``mesh=``) skips the EMA update that its other paths make after
    every step (and the overwrite every ``ema_overwrite_frequency`` steps): the averages stay at
    the initial weights, and ``finalize_variable_values`` at the end of ``fit`` puts those back
    into the model, silently. Here the update runs after each step, as the non-DTensor path
    runs it. Returns ``optimizer``.
    """
    if not getattr(optimizer, "use_ema", False) or getattr(optimizer, "_dtk_ema", False):
        return optimizer
    from tf_keras.src.optimizers import optimizer as keras_optimizer  # pylint: disable=g-import-not-at-top
    base = keras_optimizer._BaseOptimizer  # pylint: disable=protected-access
    apply = optimizer._internal_apply_gradients  # pylint: disable=protected-access

    def internal_apply_gradients(grads_and_vars):
        grads_and_vars = list(grads_and_vars)
        iteration = apply(grads_and_vars)
        var_list = [v for _, v in grads_and_vars]
        base._update_model_variables_moving_average(optimizer, var_list)  # pylint: disable=protected-access
        if optimizer.ema_overwrite_frequency:
            tf.cond(tf.equal(optimizer.iterations % optimizer.ema_overwrite_frequency, 0),
                    lambda: base._overwrite_model_variables_with_average_value(  # pylint: disable=protected-access
                        optimizer, var_list), lambda: None)
        return iteration

    optimizer._internal_apply_gradients = internal_apply_gradients  # pylint: disable=protected-access
    optimizer._dtk_ema = True  # pylint: disable=protected-access
    return optimizer


# Names Keras resolves from the shapes of the labels and predictions (compile_utils'
# MetricsContainer): binary, sparse categorical or categorical, as the first batch shows.
_RESOLVED = {"accuracy": ("binary_accuracy", "sparse_categorical_accuracy",
                          "categorical_accuracy"),
             "crossentropy": ("binary_crossentropy", "sparse_categorical_crossentropy",
                              "categorical_crossentropy")}
_RESOLVED.update(acc=_RESOLVED["accuracy"], ce=_RESOLVED["crossentropy"])


def resolved_metric_fn(key: str) -> Callable:
    """Keras's ``"accuracy"`` (``"acc"``, ``"crossentropy"``, ``"ce"``): the binary, sparse or
    categorical function, chosen when traced from the static shapes as ``Model.compile`` does.

    Predictions with a last dim of 1 are binary; labels of lower rank than the predictions, or
    with a last dim of 1 against several classes, are class ids (sparse); else one-hot labels.
    """
    names = _RESOLVED[key]

    def resolved(y_true, y_pred):
        t_shape, p_shape = y_true.shape.as_list(), y_pred.shape.as_list()
        if p_shape[-1] == 1:
            name = names[0]
        elif len(t_shape) < len(p_shape) or (t_shape[-1] == 1 and p_shape[-1] > 1):
            name = names[1]
        else:
            name = names[2]
        return getattr(tf_keras.metrics, name)(y_true, y_pred)

    resolved.__name__ = key
    return resolved


def make_metric(metric: MetricLike, mesh: dtensor.Mesh) -> tf_keras.metrics.Metric:
    """Returns a metric bound to ``mesh`` (see ``make_optimizer`` for why).

    ``"accuracy"``/``"acc"`` and ``"crossentropy"``/``"ce"`` mean what they mean in
    ``Model.compile``: the binary, sparse or categorical variant, chosen from the shapes of the
    labels and predictions (``resolved_metric_fn``).
    """
    require_keras2(metric, "metric")
    if isinstance(metric, str):
        key = metric.strip().lower()
        if key in _RESOLVED:
            return tf_keras.metrics.MeanMetricWrapper(resolved_metric_fn(key), name=key,
                                                      mesh=mesh)
        class_name = METRICS.get(key)
        candidate = getattr(tf_keras.metrics, metric, None)
        if class_name is None and isinstance(candidate, type) and issubclass(
                candidate, tf_keras.metrics.Metric):
            class_name = metric
        if class_name is None:
            raise ValueError(f"metric {metric!r} is unknown; use one of "
                             f"{', '.join(sorted([*METRICS, *_RESOLVED]))} "
                             "or a tf_keras.metrics class name, or pass an instance created with "
                             "mesh=mesh")
        name = key if key in METRICS else None
        return getattr(tf_keras.metrics, class_name)(mesh=mesh, name=name)
    if not isinstance(metric, tf_keras.metrics.Metric):
        raise TypeError(f"metric must be a name or a tf_keras.metrics.Metric; got "
                        f"{type(metric).__name__}")
    if not _same_mesh(getattr(metric, "_mesh", None), mesh):
        # As compile() takes any metric object: the same metric (class and config) made again
        # on the mesh, where its class takes mesh= (tf_keras's built-in metrics do).
        try:
            rebuilt = type(metric)(**metric.get_config(), mesh=mesh)
        except (TypeError, ValueError, NotImplementedError):
            rebuilt = None
        if rebuilt is None or not _same_mesh(getattr(rebuilt, "_mesh", None), mesh):
            raise ValueError(
                f"metric {metric.name!r} ({type(metric).__name__}) is not bound to the mesh: "
                "without mesh= it runs under DTensor but reports wrong values, and dtk cannot "
                "make it again with mesh= (its class does not take it). Create it with "
                f"{type(metric).__name__}(..., mesh=mesh) or pass a built-in metric's name")
        _log.info("metric %r (%s): made again on the mesh from its config (the training's "
                  "logs report it; the object given is not updated)", metric.name,
                  type(metric).__name__)
        return rebuilt
    return metric


def check_metrics_form(metrics: Any) -> None:
    """Refuses Keras' per-output dict of metrics, before anything is built."""
    if isinstance(metrics, dict):
        raise TypeError("metrics must be a name, a metric, or a list of them; got a dict with "
                        f"keys {sorted(map(str, metrics))} (Keras' per-output form), which dtk "
                        "does not support: dtk models have one output. Pass the list, e.g. "
                        "metrics=['accuracy']")


def make_metrics(metrics: Sequence[MetricLike] | MetricLike | None, mesh: dtensor.Mesh
                 ) -> list[tf_keras.metrics.Metric]:
    """``make_metric`` for each; one metric (a name or an instance) or None work too, as in Keras'
    ``compile``. Names must be unique, since they key the logs."""
    mesh = as_mesh(mesh, "mesh")
    check_metrics_form(metrics)
    if metrics is None:
        metrics = []
    elif isinstance(metrics, (str, tf_keras.metrics.Metric)):
        metrics = [metrics]
    made = [make_metric(m, mesh) for m in metrics]
    names = [m.name for m in made]
    duplicates = sorted({n for n in names if names.count(n) > 1} | ({"loss"} & set(names)))
    if duplicates:
        raise ValueError(f"metric names {duplicates} are repeated (or 'loss', which dtk reports "
                         "itself); give each metric a unique name")
    return made


def keras_loss(loss: Any) -> Any:
    """A loss given to dtk (the Trainer, ``Steps``), for Keras's ``compile()``: dtk's names
    are losses on logits (``dtk.make_loss``); a ``reduction="none"`` loss is refused (a step
    needs one number)."""
    make_loss(loss)  # validates: a known name, a reduction, a callable
    if isinstance(loss, str):
        return LOSSES[loss.strip().lower()]()
    return loss


def _is_keras_wrapper(value: Any) -> bool:
    """Keras's tracked containers (``_DictWrapper``, ``ListWrapper``): what ``model.loss`` holds
    after ``compile(loss={...})``."""
    return type(value).__name__ in ("_DictWrapper", "ListWrapper")


class _SumLoss:
    """A per-example loss whose reduction is a sum over the global batch (``reduction="sum"``)."""

    sum_over_batch = True

    def __init__(self, fn: Callable):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)

    def __call__(self, labels, predictions):
        return self.fn(labels, predictions)


class _PerOutputLoss:
    """Keras's per-output losses (``compile(loss={...} or [...], loss_weights=...)``): each
    output's per-example loss (averaged over its other dims), weighted and summed, so that dtk's
    mean over the global batch is Keras's sum of weighted per-output means."""

    def __init__(self, losses: dict | list, weights: dict | list | None, names: list[str] | None):
        self.keys = list(losses) if isinstance(losses, dict) else list(range(len(losses)))
        self.fns = {k: make_loss(losses[k]) for k in self.keys}
        for k, fn in self.fns.items():
            if getattr(fn, "sum_over_batch", False):
                raise ValueError(f"loss for output {k!r} has reduction='sum'; per-output losses "
                                 "must use the default reduction (the mean over the batch)")
        if weights is None:
            weights = {k: 1.0 for k in self.keys}
        elif isinstance(weights, (list, tuple)):
            if len(weights) != len(self.keys):
                raise ValueError(f"loss_weights has {len(weights)} entries for {len(self.keys)} "
                                 "losses; give one weight per output")
            weights = dict(zip(self.keys, weights))
        unknown = sorted(map(str, set(weights) - set(self.keys)))
        if unknown:
            raise ValueError(f"loss_weights names outputs {unknown} that have no loss; the losses "
                             f"are for {[str(k) for k in self.keys]}")
        self.weights = {k: float(weights.get(k, 1.0)) for k in self.keys}
        self.names = names
        self.__name__ = "per_output_loss"

    def _pick(self, values, key):
        if isinstance(values, dict):
            if key not in values:
                raise ValueError(f"the loss is given for output {key!r}, but the model's outputs "
                                 f"(or the labels) are keyed {sorted(map(str, values))}; key the "
                                 "losses and labels by the model's output names")
            return values[key]
        if isinstance(key, str):  # a dict of losses for a model with a list of outputs
            if not self.names or key not in self.names:
                raise ValueError(f"the loss is given for output {key!r}, which is not one of the "
                                 f"model's outputs {self.names}")
            return values[self.names.index(key)]
        return values[key]

    def __call__(self, labels, predictions):
        total = None
        for k in self.keys:
            per = self.fns[k](self._pick(labels, k), self._pick(predictions, k))
            per = tf.cast(per, tf.float32)
            if per.shape.rank > 1:
                per = tf.reduce_mean(tf.reshape(per, [tf.shape(per)[0], -1]), axis=1)
            per = per * self.weights[k]
            total = per if total is None else total + per
        return total


def make_loss(loss: str | tf_keras.losses.Loss | Callable, *,
              loss_weights: dict | list | None = None,
              output_names: list[str] | None = None) -> Callable:
    """Returns a function ``(labels, predictions) -> per-example losses [B]``.

    dtk reduces per-example losses itself, over the GLOBAL batch, weighted by the pad mask, so
    that every mesh gives the loss of one device:

    - ``reduction="sum_over_batch_size"`` or ``"auto"`` (Keras' default): the mean over the
      global batch's real examples;
    - ``reduction="sum"``: the sum over the global batch's real examples (gradients scale with
      the global batch size, as on one device);
    - ``reduction="none"`` is refused: a step needs one number.

    Named losses expect logits (``from_logits=True``), as dtk's reference models output. A dict
    (keyed by output name) or list of losses, with optional ``loss_weights``, is Keras's
    per-output form: the weighted sum of each output's loss.

    Raises:
      ValueError: an unknown name or ``reduction="none"``.
    """
    require_keras2(loss, "loss")
    if isinstance(loss, (dict, list, tuple)) or _is_keras_wrapper(loss):
        loss = dict(loss) if isinstance(loss, dict) or hasattr(loss, "keys") else list(loss)
        if isinstance(loss_weights, dict) or hasattr(loss_weights, "keys"):
            loss_weights = dict(loss_weights)
        elif loss_weights is not None:
            loss_weights = list(loss_weights)
        return _PerOutputLoss(loss, loss_weights, output_names)
    if loss_weights is not None:
        raise ValueError("loss_weights apply to per-output losses (a dict or list of losses); "
                         f"the loss is one {type(loss).__name__}")
    if isinstance(loss, str):
        key = loss.strip().lower()
        if key not in LOSSES:
            raise ValueError(f"loss {loss!r} is unknown; use one of {', '.join(sorted(LOSSES))} or "
                             "pass a tf_keras.losses.Loss")
        loss = LOSSES[key]()
    if isinstance(loss, tf_keras.losses.Loss):
        reduction = getattr(loss, "reduction", "auto")
        if reduction == tf_keras.losses.Reduction.NONE:
            raise ValueError(
                f"loss {type(loss).__name__} has reduction='none'; dtk needs one number per step "
                "and reduces over the global batch itself: use the default reduction (mean over "
                "the global batch) or reduction='sum'")
        if reduction == tf_keras.losses.Reduction.SUM:
            return _SumLoss(loss.call)
        return loss.call
    if callable(loss):
        return loss
    raise TypeError(f"loss must be a name, a tf_keras.losses.Loss or a callable; got "
                    f"{type(loss).__name__}")
