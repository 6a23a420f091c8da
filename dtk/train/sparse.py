"""Sparse row updates of sharded embedding tables: only the rows a step touched.

A recommender's tables are most of its weights, and a step looks up a few thousand of their
millions of rows. A dense update (the gradient as a full table, the optimizer over every row and
every slot) costs time and memory in proportion to the table; TorchRec's fused optimizers update
only the touched rows. dtk does the same for tables sharded on their rows (``dtk.parallel.ops``
looks them up block by block) or on their columns (DTensor's own gather); replicated tables,
small by the layout table's choice, keep the dense update:

* The gradient reaches the update as ``[n, dim]`` rows (n ids of the global batch), never at full
  size: the step differentiates the loss with respect to each lookup's output, not the table.
* The ids and their gradient rows are all-gathered over the batch axis (``n x dim``), sorted, and
  the rows of repeated ids summed (static shapes: DTensor lays out no dynamic ``tf.unique``).
* Each touched row's optimizer state is read block by block (one all-reduce of ``[n, dim]`` over
  the rows' axis) and the new values computed inside the step; the step returns each
  variable's changes laid out like the table (each device receives its own rows' changes).
* After the step, each device adds them to its own block in place (``ResourceScatterAdd`` on the
  variable's per-device resource, ``dtensor.unpack`` of its handle): DTensor lays out no
  in-place scatter, and ``tensor_scatter_nd_add`` inside the step copies each device's whole
  block per variable (2^23 x 16 rows on ``batch=8``: 37 ms a variable, against 1.3 ms in
  place). The scatter leaves the variable in copy-on-read mode, in which each later read copies
  the block (110 ms a step at 2^23 rows): dtk turns it off after each scatter (a buffer that a
  read still holds is then copied before it is changed, TensorFlow's copy-on-write). A stack of
  steps (``steps_per_execution > 1``) runs as one compiled call per step.

The optimizers, with the table's own hyperparameters taken from the model's optimizer:

* ``SGD`` (no momentum): ``row -= lr * g``. The same numbers as the dense update.
* ``Adagrad``: ``acc += g^2; row -= lr * g / sqrt(acc + epsilon)``, as tf_keras's sparse Adagrad.
  The same numbers as the dense update (an untouched row's gradient is zero there too).
* ``Adam`` becomes lazy Adam (TorchRec's and TensorFlow Addons' choice): a touched row's moments
  and weights are updated with the global step's bias correction; an untouched row's moments do
  not decay. Not the numbers of dense Adam, which moves every row with an old gradient every
  step: asked for explicitly (``TrainerConfig(sparse_tables=True)``), never by default.

Asked for with ``TrainerConfig(sparse_tables=True)``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor

from dtk.parallel import materialize
from dtk.parallel import ops

_log = logging.getLogger("dtk")

KINDS = ("sgd", "adagrad", "lazy_adam")


def optimizer_kind(optimizer) -> tuple[str | None, str]:
    """The sparse update that equals (or, for Adam, replaces) ``optimizer``'s, and why not if None.

    Returns:
      ``(kind, reason)``: kind in ``KINDS`` or None, with the reason a sparse update cannot serve.
    """
    options = [name for name in ("clipnorm", "clipvalue", "global_clipnorm")
               if getattr(optimizer, name, None)]
    if getattr(optimizer, "weight_decay", None):
        options.append("weight_decay")
    if getattr(optimizer, "use_ema", False):
        options.append("use_ema")
    if options:
        return None, f"its {', '.join(options)} would need the tables' gradients at full size"
    opt = tf_keras.optimizers
    if type(optimizer) is opt.SGD:  # pylint: disable=unidiomatic-typecheck
        if getattr(optimizer, "momentum", 0.0) or getattr(optimizer, "nesterov", False):
            return None, "SGD with momentum moves untouched rows too"
        return "sgd", ""
    if type(optimizer) is opt.Adagrad:  # pylint: disable=unidiomatic-typecheck
        return "adagrad", ""
    if type(optimizer) is opt.Adam:  # pylint: disable=unidiomatic-typecheck
        if getattr(optimizer, "amsgrad", False):
            return None, "amsgrad keeps a running maximum for every row"
        return "lazy_adam", ""
    return None, (f"{type(optimizer).__name__} has no sparse row update in dtk (sparse updates: "
                  "SGD without momentum, Adagrad, Adam as lazy Adam)")


@dataclasses.dataclass
class _Table:
    layer: tf_keras.layers.Embedding
    variable: tf.Variable  # the float32 table (under mixed precision, the AutoCastVariable's own)
    layout: dtensor.Layout
    slots: dict[str, tf.Variable]


class SparseTables:
    """The sharded tables of one model that a step updates sparsely, and their optimizer state.

    The state variables have the table's layout (each device holds its rows' state) and are
    attributes of the optimizer, so checkpoints save and restore them with it.
    """

    def __init__(self, model: tf_keras.Model, optimizer, kind: str, batch_axis: str):
        if kind not in KINDS:
            raise ValueError(f"sparse update kind must be one of {KINDS}; got {kind!r}")
        self.kind = kind
        self.optimizer = optimizer
        self.batch_axis = batch_axis
        self.tables: list[_Table] = []
        slots = {}
        for layer in sharded_tables_of(model):
            _record_lookups(layer)
            variable = getattr(layer.embeddings, "_variable", layer.embeddings)
            layout = dtensor.fetch_layout(variable)
            own = {}
            names = {"sgd": (), "adagrad": ("accumulator",), "lazy_adam": ("m", "v")}[kind]
            for name in names:
                init = (getattr(optimizer, "initial_accumulator_value", 0.1)
                        if name == "accumulator" else 0.0)
                # Made on each device: a slot made under the layout kept its initial value's
                # buffer shared, and the first in-place update copied the whole block.
                own[name] = dtensor.DVariable(
                    materialize.local_fill(layout, variable.shape, variable.dtype, init),
                    trainable=False, name=f"{layer.name}_sparse_{name}")
                slots[f"{layer.name}/{name}"] = own[name]
            layer._dtk_sparse = True  # pylint: disable=protected-access  (ops records its lookups)
            self.tables.append(_Table(layer=layer, variable=variable, layout=layout, slots=own))
        # Tracked by the optimizer: tf.train.Checkpoint(optimizer=...) saves and restores them.
        optimizer._dtk_sparse_table_slots = slots  # pylint: disable=protected-access
        self.table_ids = {id(t.variable) for t in self.tables}
        self._scatter_fn = None

    def is_table(self, variable) -> bool:
        return id(getattr(variable, "_variable", variable)) in self.table_ids

    def start_recording(self) -> None:
        """Before the forward pass: each table's layer appends its (ids, output) pairs."""
        for table in self.tables:
            table.layer._dtk_lookups = []  # pylint: disable=protected-access

    def lookups(self) -> list[tuple[tf.Tensor, tf.Tensor]]:
        """After the forward pass: the (ids, output) pairs of every table, in table order; the
        tables record nothing after it (evaluation, prediction) until the next
        ``start_recording``."""
        out = []
        for table in self.tables:
            pairs = table.layer._dtk_lookups  # pylint: disable=protected-access
            if not pairs:
                raise ValueError(
                    f"Embedding {table.layer.name!r} was not called in the forward pass, so its "
                    "sparse update has no rows; call every table, or pass "
                    "TrainerConfig(sparse_tables=False)")
            out.append(pairs)
            table.layer._dtk_lookups = None  # pylint: disable=protected-access
        return out

    def outputs(self, recorded) -> list[tf.Tensor]:
        return [o for pairs in recorded for _, o in pairs]

    def apply(self, recorded, output_grads: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """Inside the step: the new values of the touched rows of every table and its state.

        Returns the pending updates, which ``scatter`` adds in place after the step (DTensor lays
        out no in-place scatter): per variable, the table's local row ids ``[n]`` and the
        changes ``[shards, n, dim]``, sharded like the table on dims 0 and 2, so that each device
        receives the changes of its own rows only (zeros for the ids it does not own).
        """
        grads = iter(output_grads)
        step = tf.cast(self.optimizer.iterations, tf.float32) + 1.0
        lr = self.optimizer._learning_rate  # pylint: disable=protected-access
        if isinstance(lr, tf_keras.optimizers.schedules.LearningRateSchedule):
            lr = lr(self.optimizer.iterations)
        lr = tf.cast(lr, tf.float32)
        pending = []
        for table, pairs in zip(self.tables, recorded):
            ids, rows = [], []
            for lookup_ids, _ in pairs:
                g = next(grads)
                if g is None:  # the table does not reach the loss
                    g = tf.zeros([*lookup_ids.shape, table.variable.shape[1]], tf.float32)
                ids.append(tf.reshape(lookup_ids, [-1]))
                rows.append(tf.reshape(tf.cast(g, tf.float32), [-1, table.variable.shape[1]]))
            pending += self._update(table, tf.concat(ids, 0) if len(ids) > 1 else ids[0],
                                    tf.concat(rows, 0) if len(rows) > 1 else rows[0], lr, step)
        return pending

    def _update(self, table: _Table, ids, grads, lr, step) -> list[tf.Tensor]:
        mesh = table.layout.mesh
        rows_axis, cols_axis = table.layout.sharding_specs
        shards = 1 if rows_axis == dtensor.UNSHARDED else mesh.dim_size(rows_axis)
        per = table.variable.shape[0] // shards
        ids = dtensor.relayout(tf.cast(ids, tf.int32), dtensor.Layout.replicated(mesh, 1))
        grads = dtensor.relayout(grads, dtensor.Layout.replicated(mesh, 2))
        unique, summed, valid = _sum_repeated(ids, grads)
        # Pinned replicated: the owners' layout below must not propagate into the sort.
        unique = dtensor.relayout(unique, dtensor.Layout.replicated(mesh, 1))
        summed = dtensor.relayout(summed, dtensor.Layout.replicated(mesh, 2))
        valid = valid[:, None]
        # Which block owns each touched row, laid out on the rows' axis: device s keeps the
        # changes of its own rows and zeros for the others (they add nothing to its rows).
        owned = dtensor.relayout(tf.one_hot(unique // per, shards, axis=0),
                                 dtensor.Layout([rows_axis, dtensor.UNSHARDED], mesh))
        changes_layout = dtensor.Layout([rows_axis, dtensor.UNSHARDED, cols_axis], mesh)
        local = unique % per

        def read(variable):
            if shards == 1:  # sharded on its columns: DTensor gathers from it
                return tf.gather(variable, unique)
            return ops.row_sharded_lookup(variable, unique, table.layout, None)

        def change(delta):
            # expand_dims, not [None]: DTensor's StridedSlice fails on the owners' layout. (A
            # product, not tf.where, which failed in DTensor here: a NaN change would reach the
            # other blocks' row of the same local index, as a NaN gradient reaches every row.)
            return dtensor.relayout(tf.expand_dims(owned, 2) * tf.expand_dims(delta, 0),
                                    changes_layout)

        o = self.optimizer
        if self.kind == "sgd":
            deltas = [-lr * summed]
        elif self.kind == "adagrad":
            squared = summed * summed
            new_acc = read(table.slots["accumulator"]) + squared
            deltas = [-lr * summed / tf.sqrt(new_acc + o.epsilon), squared]
        else:  # lazy Adam, tf_keras Adam's formula on the touched rows
            b1, b2 = tf.cast(o.beta_1, tf.float32), tf.cast(o.beta_2, tf.float32)
            m_old, v_old = read(table.slots["m"]), read(table.slots["v"])
            m_new = m_old + (summed - m_old) * (1 - b1)
            v_new = v_old + (summed * summed - v_old) * (1 - b2)
            alpha = lr * tf.sqrt(1 - tf.pow(b2, step)) / (1 - tf.pow(b1, step))
            zero = tf.zeros_like(m_new)
            deltas = [tf.where(valid, -m_new * alpha / (tf.sqrt(v_new) + o.epsilon), zero),
                      tf.where(valid, m_new - m_old, zero), tf.where(valid, v_new - v_old, zero)]
        out = []
        for delta in deltas:
            out += [tf.identity(local), change(delta)]
        return out

    def _variables(self) -> list[tf.Variable]:
        """The variables ``apply``'s pending updates are for, in its order."""
        names = {"sgd": (), "adagrad": ("accumulator",), "lazy_adam": ("m", "v")}[self.kind]
        return [v for t in self.tables for v in (t.variable, *(t.slots[n] for n in names))]

    def scatter(self, pending: Sequence[tf.Tensor]) -> None:
        """After the step: adds ``apply``'s changes to each device's own rows, in place.

        Each variable's per-device resource (``dtensor.unpack`` of its handle) gets one
        ``ResourceScatterAdd`` of ``n`` rows on its own device: the cost is the rows a step
        touched, whatever the table's size. Inside the step, DTensor would copy every device's
        whole block for each variable (``tensor_scatter_nd_add`` on a variable's value; 2^23 x 16
        rows on ``batch=8``: 37 ms per variable against 1.3 ms in place).
        """
        if self._scatter_fn is None:
            handles = [dtensor.unpack(v.handle) for v in self._variables()]
            devices = [[h.device for h in hs] for hs in handles]

            @tf.function
            def scatter_fn(pending):
                for i, (hs, devs) in enumerate(zip(handles, devices)):
                    for h, dev, local, delta in zip(hs, devs, pending[2 * i],
                                                    pending[2 * i + 1]):
                        with tf.device(dev):
                            tf.raw_ops.ResourceScatterAdd(
                                resource=h, indices=local,
                                updates=tf.reshape(delta, [-1, delta.shape[-1]]))
                            # A scatter puts the variable in copy-on-read mode: every later
                            # read (the next step's lookups) would copy the whole block.
                            tf.raw_ops.DisableCopyOnRead(resource=h)
                return tf.constant(0)

            self._scatter_fn = scatter_fn
        self._scatter_fn([dtensor.unpack(t) for t in pending])


def _sum_repeated(ids: tf.Tensor, grads: tf.Tensor):
    """Sums the gradient rows of repeated ids, in static shapes.

    Returns ``(unique [n], summed [n, dim], valid [n])``: the first ``u`` entries are the distinct
    ids in ascending order with their summed rows; the rest are padding (id 0, zero rows,
    ``valid`` False). Example: ids [7, 2, 7] give unique [2, 7, 0], summed [g1, g0 + g2, 0].
    """
    n = tf.shape(ids)[0]
    order = tf.argsort(ids, stable=True)
    sorted_ids = tf.gather(ids, order)
    starts = tf.concat([tf.ones([1], tf.int32),
                        tf.cast(sorted_ids[1:] != sorted_ids[:-1], tf.int32)], 0)
    segment = tf.cumsum(starts) - 1
    summed = tf.math.unsorted_segment_sum(tf.gather(grads, order), segment, n)
    count = segment[-1] + 1
    valid = tf.range(n) < count
    # each segment's id, from its first entry (DTensor lays out no UnsortedSegmentMax)
    unique = tf.math.unsorted_segment_sum(sorted_ids * starts, segment, n)
    return unique, summed, valid


def tables_of(model: tf_keras.Model) -> list[tf_keras.layers.Embedding]:
    """The model's Embedding layers whose tables are sharded on their rows (looked up by dtk)."""
    return [layer for layer in model._flatten_layers(include_self=False)  # pylint: disable=protected-access
            if isinstance(layer, tf_keras.layers.Embedding)
            and getattr(layer, "_dtk_table_layout", None) is not None]


def sharded_tables_of(model: tf_keras.Model) -> list[tf_keras.layers.Embedding]:
    """The Embedding layers whose tables are sharded on their rows or their columns: the tables
    a sparse update serves (a replicated table is small enough for the dense update)."""
    out = []
    for layer in model._flatten_layers(include_self=False):  # pylint: disable=protected-access
        if not isinstance(layer, tf_keras.layers.Embedding):
            continue
        table = getattr(layer.embeddings, "_variable", layer.embeddings)
        try:
            layout = dtensor.fetch_layout(table)
        except (ValueError, TypeError, tf.errors.OpError):  # not a DTensor (a plain build)
            continue
        if any(spec != dtensor.UNSHARDED for spec in layout.sharding_specs):
            out.append(layer)
    return out


def _record_lookups(layer: tf_keras.layers.Embedding) -> None:
    """Makes a column-sharded table's layer record its (ids, output) pairs, as dtk's lookup of a
    row-sharded table does (``ops._row_sharded_embedding_call``)."""
    if getattr(layer, "_dtk_table_layout", None) is not None or \
            getattr(layer, "_dtk_records", False):
        return
    keras_call = layer.call

    def call(inputs):
        out = keras_call(inputs)
        if getattr(layer, "_dtk_lookups", None) is not None:  # a training step's forward pass
            ids = inputs if inputs.dtype in (tf.int32, tf.int64) else tf.cast(inputs, tf.int32)
            layer._dtk_lookups.append((ids, out))  # pylint: disable=protected-access
        return out

    layer.call = call
    layer._dtk_records = True  # pylint: disable=protected-access


def choose(model: tf_keras.Model, optimizer, mode: bool, *, batch_axis: str,
           accumulation: int = 1, custom_step: bool = False) -> tuple[SparseTables | None, str]:
    """The sparse tables of ``model`` under ``StepConfig.sparse_tables`` (``mode``), or None with
    the reason the tables are updated dense.

    True: sparse for SGD, Adagrad and Adam (as lazy Adam), refused otherwise; False: dense.

    Raises:
      ValueError: ``mode=True`` with an optimizer, option or step that has no sparse update.
    """
    if not mode:
        return None, "the default"
    if not sharded_tables_of(model):
        tables = [layer.name for layer in model._flatten_layers()  # pylint: disable=protected-access
                  if isinstance(layer, tf_keras.layers.Embedding)]
        if tables:  # asked for, and not had: said, since lazy Adam's numbers differ from Adam's
            _log.warning("sparse_tables=True: no Embedding table of this model is sharded on "
                         "this mesh (%s replicated), so its tables are updated dense, by the "
                         "optimizer as it is (Adam, not lazy Adam); shard the tables' rows or "
                         "columns in the layout table for sparse row updates",
                         ", ".join(tables[:4]))
        return None, "no Embedding table is sharded on this mesh"
    kind, reason = optimizer_kind(optimizer)
    blockers = [why for why, on in (
        ("gradient accumulation (gradient_accumulation_steps > 1)", accumulation > 1),
        ("the model's own train_step", custom_step)) if on]
    if kind is None or blockers:
        raise ValueError(
            f"sparse_tables=True: {reason or blockers[0]}. Sparse row updates serve SGD "
            "without momentum, Adagrad and Adam (as lazy Adam), without clipping, weight "
            "decay, EMA or accumulation; change the optimizer, or pass sparse_tables=False "
            "for the dense update")
    tables = SparseTables(model, optimizer, kind, batch_axis)
    names = ", ".join(t.layer.name for t in tables.tables)
    _log.info("sparse row updates (%s) for the sharded tables: %s", kind, names)
    return tables, ""
