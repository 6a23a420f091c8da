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
weight's own layout, so each gradient arrives sharded (a reduce-scatter) and the update touches
only the local slice. Outside the scope (the optimizer, checkpoints, ``global_value``) a read
returns the stored shards.

A weight with no dim that the batch axis divides (a bias of 10 on ``batch=8``) stays replicated
over it; the plan lists them in one warning with their bytes.

The gathered weights live as long as the step needs them (the backward pass reads them again);
with ``remat`` a block's gathered weights are dropped after its forward pass and gathered again
for its backward pass.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import tensorflow as tf
from tensorflow.experimental import dtensor


class _Scope(threading.local):
    def __init__(self):
        self.active = False


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
        value = super()._read_variable_op(no_copy=no_copy)
        if _scope.active:
            value = dtensor.relayout(value, self._dtk_compute_layout)
        return value

    def sparse_read(self, indices, name=None):
        if _scope.active:  # an Embedding lookup: gather rows of the gathered table
            return tf.gather(self.value(), indices, name=name)
        return super().sparse_read(indices, name=name)


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
