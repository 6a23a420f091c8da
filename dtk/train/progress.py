"""A run's progress, timing and stop-on-NaN for Keras's ``fit``: ``dtk.Trainer``'s output as callbacks.

``ProgressCallback`` prints what the Trainer prints (Keras's progress bar on a terminal; whole
lines to a log, one every ``LOG_PROGRESS_INTERVAL_S`` and one per epoch; or one line per epoch),
times the run (``Timing``: the first call with its tracing, then windows of steps between the
reads it makes anyway), stops on a non-finite loss (``NonFiniteLossError``) and writes the epoch's
scalars to TensorBoard. It reads the step's results back only every ``PROGRESS_INTERVAL_S`` and at
an epoch's end: Keras hands it the logs as tensors, so the calls in between run ahead.

Example::

    progress = dtk.train.progress.ProgressCallback(verbose=2)
    model.fit(train, epochs=3, callbacks=[progress])
    progress.timing.ms_per_step_median(skip_epoch=0)
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf
import tf_keras

from dtk.cluster import env as cluster

_log = logging.getLogger("dtk")

PROGRESS_INTERVAL_S = 0.5  # read the step's results (a device sync) at most this often
# A progress line a log (not a terminal) gets every this many seconds, and one at each epoch end.
LOG_PROGRESS_INTERVAL_S = 30.0


class NonFiniteLossError(ValueError):
    """Training stopped because the loss became NaN or infinite."""


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


def _numbers(logs) -> dict[str, float]:
    """The logs that are one number each, read back (a device sync for tensors)."""
    out = {}
    for key, value in (logs or {}).items():
        try:
            out[key] = float(np.asarray(value))
        except (TypeError, ValueError):
            continue  # a train_step's own log that is no one number
    return out


class ProgressCallback(tf_keras.callbacks.Callback):
    """Progress output, timing, stop-on-NaN and TensorBoard scalars of a ``fit``.

    Args:
      verbose: 0 silent, 1 progress bar (whole lines to a log), 2 one line per epoch.
      stop_on_nan: raise ``NonFiniteLossError`` when the loss read back is NaN or infinite.
      max_steps: a run counted in steps (``dtk.MaxSteps``): epochs are headed "Steps a-b of N"
        when the limit ends the run before its epochs do.
      tensorboard_dir: each epoch's logs as scalars there (client 0).
      on_step_end: callables ``f(step)`` after every compiled call (``step`` counts the run's
        batches: epoch * steps per epoch + batches of this epoch).
      validation_examples: the validation data's examples, logged as ``val_examples``.
    """

    def __init__(self, *, verbose: int = 1, stop_on_nan: bool = True,
                 max_steps: int | None = None, tensorboard_dir: str | None = None,
                 on_step_end: Sequence[Callable[[int], object]] = (),
                 validation_examples: int | None = None):
        super().__init__()
        self._supports_tf_logs = True  # the calls between reads run ahead
        self.verbose, self.stop_on_nan, self.max_steps = verbose, stop_on_nan, max_steps
        self.tensorboard_dir, self.on_step_end = tensorboard_dir, tuple(on_step_end)
        self.validation_examples = validation_examples
        self.timing = Timing()
        self.partial: dict[str, float] | None = None  # a stopped epoch's logs (None: none)
        self._writer = None
        self._progbar = None
        self.epoch = 0  # the epoch running (or last run)

    # -- the run ----------------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        self.timing = Timing()
        self.partial = None
        self._first = True
        self._step_limit_seen = False
        if self.tensorboard_dir and cluster.is_lead_client():
            self._writer = tf.summary.create_file_writer(self.tensorboard_dir)

    def _steps_per_epoch(self) -> int:
        return int((self.params or {}).get("steps") or 0)

    def _header(self, epoch: int) -> str:
        """Keras's "Epoch 2/6", or, for a run counted in steps (``max_steps`` ends it before its
        epochs do, as the LM's ``--steps`` with ``--eval_every``), "Steps 101-200 of 600"."""
        epochs, per_epoch = int((self.params or {}).get("epochs") or 0), self._steps_per_epoch()
        last = self.max_steps
        if last is None or last > epochs * per_epoch:
            return f"Epoch {epoch + 1}/{epochs}"
        first = epoch * per_epoch + 1
        return f"Steps {first}-{min(first + per_epoch - 1, last)} of {last}"

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        self._last = None  # the last batch index seen (Keras's: the call's last batch)
        self._window_steps, self._window_start = 0, time.perf_counter()
        self._progbar = None
        if self.verbose == 1 and cluster.is_lead_client():
            # To a log (stdout not a terminal), whole lines, one every 30 s and the epoch's last:
            # Keras's bar redraws itself with backspaces on any POSIX system, which a log file
            # keeps, every 0.05 s (1,464 redraws in one line of the recommender's log). Its
            # lines then start with a newline: the header's ends there.
            tty = hasattr(sys.stdout, "isatty") and sys.stdout.isatty()
            print(self._header(epoch), end="\n" if tty else "")
            # Every value logged is the epoch's running result, not one to average here (the
            # model's metrics are built at its first step: their names are added as they come).
            self._progbar = tf_keras.utils.Progbar(
                self._steps_per_epoch() or None,
                interval=0.05 if tty else LOG_PROGRESS_INTERVAL_S)
            self._progbar._dynamic_display = tty  # pylint: disable=protected-access

    def on_train_batch_begin(self, batch, logs=None):
        count = getattr(self.model, "_steps_per_execution", None)  # (a host variable)
        self._call_steps = 1 if count is None else int(count.numpy())
        # steps_per_execution="auto" calibrating (dtk.train.auto_steps): its calls are read
        # back one by one and timed there, not here
        self._calibrating = bool(getattr(self.model, "_dtk_calibrating", False))
        if self._first:
            self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        batch, steps = int(batch), self._call_steps
        self._last = batch
        now = time.perf_counter()
        if self._first:  # its time includes the tracing: read back, not in a window
            _numbers(logs)
            self._first = False
            self.timing.first_step_s = time.perf_counter() - self._start
            self._window_steps, self._window_start = 0, time.perf_counter()
        elif self._calibrating:
            self._window_steps, self._window_start = 0, time.perf_counter()
        else:
            self._window_steps += steps
        for callback in self.on_step_end:
            callback(self.epoch * self._steps_per_epoch() + batch + 1)
        if now - self._window_start >= PROGRESS_INTERVAL_S:
            results = self._checked(logs)  # syncs
            self._close_window()
            if self._progbar is not None:
                self._progbar.stateful_metrics.update(results)
                # (the epoch's last line, with validation's figures, comes at its end)
                self._progbar.update(batch + 1, list(results.items()), finalize=False)

    def _checked(self, logs) -> dict[str, float]:
        results = _numbers(logs)
        loss = results.get("loss", 0.0)
        if self.stop_on_nan and not math.isfinite(loss):
            step = int(self.model.optimizer.iterations.numpy())
            raise NonFiniteLossError(
                f"the training loss became {loss} in epoch {self.epoch + 1}, by step {step}; "
                "lower the learning rate, check the data for NaN or infinite values, or clip "
                "gradients (e.g. make_optimizer(..., global_clipnorm=1.0)). "
                "TrainerConfig(stop_on_nan=False) trains on regardless")
        return results

    def _close_window(self) -> None:
        """Records a timing window ending now (after a read); starts a fresh one."""
        now = time.perf_counter()
        if self._window_steps:
            self.timing.windows.append((self._window_steps, now - self._window_start, self.epoch))
        self._window_steps, self._window_start = 0, now

    def on_epoch_end(self, epoch, logs=None):
        logs = logs if logs is not None else {}
        if self.validation_examples is not None and "val_loss" in logs:
            logs["val_examples"] = self.validation_examples  # (later callbacks see it too)
        self._checked({k: v for k, v in logs.items() if not k.startswith("val_")})
        self._close_window()
        per_epoch = self._steps_per_epoch()
        done = (self._last + 1) if self._last is not None else per_epoch
        values = _numbers(logs)
        note = ""
        if done < per_epoch:  # stopped inside the epoch (max_steps, a callback)
            self.partial = values
            note = (f" (stopped at max_steps={self.max_steps})" if self.max_steps is not None
                    else " (stopped)")
        if self._progbar is not None:  # (a count of examples is no average: in the logs only)
            self._progbar.stateful_metrics.update(values)
            self._progbar.update(done, [(k, v) for k, v in values.items()
                                        if not k.endswith("examples")], finalize=True)
            self._progbar = None
            if note:
                _log.info("epoch %d/%d%s", epoch + 1, (self.params or {}).get("epochs"), note)
        elif cluster.is_lead_client() and self.verbose:
            text = " - ".join(f"{k}: {int(v)}" if k.endswith("examples") else f"{k}: {v:.4f}"
                              for k, v in values.items())
            _log.info("epoch %d/%d - %s%s", epoch + 1, (self.params or {}).get("epochs"),
                      text, note)
        if self._writer is not None:
            with self._writer.as_default():
                for key, value in values.items():
                    tf.summary.scalar(key, value, step=epoch + 1)
            self._writer.flush()

    def on_train_end(self, logs=None):
        self._writer = None
