"""A Keras optimizer bound to the mesh, updating laid-out weights as dtk does.

An optimizer made without ``mesh=`` computes wrong updates under DTensor (dtensor-notes, trap
3): ``bind_optimizers`` makes every optimizer a compiled model holds again with the model's mesh,
and ``prepare_bound_optimizer`` gives it dtk's updates (``mesh_updates``): an Embedding's sparse
gradient applied dense, an FSDP weight updated where it is stored, the ZeRO-style sharded update
(``ShardedUpdate``), the EMA kept on the mesh; ``sparse_gradients`` makes its ``minimize`` take
the sparse tables' row gradients (``distribute(sparse_tables=True)``). Used by ``dtk.distribute``
and by a user's own loop (``dtk.train.custom_loops``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor

from dtk import _env
from dtk.parallel import fsdp
from dtk.train.mesh_calls import MeshState
from dtk.train.optimizers import check_supported, keep_ema_on_mesh
from dtk.parallel.layouts import sharded_update_dims


def update_layout(variable, mesh: dtensor.Mesh, batch_axis: str) -> dtensor.Layout:
    """The layout of a weight's optimizer state under ``shard_optimizer_state``.

    The weight's own layout, plus ``batch_axis`` on the first unsharded dim that the axis size
    divides (``layouts.sharded_update_dims``); unchanged (the weight updated in place,
    replicated over the axis) when no dim qualifies, e.g. a bias of 10 on ``batch=8``, or when
    the weight has fewer than ``layouts.SHARDED_UPDATE_MIN_ELEMENTS`` elements a device. Example
    on ``batch=4,model=2``: kernel ``[784, 128]`` laid out ``[unsharded, model]`` gets
    ``[batch, model]``: each device updates a 196 x 64 slice.
    """
    layout = dtensor.fetch_layout(variable)
    if batch_axis not in mesh.dim_names:
        return layout
    dims = [None if s == dtensor.UNSHARDED else s for s in layout.sharding_specs]
    dims = sharded_update_dims(dims, variable.shape, batch_axis,
                               {name: mesh.dim_size(name) for name in mesh.dim_names})
    return dtensor.Layout([d or dtensor.UNSHARDED for d in dims], mesh)


def auto_shard_optimizer_state(variables, mesh: dtensor.Mesh, batch_axis: str) -> bool:
    """The ``shard_optimizer_state="auto"`` rule: shard when it shards something.

    On when ``batch_axis`` has more than one device and at least one weight has a dim that the
    sharded update splits over it (``update_layout`` differs from the weight's layout); off on
    ``batch=1`` meshes and for models whose weights are all too small or already sharded there.
    Only the weights it splits get the sharded update; the rest are updated in place.
    The same rule in one process and across clients: a 2-client group killed mid-run, or while
    saving, resumes to the losses of one uninterrupted process
    (``tests/test_launch.py::test_restart_resumes_from_checkpoint``).
    Measured (BUILD.md, "Benchmarks"): faster than the replicated update on the MLP, the heavy
    MLP and the language model, with the split weights' optimizer memory per device divided
    by the axis size.
    """
    if batch_axis not in mesh.dim_names or mesh.dim_size(batch_axis) < 2:
        return False
    return any(update_layout(v, mesh, batch_axis).sharding_specs
               != dtensor.fetch_layout(v).sharding_specs for v in variables)


def storage(variable: Any) -> Any:
    """The DVariable under a mixed precision AutoCastVariable (the variable itself otherwise)."""
    return getattr(variable, "_variable", variable)


def bind_optimizers(model: tf_keras.Model, mesh: dtensor.Mesh,
                     sharded: ShardedUpdate | None = None) -> None:
    """Every optimizer the model holds after ``compile()`` (``model.optimizer``; a GAN's
    ``d_optimizer`` and ``g_optimizer``), made again bound to ``mesh`` when it is not.

    Raises:
      ValueError: a legacy optimizer (it rejects ``mesh=``), naming the attribute.
    """
    for attr, value in list(vars(model).items()):
        if attr.startswith("_") and attr != "_optimizer":
            continue
        if not isinstance(value, (tf_keras.optimizers.Optimizer,
                                  tf_keras.optimizers.legacy.Optimizer)):
            continue
        if isinstance(value, tf_keras.optimizers.legacy.Optimizer):
            raise ValueError(
                f"{attr} is a legacy optimizer ({type(value).__name__}), which cannot be bound "
                "to a DTensor mesh (it rejects mesh=); use tf_keras.optimizers."
                f"{type(value).__name__} (not .legacy)")
        check_supported(value, attr.lstrip("_"))
        bound_to = getattr(value, "_mesh", None)
        if bound_to is not None and bound_to != mesh:
            raise ValueError(
                f"{attr.lstrip('_')} {type(value).__name__} is bound to another mesh "
                f"({', '.join(f'{a}={bound_to.dim_size(a)}' for a in bound_to.dim_names)}) than "
                f"the model's ({', '.join(f'{a}={mesh.dim_size(a)}' for a in mesh.dim_names)}); "
                "create it without mesh= (dtk binds it to the model's mesh) or with the model's")
        if bound_to is not None:
            continue
        steps = np.asarray(value.iterations.numpy()) if tf.executing_eagerly() else None
        if steps is not None and steps.shape == () and int(steps):
            raise ValueError(f"{attr} ({type(value).__name__}) has already taken steps off the "
                             "mesh; compile the laid-out model with a new optimizer")
        name = "optimizer" if attr == "_optimizer" else attr
        setattr(model, name, bound_copy(value, mesh))
    for value in list(vars(model).values()):
        if isinstance(value, tf_keras.optimizers.Optimizer):
            prepare_bound_optimizer(value, sharded)


def bound_copy(optimizer: tf_keras.optimizers.Optimizer, mesh: dtensor.Mesh
               ) -> tf_keras.optimizers.Optimizer:
    """A new optimizer of ``optimizer``'s class and config, bound to ``mesh``."""
    config = optimizer.get_config()
    config.pop("is_legacy_optimizer", None)
    if isinstance(config.get("learning_rate"), dict):
        config["learning_rate"] = tf_keras.optimizers.schedules.deserialize(
            config["learning_rate"])
    return type(optimizer)(**config, mesh=mesh)


def prepare_bound_optimizer(optimizer: tf_keras.optimizers.Optimizer,
                            sharded: ShardedUpdate | None = None) -> None:
    """An optimizer bound to the mesh, made to update laid-out weights as dtk does: its EMA
    kept on the mesh, sparse gradients applied dense, the sharded update (``mesh_updates``)."""
    keep_ema_on_mesh(optimizer)
    mesh_updates(optimizer, sharded)


def mesh_updates(optimizer: tf_keras.optimizers.Optimizer,
                  sharded: ShardedUpdate | None) -> None:
    """Makes ``optimizer`` update the laid-out model's weights as dtk's Trainer does.

    * An Embedding's sparse gradient (``IndexedSlices``) is applied dense: its sparse update is
      ``ResourceScatterAdd``, which DTensor cannot lay out. The same values (the untouched rows
      get zero gradient; Adam's moments decay on every row either way, as Keras's dense path
      does).
    * With ``sharded`` (ZeRO-style, ``distribute(shard_optimizer_state=...)``): the weights that
      ``dtk.train.mesh_optimizer.update_layout`` splits are updated through a copy sharded over the batch
      axis (see ``ShardedUpdate``).
    * An FSDP weight is updated where it is stored (its shards).
    """
    if getattr(optimizer, "_dtk_mesh_updates", False):
        return
    apply = optimizer.apply_gradients
    build = optimizer.build
    finalize = optimizer.finalize_variable_values

    def apply_gradients(grads_and_vars, *args, **kwargs):
        mesh = getattr(optimizer, "_mesh", None)
        if tf.executing_eagerly() or mesh is None or _env.combine_all_reduces_disabled():
            return update(grads_and_vars, *args, **kwargs)
        # DTensor's all-reduce combining (DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION=1),
        # applied to one block, lets an optimizer slot's read move before its assign (SGD and
        # Adam 20-25% off in 5 steps); in a region of its own (a cond that is always true) the
        # update keeps its order and matches one device (BUILD.md, "DTensor settings").
        grads_and_vars = list(grads_and_vars)
        with tf.init_scope():  # its slots, before the region (no variable is made in a cond)
            build_([v for _, v in grads_and_vars])
        always = dtensor.call_with_layout(tf.ones, dtensor.Layout.replicated(mesh, 0), shape=[],
                                          dtype=tf.bool)
        return tf.cond(always,
                       lambda: tf.identity(update(grads_and_vars, *args, **kwargs)),
                       lambda: tf.identity(optimizer.iterations))

    def update(grads_and_vars, *args, **kwargs):
        pairs, copies = [], []
        for g, v in grads_and_vars:
            g = tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
            entry = sharded.entry(v) if sharded is not None and g is not None else None
            if entry is None:
                pairs.append((g, v))
                continue
            master, layout, target = entry
            # The copy starts each step from the weight itself (a slice of it, no collective):
            # weights set between steps (load_weights, BackupAndRestore) are never stale.
            master.assign(dtensor.relayout(storage(v).read_value(), target))
            # Pinned to the weight's layout first (layout propagation would otherwise push the
            # sharded layout into the gradient's producer), then sliced.
            pairs.append((dtensor.relayout(dtensor.relayout(g, layout), target), master))
            copies.append((v, master, layout))
        with fsdp.gather_scope(False):
            result = apply(pairs, *args, **kwargs)
        for v, master, layout in copies:  # all-gather over the batch axis
            storage(v).assign(dtensor.relayout(master.read_value(), layout))
        return result

    def mapped(var_list):
        return [sharded.master_of(v) for v in var_list] if sharded is not None else var_list

    def build_(var_list, *args, **kwargs):
        return build(mapped(var_list), *args, **kwargs)

    def finalize_variable_values(var_list):
        var_list = list(var_list)
        entries = [(v, sharded.entry(v) if sharded is not None else None) for v in var_list]
        for v, entry in entries:
            # The copy is refreshed from the weight first, as at every step: a fit that trains
            # no step (a finished run run again, resumed from its last checkpoint) would
            # otherwise write back a copy made before the restore (the initial values).
            if entry is not None:
                entry[0].assign(dtensor.relayout(storage(v).read_value(), entry[2]))
        finalize(mapped(var_list))  # EMA: the averages go into the copies, then the weights
        for v, entry in entries:
            if entry is not None:
                storage(v).assign(dtensor.relayout(entry[0].read_value(), entry[1]))

    optimizer.apply_gradients = apply_gradients
    optimizer.build = build_
    optimizer.finalize_variable_values = finalize_variable_values
    optimizer._dtk_mesh_updates = True  # pylint: disable=protected-access


def sparse_gradients(optimizer: tf_keras.optimizers.Optimizer, state: MeshState) -> None:
    """``distribute(sparse_tables=True)``: Keras's ``train_step`` calls ``optimizer.minimize``;
    its gradients are taken here of the other weights and of each table lookup's output (the
    table's rows, never the table at full size), the compiled optimizer updates the other
    weights, and ``state.sparse`` computes the touched rows' changes (``dtk.train.sparse``),
    which the train function adds in place after the step."""
    compute, apply, build = (optimizer.compute_gradients, optimizer.apply_gradients,
                             optimizer.build)
    tables = state.sparse

    def dense(var_list):
        return [v for v in var_list if not tables.is_table(v)]

    def compute_gradients(loss, var_list, tape=None):
        if tape is None:
            return compute(loss, var_list, tape)
        var_list = dense(var_list() if callable(var_list) else var_list)
        recorded = tables.lookups()
        grads = tape.gradient(loss, [*var_list, *tables.outputs(recorded)])
        state.sparse_pending = (recorded, grads[len(var_list):])
        return list(zip(grads[:len(var_list)], var_list))

    def apply_gradients(grads_and_vars, *args, **kwargs):
        if state.sparse_pending is not None:  # first: lazy Adam reads the step before its increment
            state.sparse_changes = tables.apply(*state.sparse_pending)
            state.sparse_pending = None
        return apply(grads_and_vars, *args, **kwargs)

    def build_(var_list, *args, **kwargs):  # no dense slots for the tables
        return build(dense(list(var_list)), *args, **kwargs)

    optimizer.compute_gradients = compute_gradients
    optimizer.apply_gradients = apply_gradients
    optimizer.build = build_


class ShardedUpdate:
    """The ZeRO-style update of ``dtk.Trainer`` (``StepConfig.shard_optimizer_state``) for
    Keras's own ``train_step``: each weight that ``update_layout`` splits (one of at least
    ``layouts.SHARDED_UPDATE_MIN_ELEMENTS`` elements a device with a dim the batch axis divides)
    gets a float32 copy laid out sharded over the batch axis. The optimizer builds its state
    (Adam's moments, the EMA) on the copy, so that state takes 1/N of the memory per device, and
    each device computes the update of its slice only; the weight is then all-gathered from the
    copy. The same numbers as the update in place (elementwise). Smaller weights are updated in
    place (their all-gathers would cost more than they save)."""

    def __init__(self, mesh: dtensor.Mesh, batch_axis: str):
        self.mesh, self.batch_axis = mesh, batch_axis
        self._entries: dict[int, tuple] = {}  # id(weight) -> (weight, entry or None)
        self._masters: set[int] = set()

    def entry(self, variable: tf.Variable) -> tuple | None:
        """``(copy, the weight's layout, the copy's layout)``, or None: updated in place."""
        if id(variable) in self._masters:
            return None
        known = self._entries.get(id(variable))
        if known is not None and known[0] is variable:
            return known[1]
        stored = storage(variable)
        entry = None
        if not isinstance(stored, fsdp.GatheredVariable):  # FSDP: stored sharded, updated there
            with tf.init_scope():  # made once, eagerly, even when first met in a trace
                layout = dtensor.fetch_layout(stored)
                target = update_layout(stored, self.mesh, self.batch_axis)
                if target.sharding_specs != layout.sharding_specs:
                    master = dtensor.DVariable(
                        dtensor.relayout(stored.read_value(), target), trainable=False,
                        name=getattr(stored, "_shared_name", None))
                    self._masters.add(id(master))
                    entry = (master, layout, target)
        self._entries[id(variable)] = (variable, entry)
        return entry

    def master_of(self, variable: tf.Variable) -> tf.Variable:
        entry = self.entry(variable)
        return variable if entry is None else entry[0]
