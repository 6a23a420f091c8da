"""Keras 3's own distribution API (``keras.distribution``) on the TensorFlow backend, by DTensor.

Keras 3 implements ``DeviceMesh``, ``LayoutMap``, ``DataParallel`` and ``ModelParallel`` for
JAX only; its TensorFlow module (``keras/src/backend/tensorflow/distribution_lib.py``) is a
prototype marked "DO NOT USE". ``enable_keras_distribution()`` fills in the TensorFlow backend at
the seams Keras's JAX backend uses (``keras/src/backend/jax/core.py`` and
``distribution_lib.py``), with DTensor underneath, so that Keras's own ``fit``, callbacks,
losses and metrics run unchanged on the mesh:

* **variables** (``Variable._initialize``): a variable made while a distribution is set becomes
  a ``DVariable`` in the layout ``distribution.get_variable_layout`` gives it, made eagerly
  (``tf.init_scope``: optimizer slots are made inside the first traced step) from the same
  initial value plain Keras draws; its ``_layout`` is kept, so its optimizer slots take it too;
* **batches** (``Trainer._make_function`` / ``make_predict_function``): the next batch of
  Keras's data adapter, on the host, is laid out over the batch axis by dtk's packer (the one
  ``dtk.distribute`` uses; a last partial batch runs whole on every device with Keras's numbers)
  and Keras's own ``train_step``/``test_step``/``predict_step`` runs as one traced function;
* **the mesh and layouts** (``_to_backend_mesh``, ``distribute_tensor``, ``initialize``):
  ``DeviceMesh`` becomes a ``dtensor.Mesh`` on the devices it lists (every client's, in a
  multi-client run), a ``LayoutMap`` entry for a layer's output relayouts it.

It is a call, not an import side effect, and it checks the Keras version it was tested on.

Example::

    import dtk, keras
    dtk.enable_keras_distribution()
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    model = keras.Sequential([...]); model.compile(...); model.fit(x, y)
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

_log = logging.getLogger("dtk")

# The Keras 3 releases these seams were written against and tested on (their private names).
TESTED_KERAS = ((3, 15),)
_ENABLED: dict[str, Any] = {}


def _keras():
    """Keras 3 (the ``keras`` package), checked: the TensorFlow backend, a tested version."""
    backend = os.environ.get("KERAS_BACKEND", "tensorflow")
    if backend != "tensorflow":
        raise ValueError(
            f"dtk.enable_keras_distribution(): KERAS_BACKEND={backend!r}; dtk implements Keras's "
            "distribution API for the TensorFlow backend (DTensor). Set KERAS_BACKEND=tensorflow "
            "before importing keras, or use Keras's own JAX distribution on JAX")
    import keras  # pylint: disable=g-import-not-at-top
    version = tuple(int(p) for p in keras.__version__.split(".")[:2] if p.isdigit())
    if keras.backend.backend() != "tensorflow":
        raise ValueError(
            f"dtk.enable_keras_distribution(): keras was imported with the "
            f"{keras.backend.backend()!r} backend (KERAS_BACKEND); dtk implements the TensorFlow "
            "backend's distribution. Set KERAS_BACKEND=tensorflow before importing keras")
    if version not in TESTED_KERAS:
        tested = ", ".join(f"{a}.{b}" for a, b in TESTED_KERAS)
        raise RuntimeError(
            f"dtk.enable_keras_distribution(): keras {keras.__version__} is not a version dtk's "
            f"seams were tested on ({tested}.x): they replace private parts of Keras's "
            f"TensorFlow backend. Install keras {tested}.x (pip install 'keras>=3.15,<3.16'), "
            "or a dtk release that supports this Keras")
    return keras


def enable_keras_distribution(*, virtual_devices: int | None = None) -> None:
    """Turns Keras 3's distribution API on for the TensorFlow backend (idempotent).

    After it, ``keras.distribution.DeviceMesh``, ``LayoutMap``, ``DataParallel``,
    ``ModelParallel``, ``set_distribution``/``distribution.scope()`` and
    ``keras.distribution.initialize()`` work with ``KERAS_BACKEND=tensorflow``: models built
    under a distribution hold DTensor variables laid out as it says, and Keras's ``fit``,
    ``evaluate``, ``predict`` and the ``*_on_batch`` methods run each batch laid out over the
    batch axis. Without a distribution set, Keras behaves as before.

    On a machine with CPUs only, the CPU is split into ``virtual_devices`` logical devices
    (default ``$DTK_VIRTUAL_DEVICES``, else 8) when TensorFlow has not initialized its devices
    yet, so that ``list_devices()`` has a mesh's worth, as ``dtk.build_mesh`` does.

    Raises:
      ValueError: another Keras backend, or a distribution set before the call.
      RuntimeError: a Keras version the seams were not tested on.
    """
    if _ENABLED:
        return
    keras = _keras()
    from dtk import _env  # pylint: disable=g-import-not-at-top
    from dtk.cluster import env as cluster  # pylint: disable=g-import-not-at-top
    from dtk.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
    if not mesh_lib.is_tensorflow_initialized() and not cluster.is_multi_client() and \
            mesh_lib.resolve_device_type("auto") == "CPU":
        count = virtual_devices or _env.get_int(_env.VIRTUAL_DEVICES) or 8
        mesh_lib.configure_virtual_cpus(count)
        _log.info("dtk.enable_keras_distribution: %d virtual CPU devices", count)
    if keras.distribution.distribution() is not None:
        raise ValueError(
            "dtk.enable_keras_distribution() after keras.distribution.set_distribution(...): "
            "the TensorFlow backend had no distribution then, so what was built under it holds "
            "plain variables. Call dtk.enable_keras_distribution() first, then set the "
            "distribution and build the model")
    from keras.src.backend.tensorflow import core, trainer as tf_trainer  # pylint: disable=g-import-not-at-top
    from keras.src.backend.tensorflow import distribution_lib as backend_lib  # pylint: disable=g-import-not-at-top
    from dtk.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
    del mesh_lib
    _ENABLED["initialize"] = core.Variable._initialize  # pylint: disable=protected-access
    core.Variable._initialize = _initialize_variable  # pylint: disable=protected-access
    for name in ("numpy", "__array__", "_direct_assign"):
        _ENABLED[name] = getattr(core.Variable, name)
    core.Variable.numpy = _variable_numpy
    core.Variable.__array__ = lambda self, dtype=None, copy=None: np.asarray(
        _variable_numpy(self), dtype)
    core.Variable._direct_assign = _direct_assign  # pylint: disable=protected-access
    _ENABLED["value"] = core.Variable.value.fget
    core.Variable.value = property(_value_on_mesh)
    from keras.src.optimizers import base_optimizer  # pylint: disable=g-import-not-at-top
    _ENABLED["add_variable_from_reference"] = \
        base_optimizer.BaseOptimizer.add_variable_from_reference
    base_optimizer.BaseOptimizer.add_variable_from_reference = _add_slot
    _ENABLED["apply"] = base_optimizer.BaseOptimizer.apply
    base_optimizer.BaseOptimizer.apply = _apply
    from keras.src.backend.tensorflow import optimizer as tf_optimizer  # pylint: disable=g-import-not-at-top
    for name in ("assign", "assign_add", "assign_sub"):
        _ENABLED[f"optimizer.{name}"] = getattr(tf_optimizer.TFOptimizer, name)
        setattr(tf_optimizer.TFOptimizer, name, functools.partialmethod(_sparse_assign, name))
    for name in ("_make_function", "make_predict_function"):
        _ENABLED[name] = getattr(tf_trainer.TensorFlowTrainer, name)
    tf_trainer.TensorFlowTrainer._make_function = _make_function  # pylint: disable=protected-access
    tf_trainer.TensorFlowTrainer.make_predict_function = _make_predict_function
    from keras.src.backend.tensorflow import random as tf_random  # pylint: disable=g-import-not-at-top
    for name in ("uniform", "normal", "truncated_normal", "dropout"):
        _ENABLED[f"random.{name}"] = getattr(tf_random, name)
        setattr(tf_random, name, functools.partial(_draw, name))
    import tf_keras  # pylint: disable=g-import-not-at-top
    for name in ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch",
                 "predict_on_batch"):
        _ENABLED[f"tf_keras.{name}"] = getattr(tf_keras.Model, name)
        setattr(tf_keras.Model, name, _keras2_checked(name))
    _ENABLED["export"] = keras.Model.export
    keras.Model.export = _export
    _ENABLED["compile"] = tf_trainer.TensorFlowTrainer.compile
    tf_trainer.TensorFlowTrainer.compile = _compile
    for name, position in (("fit", 3), ("evaluate", 3), ("predict", 2)):
        _ENABLED[name] = getattr(tf_trainer.TensorFlowTrainer, name)
        setattr(tf_trainer.TensorFlowTrainer, name, _checked(name, position))
    _ENABLED["Model.__call__"] = keras.Model.__call__
    keras.Model.__call__ = _model_call_scoped
    from keras.src.backend.tensorflow import numpy as tf_numpy  # pylint: disable=g-import-not-at-top
    _ENABLED["numpy.flip"] = tf_numpy.flip
    tf_numpy.flip = _flip
    backend_lib._to_backend_mesh = _to_backend_mesh  # pylint: disable=protected-access
    backend_lib._to_backend_layout = _to_backend_layout  # pylint: disable=protected-access
    backend_lib.distribute_tensor = distribute_tensor
    backend_lib.distribute_variable = distribute_variable
    backend_lib.distribute_data_input = distribute_data_input
    backend_lib.initialize = initialize
    backend_lib.num_processes = _num_processes
    backend_lib.process_id = _process_id
    backend_lib.get_device_count = lambda device_type=None: len(
        backend_lib.list_devices(device_type))
    _ENABLED["keras"] = keras


def _keras2_checked(name: str):
    """tf_keras's ``Model.<name>``, refused for a plain tf_keras model while a Keras 3
    distribution is set: Keras 3's distribution lays out Keras 3 models only, and the tf_keras
    model would train on one device while the user believes it is distributed."""
    method = _ENABLED[f"tf_keras.{name}"]

    @functools.wraps(method)
    def checked(self, *args, **kwargs):
        distribution = _distribution()
        if distribution is not None and getattr(self, "_dtk_mesh_state", None) is None:
            raise TypeError(
                f"{name}() of model {self.name!r}: it is a tf_keras (Keras 2) model, but a Keras 3 "
                f"distribution is set ({type(distribution).__name__}, "
                "keras.distribution.set_distribution): Keras 3's distribution lays out Keras 3 "
                "models only, so this one would train on one device. Build it with `import "
                "keras` (Keras 3), or lay a tf_keras model out with dtk.distribute(factory, "
                "mesh)")
        return method(self, *args, **kwargs)

    return checked


def _distribution():
    from keras.src.distribution import distribution_lib  # pylint: disable=g-import-not-at-top
    return distribution_lib.distribution()


# -- the mesh -------------------------------------------------------------------------------------
def _num_processes() -> int:
    from dtk.cluster import env as cluster  # pylint: disable=g-import-not-at-top
    return cluster.num_clients()


def _process_id() -> int:
    from dtk.cluster import env as cluster  # pylint: disable=g-import-not-at-top
    return cluster.client_id()


def initialize(job_addresses=None, num_processes=None, process_id=None) -> None:
    """``keras.distribution.initialize``: this process as one DTensor client of several.

    Given nothing, dtk's launcher and the TF_CONFIG / Slurm bridges have already set the
    client environment (``DTENSOR_JOBS``, ``DTENSOR_CLIENT_ID``); given the addresses, they are
    set here. The clients connect when the first mesh is built.
    """
    if job_addresses is not None:
        addresses = [a.strip() for a in str(job_addresses).split(",") if a.strip()]
        if num_processes is not None and len(addresses) != int(num_processes):
            raise ValueError(
                f"keras.distribution.initialize(job_addresses=...) lists {len(addresses)} "
                f"addresses for num_processes={num_processes}; give one address per process "
                "(the TensorFlow backend connects every client to every other)")
        if process_id is None:
            raise ValueError("keras.distribution.initialize(job_addresses=...) needs "
                             "process_id= (this process's index in job_addresses)")
        os.environ["DTENSOR_JOBS"] = ",".join(addresses)
        os.environ["DTENSOR_CLIENT_ID"] = str(int(process_id))
        os.environ.setdefault("DTENSOR_JOB_NAME", "worker")
    from dtk import _env  # pylint: disable=g-import-not-at-top
    from dtk.cluster import env as cluster  # pylint: disable=g-import-not-at-top
    from dtk.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
    cluster.apply_scheduler_env()
    # The clients join now, so that list_devices() (DataParallel(), DeviceMesh) lists every
    # client's devices.
    kind = mesh_lib.resolve_device_type("auto")
    virtual = _env.get_int(_env.VIRTUAL_DEVICES) if kind == "CPU" else None
    mesh_lib._initialize(kind, mesh_lib._devices_per_client(kind, virtual), virtual)  # pylint: disable=protected-access


def _to_backend_mesh(device_mesh) -> dtensor.Mesh:
    """A ``keras.distribution.DeviceMesh`` as a ``dtensor.Mesh`` on the devices it lists.

    The usual mesh lists every device (``keras.distribution.list_devices()``) in order: it is
    built as dtk builds ``--mesh data=2,model=4`` (every client's devices, DTensor initialized
    for several clients). Any other order or subset of this process's devices is taken as given.
    """
    from dtk.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
    from keras.src.backend.tensorflow import distribution_lib as backend_lib  # pylint: disable=g-import-not-at-top
    names = list(device_mesh.axis_names)
    shape = [int(s) for s in device_mesh.shape]
    devices = [str(d) for d in np.asarray(device_mesh.devices).flatten()]
    listed = backend_lib.list_devices()
    if devices == listed[:len(devices)]:
        return mesh_lib.build_mesh(",".join(f"{n}={s}" for n, s in zip(names, shape)),
                                   device_type=devices[0].split(":")[0])
    full = []
    for device in devices:
        kind, _, index = device.rpartition(":")
        full.append(f"/job:localhost/replica:0/task:0/device:{kind.upper()}:{index}")
    return dtensor.create_mesh(list(zip(names, shape)), devices=full)


def _to_backend_layout(tensor_layout) -> dtensor.Layout:
    """A ``TensorLayout`` as a ``dtensor.Layout``, its axes checked against its mesh."""
    mesh = tensor_layout.device_mesh
    if mesh is None:
        raise ValueError(f"TensorLayout(axes={tuple(tensor_layout.axes)}) has no device mesh; "
                         "give it device_mesh=, or set it through a LayoutMap of a mesh")
    for axis in tensor_layout.axes:
        if axis is not None and axis not in mesh.axis_names:
            raise ValueError(
                f"TensorLayout(axes={tuple(tensor_layout.axes)}): axis {axis!r} is not an axis "
                f"of the mesh (axes {list(mesh.axis_names)}, shape {tuple(mesh.shape)}); use one "
                "of them, or None to keep that dim whole")
    specs = [axis if axis else dtensor.UNSHARDED for axis in tensor_layout.axes]
    return dtensor.Layout(sharding_specs=specs, mesh=mesh.backend_mesh)


def _backend_layout(layout) -> dtensor.Layout:
    return layout.backend_layout if hasattr(layout, "backend_layout") else layout


# -- dtk's tables as LayoutMaps --------------------------------------------------------------------
def _device_mesh(mesh):
    """A ``keras.distribution.DeviceMesh`` from a DeviceMesh, a ``dtensor.Mesh`` or a spec
    string (``"batch=4,model=2"``, over the first devices ``list_devices()`` gives)."""
    keras = _ENABLED.get("keras") or _keras()
    if isinstance(mesh, keras.distribution.DeviceMesh):
        return mesh
    if isinstance(mesh, dtensor.Mesh):
        axes = [(name, mesh.dim_size(name)) for name in mesh.dim_names]
    elif isinstance(mesh, str):
        from dtk.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
        axes = list(mesh_lib.parse_mesh_spec(mesh).axes)
        if any(size == -1 for _, size in axes):  # "batch=-1,model=2": every device
            rest = int(np.prod([size for _, size in axes if size != -1]))
            total = len(keras.distribution.list_devices())
            axes = [(name, total // rest if size == -1 else size) for name, size in axes]
    else:
        raise TypeError(f"mesh must be a keras.distribution.DeviceMesh, a dtensor.Mesh or a "
                        f"spec string like 'batch=4,model=2'; got {type(mesh).__name__}: "
                        f"{str(mesh)[:60]!r}")
    count = int(np.prod([size for _, size in axes]))
    devices = keras.distribution.list_devices()
    if count > len(devices):
        raise ValueError(
            f"mesh {','.join(f'{n}={s}' for n, s in axes)} needs {count} devices; "
            f"keras.distribution.list_devices() lists {len(devices)}: make the axes' product "
            f"at most {len(devices)}")
    return keras.distribution.DeviceMesh(shape=tuple(size for _, size in axes),
                                         axis_names=[name for name, _ in axes],
                                         devices=devices[:count])


def layout_map(mesh, table, *, axes: dict[str, str] | None = None):
    """A dtk layout table (``layouts/``) as a ``keras.distribution.LayoutMap`` for Keras 3.

    Each rule becomes one key: its pattern, written over dtk's dotted weight paths
    (``d1\.kernel``), matched against Keras 3's variable paths (``sequential/d1/kernel``) with
    ``/`` for the dot, anywhere below the model (``(.*/)?d1/kernel``); its dims become the
    ``TensorLayout``'s axes (``unsharded`` is ``None``; an optional axis the mesh lacks is
    ``None`` too). The map remembers its table: at the model's first step dtk checks that every
    rule lays out some weight (a rule written for tf_keras paths that the Keras 3 model does
    not have is an error naming the rule and the model's paths), that a table whose
    ``default`` is ``error`` has a rule for every weight, and that a weight two rules match is
    refused.

    Args:
      mesh: a ``keras.distribution.DeviceMesh``, a ``dtensor.Mesh`` or a spec string
        (``"batch=4,model=2"``).
      table: a table's name (``"mlp_model_parallel"``), path, or ``dtk.LayoutTable``.
      axes: the table's axis names renamed to the mesh's, e.g. ``{"batch": "data"}`` for
        keras.io's ``DeviceMesh(axis_names=["data", "model"])``.

    Returns:
      A ``keras.distribution.LayoutMap`` on ``mesh``, for
      ``keras.distribution.ModelParallel(layout_map=..., batch_dim_name=...)``.

    Raises:
      ValueError: a table axis that is neither in the mesh nor optional, an unknown table.
    """
    keras = _ENABLED.get("keras") or _keras()
    from dtk.parallel import layouts  # pylint: disable=g-import-not-at-top
    device_mesh = _device_mesh(mesh)
    if not isinstance(table, layouts.LayoutTable):
        table = layouts.load_table(table)
    renamed = dict(axes or {})
    for name, target in renamed.items():
        if name not in table.axes:
            raise ValueError(f"axes={renamed}: {name!r} is not an axis of table {table.name!r} "
                             f"(its axes: {list(table.axes)})")
        if target not in device_mesh.axis_names:
            raise ValueError(f"axes={renamed}: {target!r} is not an axis of the mesh (axes "
                             f"{list(device_mesh.axis_names)})")
    mesh_axes = list(device_mesh.axis_names)
    for name in table.axes:
        if renamed.get(name, name) not in mesh_axes and name not in table.optional_axes:
            raise ValueError(
                f"table {table.name!r} shards over axis {name!r}, which the mesh (axes "
                f"{mesh_axes}, shape {tuple(device_mesh.shape)}) lacks: name a mesh axis "
                f"{name!r}, or pass axes={{{name!r}: <one of {mesh_axes}>}}")
    result = keras.distribution.LayoutMap(device_mesh)
    keys = {}
    for rule in table.rules:
        dims = []
        for dim in rule.dims:
            axis = renamed.get(dim, dim) if dim else None
            dims.append(axis if axis in mesh_axes else None)
        key = "(.*/)?" + rule.pattern.replace(r"\.", "/")
        result[key] = tuple(dims)
        keys[key] = rule
    result._dtk_table = table  # pylint: disable=protected-access
    result._dtk_rules = keys  # pylint: disable=protected-access
    # mesh axes over which the table may replicate every weight on purpose
    result._dtk_replicated = {renamed.get(a, a) for a in table.replicated_axes}  # pylint: disable=protected-access
    return result


def distribute_model(model_factory, mesh, *, layout="data_parallel", seed: int = 0,
                     input_shape=None, batch_axis: str = "batch", allow_replicated: bool = False,
                     shard_optimizer_state: bool | str = "auto"):
    """``dtk.distribute`` of a Keras 3 factory: ``model_factory()`` built under a
    ``ModelParallel`` on ``mesh`` whose ``LayoutMap`` is the table ``layout``, seeded by
    ``keras.utils.set_random_seed(seed)`` (the initial weights equal a plain build's with that
    seed). The distribution stays with the model: its ``compile``/``fit``/``evaluate``/
    ``predict`` and calls run under it, and no global distribution is set.

    Raises:
      ValueError: the checks of ``layout_map``; ``batch_axis`` not in the mesh.
    """
    enable_keras_distribution()
    keras = _ENABLED["keras"]
    device_mesh = _device_mesh(mesh)
    if batch_axis not in device_mesh.axis_names:
        raise ValueError(f"batch_axis {batch_axis!r} is not an axis of the mesh (axes "
                         f"{list(device_mesh.axis_names)}); pass batch_axis= one of them")
    table_map = layout_map(device_mesh, layout)
    if allow_replicated:
        table_map._dtk_replicated = set(device_mesh.axis_names)  # pylint: disable=protected-access
    distribution = keras.distribution.ModelParallel(layout_map=table_map,
                                                    batch_dim_name=batch_axis)
    if shard_optimizer_state is False:
        distribution._dtk_shard_optimizer_state = False  # pylint: disable=protected-access
    from dtk.parallel import ops  # pylint: disable=g-import-not-at-top
    ops.install_equivalents()  # before the factory: a layer may keep the function itself
    keras.utils.set_random_seed(seed)
    with distribution.scope():
        model = model_factory()
        if not model.built and input_shape is not None:
            model.build((None, *input_shape))
    model._dtk_distribution = distribution  # pylint: disable=protected-access
    _check_layout_map(model, distribution)  # (built: the table checked before any step)
    _log.info("dtk.distribute: Keras 3 model %r on mesh %s, table %r (keras.distribution)",
              model.name, ",".join(f"{n}={s}" for n, s in zip(device_mesh.axis_names,
                                                             device_mesh.shape)),
              table_map._dtk_table.name)  # pylint: disable=protected-access
    return model


def explain(target) -> str:
    """Where every weight lives: a ``dtk.plan_layouts`` plan (tf_keras,
    ``dtk.parallel.layouts.explain``), or a Keras 3 model built under a distribution (one row
    per weight: its path, shape, the LayoutMap key or table rule that laid it out, its sharding
    and bytes per device; then a one-line summary).

    Raises:
      TypeError: neither a plan nor a Keras 3 model.
    """
    import re  # pylint: disable=g-import-not-at-top
    from dtk.parallel import layouts  # pylint: disable=g-import-not-at-top
    if isinstance(target, layouts.LayoutPlan):
        return layouts.explain(target)
    keras = _ENABLED.get("keras") or _keras()
    if not isinstance(target, keras.Model):
        raise TypeError(f"dtk.explain takes a layout plan (dtk.plan_layouts) or a Keras 3 model; "
                        f"got {type(target).__name__}")
    distribution = getattr(target, "_dtk_distribution", None) or _distribution()
    layout_map = getattr(distribution, "_layout_map", None)
    rules = getattr(layout_map, "_dtk_rules", {})
    rows = [("weight", "shape", "rule", "sharding", "per device")]
    total = per_device = sharded = 0
    sizes = {}
    for weight in target.weights:
        layout = getattr(weight, "_dtk_layout", None)
        specs = list(layout.sharding_specs) if layout is not None else \
            [dtensor.UNSHARDED] * len(weight.shape)
        if layout is not None:
            sizes = {n: layout.mesh.dim_size(n) for n in layout.mesh.dim_names}
        keys = [k for k in (layout_map or ()) if k == weight.path or re.fullmatch(k, weight.path)]
        rule = (rules[keys[0]].pattern if keys[0] in rules else keys[0]) if keys else \
            "(no key: replicated)"
        nbytes = int(np.prod(weight.shape)) * tf.as_dtype(weight.dtype).size
        split = int(np.prod([sizes.get(a, 1) for a in specs if a != dtensor.UNSHARDED]))
        total, per_device = total + nbytes, per_device + nbytes // split
        sharded += split > 1
        rows.append((weight.path, str(list(weight.shape)), rule, "[" + ", ".join(specs) + "]",
                     layouts._bytes(nbytes // split)))  # pylint: disable=protected-access
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    mesh = ",".join(f"{n}={s}" for n, s in sizes.items()) or "one device"
    table = getattr(getattr(layout_map, "_dtk_table", None), "name", None)
    source = f"layout table {table!r}" if table else ("LayoutMap" if layout_map is not None
                                                      else "no LayoutMap")
    lines = [f"Keras 3 model {target.name!r}, {source}, on mesh {mesh}"]
    lines += ["  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    lines.append(f"layouts: {target.name} on {mesh}: {len(rows) - 1} weights ({sharded} "
                 f"sharded), {layouts._bytes(total)} in all, "  # pylint: disable=protected-access
                 f"{layouts._bytes(per_device)} per device")  # pylint: disable=protected-access
    return "\n".join(lines)


@tf.autograph.experimental.do_not_convert
def _export(self, filepath, format="tf_saved_model", *args, **kwargs):  # pylint: disable=redefined-builtin
    """``Model.export`` of a model on the mesh: a plain twin (``clone_model``, built and given
    the gathered weights with no distribution in force) is exported, so that the artifact
    serves on one device with no DTensor in it."""
    if not _on_mesh(self):
        return _ENABLED["export"](self, filepath, format, *args, **kwargs)
    keras = _ENABLED["keras"]
    from keras.src.distribution import distribution_lib  # pylint: disable=g-import-not-at-top
    weights = self.get_weights()
    kept = distribution_lib.distribution()
    distribution_lib.set_distribution(None)
    try:
        try:
            twin = keras.models.clone_model(self)
        except Exception as e:  # pylint: disable=broad-except
            raise ValueError(
                f"export() of model {self.name!r} on the mesh: dtk exports a plain copy, and "
                f"Keras could not clone this model ({type(e).__name__}: {e}); give the "
                "subclassed model get_config(), or save_weights() and export a plain build "
                "loaded with them") from None
        if not twin.built:
            raise ValueError(
                f"export() of model {self.name!r} on the mesh: its plain copy is not built "
                "(a subclassed model builds on its first call); save_weights() and export a "
                "plain build loaded with them")
        twin.set_weights(weights)
        return _ENABLED["export"](twin, filepath, format, *args, **kwargs)
    finally:
        distribution_lib.set_distribution(kept)


# -- variables ------------------------------------------------------------------------------------
@tf.autograph.experimental.do_not_convert
def _initialize_variable(self, value) -> None:
    """``Variable._initialize`` of Keras's TensorFlow backend, with a distribution set: a
    ``DVariable`` in the variable's layout (the JAX backend's ``_initialize_layout``)."""
    distribution = _distribution()
    if distribution is None or isinstance(value, tf.Variable):
        return _ENABLED["initialize"](self, value)
    with tf.init_scope():
        # Keras's own draws for initial values, even when the first step builds the model:
        # the same numbers as plain Keras (dtk's mesh-invariant draws are for the step's).
        in_step = list(_IN_STEP)
        _IN_STEP.clear()
        try:
            initial = value() if callable(value) else value
        finally:
            _IN_STEP.extend(in_step)
        initial = tf.convert_to_tensor(initial, dtype=self._dtype)  # pylint: disable=protected-access
        if self._shape is None or None in tuple(self._shape):  # pylint: disable=protected-access
            self._shape = tuple(initial.shape)  # the layout's rank comes from it
        if self._layout is None:  # pylint: disable=protected-access
            _check_one_key(distribution, self.path)
            self._layout = distribution.get_variable_layout(self)  # pylint: disable=protected-access
        layout = _backend_layout(self._layout)  # pylint: disable=protected-access
        _check_divisible(self.path, tuple(initial.shape), layout)
        if dtensor.is_dtensor(initial):  # made under the step's default mesh (slots' zeros)
            from dtk.train import checkpoint  # pylint: disable=g-import-not-at-top
            initial = tf.constant(checkpoint.global_value(initial), dtype=initial.dtype)
        laid_out = _place(initial, layout)
        self._dtk_layout = layout  # pylint: disable=protected-access  (read when traced)
        self._dtk_distribution = distribution  # pylint: disable=protected-access  (custom loops)
        self._value = dtensor.DVariable(  # pylint: disable=protected-access
            laid_out, trainable=self.trainable, name=self.name,
            aggregation=self._map_aggregation(self.aggregation),  # pylint: disable=protected-access
            synchronization=self._map_synchronization(self.synchronization))  # pylint: disable=protected-access
    return None


@tf.autograph.experimental.do_not_convert
def _variable_numpy(self) -> np.ndarray:
    """``Variable.numpy()`` (and ``get_weights``, ``np.array``, saving) on any layout: the
    global value, gathered one sharded dim at a time."""
    if not isinstance(self._value, dtensor.DVariable):  # pylint: disable=protected-access
        return _ENABLED["numpy"](self)
    from dtk.train import checkpoint  # pylint: disable=g-import-not-at-top
    return checkpoint.global_value(self._value)  # pylint: disable=protected-access


@tf.autograph.experimental.do_not_convert
def _direct_assign(self, value) -> None:
    """``assign`` (``set_weights``, ``load_weights``, a restore) of a host value into a
    DVariable: copied to the mesh, then relaid out to the variable's layout."""
    target = self._value  # pylint: disable=protected-access
    layout = getattr(self, "_dtk_layout", None)
    if layout is not None and not tf.executing_eagerly():
        # In a step, the value may come laid out otherwise (the sharded update's slice of a
        # replicated weight): relaid out to the variable's (an all-gather there, else nothing).
        target.assign(dtensor.relayout(tf.cast(value, target.dtype), layout))
        return None
    if not isinstance(target, dtensor.DVariable) or not tf.executing_eagerly() or \
            dtensor.is_dtensor(value):
        return _ENABLED["_direct_assign"](self, value)
    target.assign(_place(tf.cast(value, target.dtype), dtensor.fetch_layout(target)))
    return None


def _place(value, layout: dtensor.Layout):
    """A host value on the mesh in ``layout``: each of this client's devices gets its slice
    (``dtk.parallel.materialize.local_shards``), packed; no full copy on any device, no
    collective, on any client count."""
    from dtk.parallel import materialize  # pylint: disable=g-import-not-at-top
    array = np.asarray(value)
    dtype = value.dtype if isinstance(value, tf.Tensor) else tf.as_dtype(array.dtype)
    shards = [tf.constant(s, dtype=dtype) for s in materialize.local_shards(array, layout)]
    return dtensor.pack(shards, layout)


def _check_divisible(path: str, shape: tuple, layout: dtensor.Layout) -> None:
    """A dim laid out over a mesh axis must split evenly (DTensor has no uneven shards: a
    3-row kernel over ``model=2`` failed later as "Dimensions must be equal, but are 3 and 2")."""
    sizes = dict(zip(layout.mesh.dim_names, layout.mesh.shape()))
    for dim, (length, axis) in enumerate(zip(shape, layout.sharding_specs)):
        if axis in sizes and length % sizes[axis]:
            raise ValueError(
                f"variable {path!r} of shape {shape}: its dim {dim} ({length}) is laid out over "
                f"mesh axis {axis!r} of size {sizes[axis]}, which does not divide it; give that "
                f"layer a size divisible by {sizes[axis]}, or a layout that keeps dim {dim} whole "
                "(None in the LayoutMap key, 'unsharded' in a dtk table)")


def _check_one_key(distribution, path: str) -> None:
    """A weight that two ``LayoutMap`` keys match is an error (Keras takes an exact key over a
    pattern without a word, and raises only between patterns)."""
    import re  # pylint: disable=g-import-not-at-top
    layout_map = getattr(distribution, "_layout_map", None)
    if layout_map is None:
        return
    keys = [k for k in layout_map if k == path or re.fullmatch(k, path)]
    if len(keys) > 1:
        raise ValueError(
            f"variable {path!r} matches {len(keys)} LayoutMap keys {keys}: which layout it "
            "gets would depend on the keys' order; make the patterns exclusive (keys are "
            "regular expressions matched against the whole path)")


@tf.autograph.experimental.do_not_convert
def _add_slot(self, reference_variable, name=None, initializer="zeros"):
    """``Optimizer.add_variable_from_reference`` on the mesh: a slot (Adam's moments, ...)
    takes its weight's layout, plus the batch axis on the first dim it divides when the weight
    is large enough (dtk's sharded update, ``dtk.train.mesh_optimizer.update_layout``: each device keeps
    and updates 1/N of the state, and the weight is all-gathered from the updated slices; the
    numbers are the update in place's, elementwise)."""
    original = _ENABLED["add_variable_from_reference"]
    layout = getattr(reference_variable, "_dtk_layout", None)
    distribution = _distribution()
    if layout is None or distribution is None or \
            getattr(distribution, "_dtk_shard_optimizer_state", True) is False:
        return original(self, reference_variable, name=name, initializer=initializer)
    from dtk.train import mesh_optimizer  # pylint: disable=g-import-not-at-top
    state = _mesh_state(distribution)
    with tf.init_scope():
        target = mesh_optimizer.update_layout(reference_variable._value, state.mesh, state.batch_axis)  # pylint: disable=protected-access
    kept = reference_variable._layout  # pylint: disable=protected-access
    reference_variable._layout = target  # pylint: disable=protected-access
    try:
        return original(self, reference_variable, name=name, initializer=initializer)
    finally:
        reference_variable._layout = kept  # pylint: disable=protected-access


@tf.autograph.experimental.do_not_convert
def _apply(self, grads, trainable_variables=None):
    """``Optimizer.apply`` on the mesh: each gradient pinned to its weight's layout first (the
    sharded update's slices are then cut from it on each device; otherwise DTensor's layout
    propagation may push the slots' layout back into the gradient's producer)."""
    variables = trainable_variables if trainable_variables is not None else \
        self._trainable_variables  # pylint: disable=protected-access
    owner = next((getattr(v, "_dtk_distribution", None) for v in variables or ()
                  if getattr(v, "_dtk_distribution", None) is not None), None)
    if _distribution() is None and owner is not None:
        # A custom loop's optimizer made outside the model's distribution (dtk.distribute keeps
        # it on the model): its step counter and slots would be plain variables on one device
        # beside the mesh's weights, and the update silently another one. Unused, it is made
        # again from its config under the distribution, in place (as compile() does).
        if _bind_in_place(self, owner):
            with owner.scope():
                return _apply(self, grads, trainable_variables)
        raise ValueError(
            f"optimizer {type(self).__name__} applies gradients to weights laid out on a mesh, "
            "outside any keras.distribution distribution (a custom training loop on a "
            "dtk.distribute Keras 3 model, whose distribution stays with the model), and it has "
            "taken steps or built its state off the mesh already: make a new one (dtk binds an "
            "unused optimizer to the model's mesh at its first apply), or set the "
            "distribution as keras.io's distribution guide does "
            "(keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map="
            "dtk.layout_map(mesh, table)))), then build the model and make the optimizer and "
            "metrics; or train with model.fit, which runs under the model's distribution")
    if _distribution() is not None and not tf.executing_eagerly():
        grads = [g if g is None or getattr(v, "_dtk_layout", None) is None or
                 isinstance(g, tf.IndexedSlices)
                 else dtensor.relayout(g, v._dtk_layout)  # pylint: disable=protected-access
                 for g, v in zip(grads, variables)]
    return _ENABLED["apply"](self, grads, trainable_variables)


def _bind_in_place(optimizer, distribution) -> bool:
    """An unused optimizer made again from its config under ``distribution``, in place: True;
    False when it has state already (built, or a step taken)."""
    with tf.init_scope():
        if optimizer.built or int(optimizer.iterations.numpy()):
            return False
        with distribution.scope():
            fresh = type(optimizer).from_config(optimizer.get_config())
    vars(optimizer).clear()
    vars(optimizer).update(vars(fresh))
    return True


def _value_on_mesh(self):
    """``Variable.value``: a plain variable read in a trace where a laid-out model runs (a
    custom loop's metric made before the distribution) first moves onto that mesh, replicated,
    with its value, so that it counts each example once (it counted one device's shard)."""
    value = self._value  # pylint: disable=protected-access
    if value is not None and not isinstance(value, dtensor.DVariable) and \
            isinstance(value, tf.Variable) and not tf.executing_eagerly():
        from dtk.train import custom_loops  # pylint: disable=g-import-not-at-top
        mesh = custom_loops.graph_mesh()
        if mesh is not None:
            with tf.init_scope():
                held = value.read_value()
                layout = dtensor.Layout.replicated(mesh, held.shape.rank)
                self._dtk_layout = layout  # pylint: disable=protected-access
                self._value = dtensor.DVariable(  # pylint: disable=protected-access
                    dtensor.copy_to_mesh(held, layout), trainable=value.trainable,
                    name=self.name, aggregation=value.aggregation,
                    synchronization=value.synchronization)
    return _ENABLED["value"](self)


@tf.autograph.experimental.do_not_convert
def _sparse_assign(self, name: str, variable, value):
    """The optimizer's ``assign``/``assign_add``/``assign_sub`` of an ``IndexedSlices`` (an
    Embedding's sparse gradient and what Keras computes from it) into a variable on the mesh.

    Keras scatters it (``ResourceScatterAdd``/``Sub``/``Update``), which DTensor cannot lay
    out. The same values, dense: the slices summed into rows (a scatter-add adds duplicate
    rows too), added or subtracted; an update replaces the rows it names."""
    original = _ENABLED[f"optimizer.{name}"]
    target = variable.value if hasattr(variable, "_dtk_layout") else variable
    if not isinstance(value, tf.IndexedSlices) or not isinstance(target, dtensor.DVariable):
        return original(self, variable, value)
    value = tf.IndexedSlices(tf.cast(value.values, target.dtype), value.indices,
                             value.dense_shape)
    dense = tf.convert_to_tensor(value)
    if name == "assign_add":
        target.assign_add(dense)
    elif name == "assign_sub":
        target.assign_sub(dense)
    else:
        rows = tf.math.unsorted_segment_max(tf.ones_like(value.indices, tf.float32),
                                            value.indices, tf.shape(dense)[0]) > 0
        rows = tf.reshape(rows, [-1] + [1] * (dense.shape.rank - 1))
        target.assign(tf.where(rows, dense, target.read_value()))
    return None


def distribute_variable(value, layout):
    """A ``DVariable`` of ``value`` in ``layout`` (a ``TensorLayout`` or ``dtensor.Layout``)."""
    return dtensor.DVariable(distribute_tensor(value, layout))


@tf.autograph.experimental.do_not_convert
def distribute_tensor(tensor, layout):
    """``tensor`` in ``layout``: relaid out when it is on the mesh, copied there when not."""
    layout = _backend_layout(layout)
    if layout is None:
        return tensor
    tensor = tf.convert_to_tensor(tensor)
    if not dtensor.is_dtensor(tensor):
        tensor = dtensor.copy_to_mesh(tensor, dtensor.Layout.replicated(layout.mesh,
                                                                        tensor.shape.rank))
    return dtensor.relayout(tensor, layout)


def distribute_data_input(per_process_batch, layout, batch_dim_name):
    """A batch of this process's rows laid out over ``batch_dim_name`` (``layout``'s mesh)."""
    del layout, batch_dim_name
    distribution = _distribution()
    return _mesh_state(distribution).pack(per_process_batch, local=_per_process(distribution))


# -- random draws ---------------------------------------------------------------------------------
_IN_STEP: list[bool] = []  # non-empty while dtk traces a model's step on the mesh


@tf.autograph.experimental.do_not_convert
def _draw(name: str, *args, **kwargs):
    """Keras's ``keras.random`` draws (``uniform``, ``normal``, ``truncated_normal``,
    ``dropout``) inside a step on the mesh, mesh-invariant.

    Keras draws with stateless TF ops seeded by a ``SeedGenerator`` (whose state, a replicated
    variable, advances the same way on every mesh). DTensor runs such an op once per device
    with a per-device seed, so the values would depend on the mesh. Here the values come from
    dtk's counter-based hash of (the drawn seed, the element's global index)
    (``dtk.parallel.randomness``), each device hashing only its own shard: the same numbers on
    every mesh and client count. They are not the numbers TensorFlow's kernels draw on one
    device (as with dtk's tf_keras path). The same holds in a user's own ``tf.function`` while a
    distribution is set (a custom training loop); eagerly, Keras's own draw runs.
    """
    original = _ENABLED[f"random.{name}"]
    if not _on_mesh_now():
        return original(*args, **kwargs)
    shape = args[0] if args and name != "dropout" else kwargs.get("shape")
    if name != "dropout" and not _static(shape):  # (a symbolic build's shape inference)
        return original(*args, **kwargs)
    from dtk.parallel import randomness  # pylint: disable=g-import-not-at-top
    from keras.src.random.seed_generator import draw_seed  # pylint: disable=g-import-not-at-top
    from keras.src.backend.config import floatx  # pylint: disable=g-import-not-at-top
    if name == "dropout":
        inputs, rate = args[0], args[1] if len(args) > 1 else kwargs["rate"]
        noise_shape = args[2] if len(args) > 2 else kwargs.get("noise_shape")
        seed = args[3] if len(args) > 3 else kwargs.get("seed")
        if rate == 0.0 or rate == 1.0:
            return original(inputs, rate, noise_shape=noise_shape, seed=seed)
        key = _seed_key(draw_seed(seed))
        shape = [int(d) if d is not None else inputs.shape[i]
                 for i, d in enumerate(noise_shape)] if noise_shape is not None else \
            inputs.shape.as_list()
        like = inputs if noise_shape is None else None
        u = randomness.uniform(shape, 0x4B3A5E11, key, like=like)
        keep = tf.cast(u >= rate, inputs.dtype)
        return inputs * keep / tf.cast(1.0 - rate, inputs.dtype)
    shape = args[0] if args else kwargs["shape"]
    dtype = kwargs.get("dtype") or floatx()
    seed = kwargs.get("seed")
    shape = [int(d) for d in (shape.as_list() if hasattr(shape, "as_list") else shape)]
    key = _seed_key(draw_seed(seed))
    if name == "uniform":
        low, high = kwargs.get("minval", 0.0), kwargs.get("maxval", 1.0)
        if len(args) > 1:
            low = args[1]
        if len(args) > 2:
            high = args[2]
        u = randomness.uniform(shape, 0x2C1B3C6D, key, dtype=tf.float32)
        return tf.cast(low + (high - low) * u, dtype)
    mean, stddev = kwargs.get("mean", 0.0), kwargs.get("stddev", 1.0)
    if len(args) > 1:
        mean = args[1]
    if len(args) > 2:
        stddev = args[2]
    z = randomness.normal(shape, 0x297A2D39, key,
                          truncate=2.0 if name == "truncated_normal" else None)
    return tf.cast(mean + stddev * z, dtype)


def _on_mesh_now() -> bool:
    """Inside a step dtk traces on the mesh, or a user's own ``tf.function`` while a
    distribution is set (a custom training loop): where DTensor runs the ops."""
    return bool(_IN_STEP) or (not tf.executing_eagerly() and _distribution() is not None)


def _static(shape) -> bool:
    dims = shape.as_list() if hasattr(shape, "as_list") else shape
    try:
        return all(isinstance(d, (int, np.integer)) for d in dims)
    except TypeError:
        return False


@tf.autograph.experimental.do_not_convert
def _flip(x, axis=None):
    """``keras.ops.flip`` (``RandomFlip``) on the mesh: DTensor cannot lay out ``ReverseV2``;
    a gather of the reversed indices along each axis is the same values."""
    original = _ENABLED["numpy.flip"]
    if not _on_mesh_now():
        return original(x, axis=axis)
    x = tf.convert_to_tensor(x)
    rank = x.shape.rank
    axes = range(rank) if axis is None else [
        a % rank for a in (axis if isinstance(axis, (list, tuple)) else [axis])]
    for a in axes:
        if x.shape[a] is None:
            return original(x, axis=axis)
        x = tf.gather(x, tf.range(x.shape[a] - 1, -1, -1), axis=a)
    return x


def _seed_key(seed) -> tf.Tensor:
    """One uint32 from Keras's two-element seed tensor."""
    seed = tf.cast(seed, tf.int64)
    low = tf.cast(tf.bitwise.bitwise_and(seed[0], 0xFFFFFFFF), tf.uint32)
    high = tf.cast(tf.bitwise.bitwise_and(seed[1], 0xFFFFFFFF), tf.uint32)
    return tf.bitwise.bitwise_xor(low * tf.constant(0x9E3779B1, tf.uint32), high)


# -- batches and steps ----------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _state_for(mesh: dtensor.Mesh, batch_axis: str):
    from dtk.train import mesh_calls  # pylint: disable=g-import-not-at-top
    return mesh_calls.MeshState(mesh, batch_axis)


def _mesh_state(distribution):
    mesh = distribution.device_mesh.backend_mesh
    axis = distribution.batch_dim_name or mesh.dim_names[0]
    return _state_for(mesh, axis)


def _on_mesh(model) -> bool:
    """Whether ``model``'s variables are DTensors (built under a distribution); for a model
    with no variables yet (a subclassed model built by its first batch), whether a
    distribution is set or the model has its own (``dtk.distribute``)."""
    for variable in model.variables:
        value = getattr(variable, "_value", None)
        if value is not None:
            return isinstance(value, dtensor.DVariable)
    return _distribution() is not None or getattr(model, "_dtk_distribution", None) is not None


@contextlib.contextmanager
def _scope_of(model):
    """The model's own distribution (``dtk.distribute`` of a Keras 3 factory keeps it on the
    model, not global), in force while Keras works on the model: its optimizer's slots and a
    subclassed model's weights, made inside the first step, are laid out by it."""
    distribution = getattr(model, "_dtk_distribution", None)
    if distribution is None or _distribution() is distribution:
        yield
        return
    with distribution.scope():
        yield


@tf.autograph.experimental.do_not_convert
def _compile(self, optimizer="rmsprop", *args, **kwargs):
    """``Model.compile`` of a model on the mesh: an optimizer made before the distribution was
    in force (its ``iterations`` a plain variable on one device, which a step on the mesh
    cannot take) and not yet used is made again, from its config, under the distribution."""
    if not _on_mesh(self):
        return _ENABLED["compile"](self, optimizer, *args, **kwargs)
    keras = _ENABLED["keras"]
    with _scope_of(self):
        if isinstance(optimizer, keras.optimizers.Optimizer) and not optimizer.built and any(
                not isinstance(getattr(v, "_value", None), dtensor.DVariable)
                for v in optimizer.variables):
            optimizer = type(optimizer).from_config(optimizer.get_config())
        return _ENABLED["compile"](self, optimizer, *args, **kwargs)


@tf.autograph.experimental.do_not_convert
def _model_call(self, *args, **kwargs):
    """``model(x)`` eagerly on host data (numpy, tensors) while a distribution is set: the
    inputs are laid out over the batch axis first, as ``fit`` lays out its batches."""
    distribution = _distribution()
    if distribution is None or not tf.executing_eagerly() or not args:
        return _ENABLED["Model.__call__"](self, *args, **kwargs)
    leaves = tf.nest.flatten(args[0])
    if not leaves or not all(isinstance(t, (np.ndarray, tf.Tensor)) and not (
            isinstance(t, tf.Tensor) and dtensor.is_dtensor(t)) for t in leaves):
        return _ENABLED["Model.__call__"](self, *args, **kwargs)
    packed = _mesh_state(distribution).pack(args[0], local=_per_process(distribution))
    return _ENABLED["Model.__call__"](self, packed, *args[1:], **kwargs)


@tf.autograph.experimental.do_not_convert
def _model_call_scoped(self, *args, **kwargs):
    if not tf.executing_eagerly() and _on_mesh(self):
        distribution = getattr(self, "_dtk_distribution", None) or _distribution()
        if distribution is not None:  # for the plain metrics of a custom loop (_value_on_mesh)
            from dtk.train import custom_loops  # pylint: disable=g-import-not-at-top
            custom_loops.mark_graph(_mesh_state(distribution).mesh, constants=False)
    with _scope_of(self):
        return _model_call(self, *args, **kwargs)


def _check_plain_model(model) -> None:
    """A model of plain variables trained while a distribution is set: built before it."""
    if _distribution() is not None and model.variables:
        raise ValueError(
            f"model {model.name!r} was built before keras.distribution.set_distribution(...) "
            "(its variables are plain, on one device), but a distribution is set now: build "
            "the model after setting the distribution (or inside distribution.scope())")


def _model_distribution(model):
    distribution = getattr(model, "_dtk_distribution", None)
    if distribution is None:
        distribution = _distribution()
        if distribution is None:
            raise ValueError(
                f"model {model.name!r} holds DTensor variables (it was built under a "
                "keras.distribution distribution) but no distribution is set now; train it "
                "inside the same distribution (keras.distribution.set_distribution(...) or "
                "its scope())")
        model._dtk_distribution = distribution  # pylint: disable=protected-access
    return distribution


def batches_on_mesh(data: Any, on: Any = None):
    """The batches of ``data`` (a batched ``tf.data.Dataset`` or any iterable of batches) laid
    out over a mesh's batch axis, for a custom training loop.

    A ``tf.function`` on the mesh takes DTensors only; keras.io's "Writing a training loop from
    scratch" runs as written with one change, ``for x, y in dtk.batches_on_mesh(dataset,
    model)``. Each batch is split over the batch axis by dtk's packer (a last partial batch is
    replicated: the same numbers).

    Args:
      data: the batches.
      on: a ``dtk.distribute`` model (tf_keras or Keras 3) or a mesh (batch axis ``"batch"``);
        None: the active Keras 3 distribution. With several processes and Keras 3's
        ``auto_shard_dataset``, pass the dataset through ``distribution.distribute_dataset``
        first, as Keras's ``fit`` does.

    Raises:
      ValueError: no ``on`` and no distribution set; ``on`` neither a laid-out model nor a mesh.
    """
    local = False
    if on is None:
        distribution = _distribution()
        if distribution is None:
            raise ValueError(
                "dtk.batches_on_mesh(data): no mesh to lay the batches out on: pass the "
                "dtk.distribute model (dtk.batches_on_mesh(data, model)) or a mesh, or set a "
                "keras.distribution distribution first")
        state = _mesh_state(distribution)
        local = _per_process(distribution)
    elif getattr(on, "_dtk_mesh_state", None) is not None:  # dtk.distribute, tf_keras
        state = on._dtk_mesh_state  # pylint: disable=protected-access
    elif getattr(on, "_dtk_distribution", None) is not None:  # dtk.distribute, Keras 3
        distribution = on._dtk_distribution  # pylint: disable=protected-access
        state, local = _mesh_state(distribution), _per_process(distribution)
    elif isinstance(on, dtensor.Mesh):
        from dtk.parallel.mesh import BATCH_AXIS, check_batch_axis  # pylint: disable=g-import-not-at-top
        check_batch_axis(on, BATCH_AXIS, what="dtk.batches_on_mesh(data, mesh)")
        state = _state_for(on, BATCH_AXIS)
    else:
        raise ValueError(
            f"dtk.batches_on_mesh(data, on={type(on).__name__}): on must be a model made by "
            "dtk.distribute or a dtensor.Mesh (dtk.build_mesh)")
    return (state.pack(batch, local=local) for batch in data)  # (the checks above: now)


def _per_process(distribution) -> bool:
    """Whether each process's batches hold only its own rows: Keras shards a ``tf.data``
    dataset over the processes (``auto_shard_dataset``, multi-process), in the order of the
    clients' devices on the batch axis; otherwise every process reads the global batch and
    packs its own devices' rows from it."""
    return bool(getattr(distribution, "_is_multi_process", False) and
                getattr(distribution, "auto_shard_dataset", False))


def _check_jit(model) -> None:
    if model.jit_compile is True and not getattr(model, "_dtk_jit_said", False):
        model._dtk_jit_said = True  # pylint: disable=protected-access
        _log.warning(
            "model %r: jit_compile=True on a mesh: the step is compiled by DTensor's SPMD "
            "expansion, without XLA (measured on CPU: the same losses, no speed-up); it runs as "
            "one traced function per batch shape", model.name)


def _checked(name: str, position: int):
    """Keras's ``fit``/``evaluate``/``predict`` with dtk's checks first, for a model on the mesh
    (a ``batch_size`` the batch axis cannot divide, ...: ``dtk.distribute``'s, written once)."""
    method = _ENABLED[name]

    @functools.wraps(method)
    def checked(self, *args, **kwargs):
        if _on_mesh(self):
            state = _mesh_state(_model_distribution(self))
            size = kwargs.get("batch_size", args[position - 1] if len(args) >= position
                              else None)
            # (batch_size is Keras's third parameter of fit/evaluate, its second of predict)
            y = kwargs.get("y", args[1] if len(args) > 1 and name != "predict" else None)
            state.check_call(name, size, kwargs.get("callbacks"), y=y,
                             class_weight=kwargs.get("class_weight"),
                             validation_split=kwargs.get("validation_split"), keras2=False)
        with _scope_of(self):
            return method(self, *args, **kwargs)

    return checked


def _check_layout_map(model, distribution) -> None:
    """Every key of a ``ModelParallel``'s ``LayoutMap`` lays out something of ``model``: a key
    that matches no variable path and no layer output is an error (Keras ignores it, and the
    weight it was meant for stays replicated)."""
    import re  # pylint: disable=g-import-not-at-top
    layout_map = getattr(distribution, "_layout_map", None)
    if layout_map is None or getattr(model, "_dtk_layout_map_checked", False) or \
            not model.variables:  # (a subclassed model: checked once its first batch built it)
        return
    for layer in model._flatten_layers():  # pylint: disable=protected-access
        kernel = getattr(layer, "kernel", None) if "Conv" in type(layer).__name__ else None
        layout = getattr(kernel, "_dtk_layout", None)
        if layout is not None and any(s != dtensor.UNSHARDED for s in layout.sharding_specs):
            raise ValueError(
                f"layer {layer.name!r} ({type(layer).__name__}): its kernel {kernel.path} is "
                f"laid out {list(layout.sharding_specs)}, but DTensor's convolution takes a "
                "replicated filter (it fails with 'Filter for convolution must have fully "
                "replicated layout'); remove its LayoutMap key and split the dense layers "
                "instead")
    paths = [v.path for v in model.variables]
    paths += [f"{layer.path}/output" for layer in model._flatten_layers()  # pylint: disable=protected-access
              if getattr(layer, "path", None)]
    unused = [key for key in layout_map
              if not any(key == p or re.fullmatch(key, p) for p in paths)]
    if getattr(layout_map, "_dtk_table", None) is not None:
        _check_table(model, distribution, layout_map, unused)
    elif unused:
        raise ValueError(
            f"LayoutMap key(s) {unused} match no variable or layer output of model "
            f"{model.name!r}, so they lay out nothing (its variable paths: "
            f"{', '.join(paths[:6])}{' ...' if len(paths) > 6 else ''}); fix the pattern (keys "
            "are regular expressions matched against the whole path, which starts with the "
            "model's name in a Sequential or nested model: '(.*/)?d1/kernel' matches d1's "
            "kernel anywhere) or remove the key")
    model._dtk_layout_map_checked = True  # pylint: disable=protected-access


def _check_table(model, distribution, layout_map, unused) -> None:
    """The checks of a ``dtk.layout_map`` (a dtk table), once the model's weights exist: every
    rule lays out a weight, every weight has a rule where the table's default is ``error``,
    and every non-batch mesh axis shards something unless the table replicates over it."""
    import re  # pylint: disable=g-import-not-at-top
    table, rules = layout_map._dtk_table, layout_map._dtk_rules  # pylint: disable=protected-access
    paths = [w.path for w in model.weights]
    shown = f"{', '.join(paths[:6])}{' ...' if len(paths) > 6 else ''}"
    if unused:
        patterns = [rules[key].pattern for key in unused]
        listed = ", ".join(patterns[:4]) + (f", ... ({len(patterns)} of the table's "
                                            f"{len(rules)} rules)" if len(patterns) > 4 else "")
        raise ValueError(
            f"layout table {table.name!r}: rule(s) {listed} match no weight of Keras 3 model "
            f"{model.name!r} (its weight paths: {shown}). A table names weights by layer name "
            "and attribute, as dtk's tf_keras models have them (d1.kernel, "
            "block0_attn._query_dense.kernel), matched against Keras 3's paths with '/' for "
            "'.'; name the model's layers as the table expects, or write a table (or a "
            "keras.distribution.LayoutMap) for this model's paths")
    if table.default == "error":
        bare = [p for p in paths if not any(re.fullmatch(key, p) for key in rules)]
        if bare:
            raise ValueError(
                f"layout table {table.name!r} has default = 'error', and no rule lays out "
                f"weight(s) {bare[:6]}{' ...' if len(bare) > 6 else ''} of Keras 3 model "
                f"{model.name!r}: add rules for them (dims 'unsharded' to replicate)")
    mesh = distribution.device_mesh
    sharding = {axis for w in model.weights
                for axis in getattr(getattr(w, "_dtk_layout", None), "sharding_specs", ())
                if axis != dtensor.UNSHARDED}
    for axis, size in zip(mesh.axis_names, mesh.shape):
        if size > 1 and axis != distribution.batch_dim_name and axis not in sharding and \
                axis not in layout_map._dtk_replicated:  # pylint: disable=protected-access
            raise ValueError(
                f"layout table {table.name!r} shards no weight of Keras 3 model {model.name!r} "
                f"over mesh axis {axis!r} (size {size}): its {size} devices would repeat the "
                "same work. Use a table with rules for this model's layers, or a mesh without "
                f"axis {axis!r}")


def _make_function(self, step_function):
    """``TensorFlowTrainer._make_function`` for a model on the mesh: Keras's step, traced."""
    if not _on_mesh(self):
        _check_plain_model(self)
        return _ENABLED["_make_function"](self, step_function)
    distribution = _model_distribution(self)
    state = _mesh_state(distribution)
    _check_jit(self)
    _check_layout_map(self, distribution)
    from dtk.parallel import ops  # pylint: disable=g-import-not-at-top

    def step(data):
        _IN_STEP.append(True)
        try:
            with ops.during_steps():  # tf.math.top_k, tf.one_hot, ...: dtk's equivalents
                return step_function(data)
        finally:
            _IN_STEP.pop()

    # One trace per batch shape (two at most: a last partial batch), never a relaxed one of an
    # unknown size: the mesh-invariant draws index every element of the batch. Several steps
    # per call (compile(steps_per_execution=n)) run as one compiled loop over n stacked batches.
    from dtk.train import mesh_calls  # pylint: disable=g-import-not-at-top
    calls = mesh_calls.MeshCalls(step, state, reduce_retracing=False,
                                 local=_per_process(distribution))

    def function(iterator):
        with _scope_of(self):
            outputs = calls(mesh_calls.next_batches(iterator, int(self.steps_per_execution)))
            _check_layout_map(self, distribution)  # (a subclassed model has variables now)
        return outputs

    return function


def _make_predict_function(self, force: bool = False):
    """``make_predict_function`` for a model on the mesh: Keras hands it a list of batches;
    the outputs come back replicated (Keras concatenates them on the host)."""
    if not _on_mesh(self):
        _check_plain_model(self)
        return _ENABLED["make_predict_function"](self, force)
    if self.predict_function is not None and not force:
        return self.predict_function
    distribution = _model_distribution(self)
    state = _mesh_state(distribution)
    _check_jit(self)

    from dtk.parallel import ops  # pylint: disable=g-import-not-at-top

    def step(data):
        _IN_STEP.append(True)
        try:
            with ops.during_steps():
                outputs = self.predict_step(data)
        finally:
            _IN_STEP.pop()
        return tf.nest.map_structure(
            lambda t: dtensor.relayout(t, dtensor.Layout.replicated(state.mesh, t.shape.rank))
            if isinstance(t, tf.Tensor) else t, outputs)

    traced = tf.function(step, reduce_retracing=True)

    local = _per_process(distribution)

    def function(datas):
        outputs = None
        for data in datas:
            with dtensor.default_mesh(state.mesh), _scope_of(self):
                step_outputs = traced(state.pack(data, local=local))
            step_outputs = tf.nest.map_structure(
                lambda t: dtensor.unpack(t)[0] if isinstance(t, tf.Tensor) and
                dtensor.is_dtensor(t) else t, step_outputs)
            outputs = step_outputs if outputs is None else tf.nest.map_structure(
                lambda a, b: tf.concat([a, b], axis=0), outputs, step_outputs)
        return outputs

    self.predict_function = function
    return function
