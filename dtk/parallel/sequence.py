"""Activations sharded along the sequence: context parallelism over a ``seq`` axis, and Megatron's
sequence parallelism over the ``model`` axis.

A transformer's residual stream is ``[batch, seq_len, dim]``. On ``batch=2,seq=4`` each device
holds a quarter of each row's positions: LayerNorm, dropout, the residual adds and the MLP work on
them where they are, and attention gathers the keys' and values' input over ``seq`` (all-gather
context parallelism): each device computes the scores of its own queries against every key,
``[rows, heads, seq_len / 4, seq_len]``. On ``batch=2,model=4`` with a table that names
``sequence_parallel_axis = "model"``, the LayerNorm / dropout / residual regions between the
tensor-parallel layers are sharded along the sequence over ``model`` (Megatron-LM's sequence
parallelism): each all-reduce of a row-parallel layer becomes a reduce-scatter, and the input of
the next column-parallel layer an all-gather, the same bytes, with 1/model of those activations a
device.

DTensor computes in the global view, so causal masks, position embeddings and dtk's dropout draws
(``dtk.parallel.randomness``, indexed by global position) are the same on every mesh: the model
only says where its sequence dim is, with two identity layers:

* ``SequenceSharding``: the residual stream, sharded along dim 1 over the sequence axis.
* ``SequenceGather``: an input that needs every position (attention's keys and values; under
  Megatron's sequence parallelism also the inputs of the column-parallel layers).

Outside a mesh, or on a mesh with no sequence axis, both are the identity. ``configure`` (called by
``dtk.parallel.layouts.build_model``) gives them their layouts from the layout table's
``sequence_axis`` / ``sequence_parallel_axis``.
"""

from __future__ import annotations

import logging

import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor

_log = logging.getLogger("dtk")


@tf_keras.saving.register_keras_serializable(package="dtk")
class SequenceSharding(tf_keras.layers.Layer):
    """Identity; on a mesh with a sequence axis, relayouts ``[batch, seq_len, ...]`` to be sharded
    along dim 1 over it (and along dim 0 over the batch axis)."""

    def call(self, x):
        layout = getattr(self, "_dtk_layout", None)
        return x if layout is None else dtensor.relayout(x, layout(x.shape.rank))


@tf_keras.saving.register_keras_serializable(package="dtk")
class SequenceGather(tf_keras.layers.Layer):
    """Identity; on a mesh with a sequence axis, gathers every position (dim 1 unsharded).

    Args:
      megatron_only: gather only under Megatron's sequence parallelism (the input of a
        column-parallel layer); with context parallelism the positions stay where they are.
    """

    def __init__(self, megatron_only: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.megatron_only = megatron_only

    def call(self, x):
        layout = getattr(self, "_dtk_layout", None)
        return x if layout is None else dtensor.relayout(x, layout(x.shape.rank))

    def get_config(self):
        return {**super().get_config(), "megatron_only": self.megatron_only}


def _layout_fn(mesh: dtensor.Mesh, batch_axis: str, seq_axis: str | None):
    unsharded = dtensor.UNSHARDED

    def layout(rank: int) -> dtensor.Layout:
        dims = [batch_axis if batch_axis in mesh.dim_names else unsharded,
                seq_axis or unsharded] + [unsharded] * (rank - 2)
        return dtensor.Layout(dims, mesh)

    return layout


def sequence_layers(model: tf_keras.Model) -> list[tf_keras.layers.Layer]:
    return [layer for layer in model._flatten_layers(include_self=False)  # pylint: disable=protected-access
            if isinstance(layer, (SequenceSharding, SequenceGather))]


def choose_axis(mesh: dtensor.Mesh, *, sequence_axis: str | None,
                sequence_parallel_axis: str | None) -> tuple[str | None, str]:
    """The mesh axis the sequence is sharded over and how: ``(axis, "context" | "megatron")``,
    or ``(None, "")``. A ``sequence_axis`` of size > 1 wins; else ``sequence_parallel_axis``."""
    sizes = {name: mesh.dim_size(name) for name in mesh.dim_names}
    if sequence_axis and sizes.get(sequence_axis, 1) > 1:
        return sequence_axis, "context"
    if sequence_parallel_axis and sizes.get(sequence_parallel_axis, 1) > 1:
        return sequence_parallel_axis, "megatron"
    return None, ""


def configure(model: tf_keras.Model, mesh: dtensor.Mesh, *, batch_axis: str,
              sequence_axis: str | None, sequence_parallel_axis: str | None,
              table_name: str = "", fsdp: bool = False) -> list[str]:
    """Gives the model's sequence layers their layouts on ``mesh``; returns lines for the log.

    FSDP's gathered weights and a sharded sequence fail together inside DTensor (a reshape of the
    wrong size in its collective lowering): under FSDP, Megatron's sequence parallelism stays off
    and a sequence axis is refused.

    Raises:
      ValueError: a sequence axis on a model with no sequence layers, a sequence length that the
        axis cannot divide (naming the length, the axis and its size), or FSDP with a sequence axis.
    """
    axis, kind = choose_axis(mesh, sequence_axis=sequence_axis,
                             sequence_parallel_axis=None if fsdp else sequence_parallel_axis)
    if fsdp and kind == "context" and sequence_layers(model):
        raise ValueError(
            f"fsdp=True (--fsdp) with the sequence sharded over mesh axis {axis!r} (size "
            f"{mesh.dim_size(axis)}) fails inside DTensor; drop --fsdp (shard the weights over "
            f"'model' instead), or drop {axis!r} from the mesh")
    layers = sequence_layers(model)
    if axis is None:
        return []
    size = mesh.dim_size(axis)
    if not layers:
        if kind == "megatron":
            return []  # a model without sequence layers simply keeps its activations replicated
        raise ValueError(
            f"mesh axis {axis!r} (size {size}) shards activations along their sequence dim "
            f"(layout table {table_name!r}: sequence_axis), but model {model.name!r} has no "
            "sequence layers (dtk.parallel.sequence.SequenceSharding): it has no sequence dim to "
            f"shard. Drop {axis!r} from the mesh, or mark the model's residual stream with "
            "SequenceSharding layers")
    for layer in layers:
        shape = layer.input_shape if not isinstance(layer.input_shape, list) else \
            layer.input_shape[0]
        length = shape[1] if shape is not None and len(shape) > 1 else None
        if length is not None and length % size:
            raise ValueError(
                f"sequence length {length} (layer {layer.name!r}) is not divisible by mesh axis "
                f"{axis!r} of size {size}: each device holds seq_len / {size} positions. Use a "
                f"--seq_len that is a multiple of {size}, or a smaller {axis!r} axis")
    shard = _layout_fn(mesh, batch_axis, axis)
    gather = _layout_fn(mesh, batch_axis, None)
    for layer in layers:
        if isinstance(layer, SequenceSharding):
            layer._dtk_layout = shard  # pylint: disable=protected-access
        elif kind == "megatron" or not layer.megatron_only:
            layer._dtk_layout = gather  # pylint: disable=protected-access
    what = ("context parallelism: attention gathers keys and values over it" if kind == "context"
            else "Megatron sequence parallelism: all-reduces become reduce-scatters + all-gathers")
    return [f"activations sharded along the sequence over {axis!r} ({size} devices; {what})"]
