"""The Trainer: fit/evaluate/predict, resume == uninterrupted, checkpoints across meshes, export."""

import functools
import glob
import os
import re

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import dtk
from dtk.parallel import layouts
from dtk.train import auto_steps
from dtk.train import checkpoint as ckpt_lib
from dtk.data import input as input_lib
from dtk import models
from tests import procs

# With dropout: parity with one device and resume == uninterrupted hold with random layers too
# (dtk.parallel.randomness draws the same masks on every mesh and after a restore).
FACTORY = functools.partial(models.mnist_mlp, hidden=16, dropout=0.2)
N_TRAIN, N_TEST, BATCH = 200, 75, 32   # 6 steps per epoch, 8 examples dropped; 75 = 2*32 + 11


def _arrays(n, seed):
    rng = np.random.default_rng(seed)
    return (rng.random((n, 28, 28, 1), dtype=np.float32),
            rng.integers(0, 10, n).astype(np.int64))


def _data(mesh, *, n=N_TRAIN, seed=0, remainder="drop", shuffle=True, steps_per_call=1):
    ds = tf.data.Dataset.from_tensor_slices(_arrays(n, seed))
    return input_lib.DistributedDataset(ds, mesh, input_lib.InputConfig(
        global_batch_size=BATCH, remainder=remainder, shuffle=shuffle, seed=5,
        steps_per_call=steps_per_call))


def _trainer(spec="batch=8", layout="data_parallel", **config):
    mesh = dtk.build_mesh(spec)
    opt = dtk.make_optimizer("adam", mesh, learning_rate=0.01)
    config.setdefault("verbose", 0)
    return dtk.Trainer(mesh=mesh, model=FACTORY, layout=layout, optimizer=opt,
                       config=dtk.TrainerConfig(seed=3, **config))


def _plain_twin(trainer):
    return ckpt_lib.plain_copy(trainer.model, FACTORY)


def test_fit_evaluate_predict():
    trainer = _trainer()
    mesh = trainer.mesh
    train, test = _data(mesh), _data(mesh, n=N_TEST, seed=1, remainder="pad", shuffle=False)
    assert (train.num_batches, train.num_dropped) == (6, 8)
    history = trainer.fit(train, epochs=2, validation_data=test)
    assert history.epochs == [0, 1]
    assert set(history.history) == {"loss", "accuracy", "val_loss", "val_accuracy", "val_examples"}
    assert history.history["val_examples"] == [N_TEST, N_TEST]
    assert trainer.global_step == 12

    results = trainer.evaluate(test)
    assert results["examples"] == N_TEST  # every example counted, none of the padding
    x, y = _arrays(N_TEST, 1)
    twin = _plain_twin(trainer)
    logits = twin(x).numpy()
    want_loss = float(tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, logits))
    np.testing.assert_allclose(results["loss"], want_loss, rtol=1e-5)
    np.testing.assert_allclose(results["accuracy"], np.mean(logits.argmax(1) == y), rtol=1e-6)
    np.testing.assert_allclose(trainer.predict(test), logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec, layout", [
    pytest.param("batch=8", "data_parallel", marks=pytest.mark.slow),
    ("batch=4,model=2", "mlp_model_parallel"),
    pytest.param("batch=2,model=4", "mlp_model_parallel", marks=pytest.mark.slow),
    pytest.param("batch=1,model=8", "mlp_model_parallel", marks=pytest.mark.slow)])
def test_fit_matches_one_device(spec, layout):
    one = _trainer("batch=1")
    want = one.fit(_data(one.mesh), epochs=2).history
    trainer = _trainer(spec, layout)
    got = trainer.fit(_data(trainer.mesh), epochs=2).history
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5)
    for a, b in zip(dtk.gather_weights(trainer.model), dtk.gather_weights(one.model)):
        # atol: Adam (lr 0.01) turns rounding differences in near-zero gradients into tiny steps.
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spe, stop_at, shard", [
    (2, 9, False), pytest.param(1, 8, False, marks=pytest.mark.slow),
    pytest.param(1, 6, False, marks=pytest.mark.slow), pytest.param(1, 8, True, marks=pytest.mark.slow)])
def test_resume_equals_uninterrupted(tmp_path, spe, stop_at, shard):
    # shard: the ZeRO-style update keeps its own weight copies, which a restore must refresh.
    full = _trainer(steps_per_execution=spe, shard_optimizer_state=shard)
    want = full.fit(_data(full.mesh, steps_per_call=spe), epochs=3).history

    first = _trainer(checkpoint_dir=str(tmp_path), steps_per_execution=spe, max_steps=stop_at,
                     shard_optimizer_state=shard)
    first.fit(_data(first.mesh, steps_per_call=spe), epochs=3)
    assert first.global_step == stop_at
    second = _trainer(checkpoint_dir=str(tmp_path), steps_per_execution=spe,
                      shard_optimizer_state=shard)
    got = second.fit(_data(second.mesh, steps_per_call=spe), epochs=3).history
    assert second.global_step == 18
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6)
    for a, b in zip(dtk.gather_weights(second.model), dtk.gather_weights(full.model)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_restore_into_another_mesh_shape(tmp_path):
    source = _trainer(checkpoint_dir=str(tmp_path))
    source.fit(_data(source.mesh), epochs=1)
    for spec in ("batch=4,model=2", "batch=2,model=4"):
        target = _trainer(spec, "mlp_model_parallel", checkpoint_dir=str(tmp_path))
        target.fit(_data(target.mesh), epochs=1)  # epoch 1 is done: restored, nothing trained
        assert target.restored_checkpoint.endswith("ckpt-6") and target.global_step == 6
        for a, b in zip(dtk.gather_weights(target.model), dtk.gather_weights(source.model)):
            np.testing.assert_array_equal(a, b)


def test_checkpoint_of_another_model_is_a_clear_error(tmp_path):
    source = _trainer(checkpoint_dir=str(tmp_path))
    source.fit(_data(source.mesh), epochs=1)
    mesh = dtk.build_mesh("batch=8")
    other = dtk.Trainer(mesh=mesh, model=functools.partial(models.mnist_mlp, hidden=8),
                        layout="data_parallel", optimizer="adam",
                        config=dtk.TrainerConfig(checkpoint_dir=str(tmp_path), verbose=0))
    with pytest.raises(ValueError, match="does not match this model"):
        other.fit(_data(mesh), epochs=2)


def test_resume_with_other_data_is_a_clear_error(tmp_path):
    source = _trainer(checkpoint_dir=str(tmp_path))
    source.fit(_data(source.mesh), epochs=1)
    again = _trainer(checkpoint_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"other settings: train_examples 200 -> 100\. .*"
                                         r"--allow_change train_examples"):
        again.fit(_data(again.mesh, n=100), epochs=2)
    # Allowed on purpose (issue 41), the run goes on from the checkpoint's epoch boundary: epoch
    # 2 trains on the new data's 3 batches.
    allowed = _trainer(checkpoint_dir=str(tmp_path), allow_change=("train_examples",))
    allowed.fit(_data(allowed.mesh, n=100), epochs=2)
    assert allowed.global_step == 6 + 3
    assert allowed.resume_changes["train_examples"] == {"old": 200, "new": 100}


@pytest.mark.parametrize("change, kwargs, listed", [
    ("dropout", dict(factory=functools.partial(models.mnist_mlp, hidden=16, dropout=0.3)),
     "model.3:Dropout.rate 0.2 -> 0.3"),
    ("seed and learning rate", dict(seed=4, lr=0.02), "learning_rate 0.01 -> 0.02; seed 3 -> 4"),
])
def test_resume_with_changed_settings_lists_them(tmp_path, change, kwargs, listed):
    source = _trainer(checkpoint_dir=str(tmp_path), max_steps=3)
    source.fit(_data(source.mesh), epochs=1)
    mesh = dtk.build_mesh("batch=8")
    again = dtk.Trainer(mesh=mesh, model=kwargs.get("factory", FACTORY), layout="data_parallel",
                        optimizer=dtk.make_optimizer("adam", mesh,
                                                     learning_rate=kwargs.get("lr", 0.01)),
                        config=dtk.TrainerConfig(seed=kwargs.get("seed", 3), verbose=0,
                                                 checkpoint_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="other settings: " + re.escape(listed) + r"\. "):
        again.fit(_data(mesh), epochs=1)


@pytest.mark.slow  # 10-14 s: the fast lane's 3-minute budget
def test_allowed_learning_rate_change_is_applied(tmp_path):
    """Allowed on purpose, the new rate is really used (the checkpoint's would win otherwise)."""
    def run(directory, lr, allow=(), max_steps=None):
        mesh = dtk.build_mesh("batch=8")
        trainer = dtk.Trainer(mesh=mesh, model=FACTORY, layout="data_parallel",
                              optimizer=dtk.make_optimizer("adam", mesh, learning_rate=lr),
                              config=dtk.TrainerConfig(seed=3, verbose=0, checkpoint_dir=directory,
                                                       allow_change=allow, max_steps=max_steps))
        return trainer, trainer.fit(_data(mesh), epochs=2).history["loss"]

    for name in ("a", "b"):
        run(str(tmp_path / name), 0.01, max_steps=6)
    changed, got = run(str(tmp_path / "a"), 0.05, allow=("learning_rate",))
    _, same = run(str(tmp_path / "b"), 0.01)
    assert changed.resume_changes == {"learning_rate": {"old": 0.01, "new": 0.05}}
    np.testing.assert_allclose(float(changed.optimizer.learning_rate.numpy()), 0.05, rtol=1e-6)
    assert abs(got[1] - same[1]) > 1e-3, (got, same)   # epoch 2 trained at the new rate
    with pytest.raises(ValueError, match=r"allow_change \(--allow_change\) names setting\(s\) \['learnin_rate'\]"):
        run(str(tmp_path / "b"), 0.01, allow=("learnin_rate",))


def test_second_run_on_a_directory_is_refused_and_a_stale_lock_taken_over(tmp_path, caplog):
    """One writer per directory: a live holder (another process) is named; a dead one's lock is
    taken over with one warning."""
    holder = procs.run_python(
        "import fcntl, json, os, sys, time\n"
        "f = open(os.path.join(sys.argv[1], '.dtk-lock'), 'a+')\n"
        "fcntl.flock(f, fcntl.LOCK_EX)\n"
        "f.write(json.dumps({'host': 'h1', 'pid': os.getpid(), 'started': 0, 'run_id': 'r1'}))\n"
        "f.flush(); print('HELD', flush=True); time.sleep(float(sys.argv[2]))\n",
        args=(str(tmp_path), "0"), timeout=60)
    assert holder.returncode == 0  # it held the lock and died: its record stays
    with caplog.at_level("WARNING", logger="dtk"):
        trainer = _trainer(checkpoint_dir=str(tmp_path), max_steps=1)
        trainer.fit(_data(trainer.mesh), epochs=1)  # the lock is taken for the fit
    taken = [r.getMessage() for r in caplog.records if "taking over the lock" in r.getMessage()]
    assert len(taken) == 1 and "host h1" in taken[0] and "run r1" in taken[0], taken

    live = procs.hold_checkpoint_lock(tmp_path, host="h2", run_id="r2")
    try:
        with pytest.raises(ckpt_lib.CheckpointError,
                           match=rf"{re.escape(str(tmp_path))} is in use by another run \(host h2, "
                                 rf"pid {live.pid}, started .*, run r2\)"):
            refused = _trainer(checkpoint_dir=str(tmp_path))
            refused.fit(_data(refused.mesh), epochs=2)
        assert refused.global_step == 0  # (refused before any step)
    finally:
        live.kill()
        live.wait(timeout=10)


def test_crash_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    trainer = _trainer(checkpoint_dir=str(tmp_path))
    trainer.fit(_data(trainer.mesh), epochs=1)
    first = trainer.latest_checkpoint
    weights = dtk.gather_weights(trainer.model)
    from tensorflow.python.checkpoint import checkpoint_management

    def crash(*args, **kwargs):
        raise OSError("disk full (simulated crash before the checkpoint is recorded)")

    monkeypatch.setattr(checkpoint_management, "update_checkpoint_state_internal", crash)
    # (sync saves raise the OSError; an asynchronous one's thread records it and wait() names it)
    with pytest.raises((OSError, ckpt_lib.CheckpointError), match="simulated") as failed:
        trainer.fit(_data(trainer.mesh), epochs=2)
    if isinstance(failed.value, ckpt_lib.CheckpointError):
        assert f"{first} stays the latest" in str(failed.value)
    monkeypatch.undo()
    again = _trainer(checkpoint_dir=str(tmp_path))
    again.fit(_data(again.mesh), epochs=1)  # restored at epoch 1 of 1: nothing trained
    assert again.restored_checkpoint == first and again.latest_checkpoint == first
    assert again.global_step == 6
    for a, b in zip(dtk.gather_weights(again.model), weights):
        np.testing.assert_array_equal(a, b)


def test_async_checkpoints_resume_exactly_across_meshes(tmp_path):
    """Asynchronous saves (each device's shards copied to the host, written by a thread) hold
    the same values as synchronous ones: written on batch=8 (sharded update) and on
    batch=4,model=2 (weights sharded over model), resumed on the next mesh each time, the run
    ends with the uninterrupted run's numbers; every checkpoint is recorded once complete."""
    full = _trainer()
    want = full.fit(_data(full.mesh), epochs=3).history
    first = _trainer(checkpoint_dir=str(tmp_path), max_steps=8, async_checkpoints=True)
    first.fit(_data(first.mesh), epochs=3)  # saves at 6 (epoch end, in the background) and 8
    assert first.latest_checkpoint.endswith("ckpt-8")
    second = _trainer("batch=4,model=2", "mlp_model_parallel", checkpoint_dir=str(tmp_path),
                      max_steps=14, async_checkpoints=True)
    second.fit(_data(second.mesh), epochs=3)
    assert second.restored_checkpoint.endswith("ckpt-8")
    assert second.latest_checkpoint.endswith("ckpt-14")
    third = _trainer("batch=2,model=4", "mlp_model_parallel", checkpoint_dir=str(tmp_path))
    got = third.fit(_data(third.mesh), epochs=3).history
    assert third.restored_checkpoint.endswith("ckpt-14") and third.global_step == 18
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6)
    for a, b in zip(dtk.gather_weights(third.model), dtk.gather_weights(full.model)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_failed_async_save_is_never_the_latest(tmp_path, monkeypatch):
    """A background write that fails (the disk filled) is reported when training next waits on
    it, its partial files are removed, and the previous checkpoint stays the latest."""
    trainer = _trainer(checkpoint_dir=str(tmp_path), async_checkpoints=True)
    trainer.fit(_data(trainer.mesh), epochs=1)
    first = trainer.latest_checkpoint
    from tensorflow.python.ops import gen_io_ops

    def full_disk(*args, **kwargs):
        raise tf.errors.ResourceExhaustedError(None, None, "No space left on device")

    monkeypatch.setattr(gen_io_ops, "merge_v2_checkpoints", full_disk)
    with pytest.raises(ckpt_lib.CheckpointError,
                       match=r"saving checkpoint .*ckpt-12 failed: No space left on device; "
                             r"its partial files were removed and .*ckpt-6 stays the latest"):
        trainer.fit(_data(trainer.mesh), epochs=2)
    monkeypatch.undo()
    assert not glob.glob(str(tmp_path / "ckpt-12*"))
    again = _trainer(checkpoint_dir=str(tmp_path))
    again.fit(_data(again.mesh), epochs=1)  # restored at epoch 1 of 1: nothing trained
    assert again.restored_checkpoint == first and again.latest_checkpoint == first
    assert again.global_step == 6


def test_export_round_trip(tmp_path):
    trainer = _trainer()
    trainer.fit(_data(trainer.mesh), epochs=1)
    test = _data(trainer.mesh, n=N_TEST, seed=1, remainder="pad", shuffle=False)
    paths = trainer.export(str(tmp_path / "export"))
    x, _ = _arrays(N_TEST, 1)
    want = trainer.predict(test)
    plain = tf_keras.models.load_model(paths["keras"])
    np.testing.assert_allclose(plain.predict(x, verbose=0), want, rtol=1e-5, atol=1e-6)
    served = tf.saved_model.load(paths["saved_model"])
    out = served.signatures["serving_default"](tf.constant(x))
    np.testing.assert_allclose(next(iter(out.values())).numpy(), want, rtol=1e-5, atol=1e-6)
    # One format only: the other is not written.
    only = trainer.export(str(tmp_path / "keras_only"), formats=["keras"])
    assert set(only) == {"keras"} and os.listdir(tmp_path / "keras_only") == ["model.keras"]
    for bad in ("keras", [], ["keras", "onnx"]):
        with pytest.raises(ValueError, match=r"formats=.*give a non-empty list of \['keras', "
                                             r"'saved_model'\]"):
            trainer.export(str(tmp_path / "bad"), formats=bad)


def test_callbacks_and_tensorboard(tmp_path):
    trainer = _trainer(tensorboard_dir=str(tmp_path / "tb"), steps_per_execution=2)
    epochs, steps = [], []
    trainer.fit(_data(trainer.mesh, steps_per_call=2), epochs=2,
                on_epoch_end=[lambda e, logs: epochs.append((e, sorted(logs)))],
                on_step_end=[steps.append])
    assert epochs == [(0, ["accuracy", "loss"]), (1, ["accuracy", "loss"])]
    assert steps == [2, 4, 6, 8, 10, 12]
    assert glob.glob(os.path.join(tmp_path, "tb", "events.out.tfevents.*"))
    assert trainer.timing.first_step_s > 0
    assert trainer.timing.ms_per_step_median() > 0


def test_bad_arguments():
    trainer = _trainer(steps_per_execution=1)
    with pytest.raises(ValueError, match="epochs must be a positive integer"):
        trainer.fit(_data(trainer.mesh), epochs=0)
    with pytest.raises(ValueError, match="steps_per_call=2 .* steps_per_execution=1"):
        trainer.fit(_data(trainer.mesh, steps_per_call=2), epochs=1)
    with pytest.raises(ValueError, match="max_steps must be a positive integer"):
        dtk.TrainerConfig(max_steps=0)
    with pytest.raises(ValueError, match="layout applies only when model is a factory"):
        dtk.Trainer(mesh=trainer.mesh, model=trainer.model, layout="data_parallel")


def test_keeps_the_last_checkpoints(tmp_path):
    trainer = _trainer(checkpoint_dir=str(tmp_path), max_to_keep=2)
    trainer.fit(_data(trainer.mesh), epochs=3)
    kept = sorted(os.path.basename(p) for p in glob.glob(str(tmp_path / "ckpt-*.index")))
    assert kept == ["ckpt-12.index", "ckpt-18.index"]
    assert trainer.latest_checkpoint.endswith("ckpt-18")


@pytest.mark.slow  # 10-14 s: the fast lane's 3-minute budget
def test_repeated_dataset_with_steps_per_epoch_resumes_exactly(tmp_path):
    """An infinite (repeat) pipeline with shuffling and augmentation: a run stopped mid-epoch and
    resumed equals the uninterrupted run."""
    def data(mesh):
        ds = tf.data.Dataset.from_tensor_slices(_arrays(N_TRAIN, 0)).shuffle(64, seed=1).repeat()
        ds = ds.map(lambda x, y: (x + tf.random.stateless_uniform(x.shape, [1, 2]) * 0.01, y))
        return input_lib.DistributedDataset(ds, mesh, input_lib.InputConfig(
            global_batch_size=BATCH, steps_per_epoch=4))

    full = _trainer()
    want = full.fit(data(full.mesh), epochs=3).history["loss"]
    first = _trainer(checkpoint_dir=str(tmp_path), max_steps=6)
    first.fit(data(first.mesh), epochs=3)
    resumed = _trainer(checkpoint_dir=str(tmp_path))
    got = resumed.fit(data(resumed.mesh), epochs=3).history["loss"]
    assert resumed.global_step == 12
    np.testing.assert_allclose(got, want, rtol=1e-6)


# -- the fast defaults: steps_per_execution="auto", shard_optimizer_state="auto" -------------------
@pytest.mark.parametrize("step_ms, overhead_ms, epoch, want", [
    (12.0, 3.0, 190, 10),   # MLP-like: 3 ms of 12 -> 12 wanted, 10 divides the epoch
    (60.0, 2.5, 190, 2),    # heavy step: the overhead is already small
    (500.0, 2.0, 190, 1),   # a step that dwarfs the overhead: no stacking
    (3.0, 2.9, 190, 19),    # nearly all overhead: capped at 32, then 19 divides the epoch
    (3.0, 2.9, 191, 32),    # 191 is prime: capped
    (12.0, 3.0, 6, 6),      # capped by the epoch
    (12.0, 3.0, 7, 7),
])
def test_choose_steps_per_call(step_ms, overhead_ms, epoch, want):
    assert auto_steps.choose_steps_per_call(step_ms / 1e3, overhead_ms / 1e3, epoch) == want


@pytest.mark.parametrize("max_steps", [None, pytest.param(11, marks=pytest.mark.slow)])
def test_auto_steps_per_execution_is_bit_identical(monkeypatch, caplog, max_steps):
    """auto re-stacks the stream twice in epoch 0 (1 -> 2 -> 3 per call); the updates, max_steps
    and the history are those of one step per call, bit for bit. The re-stacks re-read the
    stream silently: only a resume says that batches are read again (issue 57)."""
    def observe(self, seconds, steps, steps_per_epoch):  # fixed decisions instead of timings
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 2:
            self.steps_per_call = 2   # the probe: switches at the next even batch
        if self.calls == 4:
            self.set(3)

    monkeypatch.setattr(auto_steps.AutoSteps, "observe", observe)
    monkeypatch.setattr(auto_steps, "AUTO_MIN_STEPS", 1)
    one = _trainer(steps_per_execution=1, shard_optimizer_state=False, max_steps=max_steps)
    want = one.fit(_data(one.mesh), epochs=3)
    auto = _trainer(shard_optimizer_state=False, max_steps=max_steps)
    with caplog.at_level("INFO", logger="dtk"):
        got = auto.fit(_data(auto.mesh), epochs=3)
    assert "stream starts" not in caplog.text  # said at debug level only
    assert auto.steps_per_execution == 3
    assert auto.global_step == one.global_step == (max_steps or 18)
    assert got.epochs == want.epochs
    for key in ("loss", "accuracy"):
        np.testing.assert_array_equal(got.history[key], want.history[key])
    for a, b in zip(dtk.gather_weights(auto.model), dtk.gather_weights(one.model)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("spec, layout, min_elements, want", [
    ("batch=8", "data_parallel", 1 << 12, True),
    ("batch=1", "data_parallel", 1 << 12, False),
    ("batch=4,model=2", "mlp_model_parallel", 1 << 12, True),
    # the default threshold: every weight of this small MLP is below it
    ("batch=8", "data_parallel", None, False)])
def test_auto_shard_optimizer_state_rule(spec, layout, min_elements, want, monkeypatch):
    """On when the batch axis splits some weight of SHARDED_UPDATE_MIN_ELEMENTS elements a
    device or more (this MLP's kernel has 784 x 16 = 12,544)."""
    if min_elements is not None:
        monkeypatch.setattr(layouts, "SHARDED_UPDATE_MIN_ELEMENTS", min_elements)
    trainer = _trainer(spec, layout)
    assert trainer.shard_optimizer_state is want


@pytest.mark.slow  # 10-14 s: the fast lane's 3-minute budget
def test_auto_resume_keeps_the_choice_and_the_numbers(tmp_path, monkeypatch, caplog):
    """A run stopped mid-epoch resumes with the count it chose (no new calibration), same numbers."""
    def observe(self, seconds, steps, steps_per_epoch):
        self.set(2)

    monkeypatch.setattr(auto_steps.AutoSteps, "observe", observe)
    monkeypatch.setattr(auto_steps, "AUTO_MIN_STEPS", 1)
    full = _trainer(shard_optimizer_state=True)
    want = full.fit(_data(full.mesh), epochs=3).history
    first = _trainer(checkpoint_dir=str(tmp_path), max_steps=8, shard_optimizer_state=True)
    first.fit(_data(first.mesh), epochs=3)
    assert first.global_step == 8 and first.steps_per_execution == 2

    def must_not_calibrate(self, seconds, steps, steps_per_epoch):
        raise AssertionError("a resumed run calibrated again")

    monkeypatch.setattr(auto_steps.AutoSteps, "observe", must_not_calibrate)
    second = _trainer(checkpoint_dir=str(tmp_path), shard_optimizer_state=True)
    with caplog.at_level("INFO", logger="dtk"):
        got = second.fit(_data(second.mesh), epochs=3).history
    assert "input: the stream starts at batch 8 (epoch 1, batch 2)" in caplog.text  # a resume
    assert second.global_step == 18 and second.steps_per_execution == 2
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6)


@pytest.mark.slow
def test_allowed_batch_size_change_resumes_at_the_next_epoch(tmp_path, caplog):
    """Issue 41: --allow_change global_batch_size is honoured at the resume (it was refused again
    there): stopped mid-epoch, the run goes on from the next epoch, with a warning naming the
    batches of the stopped epoch that were not trained."""
    first = _trainer(checkpoint_dir=str(tmp_path), max_steps=3, steps_per_execution=1)
    first.fit(_data(first.mesh), epochs=2)
    assert first.global_step == 3
    second = _trainer(checkpoint_dir=str(tmp_path), steps_per_execution=1,
                      allow_change=("global_batch_size",))
    ds = tf.data.Dataset.from_tensor_slices(_arrays(N_TRAIN, 0))
    data = input_lib.DistributedDataset(ds, second.mesh, input_lib.InputConfig(
        global_batch_size=BATCH // 2, shuffle=True, seed=5))
    with caplog.at_level("WARNING", logger="dtk"):
        history = second.fit(data, epochs=2)
    assert second.resume_changes["global_batch_size"] == {"old": BATCH, "new": BATCH // 2}
    assert second.global_step == 3 + data.num_batches  # epoch 2 only, at the new batch size
    assert len(history.history["loss"]) == 1
    assert any("the last 3 of epoch 1's 6 batches were not trained" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("verbose", [1, 2])
def test_each_epoch_is_reported_once(capsys, caplog, verbose, monkeypatch):
    """Issue 57: verbose=1 ends each epoch's bar with its figures, validation's included, as
    Keras's fit does, and prints no second line; verbose=2 prints one line per epoch."""
    from dtk.train import progress  # pylint: disable=g-import-not-at-top
    monkeypatch.setattr(progress, "PROGRESS_INTERVAL_S", 0.0)  # the bar updated every call
    trainer = _trainer(verbose=verbose, steps_per_execution=1)
    with caplog.at_level("INFO", logger="dtk"):
        history = trainer.fit(_data(trainer.mesh), epochs=2,
                              validation_data=_data(trainer.mesh, remainder="pad",
                                                    shuffle=False)).history
    out, lines = capsys.readouterr().out, caplog.messages
    epoch_lines = [m for m in lines if m.startswith("epoch ")]
    if verbose == 1:
        assert out.count("Epoch 1/2") == 1 and out.count("Epoch 2/2") == 1
        finals = [part for part in out.replace("\b", "\n").replace("\r", "\n").splitlines()
                  if part.startswith("6/6 [") and "val_loss" in part]
        assert len(finals) == 2, out[-2000:]
        # the epoch's figures, not an average of the values shown during it (the first
        # epoch's metrics exist only after its first step)
        for final, loss, accuracy in zip(finals, history["loss"], history["accuracy"]):
            assert f"- loss: {loss:.4f} - accuracy: {accuracy:.4f}" in final, (final, loss)
        assert not epoch_lines, epoch_lines
        assert "val_examples" not in out  # issue 70: a count printed as 640.0000
        # issue 70: into a log (capsys is no terminal) whole lines, not a bar redrawn by
        # backspaces: each epoch's header, its first update and its last line, nothing between
        # (the next whole line comes 30 s later)
        assert "\b" not in out and "\r" not in out, repr(out[-500:])
        assert len([line for line in out.splitlines() if line.strip()]) == 6, out
    else:
        assert "Epoch" not in out
        assert [m.split(" - ")[0] for m in epoch_lines] == ["epoch 1/2", "epoch 2/2"]
        assert all("val_loss" in m for m in epoch_lines)
        assert all(re.search(r"val_examples: \d+( |$)", m) for m in epoch_lines), epoch_lines


def test_a_run_counted_in_steps_says_steps_not_epochs(capsys):
    """Issue 70: the LM's ``--steps 600 --eval_every 100`` printed "Epoch 1/6": a run that
    max_steps ends says which steps each bar covers."""
    trainer = _trainer(verbose=1, steps_per_execution=1, max_steps=10)
    trainer.fit(_data(trainer.mesh), epochs=2)
    out = capsys.readouterr().out
    assert "Steps 1-6 of 10" in out and "Steps 7-10 of 10" in out and "Epoch" not in out, out


@pytest.mark.parametrize("one_ms, stacked_ms, want", [
    (17.11, 11.41, 8),   # two runs of the same MNIST command here measured 6.5 and 3.8 ms of
    (16.21, 12.86, 8),   # overhead a call, and chose 19 and 8: now both keep the probe's 8
    (17.0, 16.9, 1),     # stacking saves under 3%: one step per call
    (3.0, 0.2, 8),       # nearly all overhead: 19 (capped at 32, a divisor of 190), within 4x
])
def test_auto_steps_per_call_is_the_same_for_the_same_run(one_ms, stacked_ms, want):
    """Issue 70: "auto" chose 1, 8 or 19 on similar runs."""
    auto = auto_steps.AutoSteps(None, verbose=False)
    for _ in range(auto_steps.AUTO_CALIBRATION_CALLS):
        auto.observe(one_ms / 1e3, 1, 190)
    assert auto.steps_per_call == auto_steps.AUTO_PROBE_STEPS and not auto.decided
    for _ in range(1 + auto_steps.AUTO_PROBE_CALLS):  # the first stacked call traces
        auto.observe(stacked_ms * auto.steps_per_call / 1e3, auto.steps_per_call, 190)
    assert auto.decided and auto.steps_per_call == want
