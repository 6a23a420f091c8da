"""Keras's own ``fit`` on the mesh: ``dtk.distribute`` lays a model out and lets tf_keras train it.

dtk's ``Trainer`` re-implements Keras's ``compile()``/``fit()`` contract; every keras.io page found
the next piece it lacked (callbacks, class and sample weights, masks, ``add_loss``, custom
``compile()``, EMA). Here Keras's own loop and Keras's own ``train_step``/``test_step``/
``predict_step`` run, and dtk does only what Keras cannot do on a mesh:

* lay the model out (``dtk.parallel.layouts.build_model``: the plain build's initial weights);
* bind to the mesh whatever the user compiled: every optimizer the model holds after its
  ``compile()`` (``model.optimizer``, a GAN's two), made again with ``mesh=`` (an optimizer
  without it computes wrong updates under DTensor, dtensor-notes trap 3), and the metrics
  Keras creates (their variables are made on the mesh, replicated);
* pack each batch Keras hands out: sharded over the batch axis when the axis divides it, else
  (a last partial batch) replicated, so that every batch trains with Keras's own numbers;
* compile the step: ``make_train_function``/``make_test_function``/``make_predict_function``
  return a ``tf.function`` of the model's own step around that packing, with dtk's randomness
  (the same draws on every mesh, ``tf.random.*`` in a ``train_step`` included) keyed by the
  optimizer's step, FSDP weights read gathered, and the ops DTensor cannot lay out that user code
  calls (``tf.image.extract_patches``, Keras's ``ctc_batch_cost``) run as dtk's equivalents;
* let the laid-out model be called eagerly on host values (a callback's ``self.model(x)``);
* checkpoint as dtk does, as a callback (``CheckpointCallback``).

Everything else is Keras's by construction: callbacks and ``stop_training``, ``class_weight`` and
``sample_weight`` (normalized as Keras does), masks in the loss, ``add_loss``, EMA applied at the
end of ``fit``, a ``train_step``'s own logs, ``validation_split``, ``initial_epoch``.

Example::

    mesh = dtk.build_mesh("batch=8")
    model = dtk.distribute(make_model, mesh, seed=0)       # the one line a keras.io page adds
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    model.fit(x, y, batch_size=64, epochs=3, validation_split=0.2,
              callbacks=[tf_keras.callbacks.EarlyStopping(patience=2)])
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import types
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor

from dtk.keras_check import Keras3Model, require_keras2
from dtk.parallel import fsdp, layouts, ops, randomness
from dtk.parallel import remat as dtk_remat
from dtk.parallel.mesh import BATCH_AXIS, as_mesh, check_batch_axis
from dtk.data.input import DistributedDataset
from dtk.train import custom_loops, host_inputs, input_checks, keras_data, mesh_optimizer
from dtk.train.callbacks import CheckpointCallback
from dtk.train.mesh_calls import MeshCalls, MeshState, convert_user_step, next_batches
from dtk.train.optimizers import make_metric

_log = logging.getLogger("dtk")


def distribute(model_factory: Callable[[], tf_keras.Model], mesh: dtensor.Mesh, *,
               layout: layouts.LayoutTable | str = "data_parallel", seed: int = 0,
               input_shape: Sequence[int] | None = None, input_dtype: str = "float32",
               strict: bool = False, allow_replicated: bool = False, fsdp: bool = False,
               remat: Sequence[str] = (), gradient_accumulation_steps: int = 1,
               shard_optimizer_state: bool | str = "auto",
               batch_axis: str = BATCH_AXIS, sparse_tables: bool = False) -> tf_keras.Model:
    """``model_factory()`` laid out on ``mesh``, trained by tf_keras's own ``fit``.

    Args:
      model_factory: returns a new tf_keras model (Sequential, Functional or subclassed). If it
        compiles the model, the laid-out model is compiled with the same settings, bound to the
        mesh.
      mesh: the mesh (``dtk.build_mesh``).
      layout: a layout table (name, path or ``LayoutTable``) giving every weight its layout.
      seed: ``tf_keras.utils.set_random_seed(seed)`` before the build: the initial weights equal
        the plain build's with this seed, and dtk's random layers draw from it.
      input_shape, input_dtype: one example's shape for a subclassed model (built by a call).
      strict, allow_replicated: as for ``dtk.build_model``.
      fsdp: store each weight cut over the batch axis and gather it for its layer's call
        (``dtk.parallel.fsdp``; as ``TrainerConfig(fsdp=True)``): weights, gradients and
        optimizer state take 1/N of the memory per device.
      remat: layer-name patterns (regular expressions) whose activations are recomputed in the
        backward pass (``dtk.parallel.remat``; as ``TrainerConfig(remat=...)``): the same
        numbers, less activation memory, about one more forward pass of compute.
      gradient_accumulation_steps: each batch Keras hands out trains as this many microbatches,
        one forward and backward pass live at a time, their gradients summed before one update
        (Keras's own ``train_step``; a model with its own accumulates in it): the whole batch's
        numbers, the activation memory of a microbatch. Each device's share of the batch must
        split evenly.
      shard_optimizer_state: the ZeRO-style update, as ``TrainerConfig(shard_optimizer_state=)``:
        every optimizer's state and update of each large weight are sharded over the batch
        axis, then the weight is all-gathered (the same numbers; that state's memory per device
        divided by the axis size). ``"auto"`` (the default) turns it on when it shards
        something (``dtk.train.mesh_optimizer.auto_shard_optimizer_state``), off under ``fsdp`` (the
        weights are stored sharded already).
      batch_axis: the mesh axis the batch is split over.
      sparse_tables: update only the rows a step touched of the Embedding tables the layout
        shards on their rows or columns (``dtk.train.sparse``; as ``TrainerConfig(
        sparse_tables=True)``): SGD and Adagrad with the dense update's numbers, Adam as lazy
        Adam; other optimizers are refused at ``compile()``. The compiled optimizer updates the
        other weights; each step's touched rows are added in place after it (one compiled call
        per step).

    Returns:
      The laid-out model. ``compile()``, ``fit()``, ``evaluate()``, ``predict()``,
      ``train_on_batch()``, ``test_on_batch()``, ``save_weights()`` and ``summary()`` are
      tf_keras's own and take all their arguments.

    A factory that returns a Keras 3 model (``keras``) gets Keras 3's own distribution API
    instead (``dtk.enable_keras_distribution``): a ``ModelParallel`` on ``mesh`` whose
    ``LayoutMap`` is the table (``dtk.layout_map``), kept on the model, so that its ``fit``,
    ``evaluate``, ``predict`` and calls run on the mesh without a global distribution; the
    options of the tf_keras path (``fsdp``, ``remat``, ``gradient_accumulation_steps``,
    ``strict``) are refused there.

    Raises:
      TypeError: a factory that returns no Keras model.
      ValueError: a bad layout plan, or a mesh without ``batch_axis``.
    """
    mesh = as_mesh(mesh, "mesh")
    check_batch_axis(mesh, batch_axis)
    if isinstance(gradient_accumulation_steps, bool) or not isinstance(
            gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be a positive integer; got "
                         f"{gradient_accumulation_steps!r}")
    if shard_optimizer_state not in (True, False, "auto"):
        raise ValueError(f"shard_optimizer_state must be True, False or 'auto'; got "
                         f"{shard_optimizer_state!r}")
    if shard_optimizer_state is True and fsdp:
        raise ValueError("shard_optimizer_state=True with fsdp=True: FSDP stores the weights and "
                         "their optimizer state sharded over the batch axis already, so there is "
                         "no replicated update to shard; drop one (shard_optimizer_state='auto' "
                         "is off under fsdp)")
    if isinstance(remat, str):
        raise ValueError(f"remat must be a list of layer-name patterns, e.g. [{remat!r}]; got the "
                         f"string {remat!r} (a string would be read letter by letter)")
    host = None
    try:
        try:
            model, _ = layouts.build_model(model_factory, mesh, layout, seed=seed, strict=strict,
                                           allow_replicated=allow_replicated,
                                           input_shape=input_shape, input_dtype=input_dtype,
                                           fsdp=fsdp, host_inputs=True)
        except layouts.HostInputsFirst:  # string preprocessing first: on the host
            host, device_factory, compiled = host_inputs.split(model_factory, seed)
            model, _ = layouts.build_model(device_factory, mesh, layout, seed=seed,
                                           strict=strict, allow_replicated=allow_replicated,
                                           fsdp=fsdp)
            object.__setattr__(model, "_dtk_compiled", compiled)
    except Keras3Model:  # a Keras 3 factory: Keras 3's own distribution, by dtk's seams
        from dtk.train import keras3  # pylint: disable=g-import-not-at-top
        for name, value, default in (("fsdp", fsdp, False), ("remat", tuple(remat), ()),
                                     ("gradient_accumulation_steps",
                                      gradient_accumulation_steps, 1),
                                     ("strict", strict, False)):
            if value != default:
                raise ValueError(
                    f"dtk.distribute({name}={value!r}) with a Keras 3 model: {name} is an "
                    "option of dtk's tf_keras path. On Keras 3, lay the weights out with the "
                    "table (FSDP: a table whose rules shard weights over the batch axis) and "
                    "use Keras's own options (compile(steps_per_execution=...), the "
                    f"optimizer's gradient_accumulation_steps=); drop {name}") from None
        return keras3.distribute_model(model_factory, mesh, layout=layout, seed=seed,
                                       input_shape=input_shape, batch_axis=batch_axis,
                                       allow_replicated=allow_replicated,
                                       shard_optimizer_state=shard_optimizer_state)
    prepare(model, mesh, seed=seed, remat=remat, fsdp=fsdp,
            gradient_accumulation_steps=gradient_accumulation_steps,
            shard_optimizer_state=shard_optimizer_state, batch_axis=batch_axis,
            sparse_tables=sparse_tables)
    if host is not None:
        model._dtk_mesh_state.host = host  # pylint: disable=protected-access
    _save_through_a_plain_twin(model, model_factory, input_shape)
    compiled = getattr(model, "_dtk_compiled", None) or {}
    for attr, (cls, config) in (compiled.get("attributes") or {}).items():
        setattr(model, attr, cls.from_config(dict(config)))  # bound by the compile below
    if compiled.get("optimizer") is not None:  # the factory compiled it: the same, on the mesh
        cls, config = compiled["optimizer"]
        # Through tf_keras.Model.compile: a model with its own compile() signature (keras.io's
        # Distiller) keeps the attributes its compile() set in the factory (losses, alpha).
        model.compile(optimizer=cls.from_config(dict(config)), loss=compiled["loss"],
                      metrics=compiled["metrics"], loss_weights=compiled["loss_weights"],
                      _dtk_keras_compile=True)
    return model


def prepare(model: tf_keras.Model, mesh: dtensor.Mesh, *, seed: int = 0,
            remat: Sequence[str] = (), fsdp: bool = False, gradient_accumulation_steps: int = 1,
            shard_optimizer_state: bool | str = "auto", batch_axis: str = BATCH_AXIS,
            sparse_tables: bool = False) -> tf_keras.Model:
    """Gives a laid-out model ``distribute``'s options (remat, the sharded update, sparse
    tables, gradient accumulation) and its seams (``on_mesh``); ``distribute`` and
    ``dtk.Trainer`` (which builds the model itself, to keep its layout plan) call it."""
    remat_layers = dtk_remat.apply(model, remat) if remat else []
    if remat_layers:
        _log.info("remat: %s recompute their activations in the backward pass",
                  ", ".join(remat_layers))
    on_mesh(model, mesh, batch_axis=batch_axis, seed=seed)
    model._dtk_mesh_state.remat_layers = remat_layers  # pylint: disable=protected-access
    if shard_optimizer_state == "auto":
        shard_optimizer_state = not fsdp and mesh_optimizer.auto_shard_optimizer_state(
            model.trainable_variables, mesh, batch_axis)
    if shard_optimizer_state:
        model._dtk_mesh_state.sharded = mesh_optimizer.ShardedUpdate(mesh, batch_axis)  # pylint: disable=protected-access
    if not isinstance(sparse_tables, bool):
        raise ValueError(f"sparse_tables must be True or False; got {sparse_tables!r}")
    model._dtk_mesh_state.sparse_mode = sparse_tables  # pylint: disable=protected-access
    if gradient_accumulation_steps > 1:
        if type(model).train_step is not tf_keras.Model.train_step:
            raise ValueError(
                f"gradient_accumulation_steps={gradient_accumulation_steps}: model "
                f"{type(model).__name__} has its own train_step, which dtk cannot split into "
                "microbatches; accumulate in it, or drop gradient_accumulation_steps")
        model._dtk_mesh_state.accumulation = gradient_accumulation_steps  # pylint: disable=protected-access
    return model


def check_own_train_step(model: tf_keras.Model, *, gradient_accumulation_steps: int) -> bool:
    """Refuses what would change a model's own ``train_step`` (it applies its gradients itself):
    gradient accumulation and FSDP weights. Returns whether the model has FSDP weights.

    Raises:
      ValueError: naming the model, what it asked for and the fix.
    """
    built_fsdp = any(isinstance(getattr(v, "_variable", v), fsdp.GatheredVariable)
                     for v in model.trainable_variables)
    refused = [what for what, on in (
        ("gradient_accumulation_steps > 1", gradient_accumulation_steps > 1),
        ("FSDP", built_fsdp)) if on]
    if _overrides(model, "train_step") and refused:
        raise ValueError(
            f"model {type(model).__name__} overrides train_step, which dtk runs as written (its "
            f"own gradients and update); {' and '.join(refused)} would change that step. Drop "
            "them for this model (no accumulation, no FSDP), or move the custom logic into "
            "call()/add_loss() and use Keras's step")
    return built_fsdp


def _save_through_a_plain_twin(model: tf_keras.Model, model_factory: Callable,
                               input_shape: Sequence[int] | None) -> None:
    """``model.save(path)`` on a model with sharded weights writes a plain twin
    (``dtk.train.checkpoint.plain_copy``: the factory's model with the trained weights; Keras's
    own save cannot copy a sharded DTensor to the host). The twin carries no optimizer state:
    resume from ``BackupAndRestore``, ``ModelCheckpoint(save_weights_only=True)`` or dtk's
    checkpoints, which keep it. A model whose weights are all replicated saves as Keras does."""
    keras_save = model.save

    def save(filepath, *args, **kwargs):
        from dtk.train import checkpoint  # pylint: disable=g-import-not-at-top
        if all(dtensor.fetch_layout(v).is_fully_replicated() for v in model.weights):
            return keras_save(filepath, *args, **kwargs)
        kwargs.pop("include_optimizer", None)
        twin = checkpoint.plain_copy(model, model_factory, input_shape=input_shape)
        return twin.save(filepath, *args, **kwargs)  # never compiled: no optimizer state

    model.save = save


def on_mesh(model: tf_keras.Model, mesh: dtensor.Mesh, *, batch_axis: str = BATCH_AXIS,
            seed: int = 0) -> tf_keras.Model:
    """Makes a laid-out model's ``compile``, ``fit``, ``evaluate`` and ``predict`` run on ``mesh``
    (see the module docstring); ``distribute`` calls it. Returns ``model``."""
    require_keras2(model, "model")
    custom_loops.install()
    keras_data.install()
    from dtk.train import checkpoint  # pylint: disable=g-import-not-at-top
    checkpoint.read_sharded_variables_whole()  # get_weights, save_weights(.h5), v.numpy()
    state = MeshState(mesh, batch_axis)
    state.generator = randomness.step_generator(model, seed=seed)
    state.seed = seed
    object.__setattr__(model, "_dtk_mesh_state", state)
    cls_compile = type(model).compile

    def compile(self, *args, _dtk_keras_compile=False, **kwargs):  # pylint: disable=redefined-builtin
        base = tf_keras.Model.compile if _dtk_keras_compile else cls_compile
        if kwargs.get("run_eagerly"):
            raise ValueError(
                "compile(run_eagerly=True): a laid-out model's steps run as compiled functions on "
                "the mesh (DTensor lays out traced functions); drop run_eagerly, or debug the "
                "model eagerly on one device without dtk.distribute")
        if kwargs.get("jit_compile"):
            raise ValueError(
                "compile(jit_compile=True): a laid-out model's step is compiled by DTensor's SPMD "
                "expansion, which dtk does not combine with XLA; drop jit_compile (the step is "
                "still one compiled function per call)")
        loss = kwargs.get("loss", args[1] if len(args) > 1 else None)
        for key, index in (("optimizer", 0), ("loss", 1), ("metrics", 2)):
            for value in tf.nest.flatten(kwargs.get(key, args[index] if len(args) > index
                                                    else None)):
                require_keras2(value, f"compile({key}=...) {type(value).__name__}")
        if base is tf_keras.Model.compile:  # a name Keras cannot resolve: now, not at step 1
            for name in tf.nest.flatten(loss):
                if isinstance(name, str):
                    tf_keras.losses.get(name)
        args = list(args)
        # "auto" steps per call: dtk's calibration (dtk.train.auto_steps), whose choice every
        # client shares, in place of Keras's tuner (it times each client alone).
        position = 6 if base is tf_keras.Model.compile else None  # compile()'s position
        given = kwargs.get("steps_per_execution",
                           args[position] if position is not None and len(args) > position
                           else None)
        state.auto_steps = isinstance(given, str) and given == "auto"
        if state.auto_steps:
            if "steps_per_execution" in kwargs:
                kwargs["steps_per_execution"] = 1
            else:
                args[position] = 1
        for index, key in ((2, "metrics"), (5, "weighted_metrics")):  # compile()'s positions
            if key in kwargs:
                kwargs[key] = _bind_metric_objects(kwargs[key], mesh)
            elif len(args) > index and base is tf_keras.Model.compile:
                args[index] = _bind_metric_objects(args[index], mesh)
        with dtensor.default_mesh(mesh):  # metrics and optimizer state made here live on it
            base(self, *args, **kwargs)
            mesh_optimizer.bind_optimizers(self, mesh, state.sharded)
        if getattr(self, "_steps_per_execution", None) is not None:
            # Keras's loop reads it before every step: a variable on the mesh (the model's
            # layout map makes it one) waits there for the step before; on the host it does not,
            # and the next batch is packed while the step runs.
            # (Not tracked: it is no weight of the model, as Keras's own is not.)
            object.__setattr__(self, "_steps_per_execution", tf.Variable(
                int(self._steps_per_execution.numpy()), dtype=tf.int64, trainable=False))
            tuner = getattr(self, "_steps_per_execution_tuner", None)  # steps_per_execution="auto"
            if tuner is not None:
                tuner._steps_per_execution = self._steps_per_execution  # pylint: disable=protected-access
        from dtk.train import sparse  # pylint: disable=g-import-not-at-top
        # The tables' own update, beside the compiled optimizer's (sparse_tables=True), or the
        # dense update's cost, said for each table sharded on its rows.
        state.sparse, why_dense = sparse.choose(
            self, self.optimizer, state.sparse_mode, batch_axis=state.batch_axis,
            accumulation=state.accumulation, custom_step=_overrides(self, "train_step"))
        if state.sparse is not None:
            mesh_optimizer.sparse_gradients(self.optimizer, state)
        for layer in sparse.tables_of(self) if state.sparse is None else ():
            ops.warn_dense_table_update(layer, why_dense)
        self.train_function = self.test_function = self.predict_function = None

    model.compile = types.MethodType(compile, model)
    for name, position in (("fit", 2), ("evaluate", 2), ("predict", 1)):
        model_method = getattr(type(model), name)

        def checked(self, *args, _method=model_method, _name=name, _position=position,
                    **kwargs):
            size = kwargs.get("batch_size", args[_position] if len(args) > _position else None)
            y = kwargs.get("y", args[1] if len(args) > 1 else None)
            state.check_call(_name, size, kwargs.get("callbacks"), y=y,
                             class_weight=kwargs.get("class_weight"),
                             validation_split=kwargs.get("validation_split"))
            _check_data(self, _name, kwargs.get("x", args[0] if args else None), y)
            weights_at = {"fit": 10, "evaluate": 4}.get(_name)  # sample_weight's position
            sample_weight = kwargs.get("sample_weight", args[weights_at] if weights_at is not None
                                       and len(args) > weights_at else None)
            _check_call(self, _name, kwargs.get("x", args[0] if args else None), y,
                        sample_weight)
            if isinstance(kwargs.get("x", args[0] if args else None), DistributedDataset):
                for arg, value in (("batch_size", size), ("sample_weight", sample_weight),
                                   ("class_weight", kwargs.get("class_weight"))):
                    if value is not None:  # Keras would ignore it, or fail inside its loop
                        raise ValueError(
                            f"{_name}({arg}=...) with a dtk.DistributedDataset: the dataset "
                            "batches itself (InputConfig(global_batch_size=...)) and carries "
                            "its own sample weights (elements (features, labels, "
                            f"sample_weights)); drop {arg}, or give them in the dataset")
            if _name == "fit":
                validation = kwargs.get("validation_data", args[7] if len(args) > 7 else None)
                if isinstance(validation, (tf.data.Dataset, DistributedDataset)):
                    _check_data(self, "fit(validation_data=...)", validation, None)
            if _name == "fit" and state.auto_steps:  # compile(steps_per_execution="auto")
                from dtk.train.auto_steps import AutoStepsCallback  # pylint: disable=g-import-not-at-top
                if len(args) > 5:
                    args = (*args[:5], [AutoStepsCallback(state.mesh), *(args[5] or [])],
                            *args[6:])
                else:
                    kwargs["callbacks"] = [AutoStepsCallback(state.mesh),
                                           *(kwargs.get("callbacks") or [])]
            given = kwargs.get("callbacks", args[5] if len(args) > 5 and _name == "fit" else None)
            if _name == "fit":  # a DistributedDataset's training adapter claims it
                x = kwargs.get("x", args[0] if args else None)
                state.fit_data = x if isinstance(x, DistributedDataset) else None
                state.fit_call = {"x": x, "batch_size": size}  # CheckpointCallback's settings
                state.start_epoch = int(kwargs.get("initial_epoch",
                                                   args[9] if len(args) > 9 else 0) or 0)
            keyed = _name == "fit" and _shuffles_arrays(args, kwargs) and any(
                isinstance(c, CheckpointCallback) for c in tf.nest.flatten(given or []))
            try:
                with _shuffles_resumable(state) if keyed else contextlib.nullcontext():
                    return _method(self, *args, **kwargs)
            except tf.errors.InvalidArgumentError as e:  # raised where the step is read back
                message = ops.explain_failure(e) or _explain_class_weight(
                    e, kwargs.get("class_weight"))
                if message is None:
                    raise
                # The failed step poisoned the eager executor ("This error cancels all future
                # operations"): cleared, so that the process can go on (the next model's ops).
                tf.experimental.async_clear_error()
                raise ValueError(message) from None
            finally:
                if _name == "fit":
                    state.end_fit()

        setattr(model, name, types.MethodType(checked, model))
    _eager_calls_on_mesh(model, mesh)
    _metrics_on_batch_sharded_labels(model, state)
    model.make_train_function = types.MethodType(_maker("train_step", "train_function"), model)
    model.make_test_function = types.MethodType(_maker("test_step", "test_function"), model)
    model.make_predict_function = types.MethodType(
        _maker("predict_step", "predict_function"), model)
    return model


def _check_data(model: tf_keras.Model, method: str, x: Any, y: Any) -> None:
    """What would fail inside a traced step, refused before Keras starts, in one line: dtk's
    ``DistributedDataset`` (Keras's fit takes the ``tf.data`` dataset itself), an unbatched
    ``tf.data`` dataset, integer labels outside a sparse loss's classes.

    Raises:
      ValueError: naming the argument, its value or shape, and the fix.
    """
    where = method if "(" in method else f"{method}(x=...)"
    if isinstance(x, DistributedDataset):
        _check_distributed_dataset(model, where, x, y)
        return
    inputs = getattr(model, "inputs", None) or []
    if isinstance(x, tf.data.Dataset) and inputs:
        spec = x.element_spec
        first = tf.nest.flatten(spec[0] if isinstance(spec, tuple) else spec)[0]
        want = inputs[0].shape.rank
        if getattr(first, "shape", None) is not None and first.shape.rank is not None and \
                want is not None and first.shape.rank == want - 1:
            raise ValueError(
                f"{where}: the tf.data dataset is not batched: its elements are single examples "
                f"of shape {tuple(first.shape)}, where model {model.name!r} takes batches of "
                f"{tuple(inputs[0].shape)}; call dataset.batch(batch_size) first")
    if getattr(getattr(model, "_dtk_mesh_state", None), "host", None) is None and \
            not _overrides(model, "train_step"):
        if isinstance(x, tf.data.Dataset):
            spec = x.element_spec
            x_example = _example(spec[0] if isinstance(spec, tuple) else spec)
            y_example = _example(spec[1]) if isinstance(spec, tuple) and len(spec) > 1 else None
        else:
            x_example, y_example = _example(x), _example(y)
        if x_example is not None and not isinstance(x, (list, tuple)):
            input_checks.check_features(model, x_example, where)
        if y_example is not None and method != "predict":
            input_checks.check_targets(model, getattr(model, "loss", None), y_example,
                                       where.replace("(x=", "(y="))
    classes = _implied_classes(model)
    if classes is not None and isinstance(y, np.ndarray) and y.size and y.dtype.kind in "iu":
        outputs = model.outputs
        low, high = int(y.min()), int(y.max())
        if low < 0 or high >= classes:
            bad = high if high >= classes else low
            raise ValueError(
                f"{method}(y=...): label {bad} is outside the {classes} classes of model "
                f"{model.name!r}'s output (shape {tuple(outputs[0].shape)}), which the sparse "
                f"loss needs in [0, {classes}); fix the labels, or give the last layer "
                f"{high + 1} units")


def _check_distributed_dataset(model: tf_keras.Model, where: str, data: Any, y: Any) -> None:
    """A ``DistributedDataset`` given to Keras (``dtk.train.keras_data``): packed on this model's
    mesh and batch axis, with its labels and weights inside, and examples the model takes."""
    state = model._dtk_mesh_state  # pylint: disable=protected-access
    if y is not None:
        raise ValueError(f"{where.split('(')[0]}(y=...): a dtk.DistributedDataset holds its labels "
                         "(its elements are (features, labels[, sample_weights])); drop y")
    if data.mesh != state.mesh or data.config.batch_axis != state.batch_axis:
        def axes(mesh):
            return ",".join(f"{n}={mesh.dim_size(n)}" for n in mesh.dim_names)
        raise ValueError(
            f"{where}: the dtk.DistributedDataset packs onto mesh {axes(data.mesh)} (batch axis "
            f"{data.config.batch_axis!r}), but model {model.name!r} is laid out on "
            f"{axes(state.mesh)} (batch axis {state.batch_axis!r}); build the dataset with the "
            "model's mesh and InputConfig(batch_axis=...)")
    if getattr(model, "_steps_per_execution", None) is not None and \
            data.config.steps_per_call != 1:
        raise ValueError(
            f"{where}: InputConfig(steps_per_call={data.config.steps_per_call}) stacks batches "
            "for dtk.Trainer; Keras's fit stacks them itself: build the dataset with "
            "steps_per_call=1 and pass compile(steps_per_execution=...)")
    if state.host is None and not _overrides(model, "train_step"):
        spec = data.example_spec  # one example's (unbatched)
        input_checks.check_features(model, spec[0], where)
        if "predict" not in where:
            input_checks.check_targets(model, getattr(model, "loss", None), spec[1], where)
    if data.implied_classes is None and data.config.num_classes is None:
        data.implied_classes = _implied_classes(model)


def _implied_classes(model: tf_keras.Model) -> int | None:
    """The class count a sparse loss implies (one output's last dim): integer labels are
    checked against it on the host, before a step (a label out of range inside a DTensor step
    fails its collectives)."""
    loss = getattr(model, "loss", None)
    sparse = loss in ("sparse_categorical_crossentropy",) or isinstance(
        loss, tf_keras.losses.SparseCategoricalCrossentropy)
    outputs = getattr(model, "outputs", None) or []
    if sparse and len(outputs) == 1 and outputs[0].shape[-1] is not None:
        return int(outputs[0].shape[-1])
    return None


def _overrides(model: tf_keras.Model, method: str) -> bool:
    """Whether the model's class replaces Keras's ``method`` (its data may be anything)."""
    return getattr(type(model), method) is not getattr(tf_keras.Model, method)


def _example(value: Any) -> Any:
    """One example's spec of each array, tensor or spec of a batch (its dims after the first);
    None for what has none (a generator, None)."""
    def one(leaf):
        shape = getattr(leaf, "shape", None)
        if shape is None or not isinstance(leaf, (np.ndarray, tf.Tensor, tf.TensorSpec)):
            raise TypeError
        shape = tf.TensorShape(shape)
        return tf.TensorSpec(shape[1:]) if shape.rank else None
    try:
        return tf.nest.map_structure(one, value) if value is not None else None
    except TypeError:
        return None


def _check_call(model: tf_keras.Model, method: str, x: Any, y: Any, sample_weight: Any) -> None:
    """Mistakes plain tf_keras also refuses, but from inside dtk's traced step (several lines,
    naming dtk's frames): refused first, in one line naming the argument.

    Raises:
      ValueError: no compile() before fit/evaluate; x, y and sample_weight of different
        lengths; a sample_weight of more dims than y's; dict inputs without the model's names.
    """
    if method != "predict" and not getattr(model, "_is_compiled", True):
        raise ValueError(
            f"{method}: model {model.name!r} is not compiled; call model.compile(optimizer=..., "
            "loss=...) on the model dtk.distribute returned (or in the factory) first")
    lengths = {name: input_checks.example_count(value) for name, value in (("x", x), ("y", y),
                                                          ("sample_weight", sample_weight))
               if value is not None and not isinstance(value, tf.data.Dataset)}
    lengths = {name: n for name, n in lengths.items() if n is not None}
    if len(set(lengths.values())) > 1:
        raise ValueError(
            f"{method}: " + ", ".join(f"{name} has {n} examples" for name, n in lengths.items())
            + "; give every array the same number of examples (one row per example)")
    if isinstance(sample_weight, np.ndarray) and y is not None and not isinstance(
            y, (dict, list, tuple, tf.data.Dataset)) and sample_weight.ndim > max(1, np.ndim(y)):
        raise ValueError(
            f"{method}(sample_weight=...): shape {sample_weight.shape} has more dims than y "
            f"{tuple(np.shape(y))}; give one weight per example (shape ({np.shape(y)[0]},)) or "
            "per label (y's shape)")
    names = list(getattr(model, "input_names", None) or [])
    if isinstance(x, dict) and len(names) > 1 and set(x) != set(names):
        raise ValueError(
            f"{method}(x=...): the dict's keys {sorted(x)} are not model {model.name!r}'s "
            f"input names {sorted(names)}; key each input by its Input's name (missing: "
            f"{sorted(set(names) - set(x))}, unknown: {sorted(set(x) - set(names))})")


def _explain_class_weight(error: Exception, class_weight: Any) -> str | None:
    """tf_keras's class_weight lookup of a label it has no weight for, in a tf.data input's map
    ("indices[2] = 9 is not in [0, 9)"): the label and the classes named."""
    found = re.search(r"indices\[[\d,]+\] = (-?\d+) is not in \[0, (\d+)\)",
                      str(getattr(error, "message", error)))
    if not class_weight or found is None:
        return None
    return (f"fit(class_weight=...): a label is {found.group(1)}, but class_weight has weights "
            f"for classes {sorted(class_weight)} only; give every class a weight (keys 0 to "
            "the number of classes - 1)")


def _shuffles_arrays(args: tuple, kwargs: dict) -> bool:
    """Whether a ``fit`` call has Keras shuffle arrays each epoch (``shuffle=True``, its
    default, on arrays or tensors; a ``tf.data`` dataset or a generator orders itself)."""
    x = kwargs.get("x", args[0] if args else None)
    shuffle = kwargs.get("shuffle", args[8] if len(args) > 8 else True)
    return shuffle is True and isinstance(x, (np.ndarray, tf.Tensor, dict, list, tuple))


@contextlib.contextmanager
def _shuffles_resumable(state: MeshState):
    """Keras's per-epoch shuffle of arrays, resumable: Keras draws epoch ``e``'s order as the
    ``e``-th draw of one stateful shuffle op, whose stream a new process starts again, so a
    resumed run would see other orders than the uninterrupted one. Here the same op (the seeds
    Keras's would get, drawn the same way: plain Keras's orders in a run from the start) draws
    ``1 + skip`` times for the first epoch and keeps the last, where ``CheckpointCallback`` sets
    ``skip`` to the epoch it resumes at: the resumed epochs get the uninterrupted run's orders.
    (The process's seed must be the same, as it is for ``dtk.distribute(seed=...)`` runs of one
    script.)"""
    from tensorflow.python.framework import random_seed  # pylint: disable=g-import-not-at-top
    from tensorflow.python.ops import gen_random_ops  # pylint: disable=g-import-not-at-top
    from tf_keras.src.engine import data_adapter  # pylint: disable=g-import-not-at-top
    if state.shuffle_epoch is None:
        with tf.init_scope():
            state.shuffle_epoch = tf.Variable(0, dtype=tf.int64, trainable=False)
    state.shuffle_epoch.assign(0)
    skip = state.shuffle_epoch
    random = data_adapter.tf.random  # tensorflow.compat.v2.random: the adapter's permutation
    keras_shuffle = random.shuffle

    def shuffle(value, seed=None, name=None):  # pylint: disable=unused-argument
        seed1, seed2 = random_seed.get_seed(seed)  # what Keras's op would get, here
        draws = skip.read_value()
        with tf.control_dependencies([draws]):
            reset = skip.assign(0)

        def body(i, last):
            with tf.control_dependencies([last]):  # one draw after the other, in order
                return i + 1, gen_random_ops.random_shuffle(value, seed=seed1 or 0,
                                                            seed2=seed2 or 0)

        with tf.control_dependencies([reset]):
            return tf.while_loop(lambda i, _: i <= draws, body, (tf.constant(0, tf.int64), value),
                                 parallel_iterations=1)[1]

    random.shuffle = shuffle
    try:
        yield
    finally:
        random.shuffle = keras_shuffle


def _maker(step_name: str, attr: str) -> Callable:
    """``Model.make_*_function`` for a laid-out model: Keras's step, traced, on packed batches."""

    def make(self, force: bool = False):
        if self.run_eagerly:  # (set as an attribute after compile(), or by
            # tf.config.run_functions_eagerly(True); compile(run_eagerly=True) is refused there)
            raise ValueError(
                f"model.run_eagerly is True for model {self.name!r}: a laid-out model's steps run "
                "as compiled functions on the mesh (DTensor lays out traced functions), so it "
                "cannot run them eagerly; set model.run_eagerly = False (and "
                "tf.config.run_functions_eagerly(False)), or debug the model eagerly on one "
                "device without dtk.distribute")
        if getattr(self, attr) is not None and not force:
            return getattr(self, attr)
        state = self._dtk_mesh_state  # pylint: disable=protected-access
        step = getattr(self, step_name)
        if _overrides(self, step_name):  # (the model's own: converted as Keras's fit would)
            step = convert_user_step(step)
        if step_name == "train_step" and state.accumulation > 1:
            step = functools.partial(_accumulated_train_step, self, state)
        training = step_name == "train_step"

        def body(data):
            iterations = _step_counter(self)
            if training and state.sparse is not None:  # the touched rows, scattered after
                state.sparse.start_recording()
                with randomness.step_scope(iterations.read_value()), \
                        randomness.step_draws(state.generator):
                    logs = step(data)
                _warn_uncovered_random_ops(state)
                return logs, state.sparse_changes
            if training and iterations is not None:
                with randomness.step_scope(iterations.read_value()), \
                        randomness.step_draws(state.generator):
                    logs = step(data)
                _warn_uncovered_random_ops(state)
                return logs
            if step_name == "predict_step":  # outputs to the host whole, on every client
                return tf.nest.map_structure(
                    lambda t: _replicated(t, state) if isinstance(t, tf.Tensor) else t,
                    step(data))
            return step(data)

        def traced_body(data):
            # tf.image.extract_patches in user code runs as dtk's equivalent; FSDP weights are
            # read gathered (the optimizer's update reads their stored shards: mesh_optimizer).
            # The gathered weights live from the forward pass to the backward one here (the
            # Trainer gathers them again for the backward pass instead).
            with ops.during_steps(), fsdp.gather_scope():
                return body(data)

        # Training traces once per batch size (fit has two at most: the last partial batch),
        # never one of an unknown size: dtk's mesh-invariant draws (Dropout) and gradient
        # accumulation need the batch's static size (a relaxed trace fell back to Keras's own
        # draws, which depend on the mesh, for the last partial batch).
        calls = MeshCalls(traced_body, state, reduce_retracing=not training, autograph=False)
        traced_with = getattr(self, "optimizer", None)

        def function(iterator):
            if training and getattr(self, "optimizer", None) is not traced_with:
                raise ValueError(
                    f"model.optimizer was replaced after the train step was compiled (by "
                    f"{type(getattr(self, 'optimizer', None)).__name__}, after "
                    f"{type(traced_with).__name__}; a callback during fit?): the compiled step trains with the optimizer "
                    "it was compiled with, so the new one would be silently ignored. Change the "
                    "optimizer's learning rate instead (LearningRateScheduler, "
                    "ReduceLROnPlateau), or compile() again between fits")
            if training and state.skip_batches and not isinstance(
                    iterator, keras_data.EpochIterator):  # (that one skips in its stream)
                for _ in range(state.skip_batches):  # trained before the checkpoint
                    next(iterator)
                state.skip_batches = 0
            spe = getattr(self, "_steps_per_execution", None)  # a host variable (compile)
            per_call = 1 if spe is None else int(spe.numpy())
            if training and state.sparse is not None:
                # Each step's touched rows are added in place between compiled calls
                # (dtk.train.sparse: DTensor lays out no in-place scatter): one call a step.
                pieces = (iterator.take(per_call, stack=False)
                          if isinstance(iterator, keras_data.EpochIterator) else
                          [(1, data) for data in next_batches(iterator, per_call)])
                for _, data in pieces:
                    logs, changes = (calls.run_pieces([(1, data)]) if isinstance(
                        iterator, keras_data.EpochIterator) else calls([data]))
                    state.sparse.scatter(changes)
                return logs
            if isinstance(iterator, keras_data.EpochIterator):  # a DistributedDataset's
                pieces = iterator.take(per_call, stack=step_name != "predict_step")
                if step_name != "predict_step" or len(pieces) == 1:
                    return calls.run_pieces(pieces)
                outputs = [calls.run_pieces([piece]) for piece in pieces]
                return tf.nest.map_structure(lambda *t: tf.concat(t, axis=0), *outputs)
            if step_name == "predict_step" and per_call > 1:
                # Keras counts a call as per_call batches and keeps what it returns: every
                # batch's outputs, in order (one at a time: a loop would keep only the last's).
                outputs = [calls([data]) for data in next_batches(iterator, per_call)]
                return tf.nest.map_structure(lambda *t: tf.concat(t, axis=0), *outputs)
            return calls(next_batches(iterator, per_call))

        function.calls = calls  # (its traces: dtk.Steps.trace_counts)
        setattr(self, attr, function)
        return function

    return make


def _warn_uncovered_random_ops(state: MeshState) -> None:
    """Once per model: random ops of the traced train step that ``dtk.parallel.randomness`` did
    not build (a layer calling ``tf.random.*`` itself, ``RandomContrast``) draw per device, so
    their values depend on the mesh: named in a warning."""
    if state.random_ops_checked:
        return
    state.random_ops_checked = True
    found = randomness.uncovered_random_ops(tf.compat.v1.get_default_graph())
    if found:
        where = "; ".join(f"{scope} ({', '.join(types)})" for scope, types in found.items())
        _log.warning(
            "random ops not covered by dtk.parallel.randomness: %s. Their values depend on the "
            "mesh (each device draws with its own seed), so training with them does not match "
            "one device; draw through the layer's self._random_generator (a tf_keras "
            "BaseRandomLayer) to get mesh-independent values", where)


def _replicated(tensor: tf.Tensor, state: MeshState) -> tf.Tensor:
    """``tensor`` replicated on the mesh, its other axes gathered before the batch axis: one
    relayout of an output sharded on two axes (the LM's logits: batch, and the vocabulary
    over ``model``) is lowered by DTensor with a reshape of the wrong size."""
    rank = tensor.shape.rank
    if rank and state.batch_axis in state.mesh.dim_names and len(state.mesh.dim_names) > 1 \
            and tensor.shape[0] is not None and not tensor.shape[0] % state.size:
        tensor = dtensor.relayout(tensor, dtensor.Layout.batch_sharded(
            state.mesh, state.batch_axis, rank))
    return dtensor.relayout(tensor, dtensor.Layout.replicated(state.mesh, rank))


def _accumulated_train_step(model: tf_keras.Model, state: MeshState, data: Any) -> Any:
    """Keras's ``train_step`` over ``state.accumulation`` microbatches: each device's rows viewed
    as ``[rows / k, k]``, microbatch ``j`` their column ``j`` (no example moves between devices),
    one forward and backward pass at a time, the gradients summed, one update with their mean.
    Keras's loss is each microbatch's mean (over its examples, as Keras divides by the batch
    size), so the mean over the equal microbatches is the whole batch's; the metrics (sums) and
    the loss tracker (weighted by rows) add up to the whole batch's; dropout draws the masks of
    the whole batch (``randomness.microbatch_scope``). A batch the microbatches cannot split (a
    last partial batch) trains whole."""
    from tf_keras.src.engine import data_adapter  # pylint: disable=g-import-not-at-top
    k = state.accumulation
    x, y, sample_weight = data_adapter.unpack_x_y_sample_weight(data)
    rows = int(tf.nest.flatten(x)[0].shape[0])
    if rows % (k * state.size):  # the last partial batch (fit refused a batch_size that is not)
        return tf_keras.Model.train_step(model, data)

    def part(t, j):
        if t is None:
            return None
        return tf.gather(tf.reshape(t, [t.shape[0] // k, k, *t.shape[1:]]), j, axis=1)

    variables = model.trainable_variables
    total = [None] * len(variables)
    draws = randomness.snapshot()
    for j in range(k):
        xj, yj, wj = (tf.nest.map_structure(lambda t, j=j: part(t, j), v) if v is not None
                      else None for v in (x, y, sample_weight))
        with randomness.replay(draws), randomness.microbatch_scope(k, j):
            with tf.GradientTape() as tape:
                y_pred = model(xj, training=True)
                if any(getattr(t, "_keras_mask", None) is not None
                       for t in tf.nest.flatten(y_pred)):
                    raise ValueError(
                        f"gradient_accumulation_steps={k} on a model whose output carries a "
                        "Keras mask: Keras's loss is the mean over the batch's unmasked elements, "
                        "which differ in number between microbatches, so their mean is not the "
                        "batch's; drop gradient_accumulation_steps for this model")
                loss = model.compute_loss(xj, yj, y_pred, wj)
        model._validate_target_and_loss(yj, loss)  # pylint: disable=protected-access
        grads = tape.gradient(loss, variables)
        # (an Embedding's IndexedSlices: summed dense, as the optimizer applies them)
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        total = [g if t is None else (t if g is None else t + g) for t, g in zip(total, grads)]
        model.compute_metrics(xj, yj, y_pred, wj)
    model.optimizer.apply_gradients(
        (g / k, v) for g, v in zip(total, variables) if g is not None)
    return model.get_metrics_result()


def _metrics_on_batch_sharded_labels(model: tf_keras.Model, state: MeshState) -> None:
    """Keras's ``compute_metrics`` on labels laid out on the batch axis only: labels sharded
    along the sequence too (``InputConfig(sequence_axis=...)``) make the metrics' broadcasts
    of the sample weights fail in DTensor's SPMD expansion. (A no-op on a one-axis mesh.)"""
    mesh, axis = state.mesh, state.batch_axis
    if len(mesh.dim_names) == 1:
        return
    original = model.compute_metrics

    def compute_metrics(x, y, y_pred, sample_weight):
        if not tf.executing_eagerly():
            y = tf.nest.map_structure(
                lambda t: dtensor.relayout(t, dtensor.Layout.batch_sharded(mesh, axis, t.shape.rank))
                if isinstance(t, tf.Tensor) and t.shape.rank and t.shape.rank >= 2 else t, y)
        return original(x, y, y_pred, sample_weight)

    model.compute_metrics = compute_metrics


def _eager_calls_on_mesh(model: tf_keras.Model, mesh: dtensor.Mesh) -> None:
    """Lets the model and the models inside it be called eagerly on host values (a callback's
    ``self.model.generator(noise)``, keras.io's GANMonitor; ``model(x)`` in a notebook): the
    inputs are copied to the mesh, replicated, and the output is a replicated DTensor that
    ``.numpy()`` reads. Inside dtk's compiled steps the inputs are already on the mesh. A call
    in a trace marks the graph as on the mesh (``custom_loops.mark_graph``: a user's metric
    updated there is moved onto it)."""
    models = [model] + [layer for layer in model._flatten_layers(include_self=False)  # pylint: disable=protected-access
                        if isinstance(layer, tf_keras.Model)]
    for each in models:
        original = each.call

        def call(inputs, *args, __call=original, __outer=each is model, **kwargs):
            if tf.executing_eagerly():
                if __outer:  # a model whose string preprocessing runs on the host
                    inputs = host_inputs.on_host(getattr(getattr(
                        model, "_dtk_mesh_state", None), "host", None), inputs)
                inputs = tf.nest.map_structure(
                    lambda t: dtensor.copy_to_mesh(t, dtensor.Layout.replicated(
                        mesh, t.shape.rank)) if tf.is_tensor(t) and not dtensor.is_dtensor(t)
                    else t, inputs)
            else:
                custom_loops.mark_graph(mesh)
            return __call(inputs, *args, **kwargs)

        each.call = call


def _step_counter(model: tf_keras.Model) -> tf.Variable | None:
    """The counter that keys a train step's random draws: ``model.optimizer.iterations``; for a
    model whose own ``train_step`` steps optimizers it keeps itself (keras.io's GAN: ``compile()``
    with no optimizer leaves Keras's default RMSprop, which never steps), the first of those."""
    own = [value for attr, value in vars(model).items()
           if not attr.startswith("_") and attr != "optimizer"
           and isinstance(value, tf_keras.optimizers.Optimizer)]
    if own and type(model).train_step is not tf_keras.Model.train_step:
        return own[0].iterations
    return getattr(getattr(model, "optimizer", None), "iterations", None)


def _bind_metric_objects(metrics: Any, mesh: dtensor.Mesh) -> Any:
    """Metric objects given to ``compile()`` (an ``AUC()`` the user made), made again bound to
    ``mesh`` (``make_metric``); names stay names (Keras makes them on the mesh, see above)."""
    return tf.nest.map_structure(
        lambda m: _bind_metric(m, mesh) if isinstance(m, tf_keras.metrics.Metric) else m,
        metrics)


def _bind_metric(metric: tf_keras.metrics.Metric, mesh: dtensor.Mesh
                 ) -> tf_keras.metrics.Metric:
    """``make_metric``; a user's metric class that does not take ``mesh=`` (keras.io's
    ``CategoricalTruePositives``) is made again from its config with ``mesh`` as the default
    mesh, where its ``add_weight`` variables are made replicated on the mesh, as the variables
    of the metrics Keras makes itself are.

    Raises:
      ValueError: a metric that cannot be made again from its config, named, with the fix.
    """
    try:
        return make_metric(metric, mesh)
    except ValueError:
        pass
    try:
        with dtensor.default_mesh(mesh):
            rebuilt = type(metric).from_config(metric.get_config())
    except (TypeError, ValueError, NotImplementedError) as e:
        raise ValueError(
            f"compile(metrics=[...]) {metric.name!r} ({type(metric).__name__}): dtk makes a "
            "metric object again on the mesh from its config, and this one's cannot (" +
            str(e).splitlines()[0][:200] + "); give its class a get_config() that returns its "
            "constructor's arguments, or accept mesh= in its __init__") from None
    for variable in rebuilt.variables:
        dtensor.fetch_layout(variable)  # raises if not on the mesh
    return rebuilt
