"""The seams both Kerases share on the mesh: a model's mesh state and its compiled calls.

``dtk.distribute`` (tf_keras) and ``dtk.enable_keras_distribution`` (Keras 3) each hand Keras's own
step to these, so that batch checks, packing (a batch split over the batch axis, a last partial
batch replicated, each client packing its own rows) and several steps per call are written once:

* ``MeshState``: the mesh, its batch axis, and the per-model state of a run (the sharded update,
  microbatches, batches a resume skips, what runs when ``fit`` ends), with the checks of a
  ``fit``/``evaluate``/``predict`` call made before Keras starts;
* ``next_batches``: up to ``steps_per_execution`` batches from Keras's iterator, on the host;
* ``MeshCalls``: the step as one ``tf.function`` per batch shape, and ``n`` stacked batches as one
  compiled loop.
"""

from __future__ import annotations

import itertools
import logging
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from dtk.data.input import pack
from dtk.parallel import ops
from dtk.train import host_inputs
from dtk.keras_check import require_keras2

_log = logging.getLogger("dtk")


_DTENSOR_REFUSALS = (tf.errors.UnknownError, tf.errors.UnimplementedError,
                     tf.errors.InvalidArgumentError, tf.errors.InternalError)


class MeshState:
    def __init__(self, mesh: dtensor.Mesh, batch_axis: str):
        self.mesh, self.batch_axis = mesh, batch_axis
        self.size = mesh.dim_size(batch_axis)
        self.accumulation = 1  # microbatches per batch (distribute's gradient_accumulation_steps)
        self.sharded: Any = None  # distribute's _ShardedUpdate (shard_optimizer_state)
        # Batches of the epoch a resume starts inside (CheckpointCallback after a stop at a
        # step boundary): already trained, so the next train call reads past them first.
        self.skip_batches = 0
        # Run when fit returns or raises (Keras calls on_train_end only when it returns):
        # CheckpointCallback's signal handlers and the directory's lock are released.
        self.at_fit_end: list[Callable[[], Any]] = []
        self.host: Any = None  # leading string preprocessing layers run on the host
        # A fit's DistributedDataset (dtk.train.keras_data): its training adapter claims it,
        # and reads epoch start_epoch + the epochs ended (fit's initial_epoch, or a resume's).
        self.fit_data: Any = None
        self.start_epoch = 0
        # Epochs the next shuffle of arrays draws past (a host variable; dtk.distribute's fit
        # with CheckpointCallback and shuffle=True), set by the callback when it resumes.
        self.shuffle_epoch: tf.Variable | None = None
        # distribute(sparse_tables=True): the tables' sparse update (dtk.train.sparse), and a
        # step's gradients of its lookups and the touched rows' changes, inside the trace.
        self.sparse_mode = False
        self.auto_steps = False  # compile(steps_per_execution="auto"): dtk.train.auto_steps
        self.aligning = False  # its one shorter call after the choice (the stacks line up after)
        self.sparse: Any = None
        self.sparse_pending: Any = None
        self.sparse_changes: Any = None
        self.random_ops_checked = False  # the train step's uncovered random ops named, once

    def end_fit(self) -> None:
        self.skip_batches = 0
        while self.at_fit_end:
            self.at_fit_end.pop()()

    def check_call(self, method: str, batch_size: Any, callbacks: Any, *, y: Any = None,
                   class_weight: Any = None, validation_split: Any = None,
                   keras2: bool = True) -> None:
        """Refuses, before Keras starts, what would fail inside a step on the mesh (where a
        failure cancels the process's collectives) or train silently wrong: a ``batch_size`` the
        batch axis cannot divide, Keras 3 callbacks, TensorBoard's weight histograms, string
        labels, class weights that miss a label, a ``validation_split`` outside [0, 1).

        Raises:
          ValueError: naming the argument, its value, the axis and its size, and the fix.
          TypeError: a Keras 3 callback (``keras2``), a ``batch_size`` that is not an integer.
        """
        for callback in tf.nest.flatten(callbacks) if callbacks is not None else ():
            if keras2:  # (Keras 3's own fit, dtk.enable_keras_distribution, takes Keras 3's)
                require_keras2(callback,
                               f"{method}(callbacks=[...]) entry {type(callback).__name__}")
            if type(callback).__name__ == "TensorBoard" and (
                    callback.histogram_freq or callback.embeddings_freq):
                raise ValueError(
                    f"{method}(callbacks=[TensorBoard(histogram_freq={callback.histogram_freq}, "
                    f"embeddings_freq={callback.embeddings_freq})]): TensorBoard's weight "
                    "histograms and embeddings read the weights as one host tensor, which a "
                    "weight laid out on the mesh is not; pass histogram_freq=0 and "
                    "embeddings_freq=0 (losses, metrics and the learning rate are logged)")
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(
                batch_size, (int, np.integer)) or batch_size < 1):
            raise TypeError(f"{method}(batch_size={batch_size!r}): batch_size must be a positive "
                            f"integer, a multiple of mesh axis {self.batch_axis!r}'s size "
                            f"{self.size}")
        if validation_split is not None and not 0 <= validation_split < 1:
            raise ValueError(f"{method}(validation_split={validation_split!r}): the fraction of "
                             "the data held out must be in [0, 1) (e.g. 0.2)")
        labels = y if isinstance(y, np.ndarray) else None
        if labels is not None and labels.dtype.kind in "SUO":
            raise ValueError(
                f"{method}(y=...): labels are strings (e.g. {labels.flat[0]!s}), not class ids; "
                "map them to integers first (e.g. tf_keras.layers.StringLookup, or "
                "np.unique(y, return_inverse=True))")
        if isinstance(class_weight, dict) and labels is not None and labels.size and \
                labels.dtype.kind in "iuf":
            ids = labels.argmax(-1) if labels.ndim > 1 and labels.shape[-1] > 1 else labels
            missing = sorted(set(np.unique(ids.astype(np.int64)).tolist()) - set(class_weight))
            if missing:
                raise ValueError(
                    f"{method}(class_weight={class_weight!r}) has no weight for class(es) "
                    f"{missing[:8]} found in y; give every class a weight (1.0 for unchanged)")
        if (method == "fit" and isinstance(batch_size, (int, np.integer)) and self.accumulation > 1
                and batch_size % self.size == 0 and batch_size % (self.accumulation * self.size)):
            raise ValueError(
                f"fit(batch_size={batch_size}) with gradient_accumulation_steps="
                f"{self.accumulation}: mesh axis {self.batch_axis!r} (size {self.size}) gives each "
                f"device {batch_size // self.size} rows, which {self.accumulation} microbatches "
                f"cannot split; use a multiple of {self.accumulation * self.size}")
        if isinstance(batch_size, (int, np.integer)) and batch_size % self.size:
            fits = [b for b in (batch_size - batch_size % self.size,
                                batch_size + self.size - batch_size % self.size) if b > 0]
            raise ValueError(
                f"{method}(batch_size={batch_size}): mesh axis {self.batch_axis!r} of size "
                f"{self.size} cannot split it evenly over its devices; use a multiple of "
                f"{self.size} (e.g. {' or '.join(map(str, fits))}). A last batch smaller than "
                "batch_size (the data's remainder) is fine: dtk runs it whole on every device, "
                "with Keras's numbers")

    def pack(self, data: Any, *, local: bool = False) -> Any:
        """A batch from Keras's data adapter, on the mesh: sharded over the batch axis on dim 0
        when the axis divides it (``dtk.data.input.pack``, which takes each local device's rows
        from its coordinates, on any mesh and client count), else replicated (the last partial
        batch: every device computes the whole of it, so its numbers are Keras's; one more
        trace). ``local``: the batch holds this client's rows only (Keras 3's per-process
        batches)."""
        present = [t for t in tf.nest.flatten(data) if t is not None]
        arrays = [t.numpy() if hasattr(t, "numpy") else np.asarray(t) for t in present]
        rows = {a.shape[0] for a in arrays if a.ndim}
        share = self.size // self.clients_on_axis() if local else self.size
        if len(rows) == 1 and next(iter(rows)) % share == 0 and all(a.ndim for a in arrays):
            packed = iter(pack(self.mesh, arrays, batch_axis=self.batch_axis, local=local))
        elif local:
            raise ValueError(
                f"a batch of {sorted(rows)} rows on this client cannot be split over its "
                f"{share} device(s) of mesh axis {self.batch_axis!r}: with several processes "
                "each batch must fill every device (batch the dataset with "
                "drop_remainder=True, or a global batch size that is a multiple of "
                f"{self.size})")
        else:
            local = len(self.mesh.local_device_locations())
            packed = iter(dtensor.pack([a] * local, dtensor.Layout.replicated(self.mesh, a.ndim))
                          for a in arrays)
        return tf.nest.map_structure(lambda t: None if t is None else next(packed), data)


    def clients_on_axis(self) -> int:
        """How many clients hold distinct rows of the batch axis."""
        from dtk.cluster import env as cluster  # pylint: disable=g-import-not-at-top
        local = {loc[self.batch_axis] for loc in self.mesh.local_device_locations()}
        return max(1, min(cluster.num_clients(), self.size // max(1, len(local))))

    def stackable(self, datas: list, *, local: bool = False) -> int:
        """How many of ``datas``, from the first, can run as one compiled call of several steps:
        batches of the first one's structure and shapes that the batch axis divides (a last
        partial batch runs on its own)."""
        def shapes(data):
            leaves = tf.nest.flatten(data)
            return tuple(None if t is None else tuple(t.shape) for t in leaves)

        first = shapes(datas[0])
        rows = {s[0] for s in first if s is not None and len(s)}
        share = self.size // self.clients_on_axis() if local else self.size
        if len(rows) != 1 or any(s is not None and not s for s in first) or \
                next(iter(rows)) % share:
            return 1
        count = 1
        while count < len(datas) and shapes(datas[count]) == first:
            count += 1
        return count

    def pack_stack(self, datas: list, *, local: bool = False) -> Any:
        """``datas`` (batches of one structure and shape) stacked ``[n, B, ...]`` on the mesh,
        sharded over the batch axis on dim 1 (``dtk.data.input.pack(stacked=True)``)."""
        leaves = [tf.nest.flatten(d) for d in datas]
        stacked = [None if column[0] is None else np.stack(
            [t.numpy() if hasattr(t, "numpy") else np.asarray(t) for t in column])
            for column in zip(*leaves)]
        present = [a for a in stacked if a is not None]
        packed = iter(pack(self.mesh, present, batch_axis=self.batch_axis, stacked=True,
                           local=local))
        return tf.nest.pack_sequence_as(
            datas[0], [None if a is None else next(packed) for a in stacked])


def next_batches(iterator: Any, count: int) -> list:
    """Up to ``count`` batches from Keras's data iterator (a Python iterator or a
    ``tf.data.Iterator``), on the host; ``StopIteration`` when it has none."""
    batches = []
    for _ in range(count):
        try:
            batches.append(iterator.get_next() if isinstance(iterator, tf.data.Iterator)
                           else next(iterator))
        except (StopIteration, tf.errors.OutOfRangeError):
            if not batches:
                raise StopIteration  # pylint: disable=raise-missing-from
            break
    return batches


def user_code_autograph():
    """Marks AutoGraph as enabled for the user code that a step compiled with
    ``MeshCalls(autograph=False)`` calls.

    AutoGraph rewrites a function's source before tracing: converting dtk's own step wrappers
    (five functions, no Python control flow on tensors) cost about 1.3 s of a 1.8 s first
    ``fit`` of the MNIST MLP, once per compiled function. Keras converts a subclassed layer's
    ``call``, a function loss and a metric's ``update_state`` only when the AutoGraph status is
    enabled, so the step runs under that status: user code is converted as under Keras's own
    ``tf.function``, dtk's code, like Keras's, is not. (A model's own ``train_step`` is
    converted by the caller: ``convert_user_step``.)
    """
    from tensorflow.python.autograph.core import ag_ctx  # pylint: disable=g-import-not-at-top
    return ag_ctx.ControlStatusCtx(status=ag_ctx.Status.ENABLED)


def convert_user_step(step: Callable) -> Callable:
    """A model's own ``train_step``/``test_step``/``predict_step``, converted by AutoGraph as
    Keras's ``tf.function`` converts it (its Python ``if``/``for`` on tensors become graph
    control flow) for a step compiled with ``MeshCalls(autograph=False)``."""
    return tf.__internal__.autograph.tf_convert(step, user_code_autograph())


# DTensor's SPMD compilation outlines control flow into functions named after the op
# ('dtk_steps_12_body', 'while6_cond') and registers them in the process's eager context. When
# DTensor compiles a step function a second time (its cache key changed: a small integer input it
# folded as a constant on the first call changed), the second compilation can bring a function
# of the same name with other contents, and the call fails before it runs (seen about once per
# full suite, BUILD.md): nothing has run, so tracing again (new loop names) and calling again
# is safe.
_STALE_FUNCTION = re.compile(r"Cannot add function '([^']+)' because a different function with "
                             r"the same name already exists")
_STALE_RETRIES = 2
_LOOPS = itertools.count()  # a loop name no other loop of the process has


@tf.autograph.experimental.do_not_convert
class MeshCalls:
    """A Keras step (``body``: a batch on the mesh -> its logs) compiled for the mesh, called on
    host batches: the compiled function of both Kerases' ``make_*_function`` seams.

    Several batches in one call (``steps_per_execution``) of one shape run as one compiled call
    that loops over them stacked ``[n, B, ...]`` (``tf.gather`` of step i: indexing fails under
    DTensor): the same updates as n calls, with one dispatch, as dtk's Trainer runs them. The
    loop carries the step's logs from zeros laid out as a one-step call's. A last partial batch
    runs on its own.
    """

    def __init__(self, body: Callable, state: "MeshState", *, reduce_retracing: bool,
                 local: bool = False, autograph: bool = True):
        self.state, self.local = state, local
        step = body

        def body(data):  # pylint: disable=function-redefined
            ops.constants_on_mesh(state.mesh)
            if autograph:
                return step(data)
            with user_code_autograph():
                return step(data)

        self._logs_layouts: list = []

        def many_body(stack):
            ops.constants_on_mesh(state.mesh)
            n = int(next(t for t in tf.nest.flatten(stack) if t is not None).shape[0])
            structure, layouts_ = self._logs_layouts[0]
            zeros = tf.nest.pack_sequence_as(structure, [
                dtensor.call_with_layout(tf.zeros, layout, shape=shape, dtype=dtype)
                for layout, shape, dtype in layouts_])

            def loop(i, _):
                data = tf.nest.map_structure(
                    lambda t: None if t is None else tf.gather(t, i), stack)
                return i + 1, body(data)

            return tf.while_loop(lambda i, _: i < n, loop, (tf.constant(0), zeros),
                                 name=f"dtk_steps_{next(_LOOPS)}")[1]

        def make() -> None:
            self.traced = tf.function(body, reduce_retracing=reduce_retracing,
                                      autograph=autograph)
            self.traced_many = tf.function(many_body, reduce_retracing=False,
                                           autograph=autograph)

        self._make = make
        make()
        self._fresh = True

    def _retrying(self, name: str, arg: Any) -> Any:
        """``self.<name>(arg)``, made again (a fresh trace) and called again when the call fails
        on a stale DTensor function name (``_STALE_FUNCTION``); other errors propagate."""
        retries = 0
        while True:
            try:
                return getattr(self, name)(arg)
            except tf.errors.InvalidArgumentError as e:
                found = _STALE_FUNCTION.search(str(e))
                if found is None or retries == _STALE_RETRIES:
                    raise
                retries += 1
                tf.experimental.async_clear_error()
                _log.info("DTensor could not register function %r of a recompiled step (a name "
                          "from an earlier compilation); tracing the step again", found.group(1))
                self._make()

    def _remember_layouts(self, outputs) -> None:
        """The one-step call's logs, as the loop's starting values: all DTensors, else several
        steps per call run as one call each."""
        if self._logs_layouts:
            return
        leaves = tf.nest.flatten(outputs)
        if leaves and all(isinstance(t, tf.Tensor) and dtensor.is_dtensor(t) for t in leaves):
            self._logs_layouts.append((outputs, [(dtensor.fetch_layout(t), t.shape, t.dtype)
                                                 for t in leaves]))
        else:
            self._logs_layouts.append(None)

    def __call__(self, datas: list) -> Any:
        state, outputs = self.state, None
        if state.host is not None:  # leading string preprocessing, on the host
            datas = [host_inputs.apply(state.host, d) for d in datas]
        if len(datas) > 1 and not self._fresh and self._logs_layouts[0] is not None:
            stacked = state.stackable(datas, local=self.local)
            if stacked > 1:
                outputs = self._retrying("traced_many", state.pack_stack(datas[:stacked],
                                                                         local=self.local))
                datas = datas[stacked:]
        for data in datas:
            outputs = self._one(state.pack(data, local=self.local))
        return outputs

    def run_pieces(self, pieces: list) -> Any:
        """Batches packed on the mesh already (a ``DistributedDataset``'s, packed in its
        prefetch thread: ``dtk.train.keras_data``): items ``(n, data)``, a stack of ``n``
        batches run as one compiled loop, or one batch. The first call runs its first batch
        alone (the one-step trace gives the loop its logs' layouts); a step whose logs are not
        all DTensors runs one call per batch."""
        outputs = None
        for n, data in pieces:
            if n == 1:
                outputs = self._one(data)
                continue
            start = 0
            if self._fresh or self._logs_layouts[0] is None:
                outputs, start = self._one(batch_of(data, 0)), 1
            if self._logs_layouts[0] is None:
                for i in range(start, n):
                    outputs = self._one(batch_of(data, i))
            elif start < n:
                outputs = self._retrying("traced_many",
                                         data if start == 0 else batch_of(data, start, n))
        return outputs

    def _one(self, batch: Any) -> Any:
        """One step on one batch on the mesh."""
        if self.traced.experimental_get_tracing_count() and not self._fresh:
            return self._retrying("traced", batch)
        # Variables Keras makes in the first trace (metrics' state, built on first use) are
        # made on the mesh, replicated: one not on it computes wrong values there. (Only
        # then: the scope costs about a millisecond a call.)
        with dtensor.default_mesh(self.state.mesh):
            try:
                outputs = self._retrying("traced", batch)
            except _DTENSOR_REFUSALS as e:  # DTensor expands the step before it runs
                message = ops.explain_failure(e, graph=self.traced.get_concrete_function(
                    batch).graph)
                if message is None:
                    raise
                raise ValueError(message) from None
        self._fresh = False
        self._remember_layouts(outputs)
        return outputs


def batch_of(stack: Any, start: int, stop: int | None = None) -> Any:
    """Batch ``start`` of a packed stack ``[n, B, ...]``, or its batches ``start:stop`` stacked."""
    def take(t):
        if t is None:
            return None
        if stop is None:
            return tf.gather(t, tf.constant(start))
        # (a longer index is no constant DTensor broadcasts by itself: placed on the mesh)
        index = dtensor.copy_to_mesh(tf.range(start, stop),
                                     dtensor.Layout.replicated(dtensor.fetch_layout(t).mesh, 1))
        return tf.gather(t, index)

    return tf.nest.map_structure(take, stack)
