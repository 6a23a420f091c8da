"""Rematerialization: recompute chosen layers' activations in the backward pass.

``apply(model, patterns)`` wraps the ``call`` of every layer whose name matches one of the
regular expressions in ``tf.recompute_grad``: the forward pass keeps only the layer's inputs,
and the backward pass runs the layer again to get what its gradient needs. Activation memory
inside those layers (attention scores and probabilities, a Dense layer's pre-activation) is
then freed as soon as the layer's output exists, for about one more forward pass of compute.
Under FSDP the weights a layer gathered are dropped with its activations and gathered again for
its backward pass.

The recomputation draws the same random values as the first pass (``randomness.replay``), so
dropout inside a rematerialized layer gives the same gradients; losses match the run without
remat to float tolerance (parity-tested).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

import tensorflow as tf
import tf_keras

from dtk.parallel import experts, fsdp, randomness


def matching_layers(model: tf_keras.Model, patterns: Sequence[str]) -> list[tf_keras.layers.Layer]:
    """The layers of ``model`` (nested ones included) whose names fully match a pattern.

    Raises:
      ValueError: a pattern that is no regular expression, or one that matches no layer.
    """
    layers = [layer for layer in model._flatten_layers(include_self=False)]  # pylint: disable=protected-access
    found = []
    for pattern in patterns:
        try:
            regex = re.compile(pattern)
        except re.error as e:
            raise ValueError(f"remat pattern {pattern!r} is not a regular expression ({e})") from e
        hits = [layer for layer in layers if regex.fullmatch(layer.name)]
        if not hits:
            names = [layer.name for layer in layers]
            raise ValueError(f"remat pattern '{pattern}' matches no layer of model {model.name!r}; "
                             f"its layers are {names[:12]}{' ...' if len(names) > 12 else ''}")
        found.extend(layer for layer in hits if layer not in found)
    return found


def apply(model: tf_keras.Model, patterns: Sequence[str]) -> list[str]:
    """Rematerializes the layers that ``patterns`` name; returns their names.

    Raises:
      ValueError: see ``matching_layers``.
    """
    layers = matching_layers(model, patterns)
    for layer in layers:
        for inner in layer._flatten_layers(include_self=True):  # pylint: disable=protected-access
            if isinstance(inner, experts.MixtureOfExperts):
                raise ValueError(_adds_losses(
                    layer.name, ("is" if inner is layer else f"holds {inner.name!r},") +
                    " a MixtureOfExperts, which adds its routing losses with add_loss"))
    for layer in layers:
        if getattr(layer, "_dtk_remat", False):
            continue
        layer.call = _rematerialized(layer.call)
        layer._dtk_remat = True  # pylint: disable=protected-access
    return [layer.name for layer in layers]


def _adds_losses(name: str, why: str) -> str:
    return (f"remat (--remat) of layer {name!r}: it {why}, and a recomputed layer cannot add "
            "losses (its call runs again in the backward pass); leave it out of the remat "
            "patterns (the LM's --remat blocks leaves the expert layers out), or drop remat")


def _rematerialized(call):
    @functools.wraps(call)
    def wrapped(*args, **kwargs):
        training = kwargs.get("training")
        if training is False or not tf.inside_function():
            return call(*args, **kwargs)
        tensors, rebuild = _split_tensors(args, kwargs)
        state = randomness.snapshot()
        gathering = fsdp.is_gathering()
        after = {}

        @tf.recompute_grad
        def forward(*flat):
            # The recomputation runs inside tape.gradient: the same draws, and FSDP weights
            # gathered again, as in the first pass, once the recomputation's inputs (which wait
            # for the incoming gradient) exist.
            with randomness.replay(state), fsdp.gather_scope(gathering), fsdp.gather_after(flat):
                out = call(*rebuild(flat)[0], **rebuild(flat)[1])
                after["calls"] = dict(randomness._state.calls)  # pylint: disable=protected-access
            return out

        out = forward(*tensors)
        randomness._state.calls.update(after.get("calls", {}))  # pylint: disable=protected-access
        return out
    return wrapped


def _split_tensors(args, kwargs):
    """The tensor arguments of a call (what ``recompute_grad`` differentiates), and a function
    that puts a new list of them back in their places."""
    flat_args = tf.nest.flatten((args, kwargs))
    positions = [i for i, a in enumerate(flat_args) if tf.is_tensor(a)]

    def rebuild(tensors):
        values = list(flat_args)
        for i, t in zip(positions, tensors):
            values[i] = t
        return tf.nest.pack_sequence_as((args, kwargs), values)

    return [flat_args[i] for i in positions], rebuild
