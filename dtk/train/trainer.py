"""The outer loop: ``Trainer.fit / evaluate / predict`` with progress, checkpoints and resume.

The inner loop is ``dtk.train.steps`` (compiled steps); this module owns epochs, evaluation cadence,
checkpoints, callbacks, TensorBoard scalars and progress output, in plain Python around those calls.

Example::

    mesh = dtk.build_mesh("batch=8")
    trainer = dtk.Trainer(mesh=mesh, model=dtk.models.mnist_mlp, layout="data_parallel",
                          optimizer=dtk.make_optimizer("adam", mesh, learning_rate=1e-3),
                          config=dtk.TrainerConfig(seed=0, checkpoint_dir="/tmp/run"))
    history = trainer.fit(train_data, epochs=3, validation_data=test_data)
    print(trainer.evaluate(test_data))   # {'loss': ..., 'accuracy': ..., 'examples': 10000}

Resume: with ``checkpoint_dir`` set, ``fit`` saves at the end of every epoch (and when
``max_steps`` stops it mid-epoch) and, when the directory already holds a checkpoint, restores it
and continues from the saved epoch and batch: the same data order, the same updates, the same
history as an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor
from tensorflow.python.eager import context

from dtk.train import checkpoint as ckpt_lib
from dtk.cluster import env as cluster
from dtk.errors import first_line
from dtk.parallel import experts
from dtk.parallel import layouts as layouts_lib
from dtk.parallel import mesh as mesh_lib
from dtk.parallel import ops as op_support
from dtk.train import optimizers as optimizers_lib
from dtk.train import input_checks
from dtk.train import preemption
from dtk.train import resume as resume_lib
from dtk import keras_check
from dtk.data.input import DataSource, DistributedDataset
from dtk.parallel.mesh import BATCH_AXIS
from dtk.train import steps as steps_lib
from dtk.train.auto_steps import AUTO_MIN_STEPS, AutoSteps
from dtk.train.steps import StepConfig, Steps

_PROGRESS_INTERVAL_S = 0.5  # read metrics (a device sync) at most this often
_log = logging.getLogger("dtk")


# A failed step cancels the process's collective group; TensorFlow cannot reset it in-process.
_RESTART_NOTE = (". A step that fails inside DTensor cancels the process's collectives: restart "
                 "the process to train again (with checkpoint_dir it resumes); checks on the host "
                 "(InputConfig(num_classes=...)) catch bad labels before a step")


class NonFiniteLossError(ValueError):
    """Training stopped because the loss became NaN or infinite."""


def _ensure_console_logging() -> None:
    """Shows dtk's INFO lines on stdout when the application configured no logging at all."""
    if not _log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        _log.addHandler(handler)
        _log.setLevel(logging.INFO)
        _log.propagate = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """Options of the outer loop.

    Attributes:
      seed: seeds weight initialization (identical on every client, which the run relies on).
      steps_per_execution: batches per compiled call: ``"auto"`` (the default) or an integer.
        ``"auto"`` times a few one-step calls at the start of ``fit``, then a few calls of
        ``AUTO_PROBE_STEPS`` stacked batches; what stacking saves gives the per-call overhead,
        and enough batches are stacked per call that it stays under ``AUTO_OVERHEAD_FRACTION``
        of a step (see ``AutoSteps`` and ``choose_steps_per_call``). Clients agree on client
        0's choice. A fit planned for fewer than ``AUTO_MIN_STEPS`` steps runs one per call.
        It needs a ``DistributedDataset`` with ``InputConfig(steps_per_call=1)`` (it re-stacks
        it); data built with ``steps_per_call=n > 1`` runs ``n`` per call. An integer is used
        as given, and the data must then stack as many. Updates, ``max_steps``, checkpoints and
        progress are the same whatever the count (parity-tested).
      jit_compile: compile the steps with XLA.
      shard_optimizer_state: shard optimizer state and the weight update over the batch axis
        (ZeRO-style): True, False or ``"auto"`` (the default; see ``dtk.StepConfig``).
      checkpoint_dir: save every epoch there, and resume from it if it holds a checkpoint.
      max_to_keep: checkpoints kept.
      tensorboard_dir: write per-epoch scalars there (client 0 only).
      max_steps: stop after this many training steps in all (counting steps done before a resume).
      verbose: 0 silent, 1 progress bar, 2 one line per epoch.
      batch_axis: the data-parallel mesh axis, for the steps and the sharded update (the data's
        ``InputConfig.batch_axis`` must be the same).
      stop_on_nan: stop with ``NonFiniteLossError`` (naming the epoch and step) when the loss
        becomes NaN or infinite, like Keras' ``TerminateOnNaN``; checked at every progress update
        and epoch end, so no extra device sync.
      restart_from_scratch: when ``checkpoint_dir`` holds checkpoints, start again from step 0
        instead of resuming (new checkpoints then replace the old ones).
      allow_change: settings a resume may change on purpose (see ``dtk.train.resume``), e.g.
        ``("learning_rate", "seed")``; ``"model"`` allows every model hyper-parameter. Any other
        difference from the checkpoint's settings is a ``ValueError`` listing each. An allowed
        change is applied (a new learning rate is set on the restored optimizer) and reported
        in ``Trainer.resume_changes``.
      settings: more settings that shape the run, recorded in every checkpoint and compared on
        resume like dtk's own (a script adds its data source, e.g. ``{"dataset": "idx"}``).
      setting_names: ``(glob, name)`` pairs: the recorded model settings a glob matches are
        compared, reported and allowed as ``name`` (a script's flag: ``("model.*:Dropout.rate",
        "dropout")`` makes ``--allow_change dropout`` work; ``dtk.train.resume.named``).
      fsdp: store weights, gradients and optimizer state sharded over the batch axis (ZeRO-3,
        ``dtk.parallel.fsdp``); weights are gathered for compute. Same numbers as without.
      remat: layer-name patterns whose activations are recomputed in the backward pass
        (``dtk.parallel.remat``); same numbers, less activation memory, about one more forward pass.
      gradient_accumulation_steps: split each batch into this many microbatches and make one
        update from their summed gradients (see ``dtk.StepConfig``); same numbers as one
        batch, less activation memory. Steps, checkpoints and ``max_steps`` count updates.
      async_checkpoints: write checkpoints in the background (the default): a save copies
        each client's shards of the state to host memory and training goes on while a thread
        writes them; the checkpoint becomes the latest only once complete (``dtk.train.checkpoint``).
        Measured on the LM (dim 512, 4 blocks, 148 MiB per checkpoint, ``batch=8``): training
        stalls 1.1 s per save instead of 3.6 s (``scripts/bench_checkpoint.py``). False writes
        each checkpoint before the next step (no host copy of the state).
      sparse_tables: True updates only the touched rows of the sharded tables (see
        ``dtk.StepConfig``); False (the default) every row.
    """

    seed: int = 0
    steps_per_execution: int | str = "auto"
    jit_compile: bool = False
    shard_optimizer_state: bool | str = "auto"
    checkpoint_dir: str | None = None
    max_to_keep: int = 3
    tensorboard_dir: str | None = None
    max_steps: int | None = None
    verbose: int = 1
    batch_axis: str = BATCH_AXIS
    stop_on_nan: bool = True
    restart_from_scratch: bool = False
    allow_change: tuple[str, ...] = ()
    settings: Mapping[str, Any] | None = None
    setting_names: tuple[tuple[str, str], ...] = ()
    fsdp: bool = False
    remat: tuple[str, ...] = ()
    gradient_accumulation_steps: int = 1
    async_checkpoints: bool = True
    sparse_tables: bool = False

    def step_config(self) -> StepConfig:
        """The inner loop's options, derived (one source of truth for shared fields)."""
        return StepConfig(jit_compile=self.jit_compile,
                          steps_per_execution=(1 if self.steps_per_execution == "auto"
                                               else self.steps_per_execution),
                          shard_optimizer_state=self.shard_optimizer_state,
                          batch_axis=self.batch_axis,
                          gradient_accumulation_steps=self.gradient_accumulation_steps,
                          remat=tuple(self.remat), sparse_tables=self.sparse_tables)

    def __post_init__(self):
        if not isinstance(self.setting_names, tuple) or not all(
                isinstance(p, tuple) and len(p) == 2 and all(isinstance(x, str) for x in p)
                for p in self.setting_names):
            raise ValueError(f"setting_names must be a tuple of (glob, name) string pairs, e.g. "
                             f"(('model.*:Dropout.rate', 'dropout'),); got "
                             f"{self.setting_names!r}")
        spe = self.steps_per_execution
        if spe != "auto" and (not isinstance(spe, int) or isinstance(spe, bool) or spe < 1):
            raise ValueError(f"steps_per_execution must be 'auto' or a positive integer; got {spe!r}")
        if not isinstance(self.seed, numbers.Integral) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer; got {type(self.seed).__name__} "
                             f"{self.seed!r}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be a positive integer or None; got {self.max_steps}")
        if self.verbose not in (0, 1, 2):
            raise ValueError(f"verbose must be 0, 1 or 2; got {self.verbose!r}")
        if isinstance(self.remat, str):
            raise ValueError(f"remat must be a tuple of layer-name patterns, e.g. "
                             f"(r'block\\d+_attn',); got the string {self.remat!r}")
        if not isinstance(self.remat, (tuple, list)) or not all(
                isinstance(p, str) for p in self.remat):
            raise ValueError(f"remat must be a tuple of layer-name patterns (strings), e.g. "
                             f"(r'block\\d+',); got {self.remat!r}")
        if not isinstance(self.async_checkpoints, bool):
            raise ValueError(f"async_checkpoints must be True or False; got "
                             f"{self.async_checkpoints!r}")
        if not isinstance(self.fsdp, bool):
            raise ValueError(f"fsdp must be True or False; got {self.fsdp!r}")
        self.step_config()  # validates gradient_accumulation_steps and remat
        if isinstance(self.allow_change, str) or not all(
                isinstance(k, str) and k for k in self.allow_change):
            raise ValueError(f"allow_change must be a tuple of setting names, e.g. "
                             f"('learning_rate', 'seed'); got {self.allow_change!r}")


@dataclasses.dataclass
class History:
    """Per-epoch logs, as Keras' ``History``: ``history["loss"][e]`` is epoch e's training loss."""

    epochs: list[int] = dataclasses.field(default_factory=list)
    history: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    def append(self, epoch: int, logs: dict[str, float]) -> None:
        self.epochs.append(epoch)
        for key, value in logs.items():
            self.history.setdefault(key, []).append(float(value))


@dataclasses.dataclass
class Timing:
    """Wall-clock figures of the last ``fit``: first call (with tracing) and windows of steps."""

    first_step_s: float | None = None
    windows: list[tuple[int, float, int]] = dataclasses.field(default_factory=list)  # (steps, s, epoch)

    def ms_per_step_median(self, *, skip_epoch: int | None = None) -> float | None:
        """Median over sync windows of ms per step, leaving out windows of ``skip_epoch``."""
        rates = [1000 * s / n for n, s, e in self.windows if n and e != skip_epoch]
        if not rates and skip_epoch is not None:
            return self.ms_per_step_median()
        return float(np.median(rates)) if rates else None


class Trainer:
    """Trains a laid-out Keras model on a mesh, like ``Model.fit`` (which DTensor cannot run).

    Args:
      mesh: the mesh.
      model: a model factory (a callable returning a new tf_keras model), built here under
        ``layout`` with ``config.seed``; or an already laid-out model (then ``export`` needs
        ``model_factory``).
      layout: a layout table name, path or ``LayoutTable`` (default ``data_parallel``); only used
        with a factory.
      optimizer: a name or a mesh-bound optimizer (see ``dtk.make_optimizer``). None (the
        default): the optimizer the factory's model was compiled with (rebuilt on the mesh from
        its config), else Adam.
      loss: a loss name, a ``tf_keras.losses.Loss`` or a per-example loss function (reductions:
        see ``dtk.make_loss``). None: the compiled loss, else sparse categorical crossentropy on
        logits.
      metrics: a metric name or metric, or a list of them (mesh-bound). None: the compiled
        metrics, else accuracy. Where the model was compiled and an argument is given too, the
        argument wins and one line says so.
      config: ``TrainerConfig``.
      model_factory: the factory of an already built ``model``, for ``export``.
      input_shape: one example's input shape (no batch dim), to build a subclassed model from a
        factory (see ``dtk.build_model``).
      allow_replicated: accept a table that shards no weight of this model (see
        ``dtk.parallel.layouts.plan_weights``).

    Raises:
      TypeError: a Keras 3 object, or a model that is neither a factory nor a laid-out model.
      ValueError: a bad layout plan, a batch axis the mesh lacks, unbound optimizer or metrics.
    """

    def __init__(self, *, mesh: dtensor.Mesh, model: tf_keras.Model | Callable[[], tf_keras.Model],
                 layout: Any = None, optimizer: Any = None, loss: Any = None,
                 metrics: Any = None, config: TrainerConfig = TrainerConfig(),
                 model_factory: Callable[[], tf_keras.Model] | None = None,
                 input_shape: Sequence[int] | None = None, allow_replicated: bool = False):
        if not isinstance(config, TrainerConfig):
            raise TypeError(f"config must be a dtk.TrainerConfig; got {type(config).__name__}")
        mesh = mesh_lib.as_mesh(mesh, "mesh")
        self.mesh = mesh
        self.config = config
        self._input_shape = input_shape
        self.layout_plan = None
        mesh_lib.check_batch_axis(mesh, config.batch_axis, what="TrainerConfig.batch_axis")
        keras_check.require_keras2(model, "model")
        optimizers_lib.check_metrics_form(metrics)  # before the model is built
        if config.verbose:
            _ensure_console_logging()
        if isinstance(model, tf_keras.Model):
            if layout is not None:
                raise ValueError("layout applies only when model is a factory; a built model already "
                                 "has its layouts. Pass the factory (e.g. dtk.models.mnist_mlp)")
            ignored = [name for name, value in (("TrainerConfig.fsdp", config.fsdp),
                                                 ("input_shape", input_shape)) if value]
            if ignored:
                raise ValueError(
                    f"{' and '.join(ignored)} apply only when model is a factory: model "
                    f"{model.name!r} is already built, with its weights laid out, and would "
                    "train without them. Pass the model factory (dtk builds it with them), or "
                    "drop them")
            if not _is_laid_out(model):
                raise ValueError(
                    f"model {model.name!r} is a plain (not laid-out) tf_keras model: its weights "
                    "are not DTensors on the mesh. Pass the model FACTORY instead (a function "
                    "that builds it, e.g. model=dtk.models.mnist_mlp) and dtk lays it out, or "
                    "build it with dtk.build_model")
            self.model, self.model_factory = model, model_factory
        elif callable(model):
            table = layouts_lib.load_table(layout or "data_parallel") if not isinstance(
                layout, layouts_lib.LayoutTable) else layout
            self.model, self.layout_plan = layouts_lib.build_model(
                model, mesh, table, seed=config.seed, input_shape=input_shape,
                allow_replicated=allow_replicated, fsdp=config.fsdp)
            self.model_factory = model
        else:
            raise TypeError(f"model must be a tf_keras.Model or a factory returning one; got "
                            f"{type(model).__name__}")
        if cluster.num_clients() > 1:  # replicated weights silently diverge if seeds differ
            # Summed on the mesh (no weight is gathered whole): a replicated weight is summed
            # on each client, so clients whose copies differ get different checksums.
            checksum = float(sum(float(dtensor.unpack(tf.reduce_sum(tf.cast(
                w.read_value(), tf.float64)))[0]) for w in self.model.weights))
            mesh_lib.check_same_on_all_clients(mesh, checksum, what="the initial weights' checksum")
        loss, optimizer, metrics = _compiled_or_given(self.model, mesh, loss=loss,
                                                      optimizer=optimizer, metrics=metrics)
        self.steps = Steps(self.model, loss=loss, optimizer=optimizer, metrics=metrics, mesh=mesh,
                           config=config.step_config())
        self.optimizer = self.steps.optimizer
        if (getattr(self.model, "_dtk_compiled", None) or {}).get("optimizer") is not None:
            self.model.optimizer = self.optimizer  # as after compile(): the one that trains it
        self.timing = Timing()
        self._progbar, self._progbar_steps, self._epochs = None, 0, 0
        self.history = History()
        self._auto = None
        self._spe = 1 if config.steps_per_execution == "auto" else config.steps_per_execution
        self._stop = preemption.StopSignals()  # installed while fit trains
        self._checkpointer = None
        self._settings: dict[str, Any] = {}
        self.resume_changes: dict[str, dict[str, Any]] = {}
        if config.checkpoint_dir:
            self._checkpointer = ckpt_lib.Checkpointer(
                config.checkpoint_dir, model=self.model, optimizer=self.optimizer,
                metrics=[self.steps.loss_metric, *self.steps.metrics],
                max_to_keep=config.max_to_keep, mesh=mesh,
                asynchronous=config.async_checkpoints)

    # -- training ---------------------------------------------------------------------------------
    @property
    def steps_per_execution(self) -> int:
        """Batches per compiled call in the last ``fit`` (the automatic choice under "auto")."""
        return self._auto.steps_per_call if self._auto is not None else self._spe

    @property
    def run_id(self) -> str | None:
        """The id of the run that writes ``checkpoint_dir`` (a resumed run keeps the id of the
        run it continues); None without checkpoints."""
        return self._checkpointer.run_id if self._checkpointer is not None else None

    @property
    def global_step(self) -> int:
        return int(self.optimizer.iterations.numpy())

    def _check_data(self, data: Any, *, stacked: int, where: str = "data") -> None:
        if not isinstance(data, DataSource):
            raise TypeError(
                f"{where}: data must be a dtk.DistributedDataset (or another dtk.data.input."
                f"DataSource); got {type(data).__name__}. Wrap a tf.data.Dataset of unbatched (features, labels) "
                "with dtk.DistributedDataset(dataset, mesh, dtk.InputConfig(global_batch_size="
                "...)); numpy arrays first with tf.data.Dataset.from_tensor_slices((x, y))")
        if data.mesh is not self.mesh and data.mesh != self.mesh:
            raise ValueError("data is packed on another mesh than the trainer's; build the "
                             "DistributedDataset with the trainer's mesh")
        if data.config.batch_axis != self.config.batch_axis:
            raise ValueError(
                f"data is sharded on axis {data.config.batch_axis!r} (InputConfig.batch_axis) but "
                f"the trainer's batch axis is {self.config.batch_axis!r} (TrainerConfig.batch_axis)"
                "; set both to the same mesh axis")
        got = data.config.steps_per_call
        if got != stacked:
            raise ValueError(
                f"data stacks steps_per_call={got} batches per item but the trainer runs "
                f"steps_per_execution={stacked}; build the training data with "
                f"InputConfig(steps_per_call={stacked}) (evaluation data with 1)")
        _check_label_kind(self.steps.loss_fn, getattr(data, "label_dtypes", ()))
        example = getattr(data, "example_spec", None)
        if example is not None and "train_step" not in self.steps.custom:
            input_checks.check_features(self.model, example[0], where)
            input_checks.check_targets(self.model, self.steps.loss_fn, example[1], where)
        if _is_sparse_loss(self.steps.loss_fn) and hasattr(data, "implied_classes") and \
                data.config.num_classes is None:
            outputs = getattr(self.model, "outputs", None) or []
            if len(outputs) == 1 and outputs[0].shape[-1] and outputs[0].shape[-1] > 1:
                data.implied_classes = int(outputs[0].shape[-1])  # ids checked before the step
        if not data.num_batches:
            raise ValueError(
                f"data has no batches: {data.num_examples} example(s) with global_batch_size="
                f"{data.config.global_batch_size} and remainder={data.config.remainder!r} give 0 "
                "steps per epoch; use a smaller global batch size or remainder='pad'")

    def fit(self, train_data: Any, *, epochs: int, validation_data: Any = None,
            on_epoch_end: Sequence[Callable[[int, dict], Any]] = (),
            on_step_end: Sequence[Callable[[int], Any]] = ()) -> History:
        """Trains for ``epochs`` epochs (resuming from ``checkpoint_dir`` if it holds a checkpoint).

        Args:
          train_data: a ``dtk.data.input.DistributedDataset`` (``steps_per_call`` equal to the trainer's
            ``steps_per_execution``).
          epochs: total epochs, counting epochs done before a resume.
          validation_data: evaluated at the end of every epoch (``val_`` logs).
          on_epoch_end: callables ``f(epoch, logs)``. One that sets ``trainer.model.stop_training
            = True`` (as Keras's EarlyStopping does) ends training after that epoch; a model's
            own ``train_step`` may set it too.
          on_step_end: callables ``f(global_step)`` after every compiled call.

        Returns:
          The ``History`` of all epochs, including those restored from a checkpoint. When
          ``max_steps`` stops training mid-epoch, that epoch's logs so far are its last entry.
        """
        if not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs must be a positive integer; got {epochs!r}")
        spe = self.config.steps_per_execution
        self._auto = None
        if spe == "auto":
            spe = train_data.config.steps_per_call if isinstance(train_data, DataSource) else 1
            planned = epochs * getattr(train_data, "num_batches", 0)
            if self.config.max_steps is not None:
                planned = min(planned, self.config.max_steps)
            # Calibrating costs a trace or two (~1-2 s): only worth it for a run long enough.
            if spe == 1 and isinstance(train_data, DistributedDataset) and \
                    planned >= AUTO_MIN_STEPS and "train_step" not in self.steps.custom:
                self._auto = AutoSteps(self.mesh, verbose=bool(self.config.verbose))
        self._spe = spe
        self._check_data(train_data, stacked=spe, where="fit(train_data=...)")
        if "train_step" in self.steps.custom and getattr(train_data.config, "remainder",
                                                          None) == "pad":
            raise ValueError(
                f"model {type(self.model).__name__} overrides train_step, which receives (x, y) "
                "and cannot tell padding from examples, but the training data pads its last "
                "batch (InputConfig(remainder='pad')); use remainder='drop' for training")
        if hasattr(train_data, "row_multiple"):  # a padded last batch splits into microbatches
            train_data.row_multiple = self.config.gradient_accumulation_steps
        steps_lib.check_accumulation(train_data.config.global_batch_size, self.mesh,
                                     self.config.gradient_accumulation_steps, self.config.batch_axis)
        if validation_data is not None:  # before the first step, not after the first epoch
            self._check_data(validation_data, stacked=1, where="fit(validation_data=...)")
        steps_per_epoch = train_data.num_batches
        self.history = History()
        self._settings = self._named(resume_lib.settings(
            seed=self.config.seed, optimizer=self.optimizer, model=self.model, data=train_data,
            mesh=",".join(f"{k}={v}" for k, v in mesh_lib.mesh_axis_sizes(self.mesh).items()),
            num_clients=cluster.num_clients(), extra=self.config.settings))
        self._check_allow_change()  # a typo is refused now, not at a resume runs later
        epoch, skip = self._resume(steps_per_epoch)
        if self._checkpointer is not None and self._checkpointer.restored and \
                (epoch >= epochs or self._done()) and cluster.is_lead_client():
            _log.warning("the run is already complete: %s is at epoch %d of %d (step %d); "
                         "nothing is trained, the model is the finished run's (raise epochs%s "
                         "to train further)", self._checkpointer.restored, epoch, epochs,
                         self.global_step, "/max_steps" if self.config.max_steps else "")
        dropped = train_data.num_dropped
        if dropped and self.config.verbose and cluster.is_lead_client():
            _log.info("Training drops %d of %d examples per epoch (remainder='drop': the global "
                      "batch size does not divide the data)", dropped, train_data.num_examples)
        writer = self._summary_writer()
        self.timing = Timing()
        self._epochs = epochs
        self.model.stop_training = False  # as Keras's fit: a callback or train_step may set it
        # SIGTERM/SIGINT: saved at the next step boundary, then Preempted (dtk.train.preemption)
        self._stop = preemption.StopSignals()
        if self._checkpointer is not None:
            self._stop.install()
        try:
            self._fit_epochs(train_data, epoch, skip, epochs, steps_per_epoch, validation_data,
                             writer, on_epoch_end, on_step_end)
        finally:
            self._stop.uninstall()
        return self.history

    def _fit_epochs(self, train_data, epoch, skip, epochs, steps_per_epoch, validation_data,
                    writer, on_epoch_end, on_step_end) -> None:
        while epoch < epochs and not self._done():
            if skip == 0:
                self.steps.reset_metrics()
            logs, stopped = self._run_epoch(train_data, epoch, skip, steps_per_epoch, on_step_end)
            skip = 0
            if stopped:  # max_steps reached mid-epoch: save the position, keep metric states
                batch_in_epoch = self.global_step - epoch * steps_per_epoch
                self._save(epoch, batch_in_epoch, steps_per_epoch)
                # The partial epoch is reported (not saved: a resume recomputes the whole epoch).
                self.history.append(epoch, logs)
                self._log_epoch(epoch, epochs, logs, writer, partial=True)
                break
            if validation_data is not None:
                logs.update({f"val_{k}": v for k, v in self.evaluate(validation_data).items()})
            self.history.append(epoch, logs)
            self._save(epoch + 1, 0, steps_per_epoch)
            self._log_epoch(epoch, epochs, logs, writer)
            if on_epoch_end and self._checkpointer is not None:
                self._checkpointer.wait()  # callbacks (Ray's report) see this epoch's checkpoint
            for callback in on_epoch_end:
                callback(epoch, logs)
            epoch += 1
            if self._stop.signum is not None:  # saved at this epoch's end
                break
            if getattr(self.model, "stop_training", False):  # EarlyStopping's way, as in Keras
                _log.info("training stopped after epoch %d: model.stop_training was set", epoch)
                break
        if self._checkpointer is not None:
            self._checkpointer.wait()  # the last asynchronous save is complete and recorded
        if self._stop.signum is not None and epoch < epochs and not self._done():
            saved = None  # (a signal after the last step lets the run end as it would)
            if self._checkpointer is not None:
                saved = self._checkpointer.latest
                self._checkpointer.close()  # the directory's lock is released
                self._checkpointer = None
            raise preemption.Preempted(self._stop.signum, saved, self.global_step)
        stopped = bool(getattr(self.model, "stop_training", False))
        if getattr(self.optimizer, "use_ema", False) and (epoch >= epochs or stopped):
            # As Keras's fit ends: the weights become their moving average (Adam(use_ema=True))
            self.optimizer.finalize_variable_values(self.model.trainable_variables)

    def _epoch_header(self, epoch: int, steps_per_epoch: int) -> str:
        """Keras's "Epoch 2/6", or, for a run counted in steps (``max_steps`` ends it before its
        epochs do, as the LM's ``--steps`` with ``--eval_every``), "Steps 101-200 of 600"."""
        last = self.config.max_steps
        if last is None or last > self._epochs * steps_per_epoch:
            return f"Epoch {epoch + 1}/{self._epochs}"
        first = epoch * steps_per_epoch + 1
        return f"Steps {first}-{min(first + steps_per_epoch - 1, last)} of {last}"

    def _done(self) -> bool:
        return self.config.max_steps is not None and self.global_step >= self.config.max_steps

    def _run_epoch(self, data, epoch, skip, steps_per_epoch, on_step_end):
        progbar = self._progbar = None
        if self.config.verbose == 1 and cluster.is_lead_client():
            # To a log (stdout not a terminal), whole lines, one every 30 s and the epoch's last:
            # Keras's bar redraws itself with backspaces on any POSIX system, which a log file
            # keeps, every 0.05 s (1,464 redraws in one line of the recommender's log). Its
            # lines then start with a newline: the header's ends there.
            tty = hasattr(sys.stdout, "isatty") and sys.stdout.isatty()
            print(self._epoch_header(epoch, steps_per_epoch), end="\n" if tty else "")
            # Finished by _log_epoch with the epoch's figures (validation's too): one line each.
            progbar = self._progbar = tf_keras.utils.Progbar(
                steps_per_epoch, interval=0.05 if tty else LOG_PROGRESS_INTERVAL_S,
                stateful_metrics=[*self._metric_names(), "val_loss", "val_examples",
                                  *(f"val_{n}" for n in self._metric_names())])
            progbar._dynamic_display = tty  # pylint: disable=protected-access
        try:
            return self._epoch_loop(data, epoch, skip, steps_per_epoch, on_step_end, progbar)
        except tf.errors.OpError as e:
            context.async_clear_error()  # else every later DTensor call in the process fails
            unsupported = op_support.explain_failure(str(e), self.model)
            if unsupported:
                raise ValueError(unsupported) from e
            # A step that fails on one device cancels the others' collectives, and the error
            # reported may be a cancellation: an id outside a row-sharded table is then found
            # by the forward pass alone.
            found = None if op_support.ID_OUTSIDE in str(e) else self._diagnose_ids()
            hint = ""
            if found:
                e = found
            elif op_support.ID_OUTSIDE not in str(e):
                hint = self._tables_hint()
            # DTensor runs steps asynchronously: the failure may surface a step or two later.
            try:
                where = f", at or before step {self.global_step + 1}"
            except tf.errors.OpError:  # the failed step poisoned the step counter too
                context.async_clear_error()
                where = ""
            raise ValueError(f"a step failed in epoch {epoch + 1}{where}: {first_line(e)}"
                             f"{hint}{_RESTART_NOTE}") from e

    def _tables_hint(self) -> str:
        """For a step whose reported error is a cancelled collective (another device's op failed
        first, and DTensor reported the cancellation): the row-sharded tables, whose id check
        is the usual cause."""
        tables = [(layer.name, int(layer.input_dim)) for layer in self.model._flatten_layers()  # pylint: disable=protected-access
                  if getattr(layer, "_dtk_table_layout", None) is not None]
        if not tables:
            return ""
        named = ", ".join(f"Embedding {name} ({rows} rows)" for name, rows in tables[:4])
        return (f" (where the error is a cancelled collective, an op on another device failed "
                f"first. This model looks up tables sharded on their rows, {named}: "
                f"{op_support.ID_OUTSIDE} a table fails so, in a new process; check that every "
                "id is below its table's rows)")

    def _diagnose_ids(self) -> tf.errors.OpError | None:
        """The error of the last batch's forward pass, where it finds an id outside a table
        sharded on its rows (``ops.row_sharded_lookup``'s check), else None."""
        batch = getattr(self, "_last_batch", None)
        if batch is None or not any(getattr(layer, "_dtk_table_layout", None) is not None
                                    for layer in self.model._flatten_layers()):  # pylint: disable=protected-access
            return None
        features = batch[0]
        steps = [features] if not _is_stacked(batch) else [
            tf.nest.map_structure(lambda t, i=i: t[i], features) for i in range(_num_steps(batch))]
        for one in steps:
            try:
                self.steps.predict(one)
            except tf.errors.OpError as e:
                context.async_clear_error()
                if op_support.ID_OUTSIDE in str(e):
                    return e
        return None

    def _epoch_items(self, data, epoch, skip):
        """The epoch's items; under ``steps_per_execution="auto"``, re-stacked as it decides.

        A change of count takes effect where the stacks line up with the epoch (no short stack,
        which would cost another trace); the stream then continues from that batch.
        """
        auto = self._auto
        if auto is None:
            yield from data.epoch(epoch, skip_batches=skip)
            return
        done = skip
        while done < data.num_batches:
            n = auto.steps_per_call
            source = data if n == 1 else data.with_steps_per_call(n)
            items = source.epoch(epoch, skip_batches=done)
            try:
                for item in items:
                    yield item
                    done += _num_steps(item)
                    new = auto.steps_per_call
                    if new != n and done % new == 0 and done < data.num_batches:
                        break
                else:
                    return
            finally:
                items.close()  # stops the prefetch thread before the stream is read again

    def _epoch_loop(self, data, epoch, skip, steps_per_epoch, on_step_end, progbar):
        done = skip
        window_steps, window_start = 0, time.perf_counter()
        for batch in self._epoch_items(data, epoch, skip):
            n = _num_steps(batch)
            if self.config.max_steps is not None:
                left = self.config.max_steps - self.global_step
                if left < n:
                    batch, n = _first_steps(batch, left), left
            start = time.perf_counter()
            self._last_batch = batch  # for a failed step's diagnosis (_diagnose_ids)
            loss = self.steps.train(batch, stacked=_is_stacked(batch))
            if self.timing.first_step_s is None:
                float(loss)
                self.timing.first_step_s = time.perf_counter() - start
                window_start = time.perf_counter()
            else:
                window_steps += n
                if self._auto is not None and not self._auto.decided:
                    float(loss)  # a calibration call: timed to the end
                    self._auto.observe(time.perf_counter() - start, n, steps_per_epoch)
                    window_steps, window_start = 0, time.perf_counter()
            done += n
            for callback in on_step_end:
                callback(epoch * steps_per_epoch + done)
            if self._done() or self._stop.signum is not None:
                break
            if time.perf_counter() - window_start >= _PROGRESS_INTERVAL_S:
                results = self._results(epoch)  # syncs
                window_steps, window_start = self._close_window(window_steps, window_start, epoch)
                if progbar is not None:
                    progbar.update(done, list(results.items()))
        logs = self._results(epoch)
        self._close_window(window_steps, window_start, epoch)
        self._progbar_steps = done
        return logs, (self._done() or self._stop.signum is not None) and done < steps_per_epoch

    def _results(self, epoch: int) -> dict[str, float]:
        """Metric values (a device sync); stops training on a non-finite loss if configured."""
        results = self.steps.results()
        if self.config.stop_on_nan and not math.isfinite(results.get("loss", 0.0)):
            raise NonFiniteLossError(
                f"the training loss became {results['loss']} in epoch {epoch + 1}, by step "
                f"{self.global_step}; lower the learning rate, check the data for NaN or "
                "infinite values, or clip gradients (e.g. make_optimizer(..., "
                "global_clipnorm=1.0)). TrainerConfig(stop_on_nan=False) trains on regardless")
        return results

    def _close_window(self, steps: int, start: float, epoch: int) -> tuple[int, float]:
        """Records a timing window ending now (after a sync); returns a fresh one."""
        now = time.perf_counter()
        if steps:
            self.timing.windows.append((steps, now - start, epoch))
        return 0, now

    def _metric_names(self) -> list[str]:
        return [m.name for m in [self.steps.loss_metric, *self.steps.metrics]]

    # -- checkpoints ------------------------------------------------------------------------------
    def _resume(self, steps_per_epoch: int) -> tuple[int, int]:
        if self._checkpointer is None:
            return 0, 0
        if self.config.restart_from_scratch:
            if cluster.is_lead_client() and self._checkpointer.candidates():
                _log.warning("restart_from_scratch: removing the checkpoints in %s",
                             self._checkpointer.directory)
                self._checkpointer.clear()
            return 0, 0
        try:
            state = self._checkpointer.restore()
        except ValueError as e:
            # Another architecture: where a setting that shapes the model changed (the number
            # of experts, the width), name the setting rather than the weights' shapes.
            candidates = self._checkpointer.candidates()
            recorded = ckpt_lib.state_of(candidates[0]) if candidates else None
            if "does not match this model" not in str(e) or not (recorded or {}).get("settings"):
                raise
            diff = resume_lib.changes(self._named(recorded["settings"]), self._settings)
            model_keys = {k: v for k, v in diff.items() if k.startswith("model")}
            if not model_keys:
                raise
            raise ValueError(
                f"{first_line(e).split('. ')[0].split(': it holds')[0]}: the model's settings "
                f"changed ({resume_lib.describe(model_keys)}), which changes its weights; "
                "resume with the settings the checkpoint was written with, or use a new "
                "checkpoint directory") from e
        if state is None:
            return 0, 0
        self._check_settings(state.get("settings"))
        self.steps.sync_update_state()
        experts.reset_routing_stats(self.model)  # the interval's statistics start here
        epoch, skip = int(state["epoch"]), int(state["batch_in_epoch"])
        if state.get("steps_per_epoch") != steps_per_epoch and self.resume_changes:
            # A change allowed on purpose (the batch size, the data) moved the epoch's batches:
            # the run goes on from an epoch boundary, and says what that costs.
            if skip:
                if cluster.is_lead_client():
                    _log.warning(
                        "Resuming with %s changed: the epoch's batches moved (%s steps per epoch, "
                        "now %d), so the run goes on at epoch %d; the last %d of epoch %d's %s "
                        "batches were not trained", ", ".join(self.resume_changes),
                        state.get("steps_per_epoch"), steps_per_epoch, epoch + 2,
                        int(state.get("steps_per_epoch") or 0) - skip, epoch + 1,
                        state.get("steps_per_epoch"))
                epoch, skip = epoch + 1, 0
        elif state.get("steps_per_epoch") != steps_per_epoch:
            raise ValueError(
                f"checkpoint {self._checkpointer.restored} was written with {state.get('steps_per_epoch')}"
                f" steps per epoch, but this data gives {steps_per_epoch}: the data or the global "
                "batch size changed, so the run cannot resume at the same position. Use the same "
                "data and batch size, or a new checkpoint directory")
        if self._auto is not None and state.get("auto_steps_per_call"):
            self._auto.set(int(state["auto_steps_per_call"]))
        self.history = History(epochs=list(state["history"]["epochs"]),
                               history={k: list(v) for k, v in state["history"]["logs"].items()})
        if cluster.is_lead_client() and self.config.verbose:
            _log.info("Resumed from %s: epoch %d, batch %d, step %d", self._checkpointer.restored,
                      epoch + 1, skip, self.global_step)
        return epoch, skip

    def _named(self, record: dict[str, Any]) -> dict[str, Any]:
        return resume_lib.named(record, self.config.setting_names)

    def _check_allow_change(self) -> None:
        """Every name in ``allow_change`` is a setting this run records (on a fresh run too).

        Raises:
          ValueError: naming the unknown names and the recorded settings closest to them.
        """
        unknown = [name for name in self.config.allow_change
                   if not any(resume_lib.is_allowed(k, [name]) for k in self._settings)]
        if not unknown:
            return
        import difflib  # pylint: disable=g-import-not-at-top
        close = sorted({m for name in unknown
                        for m in difflib.get_close_matches(name, list(self._settings), n=3,
                                                           cutoff=0.5)})
        hint = (f"closest recorded settings: {', '.join(close)}" if close else
                f"this run records {len(self._settings)} settings (dtk.train.resume.settings)")
        raise ValueError(f"allow_change (--allow_change) names setting(s) {unknown} that this run "
                         f"does not record; {hint}. Give recorded names, or drop them")

    def _check_settings(self, saved: dict[str, Any] | None) -> None:
        """Refuses a resume whose settings differ from the checkpoint's, unless allowed."""
        allowed = resume_lib.check(None if saved is None else self._named(saved), self._settings,
                                   allow_change=self.config.allow_change,
                                   restored=self._checkpointer.restored,
                                   lead=cluster.is_lead_client())
        self.resume_changes.update(allowed)
        new = allowed.get("learning_rate", {}).get("new")
        if isinstance(new, float):  # the restored optimizer holds the checkpoint's rate
            self.optimizer.learning_rate.assign(new)

    def _save(self, epoch: int, batch_in_epoch: int, steps_per_epoch: int) -> None:
        if self._checkpointer is None:
            return
        auto = self._auto.steps_per_call if self._auto is not None and self._auto.decided else None
        self._checkpointer.save({
            "epoch": epoch, "batch_in_epoch": batch_in_epoch, "steps_per_epoch": steps_per_epoch,
            "auto_steps_per_call": auto,  # a resumed run skips the calibration
            "settings": self._settings,  # compared on resume (dtk.train.resume)
            "history": {"epochs": self.history.epochs, "logs": self.history.history},
        }, step=self.global_step)

    # -- evaluation and prediction ----------------------------------------------------------------
    def evaluate(self, data: Any) -> dict[str, float]:
        """Loss and metrics over every example of ``data`` (padding excluded by its weights).

        Returns:
          ``{"loss": ..., <metric>: ..., "examples": <number of real examples counted>}``.
        """
        self._check_data(data, stacked=1)
        custom = "test_step" in self.steps.custom
        if custom and data.num_examples % data.config.global_batch_size:
            raise ValueError(
                f"model {type(self.model).__name__} overrides test_step, which receives (x, y) "
                f"and cannot tell padding from examples, but {data.num_examples} examples do "
                f"not fill whole batches of {data.config.global_batch_size}: give evaluation a "
                "global batch size that divides the number of examples")
        self.steps.reset_metrics()
        try:
            for batch in data.epoch(0):
                self.steps.evaluate(batch)
            results = self.steps.results()
        except tf.errors.OpError as e:
            context.async_clear_error()
            raise ValueError(f"evaluation failed: {first_line(e)}") from e
        results["examples"] = (data.num_examples if custom else
                               int(round(float(self.steps.loss_metric.count.numpy()))))
        self.steps.reset_metrics()
        return results

    def predict(self, data: Any) -> Any:
        """The model's outputs for every real example of ``data``, in order, as ``Model.predict``
        returns them: one numpy array, or the model's dict / list of arrays for a model with
        several outputs (padding of the last batch removed)."""
        self._check_data(data, stacked=1)
        outputs = []
        try:
            for batch in data.epoch(0):
                features, real = batch[0], batch[3] if len(batch) > 3 else None
                real = batch[2] if real is None else real  # padding is 0 (a real example's
                keep = ckpt_lib.global_value(real) > 0     # sample weight may be too)
                outputs.append(tf.nest.map_structure(
                    lambda out: ckpt_lib.global_value(out)[keep], self.steps.predict(features)))
        except tf.errors.OpError as e:
            context.async_clear_error()
            hint = self._tables_hint() if op_support.ID_OUTSIDE not in str(e) else ""
            raise ValueError(f"prediction failed: {first_line(e)}{hint}") from e
        if not outputs:
            return np.zeros((0,))
        return tf.nest.map_structure(lambda *parts: np.concatenate(parts), *outputs)

    def export(self, export_dir: str, *,
               formats: Sequence[str] = ckpt_lib.EXPORT_FORMATS) -> dict[str, str]:
        """Writes the trained weights as a plain ``.keras`` model and a SavedModel
        (``dtk.train.checkpoint.export``; ``formats`` picks which)."""
        if self.model_factory is None:
            raise ValueError("export needs the model factory: pass model_factory= to Trainer when "
                             "giving a built model")
        return ckpt_lib.export(self.model, self.model_factory, export_dir,
                               input_shape=self._input_shape, formats=formats)

    # -- output -----------------------------------------------------------------------------------
    def _summary_writer(self):
        if self.config.tensorboard_dir and cluster.is_lead_client():
            return tf.summary.create_file_writer(self.config.tensorboard_dir)
        return None

    def _log_epoch(self, epoch, epochs, logs, writer, *, partial=False) -> None:
        """The epoch's figures, once: the progress bar's last line (verbose=1, as Keras's fit
        prints them), or one ``epoch i/n`` line (verbose=2)."""
        note = ""
        if partial:
            note = (f" (stopped by {preemption.signal_name(self._stop.signum)})"
                    if self._stop.signum is not None else
                    f" (stopped at max_steps={self.config.max_steps})")
        if self._progbar is not None:  # (a count of examples is no average: in the logs only)
            self._progbar.update(self._progbar_steps, [(k, v) for k, v in logs.items()
                                                       if not k.endswith("examples")],
                                 finalize=True)
            self._progbar = None
            if note:
                _log.info("epoch %d/%d%s", epoch + 1, epochs, note)
        elif cluster.is_lead_client() and self.config.verbose:
            text = " - ".join(f"{k}: {int(v)}" if k.endswith("examples") else f"{k}: {v:.4f}"
                              for k, v in logs.items())
            _log.info("epoch %d/%d - %s%s", epoch + 1, epochs, text, note)
        if writer is not None:
            with writer.as_default():
                for key, value in logs.items():
                    tf.summary.scalar(key, value, step=epoch + 1)
            writer.flush()


_DEFAULTS = {"loss": "sparse_categorical_crossentropy", "optimizer": "adam",
             "metrics": ["accuracy"]}


def _compiled_or_given(model, mesh, *, loss, optimizer, metrics):
    """What the step trains with: each argument given, else what the factory compiled the model
    with (the optimizer rebuilt on the mesh from its config), else dtk's default."""
    compiled = dict(getattr(model, "_dtk_compiled", None) or {})
    given = {"loss": loss, "optimizer": optimizer, "metrics": metrics}
    chosen = {}
    for name in ("loss", "optimizer", "metrics"):
        if given[name] is not None:
            if compiled.get(name) is not None and cluster.is_lead_client():
                _log.info("Trainer: using the %s passed to Trainer; the model's compiled %s (%s) "
                          "is not used", name, name, _describe(compiled[name]))
            chosen[name] = given[name]
        elif compiled.get(name) is not None:
            chosen[name] = compiled[name]
            if name == "loss":
                chosen[name] = _compiled_loss(compiled)
            if name == "optimizer":
                cls, config = compiled[name]
                if issubclass(cls, tf_keras.optimizers.legacy.Optimizer) or not issubclass(
                        cls, tf_keras.optimizers.Optimizer):
                    raise ValueError(
                        f"the model was compiled with optimizer {cls.__name__}, which cannot be "
                        "bound to a DTensor mesh; pass optimizer=dtk.make_optimizer(name, mesh, "
                        "...) to Trainer, or compile with a tf_keras.optimizers optimizer")
                config = {k: v for k, v in config.items() if k != "is_legacy_optimizer"}
                chosen[name] = cls.from_config({**config, "mesh": mesh})
        elif name == "metrics" and compiled.get("optimizer") is not None:
            chosen[name] = []  # compiled without metrics: Keras reports the loss alone
        else:
            chosen[name] = _DEFAULTS[name]
    return chosen["loss"], chosen["optimizer"], chosen["metrics"]


def _compiled_loss(compiled: dict) -> Any:
    """The loss a factory compiled, with Keras's meaning: names as ``tf_keras.losses.get`` reads
    them (probabilities unless from_logits is set, not dtk's shorthand for its own logit
    models), and per-output dicts or lists with their ``loss_weights``."""
    def keras_meaning(loss):
        if not isinstance(loss, str):
            return loss
        try:
            return tf_keras.losses.get(loss)
        except ValueError as e:
            raise ValueError(f"the model was compiled with loss {loss!r}, which tf_keras does not "
                             f"know: {e}") from e

    loss = compiled["loss"]
    if isinstance(loss, str) or not (hasattr(loss, "keys") or isinstance(loss, (list, tuple))
                                     or optimizers_lib._is_keras_wrapper(loss)):  # pylint: disable=protected-access
        if compiled.get("loss_weights") is not None:
            return optimizers_lib.make_loss(keras_meaning(loss),
                                            loss_weights=compiled["loss_weights"])
        return keras_meaning(loss)
    per_output = ({k: keras_meaning(v) for k, v in loss.items()} if hasattr(loss, "keys")
                  else [keras_meaning(v) for v in loss])
    return optimizers_lib.make_loss(per_output, loss_weights=compiled.get("loss_weights"),
                                    output_names=compiled.get("output_names"))


def _describe(value) -> str:
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], type):
        return value[0].__name__  # (optimizer class, config)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_describe(v) for v in value) + "]"
    return value if isinstance(value, str) else type(value).__name__


def _is_sparse_loss(loss_fn) -> bool:
    """Whether the loss takes integer class ids (sparse categorical crossentropy)."""
    target = getattr(loss_fn, "fn", loss_fn)
    owner = getattr(target, "__self__", None)
    return isinstance(owner, tf_keras.losses.SparseCategoricalCrossentropy) or getattr(
        target, "__name__", "") == "sparse_categorical_crossentropy"


def _check_label_kind(loss_fn, label_dtypes) -> None:
    """Float labels with a sparse (integer class id) loss would be truncated: refuse them."""
    if _is_sparse_loss(loss_fn) and any(d.is_floating for d in label_dtypes):
        raise ValueError(
            f"labels are {', '.join(sorted({d.name for d in label_dtypes}))}, but the loss is "
            "sparse categorical crossentropy, which takes integer class ids (floats would be "
            "truncated); cast the labels to int (dataset.map(lambda x, y: (x, tf.cast(y, "
            "tf.int64)))), or use a loss for float targets (e.g. loss='mse', or "
            "'categorical_crossentropy' with one-hot labels)")


def _is_laid_out(model: tf_keras.Model) -> bool:
    """Whether the model's weights are DTensor variables (a plain model's are not)."""
    if not model.weights:
        return False
    variable = getattr(model.weights[0], "_variable", model.weights[0])
    try:
        return dtensor.fetch_layout(variable) is not None
    except (tf.errors.InvalidArgumentError, ValueError):
        return False


def _is_stacked(batch) -> bool:
    """Whether an item is a stack ``[n, B, ...]`` of batches (its weights are 2-D)."""
    return batch[2].shape.rank == 2


def _num_steps(batch) -> int:
    """Steps held by one item of data: 1, or the leading dim of a stacked batch."""
    return int(batch[2].shape[0]) if _is_stacked(batch) else 1


# A progress line a log (not a terminal) gets every this many seconds, and one at each epoch end.
LOG_PROGRESS_INTERVAL_S = 30.0

def _first_steps(batch, n: int):
    """The first ``n`` batches of a stacked batch (for ``max_steps`` inside a stack)."""
    index = tf.range(n)
    parts = (None if t is None else tf.nest.map_structure(lambda x: tf.gather(x, index), t)
             for t in batch)  # features may be a dict; examples may be None
    return type(batch)(*parts) if hasattr(batch, "_fields") else tuple(parts)
