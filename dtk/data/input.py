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

The data is streamed, never materialized: the user's ``tf.data`` pipeline (its ``map``, its
augmentation, which therefore runs anew every epoch) is batched into global batches by ``tf.data``,
and a background thread packs them ``prefetch`` items ahead of the step. Host memory is bounded by
the prefetch depth (plus the shuffle buffer), whatever the dataset's size. With ``shuffle=True`` dtk
adds a ``tf.data`` shuffle, reshuffled every epoch in an order fixed by ``seed``, so the order is
the same on every client and every mesh shape and the same again after a resume. All epochs are
one continuing stream (with a global seed set, a NEW iterator would replay the same random
numbers, so augmentation would repeat every epoch); resuming restarts the stream and skips to the
saved position (the skipped batches are read again, not packed or trained).

Multi-client (parity mode): every client reads the same global stream in the same order and packs
only its own devices' shards, so N clients x K devices train exactly like one process with N*K
devices. Each client still reads (and runs the pipeline's ``map`` on) every example; a pipeline
that decodes expensively can shard by file itself before decoding.

Infinite datasets (``.repeat()``) need ``InputConfig(steps_per_epoch=N)``: epoch ``e`` is batches
``e*N .. (e+1)*N - 1`` of one continuing stream. A finite dataset of unknown cardinality (a
``filter``, a generator) is counted once, by one pass, when the ``DistributedDataset`` is made;
``steps_per_epoch`` (or ``dataset.apply(tf.data.experimental.assert_cardinality(n))``) avoids it.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import queue
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from dtk.parallel.mesh import BATCH_AXIS, as_mesh, batch_layout, check_batch_axis

REMAINDER_POLICIES = ("drop", "pad", "error")
# A step that waits this long for its next batch says so (and again each time as long): a slow
# input pipeline is named instead of looking like a hung step.
STALL_REPORT_S = 60.0
_log = logging.getLogger("dtk")


class Batch(NamedTuple):
    """One packed global batch (or a stack of ``n`` of them: dims ``[n, B, ...]``).

    Attributes:
      features: DTensor(s) ``[B, ...]``, dim 0 sharded on the batch axis.
      labels: DTensor ``[B]``.
      weights: float32 DTensor ``[B]``: 1.0 for a real example, 0.0 for padding; for data
        that carries sample weights, each example's weight (0.0 on padding).
      examples: for data that carries sample weights, float32 DTensor ``[B]``: 1.0 for a real
        example, 0.0 for padding (the loss is divided by their count, as Keras divides by the
        batch size, not by the weights' sum; a real example of weight 0 counts); else None
        (``weights`` says it).
    """

    features: Any
    labels: Any
    weights: Any
    examples: Any = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class InputConfig:
    """How a dataset is batched and packed.

    Attributes:
      global_batch_size: examples per step over the whole mesh (a multiple of the batch axis size).
      remainder: ``drop``, ``pad`` or ``error`` (see the module docstring).
      shuffle: reshuffle every epoch with a ``tf.data`` shuffle (order fixed by ``seed``).
      seed: shuffle seed.
      shuffle_buffer: examples in the shuffle buffer (the whole dataset when it is smaller).
      steps_per_call: batches stacked into one item, for ``steps_per_execution``.
      prefetch: packed items prepared ahead by a background thread (0: pack inline).
      batch_axis: the mesh axis that dim 0 is sharded on.
      steps_per_epoch: batches per epoch; required for an infinite dataset, optional otherwise
        (at most the batches a finite dataset holds).
      num_classes: integer class labels must lie in ``[0, num_classes)``; checked on the host
        for every batch before it is packed. A label out of range inside a DTensor step fails
        the step's collectives, and a process whose collectives failed cannot run DTensor
        collectives again, so the check belongs here.
      sequence_axis: a mesh axis that dim 1 of every input and label of rank >= 2 is sharded
        on too (a long sequence's tokens go only to the devices that hold those positions,
        ``dtk.parallel.sequence``); None, or an axis of size 1: dim 0 only.
    """

    global_batch_size: int
    remainder: str = "drop"
    shuffle: bool = False
    seed: int = 0
    shuffle_buffer: int = 10_000
    steps_per_call: int = 1
    prefetch: int = 2
    batch_axis: str = BATCH_AXIS
    steps_per_epoch: int | None = None
    num_classes: int | None = None
    sequence_axis: str | None = None

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
        if self.num_classes is not None and self.num_classes < 1:
            raise ValueError(f"num_classes must be a positive integer or None; got "
                             f"{self.num_classes}")
        if self.shuffle_buffer < 1:
            raise ValueError(f"shuffle_buffer must be a positive integer; got {self.shuffle_buffer}")
        if self.steps_per_epoch is not None and (
                not isinstance(self.steps_per_epoch, int) or self.steps_per_epoch < 1):
            raise ValueError(f"steps_per_epoch must be a positive integer or None; got "
                             f"{self.steps_per_epoch!r}")


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
         stacked: bool = False, local: bool = False, sequence_axis: str | None = None) -> Any:
    """Packs global arrays into DTensors sharded on ``batch_axis`` along the batch dim.

    Args:
      mesh: the mesh.
      tree: a nest (tuple, NamedTuple, dict) of global numpy arrays or tensors, all with the same
        batch dim: dim 0, or dim 1 when ``stacked`` (``[n, B, ...]`` stacks of n batches).
      batch_axis: the mesh axis to shard the batch dim on; other axes hold copies.
      stacked: whether dim 0 is a stack of batches.
      local: the arrays hold only THIS client's rows of the global batch (scale mode: the rows
        of its batch-axis shards, in order), not the whole global batch.
      sequence_axis: shard dim 1 of every tensor of rank >= 2 (after the stack dim) on this mesh
        axis too (``InputConfig.sequence_axis``).

    Returns:
      The same nest of DTensors.

    Raises:
      ValueError: a tensor of too low rank, batch dims that differ, a batch dim not divisible
        by the batch axis size, or a sequence dim not divisible by the sequence axis.
    """
    leaves = [np.asarray(t) for t in tf.nest.flatten(tree)]
    names = _leaf_names(tree)
    dim = 1 if stacked else 0
    size = check_batch_axis(mesh, batch_axis)
    seq = _sequence_axis(mesh, sequence_axis)
    for name, leaf in zip(names, leaves):
        if seq and leaf.ndim > dim + 1 and leaf.shape[dim + 1] % mesh.dim_size(seq):
            raise ValueError(
                f"{name}: sequence dim {dim + 1} ({leaf.shape[dim + 1]}) is not divisible by mesh "
                f"axis {seq!r} (size {mesh.dim_size(seq)}); use a sequence length that is a "
                f"multiple of {mesh.dim_size(seq)}")
    if local:
        size = len(_local_batch_indices(mesh, batch_axis))
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
    packed = [_pack_one(mesh, leaf, dim, batch_axis, size, local,
                        seq if leaf.ndim > dim + 1 else None) for leaf in leaves]
    return tf.nest.pack_sequence_as(tree, packed)


def _sequence_axis(mesh: dtensor.Mesh, axis: str | None) -> str | None:
    """``axis`` where it shards anything on ``mesh`` (None: absent or of size 1)."""
    if axis is None or axis not in mesh.dim_names or mesh.dim_size(axis) == 1:
        return None
    return axis


def _local_batch_indices(mesh: dtensor.Mesh, batch_axis: str) -> list[int]:
    """The batch-axis coordinates of this client's devices, in order."""
    return sorted({loc[batch_axis] for loc in mesh.local_device_locations()})


def _pack_one(mesh, array: np.ndarray, dim: int, batch_axis: str, size: int, local: bool = False,
              seq: str | None = None):
    specs = list(batch_layout(mesh, array.ndim - dim, batch_axis=batch_axis).sharding_specs)
    if seq:
        specs[1] = seq
    layout = dtensor.Layout([dtensor.UNSHARDED] * dim + specs, mesh)
    per = array.shape[dim] // size
    seq_per = array.shape[dim + 1] // mesh.dim_size(seq) if seq else 0
    position = ({b: k for k, b in enumerate(_local_batch_indices(mesh, batch_axis))} if local
                else None)
    shards = {}
    components = []
    for location in mesh.local_device_locations():
        i = location[batch_axis] if mesh.dim_size(batch_axis) > 1 else 0
        if position is not None:
            i = position[i]
        j = location[seq] if seq else 0
        if (i, j) not in shards:
            index = [slice(None)] * array.ndim
            index[dim] = slice(i * per, (i + 1) * per)
            if seq:
                index[dim + 1] = slice(j * seq_per, (j + 1) * seq_per)
            shards[i, j] = tf.constant(array[tuple(index)])
        components.append(shards[i, j])
    return dtensor.pack(components, layout)


def _check_dataset(dataset: Any) -> int:
    """Validates an unbatched dataset of ``(features, labels[, sample_weights])``; returns its rank-0
    cardinality (``tf.data.INFINITE_CARDINALITY``, ``UNKNOWN_CARDINALITY`` or a count)."""
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(
            f"dataset must be an unbatched tf.data.Dataset of (features, labels); got "
            f"{type(dataset).__name__}. Wrap arrays with "
            "tf.data.Dataset.from_tensor_slices((x, y))")
    spec = dataset.element_spec
    if not isinstance(spec, tuple) or len(spec) not in (2, 3):
        raise ValueError(f"dataset elements must be (features, labels) or (features, labels, "
                         f"sample_weights) tuples; got {spec}")
    leaves = tf.nest.flatten(spec)
    batched = all(s.shape.rank and s.shape[0] is None for s in leaves)  # labels too: a batch
    if batched or type(dataset).__name__ in ("_BatchDataset", "_PaddedBatchDataset"):
        raise ValueError(
            f"dataset looks batched (element spec {spec}: a leading dim of unknown size); pass "
            "UNBATCHED elements (remove .batch(...), or .unbatch() it) and set "
            "InputConfig(global_batch_size=...): dtk batches over the whole mesh itself")
    unknown = [s for s in tf.nest.flatten(spec) if s.shape.rank is None or None in s.shape]
    if unknown:
        raise ValueError(f"dataset elements have dims of unknown size ({spec}); pad variable-length "
                         "features to a fixed shape in the pipeline (e.g. .map with tf.pad or "
                         "tf.ensure_shape) so that batches stack")
    return int(dataset.cardinality())


def _epoch_seed(seed: int, epoch: int) -> int:
    digest = hashlib.sha256(f"dtk-shuffle:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:7], "little")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClientShard:
    """Which part of the data this client reads in scale mode (like ``tf.distribute.InputContext``).

    Attributes:
      num_clients: clients in the run.
      client_id: this client's id; read ``files[client_id::num_clients]``, or
        ``dataset.shard(num_clients, client_id)`` BEFORE the expensive ``map``.
    """

    num_clients: int
    client_id: int


class DistributedDataset:
    """An unbatched dataset streamed as packed global batches on a mesh.

    Two multi-client modes:

    * parity (``DistributedDataset(dataset, mesh, config)``): every client reads the same global
      stream and packs its own shards; N clients x K devices train exactly like one process of
      N*K devices.
    * scale (``DistributedDataset.from_function(fn, mesh, config)``): ``fn(ClientShard)`` returns
      THIS client's part of the data (e.g. its share of the files); each client batches
      ``global_batch_size / num_clients`` examples and packs them on its own devices. Each example
      is read once in the whole cluster, but the order (and so the losses) differs from a
      single-process run; every client must yield the same number of batches per epoch (checked
      at construction), which ``steps_per_epoch`` guarantees.

    The stream runs with tf.data's autotuning off (``AUTOTUNE`` takes all cores at once; the
    dataset's other options are kept): destroying an autotuned iterator took up to 44 s here
    (issue 39), and every predict or evaluate after a fit replaces one.

    Args:
      dataset: unbatched ``tf.data.Dataset`` of ``(features, labels)`` or ``(features, labels,
        sample_weights)``; features may be a nest (dict, tuple) of tensors. Finite, or infinite
        with ``config.steps_per_epoch``.
      mesh: the mesh to pack onto.
      config: ``InputConfig``.

    Attributes:
      num_examples: examples per epoch (``steps_per_epoch * global_batch_size`` when that is
        given).
      num_batches: global batches (steps) per epoch after the remainder policy.
      num_dropped: examples dropped per epoch (``remainder="drop"``), else 0.

    Raises:
      TypeError: not a ``tf.data.Dataset``.
      ValueError: bad config, a global batch size not divisible by the batch axis, a batched or
        infinite dataset without ``steps_per_epoch``, a dataset that does not divide into batches
        with ``remainder="error"``, or malformed elements.
    """

    def __init__(self, dataset: tf.data.Dataset, mesh: dtensor.Mesh, config: InputConfig, *,
                 _clients: int = 1):
        mesh = as_mesh(mesh, "mesh")
        if not isinstance(config, InputConfig):
            raise TypeError(f"config must be a dtk.InputConfig; got {type(config).__name__}")
        self.mesh, self.config = mesh, config
        size = check_batch_axis(mesh, config.batch_axis, what="InputConfig.batch_axis")
        if config.global_batch_size % size:
            raise ValueError(
                f"global_batch_size ({config.global_batch_size}) is not divisible by mesh axis "
                f"{config.batch_axis!r} (size {size}); use a multiple of {size}")
        if config.sequence_axis is not None and config.sequence_axis == config.batch_axis:
            raise ValueError(
                f"InputConfig.sequence_axis {config.sequence_axis!r} is the batch axis: dim 0 "
                "(the batch) is sharded over it already, and one mesh axis cannot shard two "
                "dims of a tensor; name another axis (e.g. 'seq'), or None")
        if config.sequence_axis is not None and config.sequence_axis not in mesh.dim_names:
            raise ValueError(
                f"InputConfig.sequence_axis {config.sequence_axis!r} is not an axis of the mesh "
                f"{','.join(f'{n}={mesh.dim_size(n)}' for n in mesh.dim_names)}; name one of "
                f"{list(mesh.dim_names)}, or None")
        cardinality = _check_dataset(dataset)
        self._dataset = dataset
        self._local = _clients > 1
        self._has_weights = len(dataset.element_spec) == 3
        # The class count a sparse loss implies (the model's outputs), set by dtk.Trainer when
        # InputConfig.num_classes is not given: labels are checked against it on the host.
        self.implied_classes: int | None = None
        # Rows per device of a padded batch are a multiple of this (dtk.Trainer sets its
        # gradient accumulation steps, so that the padded last batch splits into microbatches).
        self.row_multiple = 1
        self.label_dtypes = tuple(s.dtype for s in tf.nest.flatten(dataset.element_spec[1]))
        self.example_spec = dataset.element_spec  # one example's (features, labels[, weights])
        self.infinite = cardinality == int(tf.data.INFINITE_CARDINALITY)
        spe, g = config.steps_per_epoch, config.global_batch_size // _clients
        # Where the stream of all epochs stands; shared with re-stacked views.
        self._shared = _Stream()
        self._rows_per_batch = g  # this client's rows of a global batch (all of them: parity)
        if self.infinite:
            if spe is None:
                raise ValueError(
                    "dataset is infinite (.repeat() without a count); set "
                    "InputConfig(steps_per_epoch=N) to say how many global batches make an "
                    "epoch, or remove .repeat() (Trainer.fit(epochs=...) repeats the data)")
            self.num_examples, self.num_batches, self.num_dropped = spe * g, spe, 0
            return
        if cardinality == int(tf.data.UNKNOWN_CARDINALITY):
            cardinality = int(dataset.reduce(np.int64(0), lambda count, _: count + 1))
        if cardinality == 0:
            raise ValueError("dataset is empty")
        full, rest = divmod(cardinality, g)
        if rest and config.remainder == "error":
            raise ValueError(
                f"dataset: {cardinality} examples do not divide into global batches of "
                f"{g} ({full} full batches, {rest} left over); use "
                "remainder='drop' (training) or remainder='pad' (evaluation)")
        self.num_examples = cardinality
        self.num_dropped = rest if config.remainder == "drop" else 0
        self.num_batches = full + (1 if rest and config.remainder == "pad" else 0)
        if spe is not None:
            if spe > self.num_batches:
                raise ValueError(
                    f"steps_per_epoch={spe} but the dataset holds only {self.num_batches} "
                    f"global batches of {g} ({cardinality} examples); use at most "
                    f"{self.num_batches} or .repeat() the dataset")
            self.num_batches = spe
            self.num_dropped = cardinality - min(cardinality, spe * g)

    @classmethod
    def from_function(cls, dataset_fn, mesh: dtensor.Mesh, config: InputConfig
                      ) -> "DistributedDataset":
        """Scale mode: ``dataset_fn(ClientShard)`` gives this client's part of the data.

        Raises:
          ValueError: clients that share batch-axis coordinates (the mesh splits clients along
            another axis, so they must read the same rows: use parity mode), a global batch not
            divisible by the number of clients, or clients with different numbers of batches.
        """
        from dtk.cluster import env as cluster  # pylint: disable=g-import-not-at-top
        from dtk.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
        clients = cluster.num_clients()
        shard = ClientShard(num_clients=clients, client_id=cluster.client_id())
        if clients == 1:
            return cls(dataset_fn(shard), mesh, config)
        size = check_batch_axis(mesh, config.batch_axis, what="InputConfig.batch_axis")
        mine = len(_local_batch_indices(mesh, config.batch_axis))
        if mine * clients != size:
            raise ValueError(
                f"scale mode needs each client to hold its own rows of the batch, but this "
                f"client's devices cover {mine} of the {size} coordinates of axis "
                f"{config.batch_axis!r} with {clients} clients; put the batch axis first in the "
                "mesh, or use parity mode (DistributedDataset(dataset, mesh, config))")
        if config.global_batch_size % clients:
            raise ValueError(f"global_batch_size ({config.global_batch_size}) is not divisible "
                             f"by the {clients} clients")
        data = cls(dataset_fn(shard), mesh, config, _clients=clients)
        mesh_lib.check_same_on_all_clients(mesh, float(data.num_batches),
                                           what="batches per epoch (scale mode)")
        data.num_examples = int(data.num_examples * clients)
        data.num_dropped = int(data.num_dropped * clients)
        return data

    def with_steps_per_call(self, n: int) -> "DistributedDataset":
        """The same data stacked ``n`` batches per item (``Trainer``'s automatic steps per call).

        The view shares this dataset's stream: epochs read through either continue one another.
        """
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"steps_per_call must be a positive integer; got {n!r}")
        if n == self.config.steps_per_call:
            return self
        view = copy.copy(self)
        view.config = dataclasses.replace(self.config, steps_per_call=n)
        return view

    def _stream_dataset(self) -> tf.data.Dataset:
        """All epochs as ONE stream of global batches: epoch e is batches e*N .. (e+1)*N - 1.

        One continuing iterator, not one per epoch: with a global seed set (as ``build_model``
        sets it), every new iterator over a pipeline replays the same random numbers, so the
        user's augmentation would repeat each epoch; a continuing stream draws new ones. A finite
        dataset is re-read each epoch (``repeat`` after ``take``, so epochs never straddle), and
        reshuffled each epoch in an order fixed by the seed.
        """
        dataset = self._dataset
        if self.config.shuffle:
            buffer = self.config.shuffle_buffer
            if not self.infinite:
                buffer = max(1, min(buffer, self.num_examples))
            dataset = dataset.shuffle(buffer, seed=_epoch_seed(self.config.seed, 0),
                                      reshuffle_each_iteration=True)
        dataset = dataset.batch(self._rows_per_batch,
                                drop_remainder=self.config.remainder == "drop")
        if not self.infinite:
            dataset = dataset.take(self.num_batches).repeat()
        # tf.data's autotuning off for the stream: destroying an autotuned iterator waits for its
        # optimization loop (gdb: a timed wait in tf.data's Model::OptimizeLoop), and every
        # restart of the stream (a predict or evaluate after a fit, a resume, a repeated epoch)
        # destroyed one: the "prefetch stall" (issue 39: a 2-epoch DenseNet121 fit, then predict:
        # 33-44 s in 4 of 5 runs, 3.6-3.9 s in 2 of 2 without). AUTOTUNE parallelism then takes
        # all cores at once (dtk's own thread already prefetches; BUILD.md, "Stress runs").
        options = tf.data.Options()
        options.autotune.enabled = False
        return dataset.with_options(options)

    def _batches(self, epoch: int, skip_batches: int, *, pad: bool = True) -> Iterator[tuple]:
        """This epoch's global batches as numpy ``(features, labels, weights)``, padded (with
        ``pad=False``, a last partial batch keeps its real rows: ``keras_batches``).

        Continues the stream when the epoch starts where the last one stopped; otherwise (a
        resume, a repeated epoch) restarts it and skips to the position (those batches are read,
        not packed or trained).
        """
        start = epoch * self.num_batches + skip_batches
        stream = self._shared
        if stream.iterator is None or stream.position != start:
            if start:
                # O(start): tf.data cannot jump to a reshuffle or to a random op's state, so the
                # stream is read up to the position (stress runs: BUILD.md, "Stress runs"). Said
                # for a resume (a new stream starting mid-way); a stream moved back by a re-stack
                # (Trainer's steps_per_execution="auto", whose prefetch read ahead) is routine.
                log = _log.info if stream.iterator is None else _log.debug
                log("input: the stream starts at batch %d (epoch %d, batch %d): the %d "
                    "batches before it are read again (not packed) so that the order and the "
                    "pipeline's random draws are an uninterrupted run's; this takes about as "
                    "long as reading them", start, epoch, skip_batches, start)
            dataset = self._stream_dataset().skip(start).prefetch(tf.data.AUTOTUNE)
            stream.position, stream.iterator = start, iter(dataset.as_numpy_iterator())
        for _ in range(self.num_batches - skip_batches):
            element = next(stream.iterator)
            stream.position += 1
            yield self._pad(element, pad=pad)

    def keras_batches(self, epoch: int = 0, *, skip_batches: int = 0,
                      steps_per_call: int = 1) -> Iterator[tuple[int, Any]]:
        """One epoch as the batches Keras's own steps take, packed on the mesh in a background
        thread (``prefetch`` items ahead): items ``(n, data)``, ``data`` being ``(features,
        labels)``, or ``(features, labels, sample_weights)`` for data that carries them.

        What ``fit``/``evaluate``/``predict`` of a ``dtk.distribute`` model read
        (``dtk.train.keras_data``). Full batches are sharded over the batch axis (and the
        sequence axis) as ``epoch`` packs them, ``steps_per_call`` of them stacked ``[n, B, ...]``
        in one item (one pack, as the Trainer's): ``n`` is the item's count of batches, 1 for
        an unstacked batch. The last partial batch of ``remainder="pad"`` data is not padded
        but packed whole on every device (replicated), alone (``n`` = 1), so that Keras's step
        divides its loss by its real examples and every example counts once, with Keras's
        numbers.

        Raises:
          ValueError: scale mode (``from_function``) with ``remainder="pad"``: each client holds
            other rows of the partial batch, which no device can hold whole.
        """
        if self._local and self.config.remainder == "pad" and not self.infinite and \
                self.num_examples % self.config.global_batch_size:
            raise ValueError(
                "InputConfig(remainder='pad') in scale mode (DistributedDataset.from_function) "
                "with Keras's fit/evaluate: the last partial batch is split over the clients, "
                "and Keras's step needs it whole; use remainder='drop', or steps_per_epoch")
        if not 0 <= skip_batches <= self.num_batches:
            raise ValueError(f"skip_batches ({skip_batches}) must be in [0, {self.num_batches}]")
        full, axis = self._rows_per_batch, self.config.batch_axis

        def stacked(parts):
            if len(parts) == 1:
                return 1, pack(self.mesh, parts[0], batch_axis=axis, local=self._local,
                               sequence_axis=self.config.sequence_axis)
            return len(parts), pack(self.mesh, tf.nest.map_structure(lambda *a: np.stack(a),
                                                                     *parts),
                                    batch_axis=axis, stacked=True, local=self._local,
                                    sequence_axis=self.config.sequence_axis)

        def items():
            parts = []
            for element in self._batches(epoch, skip_batches, pad=False):
                data = element[:3] if self._has_weights else element[:2]
                if len(tf.nest.flatten(data[1])[0]) == full:
                    parts.append(data)
                    if len(parts) == steps_per_call:
                        yield stacked(parts)
                        parts = []
                    continue
                if parts:
                    yield stacked(parts)
                    parts = []
                devices = len(self.mesh.local_device_locations())  # the last partial batch
                yield 1, tf.nest.map_structure(lambda a: dtensor.pack(
                    [np.asarray(a)] * devices, dtensor.Layout.replicated(self.mesh, np.ndim(a))),
                                               data)
            if parts:
                yield stacked(parts)

        if self.config.prefetch == 0:
            return items()
        return _prefetch(items(), self.config.prefetch)

    def _check_labels(self, labels) -> None:
        classes = self.config.num_classes or self.implied_classes
        source = (f"InputConfig(num_classes={classes})" if self.config.num_classes else
                  f"the model has {classes} outputs and a sparse loss")
        for leaf in tf.nest.flatten(labels):
            leaf = np.asarray(leaf)
            if leaf.dtype.kind not in "iuf":  # strings: '<' between bytes and int was raw
                kind = "strings" if leaf.dtype.kind in "SUO" else f"{leaf.dtype} values"
                raise ValueError(
                    f"labels are {kind} (e.g. {leaf.flat[0]!r}), not class ids: a "
                    f"sparse loss with {classes} classes ({source}) needs integers in "
                    f"[0, {classes}). Map them to ids in the pipeline (e.g. "
                    "tf_keras.layers.StringLookup(num_oov_indices=0) adapted on the labels)")
            bad = leaf[(leaf < 0) | (leaf >= classes)]
            if bad.size:
                raise ValueError(
                    f"labels hold {bad.size} value(s) outside [0, {classes}) in a batch (e.g. "
                    f"{bad.flat[0]}; {source}); fix the labels or the number of classes (the "
                    "model's outputs)")

    def _pad(self, element: tuple, *, pad: bool = True) -> tuple:
        features, labels = element[0], element[1]
        if self.config.num_classes is not None or getattr(self, "implied_classes", None):
            self._check_labels(labels)
        n = len(tf.nest.flatten(labels)[0])
        weights = (np.asarray(element[2], np.float32) if self._has_weights
                   else np.ones(n, np.float32))
        examples = np.ones(n, np.float32) if self._has_weights else None
        axis = (len(_local_batch_indices(self.mesh, self.config.batch_axis)) if self._local
                else self.mesh.dim_size(self.config.batch_axis))
        unit = axis * getattr(self, "row_multiple", 1)
        padded = -(-n // unit) * unit
        if padded > n and pad:
            pad = lambda a: np.concatenate(  # noqa: E731
                [a, np.zeros((padded - n, *a.shape[1:]), a.dtype)])
            features = tf.nest.map_structure(pad, features)
            labels = tf.nest.map_structure(pad, labels)
            weights = pad(weights)
            examples = None if examples is None else pad(examples)
        return (features, labels, weights) if examples is None else (
            features, labels, weights, examples)

    def _items(self, epoch: int, skip_batches: int) -> Iterator[Batch]:
        n = self.config.steps_per_call
        batches = self._batches(epoch, skip_batches)
        while True:
            parts = [b for _, b in zip(range(n), batches)]
            if not parts:
                return
            if n == 1:
                yield Batch(*pack(self.mesh, parts[0], batch_axis=self.config.batch_axis,
                                  local=self._local, sequence_axis=self.config.sequence_axis))
            else:
                stack = tf.nest.map_structure(lambda *a: np.stack(a), *parts)
                yield Batch(*pack(self.mesh, stack, batch_axis=self.config.batch_axis,
                                  stacked=True, local=self._local,
                                  sequence_axis=self.config.sequence_axis))

    def epoch(self, epoch: int = 0, *, skip_batches: int = 0) -> Iterator[Batch]:
        """One epoch of the stream: the same batches for the same ``(seed, epoch)``.

        Args:
          epoch: the epoch number (picks the shuffle order; for an infinite dataset, the part of
            the stream).
          skip_batches: batches to skip at the start (to resume mid-epoch); not packed or trained.

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

    def global_batches(self, epoch: int = 0) -> Iterator[tuple]:
        """This epoch's global batches as numpy ``(features, labels, weights[, examples])``,
        padded as ``epoch`` packs them, not packed: for a driver that places the rows itself
        (a pipeline splits them into microbatches on its first and last stage)."""
        return self._batches(epoch, 0)


class _Stream:
    """Where the stream of all epochs stands: the next batch index and its iterator."""

    def __init__(self):
        self.position = 0
        self.iterator = None


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
            item = _next_item(buffer)
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        # The producer may be reading the shared stream: let it finish before anyone reads on.
        thread.join(timeout=120)
        if thread.is_alive():
            _log.warning("input: the prefetch thread is still reading its dataset 120 s after "
                         "the epoch was closed; the next epoch starts beside it")


def _next_item(buffer: queue.Queue):
    """The producer's next item (it always puts one: a batch, the end or its error); says so
    every ``STALL_REPORT_S`` that it does not come."""
    waited = 0.0
    while True:
        try:
            return buffer.get(timeout=STALL_REPORT_S)
        except queue.Empty:
            waited += STALL_REPORT_S
            _log.warning("input: no batch for %.0f s; the prefetch thread is still reading and "
                         "packing its dataset (a slow source, a resume reading the batches before "
                         "its position again, or a machine short of CPU)", waited)
