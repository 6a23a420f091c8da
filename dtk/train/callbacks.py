"""dtk's Keras callbacks for ``fit`` on a ``dtk.distribute`` model: checkpoints and a step limit.

* ``CheckpointCallback``: dtk's sharded checkpoints with exact resume (the position inside an
  epoch, the random draws, a shuffled order), one writer per directory, the run's settings
  checked on resume, and a clean stop on SIGTERM/SIGINT;
* ``MaxSteps``: training stops at an optimizer step, inside an epoch and inside a call.

Both read the model's mesh state (``dtk.train.mesh_calls.MeshState``) that ``dtk.distribute``
gives it: where a ``DistributedDataset``'s stream starts on resume, the batches to skip.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

import tf_keras
from tensorflow.experimental import dtensor

from dtk.data.input import DistributedDataset
from dtk.train import input_checks
from dtk.train.mesh_calls import MeshState

_log = logging.getLogger("dtk")


class CheckpointCallback(tf_keras.callbacks.Callback):
    """dtk's checkpoints for Keras's own ``fit`` on a ``dtk.distribute`` model.

    What Keras's ``BackupAndRestore`` does, with dtk's checkpoints underneath
    (``dtk.train.checkpoint.Checkpointer``): each client writes only its own shards of the
    weights and the optimizer state (every optimizer the model holds, a GAN's two included), one
    run writes a directory at a time (a lock, released at the end of ``fit``), ``max_to_keep``
    checkpoints are kept, broken ones are skipped with a warning, and a later ``fit`` on any mesh
    resumes from the newest one where it stopped. The optimizer's step counter is restored
    with it, so dtk's random draws (Dropout) continue as in the uninterrupted run: the resumed
    run's numbers are the same. A finished run run again trains nothing, says so, and leaves the
    model as the finished run left it.

    SIGTERM or SIGINT during ``fit`` (a one-process run; ``dtk.train.preemption``): a checkpoint
    is saved at the next step boundary, the directory is released, and ``fit`` raises
    ``dtk.Preempted`` (a ``SystemExit`` with status 143 or 130: a script exits with it and no
    traceback). The same ``fit`` again resumes at that step: the weights and the optimizer state
    are the uninterrupted run's, bit for bit. A checkpoint inside an epoch records the
    metrics' running state (totals and counts), added back after the resumed epoch's first
    call: the interrupted epoch's loss and metrics are the uninterrupted run's too (Keras's
    ``BackupAndRestore`` logs those of the batches after the resume only). (A metric whose
    state is not a sum, a maximum, starts again there.)

    Args:
      directory: where the checkpoints go (shared by every client).
      max_to_keep: checkpoints kept.
      asynchronous: write in a background thread (the next epoch starts while it writes); each
        checkpoint is recorded as the latest as soon as its files are written.
      restart_from_scratch: remove the directory's checkpoints and train from the start (the
        way on from a directory whose checkpoints are all unreadable).
      allow_change: settings a resume may change on purpose, e.g. ``("learning_rate",)``
        (``"model"`` allows every model hyper-parameter). Every checkpoint records the run's
        settings (``dtk.train.resume``, as the Trainer's do: the seed, the optimizer and its
        learning rate, the data's size and batch, the steps per epoch, the model's
        hyper-parameters); a resume with any other difference is a ``ValueError`` listing
        each, before any step. An allowed change is applied (a new learning rate is set on the
        restored optimizer) and reported in ``resume_changes``. The mesh and the number of
        clients may change freely.
      settings: more settings that shape the run, recorded and compared with dtk's own (e.g.
        ``{"dataset": "idx"}``).
      setting_names: ``(glob, name)`` pairs: the recorded model settings a glob matches are
        compared, reported and allowed as ``name`` (a script's flag: ``("model.*:Dropout.rate",
        "dropout")``; ``dtk.train.resume.named``).

    Attributes:
      epochs, history: the whole run's completed epochs and their logs (``{"loss": [...]}``),
        those before a resume included (restored from the checkpoint; Keras's ``History``
        holds this ``fit``'s only).
      restored_epoch, restored_step: where the last ``fit`` resumed (None: from the start).
      restored, latest: the checkpoint the last ``fit`` restored, and the newest one it left.
      run_id: the id of the run that writes the directory (a resumed run keeps its run's).
      resume_changes: the settings that resume changed on purpose (``allow_change``).

    Example::

        model.fit(x, y, epochs=10, callbacks=[dtk.CheckpointCallback("/ckpt")])
        # killed at epoch 6; the same line again resumes at epoch 7
    """

    def __init__(self, directory: str, *, max_to_keep: int = 3, asynchronous: bool = False,
                 restart_from_scratch: bool = False, allow_change: Sequence[str] = (),
                 settings: dict[str, Any] | None = None,
                 setting_names: Sequence[tuple[str, str]] = ()):
        super().__init__()
        self._supports_tf_logs = True  # (it reads no value: the calls run ahead)
        if isinstance(allow_change, str) or not all(
                isinstance(k, str) and k for k in allow_change):
            raise ValueError(f"CheckpointCallback(allow_change=...) must be a tuple of setting "
                             f"names, e.g. ('learning_rate',); got {allow_change!r}")
        self.allow_change, self.settings = tuple(allow_change), dict(settings or {})
        self.setting_names = tuple(tuple(p) for p in setting_names)
        self.verbose = True  # the "Resumed from" line (the Trainer's verbose=0 turns it off)
        self.restored: str | None = None
        self.latest: str | None = None
        self.run_id: str | None = None
        self.resume_changes: dict[str, dict[str, Any]] = {}  # the last resume's allowed changes
        self._settings: dict[str, Any] = {}
        if not isinstance(directory, (str, bytes)) and not hasattr(directory, "__fspath__"):
            raise TypeError(f"CheckpointCallback(directory=...) must be a path; got "
                            f"{type(directory).__name__}")
        self.directory, self.max_to_keep, self.asynchronous = directory, max_to_keep, asynchronous
        self.restart_from_scratch = bool(restart_from_scratch)
        self._checkpointer = None
        self._stop = None
        self._epoch = 0
        self._preempted: list | None = None  # [checkpoint, saved inside an epoch] after a signal
        # The metrics' running state at a checkpoint inside an epoch, added to the resumed
        # epoch's after its first call: its logs are the uninterrupted epoch's.
        self._metric_state: dict[str, list] | None = None
        # The whole run's per-epoch logs, the epochs before a resume included (Keras's History
        # holds those of this fit only): saved in every checkpoint and restored with it.
        self.epochs: list[int] = []
        self.history: dict[str, list[float]] = {}
        self.restored_epoch: int | None = None  # the epoch the last fit resumed at
        self.restored_step: int = 0  # batches of that epoch trained before the checkpoint

    def on_train_begin(self, logs=None):
        from dtk.train import checkpoint, preemption  # pylint: disable=g-import-not-at-top
        state = getattr(self.model, "_dtk_mesh_state", None)
        if state is None and getattr(self.model, "_dtk_distribution", None) is not None:
            raise ValueError(
                f"CheckpointCallback is for dtk.distribute's tf_keras models; model "
                f"{self.model.name!r} is a Keras 3 model on the mesh: use Keras 3's "
                "keras.callbacks.BackupAndRestore(backup_dir), which resumes it exactly with "
                "shuffle=False or a tf.data input (tests/test_keras3.py), as in plain Keras 3")
        if state is None:
            raise ValueError("CheckpointCallback is for a model made by dtk.distribute; this "
                             f"model {self.model.name!r} is not laid out by dtk (use Keras's "
                             "BackupAndRestore for a plain model)")
        optimizer = self.model.optimizer
        with dtensor.default_mesh(state.mesh):  # its state exists before a restore fills it
            optimizer.build(self.model.trainable_variables)
            for value in vars(self.model).values():
                if value is not optimizer and isinstance(value, tf_keras.optimizers.Optimizer):
                    value.build(self.model.trainable_variables)
        self._checkpointer = checkpoint.Checkpointer(
            self.directory, model=self.model, optimizer=optimizer, mesh=state.mesh,
            max_to_keep=self.max_to_keep, asynchronous=self.asynchronous)
        self._preempted = None
        self.run_id = self._checkpointer.run_id
        self._settings = self._run_settings(state)  # (before a restore sets the saved rate)
        try:
            self._check_allow_change()  # a typo is refused now, not at a resume runs later
        except BaseException:
            self._close()
            raise
        if self.restart_from_scratch:
            if self._checkpointer.candidates():
                _log.warning("restart_from_scratch: removing the checkpoints in %s",
                             self.directory)
                self._checkpointer.clear()
            restored = None
        else:
            try:
                restored = self._checkpointer.restore()
            except checkpoint.CheckpointError as e:
                self._close()
                raise checkpoint.CheckpointError(
                    f"{str(e).split('; ')[0]}; nothing was restored. To train from the start "
                    "on purpose, pass CheckpointCallback(..., restart_from_scratch=True) (it "
                    "removes them), or give another directory") from None
            except ValueError as e:
                error = self._architecture_changed(e)
                self._close()
                raise error from e
            except BaseException:
                self._close()
                raise
        self.restored, self.run_id = self._checkpointer.restored, self._checkpointer.run_id
        self.resume_changes = {}
        self._metric_state = None
        if restored is not None:
            try:
                self._check_settings(restored)
            except BaseException:
                self._close()
                raise
        self.restored_epoch = None if restored is None else int(restored["epoch"])
        # ("batch_in_epoch": written by the Trainer's own loop before it ran on Keras's fit)
        self.restored_step = 0 if restored is None else int(
            restored.get("step", restored.get("batch_in_epoch", 0)))
        was = (restored or {}).get("settings", {}).get("steps_per_epoch",
                                                      (restored or {}).get("steps_per_epoch"))
        now = self._settings.get("steps_per_epoch")
        if self.restored_step and self.resume_changes and was != now:
            # A change allowed on purpose (the batch size, the data) moved the epoch's
            # batches: the run goes on from the next epoch, and says what that costs.
            _log.warning("Resuming with %s changed: the epoch's batches moved (%s steps per "
                         "epoch, now %s), so the run goes on at epoch %d; the last %d of epoch "
                         "%d's %s batches were not trained", ", ".join(self.resume_changes),
                         was, now, self.restored_epoch + 2, int(was or 0) - self.restored_step,
                         self.restored_epoch + 1, was)
            self.restored_epoch, self.restored_step = self.restored_epoch + 1, 0
        if (restored or {}).get("auto_steps_per_call"):  # a resume does not calibrate again
            object.__setattr__(self.model, "_dtk_auto_steps", int(restored["auto_steps_per_call"]))
        record = (restored or {}).get("history") or {}
        self.epochs = list(record.get("epochs", []))
        self.history = {k: list(v) for k, v in (record.get("logs") or {}).items()}
        if self.restored_epoch is not None:
            epochs = (self.params or {}).get("epochs")
            if epochs is not None and self.restored_epoch >= epochs:
                _log.warning("the run is already complete: %s is at epoch %d of %d (step %d); "
                             "nothing is trained, the model is the finished run's (raise "
                             "epochs to train further)", self._checkpointer.restored,
                             self.restored_epoch, epochs,
                             int(self.model.optimizer.iterations.numpy()))
            else:
                from dtk.cluster import env as cluster  # pylint: disable=g-import-not-at-top
                if self.verbose and cluster.is_lead_client():
                    _log.info("Resumed from %s: epoch %d, batch %d, step %d",
                              self._checkpointer.restored, self.restored_epoch + 1,
                              self.restored_step, int(self.model.optimizer.iterations.numpy()))
            from dtk.parallel import experts  # pylint: disable=g-import-not-at-top
            experts.reset_routing_stats(self.model)  # statistics of the run from here
            if self.restored_step:
                self._metric_state = restored.get("metrics")
            self.model._training_state = _ResumeAt(self.restored_epoch, self.restored_step,  # pylint: disable=protected-access
                                                   state)
            state.skip_batches = self.restored_step
            if state.shuffle_epoch is not None:  # the resumed epoch's order, as uninterrupted
                state.shuffle_epoch.assign(self.restored_epoch)
        self._stop = preemption.StopSignals().install()
        state.at_fit_end.append(self._close)

    def _run_settings(self, state: MeshState) -> dict[str, Any]:
        """What shapes this run, recorded in every checkpoint and compared on resume, as the
        Trainer's (``dtk.train.resume``): the seed, the optimizer and its learning rate, the
        data's size and batch, the model's hyper-parameters, the caller's ``settings``."""
        from dtk.cluster import env as cluster  # pylint: disable=g-import-not-at-top
        from dtk.train import resume  # pylint: disable=g-import-not-at-top
        call = getattr(state, "fit_call", None) or {}
        data = call.get("x")
        extra = {"steps_per_epoch": (self.params or {}).get("steps")}
        if not isinstance(data, DistributedDataset):  # arrays: Keras's batch_size and length
            extra.update(batch_size=call.get("batch_size"), train_examples=input_checks.example_count(data))
        return resume.named(resume.settings(
            seed=getattr(state, "seed", None), optimizer=self.model.optimizer, model=self.model,
            data=data if isinstance(data, DistributedDataset) else None,
            mesh=",".join(f"{n}={state.mesh.dim_size(n)}" for n in state.mesh.dim_names),
            num_clients=cluster.num_clients(), extra={**extra, **self.settings}),
            self.setting_names)

    def _check_allow_change(self) -> None:
        check_allow_change(self.allow_change, self._settings, self._reword)

    def _architecture_changed(self, error: ValueError) -> ValueError:
        """A checkpoint of another architecture: where a recorded setting that shapes the model
        changed (the number of experts, the width), the setting is named, not the shapes."""
        from dtk.errors import first_line  # pylint: disable=g-import-not-at-top
        from dtk.train import checkpoint, resume  # pylint: disable=g-import-not-at-top
        candidates = self._checkpointer.candidates() if self._checkpointer is not None else []
        recorded = checkpoint.state_of(candidates[0]) if candidates else None
        if "does not match this model" not in str(error) or not (recorded or {}).get("settings"):
            return error
        diff = resume.changes(resume.named(recorded["settings"], self.setting_names),
                              self._settings)
        model_keys = {k: v for k, v in diff.items() if k.startswith("model")}
        if not model_keys:
            return error
        return ValueError(
            f"{first_line(error).split('. ')[0].split(': it holds')[0]}: the model's settings "
            f"changed ({resume.describe(model_keys)}), which changes its weights; resume with "
            "the settings the checkpoint was written with, or use a new checkpoint directory")

    def _reword(self, message: str) -> str:
        """A refusal's fix in this API's words (the Trainer's names its option and flag)."""
        message = re.sub(
            r"\(--allow_change ([^;]*); TrainerConfig\(allow_change=\.\.\.\)\)",
            lambda m: f"(CheckpointCallback(allow_change={tuple(m.group(1).split(','))!r}))",
            message)
        return message.replace("allow_change (--allow_change)",
                               "CheckpointCallback(allow_change=...)")

    def _check_settings(self, restored: dict[str, Any]) -> None:
        """A resume whose settings differ from the checkpoint's is refused, unless allowed
        (``allow_change``): then applied (a new learning rate set on the restored optimizer)
        and reported in ``resume_changes``."""
        from dtk.cluster import env as cluster  # pylint: disable=g-import-not-at-top
        from dtk.train import resume  # pylint: disable=g-import-not-at-top
        saved = restored.get("settings")
        if saved is not None and "train_examples" not in saved:
            saved = None  # (an older CheckpointCallback's: recorded no settings)
        if saved is not None:
            saved = resume.named(saved, self.setting_names)
            if "steps_per_epoch" not in saved:  # (the Trainer's own loop recorded it apart)
                saved["steps_per_epoch"] = restored.get("steps_per_epoch")
        current = self._settings
        if saved is not None and any(saved.get(k) != current.get(k) for k in (
                "global_batch_size", "batch_size", "train_examples")):
            # The steps per epoch follow from the data's size and batch: those are named.
            saved = {k: v for k, v in saved.items() if k != "steps_per_epoch"}
            current = {k: v for k, v in current.items() if k != "steps_per_epoch"}
        try:
            self.resume_changes = resume.check(
                saved, current, allow_change=self.allow_change,
                restored=self._checkpointer.restored, lead=cluster.is_lead_client())
        except ValueError as e:  # the fix in this API's words (the Trainer's names its flag)
            raise ValueError(self._reword(str(e))) from None
        new = self.resume_changes.get("learning_rate", {}).get("new")
        if isinstance(new, float):  # the restored optimizer holds the checkpoint's rate
            self.model.optimizer.learning_rate.assign(new)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._done = None  # batches of this epoch trained (Keras's batch index + 1)

    def on_train_batch_end(self, batch, logs=None):
        self._done = int(batch) + 1
        if self._metric_state is not None:  # the first call after a resume inside an epoch
            _add_metric_state(self.model, self._metric_state, logs)
            self._metric_state = None
        if self._stop is None or self._stop.signum is None or self._preempted is not None:
            return
        steps = (self.params or {}).get("steps")
        done = int(batch) + 1  # Keras passes the index of the call's last batch
        self._preempted = [None, steps is None or done < steps]  # [checkpoint, inside the epoch]
        if self._preempted[1]:  # the position in the epoch; at its end, on_epoch_end saves
            self._preempted[0] = self._checkpointer.save(
                self._state({"epoch": self._epoch, "step": done,
                             "metrics": _metric_state(self.model)}),
                step=int(self.model.optimizer.iterations.numpy()))
            self._checkpointer.wait()
        self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if self._preempted is not None and self._preempted[1]:
            return  # saved at the step where the signal was seen
        steps = (self.params or {}).get("steps")
        if steps and self._done is not None and self._done < steps:
            # stop_training set inside the epoch (dtk.MaxSteps, a user's callback): the
            # position is recorded, so that a resume trains the rest of the epoch.
            self._checkpointer.save(self._state({"epoch": epoch, "step": self._done,
                                                 "metrics": _metric_state(self.model)}),
                                    step=int(self.model.optimizer.iterations.numpy()))
            return
        self.epochs.append(epoch)
        for key, value in (logs or {}).items():
            try:
                value = float(value)
            except (TypeError, ValueError):  # a train_step's own log that is no one number
                continue
            self.history.setdefault(key, []).append(value)
        path = self._checkpointer.save(self._state({"epoch": epoch + 1}),
                                       step=int(self.model.optimizer.iterations.numpy()))
        if self._preempted is not None:
            self._checkpointer.wait()
            self._preempted[0] = path
            if epoch + 1 >= (self.params or {}).get("epochs", 0):
                self._preempted = None  # the run's last epoch: it ends as it would

    def _state(self, position: dict[str, int]) -> dict[str, Any]:
        """What a checkpoint records beside the weights: the position, the run's settings, the
        per-epoch logs of every epoch completed (a resumed epoch's logs cover the batches after
        the resume, as Keras's), and the automatic steps per call once chosen."""
        return {**position, "settings": self._settings,
                "history": {"epochs": self.epochs, "logs": self.history},
                # compile(steps_per_execution="auto")'s choice (dtk.train.auto_steps), once made
                "auto_steps_per_call": getattr(self.model, "_dtk_auto_steps", None)}

    def on_train_end(self, logs=None):
        from dtk.train import preemption  # pylint: disable=g-import-not-at-top
        self.model._training_state = None  # pylint: disable=protected-access
        signum = self._stop.signum if self._stop is not None else None
        self._close()
        if signum is not None and self._preempted is not None:
            stop = preemption.Preempted(signum, self._preempted[0],
                                        int(self.model.optimizer.iterations.numpy()))
            _log.warning("%s", stop.message)
            raise stop

    @property
    def saving(self) -> bool:
        """Whether a checkpoint is being written in the background now."""
        return self._checkpointer is not None and bool(self._checkpointer.saving)

    def wait(self) -> None:
        """Waits for the checkpoint being written in the background, if any."""
        if self._checkpointer is not None:
            self._checkpointer.wait()

    def _close(self):
        if self._stop is not None:
            self._stop.uninstall()
            self._stop = None
        if self._checkpointer is not None:
            try:
                self._checkpointer.wait()
            finally:
                self.latest = self._checkpointer.latest
                self._checkpointer.close()
                self._checkpointer = None


def check_allow_change(allow_change: Sequence[str], settings: dict[str, Any],
                       reword: Any = None) -> None:
    """Every name in ``allow_change`` is a setting the run records (on a fresh run too: a typo
    is refused now, not at a resume runs later).

    Raises:
      ValueError: naming the unknown names and the recorded settings closest to them.
    """
    from dtk.train import resume  # pylint: disable=g-import-not-at-top
    unknown = [name for name in allow_change
               if not any(resume.is_allowed(k, [name]) for k in settings)]
    if not unknown:
        return
    import difflib  # pylint: disable=g-import-not-at-top
    close = sorted({m for name in unknown
                    for m in difflib.get_close_matches(name, list(settings), n=3, cutoff=0.5)})
    hint = (f"closest recorded settings: {', '.join(close)}" if close else
            f"this run records {len(settings)} settings (dtk.train.resume.settings)")
    message = (f"allow_change (--allow_change) names setting(s) {unknown} that this run does "
               f"not record; {hint}. Give recorded names, or drop them")
    raise ValueError(reword(message) if reword is not None else message)


def _metric_state(model: tf_keras.Model) -> dict[str, list]:
    """Each of the model's metrics' variables (loss and compiled metrics), as host lists."""
    import numpy as np  # pylint: disable=g-import-not-at-top
    return {m.name: [np.asarray(v.numpy()).tolist() for v in m.variables]
            for m in model.metrics}


def _add_metric_state(model: tf_keras.Model, saved: dict[str, list], logs: Any) -> None:
    """Adds a checkpoint's metric state to the metrics' (their variables are sums: totals,
    counts, confusion counts) and the logs Keras goes on with to their results."""
    import numpy as np  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    for metric in model.metrics:
        values = saved.get(metric.name)
        if values is None or len(values) != len(metric.variables):
            continue
        for variable, value in zip(metric.variables, values):
            value = np.asarray(value, dtype=variable.dtype.as_numpy_dtype)
            layout = dtensor.fetch_layout(variable)
            variable.assign_add(dtensor.copy_to_mesh(tf.constant(value), layout) if layout
                                is not None else value)
    if logs is not None:
        for key, value in model.get_metrics_result().items():
            if key in logs:
                logs[key] = value


class MaxSteps(tf_keras.callbacks.Callback):
    """Stops Keras's ``fit`` after ``max_steps`` optimizer steps in all, mid-epoch and mid-call.

    What ``TrainerConfig(max_steps=...)`` and a script's ``--steps`` do, for Keras's own loop:
    the count is the optimizer's step counter, so a resumed run (``dtk.CheckpointCallback``,
    which then records the position inside the epoch) stops at the same step as an
    uninterrupted one. With several steps per call, the call before the limit is shortened to
    the steps left (Keras's next call reads the count; a ``DistributedDataset``'s stacks
    follow it), so no step past the limit runs.

    Args:
      max_steps: optimizer steps after which training stops (a positive integer).

    Example::

        model.fit(train, epochs=100, callbacks=[dtk.CheckpointCallback(d), dtk.MaxSteps(5000)])
    """

    def __init__(self, max_steps: int):
        super().__init__()
        self._supports_tf_logs = True
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"MaxSteps(max_steps=...) must be a positive integer; got "
                             f"{max_steps!r}")
        self.max_steps = max_steps
        self._per_call = None  # Keras's steps per call, restored at the end of fit

    def _left(self) -> int:
        return self.max_steps - self._step

    def on_train_begin(self, logs=None):
        spe = getattr(self.model, "_steps_per_execution", None)
        self._per_call = None if spe is None else int(spe.numpy())
        # Read once (after a resume's restore), then counted on the host: reading the step
        # counter after every call would wait for that call's step.
        step = self._step = int(self.model.optimizer.iterations.numpy())
        if step >= self.max_steps:
            # Keras's fit would run one call before it reads stop_training: none runs.
            _log.warning("the run is already complete: the optimizer is at step %d of "
                         "max_steps=%d; nothing is trained, the model is the finished run's "
                         "(raise max_steps to train further)", step, self.max_steps)
            self.model._training_state = _ResumeAt(  # pylint: disable=protected-access
                int((self.params or {}).get("epochs") or 0))
            return
        self._limit()

    def on_epoch_begin(self, epoch, logs=None):
        self._limit()  # (Keras restores its count after an epoch's last, shorter call)

    def on_train_batch_begin(self, batch, logs=None):
        spe = getattr(self.model, "_steps_per_execution", None)  # (a host variable)
        self._call = 1 if spe is None else int(spe.numpy())

    def on_train_batch_end(self, batch, logs=None):
        self._step += self._call
        self._limit()

    def _limit(self) -> None:
        left = self._left()
        if left <= 0:
            self.model.stop_training = True
            return
        spe = getattr(self.model, "_steps_per_execution", None)
        if spe is not None and self._per_call is not None and left < int(spe.numpy()):
            spe.assign(left)

    def on_train_end(self, logs=None):
        spe = getattr(self.model, "_steps_per_execution", None)
        if spe is not None and self._per_call is not None:
            spe.assign(self._per_call)
        if isinstance(getattr(self.model, "_training_state", None), _ResumeAt):
            self.model._training_state = None  # pylint: disable=protected-access


class _ResumeAt:
    """What ``Model.fit`` asks a restored training state: the epoch and batch to start at."""

    def __init__(self, epoch: int, step: int = 0, state: MeshState | None = None):
        self.epoch, self.step, self.state = epoch, step, state

    def maybe_load_initial_counters_from_ckpt(self, steps_per_epoch, initial_epoch, mode=None):
        del steps_per_epoch, mode
        start = (initial_epoch, 0) if initial_epoch > self.epoch else (self.epoch, self.step)
        if self.state is not None:  # where a DistributedDataset's stream starts
            self.state.start_epoch, self.state.skip_batches = start
        return start
