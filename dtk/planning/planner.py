"""The plan chosen for the user: mesh, update, remat and microbatches from a memory budget.

``plan(model_factory, devices=8, global_batch_size=32, device_memory_gb=...)`` considers every
candidate: each factorization of the device count into the layout table's axes (``batch`` x
``model``), times the memory options (the sharded "ZeRO" update or FSDP, remat of the model's
blocks or not), each with the fewest microbatches whose activations fit. For each it gives

- **memory per device, from the layout plan** (``dtk.parallel.layouts.plan_weights`` on that mesh, so a
  table that cannot shard a weight on it drops the candidate with the table's own error):
  weights and optimizer state as stored, gradients in the compute layout, the weights FSDP
  gathers, and activations. Activations are the one estimate: the sum of every leaf layer's
  output for one example (measured by one call on one example), plus twice the largest of them
  (the backward pass's gradients of that output and of its input, live at its peak), times the
  rows a device holds at once, divided by the model axis for layers whose kernels the table
  shards on their output dim, and by the sequence axis where the model shards its sequence.
  Remat keeps a block's input and recomputes the rest, so only the largest block's internals
  are live at once.
- **predicted ms per step, from a cost model calibrated on this machine**:

      step = (a + e * B) * (1 + remat_share if remat)    the model's step on batch=D, measured
           + k x model-axis collectives                 row-parallel outputs (forward all-reduce),
             (each alpha_m + bytes / beta_m)             column-parallel inputs (backward
                                                          all-reduce), sharded features (gather)
           + FSDP: its own cost on batch=D and each more microbatch's regather (both
                   measured on batch=D, scaled by the bytes gathered), and 2 more gathers per
                   weight and microbatch on a 2-D mesh
           + (k - 1) x (the microbatch's own cost + its gradient reduction on this mesh)

  ``a`` (per-call overhead) and ``e`` (compute per example) come from timing the model's own
  step on ``batch=D`` at the rows that fit and at half of them; ``remat_share``, the microbatch
  cost and FSDP's cost and regather from the same step with remat, with FSDP, and with 2
  microbatches (with and without FSDP); ``alpha`` and ``beta`` per axis size from timed gathers at two sizes. Each
  variant is timed alternating with the plain step (``paired_ms``). The machine's figures are
  cached in a JSON file keyed by device kind and count (``$DTK_PLAN_CACHE``, default
  ``~/.cache/dtk/plan.json``), the model's by a signature of its weights, table, batch, loss,
  optimizer and remat patterns, so a later run measures nothing.

The fastest candidate that fits is chosen; ``explain_plan`` prints every candidate with its
memory, its prediction and why it was not chosen. When none fits, ``PlanError`` (a ValueError)
gives the smallest shortfall and what would make it fit. Every client computes the same plan
from the same measurements: in a multi-client run client 0 decides whether to measure
(``_cached``) and its figures are used everywhere (``_agree``), as for
``steps_per_execution="auto"``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import math
import os
import re
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from dtk import _env

_log = logging.getLogger("dtk")
# What the planner is measuring, while it measures (a minute or more before its first answer):
# its own level, so that quieting the timed builds' notes (``_log``) leaves it shown.
_progress = logging.getLogger("dtk.planning.progress")
_progress.setLevel(logging.INFO)

MIB = 1024 * 1024
# Coordination-service keys are written once: each post gets the next number (every client
# plans in the same order, so the numbers agree).
_POSTS = itertools.count()
UPDATES = ("zero", "fsdp")


# -- what is measured -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class MachineCalibration:
    """Timed gathers on this machine, per model-axis size: ``size -> (ms per call, ms per MiB)``.

    A gather's size is what each device holds after it; an all-reduce costs two gathers
    (reduce-scatter + gather) of its size.
    """

    device_kind: str
    devices: int
    gather: dict[int, tuple[float, float]]

    def gather_ms(self, axis_size: int, nbytes: float) -> float:
        if axis_size <= 1:
            return 0.0
        alpha, per_mib = self.gather[axis_size]
        return alpha + per_mib * nbytes / MIB


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepCalibration:
    """The model's own step on the ``batch=D`` mesh: ``a + e * B`` ms; remat adds ``remat_share``
    of it (it replays the forward pass: its dispatch and its compute)."""

    a_ms: float
    e_ms: float
    remat_share: float
    # One more microbatch on batch=D, less its gradient reduction: the loop's own cost.
    microbatch_ms: float = 0.0
    # FSDP's gathers again in each more microbatch on batch=D (the sharded update has none).
    fsdp_microbatch_ms: float = 0.0
    # FSDP's step on batch=D less the sharded update's, one microbatch (its gathers and their
    # gradients against the update's one gather).
    fsdp_ms: float = 0.0
    batch_sizes: tuple[int, ...] = ()
    measured_ms: tuple[float, ...] = ()
    # The candidate the step was timed on when the replicated step on batch=D does not fit the
    # budget ("" : batch=D), and what was assumed rather than measured there.
    measured_on: str = ""
    assumed: str = ""


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


# -- candidates -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
    """One way to run the model, with its memory per device (bytes) and predicted ms per step."""

    mesh: str
    update: str  # "zero" (the sharded update; replicated where batch=1) or "fsdp"
    remat: bool
    microbatches: int
    memory: dict[str, int]
    budget: int | None
    predicted_ms: float | None
    rejected: str | None = None  # why it cannot run at all (the table, the batch)
    # Mixture of experts: the experts' weights and optimizer state per device (part of
    # ``memory``'s weights and optimizer), and the bytes a device sends by all-to-all a step.
    experts_bytes: int = 0
    all_to_all_bytes: int = 0
    # Pipeline stages (a ``stage`` axis, dtk.parallel.pipeline; 1: none): the idle share of a
    # step ``(S - 1) / (M + S - 1)`` and the bytes a step moves across the stage boundaries
    # (activations forward, their gradients back). ``memory`` is the largest stage's.
    stages: int = 1
    bubble: float = 0.0
    boundary_bytes: int = 0

    @property
    def fits(self) -> bool:
        return self.rejected is None and (self.budget is None or self.memory["total"] <= self.budget)

    @property
    def label(self) -> str:
        parts = [self.mesh, self.update]
        if self.remat:
            parts.append("remat")
        if self.stages > 1:
            parts.append(f"1f1b microbatches={self.microbatches}")
        elif self.microbatches > 1:
            parts.append(f"microbatches={self.microbatches}")
        return " ".join(parts)

    @property
    def config(self) -> dict[str, Any]:
        """What the Trainer and the scripts take: mesh, fsdp, remat, grad accumulation."""
        return {"mesh": self.mesh, "fsdp": self.update == "fsdp", "remat": self.remat,
                "gradient_accumulation_steps": self.microbatches, "stages": self.stages}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """The chosen candidate, every candidate considered, and the figures behind the choice."""

    chosen: Candidate
    candidates: tuple[Candidate, ...]
    machine: MachineCalibration
    step: StepCalibration
    global_batch_size: int
    table: str

    def explain(self) -> str:
        return explain_plan(self)


class PlanError(ValueError):
    """No candidate fits: the message has the smallest shortfall and what would make it fit."""


# -- profiling a model ------------------------------------------------------------------------------

# Block-sized tensors blockwise attention holds at its peak (its blocks chained), calibrated on
# the LM at T = 4,096 (4 heads, blocks of 128 keys; scripts/bench_memory.py, 4 clients x 2
# devices: 300-380 MiB a device over T = 128). Attention alone on one device holds 18 (150 and
# 292 MiB at T = 4,096 and 8,192); two devices of a process running side by side hold more.
_BLOCKS_LIVE = 32
# Larger blocks hold about what blocks of this many keys hold (fewer of them are in flight):
# measured the same way, over T = 128 per client, blocks of 128 / 256 / 512 keys: 510 / 452-462 /
# 523 MiB (2026-11-27). Counting a block of 256 as two of 128 planned twice what it held.
_LIVE_BLOCK_KEYS = 128


def _blockwise_attention():
    from dtk.parallel import attention  # pylint: disable=g-import-not-at-top
    return attention.BlockwiseAttention


def _blocks_working_set(layer, name: str, query, value, weights) -> LayerProfile:
    """Blockwise attention's scores in flight, as a layer of their own: ``_BLOCKS_LIVE`` blocks
    of ``heads x Tq x block`` (chained; a block counted as at most ``_LIVE_BLOCK_KEYS`` keys), or
    three times the whole scores where those are fewer.
    Its weights (the query projection's) tell the planner how heads are split."""
    heads, tq, tk = layer._num_heads, int(query.shape[1]), int(value.shape[1])  # pylint: disable=protected-access
    block = min(layer.block_size_for(tk), _LIVE_BLOCK_KEYS)
    live = min(_BLOCKS_LIVE * heads * tq * block, 3 * heads * tq * tk)
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


def _build_shape(shape):
    """What ``build_model`` takes as ``input_shape``: a named-input (functional) model is built
    by its factory and needs none."""
    return None if isinstance(shape, dict) else shape


def _build_dtype(dtype):
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


# -- memory -----------------------------------------------------------------------------------------
class _Axes:
    """The axes of a mesh that need not exist: all that planning layouts reads of a mesh."""

    def __init__(self, sizes: dict[str, int]):
        self.dim_names = list(sizes)
        self._sizes = sizes

    def dim_size(self, name: str) -> int:
        return self._sizes[name]


def _kernel(layer: LayerProfile) -> str | None:
    return next((p for p in layer.weights if p.endswith(("kernel", "embeddings"))), None)


def _column_axis(dims: Sequence[str | None] | None) -> str | None:
    """The axis sharding a kernel's output features (last dim; heads of a ``[dim, heads, d]``
    projection), or None: such a layer's output is split over that axis."""
    if not dims or len(dims) < 2:
        return None
    if dims[-1]:
        return dims[-1]
    return dims[1] if len(dims) == 3 and dims[0] is None else None


def _layer_split(layer: LayerProfile, dims_of: dict[str, tuple], sizes: dict[str, int],
                 sequence: tuple[str, int] | None = None) -> int:
    """How many ways the layer's output is split: a column-parallel kernel, times the sequence
    axis (``sequence``: its name and size, see ``_sequence_split``) where it is another axis."""
    kernel = _kernel(layer)
    axis = _column_axis(dims_of.get(kernel)) if kernel else None
    split = sizes.get(axis, 1) if axis else 1
    if sequence and sequence[0] != axis:
        split *= sequence[1]
    return split


def _sequence_split(profile: ModelProfile, table, sizes: dict[str, int], *,
                    fsdp: bool) -> tuple[str, int] | None:
    """The axis the model's activations are sharded on along the sequence, and its size, as
    ``dtk.parallel.sequence.choose_axis`` would choose it (None: not sharded). An estimate: every
    activation of a model with sequence layers is counted as carrying the sequence dim."""
    if not profile.sequence_length or table is None:
        return None
    seq = table.sequence_axis
    if seq and sizes.get(seq, 1) > 1:
        return seq, sizes[seq]
    sp = table.sequence_parallel_axis
    if sp and not fsdp and sizes.get(sp, 1) > 1:
        return sp, sizes[sp]
    return None


def _block(layer: LayerProfile, remat: Sequence[str]) -> str | None:
    """The outermost layer on ``layer``'s path that a remat pattern names (as ``dtk.parallel.remat``)."""
    parts = layer.name.split("/")
    for i in range(len(parts)):
        if any(re.fullmatch(p, parts[i]) for p in remat):
            return "/".join(parts[:i + 1])
    return None


def _activation_bytes(profile: ModelProfile, dims_of, sizes, remat: Sequence[str],
                      sequence: tuple[str, int] | None = None) -> int:
    """Bytes per example live for the backward pass (see the module docstring)."""
    kept, blocks, seen, largest = 0, {}, set(), 0
    for layer in profile.layers:
        nbytes = layer.out_elements * layer.itemsize // _layer_split(layer, dims_of, sizes,
                                                                      sequence)
        if not layer.name.endswith(("/blocks", "/experts")):  # working sets (blockwise
            largest = max(largest, nbytes)  # attention's, the experts') have no gradient of their own
        block = _block(layer, remat) if remat else None
        if block is None:
            kept += nbytes
            continue
        # recomputed: only the block's input is kept; its internals live one block at a time
        if block not in seen:
            seen.add(block)
            kept += layer.in_elements * layer.itemsize // (sequence[1] if sequence else 1)
        blocks[block] = blocks.get(block, 0) + nbytes
    # At the backward pass's peak, the gradient of the largest output and of its input are live
    # beside everything kept (attention's [heads, T, T] scores: measured 1.8-2.0x the kept
    # outputs alone on the LM at T = 4,096, scripts/bench_memory.py).
    return kept + max(blocks.values(), default=0) + 2 * largest


def _remat_weights(profile: ModelProfile, remat: Sequence[str]) -> dict[str, str]:
    """weight path -> the remat block that owns it."""
    return {p: block for layer in profile.layers if (block := _block(layer, remat))
            for p in layer.weights}


def _compute_dims(plan) -> dict[str, tuple]:
    """Each weight's layout while a step computes (FSDP weights are gathered to the table's)."""
    return {w.path: (w.compute_dims if w.compute_dims is not None else w.dims)
            for w in plan.weights}


def _gradient_bytes(plan) -> int:
    """Bytes per device of all gradients, in the compute layout."""
    from dtk.parallel import layouts  # pylint: disable=g-import-not-at-top
    sizes, dims = dict(plan.mesh_axes), _compute_dims(plan)
    return sum(w.bytes_total // layouts._split(dims[w.path], sizes)  # pylint: disable=protected-access
               for w in plan.weights)


def candidate_memory(profile: ModelProfile, plan, *, update: str, remat: Sequence[str],
                     rows_per_device: int, optimizer_slots: int = 2) -> dict[str, int]:
    """Bytes per device of a candidate: weights, optimizer state, gradients, gathered weights
    and activations (``rows_per_device``: the rows one microbatch puts on a device)."""
    from dtk.parallel import layouts  # pylint: disable=g-import-not-at-top
    sizes = dict(plan.mesh_axes)
    zero = update == "zero" and sizes.get("batch", 1) > 1
    stored = layouts.memory_per_device(plan, optimizer_slots=optimizer_slots,
                                       shard_optimizer_state=zero)
    compute_dims = _compute_dims(plan)
    gradients = _gradient_bytes(plan)
    gathered = stored["gathered_in_step"]
    if remat and gathered:  # remat gathers a block's weights again and drops them with it
        in_blocks = _remat_weights(profile, remat)
        per_block: dict[str, int] = {}
        outside = 0
        for w in plan.weights:
            if w.compute_dims is None:
                continue
            extra = w.bytes_total // layouts._split(w.compute_dims, sizes) - w.bytes_per_device  # pylint: disable=protected-access
            if w.path in in_blocks:
                block = in_blocks[w.path]
                per_block[block] = per_block.get(block, 0) + extra
            else:
                outside += extra
        gathered = outside + max(per_block.values(), default=0)
    sequence = _sequence_split(profile, plan.table, sizes, fsdp=update == "fsdp")
    activations = rows_per_device * _activation_bytes(profile, compute_dims, sizes, remat,
                                                      sequence)
    memory = {"weights": stored["weights"], "optimizer": stored["optimizer"],
              "gradients": gradients, "gathered": gathered, "activations": activations}
    memory["total"] = sum(memory.values())
    return memory


# -- time -------------------------------------------------------------------------------------------
def _model_axis_ms(profile: ModelProfile, plan, machine: MachineCalibration, rows: int) -> float:
    """The model axis's collectives per step (see the module docstring), in ms."""
    sizes = dict(plan.mesh_axes)
    m = sizes.get("model", 1)
    if m <= 1:
        return 0.0
    dims_of = _compute_dims(plan)
    total = 0.0
    for layer in profile.layers:
        kernel = _kernel(layer)
        dims = dims_of.get(kernel) if kernel else None
        if not dims or "model" not in dims:
            continue
        out_bytes = rows * layer.out_elements * layer.itemsize
        in_bytes = rows * layer.in_elements * layer.itemsize
        if kernel.endswith("embeddings") and dims[0] == "model":
            # rows sharded: each device's block looked up, summed over the axis (an all-reduce
            # of the output, dtk.parallel.ops.row_sharded_lookup); its gradient stays sharded
            total += 2 * machine.gather_ms(m, out_bytes)
        elif kernel.endswith("embeddings"):  # features sharded: gathered after the lookup
            total += machine.gather_ms(m, out_bytes)
        elif _column_axis(dims) == "model":  # column parallel
            total += 2 * machine.gather_ms(m, in_bytes)  # backward: the input's gradient
        else:  # row parallel: the output is summed over the axis
            total += 2 * machine.gather_ms(m, out_bytes)
    return total


def _sequence_ms(profile: ModelProfile, plan, machine: MachineCalibration, rows: int) -> float:
    """The ``seq`` axis's collectives per step, in ms: each attention layer gathers its keys' and
    values' input over the axis (forward) and reduce-scatters its gradient (backward). The
    all-to-all alternative moves less (dtk.parallel.sequence times both on the mesh); this is
    the bound."""
    seq = getattr(plan.table, "sequence_axis", None)
    size = dict(plan.mesh_axes).get(seq, 1) if seq else 1
    if size <= 1 or not profile.sequence_length:
        return 0.0
    return sum(2 * machine.gather_ms(size, rows * elements * itemsize)
               for _, elements, itemsize in profile.attention)


def _all_to_all(profile: ModelProfile, plan, sizes: dict[str, int], rows: int
                ) -> list[tuple[int, float]]:
    """Each MoE layer's all-to-all on a mesh of ``sizes``: (axis size, bytes a device holds of
    the expert inputs). The axis is the one sharding the experts' dim 0; the tokens are split over
    the batch rows and, where the table shards the sequence, the sequence axis."""
    dims_of = _compute_dims(plan)
    seq = getattr(plan.table, "sequence_axis", None)
    split = sizes.get(seq, 1) if seq else 1
    out = []
    for _, moved, itemsize, paths in profile.experts:
        axes = {dims_of[p][0] for p in paths if p in dims_of and len(dims_of[p]) == 3}
        axis = next((a for a in axes if a), None)
        if axis and sizes.get(axis, 1) > 1:
            out.append((sizes[axis], rows * moved * itemsize / split))
    return out


def all_to_all_bytes(profile: ModelProfile, plan, rows: int, microbatches: int = 1) -> int:
    """Bytes a device sends by all-to-all in one step: per MoE layer, the expert inputs to their
    experts and the outputs back, forward and backward (4), each sending ``(n - 1) / n`` of what
    the device holds over an axis of size n."""
    return int(microbatches * sum(4 * nbytes * (n - 1) / n for n, nbytes in
                                  _all_to_all(profile, plan, dict(plan.mesh_axes), rows)))


def _experts_ms(profile: ModelProfile, plan, machine: MachineCalibration, rows: int,
                global_batch_size: int) -> float:
    """The all-to-alls of the MoE layers per step, in ms: 4 per layer, each priced as a gather of
    what a device holds (both send ``(n - 1) / n`` of it). Where the experts are sharded over
    ``batch`` the calibrated step on ``batch=D`` already ran them on all D devices: that share is
    taken off."""
    sizes = dict(plan.mesh_axes)
    ms = sum(4 * machine.gather_ms(n, nbytes) for n, nbytes in
             _all_to_all(profile, plan, sizes, rows))
    dims_of = _compute_dims(plan)
    over_batch = any(dims_of.get(p, (None,))[0] == "batch" for _, _, _, paths in profile.experts
                     for p in paths if len(dims_of.get(p, ())) == 3)
    if over_batch:
        d = machine.devices
        ms -= sum(4 * machine.gather_ms(d, global_batch_size // d * moved * itemsize)
                  for _, moved, itemsize, _ in profile.experts)
    return ms


def predict_ms(profile: ModelProfile, plan, machine: MachineCalibration, step: StepCalibration,
               *, global_batch_size: int, update: str, remat: bool, microbatches: int,
               remat_patterns: Sequence[str] = ()) -> float:
    """Predicted ms per step of one candidate (the module docstring's formula)."""
    from dtk.parallel import layouts  # pylint: disable=g-import-not-at-top
    sizes = dict(plan.mesh_axes)
    b = sizes.get("batch", 1)
    k = microbatches
    rows = global_batch_size // b // k
    ms = (step.a_ms + step.e_ms * global_batch_size) * (1 + (step.remat_share if remat else 0.0))
    ms += k * _model_axis_ms(profile, plan, machine, rows) / sizes.get(
        getattr(plan.table, "sequence_axis", None) or "", 1)
    ms += k * _sequence_ms(profile, plan, machine, rows)
    if profile.experts:
        ms += k * _experts_ms(profile, plan, machine, rows, global_batch_size // k)
    if update == "fsdp":
        # Each microbatch gathers the weights (again in the backward pass for remat's blocks);
        # the sharded update gathers them once, after the update. On batch=D the difference is
        # measured (``fsdp_ms``: 26-39% of the step on the LM of bench_plan.py, priced at zero
        # before 2026-11-26, which chose FSDP over cheaper plans). With a model axis too, DTensor's
        # gradient of the 2-D gather is not a reduce-scatter: about two more gathers per weight.
        in_blocks = _remat_weights(profile, remat_patterns) if remat else {}
        two_d = 2 if sizes.get("model", 1) > 1 else 0
        gathered = full = 0
        for w in plan.weights:
            if w.compute_dims is None:
                continue
            compute = w.bytes_total // layouts._split(w.compute_dims, sizes)  # pylint: disable=protected-access
            gathered += compute
            full += w.bytes_total
            gathers = k * (two_d + (1 if w.path in in_blocks else 0))
            if gathers:
                ms += gathers * machine.gather_ms(b, compute)
        # FSDP's own cost on batch=D, and each more microbatch's gathers again: measured there,
        # scaled by what is gathered
        ms += (step.fsdp_ms + (k - 1) * step.fsdp_microbatch_ms) * gathered / max(full, 1)
    if k > 1:  # the loop's cost, and DTensor reduces every microbatch's gradients (dtk.train.steps)
        ms += (k - 1) * (step.microbatch_ms + 2 * machine.gather_ms(b, _gradient_bytes(plan)))
    return ms


# -- candidates -------------------------------------------------------------------------------------
def factorizations(devices: int, axes: Sequence[str]) -> list[dict[str, int]]:
    """Every way to write ``devices`` as a product over ``axes`` (``batch`` first)."""
    if len(axes) == 1:
        return [{axes[0]: devices}]
    out = []
    for n in range(devices, 0, -1):
        if devices % n == 0:
            out += [{axes[0]: n, **rest} for rest in factorizations(devices // n, axes[1:])]
    return out


def enumerate_candidates(profile: ModelProfile, table, *, devices: int, global_batch_size: int,
                         budget_bytes: int | None, machine: MachineCalibration | None,
                         step: StepCalibration | None, remat_patterns: Sequence[str] = (),
                         optimizer_slots: int = 2) -> list[Candidate]:
    """Every candidate with its memory and (given the calibrations) its predicted time."""
    from dtk.parallel import layouts  # pylint: disable=g-import-not-at-top
    # The sequence axis is a candidate where the model marks its sequence (sequence layers).
    seq = table.sequence_axis if profile.sequence_length else None
    axes = ["batch"] + [a for a in table.axes
                        if a != "batch" and (a != table.sequence_axis or seq)]
    out = []
    for sizes in factorizations(devices, axes):
        mesh = ",".join(f"{a}={n}" for a, n in sizes.items()
                        if a == "batch" or n > 1 or a not in table.optional_axes)
        b = sizes["batch"]
        for update in UPDATES:
            for remat in ((False, True) if remat_patterns else (False,)):
                base = {"mesh": mesh, "update": update, "remat": remat, "budget": budget_bytes}
                if update == "fsdp" and b == 1:
                    continue  # nothing to shard over: the same as "zero"
                if global_batch_size % b:
                    out.append(Candidate(**base, microbatches=1, memory={"total": 0},
                                         predicted_ms=None, rejected=(
                        f"global batch {global_batch_size} is not divisible by batch={b}")))
                    continue
                why = None
                if seq and sizes.get(seq, 1) > 1:
                    why = (f"sequence length {profile.sequence_length} is not divisible by "
                           f"{seq}={sizes[seq]}" if profile.sequence_length % sizes[seq] else
                           "FSDP with a sharded sequence fails inside DTensor"
                           if update == "fsdp" else None)
                split = _sequence_split(profile, table, sizes, fsdp=update == "fsdp")
                if why is None and split and profile.sequence_length % split[1]:
                    # Megatron's sequence parallelism shards it over the tensor-parallel axis
                    # (dtk.parallel.sequence), which the model then refuses (issue 59)
                    why = (f"sequence length {profile.sequence_length} is not divisible by "
                           f"{split[0]}={split[1]}, which shards the sequence (sequence "
                           "parallelism)")
                if why:
                    out.append(Candidate(**base, microbatches=1, memory={"total": 0},
                                         predicted_ms=None, rejected=why))
                    continue
                try:
                    plan = layouts.plan_weights(
                        table, _Axes(sizes), profile.weights,
                        fsdp_paths=[p for p, _, _ in profile.weights] if update == "fsdp" else ())
                except ValueError as e:
                    out.append(Candidate(**base, microbatches=1, memory={"total": 0},
                                         predicted_ms=None, rejected=str(e).split(";")[0]))
                    continue
                per_device = global_batch_size // b
                patterns = remat_patterns if remat else ()
                chosen = None
                for k in [k for k in range(1, per_device + 1) if per_device % k == 0]:
                    memory = candidate_memory(profile, plan, update=update, remat=patterns,
                                              rows_per_device=per_device // k,
                                              optimizer_slots=optimizer_slots)
                    chosen = (k, memory)
                    if budget_bytes is None or memory["total"] <= budget_bytes:
                        break
                k, memory = chosen
                predicted = None if machine is None or step is None else predict_ms(
                    profile, plan, machine, step, global_batch_size=global_batch_size,
                    update=update, remat=remat, microbatches=k, remat_patterns=patterns)
                experts = {p for _, _, _, paths in profile.experts for p in paths}
                experts_bytes = layouts.memory_per_device(
                    dataclasses.replace(plan, weights=tuple(
                        w for w in plan.weights if w.path in experts)),
                    optimizer_slots=optimizer_slots,
                    shard_optimizer_state=update == "zero" and b > 1)["total"] if experts else 0
                out.append(Candidate(**base, microbatches=k, memory=memory,
                                     predicted_ms=predicted, experts_bytes=experts_bytes,
                                     all_to_all_bytes=all_to_all_bytes(
                                         profile, plan, per_device // k, k)))
    return out


# -- pipeline candidates ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class StageSplit:
    """A model cut into stages (``dtk.parallel.pipeline.split``): each stage's top-level layer
    names, and the elements and itemsize of one example's tensor crossing each boundary."""

    layers: tuple[frozenset[str], ...]
    crossing: tuple[tuple[int, int], ...]


def stage_splits(model_factory: Callable[[], Any], input_shape, input_dtype, devices: int
                 ) -> dict[int, StageSplit]:
    """Each stage count a pipeline of ``devices`` can have (a divisor of it, 2 or more, up to
    the model's units), balanced as ``dtk.parallel.pipeline.build`` balances them; {} for a model
    without boundaries (a subclassed model)."""
    from dtk.parallel import materialize, pipeline  # pylint: disable=g-import-not-at-top
    shape = None if isinstance(input_shape, dict) else input_shape
    try:
        model = materialize.lazy_model(model_factory, shape, input_dtype if isinstance(
            input_dtype, str) else "float32")
        units, between = pipeline.cuts(model)
    except Exception:  # pylint: disable=broad-except  (no graph to cut: no pipeline candidate)
        return {}
    out = {}
    for stages in range(2, min(devices, len(units)) + 1):
        if devices % stages:
            continue
        try:
            parts = pipeline.split(model, stages)
        except ValueError:
            continue
        names = tuple(frozenset(layer.name for layer in pipeline.stage_model(
            model, parts, s).layers) for s in range(stages))
        crossing = tuple((int(between[b].shape[1:].num_elements()), between[b].dtype.size)
                         for _, b in parts[:-1])
        out[stages] = StageSplit(layers=names, crossing=crossing)
    return out


def _stage_profile(profile: ModelProfile, layers: frozenset[str]) -> ModelProfile:
    """The part of ``profile`` a stage of these top-level layers holds."""
    return dataclasses.replace(
        profile, weights=tuple(w for w in profile.weights if w[0].split(".")[0] in layers),
        layers=tuple(l for l in profile.layers if l.name.split("/")[0] in layers),
        attention=tuple(a for a in profile.attention if a[0].split("/")[0] in layers),
        experts=())


def pipeline_candidates(profile: ModelProfile, table, splits: dict[int, StageSplit], *,
                        devices: int, global_batch_size: int, budget_bytes: int | None,
                        machine: MachineCalibration | None, step: StepCalibration | None,
                        optimizer_slots: int = 2) -> list[Candidate]:
    """Every pipeline candidate: a stage count, the other axes over each stage's devices, and
    the microbatches (1F1B, dtk's default schedule) predicted fastest among those that fit.

    Memory is the largest stage's: its weights and optimizer state (not sharded within a stage),
    gradients, one microbatch's activations over its layers and, as 1F1B holds them, the inputs
    of up to ``S - s`` microbatches in flight on stage s. Time (the cost model's step on
    ``batch=D``, which runs the same work over the same devices):

        step = (a + e * B) * (M + S - 1) / M          the bubble
             + (M - 1) x the microbatch's own cost
             + M x each stage's model-axis collectives
             + 2 (S - 1) M boundary transfers, each priced as a gather of what a device holds

    The formula's bubble assumes the stages run at once, as on a GPU host; on a CPU host whose
    cores run every virtual device, they run one after another (BUILD.md, "Pipeline
    parallelism")."""
    from dtk.parallel import layouts  # pylint: disable=g-import-not-at-top
    axes = ["batch"] + [a for a in table.axes if a not in ("batch", table.sequence_axis)]
    out = []
    for stages, split in sorted(splits.items()):
        parts = [_stage_profile(profile, names) for names in split.layers]
        for sizes in factorizations(devices // stages, axes):
            mesh = ",".join([f"stage={stages}"] + [
                f"{a}={n}" for a, n in sizes.items()
                if a == "batch" or n > 1 or a not in table.optional_axes])
            base = {"mesh": mesh, "update": "replicated", "remat": False, "budget": budget_bytes,
                    "stages": stages}
            b = sizes["batch"]
            if global_batch_size % b:
                out.append(Candidate(**base, microbatches=1, memory={"total": 0},
                                     predicted_ms=None, rejected=(
                    f"global batch {global_batch_size} is not divisible by batch={b}")))
                continue
            try:
                plans = [layouts.plan_weights(table, _Axes(sizes), part.weights)
                         for part in parts]
            except ValueError as e:
                out.append(Candidate(**base, microbatches=1, memory={"total": 0},
                                     predicted_ms=None, rejected=str(e).split(";")[0]))
                continue
            per_device = global_batch_size // b
            options = []
            for m in [m for m in range(1, per_device + 1) if per_device % m == 0]:
                rows = per_device // m
                memories = []
                for s, (part, plan) in enumerate(zip(parts, plans)):
                    memory = candidate_memory(part, plan, update="replicated", remat=(),
                                              rows_per_device=rows,
                                              optimizer_slots=optimizer_slots)
                    if s:  # the inputs 1F1B holds: up to S - s microbatches in flight
                        elements, itemsize = split.crossing[s - 1]
                        memory["activations"] += min(m, stages - s) * rows * elements * itemsize
                        memory["total"] = sum(v for k, v in memory.items() if k != "total")
                    memories.append(memory)
                memory = max(memories, key=lambda mem: mem["total"])
                moved = sum(2 * global_batch_size * e * i for e, i in split.crossing)
                predicted = None
                if machine is not None and step is not None:
                    predicted = ((step.a_ms + step.e_ms * global_batch_size)
                                 * (m + stages - 1) / m + (m - 1) * step.microbatch_ms)
                    predicted += m * sum(_model_axis_ms(part, plan, machine, rows)
                                         for part, plan in zip(parts, plans))
                    predicted += 2 * m * sum(machine.gather_ms(b, rows * e * i)
                                             for e, i in split.crossing)
                options.append(Candidate(**base, microbatches=m, memory=memory,
                                         predicted_ms=predicted,
                                         bubble=(stages - 1) / (m + stages - 1),
                                         boundary_bytes=moved))
            fitting = [c for c in options if c.fits] or options[-1:]
            out.append(min(fitting, key=lambda c: (c.predicted_ms or 0.0, -c.microbatches)))
    return out


# Candidates that fit and are predicted within this factor of the fastest are a tie: the cost
# model is not finer than that. A tie goes to the one that is simpler to run.
TIE = 1.01
TIE_RULE = (f"the fastest candidate that fits; those within {TIE - 1:.0%} of it are a tie, which "
            "goes to the sharded update (not FSDP), then no remat, then one stage, then less "
            "memory")


def _tie_key(c: Candidate) -> tuple:
    return (c.update == "fsdp", c.remat, c.stages > 1, c.memory["total"])


def choose(candidates: Sequence[Candidate]) -> Candidate:
    """The chosen candidate, by ``TIE_RULE``; ``PlanError`` when none fits."""
    feasible = [c for c in candidates if c.fits]
    if feasible:
        fastest = min(c.predicted_ms or 0.0 for c in feasible)
        near = [c for c in feasible if (c.predicted_ms or 0.0) <= fastest * TIE]
        return min(near, key=_tie_key)
    runnable = [c for c in candidates if c.rejected is None]
    if not runnable:
        reasons = list(dict.fromkeys(c.rejected for c in candidates))  # each reason once
        split = [re.fullmatch(r"global batch (\d+) is not divisible by batch=(\d+)", r)
                 for r in reasons]
        if all(split):  # every mesh of these devices: one fix, said once
            batch = int(split[0].group(1))
            sizes = sorted({int(m.group(2)) for m in split})
            raise PlanError(
                f"no candidate can run: every mesh of these devices splits the global batch "
                f"{batch} over a batch axis of {' or '.join(map(str, sizes))}, which does not "
                f"divide it; use a global_batch_size (--global_batch_size) that "
                f"{sizes[0]} divides (e.g. {batch + sizes[0] - batch % sizes[0]}), or a device "
                f"count that divides {batch} (--virtual_devices, DTK_VIRTUAL_DEVICES)")
        first = {}  # the first candidate of each reason
        for c in candidates:
            first.setdefault(c.rejected, c)
        raise PlanError("no candidate can run: " + "; ".join(
            f"{c.label}: {reason}" for reason, c in list(first.items())[:4]))
    best = min(runnable, key=lambda c: c.memory["total"])
    memory, budget = best.memory, best.budget
    parts = " + ".join(f"{k} {_mib(v)}" for k, v in memory.items() if k != "total" and v)
    raise PlanError(
        f"no plan fits the device memory budget of {_mib(budget)} per device: the smallest is "
        f"{best.label} with {parts} = {_mib(memory['total'])}, {_mib(memory['total'] - budget)} "
        f"over. To fit: more devices (its weights and state divide by the device count), a "
        f"smaller global batch (activations are {_mib(memory['activations'])} of it), remat"
        f"{'' if best.remat else ' (not possible: the model names no blocks)'}, or a budget of "
        f"at least {_mib(memory['total'])}")


def _itemsize(dtype: str) -> int:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    return tf.as_dtype(dtype).size


def _mib(n: float | None) -> str:
    return "none" if n is None else f"{n / MIB:.1f} MiB"


# -- calibration ------------------------------------------------------------------------------------
def cache_path() -> str:
    return _env.get_str(_env.PLAN_CACHE) or os.path.join(
        os.path.expanduser("~"), ".cache", "dtk", "plan.json")


def _load_cache(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _cached(path: str, key: str, refresh: bool) -> dict | None:
    """The cached entry, or None: measure. In a multi-client run, client 0's answer for every
    client: the measurements run collectives, so all clients measure or none does."""
    from dtk.cluster import env as cluster  # pylint: disable=g-import-not-at-top
    value = None if refresh else _load_cache(path).get(key)
    if not cluster.is_multi_client():
        return value
    from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
    ctx = context.context()
    name = f"dtk/plan/cached/{hashlib.sha256(key.encode()).hexdigest()[:16]}/{next(_POSTS)}"
    if cluster.is_lead_client():
        ctx.set_config_key_value(name, json.dumps(value))
        return value
    return json.loads(ctx.get_config_key_value(name, timeout_in_ms=600_000))


def _store_cache(path: str, key: str, value: dict) -> None:
    """Adds ``key`` to the cache file, atomically; never over a file that is not dtk's cache
    (``_env.check_all`` refuses that before any work; a library call is told here)."""
    data = _load_cache(path)
    if os.path.isdir(path) or (os.path.isfile(path) and os.path.getsize(path) and not data) or \
            not all(k.startswith(_env.PLAN_CACHE_KEY_PREFIXES) for k in data):
        _log.warning("plan: %s is not dtk's plan cache (a directory or another file); the "
                     "calibration is not cached there, and the file is left as it is", path)
        return
    data[key] = value
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:  # a read-only home: measure again next time
        _log.info("plan: could not cache the calibration in %s (%s)", path, e)
        try:
            os.remove(tmp)
        except OSError:
            pass


def calibrate_machine(device_type: str, devices: int, *, cache: str | None = None,
                      refresh: bool = False) -> MachineCalibration:
    """Times gathers over each axis size that divides ``devices`` (cached, see the module doc)."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from tensorflow.experimental import dtensor  # pylint: disable=g-import-not-at-top
    from dtk.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
    path = cache or cache_path()
    key = f"machine/{device_type}:{devices}"
    cached = _cached(path, key, refresh)
    if cached:
        return MachineCalibration(device_kind=device_type, devices=devices,
                                  gather={int(k): tuple(v) for k, v in cached["gather"].items()})
    gather = {}
    small, large = 4 * 1024, 4 * MIB  # bytes per device after the gather
    sizes = [n for n in range(2, devices + 1) if devices % n == 0]
    for i, size in enumerate(sizes):
        _progress.info("plan: timing gathers over an axis of %d devices (%d of %d axis sizes; "
                       "cached for the next run)", size, i + 1, len(sizes))
        mesh = mesh_lib.build_mesh(f"batch={devices // size},model={size}", device_type=device_type)
        points = []
        for nbytes in (small, large):
            rows = devices // size * 8
            width = max(size, nbytes // 4 // 8 // size * size)
            x = dtensor.call_with_layout(tf.ones, dtensor.Layout(["batch", "model"], mesh),
                                         [rows, width])
            target = dtensor.Layout(["batch", dtensor.UNSHARDED], mesh)

            @tf.function
            def gathered(x, target=target):
                return tf.reduce_sum(dtensor.relayout(x, target))

            @tf.function
            def local(x):
                return tf.reduce_sum(x)

            with_gather, without = alternating_ms([lambda: float(gathered(x)),
                                                   lambda: float(local(x))])
            ms = with_gather - without
            points.append((8 * width * 4, max(ms, 0.0)))
        (b0, t0), (b1, t1) = points
        per_mib = max((t1 - t0) / ((b1 - b0) / MIB), 0.0)
        gather[size] = (max(t0, 0.0), per_mib)
    _store_cache(path, key, {"gather": {str(k): list(v) for k, v in gather.items()}})
    return MachineCalibration(device_kind=device_type, devices=devices, gather=gather)


def calibrate_step(model_factory, *, profile: ModelProfile, table, machine: MachineCalibration,
                   device_type: str, devices: int, batch: int, input_shape: Sequence[int], input_dtype: str,
                   loss: Any, optimizer: Any, remat_patterns: Sequence[str], num_classes: int,
                   cache: str | None = None, refresh: bool = False,
                   on: Candidate | None = None) -> StepCalibration:
    """Times the model's own step on ``batch=D`` at ``batch`` rows and at half of them (and at
    ``batch`` with remat), the steps alternating call by call so that noise hits them alike.

    ``batch`` is the global batch, or the microbatch that fits the budget on ``batch=D``: the
    prediction for the likeliest plans is then a measurement, not an extrapolation.

    ``on``: a candidate that fits the budget, for a model whose replicated step on ``batch=D``
    does not (``_calibrate_on``): the step is timed there instead, one build at a time, so the
    calibration never holds more than that candidate's memory per device.
    """
    import numpy as np  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from dtk.parallel import layouts, mesh as mesh_lib  # pylint: disable=g-import-not-at-top
    from dtk.train import steps  # pylint: disable=g-import-not-at-top
    path = cache or cache_path()
    key = (f"step/{device_type}:{devices}/{profile.signature}/{table.name}/{batch}/"
           f"{json.dumps([str(loss), str(optimizer), list(remat_patterns)])}"
           f"{'/on ' + on.label if on is not None else ''}")
    cached = _cached(path, key, refresh)
    if cached:
        return StepCalibration(**{k: tuple(v) if isinstance(v, list) else v
                                  for k, v in cached.items()})
    if on is not None:
        result = _calibrate_on(on, model_factory=model_factory, profile=profile, table=table,
                               machine=machine, device_type=device_type, batch=batch,
                               input_shape=input_shape, input_dtype=input_dtype, loss=loss,
                               optimizer=optimizer, remat_patterns=remat_patterns,
                               num_classes=num_classes)
        _store_cache(path, key, dataclasses.asdict(result))
        return result
    mesh = mesh_lib.build_mesh(",".join(f"{a}={devices if a == 'batch' else 1}" for a in
                                        ["batch"] + [a for a in table.axes
                                                     if a not in ("batch", table.sequence_axis)]),
                               device_type=device_type)
    half = max(devices, batch // 2 // devices * devices)
    if half == batch:
        batch = 2 * half
    rng = np.random.default_rng(0)

    built = [0]

    def step_fn(rows: int, remat: Sequence[str] = (), k: int = 1, fsdp: bool = False):
        built[0] += 1
        _progress.info("plan: timing the model's step, variant %d of %d: %d rows%s%s%s on "
                       "batch=%d", built[0], len(variants) + 1, rows, ", remat" if remat else "",
                       f", {k} microbatches" if k > 1 else "", ", fsdp" if fsdp else "",
                       devices)
        model, _ = layouts.build_model(model_factory, mesh, table, seed=0,
                                       input_shape=_build_shape(input_shape),
                                       input_dtype=_build_dtype(input_dtype),
                                       allow_replicated=True, fsdp=fsdp)
        step = steps.Steps(model, loss=loss, optimizer=optimizer, mesh=mesh,
                           config=steps.StepConfig(remat=tuple(remat),
                                                   gradient_accumulation_steps=k))
        packed = _random_batch(rng, mesh, rows, input_shape, input_dtype, num_classes,
                               model.output_shape)
        return lambda: float(tf.reduce_sum(step.train(packed)))

    variants = {"half": lambda: step_fn(half)}
    if remat_patterns:
        variants["remat"] = lambda: step_fn(batch, remat_patterns)
    if (batch // devices) % 2 == 0:  # microbatches are possible
        variants["k2"] = lambda: step_fn(batch, k=2)
        variants["fsdp_k2"] = lambda: step_fn(batch, k=2, fsdp=True)
    if devices > 1:
        variants["fsdp"] = lambda: step_fn(batch, fsdp=True)
    # The timed builds' notes (FSDP's replicated weights, random layers) are the real run's to
    # give, once: quiet here.
    level = _log.level
    _log.setLevel(logging.ERROR)
    try:
        measured = {"plain": 0.0, **paired_ms(step_fn(batch), variants)}
    finally:
        _log.setLevel(level)
    measured["plain"] = measured.pop("anchor")
    e = max((measured["plain"] - measured["half"]) / (batch - half), 0.0)
    a = max(measured["plain"] - e * batch, 0.0)
    share = max(measured["remat"] / measured["plain"] - 1, 0.0) if "remat" in measured else 0.0
    micro = fsdp_micro = 0.0
    fsdp = max(measured["fsdp"] - measured["plain"], 0.0) if "fsdp" in measured else 0.0
    if "k2" in measured:
        grads = sum(math.prod(shape) * _itemsize(dtype) for _, shape, dtype in profile.weights)
        micro = max(measured["k2"] - measured["plain"] - 2 * machine.gather_ms(devices, grads),
                    0.0)
        fsdp_micro = max(measured["fsdp_k2"] - measured["k2"] - fsdp, 0.0)
    result = StepCalibration(a_ms=a, e_ms=e, remat_share=share, microbatch_ms=micro,
                             fsdp_microbatch_ms=fsdp_micro, fsdp_ms=fsdp, batch_sizes=(batch, half),
                             measured_ms=tuple(measured.values()))
    _store_cache(path, key, dataclasses.asdict(result))
    return result


# What a remat candidate's step costs more than the same step without remat, when only the
# remat step fits the budget and so cannot be compared: the forward pass again, about a third
# of a step (forward + backward, the backward about twice the forward).
ASSUMED_REMAT_SHARE = 1 / 3


def _calibrate_on(on: Candidate, *, model_factory, profile: ModelProfile, table,
                  machine: MachineCalibration, device_type: str, batch: int,
                  input_shape: Sequence[int], input_dtype: str, loss: Any, optimizer: Any,
                  remat_patterns: Sequence[str], num_classes: int) -> StepCalibration:
    """The cost model's figures from the step of candidate ``on`` (one that fits the budget),
    for a model whose replicated step on ``batch=D`` does not fit.

    The candidate's step is timed at half and a quarter of ``batch`` rows (where the mesh and the
    microbatches divide them), on one build of the model, dropped afterwards (never more than
    the candidate's memory per device). The cost
    model's collectives for that candidate (``predict_ms`` with no compute) are subtracted, and
    what is left is the compute ``a + e * B`` that every candidate shares. Not measured there:
    the share remat adds when ``on`` uses remat (``ASSUMED_REMAT_SHARE``), and a microbatch's
    own cost (in ``a`` and ``e`` when ``on`` has microbatches); ``explain_plan`` says so.
    """
    import gc  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from dtk.parallel import layouts, materialize, mesh as mesh_lib  # pylint: disable=g-import-not-at-top
    from dtk.train import steps  # pylint: disable=g-import-not-at-top
    mesh = mesh_lib.build_mesh(on.mesh, device_type=device_type)
    sizes = {name: mesh.dim_size(name) for name in mesh.dim_names}
    b, k = sizes.get("batch", 1), on.microbatches
    unit = b * k
    # Half and a quarter of the batch where the mesh and the microbatches divide them: less
    # activation memory and shorter steps than the whole batch (the cost is linear in it).
    smaller = [rows for rows in (batch // 2, batch // 4) if rows >= unit and rows % unit == 0]
    batches = tuple(smaller) if len(smaller) == 2 else (batch, *smaller[:1])
    remat = tuple(remat_patterns) if on.remat else ()
    rng = np.random.default_rng(0)

    def timed() -> list[float]:
        # One build for both batch sizes (each is traced once): a second build would hold a
        # second copy while the first is released.
        model, _ = layouts.build_model(
            model_factory, mesh, table, seed=0, input_shape=_build_shape(input_shape),
            input_dtype=_build_dtype(input_dtype),
            allow_replicated=True, fsdp=on.update == "fsdp")
        step = steps.Steps(model, loss=loss, optimizer=optimizer, mesh=mesh, config=steps.StepConfig(
            remat=remat, gradient_accumulation_steps=k,
            shard_optimizer_state=on.update == "zero" and b > 1))
        try:
            out = []
            for rows in batches:
                packed = _random_batch(rng, mesh, rows, input_shape, input_dtype, num_classes,
                                       model.output_shape)
                # Few calls: each step of a model that needs sharding is long.
                out.append(alternating_ms([lambda: float(tf.reduce_sum(step.train(packed)))],
                                          rounds=2, warmup=1)[0])
                del packed
            return out
        finally:
            del step, model
            gc.collect()
            materialize.release_free_memory()

    level = _log.level
    _log.setLevel(logging.ERROR)  # the real run gives the builds' notes, once
    try:
        measured = timed()
    finally:
        _log.setLevel(level)
    plan = layouts.plan_weights(table, _Axes(sizes), profile.weights,
                                fsdp_paths=[p for p, _, _ in profile.weights]
                                if on.update == "fsdp" else ())
    share = ASSUMED_REMAT_SHARE if on.remat else 0.0
    none = StepCalibration(a_ms=0.0, e_ms=0.0, remat_share=share)

    def compute(rows: int, ms: float) -> float:
        collectives = predict_ms(profile, plan, machine, none, global_batch_size=rows,
                                 update=on.update, remat=on.remat, microbatches=k,
                                 remat_patterns=remat)
        return max(ms - collectives, 0.0) / (1 + share)

    computed = [compute(rows, ms) for rows, ms in zip(batches, measured)]
    if len(batches) == 2:
        e = max((computed[0] - computed[1]) / (batches[0] - batches[1]), 0.0)
        a = max(computed[0] - e * batches[0], 0.0)
    else:  # one batch size only: all of it counted per example
        a, e = 0.0, computed[0] / batches[0]
    assumed = [f"remat +{share:.0%}"] if on.remat else []
    if k > 1:
        assumed.append(f"the {k} microbatches' own cost counted in the compute")
    if on.update == "fsdp":
        assumed.append("FSDP's own cost counted in the compute")
    if len(batches) == 1:
        assumed.append("one batch size: no per-call overhead separated")
    return StepCalibration(a_ms=a, e_ms=e, remat_share=share, batch_sizes=batches,
                           measured_ms=tuple(measured), measured_on=on.label,
                           assumed="; ".join(assumed))


def calibration_candidate(candidates: Sequence[Candidate], devices: int) -> Candidate | None:
    """Where to time the model's step: None (on ``batch=D``, replicated) when some data-parallel
    candidate fits the budget, else the fitting candidate without remat (its share is then
    measured in the step, not assumed) that needs the least memory: timing it never needs more
    memory than the plan that will be chosen, whichever it is. None when none fits (``choose``
    says why)."""
    runnable = [c for c in candidates if c.rejected is None]
    if any(c.fits and not c.remat and c.mesh.split(",")[0] == f"batch={devices}"
           for c in runnable):
        return None
    fitting = [c for c in runnable if c.fits]
    if not fitting:
        return None
    return min(fitting, key=lambda c: (c.remat, c.memory["total"]))


def _random_batch(rng, mesh, rows: int, input_shape: Sequence[int], input_dtype: str,
                  num_classes: int, output_shape) -> tuple:
    """A packed batch of random inputs and labels for a timed step (integer inputs, token ids,
    are drawn from the label range too)."""
    import numpy as np  # pylint: disable=g-import-not-at-top
    from dtk.data import input as input_lib  # pylint: disable=g-import-not-at-top
    def draw(one_shape, dtype):
        shape = [rows, *one_shape]
        if "int" in dtype:
            return rng.integers(0, num_classes, shape).astype(dtype)
        return rng.standard_normal(shape).astype(dtype)

    if isinstance(input_shape, dict):  # named inputs
        x = {k: draw(v, input_dtype[k] if isinstance(input_dtype, dict) else input_dtype)
             for k, v in input_shape.items()}
    else:
        x = draw(input_shape, input_dtype)
    if output_shape[-1] == 1:  # one logit: 0/1 labels of the output's shape
        y = rng.integers(0, 2, [rows, *output_shape[1:]]).astype(np.float32)
    else:
        y = rng.integers(0, num_classes, [rows, *output_shape[1:-1]]).astype(np.int64)
    return input_lib.pack(mesh, (x, y, np.ones(rows, np.float32)))


def paired_ms(anchor: Callable[[], Any], variants: dict[str, Callable[[], Callable[[], Any]]],
              *, rounds: int = 9) -> dict[str, float]:
    """ms per call of ``anchor`` (key ``"anchor"``) and of each variant, measured as ratios.

    Each variant is built (``variants[name]()`` returns its call), timed alternating with the
    anchor, and dropped before the next: two models alive at a time, as in a real run (with many
    alive every step ran 30-40% slower here), and a variant's time is its median ratio to the
    anchor in its own rounds times the anchor's median over all rounds, so drift between
    variants cancels out.
    """
    import gc  # pylint: disable=g-import-not-at-top
    ratios, anchor_ms = {}, []
    for name, build in variants.items():
        fn = build()
        base, other = alternating_ms([anchor, fn], rounds=rounds)
        ratios[name] = other / base
        anchor_ms.append(base)
        del fn
        gc.collect()
    if not anchor_ms:
        anchor_ms = alternating_ms([anchor], rounds=rounds)
    ms = statistics.median(anchor_ms)
    return {"anchor": ms, **{name: r * ms for name, r in ratios.items()}}


def alternating_ms(fns: Sequence[Callable[[], Any]], *, rounds: int = 9,
                   warmup: int = 3) -> list[float]:
    """Median ms per call of each function, called in turn (noise hits them alike)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, out in zip(fns, times):
            start = time.perf_counter()
            fn()
            out.append(1000 * (time.perf_counter() - start))
    return [statistics.median(t) for t in times]


def _agree(machine: MachineCalibration, step: StepCalibration
           ) -> tuple[MachineCalibration, StepCalibration]:
    """Client 0's figures on every client, so that every client chooses the same plan."""
    from dtk.cluster import env as cluster  # pylint: disable=g-import-not-at-top
    if not cluster.is_multi_client():
        return machine, step
    from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
    ctx = context.context()
    key = f"dtk/plan/calibration/{next(_POSTS)}"
    if cluster.is_lead_client():
        ctx.set_config_key_value(key, json.dumps(
            {"gather": {str(k): list(v) for k, v in machine.gather.items()},
             "step": dataclasses.asdict(step)}))
        return machine, step
    data = json.loads(ctx.get_config_key_value(key, timeout_in_ms=600_000))
    machine = dataclasses.replace(machine, gather={int(k): tuple(v)
                                                   for k, v in data["gather"].items()})
    s = data["step"]
    step = StepCalibration(**{k: tuple(v) if isinstance(v, list) else v for k, v in s.items()})
    return machine, step


# -- the entry point --------------------------------------------------------------------------------
def plan(model_factory: Callable[[], Any], *, devices: int | None = None,
         global_batch_size: int, device_memory_gb: float | None = None, table=None,
         input_shape: Sequence[int] | None = None, input_dtype: str | None = None,
         num_classes: int | None = None,
         loss: Any = None, optimizer: Any = "adamw",
         remat_patterns: Sequence[str] = (), device_type: str = "auto",
         cache: str | None = None, refresh: bool = False,
         machine: MachineCalibration | None = None,
         step: StepCalibration | None = None, pipeline: bool = False) -> Plan:
    """Chooses the mesh, update, remat and microbatches for ``model_factory`` (module docstring).

    Args:
      model_factory: builds the plain tf_keras model.
      devices: devices in the mesh (default: every device of ``device_type`` on every client).
      global_batch_size: examples per step, over all devices.
      device_memory_gb: memory per device for weights, state, gradients and activations
        (None: no limit; the fastest candidate wins).
      table: the layout table (name, path or LayoutTable).
      input_shape, input_dtype, num_classes: one example's input and the label range; the
        timed steps train on random data of that shape (integer inputs, token ids, are drawn
        from the label range too). Default: the model's input spec and the last dim of its
        output.
      loss, optimizer: what the timed steps train with (loss default: binary cross-entropy for
        a model with one output, a click model's logit; else sparse categorical).
      remat_patterns: the model's blocks, as for ``TrainerConfig(remat=...)``; without them remat
        is not a candidate.
      device_type: as for ``build_mesh``.
      cache: the calibration cache file; refresh: measure again even if cached.
      machine, step: calibrations to use instead of measuring (tests, benchmarks).
      pipeline: consider pipeline stages too (a ``stage`` axis: ``pipeline_candidates``), for a
        caller that runs them (``train_lm.py``).

    Raises:
      PlanError: no candidate fits, with the smallest shortfall and the fix.
      ValueError: bad arguments, named.
    """
    from dtk.cluster import env as cluster_lib  # pylint: disable=g-import-not-at-top
    from dtk.parallel import layouts, mesh as mesh_lib  # pylint: disable=g-import-not-at-top
    if not callable(model_factory):
        raise TypeError(f"model_factory must be a function that builds the tf_keras model (e.g. "
                        f"dtk.models.mnist_mlp); got {type(model_factory).__name__} "
                        f"{model_factory!r}. For a model by name, use dtk.models.MODEL_SPECS"
                        "[name].factory")
    if not isinstance(global_batch_size, int) or isinstance(global_batch_size, bool) or \
            global_batch_size < 1:
        raise ValueError(f"global_batch_size must be a positive integer; got {global_batch_size!r}")
    if devices is not None and (not isinstance(devices, int) or isinstance(devices, bool)
                                or devices < 1):
        raise ValueError(f"devices must be a positive integer (the mesh's device count); got "
                         f"{devices!r}")
    if device_memory_gb is not None and (
            isinstance(device_memory_gb, bool) or not isinstance(device_memory_gb, (int, float))
            or not 0 < device_memory_gb < float("inf")):
        raise ValueError(f"device_memory_gb must be a positive number of GiB (e.g. 0.5); got "
                         f"{device_memory_gb!r}")
    if isinstance(remat_patterns, str):
        raise ValueError(f"remat_patterns must be a list of layer-name patterns, e.g. "
                         f"[{remat_patterns!r}]; got the string {remat_patterns!r} (a string would "
                         "be read letter by letter)")
    for pattern in remat_patterns:
        try:
            re.compile(pattern)
        except (re.error, TypeError) as e:
            raise ValueError(f"remat_patterns: {pattern!r} is not a regular expression: {e}") \
                from None
    for shape in (input_shape.values() if isinstance(input_shape, dict) else [input_shape]):
        if shape is not None and (isinstance(shape, (str, bytes)) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)):
            raise ValueError(
                f"input_shape must be one example's shape as positive integers, without the batch "
                f"dim (e.g. (28, 28, 1)), or a dict of them by input name; got {input_shape!r}")
    table = layouts.load_table(table or "data_parallel")
    kind = mesh_lib.resolve_device_type(device_type)
    if devices is not None and kind == "CPU" and not mesh_lib.is_tensorflow_initialized() \
            and not cluster_lib.is_multi_client():
        # A CPU-only process: ``devices`` virtual CPUs, as the README's dtk.plan(..., devices=8).
        mesh_lib.configure_virtual_cpus(devices)
    if devices is None:  # every device of every client (initializes TensorFlow's devices)
        devices = mesh_lib.build_mesh("batch=-1", device_type=kind).size
    budget = None if device_memory_gb is None else int(device_memory_gb * 1024 * MIB)
    profile = profile_model(model_factory, input_shape, input_dtype=input_dtype)
    input_shape, input_dtype = profile.input_shape, profile.input_dtype
    num_classes = num_classes or profile.outputs
    if loss is None:
        loss = "binary_crossentropy" if profile.outputs == 1 else "sparse_categorical_crossentropy"
    names = {part for layer in profile.layers for part in layer.name.split("/")}
    for pattern in remat_patterns:
        if not any(re.fullmatch(pattern, name) for name in names):
            raise ValueError(
                f"remat_patterns: {pattern!r} matches no layer of the model (layers: "
                f"{sorted(names)[:8]}...); name the model's blocks, as for TrainerConfig(remat=...)")
    common = {"devices": devices, "global_batch_size": global_batch_size,
              "budget_bytes": budget, "remat_patterns": remat_patterns}
    splits = stage_splits(model_factory, input_shape, input_dtype, devices) if pipeline else {}

    def every(machine, step):
        return enumerate_candidates(profile, table, machine=machine, step=step, **common) + \
            pipeline_candidates(profile, table, splits, devices=devices,
                                global_batch_size=global_batch_size, budget_bytes=budget,
                                machine=machine, step=step)
    if machine is None or step is None:
        # Memory first: a budget nothing fits is an error before anything is measured, and
        # the model's step is timed at the rows that fit on batch=D.
        untimed = every(None, None)
        choose(untimed)
        untimed = [c for c in untimed if c.stages == 1]
        data_parallel = [c for c in untimed if c.rejected is None and not c.remat
                         and c.mesh.split(",")[0] == f"batch={devices}"]
        fitting = [c for c in data_parallel if c.fits] or data_parallel
        rows = global_batch_size // min((c.microbatches for c in fitting), default=1)
        # A model whose replicated step does not fit is timed on a candidate that does.
        on = calibration_candidate(untimed, devices) if budget is not None else None
        if on is not None:
            rows = global_batch_size
        if machine is None:
            machine = calibrate_machine(kind, devices, cache=cache, refresh=refresh)
        if step is None:
            step = calibrate_step(model_factory, profile=profile, table=table, machine=machine,
                                  device_type=kind,
                                  devices=devices, batch=max(rows, devices),
                                  input_shape=input_shape, input_dtype=input_dtype, loss=loss,
                                  optimizer=optimizer, remat_patterns=remat_patterns,
                                  num_classes=num_classes, cache=cache, refresh=refresh,
                                  on=on)
    machine, step = _agree(machine, step)
    candidates = every(machine, step)
    chosen = choose(candidates)
    _log.debug("plan: %s, predicted %.1f ms/step, %s per device", chosen.label,
               chosen.predicted_ms or 0.0, _mib(chosen.memory["total"]))
    return Plan(chosen=chosen, candidates=tuple(candidates), machine=machine, step=step,
                global_batch_size=global_batch_size, table=table.name)


def plot_plan(p: Plan, path: str) -> None:
    """Draws every candidate as predicted ms/step against memory per device, with the budget
    as a vertical line and the chosen plan marked, into the PNG ``path`` (needs matplotlib).

    Raises:
      ValueError: matplotlib is not installed (named, with the install command).
    """
    try:
        import matplotlib  # pylint: disable=g-import-not-at-top
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
    except ImportError:
        raise ValueError("drawing the plan needs matplotlib: pip install matplotlib (dtk's bench "
                         "extra)") from None
    timed = [c for c in p.candidates if c.rejected is None and c.predicted_ms is not None]
    fig, ax = plt.subplots(figsize=(9, 6))
    for fits, color, label in ((True, "tab:blue", "fits the budget"),
                               (False, "tab:gray", "over the budget")):
        group = [c for c in timed if c.fits == fits and c is not p.chosen]
        if group:
            ax.scatter([c.memory["total"] / MIB for c in group],
                       [c.predicted_ms for c in group], color=color, label=label, s=30)
    chosen = p.chosen
    ax.scatter([chosen.memory["total"] / MIB], [chosen.predicted_ms], color="tab:red", marker="*",
               s=250, label=f"chosen: {chosen.label}", zorder=3)
    # Candidates at the same point (the same memory and time, e.g. remat or not where remat
    # saves nothing) share one label; labels of nearby points are stacked, not drawn over.
    at: dict[tuple[float, float], list[str]] = {}
    for c in timed:
        at.setdefault((round(c.memory["total"] / MIB, 1), round(c.predicted_ms, 1)),
                      []).append(c.label)
    span_x = max((x for x, _ in at), default=1.0) - min((x for x, _ in at), default=0.0) or 1.0
    span_y = max((y for _, y in at), default=1.0) - min((y for _, y in at), default=0.0) or 1.0
    placed: list[tuple[float, float]] = []
    for (x, y), labels in sorted(at.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        near = sum(1 for px, py in placed  # a label runs right of its point
                   if -0.1 * span_x < x - px < 0.35 * span_x and abs(py - y) < 0.04 * span_y)
        placed.append((x, y))
        ax.annotate(" / ".join(labels), (x, y), fontsize=6, xytext=(4, 2 + 8 * near),
                    textcoords="offset points")
    if chosen.budget is not None:
        ax.axvline(chosen.budget / MIB, color="tab:red", linestyle="--",
                   label=f"budget {chosen.budget / MIB:.0f} MiB per device")
    ax.set_xlabel("memory per device (MiB): weights, optimizer state, gradients, gathered, "
                  "activations")
    ax.set_ylabel("predicted ms per step")
    where = f" (step timed on {p.step.measured_on})" if p.step.measured_on else ""
    ax.set_title(f"dtk plan: {p.machine.devices} {p.machine.device_kind.upper()} devices, global "
                 f"batch {p.global_batch_size}, table {p.table}{where}", fontsize=9)
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def explain_plan(p: Plan) -> str:
    """Every candidate: memory per device, predicted ms/step, and chosen or why not."""
    moe = any(c.experts_bytes for c in p.candidates)
    staged = any(c.stages > 1 for c in p.candidates)
    rows = [("candidate", "weights", "state", "grads", "gathered", "activations", "total",
             *(("experts", "all-to-all") if moe else ()),
             *(("bubble", "boundary") if staged else ()), "ms/step", "")]
    best = p.chosen
    fastest = min((c.predicted_ms or 0.0 for c in p.candidates if c.fits and not c.rejected),
                  default=best.predicted_ms or 0.0)
    for c in sorted(p.candidates, key=lambda c: (c.predicted_ms is None, c.predicted_ms or 0)):
        if c.rejected:
            rows.append((c.label, "", "", "", "", "", "", *(("", "") if moe else ()),
                         *(("", "") if staged else ()), "", f"cannot run: {c.rejected}"))
            continue
        m = c.memory
        if c is best:
            why = "CHOSEN"
        elif not c.fits:
            why = f"over budget by {_mib(m['total'] - c.budget)}"
        else:
            ratio = (c.predicted_ms or 0) / (best.predicted_ms or 1) - 1
            if (c.predicted_ms or 0.0) <= fastest * TIE:  # as choose() decides
                why = f"a tie ({ratio:+.1%}): the tie goes to the chosen one"
            else:
                why = f"slower ({ratio:+.0%})"
        rows.append((c.label, *(f"{m[k] / MIB:.1f}" for k in (
            "weights", "optimizer", "gradients", "gathered", "activations", "total")),
            *((f"{c.experts_bytes / MIB:.1f}", f"{c.all_to_all_bytes / MIB:.1f}") if moe else ()),
            *((f"{c.bubble:.0%}" if c.stages > 1 else "", f"{c.boundary_bytes / MIB:.1f}"
               if c.stages > 1 else "") if staged else ()),
            f"{c.predicted_ms:.1f}" if c.predicted_ms is not None else "", why))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    budget = best.budget
    lines = [f"plan for {p.machine.devices} {p.machine.device_kind.upper()} device(s), global batch "
             f"{p.global_batch_size}, table {p.table!r}, budget "
             f"{_mib(budget) if budget is not None else 'none'} per device (MiB per device below)"]
    lines += ["  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    s = p.step
    m = s.measured_ms
    timed = ", ".join(f"{ms:.1f} ms at batch {rows}" for ms, rows in zip(m, s.batch_sizes))
    where = (f"the step timed on {s.measured_on} ({timed}; the replicated step on "
             f"batch={p.machine.devices} does not fit the budget), less that candidate's "
             f"predicted collectives, scaled to every candidate by the cost model"
             f"{'; assumed: ' + s.assumed if s.assumed else ''}" if s.measured_on else
             f"measured {timed} on batch={p.machine.devices}")
    lines.append(f"cost model: {s.a_ms:.1f} ms + {s.e_ms:.3f} ms/example x batch ({where}); remat "
                 f"+{s.remat_share:.0%}; FSDP +{s.fsdp_ms:.1f} ms; a microbatch "
                 f"+{s.microbatch_ms:.1f} ms (FSDP +{s.fsdp_microbatch_ms:.1f} ms) and its "
                 "gradient reduction; a seq axis: each attention layer's keys and values "
                 "gathered and their gradient reduce-scattered, activations / seq; gathers: "
                 + ", ".join(
                     f"axis {n}: {a:.2f} ms + {b:.2f} ms/MiB" for n, (a, b) in
                     sorted(p.machine.gather.items())))
    if moe:
        lines.append("experts: the experts' weights and optimizer state per device (within weights "
                     "and state; divided by the axis sharding the experts); all-to-all: MiB a "
                     "device sends a step, the expert inputs to their experts and back, forward "
                     "and backward, priced as gathers of what a device holds")
    if staged:
        lines.append("stage=S: a pipeline of S stages (1F1B); memory is the largest stage's "
                     "(its optimizer state replicated within it); bubble (S - 1) / (M + S - 1), "
                     "priced as if the stages ran at once (a GPU host; this machine's cores run "
                     "them one after another); boundary: MiB a step moves between stages, "
                     "activations forward and their gradients back")
    if any("seq=" in c.label for c in p.candidates):
        lines.append("attention on a seq axis: priced as the all-gather of keys and values; at "
                     "build time the layout table's sequence_attention (auto: the default) times "
                     "the all-gather against the all-to-all to heads (Ulysses) on the chosen mesh "
                     "and uses the faster, and the log says which (dtk.parallel.sequence)")
    lines.append(f"chosen: {TIE_RULE}")
    lines.append(f"plan: {best.label}: predicted {best.predicted_ms:.1f} ms/step, "
                 f"{_mib(best.memory['total'])} per device")
    return "\n".join(lines)
