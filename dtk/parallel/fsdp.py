"""Fully sharded data parallel (ZeRO-3): weights stored sharded over the batch axis too.

With ``fsdp=True`` the plan stores every trainable weight sharded over the batch axis, on the
first dim that the table leaves unsharded and the axis size divides (the placement of the sharded
optimizer update, ``layouts.shard_over_axis``), on top of whatever the table shards over
``model`` (2-D FSDP x TP). The weight, its gradient and its optimizer state then take 1/batch
of the memory they took, and the optimizer update is sharded with no second copy of the weights
(unlike ``shard_optimizer_state``, which keeps replicated weights and sharded float32 masters).

For compute, the forward pass reads each weight through a gather: inside ``gather_scope`` (which
dtk's train, eval and predict steps enter) a read of such a weight returns it relayouted to the
table's layout, an all-gather over the batch axis. DTensor differentiates the relayout into the
weight's own layout, so each gradient arrives sharded (on CPU: the full-size partial sums are
all-reduced and each device keeps its slice) and the update touches only the local slice.
Outside the scope (the optimizer, checkpoints, ``global_value``) a read returns the stored shards.

A weight with no dim that the batch axis divides (a bias of 10 on ``batch=8``) stays replicated
over it; the plan lists them in one warning with their bytes.

When the gathers run, and how long gathered weights and full-size gradients live, is scheduled
as in PyTorch's FSDP2 (``reshard_after_forward``), so that a step holds a few layers' worth of
full-size tensors, not the whole model's. Each item below was measured; without them the 772.7
MiB LM of issue 24 on ``batch=8`` (4 clients x 2 CPUs) peaked at 4.7 GB per client, with all
three at 2.27 GB:

* Each layer's gathers wait for the layer's inputs (``gather_after``, a control dependency on
  the read: DTensor drops control inputs of the Relayout it lowers). Otherwise the executor
  starts every gather when the step starts, since reads depend on nothing.
* The backward pass gathers again (``regather_for_backward``): the gradient ops that read a
  gathered weight (a MatMul's input gradient) are rewired to a fresh gather that waits, by data,
  for the gradient arriving at them (a zero computed from it, as ``tf.recompute_grad`` does; a
  plain second read would be merged with the forward's), and for the previous layer's
  finished gradient. The forward pass's gathered weights are then freed after their forward use.
* Each sharded gradient gets a buffer of its own (``own_buffer``): the slice a device keeps is
  a view of the full-size sum, and the update would otherwise keep that view, and with it the
  full-size buffer, in the variable.

With ``remat`` a block's recomputation gathers again as well (inside ``tf.recompute_grad``).

Where a Dense or EinsumDense layer's activations are smaller than its kernel (wide layers, few
tokens), the kernel is not gathered at all: the layer multiplies by its shards and gathers the
activations instead (``_activation_gathered``). With it, the LM above peaks at 1.99 GB per
client.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import threading
from collections.abc import Iterator
from typing import NamedTuple

import tensorflow as tf
from tensorflow.experimental import dtensor


class _Scope(threading.local):
    def __init__(self):
        self.active = False
        self.after: list[tf.Tensor] = []  # what this layer's gathers wait for
        self.records: list | None = None  # (gathered tensor, variable) of a forward pass


_scope = _Scope()


def is_gathering() -> bool:
    """Whether reads of FSDP weights gather them now (inside ``gather_scope``)."""
    return _scope.active


@contextlib.contextmanager
def gather_scope(active: bool = True) -> Iterator[None]:
    """Within it, reads of FSDP weights return them gathered to their compute layout
    (``active=False``: their stored shards)."""
    saved, _scope.active = _scope.active, active
    try:
        yield
    finally:
        _scope.active = saved


class GatheredVariable(dtensor.DVariable):
    """A DVariable stored sharded over the batch axis and read gathered inside ``gather_scope``.

    ``adapt_variables`` swaps the class of an FSDP weight's DVariable; the object, its state and
    its checkpoint keys stay the same.
    """

    _dtk_compute_layout: dtensor.Layout

    def _read_variable_op(self, no_copy=False):
        if not _scope.active:
            return super()._read_variable_op(no_copy=no_copy)
        gathered = self._gather(_waits(), no_copy=no_copy)
        if _scope.records is not None:
            _scope.records.append((gathered, self))
        return gathered

    def _gather(self, waits, no_copy=False, after=None):
        # The wait goes on the read: DTensor drops control inputs of the Relayout it lowers.
        with tf.control_dependencies(waits):
            value = super()._read_variable_op(no_copy=no_copy)
        if after is not None:
            value = value + tf.cast(after, value.dtype)
        return dtensor.relayout(value, self._dtk_compute_layout)

    def sparse_read(self, indices, name=None):
        if _scope.active:  # an Embedding lookup: gather rows of the gathered table
            return tf.gather(self.value(), indices, name=name)
        return super().sparse_read(indices, name=name)


def _waits() -> list[tf.Tensor]:
    """The tensors the gathers being made now wait for: those of the current graph in
    ``gather_after``'s innermost scope (a tensor of an enclosing graph cannot be waited on)."""
    if tf.executing_eagerly():
        return []
    graph = tf.compat.v1.get_default_graph()
    return [t for t in _scope.after if getattr(t, "graph", None) is graph]


@contextlib.contextmanager
def gather_after(tensors) -> Iterator[None]:
    """Within it, gathers of FSDP weights wait until ``tensors`` (a layer's inputs) exist."""
    saved = _scope.after
    _scope.after = [t for t in tf.nest.flatten(tensors)
                    if tf.is_tensor(t) and not isinstance(t, tf.SparseTensor)]
    try:
        yield
    finally:
        _scope.after = saved


def schedule(model) -> int:
    """Makes the gathers of every layer of ``model`` wait for the layer's inputs.

    Returns:
      The number of layers scheduled (every layer, nested ones included, and the model).
    """
    import tf_keras  # pylint: disable=g-import-not-at-top
    count = 0
    for layer in model._flatten_layers(include_self=True):  # pylint: disable=protected-access
        if getattr(layer, "_dtk_fsdp_scheduled", False):
            continue
        if isinstance(layer, (tf_keras.layers.Dense, tf_keras.layers.EinsumDense)):
            layer.call = _activation_gathered(layer, layer.call)
        layer.call = _after_inputs(layer.call)
        layer._dtk_fsdp_scheduled = True  # pylint: disable=protected-access
        count += 1
    return count


def _after_inputs(call):
    @functools.wraps(call)
    def wrapped(*args, **kwargs):
        if not _scope.active:
            return call(*args, **kwargs)
        with gather_after((args, kwargs)):
            return call(*args, **kwargs)
    return wrapped


def _activation_gathered(layer, call):
    """A Dense or EinsumDense layer's call that gathers its inputs instead of its kernel, where
    that moves less.

    With the kernel stored sharded over an axis on a dim that the layer contracts with the
    inputs (the FSDP shards of a kernel the table replicates: ``[axis, unsharded]`` for a
    Dense), each device multiplies its block of that input dim, for the tokens of all devices
    (an all-gather of the activations), by its shard of the kernel, and the partial products
    are summed over the axis (an all-reduce of the outputs). DTensor differentiates that into a
    weight gradient that each device computes as its own shard (no full-size gradient, no
    reduction) and an input gradient from its shard of the kernel: no device ever holds the
    whole kernel. It moves the activations, ``T * (in + out)`` values for ``T`` tokens in the
    global batch, instead of the ``in * out`` of the kernel: less for wide layers and short
    batches (the LM of issue 24, dim 2048 with 256 tokens: a sixth for its MLP). Otherwise, and
    for inputs that are not a dense tensor, the kernel is gathered as every other weight is.
    """

    @functools.wraps(call)
    def wrapped(inputs, *args, **kwargs):
        plan = _activation_plan(layer, inputs) if _scope.active and not args and not kwargs \
            else None
        if plan is None:
            return call(inputs, *args, **kwargs)
        axis, mesh = plan.axis, plan.mesh
        if inputs.dtype.base_dtype != layer._compute_dtype_object.base_dtype:  # pylint: disable=protected-access
            inputs = tf.cast(inputs, layer._compute_dtype_object)  # pylint: disable=protected-access
        with gather_scope(False):
            kernel = tf.convert_to_tensor(layer.kernel)  # the stored shards (cast under autocast)
        # As a matmul of [tokens, contracted] by [contracted, outputs], with the kernel's sharded
        # dim moved first among the contracted ones, so that the reshapes keep it sharded.
        if plan.input_perm is not None:
            inputs = tf.transpose(inputs, plan.input_perm)
            kernel = tf.transpose(kernel, plan.kernel_perm)
        rows = tf.reshape(inputs, [-1, plan.contracted])
        rows = dtensor.relayout(rows, dtensor.Layout([dtensor.UNSHARDED, axis], mesh))
        outputs = tf.matmul(rows, tf.reshape(kernel, [plan.contracted, -1]))  # partial sums
        outputs = dtensor.relayout(outputs, dtensor.Layout([axis, dtensor.UNSHARDED], mesh))
        # Each device's rows are a view of the all-reduced sum of all rows (``own_buffer``): a
        # copy frees the sum now, not when the backward pass is done with what reads the rows.
        outputs = tf.reshape(own_buffer(outputs), plan.output_shape)
        if getattr(layer, "bias", None) is not None:
            outputs = outputs + layer.bias
        if layer.activation is not None:
            outputs = layer.activation(outputs)
        return outputs

    return wrapped


class _ActivationPlan(NamedTuple):
    axis: str  # the mesh axis the kernel's shards are cut over
    mesh: dtensor.Mesh
    contracted: int  # the size of the contracted dims, together
    output_shape: list[int]
    input_perm: list[int] | None  # transposes moving the kernel's sharded dim first
    kernel_perm: list[int] | None


def _activation_plan(layer, inputs) -> _ActivationPlan | None:
    """How ``layer`` gathers ``inputs`` instead of its kernel (see ``_activation_gathered``),
    or None where it should gather its kernel.

    The layer must multiply inputs ``[tokens..., contracted...]`` by a kernel ``[contracted...,
    outputs...]`` (a Dense; an EinsumDense such as attention's projections, ``abc,cde->abde``
    and ``abcd,cde->abe``) whose shards are cut on one contracted dim, over one axis.
    """
    kernel = getattr(layer, "kernel", None)
    kernel = getattr(kernel, "_variable", kernel)
    if not isinstance(kernel, GatheredVariable) or not isinstance(inputs, tf.Tensor):
        return None
    rank = inputs.shape.rank
    if not inputs.dtype.is_floating or not inputs.shape.is_fully_defined() or rank < 2:
        return None
    stored, compute = kernel.layout, kernel._dtk_compute_layout  # pylint: disable=protected-access
    sharded = [(d, a) for d, a in enumerate(stored.sharding_specs) if a != dtensor.UNSHARDED]
    if not compute.is_fully_replicated() or len(sharded) != 1:
        return None
    dim, axis = sharded[0]
    if hasattr(layer, "equation"):  # EinsumDense
        if "..." in layer.equation or "->" not in layer.equation:
            return None
        ins, out = layer.equation.split("->")
        spec_in, spec_kernel = ins.split(",")
    else:  # Dense
        spec_in, spec_kernel, out = "abcdefgh"[:rank - 1] + "y", "yz", "abcdefgh"[:rank - 1] + "z"
    if len(spec_in) != rank or len(spec_kernel) != kernel.shape.rank:
        return None
    # Contracted: a suffix of the inputs and a prefix of the kernel; the rest pass through.
    n = len(spec_kernel) - len(set(spec_kernel) - set(spec_in))
    tokens, contracted, kept = spec_in[:rank - n], spec_in[rank - n:], spec_kernel[n:]
    if n < 1 or spec_kernel[:n] != contracted or out != tokens + kept or not tokens:
        return None
    if dim >= n:
        return None  # the kernel is sharded on an output dim
    shape = inputs.shape.as_list()
    contracted_size = math.prod(shape[rank - n:])
    outputs = math.prod(shape[:rank - n]) * math.prod(kernel.shape.as_list()[n:])
    if shape[0] % stored.mesh.dim_size(axis):
        return None
    if inputs.shape.num_elements() + outputs >= kernel.shape.num_elements():
        return None  # gathering the kernel moves less
    input_perm = kernel_perm = None
    if dim:  # attention's output projection (heads, head_dim, dim), sharded on head_dim
        order = [dim] + [d for d in range(n) if d != dim]
        input_perm = list(range(rank - n)) + [rank - n + d for d in order]
        kernel_perm = order + list(range(n, kernel.shape.rank))
    return _ActivationPlan(axis, stored.mesh, contracted_size,
                           shape[:rank - n] + kernel.shape.as_list()[n:], input_perm, kernel_perm)


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """Collects the ``(gathered tensor, variable)`` of the gathers made within it."""
    saved, _scope.records = _scope.records, []
    try:
        yield _scope.records
    finally:
        _scope.records = saved


def graph_mark() -> int:
    """The largest op id of the current graph: ops made later have larger ones, so taken
    between the forward and the backward pass it tells the two apart."""
    graph = tf.compat.v1.get_default_graph()
    return max(graph._nodes_by_id, default=0)  # pylint: disable=protected-access


# Ops that read only a tensor's shape: in DTensor the stored shards have the same (global) shape.
_SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank"})
# Ops between a gathered weight and its users that the backward pass may read (an
# AutoCastVariable's cast): made again on the fresh gather.
_CHAIN_OPS = frozenset({"Cast", "Identity"})


def regather_for_backward(records, mark: int, grads=None) -> int:
    """Rewires the backward pass's readers of gathered weights to gathers of their own.

    Args:
      records: ``(gathered tensor, variable)`` of the forward pass (``recording``).
      mark: ``graph_mark()`` taken between the forward and the backward pass; ops with a larger
        id are the backward pass's.
      grads: ``{id(variable): gradient}``, the final (sharded) gradients. A weight's gather then
        also waits for the gradient of the weight gathered after it in the forward pass (the one
        before it in the backward pass): one layer's full-size weight and gradient at a time.
        Only weights read once take part (a weight read twice, a tied embedding, gets its
        gradient at the end of the backward pass: waiting for it would never end).

    Returns:
      The number of weights gathered again for the backward pass.
    """
    graph = tf.compat.v1.get_default_graph()
    reads = collections.Counter(id(variable) for _, variable in records)
    count = 0
    previous = None  # the gradient of the weight gathered next in the forward pass
    for gathered, variable in reversed(records):
        if gathered.graph is not graph or gathered.op._id > mark:  # pylint: disable=protected-access
            continue  # another graph's, or made by the backward pass (a recomputation)
        if _rewire(gathered, variable, mark, lambda fresh: fresh,
                   [] if previous is None else [previous]):
            count += 1
            grad = (grads or {}).get(id(variable)) if reads[id(variable)] == 1 else None
            previous = grad if grad is not None and not isinstance(grad, tf.IndexedSlices) else None
    return count


def _rewire(tensor, variable, mark, remake, after=()) -> bool:
    """Points the backward readers of ``tensor`` (``remake`` applied to a gather of
    ``variable``) at a fresh gather; follows casts. Returns whether anything was rewired."""
    backward = [op for op in tensor.consumers() if op._id > mark]  # pylint: disable=protected-access
    readers = [op for op in backward if op.type not in _SHAPE_OPS]
    stored = None
    for op in backward:
        if op.type in _SHAPE_OPS:
            stored = stored if stored is not None else _stored_read(tensor)
            if stored is not None:
                _replace_input(op, tensor, stored)
    done = False
    if readers:
        inputs = [t for op in readers for t in op.inputs if t is not tensor]
        waits = [t.op for t in [*inputs, *after]]
        fresh = remake(variable._gather(waits, after=_zero_after(inputs)))  # pylint: disable=protected-access
        for op in readers:
            _replace_input(op, tensor, fresh)
        done = True
    for op in tensor.consumers():
        if op._id <= mark and op.type in _CHAIN_OPS:  # pylint: disable=protected-access
            dtype = op.outputs[0].dtype
            chain = (lambda t, d=dtype, r=remake: tf.cast(r(t), d))
            done = _rewire(op.outputs[0], variable, mark, chain, after) or done
    return done


def _zero_after(tensors):
    """A scalar zero computed from ``tensors`` (NaN where they hold one): adding it to what the
    backward pass gathers makes that gather a different computation from the forward pass's
    (which DTensor would otherwise merge with it, holding the forward's gathered weight) and
    makes it wait for ``tensors`` by data, as ``tf.recompute_grad`` does."""
    for t in tensors:
        if t.dtype.is_floating:
            elem = tf.reduce_max(t)
            return tf.where(tf.equal(elem, elem), tf.zeros_like(elem), elem)
    return None


def _stored_read(tensor):
    """The stored shards a gathered tensor came from (the Relayout's input), if it is one."""
    op = tensor.op
    while op.type in _CHAIN_OPS:
        op = op.inputs[0].op
    return op.inputs[0] if op.type == "Relayout" else None


def _replace_input(op, old, new) -> None:
    for i, t in enumerate(op.inputs):
        if t is old:
            op._update_input(i, new)  # pylint: disable=protected-access


def own_buffer(tensor: tf.Tensor) -> tf.Tensor:
    """``tensor`` in a buffer of its own (a float64 round trip, exact).

    A sharded gradient arrives as a slice of its full-size sum over the batch axis (DTensor
    all-reduces, then each device keeps its part), and TensorFlow's Slice returns a view when it
    cuts only dim 0, the sharded dim here. Elementwise ops write into their input's buffer when
    they can, so the update's result, and then the variable, kept that view: every weight held
    a full-size buffer after the first step (1 GB instead of 128 MiB in a test of 8 weights of
    16 MiB on 8 devices). Multiplying by one or adding zero is folded away; a cast is not.
    """
    if tensor.dtype not in (tf.float32, tf.float16, tf.bfloat16):
        return tensor
    return tf.cast(tf.cast(tensor, tf.float64), tensor.dtype)


def own_buffers(grads, variables, records) -> list:
    """The gradients of the weights gathered in ``records`` in buffers of their own
    (``own_buffer``). A kernel multiplied by its shards (``_activation_gathered``) gets its
    gradient computed as its shard: in a buffer of its own already."""
    gathered = {id(getattr(variable, "_variable", variable)) for _, variable in records}
    return [own_buffer(g) if g is not None and id(getattr(v, "_variable", v)) in gathered else g
            for g, v in zip(grads, variables)]


def adapt_variables(weights, compute_layouts: dict[str, dtensor.Layout]) -> int:
    """Makes the weights named in ``compute_layouts`` (path -> layout for compute) read gathered.

    Args:
      weights: ``(path, variable)`` of every weight (``layouts.weight_paths``).
      compute_layouts: the table's layout of each FSDP weight.

    Returns:
      The number of weights adapted.
    """
    count = 0
    for path, variable in weights:
        layout = compute_layouts.get(path)
        if layout is None:
            continue
        target = getattr(variable, "_variable", variable)
        if not isinstance(target, dtensor.DVariable):
            raise TypeError(f"FSDP weight {path} is a {type(target).__name__}, not a DVariable")
        target.__class__ = GatheredVariable
        target._dtk_compute_layout = layout  # pylint: disable=protected-access
        count += 1
    return count
