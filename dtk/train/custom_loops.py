"""A user's own training loop on a ``dtk.distribute`` model (keras.io's "Writing a training loop
from scratch"): what Keras's ``fit`` does for its own objects, done for the user's.

Inside ``fit`` dtk binds Keras's optimizer and metrics to the mesh (``distribute``). A custom loop
makes its own: ``keras.optimizers.Adam()``, ``keras.metrics.SparseCategoricalAccuracy()``, with no
``mesh=``. DTensor runs such objects without an error and wrong (dtensor-notes, trap 3: a metric
counted every device's copy, 2.66 "accuracy"). So, once a laid-out model exists:

* an optimizer without a mesh is bound to its variables' mesh at its first ``apply_gradients``
  (made again from its config with ``mesh=``, in place: the user's object stays the one that
  trains); one that already has state off the mesh is refused;
* a metric made after ``dtk.distribute`` has its variables moved onto the mesh (replicated,
  their values kept) at its first ``update_state`` with values on it, eagerly or in a
  ``tf.function`` that calls a laid-out model;
* a ``tf.function`` given host tensors where DTensor needs tensors on the mesh raises dtk's
  one-line ``ValueError`` with the fix (``dtk.batches_on_mesh(dataset, model)``), not DTensor's
  ``got a regular tensor ... but was expecting a DTensor``.

The one change a custom loop needs is its batches: ``for x, y in dtk.batches_on_mesh(dataset,
model)`` (sharded over the batch axis; a last partial batch replicated: Keras's numbers).
"""

from __future__ import annotations

import functools
import re
from typing import Any

import tensorflow as tf
import tf_keras  # (partly loaded when dtk._import_hooks installs the metric hook: no names read)
from tensorflow.experimental import dtensor

_installed = False
_HOST_TENSOR = re.compile(r"got a regular tensor for input (\d+) \(shape (\[[^\]]*\])\) but was "
                          r"expecting a DTensor")


def install() -> None:
    """Puts the seams above in place, once per process (``dtk.distribute`` calls it): from now on
    a metric's update looks for a mesh (before, it costs nothing)."""
    global _installed
    if _installed:
        return
    _installed = True
    from tf_keras.src.utils import metrics_utils  # pylint: disable=g-import-not-at-top
    install_metric_hook(metrics_utils)
    _bind_optimizers_at_first_apply()
    _explain_host_tensors_given_to_functions()


def install_metric_hook(metrics_utils: Any) -> None:
    """Makes the metrics made from now on move their variables onto the mesh at their first
    update there; ``import dtk`` calls it as tf_keras loads (``dtk._import_hooks``), so that a
    metric made before ``dtk.distribute`` is covered too."""
    if getattr(metrics_utils, "_dtk_hooked", False):
        return
    metrics_utils._dtk_hooked = True  # pylint: disable=protected-access
    keras_wrapper = metrics_utils.update_state_wrapper

    def update_state_wrapper(update_state_fn):
        keras_decorated = keras_wrapper(update_state_fn)

        @tf.autograph.experimental.do_not_convert  # Python glue, run as written
        def decorated(metric_obj, *args, **kwargs):
            if _installed:  # a laid-out model exists
                mesh = _mesh_in_use(args, kwargs)
                if mesh is not None:
                    bind_metric_in_place(metric_obj, mesh)
            return keras_decorated(metric_obj, *args, **kwargs)

        return tf.__internal__.decorator.make_decorator(update_state_fn, decorated)

    metrics_utils.update_state_wrapper = update_state_wrapper


@tf.autograph.experimental.do_not_convert  # Python glue, run as written
def mark_graph(mesh: dtensor.Mesh, *, constants: bool = True) -> None:
    """Records, on the graph being traced, that a laid-out model runs in it on ``mesh``: a metric
    updated there is moved onto that mesh (the tensors of a trace carry no layout yet);
    ``constants``: the host constants the trace captures are copied onto it too."""
    if not tf.executing_eagerly():
        tf.compat.v1.get_default_graph()._dtk_mesh = mesh  # pylint: disable=protected-access
        if constants:
            from dtk.parallel import ops  # pylint: disable=g-import-not-at-top
            ops.constants_on_mesh(mesh)  # host constants the user's code captures


def graph_mesh() -> dtensor.Mesh | None:
    """The mesh ``mark_graph`` recorded on the graph being traced or on a graph around it."""
    graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        mesh = getattr(graph, "_dtk_mesh", None)
        if mesh is not None:
            return mesh
        graph = getattr(graph, "outer_graph", None)
    return None


def _mesh_of_variables(variables) -> dtensor.Mesh | None:
    from dtk.train.mesh_optimizer import storage  # pylint: disable=g-import-not-at-top
    for variable in variables:
        layout = getattr(storage(variable), "layout", None)
        if isinstance(layout, dtensor.Layout):
            return layout.mesh
    return None


def _on_mesh(variable: tf.Variable) -> bool:
    from dtk.train.mesh_optimizer import storage  # pylint: disable=g-import-not-at-top
    with tf.init_scope():
        try:
            return bool(dtensor.is_dtensor(storage(variable).handle))
        except (ValueError, TypeError, AttributeError):
            return False


def _bind_optimizers_at_first_apply() -> None:
    optimizer_cls = tf_keras.optimizers.Optimizer
    keras_apply = optimizer_cls.apply_gradients

    @functools.wraps(keras_apply)
    @tf.autograph.experimental.do_not_convert  # Python glue, run as written
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        if getattr(self, "_mesh", None) is None and not getattr(self, "_run_with_dtensor", False):
            grads_and_vars = list(grads_and_vars)
            mesh = _mesh_of_variables(v for _, v in grads_and_vars)
            if mesh is not None:
                bind_optimizer_in_place(self, mesh)
                return self.apply_gradients(grads_and_vars, *args, **kwargs)
        return keras_apply(self, grads_and_vars, *args, **kwargs)

    optimizer_cls.apply_gradients = apply_gradients


@tf.autograph.experimental.do_not_convert  # Python glue, run as written
def bind_optimizer_in_place(optimizer: tf_keras.optimizers.Optimizer,
                            mesh: dtensor.Mesh) -> None:
    """``optimizer`` made again from its config with ``mesh=``, in place (its state is made on
    the mesh when it builds), with dtk's mesh updates (``mesh_optimizer.mesh_updates``).

    Raises:
      ValueError: it has state already (built or stepped off the mesh), named, with the fix.
    """
    from dtk.train import mesh_optimizer  # pylint: disable=g-import-not-at-top
    with tf.init_scope():
        steps = int(optimizer.iterations.numpy())
        if steps or getattr(optimizer, "_built", False) or getattr(optimizer, "built", False):
            raise ValueError(
                f"optimizer {optimizer.name!r} ({type(optimizer).__name__}) updates weights "
                "laid out on a DTensor mesh but was made without mesh= and has already "
                f"{'taken ' + str(steps) + ' step(s)' if steps else 'built its state'} off the "
                "mesh, so its state cannot move; make a new one (dtk binds an unused optimizer "
                "to the mesh at its first apply_gradients), or pass mesh= when you make it")
        bound = mesh_optimizer.bound_copy(optimizer, mesh)
    vars(optimizer).clear()
    vars(optimizer).update(vars(bound))
    mesh_optimizer.prepare_bound_optimizer(optimizer)


def _mesh_in_use(args, kwargs) -> dtensor.Mesh | None:
    """The mesh of a metric update's values: a DTensor's eagerly; in a trace, the mesh of a
    laid-out model called in it or in a graph around it (``mark_graph``)."""
    if tf.executing_eagerly():
        for t in tf.nest.flatten((args, kwargs)):
            if isinstance(t, tf.Tensor) and dtensor.is_dtensor(t):
                return dtensor.fetch_layout(t).mesh
        return None
    return graph_mesh()


@tf.autograph.experimental.do_not_convert  # Python glue, run as written
def bind_metric_in_place(metric: tf_keras.metrics.Metric, mesh: dtensor.Mesh) -> None:
    """Moves the variables of ``metric`` (and the metrics inside it) that are off the mesh onto
    it, replicated, with their values: the metric then counts each example once."""
    moved: dict[int, tf.Variable] = {}
    for layer in metric._flatten_layers():  # pylint: disable=protected-access
        for attr, value in list(vars(layer).items()):
            if isinstance(value, tf.Variable):
                new = _moved(value, mesh, moved)
                if new is not value:
                    object.__setattr__(layer, attr, new)
            elif isinstance(value, list) and attr in ("_trainable_weights",
                                                      "_non_trainable_weights"):
                value[:] = [_moved(v, mesh, moved) if isinstance(v, tf.Variable) else v
                            for v in value]


def _moved(variable: tf.Variable, mesh: dtensor.Mesh, moved: dict) -> tf.Variable:
    if id(variable) in moved:
        return moved[id(variable)]
    if _on_mesh(variable):
        return variable
    with tf.init_scope():
        value = variable.read_value()
        new = dtensor.DVariable(
            dtensor.copy_to_mesh(value, dtensor.Layout.replicated(mesh, value.shape.rank)),
            trainable=variable.trainable, name=variable.name.split(":")[0],
            aggregation=variable.aggregation, synchronization=variable.synchronization)
    moved[id(variable)] = new
    return new


def _explain_host_tensors_given_to_functions() -> None:
    from tensorflow.python.eager.polymorphic_function import polymorphic_function  # pylint: disable=g-import-not-at-top
    function_cls = polymorphic_function.Function
    call = function_cls.__call__

    @functools.wraps(call)
    def __call__(self, *args, **kwargs):  # pylint: disable=invalid-name
        try:
            return call(self, *args, **kwargs)
        except (tf.errors.UnimplementedError, tf.errors.InvalidArgumentError) as e:
            found = _HOST_TENSOR.search(str(e.message))
            if found is None or not str(e.message).lstrip().startswith(
                    "The op/function __inference"):
                raise
            raise ValueError(
                f"tf.function {getattr(self, '__name__', '?')!r} was given a host tensor "
                f"(input {found.group(1)}, shape {found.group(2)}) while it runs on a DTensor "
                "mesh (it uses a laid-out model's weights or other values on the mesh): give it "
                "batches laid out on the mesh: iterate dtk.batches_on_mesh(dataset, model) in "
                "the loop (or dtk.pack(mesh, batch) for one batch); a laid-out model called "
                "eagerly, outside a tf.function, takes host values") from None

    function_cls.__call__ = __call__
