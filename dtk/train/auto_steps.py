"""``steps_per_execution="auto"``: how many batches a compiled call runs, measured on this machine.

A call's fixed cost (dispatch, the step's function call, reading back the logs) is paid once per
call; stacking ``n`` batches in one call spreads it over ``n`` steps. ``AutoSteps`` times one-step
calls, then calls of ``AUTO_PROBE_STEPS`` stacked batches, takes the overhead from what stacking
saved, and chooses the count that keeps it under ``AUTO_OVERHEAD_FRACTION`` of a step
(``choose_steps_per_call``). Every client uses client 0's choice: the clients' compiled calls
must match.

Used by ``dtk.Trainer`` (``TrainerConfig(steps_per_execution="auto")``, the default) and by a
``dtk.distribute`` model compiled with ``steps_per_execution="auto"`` (``AutoStepsCallback``, in
place of Keras's own tuner, which times each client alone).
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import tf_keras
from tensorflow.experimental import dtensor

from dtk.cluster import env as cluster
from dtk.parallel import mesh as mesh_lib

_log = logging.getLogger("dtk")


# steps_per_execution="auto"
AUTO_CALIBRATION_CALLS = 8      # timed one-step calls (after the first, traced one)
AUTO_PROBE_CALLS = 4            # timed stacked calls (after the one that traces): medians of
                                # 4 and 2 chose 1 in one MNIST run of 3 where stacking saves 30%
AUTO_PROBE_STEPS = 8            # then stacks of this many: one traced call, two timed
AUTO_MIN_STEPS = 200            # a fit planned shorter runs one step per call (no calibration)
AUTO_OVERHEAD_FRACTION = 0.03   # per-call overhead kept under this share of a step
AUTO_MAX_STEPS_PER_CALL = 32
# The probe's count is kept where the choice is within this factor of it: the overhead measured
# from a few calls varies by 2x between runs (3.8 and 6.5 ms on the same MNIST run here, which
# chose 8 and 19), and the time saved between such counts is a few percent of a step.
AUTO_KEEP_PROBE = 4


def choose_steps_per_call(step_s: float, overhead_s: float, steps_per_epoch: int) -> int:
    """Batches per compiled call so that the per-call overhead is a small share of the work.

    ``step_s`` is a measured one-step call (overhead included), ``overhead_s`` the measured
    cost of a call that does nothing on the same mesh. The overhead of one call is spread over
    ``n`` steps; ``n`` is the smallest count that brings it under ``AUTO_OVERHEAD_FRACTION`` of
    the step's own work, capped by ``AUTO_MAX_STEPS_PER_CALL`` and by the epoch length, and
    lowered (by at most half) to a divisor of the epoch length where one exists. A step that
    dwarfs the overhead gets 1 (stacking would only add host memory and latency).
    """
    work = max(step_s - overhead_s, 1e-6)
    n = max(1, min(math.ceil(overhead_s / (AUTO_OVERHEAD_FRACTION * work)),
                   AUTO_MAX_STEPS_PER_CALL, steps_per_epoch))
    # Prefer a count that divides the epoch (no short last stack, which costs another trace).
    for d in range(n, (n + 1) // 2 - 1, -1):
        if steps_per_epoch % d == 0:
            return d
    return n


class AutoSteps:
    """``steps_per_execution="auto"``: measures one-step calls, then stacked calls, and decides.

    Phase 1 times ``AUTO_CALIBRATION_CALLS`` one-step calls (``t1`` per step). Phase 2 stacks
    ``AUTO_PROBE_STEPS`` batches per call and times ``AUTO_PROBE_CALLS`` calls after the one that traces
    (``tp`` per step). The per-call overhead is what stacking saved, ``c = (t1 - tp) * p / (p - 1)``
    (a no-op call underestimates it: a step's call carries every weight, slot and metric);
    ``choose_steps_per_call(t1, c, ...)`` gives the count, kept at the probe's where it is within
    ``AUTO_KEEP_PROBE`` x of it (no third trace; the same count on runs whose measured overhead
    differs by 2x). When stacking saved under 3%, one step per call it is.
    """

    def __init__(self, mesh: dtensor.Mesh, *, verbose: bool):
        self._mesh, self._verbose = mesh, verbose
        self._single: list[float] = []
        self._probe: list[float] = []
        self._probe_calls = 0
        self.decided = False
        self.steps_per_call = 1

    def set(self, n: int) -> None:
        self.steps_per_call, self.decided = n, True

    def observe(self, seconds: float, steps: int, steps_per_epoch: int) -> None:
        """One timed call of ``steps`` steps (not the fit's first call)."""
        if self.decided:
            return
        if steps == 1 and self.steps_per_call == 1:
            self._single.append(seconds)
            if len(self._single) >= AUTO_CALIBRATION_CALLS:
                probe = min(AUTO_PROBE_STEPS, steps_per_epoch)
                if probe < 2:
                    self.set(1)
                else:
                    self.steps_per_call = probe
            return
        if steps != self.steps_per_call:
            return  # a short stack (epoch end, max_steps): not comparable
        self._probe_calls += 1
        if self._probe_calls == 1:
            return  # that call traced the stacked step
        self._probe.append(seconds / steps)
        if len(self._probe) < AUTO_PROBE_CALLS:
            return
        t1, tp, p = float(np.median(self._single)), float(np.median(self._probe)), self.steps_per_call
        if tp >= (1 - AUTO_OVERHEAD_FRACTION) * t1:
            n, overhead = 1, 0.0
        else:
            overhead = (t1 - tp) * p / (p - 1)
            n = choose_steps_per_call(t1, overhead, steps_per_epoch)
            if p / AUTO_KEEP_PROBE <= n <= AUTO_KEEP_PROBE * p:
                n = p
        if cluster.num_clients() > 1:  # timings differ by client; the stacking must not
            n = int(mesh_lib.values_on_all_clients(self._mesh, float(n))[0])
        self.set(n)
        if self._verbose and cluster.is_lead_client() and not overhead:
            _log.info("steps_per_execution=auto: 1 (one step per call %.2f ms, %d per call %.2f ms "
                      "per step: stacking saves under %.0f%%)", 1000 * t1, p, 1000 * tp,
                      100 * AUTO_OVERHEAD_FRACTION)
        elif self._verbose and cluster.is_lead_client():
            _log.info("steps_per_execution=auto: %d (one step per call %.2f ms, %d per call "
                      "%.2f ms per step: %.2f ms of overhead per call)", n, 1000 * t1, p,
                      1000 * tp, 1000 * overhead)


class AutoStepsCallback(tf_keras.callbacks.Callback):
    """``compile(steps_per_execution="auto")`` on a ``dtk.distribute`` model: ``AutoSteps``'s
    calibration drives Keras's steps per call (its next call reads the count; a
    ``DistributedDataset``'s stacks follow it), and the clients agree on client 0's choice.

    Each call is timed from its batch-begin hook to the read-back of its logs in its batch-end
    hook (the call has run); the fit's first call (it traces) and calls of
    another count (an epoch's last, shorter one) are not used. A fit planned for fewer than
    ``AUTO_MIN_STEPS`` steps runs one step per call. The choice is kept on the model for its
    later fits, and in a ``CheckpointCallback``'s checkpoints: a resumed run takes it after its
    first call, without calibrating again.
    """

    def __init__(self, mesh: dtensor.Mesh):
        super().__init__()
        # Keras then hands the logs over as tensors, read back only while calibrating: with a
        # callback that takes host logs, every call of the whole fit would wait for the last.
        self._supports_tf_logs = True
        self._mesh = mesh
        self._auto: AutoSteps | None = None
        self._start, self._steps, self._first = 0.0, 1, True
        self._realign: int | None = None  # n, after one shorter call that lines the calls up

    def _state(self):
        return self.model._dtk_mesh_state  # pylint: disable=protected-access

    def _count(self):
        return self.model._steps_per_execution  # pylint: disable=protected-access

    def on_train_end(self, logs=None):
        object.__setattr__(self.model, "_dtk_calibrating", False)
        self._state().aligning = False

    def on_train_begin(self, logs=None):
        chosen = getattr(self.model, "_dtk_auto_steps", None)
        params = self.params or {}
        planned = (params.get("steps") or 0) * (params.get("epochs") or 0)
        self._first, self._realign = True, None
        if chosen is not None or planned < AUTO_MIN_STEPS:
            self._auto = None
            self._count().assign(chosen or 1)
            return
        self._auto = AutoSteps(self._mesh, verbose=True)
        self._count().assign(self._auto.steps_per_call)

    def on_train_batch_begin(self, batch, logs=None):
        # (a progress callback leaves the calibration's calls, read back one by one, untimed)
        object.__setattr__(self.model, "_dtk_calibrating", self._auto is not None)
        if self._auto is not None:
            self._steps = int(self._count().numpy())
            self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if self._realign is not None:  # the shorter call ran: n per call from here
            self._count().assign(self._realign)
            self._realign = None
            self._state().aligning = False
            return
        auto = self._auto
        if auto is None:
            return
        for value in (logs or {}).values():  # the call has run once its logs are read back
            np.asarray(value)
            break
        seconds = time.perf_counter() - self._start
        if self._first:  # it traced
            self._first = False
            restored = getattr(self.model, "_dtk_auto_steps", None)
            if restored is not None:  # a CheckpointCallback resumed a run that had chosen
                self._count().assign(restored)
                self._auto = None
            return
        before = auto.steps_per_call
        auto.observe(seconds, self._steps, int((self.params or {}).get("steps") or 1))
        if auto.steps_per_call != before:
            self._count().assign(auto.steps_per_call)
        if auto.decided:
            n = auto.steps_per_call
            object.__setattr__(self.model, "_dtk_auto_steps", n)
            self._auto = None
            done = int(batch) + 1  # (Keras's index of the call's last batch in the epoch)
            if n > 1 and done % n:
                # One shorter call first, so that the calls line up with the epoch's stacks
                # of n (a DistributedDataset stacks them again there: dtk.train.keras_data) and
                # the epoch's last call is the later epochs' (their loops traced once, here).
                self._count().assign(n - done % n)
                self._realign = n
                self._state().aligning = True  # (that call's batches are not stacked again)
