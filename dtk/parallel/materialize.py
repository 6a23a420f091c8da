"""Initial weights without a full copy: each client materializes only its own shards.

``build_model`` needs two things from a model before any DTensor variable exists: the path and
shape of every weight (to plan and validate the layouts) and the initial values a plain
single-device build would draw (so every mesh starts from the same weights). Building the plain
model for that held the whole model on every client, plus a numpy copy, while the laid-out
model was built: a model larger than one host could not be built on any number of hosts.

dtk instead builds the reference model with tf_keras' lazy variables (shapes, no storage), then
draws the initial values one weight at a time, in the order the plain build would (the order the
variables were created, after the same ``set_random_seed``), so each value equals the plain
build's exactly. Each value is sliced on the host, and only this client's shards go to its
devices (``dtensor.pack``); the full value is dropped before the next weight is drawn. At most
one full weight is on a host at a time.

A factory that needs real values while it builds (``Normalization.adapt()`` on data, a subclassed
model whose symbolic build fails with lazy variables) falls back to a plain build, with one info
line naming why.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor


def lazy_model(model_factory: Callable[[], tf_keras.Model], input_shape: Sequence[int] | None,
               dtype: str) -> tf_keras.Model:
    """``model_factory()`` built with lazy variables: paths and shapes, no storage.

    Raises:
      Exception: whatever the factory raises when it needs real values (the caller falls back).
    """
    from tf_keras.src.dtensor import lazy_variable  # pylint: disable=g-import-not-at-top
    with lazy_variable.lazy_init_scope():
        model = model_factory()
        if not model.built and input_shape is not None:
            model(tf_keras.Input(tuple(int(d) for d in input_shape), dtype=dtype))
    return model


def creation_order(weights: Sequence[tuple[str, tf.Variable]]) -> list[tuple[str, tf.Variable]]:
    """Lazy weights in the order they were created, which is the order a plain build draws
    their initial values in (a lazy variable's unique id ends with a global counter)."""
    def created(item):
        variable = getattr(item[1], "_variable", item[1])
        return int(variable._unique_id.rsplit("_", 1)[1])  # pylint: disable=protected-access
    return sorted(weights, key=created)


def initial_value(variable: tf.Variable) -> np.ndarray:
    """Draws a lazy variable's initial value (its initializer, called as a plain build would)."""
    variable = getattr(variable, "_variable", variable)
    value = variable._initial_value  # pylint: disable=protected-access
    if callable(value):
        value = value()
    return np.asarray(value.numpy() if hasattr(value, "numpy") else value)


def local_shards(value: np.ndarray, layout: dtensor.Layout) -> list[np.ndarray]:
    """The slices of a global value that this client's devices hold under ``layout``, in the
    order ``dtensor.pack`` takes them (the mesh's local devices)."""
    mesh = layout.mesh
    shards = []
    for location in mesh.local_device_locations():
        index = []
        for dim, axis in enumerate(layout.sharding_specs):
            if axis == dtensor.UNSHARDED:
                index.append(slice(None))
                continue
            size = value.shape[dim] // mesh.dim_size(axis)
            start = location[axis] * size
            index.append(slice(start, start + size))
        shards.append(value[tuple(index)])
    return shards


def assign_global(variable: tf.Variable, value: Callable[[], np.ndarray]) -> None:
    """Assigns a global value (made by ``value()``) to a (possibly sharded, possibly autocast)
    DTensor variable, sending each of this client's devices only its own shard.

    The full value is dropped as soon as this client's shards are cut from it, before they go
    to the devices: a weight's peak on the host is the weight plus this client's shards.
    """
    target = getattr(variable, "_variable", variable)
    layout = dtensor.fetch_layout(target)
    full = np.asarray(value(), dtype=target.dtype.base_dtype.as_numpy_dtype)
    freed = full.nbytes
    shards = [tf.constant(s) for s in local_shards(full, layout)]
    del full
    target.assign(dtensor.pack(shards, layout))
    del shards
    release_free_memory(freed)


# malloc_trim walks the whole heap (13 ms a call after a DenseNet121 build): trimming after every
# weight cost 8 s of its 25 s build. glibc keeps at most 32 MiB of freed blocks before it gives
# memory back by itself, so trimming once that much has been freed bounds what stays resident
# the same way.
_TRIM_EVERY_BYTES = 32 << 20
_freed_bytes = 0


def release_free_memory(freed: int | None = None) -> None:
    """Gives memory freed on the heap back to the system (glibc's ``malloc_trim``).

    With ``freed`` (bytes just freed), only once ``_TRIM_EVERY_BYTES`` have been freed since the
    last trim; without it, now.

    glibc keeps freed blocks of up to 32 MiB for reuse after it has seen one freed, so the
    placeholders, full values and shards of a build stay resident: 458 MiB after building a
    194 MiB LM on 8 devices of one host, against 273 MiB with the memory given back. Elsewhere
    than on glibc this does nothing.
    """
    global _TRIM, _freed_bytes  # pylint: disable=global-statement
    if freed is not None:
        _freed_bytes += freed
        if _freed_bytes < _TRIM_EVERY_BYTES:
            return
    _freed_bytes = 0
    if _TRIM is None:
        try:
            import ctypes  # pylint: disable=g-import-not-at-top
            _TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM = None


@contextlib.contextmanager
def placeholder_values(paths: Sequence[str]) -> Iterator[None]:
    """While tf_keras lays out a model: the weights named in ``paths`` start as zeros.

    Their initial values are assigned afterwards (``assign_global``), so running their
    initializers would be wasted, and it is not cheap: tf_keras runs each one replicated (a full
    copy on every local device) and then relayouts it, 230 MiB of peak for a 98 MiB LM on
    ``model=8``. Zeros made under the layout allocate only each device's shard. Other variables the build creates
    (a random generator's state) keep their initializers.
    """
    from tf_keras.src.dtensor import layout_map as keras_layout_map  # pylint: disable=g-import-not-at-top
    original = keras_layout_map._create_dvariable  # pylint: disable=protected-access
    wanted = set(paths)

    def create(layout_map, object_path, variable):
        layout = layout_map[object_path] if object_path in wanted else None
        if layout is None:
            return original(layout_map, object_path, variable)
        # tf_keras would run the initializer replicated (a full copy on every device), then
        # relayout; zeros made under the layout exist only as each device's shard.
        value = dtensor.call_with_layout(tf.zeros, layout, shape=variable.shape,
                                         dtype=variable.dtype)
        name = variable.name[:-2] if variable.name.endswith(":0") else variable.name
        return dtensor.DVariable(value, trainable=variable.trainable, name=name)

    keras_layout_map._create_dvariable = create  # pylint: disable=protected-access
    try:
        yield
    finally:
        keras_layout_map._create_dvariable = original  # pylint: disable=protected-access
