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

A large sharded weight drawn by tf_keras' ``RandomNormal`` or ``RandomUniform`` (an Embedding's
default, and the recommender's tables) is not drawn whole: their stateless draw is counter-based
(Philox; element ``i`` comes from counter ``i // 4``), so ``write_drawn`` draws this client's
rows block by block from the same key and an offset counter, equal bit for bit to the slices of
the whole draw, and writes each block into the devices' buffers in place. A host then holds one
block, not the table: a 2^23 x 16 table on 4 clients x 2 devices drew 512 MiB on every client
before.

A factory that needs real values while it builds (``Normalization.adapt()`` on data, a subclassed
model whose symbolic build fails with lazy variables) falls back to a plain build, with one info
line naming why.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor

from dtk import keras_check


def is_built(model: tf_keras.Model) -> bool:
    """Whether ``model`` has all its weights: built, or a model that is never called itself
    whose parts are built (keras.io's GAN: a ``train_step`` over a built generator and
    discriminator, no ``call``)."""
    if model.built:
        return True
    parts = list(model._flatten_layers(include_self=False, recursive=False))  # pylint: disable=protected-access
    return bool(parts) and bool(weights_so_far(model)) and all(p.built for p in parts)


def weights_so_far(model: tf_keras.Model) -> list:
    """``model.weights``, or [] while a part of it is an unbuilt ``Sequential`` (keras.io's
    subclassed models hold ``keras.Sequential([...])`` without an input shape, whose
    ``weights`` raises "Weights for model 'sequential' have not yet been created")."""
    try:
        return model.weights
    except ValueError:
        return []


def lazy_model(model_factory: Callable[[], tf_keras.Model], input_shape: Sequence[int] | None,
               dtype: str) -> tf_keras.Model:
    """``model_factory()`` built with lazy variables: paths and shapes, no storage.

    Raises:
      Exception: whatever the factory raises when it needs real values (the caller falls back).
    """
    from tf_keras.src.dtensor import lazy_variable  # pylint: disable=g-import-not-at-top
    with lazy_variable.lazy_init_scope():
        model = keras_check.call_factory(model_factory)
        if not is_built(model) and input_shape is not None:
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


def _local_indices(shape: Sequence[int], layout: dtensor.Layout) -> list[tuple[tuple[int, int], ...]]:
    """The ``(start, stop)`` of each dim of each of this client's shards in a global value of
    ``shape``, in the order ``dtensor.pack`` takes them (the mesh's local devices)."""
    mesh = layout.mesh
    indices = []
    for location in mesh.local_device_locations():
        index = []
        for dim, axis in enumerate(layout.sharding_specs):
            if axis == dtensor.UNSHARDED:
                index.append((0, int(shape[dim])))
                continue
            size = int(shape[dim]) // mesh.dim_size(axis)
            start = location[axis] * size
            index.append((start, start + size))
        indices.append(tuple(index))
    return indices


def local_shards(value: np.ndarray, layout: dtensor.Layout) -> list[np.ndarray]:
    """The slices of a global value that this client's devices hold under ``layout``, in the
    order ``dtensor.pack`` takes them (the mesh's local devices)."""
    return [value[_slices(index)] for index in _local_indices(value.shape, layout)]


def _slices(index: tuple[tuple[int, int], ...]) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in index)


# Rows drawn at a time by ``write_drawn``; a weight no larger than this is drawn whole.
_BLOCK_BYTES = 16 << 20
_UINT64 = (1 << 64) - 1


def _block_drawable(variable: tf.Variable):
    """``(initializer, shape, dtype)`` when a lazy variable's initial value is a stateless
    tf_keras ``RandomNormal``/``RandomUniform`` draw of a float weight, else None."""
    variable = getattr(variable, "_variable", variable)
    value = getattr(variable, "_initial_value", None)
    if not isinstance(value, functools.partial) or len(value.args) != 1 or \
            set(value.keywords) - {"dtype"}:
        return None
    init = value.func
    if type(init) not in (tf_keras.initializers.RandomNormal,  # pylint: disable=unidiomatic-typecheck
                          tf_keras.initializers.RandomUniform):
        return None
    generator = getattr(init, "_random_generator", None)
    dtype = tf.as_dtype(value.keywords.get("dtype") or tf_keras.backend.floatx())
    if generator is None or generator._rng_type != generator.RNG_STATELESS or \
            not dtype.is_floating:  # pylint: disable=protected-access
        return None
    return init, tuple(int(d) for d in value.args[0]), dtype


def write_drawn(source: tf.Variable, target: tf.Variable) -> bool:
    """Draws a lazy variable's initial value a block of rows at a time, equal bit for bit to
    the whole draw, and writes each block into this client's devices' buffers of ``target`` in
    place; False where that cannot be had (another initializer, a weight of at most
    ``_BLOCK_BYTES``, rows that start inside a Philox group of 4), and nothing is drawn.

    In place (``ResourceScatterUpdate`` on each device's resource): assigning a new value would
    free the placeholder's buffers, which TensorFlow's allocator keeps, a second copy of the
    table in the process's memory for the rest of the run. Must be called where the plain
    build would draw this weight (``creation_order``): it takes the initializer's seed from the
    same Python random stream.
    """
    from tensorflow.python.ops import gen_stateless_random_ops_v2  # pylint: disable=g-import-not-at-top
    from tensorflow.python.ops import random_ops_util  # pylint: disable=g-import-not-at-top
    found = _block_drawable(source)
    if found is None:
        return False
    init, shape, dtype = found
    layout = dtensor.fetch_layout(target)
    per_row = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
    if not shape or shape[0] * per_row * dtype.size <= _BLOCK_BYTES or \
            all(axis == dtensor.UNSHARDED for axis in layout.sharding_specs):
        return False  # small, or every device holds the whole value: drawn once, whole
    devices = _local_indices(shape, layout)
    if any(index[0][0] * per_row % 4 for index in devices):
        return False
    block = max(4, _BLOCK_BYTES // (per_row * dtype.size) // 4 * 4)  # rows; a multiple of 4
    seed = init._random_generator.make_seed_for_stateless_op()  # pylint: disable=protected-access
    key, counter, alg = random_ops_util.get_key_counter_alg(seed, None)
    low, high = (int(c) for c in counter.numpy())
    normal = isinstance(init, tf_keras.initializers.RandomNormal)
    # As tf.random.stateless_normal / stateless_uniform compute it, on a part of the counter.
    a, b = ((init.mean, init.stddev) if normal else (init.minval, init.maxval))
    a, b = tf.convert_to_tensor(a, dtype=dtype), tf.convert_to_tensor(b, dtype=dtype)
    handles = dtensor.unpack(target.handle)
    numpy_dtype = target.dtype.base_dtype.as_numpy_dtype
    for start, stop in sorted({index[0] for index in devices}):
        for first in range(start, stop, block):
            last = min(first + block, stop)
            skipped = low + first * per_row // 4
            at = tf.constant(np.array([skipped & _UINT64, (high + (skipped >> 64)) & _UINT64],
                                      np.uint64))
            rows = [last - first, *shape[1:]]
            if normal:
                drawn = gen_stateless_random_ops_v2.stateless_random_normal_v2(
                    rows, key=key, counter=at, dtype=dtype, alg=alg) * b + a
            else:
                drawn = gen_stateless_random_ops_v2.stateless_random_uniform_v2(
                    rows, key=key, counter=at, dtype=dtype, alg=alg) * (b - a) + a
            drawn = drawn.numpy()
            for handle, index in zip(handles, devices):
                if index[0] != (start, stop):
                    continue
                with tf.device(handle.device):
                    tf.raw_ops.ResourceScatterUpdate(
                        resource=handle, indices=tf.range(first - start, last - start),
                        updates=tf.constant(np.asarray(
                            drawn[(slice(None),) + _slices(index[1:])], numpy_dtype)))
            del drawn
    for handle in handles:
        with tf.device(handle.device):
            # A scatter puts the variable in copy-on-read mode: every later read would copy it.
            tf.raw_ops.DisableCopyOnRead(resource=handle)
    return True


def assign_global(variable: tf.Variable, value: Callable[[], np.ndarray], *,
                  source: tf.Variable | None = None) -> None:
    """Assigns a global value (made by ``value()``) to a (possibly sharded, possibly autocast)
    DTensor variable, sending each of this client's devices only its own shard.

    With ``source`` (the lazy variable of the plain build), a large table drawn by
    ``RandomNormal``/``RandomUniform`` is drawn and written block by block (``write_drawn``)
    and the full value never exists. Otherwise the full value is dropped as soon as this
    client's shards are cut from it, before they go to the devices: a weight's peak on the host
    is the weight plus this client's shards.
    """
    target = getattr(variable, "_variable", variable)
    layout = dtensor.fetch_layout(target)
    if not layout.mesh.local_devices():  # another client's devices hold it: nothing to send
        return
    if source is not None and write_drawn(source, target):
        return
    full = np.asarray(value(), dtype=target.dtype.base_dtype.as_numpy_dtype)
    freed = full.nbytes
    shards = [tf.constant(s) for s in local_shards(full, layout)]
    del full
    target.assign(dtensor.pack(shards, layout))
    del shards
    release_free_memory(freed)


_handle_scopes = 0  # nesting depth of ``shared_handle_compilation``


@contextlib.contextmanager
def shared_handle_compilation() -> Iterator[None]:
    """Variables created inside share DTensor's compilation of their handle op.

    DTensor compiles each eager op once per op, attributes and input layouts, and caches it. A
    variable's handle op carries the variable's name as ``debug_name``, so every variable cost a
    compilation of its own: 8.9 ms a variable against 1.2 ms without the name (200 variables of
    one shape on ``batch=8``), 21 s of DenseNet121's builds, masters and state on two meshes.
    Inside, handles are made without ``debug_name``. The variable keeps its ``name`` (layouts,
    checkpoints and export use it); only TensorFlow's own text for a missing resource loses it.
    """
    global _handle_scopes  # pylint: disable=global-statement
    from tensorflow.python.ops import gen_resource_variable_ops as gen  # pylint: disable=g-import-not-at-top
    if _handle_scopes == 0:
        original = gen.var_handle_op

        def var_handle_op(*args, **kwargs):
            kwargs.pop("debug_name", None)
            return original(*args, **kwargs)
        var_handle_op.original = original
        gen.var_handle_op = var_handle_op
    _handle_scopes += 1
    try:
        yield
    finally:
        _handle_scopes -= 1
        if _handle_scopes == 0:
            gen.var_handle_op = gen.var_handle_op.original


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


def local_fill(layout: dtensor.Layout, shape, dtype, value: float = 0.0) -> tf.Tensor:
    """A tensor of ``shape`` filled with ``value`` under ``layout``, made on each local device
    and packed: the initial value of a large variable.

    ``dtensor.call_with_layout(tf.zeros, ...)`` costs twice: the variable made from it copies it,
    and TensorFlow's allocator keeps the freed copy (a 2^23 x 16 table on ``batch=8`` in one
    process: 1,057 MiB against 530 MiB made this way).
    """
    if not layout.mesh.local_devices():  # another client's devices (a pipeline stage there)
        return dtensor.call_with_layout(tf.zeros, layout, shape=shape, dtype=dtype)
    local = [int(d) // (layout.mesh.dim_size(a) if a != dtensor.UNSHARDED else 1)
             for d, a in zip(shape, layout.sharding_specs)]
    parts = []
    for device in layout.mesh.local_devices():
        with tf.device(device):
            parts.append(tf.zeros(local, dtype=dtype) if value == 0 else
                         tf.fill(local, tf.cast(value, dtype)))
    return dtensor.pack(parts, layout)


@contextlib.contextmanager
def placeholder_values(paths: Sequence[str]) -> Iterator[None]:
    """While tf_keras lays out a model: the weights named in ``paths`` start as zeros.

    Their initial values are assigned afterwards (``assign_global``), so running their
    initializers would be wasted, and it is not cheap: tf_keras runs each one replicated (a full
    copy on every local device) and then relayouts it, 230 MiB of peak for a 98 MiB LM on
    ``model=8``. Zeros made on each device (``local_fill``) allocate only its shard. Other variables the build creates
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
        # relayout; zeros made on each device exist only as its shard (local_fill).
        value = local_fill(layout, variable.shape, variable.dtype)
        name = variable.name[:-2] if variable.name.endswith(":0") else variable.name
        return dtensor.DVariable(value, trainable=variable.trainable, name=name)

    keras_layout_map._create_dvariable = create  # pylint: disable=protected-access
    try:
        yield
    finally:
        keras_layout_map._create_dvariable = original  # pylint: disable=protected-access
