"""String and lookup preprocessing layers at the front of a model, run on the host.

``TextVectorization``, ``StringLookup``, ``IntegerLookup`` and ``Hashing`` compute with string
and hash-table ops that DTensor cannot lay out (``Discretization`` with ``Bucketize``, where dtk's
in-step replacement does not cover its mode) (``'tf.StringLower' op does not implement layout
propagation``; a lookup's table is a host resource). Keras's own advice is to run them in the
input pipeline; ``dtk.distribute`` does it for the user: when a ``Sequential`` model starts with
such layers, they stay plain (adapted as the factory adapted them) and run on each batch on the
host, before it is laid out; the rest of the model is what dtk lays out on the mesh. ``fit``,
``evaluate``, ``predict`` and an eager call take the raw inputs (strings) as the factory's model
does, with plain Keras's numbers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import tensorflow as tf
import tf_keras

_log = logging.getLogger("dtk")


def _on_host(layer: Any) -> bool:
    from dtk.parallel.layouts import runs_on_host  # pylint: disable=g-import-not-at-top
    return runs_on_host(layer)


def split(model_factory: Callable[[], tf_keras.Model], seed: int
          ) -> tuple[tf_keras.Model, Callable[[], tf_keras.Model], dict]:
    """``(host, device_factory, compiled)`` when ``model_factory()`` is a ``Sequential`` whose first layers
    are host preprocessing layers, else None. ``host``: those layers, plain (built and adapted by
    the factory); ``device_factory``: the rest of the model, its layers made again from their
    configs with the plain build's initial weights (so the laid-out model starts where the
    factory's model does); ``compiled``: what the factory compiled its model with
    (``layouts.compiled_settings``).

    Raises:
      ValueError: no such layers first (the factory builds another model each time), a host
        layer after a layer dtk lays out, or a layer of the rest that cannot be made again from
        its config, named, with the fix.
    """
    from dtk.parallel import layouts  # pylint: disable=g-import-not-at-top
    tf_keras.utils.set_random_seed(seed)
    plain = model_factory()
    if not isinstance(plain, tf_keras.Sequential) or not plain.built:
        raise ValueError(
            f"model_factory built {type(plain).__name__} {plain.name!r}, not the built Sequential "
            "it built before: dtk runs leading string preprocessing layers on the host and needs "
            "the same built model from every call (give the Sequential an Input)")
    layers = plain.layers
    count = 0
    while count < len(layers) and _on_host(layers[count]):
        count += 1
    later = [layer for layer in layers[count:] if _on_host(layer)]
    if later:
        raise ValueError(
            f"layer {later[0].name!r} ({type(later[0]).__name__}) comes after layers dtk lays out "
            "on the mesh: dtk runs string and lookup preprocessing on the host, before the batch "
            "is laid out, so such layers must come first in the model (or run in the input "
            "pipeline, as Keras advises)")
    host = tf_keras.Sequential([tf_keras.Input(tuple(plain.input.shape[1:]),
                                               dtype=plain.input.dtype), *layers[:count]],
                               name=f"{plain.name}_host_inputs")
    out = layers[count - 1].output
    tail_weights = [w.numpy() for w in _tail_weights(layers[count:])]
    configs = []
    for layer in layers[count:]:
        try:
            configs.append((type(layer), layer.get_config()))
        except NotImplementedError:
            raise ValueError(
                f"layer {layer.name!r} ({type(layer).__name__}) follows the host preprocessing "
                f"layers {[l.name for l in layers[:count]]}: dtk makes the model's remaining "
                "layers again from their configs to lay them out without those, and this one has "
                "no get_config(); give its class a get_config() that returns its constructor's "
                "arguments, or move the preprocessing into the input pipeline") from None
    shape, dtype, name = tuple(out.shape[1:]), out.dtype, plain.name

    def device_factory() -> tf_keras.Model:
        rest = [cls.from_config(dict(config)) for cls, config in configs]
        model = tf_keras.Sequential([tf_keras.Input(shape, dtype=dtype), *rest], name=name)
        model.set_weights(tail_weights)
        return model

    _log.info("host inputs: %s run on the host before each batch is laid out (string and "
              "lookup ops DTensor cannot lay out); the rest of %r is laid out",
              ", ".join(f"{l.name} ({type(l).__name__})" for l in layers[:count]), name)
    return host, device_factory, layouts.compiled_settings(plain)


def _tail_weights(layers: list) -> list:
    weights = []
    for layer in layers:
        weights.extend(layer.weights)
    return weights


def apply(host: tf_keras.Model | None, data: Any) -> Any:
    """Keras's batch ``(x, y, sample_weight)`` (or ``(x,)``) with ``x`` through ``host``."""
    if host is None:
        return data
    from tf_keras.src.engine import data_adapter  # pylint: disable=g-import-not-at-top
    x, y, sample_weight = data_adapter.unpack_x_y_sample_weight(data)
    x = host(x, training=False)
    if y is None and sample_weight is None:
        return (x,) if isinstance(data, tuple) else x
    return data_adapter.pack_x_y_sample_weight(x, y, sample_weight)


def on_host(host: tf_keras.Model | None, inputs: Any) -> Any:
    """An eager call's inputs through ``host`` (a string tensor becomes the model's input)."""
    if host is None or not tf.executing_eagerly():
        return inputs
    return host(inputs, training=False)
