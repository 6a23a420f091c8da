"""Layouts: how tensors and Keras weights are laid out on a mesh.

(Work in progress: rule tables, LayoutMap builders, validation and the explainer land here.)
"""

from __future__ import annotations

from tensorflow.experimental import dtensor

from dtk.mesh import BATCH_AXIS


def batch_layout(mesh: dtensor.Mesh, rank: int, *, batch_axis: str = BATCH_AXIS) -> dtensor.Layout:
    """The layout of an input tensor: dim 0 sharded on ``batch_axis``, every other dim unsharded.

    On a ``batch=4,model=2`` mesh a ``[128, 784]`` batch puts rows 32*i..32*i+31 on both devices of
    batch row i; the two devices along ``model`` hold the same rows. A mesh without ``batch_axis``
    replicates inputs.

    Raises:
      ValueError: ``rank`` < 1 (a scalar has no batch dim).
    """
    if rank < 1:
        raise ValueError(f"an input of rank {rank} has no batch dim to shard on axis {batch_axis!r}; "
                         "inputs must be at least rank 1 ([batch, ...])")
    if batch_axis not in mesh.dim_names:
        return dtensor.Layout.replicated(mesh, rank)
    return dtensor.Layout.batch_sharded(mesh, batch_axis, rank)
