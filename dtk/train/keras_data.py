"""``dtk.DistributedDataset`` as a Keras data adapter: ``model.fit(dataset)`` on a ``dtk.distribute`` model.

Keras's ``fit``, ``evaluate`` and ``predict`` turn their ``x`` into batches through a data adapter
(``tf_keras``'s ``data_adapter.ALL_ADAPTER_CLS``). This one takes a ``DistributedDataset`` and
keeps what it adds over a batched ``tf.data`` dataset:

* background packing: each batch is laid out on the mesh in the dataset's prefetch thread
  (``DistributedDataset.keras_batches``), so a step never waits for its batch's packing;
* per-client reading: in scale mode (``DistributedDataset.from_function``) each client reads and
  packs only its own rows;
* every example counted: the last partial batch of ``remainder="pad"`` data is given whole to
  every device (not padded), so Keras's step divides its loss by its real examples;
* exact resume: epoch ``e`` of a shuffled dataset is the same order in every run, and a
  ``CheckpointCallback`` resume starts at the checkpoint's epoch and batch without packing the
  batches before it.

Several steps per call (``compile(steps_per_execution=n)``): the prefetch thread stacks ``n``
batches into one packed item (one pack of ``[n, B, ...]``, as the Trainer's input), and the
compiled call runs them as one loop (``MeshCalls.run_pieces``).

Example::

    model = dtk.distribute(factory, mesh)
    model.compile(optimizer="sgd", loss=..., metrics=["accuracy"], steps_per_execution=8)
    train = dtk.DistributedDataset(train_ds, mesh, dtk.InputConfig(global_batch_size=128,
                                                                   shuffle=True))
    model.fit(train, epochs=3, validation_data=test, callbacks=[dtk.CheckpointCallback(d)])
"""

from __future__ import annotations

from typing import Any

from tf_keras.src.engine import data_adapter

from dtk.data.input import DistributedDataset
from dtk.train.mesh_calls import batch_of


class _Epochs:
    """What the adapter gives Keras as its "dataset": each ``iter()`` is one epoch of batches.

    Keras's ``DataHandler`` calls ``iter()`` once before its first epoch and again at the start
    of every epoch; an iterator starts reading only at its first ``next()``, so the unused one
    reads nothing. The epoch it reads is the run's: the epoch ``fit`` starts at (its
    ``initial_epoch``, or the one a ``CheckpointCallback`` restored) plus the epochs ended since.
    """

    def __init__(self, dataset: DistributedDataset, state: Any, *, training: bool):
        self.dataset, self.state, self.training = dataset, state, training
        self.ended = 0  # epochs Keras ended (the adapter's on_epoch_end)

    def __iter__(self) -> "EpochIterator":
        return EpochIterator(self)


class EpochIterator:
    """One epoch of packed batches, started at its first ``take``.

    Training: the epoch is ``state.start_epoch + ended``; the batches a resume skips
    (``state.skip_batches``, set by ``CheckpointCallback``) are skipped in the stream, unpacked.
    Evaluation and prediction always read epoch 0 (their order does not change). The first
    ``take(count)`` fixes how many batches the prefetch thread stacks per item: ``count``,
    Keras's steps per call, so that each call's batches arrive as one packed stack.
    """

    def __init__(self, epochs: _Epochs):
        self._epochs = epochs
        self._batches = None
        self._pending: list = []  # the rest of a stack a shorter call did not take
        self._epoch, self._done, self._stack = 0, 0, 1  # the epoch, its batches taken, per item

    def __iter__(self):
        return self

    def __next__(self):
        """One batch (Keras's generic protocol; dtk's compiled call uses ``take``)."""
        (n, data), = self.take(1, stack=False)
        return data if n == 1 else batch_of(data, 0)

    def take(self, count: int, *, stack: bool = True) -> list[tuple[int, Any]]:
        """Items ``(n, data)`` holding ``count`` batches in all (fewer at the epoch's end): a
        stack of ``n`` batches ``[n, B, ...]``, or one batch (``n`` = 1).

        Raises:
          StopIteration: the epoch has no batch left.
        """
        if self._batches is None:
            epochs, state = self._epochs, self._epochs.state
            epoch, skip = 0, 0
            if epochs.training:
                epoch = state.start_epoch + epochs.ended
                skip, state.skip_batches = state.skip_batches, 0
            self._epoch, self._done, self._stack = epoch, skip, count if stack else 1
            self._batches = epochs.dataset.keras_batches(
                epoch, skip_batches=skip, steps_per_call=self._stack)
        elif stack and count > 1 and count != self._stack and not self._pending and \
                self._epochs.training and self._done % count == 0 and \
                not getattr(self._epochs.state, "aligning", False):
            # The count changed for the rest of the epoch (steps_per_execution="auto" decided):
            # the stream is stacked again from here, so that the next epochs' calls find their
            # compiled loop traced (and the calls of this one run as one loop, not one by one).
            self.close()
            self._stack = count
            self._batches = self._epochs.dataset.keras_batches(
                self._epoch, skip_batches=self._done, steps_per_call=count)
        pieces, have = [], 0
        while have < count:
            if self._pending:
                n, data = self._pending.pop(0)
            else:
                try:
                    n, data = next(self._batches)
                except StopIteration:
                    if not pieces:
                        raise
                    break
            if have + n > count:  # a shorter call than the stacks (Keras's tuner changed it)
                k = count - have
                self._pending.insert(0, (n - k, batch_of(data, k) if n - k == 1
                                         else batch_of(data, k, n)))
                n, data = k, (batch_of(data, 0) if k == 1 else batch_of(data, 0, k))
            pieces.append((n, data))
            have += n
        self._done += have
        return pieces

    def close(self) -> None:
        """Stops the prefetch thread of an epoch left before its end (``stop_training``)."""
        if self._batches is not None and hasattr(self._batches, "close"):
            self._batches.close()


class OneItem(EpochIterator):
    """What a compiled call reads (``take``) when it is given one item ``(n, data)`` directly,
    not an epoch: ``dtk.Steps`` calls Keras's compiled functions so, one packed batch
    (``n`` = 1) or one stack of ``n`` at a time."""

    def __init__(self, item: tuple[int, Any]):  # pylint: disable=super-init-not-called
        self._item = item

    def take(self, count: int, *, stack: bool = True) -> list[tuple[int, Any]]:  # pylint: disable=unused-argument
        return [self._item]


class DistributedDatasetAdapter(data_adapter.DataAdapter):
    """Keras's adapter for a ``DistributedDataset`` given to a ``dtk.distribute`` model."""

    @staticmethod
    def can_handle(x, y=None):
        return isinstance(x, DistributedDataset) and y is None

    def __init__(self, x, y=None, *, model=None, **kwargs):  # pylint: disable=super-init-not-called
        del y, kwargs  # batch_size, shuffle, sample_weight: the dataset's (checked by distribute)
        state = getattr(model, "_dtk_mesh_state", None)
        if state is None:
            raise ValueError(
                f"a dtk.DistributedDataset is packed on a mesh; model "
                f"{getattr(model, 'name', model)!r} is not laid out on one. Make it with "
                "dtk.distribute(factory, mesh), or give Keras a batched tf.data dataset")
        training = state.fit_data is x  # the fit's training data (its first adapter)
        if training:
            state.fit_data = None
        self._dataset = x
        self._epochs = _Epochs(x, state, training=training)

    def get_dataset(self):
        return self._epochs

    def get_size(self):
        return self._dataset.num_batches

    def batch_size(self):
        return self._dataset.config.global_batch_size

    def has_partial_batch(self):
        return self._dataset.config.remainder == "pad" and bool(
            self._dataset.num_examples % self._dataset.config.global_batch_size)

    def partial_batch_size(self):
        return self._dataset.num_examples % self._dataset.config.global_batch_size or None

    def should_recreate_iterator(self):
        return True

    def on_epoch_end(self):
        self._epochs.ended += 1


def install() -> None:
    """Puts the adapter first in tf_keras's list (once): only it takes a ``DistributedDataset``."""
    if DistributedDatasetAdapter not in data_adapter.ALL_ADAPTER_CLS:
        data_adapter.ALL_ADAPTER_CLS.insert(0, DistributedDatasetAdapter)
