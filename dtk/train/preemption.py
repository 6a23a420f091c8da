"""A clean stop on SIGTERM and SIGINT: save at the next step boundary, release, exit non-zero.

Slurm, Kubernetes and cloud preemption send SIGTERM and kill a few seconds to minutes later;
Ctrl-C sends SIGINT. Python's defaults end the process at once (SIGTERM: no message, the
checkpoint directory's lock left behind) or raise ``KeyboardInterrupt`` wherever the main thread
is (a traceback; the epoch's work lost). With dtk's checkpoints in use, the training loops
(``dtk.Trainer``, ``dtk.CheckpointCallback`` under Keras's ``fit``) hold a ``StopSignals``
while they train: a signal only sets a flag; the loop sees it at the next step boundary, saves
a checkpoint there (its position inside the epoch included), releases the directory and raises
``Preempted``. A re-run of the same command resumes from that checkpoint with the
uninterrupted run's numbers.

``Preempted`` is a ``SystemExit`` whose code is 128 + the signal's number (143 for SIGTERM, 130
for SIGINT, as a shell reports a process ended by the signal): a script that does not catch it
exits with that status and no traceback. A second signal of the same kind acts at once, as it
would without dtk.

Several clients must stop at the same step; a signal reaches each at a different one. There the
loops do not install the handlers (the launcher's own forwarding stops the group, and the last
checkpoint stays the latest): a one-process run is where a stop saves.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any, Sequence

_log = logging.getLogger("dtk")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class Preempted(SystemExit):
    """Training stopped on a signal after saving a checkpoint at a step boundary.

    Attributes:
      signum: the signal received.
      checkpoint: the checkpoint saved at the stop (None if the loop had none to write).
      step: the optimizer step the checkpoint holds.
    """

    def __init__(self, signum: int, checkpoint: str | None, step: int):
        super().__init__(128 + int(signum))
        self.signum, self.checkpoint, self.step = int(signum), checkpoint, int(step)

    @property
    def message(self) -> str:
        name = signal_name(self.signum)
        if self.checkpoint is None:
            return f"stopped by {name} at step {self.step}; no checkpoint directory was given"
        return (f"stopped by {name} at step {self.step}: saved {self.checkpoint} and released "
                "its directory; run the same command again to resume from there")

    def __str__(self) -> str:
        return self.message


class StopSignals:
    """Turns SIGTERM/SIGINT into a request that a training loop reads at its step boundaries.

    Installed only in the main thread of a one-client run (``enabled``); elsewhere ``signum``
    stays None and the signals act as they would without it.

    Example::

        with StopSignals() as stop:
            for step in ...:
                train_one_step()
                if stop.signum is not None:
                    save(); raise Preempted(stop.signum, path, step)
    """

    def __init__(self, signals: Sequence[int] = STOP_SIGNALS):
        self.signals = tuple(signals)
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def enabled(self) -> bool:
        return bool(self._previous)

    def _handler(self, signum, frame) -> None:
        del frame
        if self.signum is not None:  # the second one acts at once, as without dtk
            previous = self._previous.get(signum, signal.SIG_DFL)
            self.uninstall()
            if callable(previous):
                previous(signum, None)
            else:
                signal.signal(signum, signal.SIG_DFL)
                signal.raise_signal(signum)
            return
        self.signum = signum
        _log.warning("received %s: saving a checkpoint at the next step boundary, then stopping "
                     "(send it again to stop at once)", signal.Signals(signum).name)

    def install(self) -> "StopSignals":
        from dtk.cluster import env as cluster  # pylint: disable=g-import-not-at-top
        if self._previous or threading.current_thread() is not threading.main_thread() or \
                cluster.num_clients() > 1:
            return self
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def __enter__(self) -> "StopSignals":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()
