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

Attention over a sharded sequence runs one of two ways (the layout table's ``sequence_attention``):

* ``all_gather`` (context parallelism as above): keys' and values' input gathered over ``seq``; the
  key and value projections of every position run on each device.
* ``all_to_all`` (DeepSpeed-Ulysses): the projections run on each device's own positions, then
  one relayout of queries, keys and values from sharded along the sequence to sharded by head over
  ``seq`` (an all-to-all), attention of whole sequences for ``heads / seq`` heads, and one back.
  It needs the heads divisible by the axis and not already split over another axis (``model``).
* ``auto`` (the default): where both can run, one attention layer's forward and backward pass is
  timed both ways on the mesh and the faster one is used; the log says which, with the times.

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

import json
import logging
import statistics
import time

import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor

from dtk.parallel import mesh as mesh_lib

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


ATTENTION_MODES = ("auto", "all_gather", "all_to_all")
# (mesh, layer config, input shape, axis) -> {mode: ms}: a model built again on the same mesh
# (a resume, an evaluation copy) is not timed again.
_TIMED: dict[str, dict[str, float]] = {}


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


def attention_layers(model: tf_keras.Model) -> list[tf_keras.layers.MultiHeadAttention]:
    return [layer for layer in model._flatten_layers(include_self=False)  # pylint: disable=protected-access
            if isinstance(layer, tf_keras.layers.MultiHeadAttention)]


def _all_to_all_obstacle(layer, mesh: dtensor.Mesh, axis: str) -> str | None:
    """Why ``layer`` cannot split its heads over ``axis`` (None: it can)."""
    size = mesh.dim_size(axis)
    heads = layer._num_heads  # pylint: disable=protected-access
    if heads % size:
        return (f"attention layer {layer.name!r} has {heads} heads, which mesh axis {axis!r} of "
                f"size {size} cannot divide (the all-to-all gives each device heads / {size})")
    kernel = getattr(getattr(layer, "_query_dense", None), "kernel", None)
    if kernel is not None:
        try:
            split = dtensor.fetch_layout(kernel).sharding_specs[1]
        except (ValueError, TypeError, IndexError, tf.errors.InvalidArgumentError):
            split = dtensor.UNSHARDED
        if split != dtensor.UNSHARDED:
            return (f"attention layer {layer.name!r} has its heads split over mesh axis "
                    f"{split!r} already (a tensor dim takes one mesh axis)")
    return None


def _all_to_all(x, mesh: dtensor.Mesh, batch: str, axis: str, *, to_heads: bool):
    """``[B, T, heads, d]`` from sharded on T over ``axis`` to sharded on heads, or back.

    DTensor's all-to-all scrambles the elements of a rank-4 tensor whose newly sharded dim is
    followed by another of size > 1 (measured, TF 2.21): it runs on ``[B, T, heads * d]`` instead,
    where the heads are the outer part of the last dim."""
    _, t, h, d = x.shape
    u = dtensor.UNSHARDED
    on_seq, on_heads = [batch, axis, u], [batch, u, axis]
    src, dst = (on_seq, on_heads) if to_heads else (on_heads, on_seq)
    flat = dtensor.relayout(tf.reshape(x, [-1, t, h * d]), dtensor.Layout(src, mesh))
    flat = dtensor.relayout(flat, dtensor.Layout(dst, mesh))
    return dtensor.relayout(tf.reshape(flat, [-1, t, h, d]), dtensor.Layout(dst + [u], mesh))


def _install_all_to_all(layer) -> None:
    """Wraps ``layer._compute_attention``: with ``layer._dtk_all_to_all = (mesh, batch axis,
    sequence axis)``, queries, keys and values ``[B, T, heads, d]`` go from sharded on T to
    sharded on heads before attention, and its output back after (read when traced)."""
    if getattr(layer, "_dtk_original_attention", None) is not None:
        return
    original = layer._compute_attention  # pylint: disable=protected-access

    def compute(query, key, value, attention_mask=None, training=None):
        where = getattr(layer, "_dtk_all_to_all", None)
        if where is None:
            return original(query, key, value, attention_mask, training)
        query, key, value = (_all_to_all(t, *where, to_heads=True) for t in (query, key, value))
        out, scores = original(query, key, value, attention_mask, training)
        return _all_to_all(out, *where, to_heads=False), scores

    object.__setattr__(layer, "_dtk_original_attention", original)
    object.__setattr__(layer, "_compute_attention", compute)


def _time_attention(layer, mesh: dtensor.Mesh, batch_axis: str, axis: str,
                    all_to_all: tuple) -> dict[str, float]:
    """ms of one forward and backward pass of ``layer`` on the mesh, each way (median of 3,
    alternating, after one call each to trace)."""
    shape = [d for d in layer._query_shape]  # pylint: disable=protected-access
    rows = mesh.dim_size(batch_axis) if batch_axis in mesh.dim_names else 1
    shape = [rows, *(int(d) for d in shape[1:])]
    key = json.dumps([str(mesh), {k: v for k, v in layer.get_config().items() if k != "name"},
                      shape, axis], sort_keys=True, default=str)
    if key in _TIMED:
        return _TIMED[key]
    batch = batch_axis if batch_axis in mesh.dim_names else dtensor.UNSHARDED
    rest = [dtensor.UNSHARDED] * (len(shape) - 2)
    sharded = dtensor.Layout([batch, axis, *rest], mesh)
    whole = dtensor.Layout([batch, dtensor.UNSHARDED, *rest], mesh)
    x = dtensor.call_with_layout(tf.ones, sharded, shape, dtype=layer.compute_dtype)

    def traced(mode):
        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                kv = dtensor.relayout(x, whole) if mode == "all_gather" else x
                loss = tf.reduce_sum(layer(x, kv, kv, use_causal_mask=True))
            grads = tape.gradient(loss, [x, *layer.trainable_variables])
            return tf.add_n([tf.cast(tf.reduce_sum(g), tf.float32) for g in grads])

        object.__setattr__(layer, "_dtk_all_to_all", all_to_all if mode == "all_to_all" else None)
        object.__setattr__(layer, "_dtk_queries_sharded", mode == "all_gather")
        try:
            step(x).numpy()  # traced with this mode
        finally:
            object.__setattr__(layer, "_dtk_all_to_all", None)
            object.__setattr__(layer, "_dtk_queries_sharded", False)
        return step

    steps = {mode: traced(mode) for mode in ("all_gather", "all_to_all")}
    times: dict[str, list[float]] = {mode: [] for mode in steps}
    for _ in range(3):
        for mode, step in steps.items():
            start = time.perf_counter()
            step(x).numpy()
            times[mode].append((time.perf_counter() - start) * 1e3)
    _TIMED[key] = {mode: statistics.median(t) for mode, t in times.items()}
    return _TIMED[key]


def _configure_attention(model, mesh: dtensor.Mesh, *, batch_axis: str, axis: str,
                         mode: str) -> tuple[str, str]:
    """Chooses and installs how attention meets the sequence sharded over ``axis``: returns
    ``(mode, why)``."""
    layers = attention_layers(model)
    if not layers:
        return "all_gather", "no attention layer"
    obstacle = next((o for layer in layers if (o := _all_to_all_obstacle(layer, mesh, axis))),
                    None)
    if mode == "all_to_all" and obstacle:
        raise ValueError(
            f"sequence_attention = \"all_to_all\" (layout table) cannot run: {obstacle}. Use "
            f"heads divisible by {mesh.dim_size(axis)}, or sequence_attention = \"all_gather\"")
    where = (mesh, batch_axis if batch_axis in mesh.dim_names else dtensor.UNSHARDED, axis)
    why = "as the layout table says"
    if mode == "auto":
        if obstacle:
            mode, why = "all_gather", f"all-to-all cannot run: {obstacle}"
        else:
            _install_all_to_all(layers[0])
            ms = _time_attention(layers[0], mesh, batch_axis, axis, where)
            # client 0's choice on every client (each timed its own devices)
            mine = ATTENTION_MODES.index(min(ms, key=ms.get))
            mode = ATTENTION_MODES[int(mesh_lib.values_on_all_clients(mesh, float(mine))[0])]
            why = (f"measured on this mesh, one attention layer forward and backward: all-to-all "
                   f"{ms['all_to_all']:.1f} ms, all-gather {ms['all_gather']:.1f} ms")
    for layer in layers:
        _install_all_to_all(layer)
        object.__setattr__(layer, "_dtk_all_to_all",
                           where if mode == "all_to_all" else None)
        # All-gather keeps each device's queries sharded along the sequence (blockwise
        # attention must not slice them); all-to-all gives each device whole sequences.
        object.__setattr__(layer, "_dtk_queries_sharded", mode == "all_gather")
    return mode, why


def _fsdp_with_sequence(axis: str, size: int, given: str, drop: str) -> ValueError:
    return ValueError(
        f"{given} with the sequence sharded over mesh axis {axis!r} (size {size}) fails inside "
        f"DTensor; drop {drop} (shard the weights over 'model' instead), or drop {axis!r} from "
        "the mesh")


def check_mesh(mesh: dtensor.Mesh, *, sequence_axis: str | None,
               sequence_parallel_axis: str | None = None, seq_len: int,
               heads: int | None = None, attention: str = "auto", fsdp: bool = False,
               names: dict[str, str] | None = None) -> None:
    """What ``configure`` would refuse, from the sizes alone, before a model is built (a
    script's flags): a sequence length the axis cannot divide, FSDP with a sequence axis, heads
    that an explicit all-to-all cannot split. ``names`` maps ``seq_len``, ``heads`` and
    ``fsdp`` to what the caller calls them (a script: its flags).

    Raises:
      ValueError: naming the value, the axis and its size, and the fix.
    """
    names = {"seq_len": "seq_len", "heads": "heads", "fsdp": "fsdp=True", **(names or {})}
    axis, kind = choose_axis(mesh, sequence_axis=sequence_axis,
                             sequence_parallel_axis=None if fsdp else sequence_parallel_axis)
    if axis is None:
        return
    size = mesh.dim_size(axis)
    if fsdp and kind == "context":
        raise _fsdp_with_sequence(axis, size, names["fsdp"], names["fsdp"])
    if seq_len % size:
        raise ValueError(
            f"{names['seq_len']} {seq_len} is not divisible by mesh axis {axis!r} of size {size}: "
            f"each device holds {names['seq_len']} / {size} positions; use a multiple of {size}, "
            f"or a smaller {axis!r} axis")
    if kind == "context" and attention == "all_to_all" and heads is not None and heads % size:
        raise ValueError(
            f"sequence_attention all_to_all splits the heads over mesh axis {axis!r} of size "
            f"{size}, but {names['heads']} is {heads}; use {names['heads']} divisible by "
            f"{size}, or sequence_attention all_gather")


def configure(model: tf_keras.Model, mesh: dtensor.Mesh, *, batch_axis: str,
              sequence_axis: str | None, sequence_parallel_axis: str | None,
              table_name: str = "", fsdp: bool = False,
              attention: str = "auto") -> list[str]:
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
        raise _fsdp_with_sequence(axis, mesh.dim_size(axis), "fsdp=True (--fsdp)", "--fsdp")
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
    mode, why = ("", "")
    if kind == "context":
        mode, why = _configure_attention(model, mesh, batch_axis=batch_axis, axis=axis,
                                         mode=attention)
    for layer in layers:
        if isinstance(layer, SequenceGather) and (
                kind == "megatron" or (not layer.megatron_only and mode == "all_gather")):
            layer._dtk_layout = gather  # pylint: disable=protected-access
    if kind == "context":
        what = ("context parallelism; attention: " + (
            "all-to-all to heads (Ulysses)" if mode == "all_to_all"
            else "keys and values gathered (all-gather)") + f", {why}")
    else:
        what = "Megatron sequence parallelism: all-reduces become reduce-scatters + all-gathers"
    return [f"activations sharded along the sequence over {axis!r} ({size} devices; {what})"]
