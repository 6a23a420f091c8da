"""Input: global batches become batch-sharded DTensors, on any mesh and any client.

The packer slices each LOCAL device's shard of a global batch from that device's mesh coordinates,
so it is right on 2-D meshes whatever the position of the batch axis (the tutorial's
``tf.split(x, num_local_devices)`` is silently wrong there), and in a multi-client run each client
builds only its own devices' shards of the same global batch. Example, ``batch=4,model=2``, global
batch 128: devices (b, 0) and (b, 1) both hold rows ``32*b .. 32*b+31``.

``DistributedDataset`` turns an unbatched dataset into packed ``Batch(features, labels, weights)``
items with an explicit remainder policy:

* ``drop`` (the training default): the last partial batch is dropped, and ``num_dropped`` says how
  many examples that is per epoch.
* ``pad`` (the evaluation default): the last batch is padded up to the next multiple of the batch
  axis size, and ``weights`` is 0.0 on the padding, so losses and metrics count exactly the real
  examples.
* ``error``: a dataset that does not divide into global batches is an error.

The data is read once into host memory (each client holds it all and packs its own shards); epochs
are shuffled with a numpy permutation seeded by ``(seed, epoch)``, so the order is the same on every
client and every mesh shape, and resuming mid-epoch skips batches without reading them. Batches are
packed by a background thread, ``prefetch`` ahead of the training step.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from dtk.mesh import BATCH_AXIS, batch_layout, check_batch_axis

REMAINDER_POLICIES = ("drop", "pad", "error")


class Batch(NamedTuple):
    """One packed global batch (or a stack of ``n`` of them: dims ``[n, B, ...]``).

    Attributes:
      features: DTensor(s) ``[B, ...]``, dim 0 sharded on the batch axis.
      labels: DTensor ``[B]``.
      weights: float32 DTensor ``[B]``: 1.0 for a real example, 0.0 for padding.
    """

    features: Any
    labels: Any
    weights: Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class InputConfig:
    """How a dataset is batched and packed.

    Attributes:
      global_batch_size: examples per step over the whole mesh (a multiple of the batch axis size).
      remainder: ``drop``, ``pad`` or ``error`` (see the module docstring).
      shuffle: reshuffle every epoch (deterministic for ``(seed, epoch)``).
      seed: shuffle seed.
      steps_per_call: batches stacked into one item, for ``steps_per_execution``.
      prefetch: packed items prepared ahead by a background thread (0: pack inline).
      batch_axis: the mesh axis that dim 0 is sharded on.
    """

    global_batch_size: int
    remainder: str = "drop"
    shuffle: bool = False
    seed: int = 0
    steps_per_call: int = 1
    prefetch: int = 2
    batch_axis: str = BATCH_AXIS

    def __post_init__(self):
        for name in ("global_batch_size", "steps_per_call"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer; got {value!r}")
        if self.remainder not in REMAINDER_POLICIES:
            raise ValueError(f"remainder {self.remainder!r} is not one of "
                             f"{', '.join(REMAINDER_POLICIES)}")
        if self.prefetch < 0:
            raise ValueError(f"prefetch must be >= 0; got {self.prefetch}")


@runtime_checkable
class DataSource(Protocol):
    """The data contract of ``Trainer.fit / evaluate / predict``: what a data object must offer.

    ``DistributedDataset`` is dtk's implementation; any object with these members works (for
    example a wrapper that reads pre-packed batches).

    Attributes:
      mesh: the mesh the batches are packed on (the trainer's).
      config: the ``InputConfig`` (``steps_per_call``: batches stacked per item, which must equal
        the trainer's ``steps_per_execution`` for training and 1 for evaluation; ``batch_axis``).
      num_batches: global batches (steps) per epoch, after the remainder policy; > 0.
      num_examples: real examples per epoch.
      num_dropped: examples dropped per epoch by ``remainder="drop"``.
    """

    mesh: dtensor.Mesh
    config: InputConfig
    num_batches: int
    num_examples: int
    num_dropped: int

    def epoch(self, epoch: int = 0, *, skip_batches: int = 0) -> Iterator[Batch]:
        """The batches of one epoch (order fixed by ``epoch``), skipping the first ones on resume.

        Each item is a ``Batch(features, labels, weights)`` of DTensors sharded on the batch
        axis: ``[B, ...]``, or ``[n, B, ...]`` stacks when ``config.steps_per_call`` > 1.
        """


def _leaf_names(tree: Any) -> list[str]:
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return list(tree._fields)
    leaves = tf.nest.flatten(tree)
    return ["tensor"] if len(leaves) == 1 else [f"element {i}" for i in range(len(leaves))]


def pack(mesh: dtensor.Mesh, tree: Any, *, batch_axis: str = BATCH_AXIS,
         stacked: bool = False) -> Any:
    """Packs global arrays into DTensors sharded on ``batch_axis`` along the batch dim.

    Args:
      mesh: the mesh.
      tree: a nest (tuple, NamedTuple, dict) of global numpy arrays or tensors, all with the same
        batch dim: dim 0, or dim 1 when ``stacked`` (``[n, B, ...]`` stacks of n batches).
      batch_axis: the mesh axis to shard the batch dim on; other axes hold copies.
      stacked: whether dim 0 is a stack of batches.

    Returns:
      The same nest of DTensors.

    Raises:
      ValueError: a tensor of too low rank, batch dims that differ, or a batch dim not divisible
        by the batch axis size.
    """
    leaves = [np.asarray(t) for t in tf.nest.flatten(tree)]
    names = _leaf_names(tree)
    dim = 1 if stacked else 0
    size = check_batch_axis(mesh, batch_axis)
    batch = None
    for name, leaf in zip(names, leaves):
        if leaf.ndim <= dim:
            raise ValueError(f"{name}: rank {leaf.ndim} (shape {leaf.shape}) has no batch dim "
                             f"{dim} to shard on mesh axis {batch_axis!r}; inputs must be "
                             f"{'[n, B, ...]' if stacked else '[B, ...]'}")
        if batch is None:
            batch = leaf.shape[dim]
        elif leaf.shape[dim] != batch:
            raise ValueError(f"{name}: batch dim {dim} is {leaf.shape[dim]} but the first tensor's "
                             f"is {batch}; every tensor of a batch must have the same batch size")
        if leaf.shape[dim] % size:
            raise ValueError(
                f"{name}: dim {dim} ({leaf.shape[dim]}) is not divisible by mesh axis "
                f"{batch_axis!r} (size {size}); use a global batch size that is a multiple of "
                f"{size} or set remainder='pad'")
    packed = [_pack_one(mesh, leaf, dim, batch_axis, size) for leaf in leaves]
    return tf.nest.pack_sequence_as(tree, packed)


def _pack_one(mesh, array: np.ndarray, dim: int, batch_axis: str, size: int):
    layout = batch_layout(mesh, array.ndim - dim, batch_axis=batch_axis)
    if dim:
        layout = dtensor.Layout([dtensor.UNSHARDED, *layout.sharding_specs], mesh)
    per = array.shape[dim] // size
    shards = {}
    components = []
    for location in mesh.local_device_locations():
        i = location[batch_axis] if size > 1 else 0
        if i not in shards:
            index = [slice(None)] * array.ndim
            index[dim] = slice(i * per, (i + 1) * per)
            shards[i] = tf.constant(array[tuple(index)])
        components.append(shards[i])
    return dtensor.pack(components, layout)


def _materialize(dataset: tf.data.Dataset) -> tuple[Any, Any]:
    """Reads an unbatched ``(features, labels)`` dataset into numpy arrays (once)."""
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(
            f"dataset must be an unbatched tf.data.Dataset of (features, labels); got "
            f"{type(dataset).__name__}. Wrap arrays with "
            "tf.data.Dataset.from_tensor_slices((x, y))")
    spec = dataset.element_spec
    if not isinstance(spec, tuple) or len(spec) != 2:
        raise ValueError(f"dataset elements must be (features, labels) pairs; got {spec}")
    batched = [s for s in tf.nest.flatten(spec) if s.shape.rank and s.shape[0] is None]
    if batched or type(dataset).__name__ in ("_BatchDataset", "_PaddedBatchDataset"):
        raise ValueError(
            f"dataset looks batched (element spec {spec}: a leading dim of unknown size); pass "
            "UNBATCHED elements (remove .batch(...), or .unbatch() it) and set "
            "InputConfig(global_batch_size=...): dtk batches over the whole mesh itself")
    if dataset.cardinality() == tf.data.INFINITE_CARDINALITY:
        raise ValueError("dataset is infinite (.repeat() without a count); dtk reads a finite "
                         "dataset per epoch: remove .repeat() (Trainer.fit(epochs=...) repeats)")
    chunks = list(dataset.batch(8192).as_numpy_iterator())
    if not chunks:
        raise ValueError("dataset is empty")
    return tuple(tf.nest.map_structure(lambda *parts: np.concatenate(parts), *[c[i] for c in chunks])
                 for i in range(2))


class DistributedDataset:
    """An unbatched ``(features, labels)`` dataset as packed global batches on a mesh.

    Args:
      dataset: unbatched ``tf.data.Dataset`` of ``(features, labels)`` (finite; read once).
      mesh: the mesh to pack onto.
      config: ``InputConfig``.

    Attributes:
      num_examples: examples per epoch.
      num_batches: global batches (steps) per epoch after the remainder policy.
      num_dropped: examples dropped per epoch (``remainder="drop"``), else 0.

    Raises:
      ValueError: bad config, a global batch size not divisible by the batch axis, a dataset that
        does not divide into batches with ``remainder="error"``, or malformed elements.
    """

    def __init__(self, dataset: tf.data.Dataset, mesh: dtensor.Mesh, config: InputConfig):
        self.mesh, self.config = mesh, config
        size = check_batch_axis(mesh, config.batch_axis, what="InputConfig.batch_axis")
        if config.global_batch_size % size:
            raise ValueError(
                f"global_batch_size ({config.global_batch_size}) is not divisible by mesh axis "
                f"{config.batch_axis!r} (size {size}); use a multiple of {size}")
        self.features, self.labels = _materialize(dataset)
        self.num_examples = len(self.labels)
        for leaf in tf.nest.flatten(self.features):
            if len(leaf) != self.num_examples:
                raise ValueError(f"features hold {len(leaf)} examples but labels {self.num_examples}")
        full, rest = divmod(self.num_examples, config.global_batch_size)
        if rest and config.remainder == "error":
            raise ValueError(
                f"dataset: {self.num_examples} examples do not divide into global batches of "
                f"{config.global_batch_size} ({full} full batches, {rest} left over); use "
                "remainder='drop' (training) or remainder='pad' (evaluation)")
        self.num_dropped = rest if config.remainder == "drop" else 0
        self.num_batches = full + (1 if rest and config.remainder == "pad" else 0)

    def _order(self, epoch: int) -> np.ndarray:
        if not self.config.shuffle:
            return np.arange(self.num_examples)
        return np.random.default_rng([self.config.seed, epoch]).permutation(self.num_examples)

    def _global_batch(self, order: np.ndarray, b: int) -> tuple:
        size = self.config.global_batch_size
        index = order[b * size:(b + 1) * size]
        n = len(index)
        axis = self.mesh.dim_size(self.config.batch_axis)
        padded = -(-n // axis) * axis
        take = lambda a: a[index]  # noqa: E731
        features = tf.nest.map_structure(take, self.features)
        labels = take(self.labels)
        weights = np.ones(padded, np.float32)
        if padded > n:
            weights[n:] = 0.0
            pad = lambda a: np.concatenate(  # noqa: E731
                [a, np.zeros((padded - n, *a.shape[1:]), a.dtype)])
            features = tf.nest.map_structure(pad, features)
            labels = pad(labels)
        return features, labels, weights

    def _items(self, epoch: int, skip_batches: int) -> Iterator[Batch]:
        order = self._order(epoch)
        n = self.config.steps_per_call
        for start in range(skip_batches, self.num_batches, n):
            parts = [self._global_batch(order, b)
                     for b in range(start, min(start + n, self.num_batches))]
            if n == 1:
                yield Batch(*pack(self.mesh, parts[0], batch_axis=self.config.batch_axis))
            else:
                stack = tf.nest.map_structure(lambda *a: np.stack(a), *parts)
                yield Batch(*pack(self.mesh, stack, batch_axis=self.config.batch_axis,
                                  stacked=True))

    def epoch(self, epoch: int = 0, *, skip_batches: int = 0) -> Iterator[Batch]:
        """One pass over the data, in the order of ``(seed, epoch)``.

        Args:
          epoch: the epoch number (picks the shuffle order).
          skip_batches: batches to skip at the start (to resume mid-epoch); not read or packed.

        Yields:
          ``Batch`` items; stacks of up to ``steps_per_call`` batches when that is > 1 (the last
          stack of an epoch may hold fewer).
        """
        if not 0 <= skip_batches <= self.num_batches:
            raise ValueError(f"skip_batches ({skip_batches}) must be in [0, {self.num_batches}]")
        items = self._items(epoch, skip_batches)
        if self.config.prefetch == 0:
            return items
        return _prefetch(items, self.config.prefetch)

    def __iter__(self) -> Iterator[Batch]:
        return self.epoch(0)


_DONE = object()


def _prefetch(items: Iterator, depth: int) -> Iterator:
    """Runs ``items`` in a background thread, ``depth`` items ahead; re-raises its errors here."""
    buffer: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                buffer.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce():
        try:
            for item in items:
                if not put(item):
                    return
            put(_DONE)
        except BaseException as e:  # pylint: disable=broad-except
            put(e)

    thread = threading.Thread(target=produce, name="dtk-input-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = buffer.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
