"""``Trainer.fit / evaluate / predict``: a laid-out model trained by Keras's own ``fit``, with dtk's
progress, checkpoints and resume.

The Trainer is a thin layer over ``dtk.distribute``'s seams and tf_keras's ``fit``: the step is
Keras's ``train_step`` (as for any ``dtk.distribute`` model), the data a ``DistributedDataset``
through dtk's Keras data adapter (``dtk.train.keras_data``), and what the Trainer adds are
callbacks any ``fit`` can take: ``dtk.CheckpointCallback`` (exact resume, the run's settings),
``dtk.MaxSteps``, ``dtk.train.progress.ProgressCallback`` (progress lines, timing, stop on NaN,
TensorBoard), and ``compile(steps_per_execution="auto")`` (``dtk.train.auto_steps``).

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
import numbers
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor
from tensorflow.python.eager import context

from dtk.train import checkpoint as ckpt_lib
from dtk.cluster import env as cluster
from dtk.errors import first_line
from dtk.parallel import layouts as layouts_lib
from dtk.parallel import mesh as mesh_lib
from dtk.parallel import ops as op_support
from dtk.train import optimizers as optimizers_lib
from dtk.train import distribute as distribute_lib
from dtk.train import input_checks
from dtk.train.input_checks import check_accumulation
from dtk.train import resume as resume_lib
from dtk import keras_check
from dtk.data.input import DistributedDataset
from dtk.parallel.mesh import BATCH_AXIS
from dtk.train.callbacks import CheckpointCallback, MaxSteps, check_allow_change
# (NonFiniteLossError and Timing: the Trainer's names, kept)
from dtk.train.progress import NonFiniteLossError, ProgressCallback, Timing  # noqa: F401

_log = logging.getLogger("dtk")


# A failed step cancels the process's collective group; TensorFlow cannot reset it in-process.
_RESTART_NOTE = (". A step that fails inside DTensor cancels the process's collectives: restart "
                 "the process to train again (with checkpoint_dir it resumes); checks on the host "
                 "(InputConfig(num_classes=...)) catch bad labels before a step")


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
      jit_compile: refused when True: Keras's step on the mesh is compiled by DTensor's SPMD
        expansion, which dtk does not combine with XLA (no speed-up was measured on CPU).
      shard_optimizer_state: shard optimizer state and the weight update over the batch axis
        (ZeRO-style): True, False or ``"auto"`` (the default; see ``dtk.distribute``).
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
        update from their summed gradients (see ``dtk.distribute``); same numbers as one
        batch, less activation memory. Steps, checkpoints and ``max_steps`` count updates.
      async_checkpoints: write checkpoints in the background (the default): a save copies
        each client's shards of the state to host memory and training goes on while a thread
        writes them; the checkpoint becomes the latest only once complete (``dtk.train.checkpoint``).
        Measured on the LM (dim 512, 4 blocks, 148 MiB per checkpoint, ``batch=8``): training
        stalls 1.1 s per save instead of 3.6 s (``scripts/bench_checkpoint.py``). False writes
        each checkpoint before the next step (no host copy of the state).
      sparse_tables: True updates only the touched rows of the sharded tables (see
        ``dtk.distribute``); False (the default) every row.
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
        k = self.gradient_accumulation_steps
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"gradient_accumulation_steps must be a positive integer; got {k!r}")
        if self.shard_optimizer_state not in (True, False, "auto"):
            raise ValueError(f"shard_optimizer_state must be True, False or 'auto'; got "
                             f"{self.shard_optimizer_state!r}")
        if not isinstance(self.sparse_tables, bool):
            raise ValueError(f"sparse_tables must be True or False; got {self.sparse_tables!r}")
        if self.jit_compile:
            raise ValueError(
                "TrainerConfig(jit_compile=True): the Trainer's step is Keras's, compiled by "
                "DTensor's SPMD expansion, which dtk does not combine with XLA (no speed-up was "
                "measured on CPU); drop jit_compile")
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


class Trainer:
    """Trains a laid-out Keras model on a mesh with Keras's own ``fit``, and dtk's checkpoints,
    resume, progress and summary.

    The model is laid out (``dtk.parallel.layouts.build_model``) and given ``dtk.distribute``'s
    seams (``dtk.train.distribute.prepare``), then compiled with the loss, optimizer and metrics;
    ``fit`` is ``model.fit`` with the Trainer's callbacks. Everything it adds is a piece any
    ``dtk.distribute`` user can take: ``dtk.CheckpointCallback``, ``dtk.MaxSteps``,
    ``ProgressCallback``, ``compile(steps_per_execution="auto")``.

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
      loss: a loss name (dtk's names are losses on logits, ``dtk.make_loss``), a
        ``tf_keras.losses.Loss`` or a function ``(labels, predictions) -> per-example losses``.
        None: the compiled loss (with Keras's meaning), else sparse categorical crossentropy on
        logits.
      metrics: a metric name or metric, or a list of them. None: the compiled metrics, else
        accuracy. Where the model was compiled and an argument is given too, the argument wins
        and one line says so.
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
        fsdp_built = distribute_lib.check_own_train_step(
            self.model, gradient_accumulation_steps=config.gradient_accumulation_steps)
        custom = distribute_lib._overrides(self.model, "train_step")  # pylint: disable=protected-access
        distribute_lib.prepare(
            self.model, mesh, seed=config.seed, remat=tuple(config.remat),
            fsdp=config.fsdp or fsdp_built,
            gradient_accumulation_steps=config.gradient_accumulation_steps,
            # (a model's own train_step applies its gradients to the model's variables itself)
            shard_optimizer_state=False if custom else config.shard_optimizer_state,
            batch_axis=config.batch_axis, sparse_tables=config.sparse_tables)
        state = self.model._dtk_mesh_state  # pylint: disable=protected-access
        self.remat_layers = list(state.remat_layers)
        self.shard_optimizer_state = state.sharded is not None
        compile_args = _compiled_or_given(self.model, mesh, loss=loss, optimizer=optimizer,
                                          metrics=metrics)
        spe = config.steps_per_execution
        with dtensor.default_mesh(mesh):
            self.model.compile(**compile_args, steps_per_execution=spe)
        self.optimizer = self.model.optimizer
        self.loss = self.model.loss
        self.metrics = list(compile_args["metrics"] or [])  # as compiled (names or metrics)
        with dtensor.default_mesh(mesh):  # its state exists before a restore or a plan reads it
            self.optimizer.build(self.model.trainable_variables)
        self.timing = Timing()
        self.history = History()
        self._per_call = 1 if spe == "auto" else spe
        self._checkpoint: CheckpointCallback | None = None
        self.resume_changes: dict[str, dict[str, Any]] = {}
        if config.checkpoint_dir:  # a directory that cannot be written: refused now, not at fit
            ckpt_lib.check_writable(config.checkpoint_dir)

    @property
    def sparse(self):
        """The sparse tables' update (``dtk.train.sparse``), or None (every row updated)."""
        return self.model._dtk_mesh_state.sparse  # pylint: disable=protected-access

    # -- training ---------------------------------------------------------------------------------
    @property
    def steps_per_execution(self) -> int:
        """Batches per compiled call in the last ``fit`` (the automatic choice under "auto")."""
        chosen = getattr(self.model, "_dtk_auto_steps", None)
        return int(chosen) if chosen is not None and self.config.steps_per_execution == "auto" \
            else self._per_call

    @property
    def run_id(self) -> str | None:
        """The id of the run that writes ``checkpoint_dir`` (a resumed run keeps the id of the
        run it continues); None without checkpoints."""
        return self._checkpoint.run_id if self._checkpoint is not None else None

    @property
    def checkpoint_callback(self) -> CheckpointCallback | None:
        """The ``dtk.CheckpointCallback`` of the last ``fit`` (None without checkpoints)."""
        return self._checkpoint

    @property
    def latest_checkpoint(self) -> str | None:
        """The newest checkpoint in ``checkpoint_dir`` after the last ``fit`` (None: none)."""
        return self._checkpoint.latest if self._checkpoint is not None else None

    @property
    def restored_checkpoint(self) -> str | None:
        """The checkpoint the last ``fit`` resumed from (None: it started fresh)."""
        return self._checkpoint.restored if self._checkpoint is not None else None

    @property
    def global_step(self) -> int:
        return int(self.optimizer.iterations.numpy())

    def _check_data(self, data: Any, *, stacked: int | None, where: str = "data") -> None:
        if not isinstance(data, DistributedDataset):
            raise TypeError(
                f"{where}: data must be a dtk.DistributedDataset; got {type(data).__name__}. "
                "Wrap a tf.data.Dataset of unbatched (features, labels) with "
                "dtk.DistributedDataset(dataset, mesh, dtk.InputConfig(global_batch_size="
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
        if stacked is not None and got != stacked:
            raise ValueError(
                f"data stacks steps_per_call={got} batches per item but the trainer runs "
                f"steps_per_execution={stacked}; build the training data with "
                f"InputConfig(steps_per_call={stacked}) (evaluation data with 1)")
        _check_label_kind(self.loss, getattr(data, "label_dtypes", ()))
        example = getattr(data, "example_spec", None)
        custom = distribute_lib._overrides(self.model, "train_step")  # pylint: disable=protected-access
        if example is not None and not custom:
            input_checks.check_features(self.model, example[0], where)
            input_checks.check_targets(self.model, self.loss, example[1], where)
        if _is_sparse_loss(self.loss) and data.config.num_classes is None:
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
          train_data: a ``dtk.DistributedDataset`` (``steps_per_call`` 1, or equal to the
            trainer's integer ``steps_per_execution``; under "auto", ``n`` > 1 runs ``n`` per
            call).
          epochs: total epochs, counting epochs done before a resume.
          validation_data: evaluated at the end of every epoch (``val_`` logs).
          on_epoch_end: callables ``f(epoch, logs)``, called once the epoch's checkpoint is
            written. One that sets ``trainer.model.stop_training = True`` (as Keras's
            EarlyStopping does) ends training after that epoch; a model's own ``train_step``
            may set it too.
          on_step_end: callables ``f(step)`` after every compiled call.

        Returns:
          The ``History`` of all epochs, including those restored from a checkpoint. When
          ``max_steps`` stops training mid-epoch, that epoch's logs so far are its last entry.
        """
        if not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs must be a positive integer; got {epochs!r}")
        spe = self.config.steps_per_execution
        state = self.model._dtk_mesh_state  # pylint: disable=protected-access
        per_call = spe
        if spe == "auto":
            per_call = train_data.config.steps_per_call if isinstance(
                train_data, DistributedDataset) else 1
        self._check_data(train_data, stacked=None if spe == "auto" else spe,
                         where="fit(train_data=...)")
        if distribute_lib._overrides(self.model, "train_step") and \
                train_data.config.remainder == "pad" and \
                train_data.num_examples % train_data.config.global_batch_size:  # pylint: disable=protected-access
            raise ValueError(
                f"model {type(self.model).__name__} overrides train_step, which receives (x, y) "
                "and cannot tell padding from examples, but the training data pads its last "
                "batch (InputConfig(remainder='pad')); use remainder='drop' for training")
        check_accumulation(train_data.config.global_batch_size, self.mesh,
                           self.config.gradient_accumulation_steps, self.config.batch_axis)
        if validation_data is not None:  # before the first step, not after the first epoch
            self._check_data(validation_data, stacked=1, where="fit(validation_data=...)")
        dropped = train_data.num_dropped
        if dropped and self.config.verbose and cluster.is_lead_client():
            _log.info("Training drops %d of %d examples per epoch (remainder='drop': the global "
                      "batch size does not divide the data)", dropped, train_data.num_examples)
        if self.config.allow_change and not self.config.checkpoint_dir:
            # (with checkpoints, the callback checks them against what it records)
            check_allow_change(self.config.allow_change, resume_lib.named(resume_lib.settings(
                seed=self.config.seed, optimizer=self.optimizer, model=self.model,
                data=train_data, mesh="", num_clients=cluster.num_clients(),
                extra={"steps_per_epoch": train_data.num_batches, **(self.config.settings or {})}),
                self.config.setting_names))
        auto = spe == "auto" and per_call == 1
        self._per_call = per_call if not auto else 1
        progress = ProgressCallback(verbose=self.config.verbose if cluster.is_lead_client()
                                    else 0, stop_on_nan=self.config.stop_on_nan,
                                    max_steps=self.config.max_steps,
                                    tensorboard_dir=self.config.tensorboard_dir,
                                    on_step_end=on_step_end, validation_examples=None if
                                    validation_data is None else int(
                                        validation_data.num_examples - validation_data.num_dropped))
        callbacks: list[Any] = [progress]
        self._checkpoint = None
        if self.config.checkpoint_dir:
            self._checkpoint = _TrainerCheckpoint(
                self.config.checkpoint_dir, max_to_keep=self.config.max_to_keep,
                asynchronous=self.config.async_checkpoints,
                restart_from_scratch=self.config.restart_from_scratch,
                allow_change=self.config.allow_change, settings=self.config.settings,
                setting_names=self.config.setting_names)
            self._checkpoint.verbose = bool(self.config.verbose)
            callbacks.append(self._checkpoint)
        if self.config.max_steps is not None:
            callbacks.append(MaxSteps(self.config.max_steps))
        if on_epoch_end:
            callbacks.append(_EpochEnd(on_epoch_end, progress, self._checkpoint))
        if not auto:
            self.model._steps_per_execution.assign(per_call)  # pylint: disable=protected-access
        was_auto, state.auto_steps = state.auto_steps, auto
        data = train_data.with_steps_per_call(1)
        if validation_data is not None:
            validation_data = validation_data.with_steps_per_call(1)
        try:
            history = self.model.fit(data, epochs=epochs, validation_data=validation_data,
                                     callbacks=callbacks, verbose=0)
        except tf.errors.OpError as e:
            raise self._step_failure(e, progress) from e
        finally:
            state.auto_steps = was_auto
            self.timing = progress.timing
        if self._checkpoint is not None:
            self.resume_changes = dict(self._checkpoint.resume_changes)
            self.history = History(epochs=list(self._checkpoint.epochs),
                                   history={k: list(v) for k, v in
                                            self._checkpoint.history.items()})
        else:
            self.history = History()
            for index, epoch in enumerate(history.epoch):
                self.history.append(epoch, {k: v[index] for k, v in history.history.items()})
        if progress.partial is not None and self._checkpoint is not None:
            self.history.append(progress.epoch, progress.partial)
        return self.history

    def _step_failure(self, error: tf.errors.OpError, progress: ProgressCallback) -> ValueError:
        """A failed step as one ``ValueError`` naming the epoch, the step and the likely cause."""
        if isinstance(error, tf.errors.CancelledError):
            # A step enqueued after the failed one reports only its cancellation; the executor
            # may still hold the first error.
            try:
                context.async_wait()
            except tf.errors.OpError as first:
                if not isinstance(first, tf.errors.CancelledError):
                    error = first
        context.async_clear_error()  # else every later DTensor call in the process fails
        unsupported = op_support.explain_failure(str(error), self.model)
        if unsupported:
            return ValueError(unsupported)
        hint = "" if op_support.ID_OUTSIDE in str(error) else self._tables_hint()
        # DTensor runs steps asynchronously: the failure may surface a step or two later.
        try:
            where = f", at or before step {self.global_step + 1}"
        except tf.errors.OpError:  # the failed step poisoned the step counter too
            context.async_clear_error()
            where = ""
        epoch = getattr(progress, "epoch", 0)
        return ValueError(f"a step failed in epoch {epoch + 1}{where}: {first_line(error)}"
                          f"{hint}{_RESTART_NOTE}")

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

    # -- evaluation and prediction ----------------------------------------------------------------
    def evaluate(self, data: Any) -> dict[str, float]:
        """Loss and metrics over every example of ``data`` (Keras's ``evaluate``; the last
        partial batch of ``remainder="pad"`` data counted whole, once).

        Returns:
          ``{"loss": ..., <metric>: ..., "examples": <number of examples counted>}``.
        """
        self._check_data(data, stacked=1)
        try:
            results = self.model.evaluate(data, verbose=0, return_dict=True)
        except tf.errors.OpError as e:
            context.async_clear_error()
            raise ValueError(f"evaluation failed: {first_line(e)}") from e
        results = {k: float(v) for k, v in results.items()}
        results["examples"] = int(data.num_examples - data.num_dropped)
        return results

    def predict(self, data: Any) -> Any:
        """The model's outputs for every example of ``data``, in order, as ``Model.predict``
        returns them: one numpy array, or the model's dict / list of arrays for a model with
        several outputs."""
        self._check_data(data, stacked=1)
        try:
            return self.model.predict(data, verbose=0)
        except tf.errors.OpError as e:
            context.async_clear_error()
            hint = self._tables_hint() if op_support.ID_OUTSIDE not in str(e) else ""
            raise ValueError(f"prediction failed: {first_line(e)}{hint}") from e

    def export(self, export_dir: str, *,
               formats: Sequence[str] = ckpt_lib.EXPORT_FORMATS) -> dict[str, str]:
        """Writes the trained weights as a plain ``.keras`` model and a SavedModel
        (``dtk.train.checkpoint.export``; ``formats`` picks which)."""
        if self.model_factory is None:
            raise ValueError("export needs the model factory: pass model_factory= to Trainer when "
                             "giving a built model")
        return ckpt_lib.export(self.model, self.model_factory, export_dir,
                               input_shape=self._input_shape, formats=formats)


class _TrainerCheckpoint(CheckpointCallback):
    """``CheckpointCallback`` whose refusals name the Trainer's options (and a script's flag)."""

    def _reword(self, message: str) -> str:
        return message


class _EpochEnd(tf_keras.callbacks.Callback):
    """The Trainer's ``on_epoch_end`` callables, after the epoch's checkpoint (a Ray report sees
    it); not for an epoch that ``max_steps`` stopped."""

    def __init__(self, functions, progress: ProgressCallback,
                 checkpoint: CheckpointCallback | None):
        super().__init__()
        self._functions, self._progress = tuple(functions), progress
        self._checkpoint = checkpoint

    def on_epoch_end(self, epoch, logs=None):
        if self._progress.partial is not None:
            return
        if self._checkpoint is not None:
            self._checkpoint.wait()
        for function in self._functions:
            function(epoch, dict(logs or {}))


_DEFAULTS = {"loss": "sparse_categorical_crossentropy", "optimizer": "adam",  # logits
             "metrics": ["accuracy"]}


def _compiled_or_given(model, mesh, *, loss, optimizer, metrics) -> dict[str, Any]:
    """``compile()``'s arguments: each argument given (a loss name with dtk's meaning, a logit
    loss), else what the factory compiled the model with (Keras's meaning; the optimizer rebuilt
    on the mesh from its config), else dtk's default."""
    compiled = dict(getattr(model, "_dtk_compiled", None) or {})
    given = {"loss": loss, "optimizer": optimizer, "metrics": metrics}
    chosen: dict[str, Any] = {}
    for name in ("loss", "optimizer", "metrics"):
        if given[name] is not None:
            if compiled.get(name) is not None and cluster.is_lead_client():
                _log.info("Trainer: using the %s passed to Trainer; the model's compiled %s (%s) "
                          "is not used", name, name, _describe(compiled[name]))
            chosen[name] = given[name]
        elif compiled.get(name) is not None:
            chosen[name] = compiled[name]
            if name == "loss":
                _check_compiled_loss(compiled[name])
                if compiled.get("loss_weights") is not None:
                    chosen["loss_weights"] = compiled["loss_weights"]
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
            if name == "loss":
                chosen[name] = optimizers_lib.keras_loss(chosen[name])
    if given["loss"] is not None:
        chosen["loss"] = optimizers_lib.keras_loss(given["loss"])
    if given["metrics"] is not None or compiled.get("optimizer") is None:
        chosen["metrics"] = optimizers_lib.make_metrics(chosen["metrics"], mesh)  # dtk's names
    chosen["optimizer"] = optimizers_lib.make_optimizer(chosen["optimizer"], mesh)
    return chosen


def _check_compiled_loss(loss: Any) -> None:
    """A factory's compiled loss names Keras knows (checked now, not at the first step)."""
    for one in (loss.values() if hasattr(loss, "keys") else
                loss if isinstance(loss, (list, tuple)) else [loss]):
        if isinstance(one, str):
            try:
                tf_keras.losses.get(one)
            except ValueError as e:
                raise ValueError(f"the model was compiled with loss {one!r}, which tf_keras "
                                 f"does not know: {e}") from e


def _describe(value) -> str:
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], type):
        return value[0].__name__  # (optimizer class, config)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_describe(v) for v in value) + "]"
    return value if isinstance(value, str) else type(value).__name__


def _is_sparse_loss(loss_fn) -> bool:
    """Whether the loss takes integer class ids (sparse categorical crossentropy)."""
    if isinstance(loss_fn, str):
        return loss_fn.strip().lower() == "sparse_categorical_crossentropy"
    if isinstance(loss_fn, tf_keras.losses.SparseCategoricalCrossentropy):
        return True
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
