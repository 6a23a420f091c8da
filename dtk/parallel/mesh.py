"""Meshes: from a spec such as ``"batch=4,model=2"`` to a ``tf.experimental.dtensor.Mesh``.

A mesh is a named, ordered grid of devices. Axis order is the order the user wrote: ``batch=4,model=2``
puts device ids ``[[0, 1], [2, 3], [4, 5], [6, 7]]`` on ``(batch, model)``, so devices 0 and 1 hold
the same batch shard and different model shards.

Everything that can be checked is checked here, before DTensor sees it, because DTensor reports bad
meshes as low-level errors (or hangs, in multi-client runs). Single-client and multi-client runs use
the same call: when ``DTENSOR_JOBS`` is set, the mesh spans every client and each client owns its
local devices (``dtensor.create_distributed_mesh``).

Example::

    mesh = dtk.build_mesh("batch=4,model=2", device_type="cpu", virtual_devices=8)
    print(dtk.describe_mesh(mesh))
    # mesh batch=4,model=2: 8 CPU devices, 1 client, 8 local devices (CPU:0-7)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any, Union

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor
from tensorflow.python.eager import context as _context

from dtk import _env
from dtk.cluster import env as cluster
from dtk.cluster.env import client_id, is_multi_client, num_clients

BATCH_AXIS = "batch"
MODEL_AXIS = "model"
FLEXIBLE = -1  # the size of the one mesh axis that takes the devices that exist
DEVICE_TYPES = ("auto", "cpu", "gpu", "tpu")

_AXIS_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

MeshSpecLike = Union[str, Mapping[str, int], "MeshSpec"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshSpec:
    """An ordered list of (axis name, axis size) pairs, validated.

    Attributes:
      axes: ``(("batch", 4), ("model", 2))`` for ``"batch=4,model=2"``.
    """

    axes: tuple[tuple[str, int], ...]

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.axes)

    @property
    def flexible_axis(self) -> str | None:
        """The axis written with size -1 (it takes the devices that exist), or None."""
        return next((name for name, size in self.axes if size == FLEXIBLE), None)

    @property
    def num_devices(self) -> int:
        """Devices the mesh spans; for a flexible spec, the fewest it can span (its fixed axes)."""
        n = 1
        for size in self.shape:
            n *= 1 if size == FLEXIBLE else size
        return n

    def resolve(self, devices: int) -> MeshSpec:
        """The spec with its flexible axis (size -1) sized to span ``devices``; a fixed spec as is.

        Raises:
          ValueError: ``devices`` is not a multiple of the fixed axes' product.
        """
        axis = self.flexible_axis
        if axis is None:
            return self
        fixed = self.num_devices
        if devices < fixed or devices % fixed:
            raise ValueError(
                f"mesh {self}: {devices} device(s) exist, which the fixed axes "
                f"({fixed} devices) do not divide, so axis {axis!r} has no size; use a device "
                f"count that is a multiple of {fixed}, or give {axis!r} a size")
        return MeshSpec(axes=tuple((name, devices // fixed if size == FLEXIBLE else size)
                                   for name, size in self.axes))

    def __str__(self) -> str:
        return ",".join(f"{name}={size}" for name, size in self.axes)


def parse_mesh_spec(spec: MeshSpecLike) -> MeshSpec:
    """Parses ``"batch=4,model=2"`` or an ordered mapping into a validated ``MeshSpec``.

    Args:
      spec: a string of comma-separated ``axis=size`` items, a mapping of axis name to size (its
        order is the axis order), or a ``MeshSpec``.

    Returns:
      The ``MeshSpec``, axes in the order given. One axis may have size -1
      (``"batch=-1,model=2"``): ``build_mesh`` sizes it to span every device of the run, so the
      same command runs on 8 or on 4 devices (an elastic restart on fewer clients).

    Raises:
      ValueError: the spec is empty, an item is not ``name=size``, a name is not an identifier, a
        size is not a positive integer (or -1, on one axis), or an axis appears twice.
    """
    if isinstance(spec, MeshSpec):
        return spec
    if isinstance(spec, Mapping):
        items = [(str(k), v) for k, v in spec.items()]
        text = ",".join(f"{k}={v}" for k, v in items)
    elif isinstance(spec, str):
        text = spec.strip()
        items = []
        for raw in text.split(",") if text else []:
            item = raw.strip()
            if item.count("=") != 1:
                raise ValueError(
                    f"mesh spec {spec!r}: item {item!r} is not of the form axis=size; "
                    "write for example 'batch=8' or 'batch=4,model=2'")
            name, size = (s.strip() for s in item.split("="))
            items.append((name, size))
    else:
        raise TypeError(
            f"mesh spec must be a string like 'batch=4,model=2' or a mapping of axis name to size; "
            f"got {type(spec).__name__}: {spec!r}")
    if not items:
        raise ValueError(
            f"mesh spec {spec!r} is empty; give at least one axis, e.g. 'batch=8'")

    axes = []
    for name, size in items:
        if not _AXIS_NAME.match(name):
            raise ValueError(
                f"mesh spec {text!r}: axis name {name!r} is not a valid name; use letters, digits and "
                "'_' starting with a letter, e.g. 'batch=8'")
        if isinstance(size, bool):
            size_int = None
        elif isinstance(size, int):
            size_int = size
        else:
            try:
                size_int = int(str(size))
            except ValueError:
                size_int = None
        if size_int is None:
            raise ValueError(
                f"mesh spec {text!r}: size of axis {name!r} is {str(size)!r}, not an integer; "
                f"write e.g. '{name}=8'")
        if size_int == FLEXIBLE and any(size == FLEXIBLE for _, size in axes):
            raise ValueError(
                f"mesh spec {text!r}: more than one axis has size -1; one axis at most takes the "
                "devices that exist, e.g. 'batch=-1,model=2'")
        if size_int <= 0 and size_int != FLEXIBLE:
            raise ValueError(
                f"mesh spec {text!r}: axis {name!r} has size {size_int}; sizes must be positive "
                "integers (use 1 for an axis you do not shard over), or -1 for the one axis that "
                "takes the devices that exist")
        if name in (a for a, _ in axes):
            raise ValueError(
                f"mesh spec {text!r}: axis {name!r} appears twice; each axis name must be unique")
        axes.append((name, size_int))
    return MeshSpec(axes=tuple(axes))


def is_tensorflow_initialized() -> bool:
    """True once TensorFlow has created its devices (after that, virtual CPUs cannot be added)."""
    return bool(_context.context()._initialized)  # pylint: disable=protected-access


def configure_virtual_cpus(n: int) -> None:
    """Splits the host CPU into ``n`` logical devices, so a CPU-only machine can hold an n-device mesh.

    Must run before TensorFlow initializes its devices (before the first op or tensor). Calling it
    again with the count already in force is a no-op.

    Raises:
      ValueError: ``n`` is not positive, or TensorFlow is already initialized with another count.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise ValueError(f"virtual_devices must be a positive integer; got {n!r}")
    if is_tensorflow_initialized():
        have = local_device_count("CPU")
        if have == n:
            return
        raise ValueError(
            f"virtual_devices={n} was requested, but TensorFlow is already initialized with {have} "
            "CPU device(s) and cannot change that in this process. Build the mesh (or call "
            "dtk.configure_virtual_cpus) before any TensorFlow op runs, e.g. at the top of your "
            "script, or start a new process")
    cpu = _physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * n)


def _physical_devices(kind: str) -> list:
    """``tf.config.list_physical_devices(kind)``, its CUDA probe hidden (``_probing``)."""
    with _probing():
        return tf.config.list_physical_devices(kind)


@contextlib.contextmanager
def _probing():
    """Around what may initialize TensorFlow's platforms: the first time, on a machine with no
    NVIDIA driver (``dtk._env.no_nvidia_driver``), the CUDA probe's failure line is hidden."""
    with _env.quiet_stderr(when=_env.no_nvidia_driver() and not _PROBED):
        yield
    _PROBED.append(True)


_PROBED: list[bool] = []


def resolve_device_type(device_type: str = "auto") -> str:
    """Maps ``auto|cpu|gpu|tpu`` to DTensor's upper-case device type (auto: TPU > GPU > CPU).

    Raises:
      ValueError: unknown device type.
    """
    if not isinstance(device_type, str) or device_type.lower() not in DEVICE_TYPES:
        raise ValueError(
            f"device_type {device_type!r} is not one of {', '.join(DEVICE_TYPES)}")
    kind = device_type.lower()
    if kind == "auto":
        for candidate in ("TPU", "GPU"):
            if _physical_devices(candidate):
                return candidate
        return "CPU"
    return kind.upper()


def _initialize(device_type: str, local_needed: int, virtual_devices: int | None) -> None:
    """Configures devices (and the multi-client cluster) once per process, before TF initializes."""
    if _dtensor_initialized():
        if virtual_devices is not None and device_type == "CPU":
            configure_virtual_cpus(virtual_devices)  # no-op if equal, clear error otherwise
        return
    if is_tensorflow_initialized():
        if virtual_devices is not None and device_type == "CPU":
            configure_virtual_cpus(virtual_devices)
        if is_multi_client():
            raise ValueError(
                "a multi-client mesh (DTENSOR_JOBS is set) must be built before TensorFlow "
                "initializes its devices, and TensorFlow is already initialized in this process. "
                "Call dtk.build_mesh before any TensorFlow op runs")
        return  # single client: use the devices that exist
    if device_type == "GPU":
        _env.apply_gpu_defaults()
    num_cpus = None
    if device_type == "CPU":
        if virtual_devices is not None:
            num_cpus = virtual_devices
        else:
            have = len(tf.config.get_logical_device_configuration(
                _physical_devices("CPU")[0]) or [None])
            num_cpus = max(have, local_needed)
    if not is_multi_client():
        with _probing():
            dtensor.initialize_accelerator_system(device_type, num_logical_cpu_devices=num_cpus)
        return
    cluster.check_environment()  # a malformed DTENSOR_JOBS: one line, not TensorFlow's error
    try:
        with cluster.coordination_timeouts():
            dtensor.initialize_accelerator_system(device_type, num_logical_cpu_devices=num_cpus)
        cluster.leave_group_at_exit()
    except tf.errors.OpError as e:
        raise RuntimeError(
            f"DTensor client {client_id()} of {num_clients()} could not join the cluster "
            f"DTENSOR_JOBS={os.environ.get('DTENSOR_JOBS')}: {e.message.strip().splitlines()[0]}. "
            "A client did not start, died, or cannot be reached (port in use or blocked); "
            "every client must start within DTK_REGISTER_TIMEOUT_S seconds") from None


def _devices_per_client(kind: str, virtual_devices: int | None) -> int:
    """The devices each client has for a flexible mesh: its virtual CPUs (given, or configured
    already), else the devices TensorFlow lists."""
    if is_tensorflow_initialized():
        return local_device_count(kind)
    if kind == "CPU":  # listing logical devices would initialize TensorFlow (too early here)
        return virtual_devices or len(tf.config.get_logical_device_configuration(
            _physical_devices("CPU")[0]) or [None])
    return len(_physical_devices(kind))


def _dtensor_initialized() -> bool:
    from tensorflow.dtensor.python import accelerator_util  # pylint: disable=g-import-not-at-top
    return accelerator_util.is_initialized()


def build_mesh(spec: MeshSpecLike, *, device_type: str = "auto",
               virtual_devices: int | None = None) -> dtensor.Mesh:
    """Builds a DTensor mesh for ``spec`` on this process's (or every client's) devices.

    On CPU, virtual devices are created when ``virtual_devices`` is given, or when the mesh needs more
    CPU devices than exist and TensorFlow has not initialized yet. On GPU and TPU the accelerator
    system is initialized as DTensor requires. In a multi-client run (``DTENSOR_JOBS`` set), the
    mesh spans all clients; each client holds ``num_devices / num_clients`` local devices.

    A mesh smaller than the devices available uses the first ones; ``describe_mesh`` says so.

    Args:
      spec: ``"batch=8"``, ``"batch=4,model=2"``, an ordered mapping, or a ``MeshSpec``. One axis
        of size -1 (``"batch=-1,model=2"``) spans the devices that exist: every client's (its
        virtual CPUs on CPU) times the number of clients.
      device_type: ``auto`` (TPU > GPU > CPU), ``cpu``, ``gpu`` or ``tpu``.
      virtual_devices: on CPU, the number of logical CPU devices per client to create.

    Returns:
      The ``dtensor.Mesh``.

    Raises:
      ValueError: a bad spec or device type, a mesh larger than the devices available, a mesh not
        divisible across clients, or virtual devices requested after TensorFlow initialized.
      RuntimeError: a multi-client cluster did not form within ``DTK_REGISTER_TIMEOUT_S``.
    """
    mesh_spec = parse_mesh_spec(spec)
    kind = resolve_device_type(device_type)
    cluster.apply_scheduler_env()  # TF_CONFIG or Slurm -> DTENSOR_* when DTENSOR_JOBS is unset
    if virtual_devices is None and kind == "CPU":
        virtual_devices = _env.get_int(_env.VIRTUAL_DEVICES)  # set by launchers
    if virtual_devices is not None and kind != "CPU":
        raise ValueError(
            f"virtual_devices={virtual_devices} only applies to CPU meshes; device type is {kind}. "
            "Drop virtual_devices or use device_type='cpu'")
    clients = num_clients()
    if mesh_spec.flexible_axis is not None:
        mesh_spec = mesh_spec.resolve(clients * _devices_per_client(kind, virtual_devices))
    if mesh_spec.num_devices % clients:
        raise ValueError(
            f"mesh {mesh_spec} has {mesh_spec.num_devices} devices, which do not divide evenly over "
            f"{clients} clients (DTENSOR_JOBS); use a mesh whose size is a multiple of {clients}")
    local_needed = mesh_spec.num_devices // clients
    _initialize(kind, local_needed, virtual_devices)
    if kind == "CPU" and not _env.get_flag(_env.GRAPPLER):
        # Grappler's meta optimizer took half of DTensor's first step on CPU meshes here and
        # bought nothing after it (LM on batch=8: first step 12.8-15.0 s -> 6.3-6.6 s, steps
        # 293 -> 271-277 ms; batch=4,model=2 and the heavy MLP within 2%; BUILD.md, "DTensor
        # settings"). Left on for GPUs and TPUs (its layout optimizer matters there; unmeasured).
        tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})

    available = local_device_count(kind)
    if local_needed > available:
        where = f"per client ({clients} clients)" if clients > 1 else "in this process"
        if kind == "CPU" and _env.get_int(_env.VIRTUAL_DEVICES) is not None:
            fix = (f"{_env.VIRTUAL_DEVICES}={_env.get_int(_env.VIRTUAL_DEVICES)} is set in the "
                   f"environment (a launcher sets it per client); set it to {local_needed} or "
                   f"unset it, or use a mesh of at most {available * clients} devices")
        elif kind == "CPU":
            fix = (f"pass virtual_devices={local_needed} (--virtual_devices) before TensorFlow "
                   "initializes")
        else:
            fix = f"use a mesh of at most {available * clients} devices"
        raise ValueError(
            f"mesh {mesh_spec} needs {mesh_spec.num_devices} devices ({local_needed} {where}), but "
            f"only {available} {kind} device(s) exist {where}; {fix}")
    local_devices = [f"{kind}:{i}" for i in range(local_needed)]
    if clients > 1:
        mesh = dtensor.create_distributed_mesh(
            list(mesh_spec.axes), local_devices=local_devices, device_type=kind)
    else:
        mesh = dtensor.create_mesh(list(mesh_spec.axes), devices=local_devices, device_type=kind)
    ready = _env.get_str(_env.READY_FILE)
    if ready:  # tells python -m dtk.cluster.launch that this client joined the cluster
        with open(ready, "w") as f:
            f.write(describe_mesh(mesh))
    return mesh


def as_mesh(value: Any, argument: str = "mesh") -> dtensor.Mesh:
    """A ``dtensor.Mesh`` from what an argument that takes a mesh was given: a Mesh, a spec
    string (``"batch=8"``) or a ``MeshSpec`` (built with ``build_mesh``).

    Raises:
      TypeError: anything else (a list of meshes, a dict, None), naming the argument.
    """
    if isinstance(value, dtensor.Mesh):
        return value
    if isinstance(value, (str, MeshSpec)):
        return build_mesh(value)
    raise TypeError(f"{argument} must be a dtensor.Mesh (dtk.build_mesh(...)), a mesh spec string "
                    f"like 'batch=8', or a dtk.MeshSpec; got {type(value).__name__}: "
                    f"{str(value)[:60]!r}")


def check_batch_axis(mesh: dtensor.Mesh, batch_axis: str, *, what: str = "batch_axis") -> int:
    """The size of ``batch_axis`` on ``mesh``; the one check of the batch axis, used everywhere.

    A batch axis the mesh lacks would silently replicate the inputs (every device trains on the
    whole batch) and make the sharded update a no-op, so it is an error.

    Raises:
      ValueError: the mesh has no such axis, naming the mesh's axes and the fix.
    """
    if batch_axis not in mesh.dim_names:
        axes = ",".join(f"{n}={mesh.dim_size(n)}" for n in mesh.dim_names)
        raise ValueError(
            f"{what} {batch_axis!r} is not an axis of mesh {axes}; use one of "
            f"{list(mesh.dim_names)} (the data-parallel axis), or add a {batch_axis}=1 axis to the "
            "mesh for a run without data parallelism")
    return mesh.dim_size(batch_axis)


def batch_layout(mesh: dtensor.Mesh, rank: int, *, batch_axis: str = BATCH_AXIS) -> dtensor.Layout:
    """The layout of an input tensor: dim 0 sharded on ``batch_axis``, every other dim unsharded.

    On a ``batch=4,model=2`` mesh a ``[128, 784]`` batch puts rows 32*i..32*i+31 on both devices of
    batch row i; the two devices along ``model`` hold the same rows.

    Raises:
      ValueError: ``rank`` < 1 (a scalar has no batch dim), or a batch axis the mesh lacks.
    """
    check_batch_axis(mesh, batch_axis)
    if rank < 1:
        raise ValueError(f"an input of rank {rank} has no batch dim to shard on axis {batch_axis!r}; "
                         "inputs must be at least rank 1 ([batch, ...])")
    return dtensor.Layout.batch_sharded(mesh, batch_axis, rank)


def local_device_count(kind: str) -> int:
    """Logical ``kind`` devices of THIS client (a multi-client run also lists the others')."""
    devices = tf.config.list_logical_devices(kind)
    if not is_multi_client():
        return len(devices)
    me = client_id()
    mine = [d for d in devices
            if tf.DeviceSpec.from_string(d.name).task in (None, me)
            and tf.DeviceSpec.from_string(d.name).job in (None, cluster.JOB_NAME)]
    return len(mine)


def mesh_axis_sizes(mesh: dtensor.Mesh) -> dict[str, int]:
    """``{"batch": 4, "model": 2}`` for a mesh built from ``"batch=4,model=2"`` (ordered)."""
    return {name: mesh.dim_size(name) for name in mesh.dim_names}


def _ranges(indices: list[int]) -> str:
    """Compresses ``[0, 1, 2, 5]`` into ``"0-2,5"``."""
    parts, start, prev = [], None, None
    for i in indices + [None]:
        if start is None:
            start = prev = i
        elif i is not None and i == prev + 1:
            prev = i
        else:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = i
    return ",".join(parts)


def describe_mesh(mesh: dtensor.Mesh) -> str:
    """One line for logs: axes and sizes, device type, clients, this client's local devices.

    Example: ``mesh batch=4,model=2: 8 CPU devices, 1 client, 8 local devices (CPU:0-7)``; a mesh
    that uses fewer devices than exist adds ``; uses 4 of 8 local CPU devices``.
    """
    kind = mesh.device_type()
    axes = ",".join(f"{n}={s}" for n, s in mesh_axis_sizes(mesh).items())
    clients = num_clients()
    local = [tf.DeviceSpec.from_string(d).device_index for d in mesh.local_devices()]
    line = (f"mesh {axes}: {mesh.size} {kind} devices, {clients} client{'s' if clients > 1 else ''}"
            f", {len(local)} local devices ({kind}:{_ranges(sorted(local))})")
    if clients > 1:
        line += f", this is client {client_id()}"
    available = local_device_count(kind)
    if len(local) < available:
        line += f"; uses {len(local)} of {available} local {kind} devices"
    return line


def check_same_on_all_clients(mesh, value: float, *, what: str) -> dict[int, float]:
    """Raises if ``value`` differs between clients (e.g. a checksum of the initial weights).

    Every client must call this (it is a collective). Single-client: nothing to compare.

    Returns:
      Each client's value, by client id (all equal).

    Raises:
      ValueError: the clients disagree, with each client's value.
    """
    values = values_on_all_clients(mesh, value)
    if len(set(values.values())) > 1:
        raise ValueError(
            f"{what} differs between clients: {values}; every client must use the same seed (and "
            "the same code and data) or 'replicated' values diverge")
    return values


def values_on_all_clients(mesh, value: float) -> dict[int, float]:
    """Every client's ``value``, by client id, on every client (a collective: all must call).

    Used where clients decide something from their own measurements and must then act alike
    (e.g. ``steps_per_execution="auto"`` takes client 0's choice).
    """
    clients = num_clients()
    if clients == 1:
        return {0: value}
    # One value per device, sharded over a 1-D view of every axis; gathered to all clients.
    layout = dtensor.Layout([*mesh.dim_names], mesh)
    local = [tf.fill([1] * len(mesh.dim_names), tf.constant(value, tf.float64))
             for _ in mesh.local_devices()]
    packed = dtensor.pack(local, layout)
    full = dtensor.relayout(packed, dtensor.Layout.replicated(mesh, len(mesh.dim_names)))
    values = np.asarray(dtensor.unpack(full)[0]).ravel()
    per_client = values.reshape(clients, -1)[:, 0]
    return dict(enumerate(per_client.tolist()))
