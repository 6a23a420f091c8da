"""What the planner knows of a model: one call on one example, recorded per layer (``profile_model``).

Each leaf layer's output (and input) elements per example, its weights' shapes and paths, and the
working set of the layers that hold more than their output (blockwise attention, experts), with
no mesh and no step: the memory and time models (``cost``) price a candidate from this alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from collections.abc import Callable, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerProfile:
    """One leaf layer on one example: elements in and out, and the weights it owns."""

    name: str
    in_elements: int
    out_elements: int
    itemsize: int
    weights: tuple[str, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """What the planner needs to know of a model, read from one plain call on one example."""

    weights: tuple[tuple[str, tuple[int, ...], str], ...]
    layers: tuple[LayerProfile, ...]
    input_shape: tuple[int, ...] | dict[str, tuple[int, ...]] = ()  # a dict: named inputs
    input_dtype: str | dict[str, str] = "float32"
    outputs: int = 1  # the last dim of the output: the label range of the timed steps
    # The sequence (dtk.parallel.sequence): its length where the model marks it (0: no sequence
    # layers), and each attention layer's (name, key/value input elements per example,
    # itemsize), for the gather of keys and values over a ``seq`` axis.
    sequence_length: int = 0
    attention: tuple[tuple[str, int, int], ...] = ()
    # Each mixture-of-experts layer (dtk.parallel.experts): (name, elements per example one
    # all-to-all moves, itemsize, its weights' paths).
    experts: tuple[tuple[str, int, int, tuple[str, ...]], ...] = ()

    @property
    def signature(self) -> str:
        text = json.dumps([[p, list(s), d] for p, s, d in self.weights])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


# Block-sized tensors blockwise attention holds at its peak (its blocks chained), calibrated on
# the LM at T = 4,096 (4 heads, blocks of 128 keys; scripts/bench_memory.py, 4 clients x 2
# devices: 300-380 MiB a device over T = 128). Attention alone on one device holds 18 (150 and
# 292 MiB at T = 4,096 and 8,192); two devices of a process running side by side hold more.
BLOCKS_LIVE = 32


# Larger blocks hold about what blocks of this many keys hold (fewer of them are in flight):
# measured the same way, over T = 128 per client, blocks of 128 / 256 / 512 keys: 510 / 452-462 /
# 523 MiB (2026-11-27). Counting a block of 256 as two of 128 planned twice what it held.
_LIVE_BLOCK_KEYS = 128


def _blockwise_attention():
    from dtk.parallel import attention  # pylint: disable=g-import-not-at-top
    return attention.BlockwiseAttention


def _blocks_working_set(layer, name: str, query, value, weights) -> LayerProfile:
    """Blockwise attention's scores in flight, as a layer of their own: ``BLOCKS_LIVE`` blocks
    of ``heads x Tq x block`` (chained; a block counted as at most ``_LIVE_BLOCK_KEYS`` keys), or
    three times the whole scores where those are fewer.
    Its weights (the query projection's) tell the planner how heads are split."""
    heads, tq, tk = layer._num_heads, int(query.shape[1]), int(value.shape[1])  # pylint: disable=protected-access
    block = min(layer.block_size_for(tk), _LIVE_BLOCK_KEYS)
    live = min(BLOCKS_LIVE * heads * tq * block, 3 * heads * tq * tk)
    return LayerProfile(name=name + "/blocks", in_elements=0, out_elements=live,
                        itemsize=query.dtype.size, weights=weights)


def _shape_tuple(shape):
    """One example's shape as a tuple, or a dict of them for a model with named inputs."""
    if isinstance(shape, dict):
        return {k: tuple(int(d) for d in v) for k, v in shape.items()}
    return tuple(int(d) for d in shape)


def _zeros(shape, dtype):
    """One example of zeros: a tensor, or a dict of them for a model with named inputs."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    if isinstance(shape, dict):
        return {k: tf.zeros([1, *v], dtype[k] if isinstance(dtype, dict) else dtype)
                for k, v in _shape_tuple(shape).items()}
    return tf.zeros([1, *_shape_tuple(shape)], dtype)


def build_shape(shape):
    """What ``build_model`` takes as ``input_shape``: a named-input (functional) model is built
    by its factory and needs none."""
    return None if isinstance(shape, dict) else shape


def build_dtype(dtype):
    return "float32" if isinstance(dtype, dict) else dtype


def _experts_layer():
    from dtk.parallel import experts  # pylint: disable=g-import-not-at-top
    return experts.MixtureOfExperts


def _identity_layers():
    from dtk.parallel import sequence  # pylint: disable=g-import-not-at-top
    return (sequence.SequenceSharding, sequence.SequenceGather)


def profile_model(model_factory: Callable[[], Any], input_shape: Sequence[int] | None = None,
                  *, input_dtype: str | None = None) -> ModelProfile:
    """Reads the weights and every leaf layer's sizes from one plain call on one example.

    The plain build holds the model once on this host (the planner runs before any mesh).
    """
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    import tf_keras  # pylint: disable=g-import-not-at-top
    from dtk.parallel import layouts  # pylint: disable=g-import-not-at-top
    from dtk import keras_check  # pylint: disable=g-import-not-at-top
    model = layouts._check_factory_result(keras_check.call_factory(model_factory))  # pylint: disable=protected-access
    if input_shape is None or input_dtype is None:
        inputs = getattr(model, "inputs", None) if model.built else None
        if not inputs:
            raise ValueError(
                f"input_shape is needed: model {model.name!r} has no input spec (a subclassed "
                "model); pass input_shape= (one example's shape) and input_dtype=")
        nested = getattr(model, "_nested_inputs", None)
        if isinstance(nested, dict) and len(inputs) > 1:  # named inputs (the recommender's)
            input_shape = input_shape or {k: tuple(int(d) for d in t.shape[1:])
                                          for k, t in nested.items()}
            input_dtype = input_dtype or {k: t.dtype.name for k, t in nested.items()}
        elif len(inputs) > 1:
            raise ValueError(
                f"model {model.name!r} takes {len(inputs)} inputs as a list; the planner times "
                "its step on random inputs by name: give the model named inputs "
                "(tf_keras.Model({'a': ..., 'b': ...}, outputs)), as dtk.models.dlrm does")
        else:
            input_shape = input_shape or tuple(int(d) for d in inputs[0].shape[1:])
            input_dtype = input_dtype or inputs[0].dtype.name
    example = _zeros(input_shape, input_dtype)
    if not model.built:
        model(example)
    elif not isinstance(input_shape, dict):  # a shape the model cannot take: one line, here
        from dtk.train import input_checks  # pylint: disable=g-import-not-at-top
        input_checks.check_features(model, tf.TensorSpec(input_shape),
                                    f"plan(input_shape={tuple(input_shape)})")
    paths = layouts.weight_paths(model)
    by_id = {id(v): p for p, v in paths}
    records: dict[int, LayerProfile] = {}

    def elements(value) -> int:
        return sum(int(t.shape.num_elements() or 0) for t in tf.nest.flatten(value)
                   if isinstance(t, tf.Tensor))

    originals = []
    sequence_length = [0]
    attention: dict[int, tuple[str, int, int]] = {}
    moe: dict[int, tuple[str, int, int, tuple[str, ...]]] = {}
    calls = [0]  # records made so far: a layer none of whose sublayers ran counts as a leaf

    def every_layer(layer, prefix):
        yield layer, prefix + layer.name
        for child in layer._flatten_layers(include_self=False, recursive=False):  # pylint: disable=protected-access
            yield from every_layer(child, prefix + layer.name + "/")

    for top in model._flatten_layers(include_self=False, recursive=False):  # pylint: disable=protected-access
        for layer, name in every_layer(top, ""):
            original = layer.call

            def call(*args, __layer=layer, __name=name, __call=original, **kwargs):
                before = calls[0]
                out = __call(*args, **kwargs)
                if isinstance(__layer, tf_keras.layers.MultiHeadAttention):
                    value = args[1] if len(args) > 1 else kwargs.get("value")
                    attention[id(__layer)] = (__name, elements(value), value.dtype.size)
                    if isinstance(__layer, _blockwise_attention()):
                        records[("blocks", id(__layer))] = _blocks_working_set(
                            __layer, __name, args[0], value,
                            tuple(by_id[id(w)] for w in __layer._query_dense.weights  # pylint: disable=protected-access
                                  if id(w) in by_id))
                if isinstance(__layer, _experts_layer()):
                    x = args[0]
                    sizes = __layer.sizes_per_example(int(x.shape[1]), int(x.shape[-1]))
                    paths = tuple(by_id[id(w)] for w in __layer.weights if id(w) in by_id)
                    moe[id(__layer)] = (__name, sizes["moved"], x.dtype.size, paths)
                    # its dispatched tokens and hidden activations, as a layer of their own
                    records[("experts", id(__layer))] = LayerProfile(
                        name=__name + "/experts", in_elements=0, out_elements=sizes["live"],
                        itemsize=x.dtype.size, weights=())
                if isinstance(__layer, _identity_layers()):
                    # marks where the sequence is sharded; keeps nothing of its own
                    if args and len(args[0].shape) > 1 and not sequence_length[0]:
                        sequence_length[0] = int(args[0].shape[1])
                    return out
                if calls[0] != before:
                    return out  # its sublayers ran and were counted (an LSTM's fused kernel
                                # never calls its cell: then the LSTM itself is counted)
                calls[0] += 1
                outs = [t for t in tf.nest.flatten(out) if isinstance(t, tf.Tensor)]
                # A layer called several times (a shared layer, an RNN cell per time step)
                # keeps every call's output for the backward pass: the sizes add up.
                seen = records.get(id(__layer))
                records[id(__layer)] = LayerProfile(
                    name=__name,
                    in_elements=elements(args[:1]) + (seen.in_elements if seen else 0),
                    out_elements=elements(out) + (seen.out_elements if seen else 0),
                    itemsize=outs[0].dtype.size if outs else 4,
                    weights=tuple(by_id[id(w)] for w in __layer.weights if id(w) in by_id))
                return out
            layer.call = call
            originals.append(layer)
    try:
        model(example, training=True)
    finally:
        for layer in originals:
            del layer.call
    weights = tuple((p, tuple(int(s) for s in v.shape), v.dtype.name) for p, v in paths)
    return ModelProfile(weights=weights, layers=tuple(records.values()),
                        input_shape=_shape_tuple(input_shape), input_dtype=input_dtype,
                        outputs=int(model.output_shape[-1]), sequence_length=sequence_length[0],
                        attention=tuple(attention.values()), experts=tuple(moe.values()))
