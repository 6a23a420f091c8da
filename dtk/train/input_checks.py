"""What a model takes against what the data gives, checked before any step.

A batch of the wrong shape, a dict of features into a one-input model, or class ids into a loss
that compares outputs element by element fail inside Keras's traced step, in Keras's words
(``Input 0 of layer "mnist_mlp" is incompatible``, ``Missing data for input "flatten_input"``,
``Dimensions must be equal, but are 10 and 32 for SquaredDifference``), naming neither the
argument nor the fix. ``dtk.Trainer`` and ``dtk.distribute`` models both check here, on the
per-example shapes of their input (a ``tf.data`` element spec or a numpy array's), so that the
two paths refuse the same mistakes in the same words.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor

from dtk.parallel.mesh import BATCH_AXIS

# Losses that compare a prediction with a target of the same shape: class ids (one number per
# example) against a vector of class scores is the mistake of compiling a classifier with them.
_ELEMENTWISE = frozenset({
    "mean_squared_error", "mean_absolute_error", "mean_absolute_percentage_error",
    "mean_squared_logarithmic_error", "huber_loss", "log_cosh", "kl_divergence",
    "categorical_crossentropy", "binary_crossentropy", "categorical_hinge", "hinge",
    "squared_hinge", "poisson", "cosine_similarity"})


def _shape(value: Any) -> tuple | None:
    """The shape of ``value`` (a spec, tensor or array of ONE example: the callers drop the
    batch dim), or None where it has none or its rank is unknown."""
    shape = getattr(value, "shape", None)
    if shape is None:
        return None
    shape = tf.TensorShape(shape)
    return None if shape.rank is None else tuple(shape.as_list())


def check_features(model: tf_keras.Model, features: Any, where: str) -> None:
    """Refuses features a one-input model cannot take, naming ``where`` and the fix.

    Args:
      model: a built tf_keras model (one without ``inputs``, e.g. an unbuilt subclassed model,
        is not checked).
      features: one example's features: a ``tf.TensorSpec``/array-like with that shape, or a
        dict of them.
      where: the argument, as the message names it (e.g. ``"fit(x=...)"``, ``"data"``).

    Raises:
      ValueError: a dict into a model of one unnamed-for-it input, or a shape that differs from
        the model's ``Input`` in a known dim (a missing trailing dim of 1 is Keras's to add).
    """
    inputs = getattr(model, "inputs", None) or []
    if len(inputs) != 1:
        return
    want = tuple(inputs[0].shape.as_list()[1:]) if inputs[0].shape.rank is not None else None
    name = getattr(model, "input_names", None) or [inputs[0].name]
    if isinstance(features, dict):
        if set(features) != {name[0]}:
            raise ValueError(
                f"{where}: the features are a dict with keys {sorted(features)}, but model "
                f"{model.name!r} takes one input, {name[0]!r} of shape {want}; map the data to "
                f"(features[{sorted(features)[0]!r}], labels) with dataset.map, or name the "
                f"model's Input {sorted(features)[0]!r}")
        features = features[name[0]]
    got = _shape(features)
    if got is None or want is None:
        return
    if len(got) == len(want) - 1 and want[-1] == 1:
        got = got + (1,)  # Keras adds a trailing dim of 1 itself
    differs = len(got) != len(want) or any(
        g is not None and w is not None and g != w for g, w in zip(got, want))
    if differs:
        raise ValueError(
            f"{where}: one example's features have shape {got}, but model {model.name!r} takes "
            f"{want} (its Input {name[0]!r}); reshape or resize them in the input pipeline "
            f"(dataset.map), or build the model for {got}")


def loss_name(loss: Any) -> str | None:
    """The Keras function name of a loss given as a name, a ``tf_keras.losses.Loss``, its bound
    ``call`` or a function; None where it is none of Keras's."""
    if isinstance(loss, str):
        try:
            loss = tf_keras.losses.get(loss)
        except ValueError:
            return None
    owner = getattr(loss, "__self__", loss)  # a Loss's bound call
    fn = getattr(owner, "fn", owner)
    return getattr(fn, "__name__", None)


def check_targets(model: tf_keras.Model, loss: Any, labels: Any, where: str) -> None:
    """Refuses class ids (one number per example) into a loss that compares the model's output
    element by element (``mse``, ``categorical_crossentropy``...), where the output holds one
    score per class: Keras fails inside the step, or broadcasts without a word.

    Raises:
      ValueError: naming the loss, the two shapes and the two fixes.
    """
    outputs = getattr(model, "outputs", None) or []
    name = loss_name(loss)
    if len(outputs) != 1 or name not in _ELEMENTWISE or isinstance(labels, dict):
        return
    got = _shape(labels)
    out = outputs[0].shape
    if got is None or out.rank != 2 or out[-1] is None or out[-1] < 2:
        return
    if got in ((), (1,)):
        classes = int(out[-1])
        raise ValueError(
            f"{where}: the labels are one number per example (shape {got}), but the loss "
            f"{name!r} compares them with the {classes} scores per example that model "
            f"{model.name!r} outputs; for class ids use loss='sparse_categorical_crossentropy' (from_logits="
            f"True for logits), or give one-hot labels of shape ({classes},)")


def example_count(value: Any) -> int | None:
    """The number of examples of an array argument (its first leaf's first dim), else None."""
    for leaf in tf.nest.flatten(value):
        if isinstance(leaf, np.ndarray) and leaf.ndim:
            return int(leaf.shape[0])
        if isinstance(leaf, tf.Tensor) and leaf.shape.rank and leaf.shape[0] is not None:
            return int(leaf.shape[0])
    return None


def check_accumulation(global_batch_size: int, mesh: dtensor.Mesh, steps: int,
                       batch_axis: str = BATCH_AXIS) -> None:
    """Gradient accumulation over ``steps`` microbatches needs each device's share of the batch
    to split evenly.

    Raises:
      ValueError: naming the batch, the axis and its size, and the values that would work.
    """
    if steps == 1:
        return
    size = mesh.dim_size(batch_axis) if batch_axis in mesh.dim_names else 1
    per_device = global_batch_size // size
    if per_device % steps:
        good = [k for k in range(1, per_device + 1) if per_device % k == 0]
        raise ValueError(
            f"gradient_accumulation_steps={steps} (--grad_accum) does not divide the per-device "
            f"batch: global batch {global_batch_size} over mesh axis {batch_axis!r} (size {size}) "
            f"is {per_device} examples per device. Use a divisor of {per_device} "
            f"({', '.join(map(str, good[:8]))}{' ...' if len(good) > 8 else ''}) or change "
            "--global_batch_size")
