"""Nothing is lost when a run is stopped or run again (issue 72).

A finished run run again, a run killed at random points and re-run, a run stopped by SIGTERM or
SIGINT and re-run: each ends with the uninterrupted run's model, bit for bit, under Keras's own
``fit`` (``dtk.distribute`` + ``dtk.CheckpointCallback``) with every update dtk makes (the
sharded one, in place, FSDP), and through the scripts (``dtk.Trainer``).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tf_keras

import dtk
from dtk.train import checkpoint as ckpt_lib
from dtk.train import preemption
from tests import procs

EPOCHS, BATCH, N = 3, 32, 192  # 6 steps an epoch, 18 in all

# update -> dtk.distribute keywords. The 128x512 and 512x512 kernels have 64K+ elements: the
# sharded update ("auto") keeps their float32 copies and Adam's state cut over batch.
UPDATES = {
    "sharded": {},
    "in_place": {"shard_optimizer_state": False},
    "fsdp": {"fsdp": True},
}


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 128)).astype("float32")
    return x, rng.integers(0, 4, N)


def _mlp():
    return tf_keras.Sequential([
        tf_keras.layers.Dense(512, activation="relu", input_shape=(128,), name="d1"),
        tf_keras.layers.Dense(512, activation="relu", name="d2"),
        tf_keras.layers.Dropout(0.2, name="drop"),  # the draws continue after a resume
        tf_keras.layers.Dense(4, name="d3")])


def _model(update):
    model = dtk.distribute(_mlp, dtk.build_mesh("batch=8"), seed=0, **UPDATES[update])
    model.compile(tf_keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def _fit(model, callbacks, epochs=EPOCHS):
    x, y = _data()
    return model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
                     callbacks=callbacks).history


class _KillAt(tf_keras.callbacks.Callback):
    """A crash at optimizer step ``step`` (after the step, before any later save)."""

    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == self.step:
            raise RuntimeError(f"killed at step {self.step}")


class _SignalAt(tf_keras.callbacks.Callback):
    """Sends this process ``signum`` during step ``step``'s batch end (as a scheduler would)."""

    def __init__(self, step, signum):
        super().__init__()
        self.step, self.signum = step, signum

    def on_train_batch_begin(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == self.step - 1:
            signal.raise_signal(self.signum)


@functools.lru_cache(maxsize=None)
def _uninterrupted(update):
    model = _model(update)
    _fit(model, [])
    return [w.copy() for w in dtk.gather_weights(model)]


def _same_model(model, update):
    for got, want in zip(dtk.gather_weights(model), _uninterrupted(update)):
        np.testing.assert_array_equal(got, want)


# Kill points drawn once (seeded): inside epochs, on an epoch's last step, and after the end.
_KILLS = sorted({int(s) for s in np.random.default_rng(72).integers(1, EPOCHS * N // BATCH, 2)})


@pytest.mark.slow
@pytest.mark.parametrize("update", sorted(UPDATES))
def test_killed_or_finished_runs_run_again_end_with_the_uninterrupted_model(tmp_path, update,
                                                                            caplog):
    """Killed at random steps and at an epoch's end, each re-run (by the same fit) ends with the
    uninterrupted run's weights bit for bit; and the finished run run again once more trains
    nothing, says so, and leaves the model as it was (before the fix, the large kernels went
    back to their initial values under the sharded update). Every kill point with the sharded
    update (where the bug was); one inside an epoch with the others (the suite's time)."""
    for kill in [*_KILLS, 2 * N // BATCH] if update == "sharded" else _KILLS[:1]:
        directory = tmp_path / f"kill{kill}"
        with pytest.raises(RuntimeError, match="killed"):
            _fit(_model(update), [dtk.CheckpointCallback(directory), _KillAt(kill)])
        model = _model(update)
        _fit(model, [dtk.CheckpointCallback(directory)])
        _same_model(model, update)
    again = _model(update)
    with caplog.at_level(logging.WARNING, logger="dtk"):
        history = _fit(again, [dtk.CheckpointCallback(directory)])
    assert history == {} or not any(history.values())  # no epoch trained
    assert "already complete" in caplog.text and f"epoch {EPOCHS} of {EPOCHS}" in caplog.text
    _same_model(again, update)
    x, y = _data()
    plain = _mlp()
    plain.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    plain.set_weights(_uninterrupted(update))
    np.testing.assert_allclose(again.evaluate(x, y, batch_size=BATCH, verbose=0),
                               plain.evaluate(x, y, batch_size=BATCH, verbose=0), rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("signum,step", [(signal.SIGTERM, 8), (signal.SIGINT, 6),
                                         (signal.SIGTERM, 18)])
def test_a_signal_saves_at_the_step_releases_the_directory_and_the_rerun_is_exact(
        tmp_path, signum, step):
    """SIGTERM inside an epoch (step 8 of 6-step epochs), SIGINT on an epoch's last step: fit
    raises dtk.Preempted (a SystemExit with 128 + the signal) after saving that very step and
    releasing the lock; the re-run loses no step and ends with the uninterrupted weights. On
    the run's last step the run ends as it would."""
    directory = tmp_path / "ckpt"
    model = _model("sharded")
    if step == EPOCHS * N // BATCH:
        _fit(model, [dtk.CheckpointCallback(directory), _SignalAt(step, signum)])
        _same_model(model, "sharded")
        return
    with pytest.raises(dtk.Preempted) as stopped:
        _fit(model, [dtk.CheckpointCallback(directory), _SignalAt(step, signum)])
    assert stopped.value.code == 128 + signum and stopped.value.step == step
    assert stopped.value.checkpoint.endswith(f"ckpt-{step}")
    assert os.path.getsize(directory / ".dtk-lock") == 0  # released, nothing to take over
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are gone
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    callback = dtk.CheckpointCallback(directory)
    model = _model("sharded")
    _fit(model, [callback])
    assert (callback.restored_epoch, callback.restored_step) == divmod(step, N // BATCH)
    _same_model(model, "sharded")


def test_an_asynchronous_save_is_the_latest_as_soon_as_it_is_written(tmp_path):
    """Recorded by the thread that writes it: a kill before the next save resumes from it."""
    model = _model("in_place")
    callback = dtk.CheckpointCallback(tmp_path, asynchronous=True)

    class Look(tf_keras.callbacks.Callback):
        seen = []

        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and callback._checkpointer.saving:  # pylint: disable=protected-access
                    time.sleep(0.01)
                import tensorflow as tf  # pylint: disable=g-import-not-at-top
                self.seen.append(tf.train.latest_checkpoint(str(tmp_path)))

    _fit(model, [callback, Look()], epochs=2)
    assert Look.seen == [str(tmp_path / "ckpt-6")]


def test_all_checkpoints_damaged_names_the_callbacks_way_on(tmp_path):
    directory = tmp_path / "ckpt"
    _fit(_model("in_place"), [dtk.CheckpointCallback(directory)], epochs=1)
    for f in directory.glob("ckpt-*.data-*"):
        f.write_bytes(b"garbage")
    with pytest.raises(ckpt_lib.CheckpointError,
                       match=r"CheckpointCallback\(\.\.\., restart_from_scratch=True\)"):
        _fit(_model("in_place"), [dtk.CheckpointCallback(directory)], epochs=2)
    assert os.path.getsize(directory / ".dtk-lock") == 0
    model = _model("in_place")
    history = _fit(model, [dtk.CheckpointCallback(directory, restart_from_scratch=True)], epochs=1)
    assert len(history["loss"]) == 1


def _train_mnist(directory, summary, *extra):
    # 125 steps an epoch on the bundled sample: a signal after epoch 1's checkpoint lands inside
    # epoch 2
    return [sys.executable, "scripts/train_mnist.py", "--mesh", "batch=8", "--epochs", "3",
            "--dataset", "sample", "--global_batch_size", "16",
            "--checkpoint_dir", str(directory), "--summary_json", str(summary),
            "--steps_per_execution", "1", *extra]


@pytest.mark.slow
def test_sigterm_to_train_mnist_saves_exits_143_and_the_rerun_is_exact(tmp_path):
    """The scripts (dtk.Trainer): SIGTERM mid-run saves at the step, releases the directory,
    prints one ``stopped by SIGTERM at step N: saved ...`` line and exits 143; the same command again finishes with the
    uninterrupted run's test accuracy and loss; run once more, it trains nothing and says so."""
    env = procs.base_env(DTK_OFFLINE="1")
    straight = subprocess.Popen(_train_mnist(tmp_path / "a", tmp_path / "a.json"), env=env,
                                cwd=procs.REPO, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    stopped = subprocess.Popen(_train_mnist(tmp_path / "b", tmp_path / "b.json"), env=env,
                               cwd=procs.REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        deadline = time.monotonic() + 240
        while stopped.poll() is None and time.monotonic() < deadline:  # into training
            if list((tmp_path / "b").glob("ckpt-*.index")):
                break
            time.sleep(0.05)
        stopped.send_signal(signal.SIGTERM)
        _, err = stopped.communicate(timeout=120)
        assert straight.wait(timeout=300) == 0
    finally:
        for p in (straight, stopped):
            if p.poll() is None:
                p.kill()
    assert stopped.returncode == 143, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("stopped by SIGTERM at step")]
    assert len(lines) == 1 and "SIGTERM" in lines[0] and "Traceback" not in err, err[-2000:]
    assert os.path.getsize(tmp_path / "b" / ".dtk-lock") == 0
    for run in range(2):
        again = subprocess.run(_train_mnist(tmp_path / "b", tmp_path / "b.json"), env=env,
                               cwd=procs.REPO, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stderr[-2000:]
        want, got = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "ab")
        assert got["test_accuracy"] == want["test_accuracy"]
        assert got["test_loss"] == want["test_loss"]
    assert "already complete" in again.stderr + again.stdout


def test_preempted_is_a_system_exit_with_the_signals_status():
    stop = preemption.Preempted(signal.SIGTERM, "/d/ckpt-8", 8)
    assert isinstance(stop, SystemExit) and stop.code == 143
    assert "SIGTERM" in str(stop) and "/d/ckpt-8" in str(stop) and "again" in str(stop)


@pytest.mark.slow
def test_train_lm_in_stages_run_again_after_it_finished_is_the_finished_model(tmp_path):
    """Pipeline stages: the finished run run again restores the stages, trains nothing, says
    so, and gives the finished run's held-out bits per byte and sample exactly (it stopped with
    "no median for empty data" before)."""
    command = [sys.executable, "scripts/train_lm.py", "--mesh", "stage=2,batch=4",
               "--microbatches", "4", "--steps", "3", "--eval_every", "3", "--eval_batches", "2",
               "--global_batch_size", "16", "--seq_len", "32", "--dim", "32", "--heads", "4",
               "--sample_bytes", "8", "--dropout", "0.1", "--checkpoint_dir", str(tmp_path / "c")]
    summaries = []
    for run in range(2):
        done = subprocess.run([*command, "--summary_json", str(tmp_path / f"{run}.json")],
                              env=procs.base_env(), cwd=procs.REPO, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        summaries.append(json.loads((tmp_path / f"{run}.json").read_text()))
    assert "already complete" in done.stdout and "step 3 of 3" in done.stdout
    first, again = summaries
    assert again["heldout_bits_per_byte"] == first["heldout_bits_per_byte"]
    assert again["sample"] == first["sample"] and again["steps"] == 3
    assert again["ms_per_step_median"] is None
