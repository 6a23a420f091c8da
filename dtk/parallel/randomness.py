"""Random numbers that do not depend on the mesh: dropout equal on every mesh and client count.

DTensor runs a random op once per device and changes each device's seed, so dropout masks depend
on the mesh shape, the layout and the number of clients: a model with dropout trained on
``batch=8`` is another run than on one device (1.5e-2 apart in 5 LM steps). dtk replaces the
random numbers of the laid-out model's random layers with a counter-based hash, in the manner of
JAX's partitionable threefry: a value is a function of

    (seed, step, layer, call, global index of the element)

only, never of the device that computes it. Each device hashes only the elements of its own shard
(the global index is built from one iota per tensor dim, sliced by DTensor like any replicated
operand), so no full-size tensor exists on any device.

- ``seed``: ``build_model``'s seed, and the layer's own ``seed=`` where the user gave one.
- ``step``: the optimizer's step counter (``iterations``), read inside the compiled step, so a run
  resumed from a checkpoint draws the same masks as the uninterrupted run.
- ``layer``: the layer's position in the model (``_flatten_layers`` order), which is the same in
  every build of the same factory; ``call``: the how-many-th draw of that layer in one step.

Covered: every layer that draws through Keras's ``RandomGenerator`` (``layer._random_generator``):
``Dropout``, ``SpatialDropout1D/2D/3D``, ``GaussianNoise``, ``GaussianDropout``,
``AlphaDropout``, the dropout inside ``MultiHeadAttention``/``Attention``, the recurrent dropout of
RNN cells, and the augmentation layers that draw uniform values (``RandomBrightness``,
``RandomHeight``, ``RandomWidth``). Not covered: a layer that calls ``tf.random.*`` itself, or one
that asks its generator for a seed (``RandomContrast``, ``RandomCrop``): ``Steps`` finds their
random ops when it traces the first train step and names them once in a warning.

Limits: the hash has 32 bits of index, so a tensor of more than 2^32 elements repeats its pattern
every 2^32 elements; uniform values have 24 bits of resolution.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import tensorflow as tf
import tf_keras
from tf_keras.src import backend as keras_backend

_log = logging.getLogger("dtk")

_U32 = tf.uint32
_SCOPE = "dtk_random"  # name scope of dtk's own random ops (the uncovered-op scan skips it)

# Op types that draw random numbers; an op of these in a train step that dtk did not build is
# a draw that depends on the mesh.
_RANDOM_OP_PREFIXES = ("Random", "Stateless", "Stateful", "Rng")
_RANDOM_OP_TYPES = frozenset({"TruncatedNormal", "Multinomial", "ParameterizedTruncatedNormal"})


# Control flow, not draws, though named "Stateless...".
_NOT_RANDOM = frozenset({"StatelessWhile", "StatelessIf", "StatelessCase",
                         "StatelessPartitionedCall"})


def is_random_op(op_type: str) -> bool:
    """Whether a TF op type draws random numbers (``RandomUniform``, ``StatelessRandom...``)."""
    if op_type in _NOT_RANDOM:
        return False
    return op_type.startswith(_RANDOM_OP_PREFIXES) or op_type in _RANDOM_OP_TYPES


# -- the hash ---------------------------------------------------------------------------------
def _mix(h: tf.Tensor) -> tf.Tensor:
    """A 32-bit avalanche mix (Chris Wellons' lowbias32): every input bit flips about half of the
    output bits. uint32 multiplication wraps, which is what the mix needs."""
    h = tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, tf.constant(16, _U32)))
    h = h * tf.constant(0x7FEB352D, _U32)
    h = tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, tf.constant(15, _U32)))
    h = h * tf.constant(0x846CA68B, _U32)
    return tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, tf.constant(16, _U32)))


def _mix_int(h: int) -> int:
    """``_mix`` on a Python int (for keys known when tracing)."""
    h &= 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x7FEB352D) & 0xFFFFFFFF
    h ^= h >> 15
    h = (h * 0x846CA68B) & 0xFFFFFFFF
    return h ^ (h >> 16)


def stream_key(seed: int, layer: int, call: int) -> int:
    """The static part of a draw's key: one 32-bit value per (seed, layer, call)."""
    key = _mix_int(seed & 0xFFFFFFFF ^ 0x9E3779B9)
    key = _mix_int(key ^ (seed >> 32) & 0xFFFFFFFF)
    key = _mix_int(key ^ layer)
    return _mix_int(key ^ (call * 0x85EBCA6B))


def _global_index(shape: Sequence[int], like: tf.Tensor | None) -> tf.Tensor:
    """The row-major global index of every element of a ``shape`` tensor, as uint32.

    A sum of one iota per dim (each as long as its dim, broadcast). When ``like`` (a tensor of
    ``shape``) is given, the sum starts from zeros shaped and laid out like it, so under DTensor
    the index, and the hash after it, have ``like``'s layout: each device computes its own shard.
    """
    rank = len(shape)
    index = tf.cast(tf.zeros_like(like), _U32) if like is not None else None
    stride = 1
    microbatches, microbatch = _state.microbatch or (1, 0)
    for dim in reversed(range(rank)):
        iota = tf.cast(tf.range(shape[dim]), _U32)
        if dim == 0 and microbatches > 1:
            # Row r of microbatch j is row r * k + j of the whole batch (dtk.train.steps splits it so):
            # the draw is the one the whole batch would get.
            iota = iota * tf.constant(microbatches, _U32) + tf.cast(microbatch, _U32)
        if stride != 1:
            iota = iota * tf.constant(stride & 0xFFFFFFFF, _U32)
        iota = tf.reshape(iota, [shape[dim] if d == dim else 1 for d in range(rank)])
        index = iota if index is None else index + iota
        stride *= shape[dim]
    if index is None:  # a scalar
        index = tf.constant(0, _U32)
    return index


def uniform_bits(shape: Sequence[int], key: int, step: tf.Tensor | int,
                 like: tf.Tensor | None = None) -> tf.Tensor:
    """32 random bits per element of ``shape``: a function of (key, step, global index) only.

    Two rounds of the mix: the first keyed by ``key``, the second by the step's key, so streams of
    other layers or steps are unrelated (not shifted copies of each other).
    """
    step_key = _mix(tf.cast(step, _U32) ^ tf.constant(0x68E31DA4, _U32))
    index = _global_index(shape, like)
    return _mix(_mix(index ^ tf.constant(key, _U32)) ^ step_key)


def uniform(shape: Sequence[int], key: int, step: tf.Tensor | int, *, dtype=tf.float32,
            like: tf.Tensor | None = None, open_low: bool = False) -> tf.Tensor:
    """Uniform values in [0, 1) (or (0, 1] with ``open_low``), 24 bits of resolution."""
    bits = tf.bitwise.right_shift(uniform_bits(shape, key, step, like), tf.constant(8, _U32))
    value = tf.cast(bits, tf.float32)
    if open_low:
        value = value + 1.0
    return tf.cast(value * (1.0 / (1 << 24)), dtype)


def normal(shape: Sequence[int], key: int, step: tf.Tensor | int, *, dtype=tf.float32,
           like: tf.Tensor | None = None, truncate: float | None = None) -> tf.Tensor:
    """Standard normal values by the inverse CDF of one uniform value per element.

    With ``truncate=t``, the uniform value is mapped into [Phi(-t), Phi(t)] first: exactly the
    normal distribution truncated to [-t, t] (as ``tf.random.truncated_normal`` with t=2).
    """
    u = uniform(shape, key, step, like=like, open_low=True) * (1.0 - 2.0 ** -25)
    if truncate is not None:
        low = 0.5 * (1.0 + float(math.erf(-truncate / math.sqrt(2.0))))
        u = low + u * (1.0 - 2.0 * low)
    return tf.cast(tf.math.ndtri(u), dtype)


# -- the step scope ---------------------------------------------------------------------------
class _StepState(threading.local):
    def __init__(self):
        self.step = None
        self.calls: dict[int, int] = {}
        self.inputs: list[tf.Tensor] = []
        self.microbatch: tuple[int, int] | None = None  # (k, j): the j-th of k microbatches
        # The generators of the user layers whose call is running (innermost last): their
        # tf_keras.backend.random_* calls draw from it (``_install_backend_draws``).
        self.backend: list["IndexedRandomGenerator"] = []
        self.routing = 0  # inside a routed tf.random draw (its fallback calls TensorFlow's)


_state = _StepState()


@contextlib.contextmanager
def microbatch_scope(count: int, index: int) -> Iterator[None]:
    """Within it, draws are those of rows ``r * count + index`` of the whole batch: a step that
    accumulates gradients over ``count`` microbatches draws the masks of one whole-batch step.
    ``index`` may be a tensor (a loop counter)."""
    saved, _state.microbatch = _state.microbatch, (count, index)
    try:
        yield
    finally:
        _state.microbatch = saved


def snapshot() -> tuple[Any, dict[int, int], tuple[int, int] | None]:
    """The draw state (step, per-layer call counts, microbatch), for a recomputation (remat)
    to draw what the first computation drew."""
    return _state.step, dict(_state.calls), _state.microbatch


@contextlib.contextmanager
def replay(state) -> Iterator[None]:
    """Draws as at ``snapshot()`` time (the recomputed forward pass of a rematerialized layer)."""
    saved = (_state.step, _state.calls, _state.microbatch)
    _state.step, _state.calls, _state.microbatch = state[0], dict(state[1]), state[2]
    try:
        yield
    finally:
        _state.step, _state.calls, _state.microbatch = saved


@contextlib.contextmanager
def step_scope(step: tf.Tensor) -> Iterator[None]:
    """Within it, random layers of a dtk model draw for training step ``step`` (a tensor).

    ``Steps`` enters it around the forward pass of each train step (inside the compiled
    function), with the optimizer's ``iterations``. Outside one, the layers draw with Keras's own
    generator (as a plain ``model(x, training=True)`` call would).
    """
    saved = (_state.step, _state.calls)
    _state.step, _state.calls = step, {}
    try:
        yield
    finally:
        _state.step, _state.calls = saved


class IndexedRandomGenerator(keras_backend.RandomGenerator):
    """Keras's ``RandomGenerator`` with draws that depend on no device: see the module docstring.

    Takes the place of a laid-out layer's generator (``adapt_layers``); it keeps the original
    generator's state and tracking, and draws with it outside a ``step_scope``.
    """

    _dtk_seed: int
    _dtk_layer: int

    def _draw_key(self) -> int:
        call = _state.calls.get(self._dtk_layer, 0)
        _state.calls[self._dtk_layer] = call + 1
        seed = self._dtk_seed if self._seed is None else self._dtk_seed ^ (self._seed << 32)
        return stream_key(seed, self._dtk_layer, call)

    @staticmethod
    def _static_shape(shape) -> list[int] | None:
        value = tf.get_static_value(shape) if tf.is_tensor(shape) else shape
        if value is None and tf.is_tensor(shape) and shape.op.type == "Pack":
            # Dropout's noise_shape with None dims (EfficientNet's stochastic depth:
            # (None, 1, 1, 1)) is packed from tf.shape(inputs)[i]: each piece is static.
            value = list(shape.op.inputs)
        if value is None:
            return None
        dims = [_static_dim(n) if tf.is_tensor(n) else n for n in value]
        if any(n is None for n in dims):
            return None
        return [int(n) for n in dims]

    @staticmethod
    def _like(shape: list[int]) -> tf.Tensor | None:
        # The layer's input when the draw has its shape (GaussianNoise draws tf.shape(inputs)):
        # the draw then takes the input's layout.
        for tensor in _state.inputs:
            if tensor.shape.as_list() == shape:
                return tensor
        return None

    def _covered(self, shape, dtype) -> list[int] | None:
        if _state.step is None or (dtype is not None and not tf.as_dtype(dtype).is_floating):
            return None
        return self._static_shape(shape)

    def _draw(self, shape, dtype, nonce, fallback, sample, low, scale):
        """``sample(static shape, key, dtype, like) * scale + low``, or Keras's own ``fallback()``
        outside a step scope, for a dynamic shape, an integer dtype or a ``nonce``."""
        static = self._covered(shape, dtype)
        if static is None or nonce:
            return fallback()
        dtype = dtype or keras_backend.floatx()
        with tf.name_scope(_SCOPE):
            values = sample(static, self._draw_key(), dtype, self._like(static))
            return values * tf.cast(scale, dtype) + tf.cast(low, dtype)

    def random_uniform(self, shape, minval=0.0, maxval=None, dtype=None, nonce=None):
        return self._draw(
            shape, dtype, nonce, lambda: super(IndexedRandomGenerator, self).random_uniform(
                shape, minval, maxval, dtype, nonce),
            lambda static, key, dt, like: uniform(static, key, _state.step, dtype=dt, like=like),
            minval, (1.0 if maxval is None else maxval) - minval)

    def random_normal(self, shape, mean=0.0, stddev=1.0, dtype=None, nonce=None):
        return self._draw(
            shape, dtype, nonce, lambda: super(IndexedRandomGenerator, self).random_normal(
                shape, mean, stddev, dtype, nonce),
            lambda static, key, dt, like: normal(static, key, _state.step, dtype=dt, like=like),
            mean, stddev)

    def truncated_normal(self, shape, mean=0.0, stddev=1.0, dtype=None, nonce=None):
        return self._draw(
            shape, dtype, nonce, lambda: super(IndexedRandomGenerator, self).truncated_normal(
                shape, mean, stddev, dtype, nonce),
            lambda static, key, dt, like: normal(static, key, _state.step, dtype=dt, like=like,
                                                 truncate=2.0),
            mean, stddev)

    def dropout(self, inputs, rate, noise_shape=None):
        static = self._covered(inputs.shape.as_list(), inputs.dtype)
        if static is None:
            return super().dropout(inputs, rate, noise_shape)
        like = inputs
        if noise_shape is not None:
            noise = self._static_shape(noise_shape)
            if noise is None:
                return super().dropout(inputs, rate, noise_shape)
            noise = [n if n is not None else s for n, s in zip(noise, static)]
            if noise != static:
                # The mask is shared along the dims of size 1 (SpatialDropout): its layout is the
                # input's, sliced to one element there.
                like = inputs[tuple(slice(0, 1) if n == 1 and s != 1 else slice(None)
                                    for n, s in zip(noise, static))]
                static = noise
        with tf.name_scope(_SCOPE):
            if isinstance(rate, (int, float)) and rate == 0:
                return tf.identity(inputs)
            u = uniform(static, self._draw_key(), _state.step, dtype=inputs.dtype, like=like)
            rate = tf.cast(rate, inputs.dtype)
            keep = tf.cast(u >= rate, inputs.dtype)
            return inputs * keep * tf.math.reciprocal_no_nan(1.0 - rate)


def _static_dim(n: tf.Tensor) -> int | None:
    """A scalar tensor's value when known at trace time, including ``tf.shape(x)[i]`` of a static
    shape (how SpatialDropout builds its noise shape; ``tf.get_static_value`` does not see it)."""
    value = tf.get_static_value(n)
    if value is not None:
        return int(value)
    op = n.op
    if op.type != "StridedSlice" or n.shape.rank != 0:
        return None
    begin = tf.get_static_value(op.inputs[1])
    if begin is None or len(begin) != 1:
        return None
    source = op.inputs[0]
    whole = tf.get_static_value(source)  # tf.shape(x) of a static shape is a constant
    if whole is not None:
        return int(whole[int(begin[0])])
    if source.op.type == "Shape" and source.op.inputs[0].shape.rank is not None:
        return source.op.inputs[0].shape[int(begin[0])]
    return None


def _with_inputs(call):
    """Wraps a random layer's ``call`` so its draws can take the layout of its input."""
    def wrapped(inputs, *args, **kwargs):
        tensors = [t for t in tf.nest.flatten(inputs) if tf.is_tensor(t)]
        _state.inputs = tensors + _state.inputs
        try:
            return call(inputs, *args, **kwargs)
        finally:
            _state.inputs = _state.inputs[len(tensors):]
    return wrapped


# tf_keras.backend's module-level draws, which a user's layer may call itself (keras.io's VAE:
# ``epsilon = tf.keras.backend.random_normal(shape=(batch, dim))``).
_BACKEND_DRAWS = ("random_normal", "random_uniform", "truncated_normal")


def _install_backend_draws() -> None:
    """Routes ``tf_keras.backend.random_normal / random_uniform / truncated_normal`` (both the
    public module and ``tf_keras.src.backend``) to the running user layer's generator while one
    runs; Keras's own function otherwise."""
    import inspect  # pylint: disable=g-import-not-at-top
    from tf_keras import backend as public  # pylint: disable=g-import-not-at-top
    for module in (keras_backend, public):
        for name in _BACKEND_DRAWS:
            original = getattr(module, name)
            if getattr(original, "_dtk", False):
                continue
            signature = inspect.signature(original)

            def wrapped(*args, __original=original, __name=name, __signature=signature,
                        **kwargs):
                if not _state.backend:
                    return __original(*args, **kwargs)
                bound = __signature.bind(*args, **kwargs)
                bound.apply_defaults()
                a = dict(bound.arguments)
                generator = _state.backend[-1]
                saved, generator._seed = generator._seed, a.pop("seed")  # pylint: disable=protected-access
                try:
                    return getattr(generator, __name)(**a)
                finally:
                    generator._seed = saved  # pylint: disable=protected-access

            wrapped._dtk = True  # pylint: disable=protected-access
            setattr(module, name, wrapped)


# TensorFlow's own stateful draws, which a model's train_step may call itself (keras.io's GAN:
# ``tf.random.normal(shape=(batch_size, self.latent_dim))``): stateful random ops have no DTensor
# expansion at all ("Stateful random operations are not supported in DTensor").
_TF_DRAWS = {"normal": "random_normal", "uniform": "random_uniform",
             "truncated_normal": "truncated_normal"}


def _install_tf_draws() -> None:
    """Routes ``tf.random.normal / uniform / truncated_normal`` and ``tf.nn.dropout`` to the
    innermost generator of
    ``_state.backend`` (a user layer's, else the step's: ``step_draws``) while a step scope is
    active; TensorFlow's own function otherwise, and for what dtk cannot draw (integer values,
    a dynamic shape), where Keras's generator draws."""
    import inspect  # pylint: disable=g-import-not-at-top
    for name, method in _TF_DRAWS.items():
        original = getattr(tf.random, name)
        if getattr(original, "_dtk", False):
            continue
        signature = inspect.signature(original)

        def wrapped(*args, __original=original, __method=method, __signature=signature,
                    **kwargs):
            if not _state.backend or _state.step is None or _state.routing:
                return __original(*args, **kwargs)
            a = dict(__signature.bind(*args, **kwargs).arguments)
            a.pop("name", None)
            generator = _state.backend[-1]
            saved, generator._seed = generator._seed, a.pop("seed", None)  # pylint: disable=protected-access
            _state.routing += 1  # Keras's fallback draws call TensorFlow's own
            try:
                return getattr(generator, __method)(**a)
            finally:
                _state.routing -= 1
                generator._seed = saved  # pylint: disable=protected-access

        wrapped._dtk = True  # pylint: disable=protected-access
        setattr(tf.random, name, wrapped)
    if not getattr(tf.nn.dropout, "_dtk", False):  # keras.io's subclassing guide's own dropout
        original = tf.nn.dropout

        def dropout(x, rate, noise_shape=None, seed=None, name=None, __original=original):
            if not _state.backend or _state.step is None or _state.routing:
                return __original(x, rate, noise_shape=noise_shape, seed=seed, name=name)
            generator = _state.backend[-1]
            saved, generator._seed = generator._seed, seed  # pylint: disable=protected-access
            _state.routing += 1
            try:
                return generator.dropout(tf.convert_to_tensor(x), rate, noise_shape)
            finally:
                _state.routing -= 1
                generator._seed = saved  # pylint: disable=protected-access

        dropout._dtk = True  # pylint: disable=protected-access
        tf.nn.dropout = dropout


def step_generator(model: tf_keras.Model, *, seed: int) -> "IndexedRandomGenerator":
    """The generator of the draws a model's own ``train_step`` makes with ``tf.random.*`` or
    ``tf_keras.backend.random_*`` (``step_draws``): keyed like a layer's, by a layer number no
    layer of the model has."""
    generator = IndexedRandomGenerator(seed=None)
    generator._dtk_seed = int(seed)  # pylint: disable=protected-access
    generator._dtk_layer = len(list(model._flatten_layers(include_self=False)))  # pylint: disable=protected-access
    return generator


@contextlib.contextmanager
def step_draws(generator: "IndexedRandomGenerator") -> Iterator[None]:
    """Within it (and a ``step_scope``), the step's own draws come from ``generator``: the same
    on every mesh."""
    _install_tf_draws()
    _install_backend_draws()
    _state.backend.append(generator)
    try:
        yield
    finally:
        _state.backend.pop()


def _draws_backend(layer) -> bool:
    """A user's layer whose own code calls tf_keras.backend's random functions."""
    import inspect  # pylint: disable=g-import-not-at-top
    if type(layer).__module__.startswith(("tf_keras.", "keras.", "dtk.")):
        return False
    try:
        source = inspect.getsource(type(layer))  # call and its helpers
    except (OSError, TypeError):
        return False
    return any(f"{name}(" in source for name in _BACKEND_DRAWS)


def _with_backend_generator(call, generator):
    def wrapped(*args, **kwargs):
        _state.backend.append(generator)
        try:
            return call(*args, **kwargs)
        finally:
            _state.backend.pop()
    return wrapped


def adapt_layers(model: tf_keras.Model, *, seed: int) -> list[str]:
    """Gives every random layer of the laid-out ``model`` an ``IndexedRandomGenerator``: Keras's
    random layers in place of theirs, and a user's layer that calls ``tf_keras.backend``'s random
    functions itself one for those calls.

    Returns one log line naming the layers (none when the model has no random layer).
    """
    names = []
    # A pipeline stage (dtk.parallel.pipeline.stage_model) keeps its layers' positions in the
    # whole model: its draws are the whole model's.
    keys = getattr(model, "_dtk_layer_keys", None) or {}
    for index, layer in enumerate(model._flatten_layers(include_self=False)):  # pylint: disable=protected-access
        index = keys.get(id(layer), index)
        generator = getattr(layer, "_random_generator", None)
        if generator is None and _draws_backend(layer) and not getattr(
                layer, "_dtk_backend_generator", None):
            _install_backend_draws()
            generator = IndexedRandomGenerator(seed=None)
            generator._dtk_seed = int(seed)  # pylint: disable=protected-access
            generator._dtk_layer = index  # pylint: disable=protected-access
            object.__setattr__(layer, "_dtk_backend_generator", generator)  # untracked
            layer.call = _with_backend_generator(_with_inputs(layer.call), generator)
            names.append(layer.name)
            continue
        if not isinstance(generator, keras_backend.RandomGenerator):
            continue
        # Same object, same tracked state (checkpoints keep their keys): only the draws change.
        generator.__class__ = IndexedRandomGenerator
        generator._dtk_seed = int(seed)  # pylint: disable=protected-access
        generator._dtk_layer = index  # pylint: disable=protected-access
        if not getattr(layer, "_dtk_random_inputs", False):
            layer.call = _with_inputs(layer.call)
            layer._dtk_random_inputs = True  # pylint: disable=protected-access
        names.append(layer.name)
    if not names:
        return []
    shown = ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")
    return [f"random layers {shown}: draws keyed by (seed, step, layer, global index), the same on "
            "every mesh (dtk.parallel.randomness)"]


def uncovered_random_ops(graph: Any) -> dict[str, list[str]]:
    """Random ops in ``graph`` that dtk did not build: {layer scope: [op types]}.

    Such a draw runs once per device with a per-device seed, so its values depend on the mesh.
    """
    found: dict[str, list[str]] = {}
    for op in graph.get_operations():
        if not is_random_op(op.type) or f"{_SCOPE}/" in op.name or op.name.startswith(_SCOPE):
            continue
        scope = op.name.rsplit("/", 1)[0]
        found.setdefault(scope, [])
        if op.type not in found[scope]:
            found[scope].append(op.type)
    return found
