"""dtk.distribute: tf_keras's own compile/fit/evaluate/predict on the mesh (issue 58).

Each test runs the same Keras code twice, once on a plain model on one device and once on
``dtk.distribute(factory, mesh)``, and compares every logged number (1e-5) and the weights.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor

import dtk

MESHES = ["batch=8", "batch=4,model=2", "batch=1"]
RTOL = 1e-5


def _binary_data(n=200, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 12)).astype("float32")
    y = (x[:, 0] + 0.5 * x[:, 1] > 0.3).astype("float32")  # 1-D labels, as keras.io writes them
    return x, y


def _mlp(dropout=0.0):
    layers = [tf_keras.layers.Dense(16, activation="relu", input_shape=(12,), name="d1")]
    if dropout:
        layers.append(tf_keras.layers.Dropout(dropout, name="drop"))
    layers.append(tf_keras.layers.Dense(1, activation="sigmoid", name="d2"))
    return tf_keras.Sequential(layers)


def _layout(spec):
    return "mlp_model_parallel" if "model" in spec else "data_parallel"


def _both(factory, spec, run, seed=0):
    """``run(model)`` on the plain model and on the distributed one; both results."""
    tf_keras.utils.set_random_seed(seed)
    plain = run(factory())
    mesh = dtk.build_mesh(spec)
    model = dtk.distribute(factory, mesh, layout=_layout(spec), seed=seed, allow_replicated=True)
    return plain, run(model)


def _close_histories(want, got):
    assert set(want) == set(got), (set(want), set(got))
    for key in want:
        assert len(want[key]) == len(got[key]), key
        np.testing.assert_allclose(got[key], want[key], rtol=RTOL, atol=1e-6, err_msg=key)


def _close_weights(a, b):
    for w, v in zip(a.get_weights(), dtk.gather_weights(b)):
        np.testing.assert_allclose(v, w, rtol=RTOL, atol=1e-6)


@pytest.mark.parametrize("spec", MESHES)
def test_fit_with_callbacks_class_weight_and_validation_split_is_keras(spec):
    """The findings of issue 58 in one fit: callbacks accepted; class_weight normalized as Keras
    does; EarlyStopping stops at Keras's epoch; 1-D binary labels with the string loss and
    "accuracy"; a user's metric object (AUC); a last partial batch (150 = 4 x 32 + 22)."""
    x, y = _binary_data()

    def run(model):
        model.compile(optimizer=tf_keras.optimizers.Adam(1e-2), loss="binary_crossentropy",
                      metrics=["accuracy", tf_keras.metrics.AUC(name="auc")])
        stop = tf_keras.callbacks.EarlyStopping(monitor="val_loss", patience=0, min_delta=0.02)
        history = model.fit(x, y, batch_size=32, epochs=8, class_weight={0: 1, 1: 3},
                            validation_split=0.25, verbose=0, callbacks=[stop])
        return history.history, model, model.evaluate(x, y, batch_size=40, verbose=0), \
            model.predict(x, verbose=0)

    (want, plain, plain_eval, plain_pred), (got, model, got_eval, got_pred) = _both(_mlp, spec, run)
    assert len(want["loss"]) < 8  # EarlyStopping stopped Keras's run, and dtk's at the same epoch
    _close_histories(want, got)
    _close_weights(plain, model)
    np.testing.assert_allclose(got_eval, plain_eval, rtol=RTOL)
    np.testing.assert_allclose(got_pred, plain_pred, rtol=RTOL, atol=1e-6)


@pytest.mark.parametrize("loss", ["object", "string"])
def test_sample_weight_and_binary_crossentropy_object_are_keras(loss):
    x, y = _binary_data()
    weights = np.random.default_rng(1).uniform(0.1, 2.0, size=len(x)).astype("float32")

    def run(model):
        model.compile(optimizer=tf_keras.optimizers.SGD(0.1, momentum=0.9),
                      loss=tf_keras.losses.BinaryCrossentropy() if loss == "object"
                      else "binary_crossentropy", weighted_metrics=["accuracy"])
        return model.fit(x, y, sample_weight=weights, batch_size=40, epochs=3,
                         verbose=0).history, model

    (want, plain), (got, model) = _both(_mlp, "batch=8", run)
    _close_histories(want, got)
    _close_weights(plain, model)


def test_train_on_batch_and_test_on_batch_are_keras():
    x, y = _binary_data(64)

    def run(model):
        model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
        out = [model.train_on_batch(x[:32], y[:32]), model.train_on_batch(x[32:], y[32:]),
               model.test_on_batch(x, y)]
        return out, model

    (want, plain), (got, model) = _both(_mlp, "batch=4,model=2", run)
    np.testing.assert_allclose(got, want, rtol=RTOL)
    _close_weights(plain, model)


def test_the_optimizer_the_user_compiled_is_bound_to_the_mesh():
    """compile(optimizer="adam") gives Keras's own Adam, not bound to the mesh (which trains
    wrong under DTensor): dtk makes it again with mesh=, keeping its settings."""
    mesh = dtk.build_mesh("batch=8")
    model = dtk.distribute(_mlp, mesh)
    model.compile(optimizer=tf_keras.optimizers.Adam(3e-3, beta_1=0.8), loss="mse")
    assert model.optimizer._mesh == mesh  # pylint: disable=protected-access
    assert model.optimizer.get_config()["beta_1"] == pytest.approx(0.8)
    assert float(model.optimizer.learning_rate) == pytest.approx(3e-3)


def test_run_eagerly_is_refused_with_the_reason():
    model = dtk.distribute(_mlp, dtk.build_mesh("batch=8"))
    with pytest.raises(ValueError, match=r"run_eagerly=True.*drop run_eagerly"):
        model.compile(optimizer="adam", loss="mse", run_eagerly=True)
    # the attribute set after compile() gets the same answer (issue 70: it was ignored)
    model.compile(optimizer="adam", loss="mse")
    model.run_eagerly = True
    x = np.zeros((16,) + tuple(model.inputs[0].shape[1:]), "float32")
    with pytest.raises(ValueError, match=r"model.run_eagerly is True .*set model.run_eagerly = "
                                         r"False"):
        model.fit(x, np.zeros((16,) + tuple(model.outputs[0].shape[1:])), batch_size=8,
                  verbose=0)


def test_ema_is_applied_at_the_end_of_fit_as_keras_does():
    x, y = _binary_data()

    def run(model):
        model.compile(optimizer=tf_keras.optimizers.Adam(1e-2, use_ema=True,
                                                         ema_overwrite_frequency=None),
                      loss="binary_crossentropy")
        model.fit(x, y, batch_size=40, epochs=2, verbose=0)
        return model

    plain, model = _both(_mlp, "batch=8", run)
    _close_weights(plain, model)


def test_masked_sequence_loss_is_keras():
    """A model whose output carries a Keras mask (Embedding(mask_zero=True)): the loss skips the
    padding, as Keras's does. The Embedding's gradient is applied dense (DTensor cannot lay out
    the sparse update), with the same numbers."""
    rng = np.random.default_rng(0)
    x = rng.integers(1, 20, size=(64, 10)).astype("int32")
    x[:, 6:] = 0  # padding
    y = rng.integers(0, 5, size=(64, 10)).astype("int32")

    def factory():
        inputs = tf_keras.Input((10,), dtype="int32")
        h = tf_keras.layers.Embedding(20, 8, mask_zero=True, name="embed")(inputs)
        outputs = tf_keras.layers.Dense(5, name="d1")(h)
        return tf_keras.Model(inputs, outputs)

    def run(model):
        model.compile(optimizer=tf_keras.optimizers.Adam(1e-2),
                      loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return model.fit(x, y, batch_size=16, epochs=2, verbose=0).history, model

    (want, plain), (got, model) = _both(factory, "batch=8", run)
    _close_histories(want, got)
    _close_weights(plain, model)


class _TwoOptimizers(tf_keras.Model):
    """keras.io's GAN shape: its own compile() signature, two optimizers, its own train_step
    and logs."""

    def __init__(self):
        super().__init__()
        self.a = tf_keras.layers.Dense(8, activation="tanh", name="a")
        self.b = tf_keras.layers.Dense(1, name="b")
        self.tracker = tf_keras.metrics.Mean(name="b_loss")

    def call(self, x):
        return self.b(self.a(x))

    def compile(self, a_optimizer, b_optimizer, loss_fn, **kwargs):  # pylint: disable=arguments-differ
        super().compile(**kwargs)
        self.a_optimizer, self.b_optimizer, self.loss_fn = a_optimizer, b_optimizer, loss_fn

    def train_step(self, data):
        x, y = data
        with tf.GradientTape(persistent=True) as tape:
            loss = self.loss_fn(y, self(x, training=True))
        self.a_optimizer.apply_gradients(zip(tape.gradient(loss, self.a.trainable_weights),
                                             self.a.trainable_weights))
        self.b_optimizer.apply_gradients(zip(tape.gradient(loss, self.b.trainable_weights),
                                             self.b.trainable_weights))
        self.tracker.update_state(loss)
        return {"b_loss": self.tracker.result(), "last": loss}

    @property
    def metrics(self):
        return [self.tracker]


def test_a_custom_compile_with_two_optimizers_runs_as_written():
    x, y = _binary_data(96)

    def run(model):
        model.compile(tf_keras.optimizers.Adam(1e-2), tf_keras.optimizers.SGD(0.05),
                      tf_keras.losses.MeanSquaredError())
        return model.fit(x, y[:, None], batch_size=32, epochs=2, verbose=0).history, model

    tf_keras.utils.set_random_seed(0)
    plain = _TwoOptimizers()
    plain(x[:1])
    want = run(plain)[0]
    mesh = dtk.build_mesh("batch=8")
    model = dtk.distribute(_TwoOptimizers, mesh, seed=0, input_shape=(12,))
    got = run(model)[0]
    assert model.a_optimizer._mesh == mesh and model.b_optimizer._mesh == mesh  # pylint: disable=protected-access
    assert set(got) == {"b_loss", "last"}  # the train_step's own logs, kept
    _close_histories(want, got)


@pytest.mark.slow
def test_dropout_draws_the_same_on_every_mesh():
    """With dtk's randomness a Dropout's masks depend on (seed, step, layer, example), not on
    the mesh: batch=8 and batch=4,model=2 train to batch=1's numbers. They differ from plain
    Keras, whose masks come from its own generator (not comparable)."""
    x, y = _binary_data()
    histories = []
    for spec in ("batch=1", "batch=8", "batch=4,model=2"):
        model = dtk.distribute(functools.partial(_mlp, dropout=0.3), dtk.build_mesh(spec),
                               layout=_layout(spec), seed=0, allow_replicated=True)
        model.compile(optimizer=tf_keras.optimizers.Adam(1e-2), loss="binary_crossentropy")
        histories.append(model.fit(x, y, batch_size=40, epochs=3, verbose=0).history["loss"])
    np.testing.assert_allclose(histories[1], histories[0], rtol=RTOL)
    np.testing.assert_allclose(histories[2], histories[0], rtol=RTOL)


def test_a_mesh_bound_optimizer_keeps_its_moving_average():
    """tf_keras's DTensor path skips the EMA update (the averages stayed at the initial weights,
    and the end of fit put those back): dtk.make_optimizer's optimizers keep it, as the plain
    path does, overwrite frequency included."""
    mesh = dtk.build_mesh("batch=8")
    from tensorflow.experimental import dtensor  # pylint: disable=import-outside-toplevel
    start = np.arange(6, dtype=np.float32).reshape(2, 3)
    grads = [np.full((2, 3), 0.1 * (i + 1), np.float32) for i in range(5)]
    plain_var = tf.Variable(start)
    plain = tf_keras.optimizers.Adam(0.1, use_ema=True, ema_overwrite_frequency=3)
    mesh_var = dtensor.DVariable(dtensor.copy_to_mesh(start, dtensor.Layout.replicated(mesh, 2)))
    bound = dtk.make_optimizer(tf_keras.optimizers.Adam(0.1, use_ema=True,
                                                        ema_overwrite_frequency=3, mesh=mesh),
                               mesh)
    for g in grads:
        plain.apply_gradients([(tf.constant(g), plain_var)])
        bound.apply_gradients([(dtensor.copy_to_mesh(g, dtensor.Layout.replicated(mesh, 2)),
                                mesh_var)])
    np.testing.assert_allclose(dtk.global_value(mesh_var), plain_var.numpy(), rtol=1e-6)
    plain.finalize_variable_values([plain_var])
    bound.finalize_variable_values([mesh_var])
    np.testing.assert_allclose(dtk.global_value(mesh_var), plain_var.numpy(), rtol=1e-6)
    assert not np.allclose(plain_var.numpy(), start)


BAD_CALLS = [  # (call, error type, phrase): one clear error before Keras starts
    (lambda m, x, y: m.fit(x, y, batch_size=30, verbose=0), ValueError,
     r"fit\(batch_size=30\): mesh axis 'batch' of size 8 cannot split it evenly.*24 or 32.*"
     r"last batch smaller than batch_size .* is fine"),
    (lambda m, x, y: m.evaluate(x, y, 20, verbose=0), ValueError,
     r"evaluate\(batch_size=20\).*16 or 24"),
    (lambda m, x, y: m.predict(x, 12, verbose=0), ValueError, r"predict\(batch_size=12\)"),
    (lambda m, x, y: m.fit(x, y, batch_size=32, verbose=0,
                           callbacks=[type("Keras3Callback", (), {"__module__": "keras.src.x"})()]),
     TypeError, r"Keras 3"),
]


@pytest.mark.parametrize("call, error, phrase", BAD_CALLS, ids=["fit", "evaluate", "predict",
                                                                  "keras3 callback"])
def test_bad_calls_are_refused_in_one_line(call, error, phrase):
    x, y = _binary_data(64)
    model = dtk.distribute(_mlp, dtk.build_mesh("batch=8"))
    model.compile(optimizer="adam", loss="binary_crossentropy")
    with pytest.raises(error, match=phrase) as info:
        call(model, x, y)
    assert "\n" not in str(info.value)


def test_a_keras_3_factory_takes_keras_3s_own_distribution():
    """(Its training: tests/test_keras3.py.) The tf_keras path's own options are refused."""
    import keras as keras3  # pylint: disable=import-outside-toplevel  (TensorFlow 2.21 requires it)
    assert keras3.__version__.startswith("3"), keras3.__version__
    model = dtk.distribute(lambda: keras3.Sequential([keras3.layers.Dense(1)]),
                           dtk.build_mesh("batch=8"))
    assert isinstance(model, keras3.Model)
    assert isinstance(model._dtk_distribution, keras3.distribution.ModelParallel)  # pylint: disable=protected-access
    assert keras3.distribution.distribution() is None
    with pytest.raises(ValueError, match=r"distribute\(remat=\('d1',\)\) with a Keras 3 model"):
        dtk.distribute(lambda: keras3.Sequential([keras3.layers.Dense(1)]),
                       dtk.build_mesh("batch=8"), remat=["d1"])


def _compiled(spec):
    model = dtk.distribute(_mlp, dtk.build_mesh(spec), layout=_layout(spec), seed=0,
                           allow_replicated=True)
    model.compile(optimizer=tf_keras.optimizers.Adam(1e-2), loss="binary_crossentropy",
                  metrics=["accuracy"])
    return model


class _Killed(tf_keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            raise RuntimeError("killed after epoch 2")


@pytest.mark.slow
def test_keras_backup_and_restore_resumes_exactly(tmp_path):
    """Keras's own BackupAndRestore on a model sharded over model: a run killed after epoch 2
    resumes at epoch 3 and ends with the uninterrupted run's losses, bit for bit."""
    x, y = _binary_data(192)
    fit = functools.partial(_fit_no_shuffle, x, y)
    full = fit(_compiled("batch=4,model=2"), [])
    with pytest.raises(RuntimeError, match="killed"):
        fit(_compiled("batch=4,model=2"), [tf_keras.callbacks.BackupAndRestore(str(tmp_path)),
                                           _Killed()])
    resumed = fit(_compiled("batch=4,model=2"),
                  [tf_keras.callbacks.BackupAndRestore(str(tmp_path))])
    assert resumed == full[2:]


def _fit_no_shuffle(x, y, model, callbacks):
    return model.fit(x, y, batch_size=32, epochs=4, verbose=0, shuffle=False,
                     callbacks=callbacks).history["loss"]


def test_weights_and_saved_models_cross_meshes_and_load_in_plain_keras(tmp_path):
    """ModelCheckpoint(save_weights_only=True) on batch=8 loads into batch=4,model=2; save() of a
    model sharded over model writes a file plain tf_keras loads, with the same predictions."""
    x, y = _binary_data(64)
    first = _compiled("batch=8")
    path = str(tmp_path / "w.ckpt")
    first.fit(x, y, batch_size=32, epochs=1, verbose=0,
              callbacks=[tf_keras.callbacks.ModelCheckpoint(path, save_weights_only=True)])
    second = _compiled("batch=4,model=2")
    second.load_weights(path)
    for a, b in zip(dtk.gather_weights(first), dtk.gather_weights(second)):
        np.testing.assert_array_equal(a, b)
    second.fit(x, y, batch_size=32, epochs=1, verbose=0)
    second.save(str(tmp_path / "m.keras"))
    loaded = tf_keras.models.load_model(str(tmp_path / "m.keras"))
    np.testing.assert_allclose(loaded.predict(x, verbose=0), second.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_readme_keras_example_runs_as_written():
    """README's first library example (the Keras way), run as written in a fresh process."""
    from tests import procs  # pylint: disable=import-outside-toplevel
    readme = (procs.REPO / "README.md").read_text()
    start = readme.index("```python", readme.index("The Keras way")) + len("```python\n")
    code = readme[start:readme.index("```", start)]
    assert "dtk.distribute(" in code and "model.fit(" in code
    res = procs.run_python(code + "\nprint('HISTORY', model.history.history['val_accuracy'])\n",
                           timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    accuracy = eval(res.stdout.split("HISTORY", 1)[1].strip())  # pylint: disable=eval-used
    assert accuracy[-1] > 0.7, accuracy


def test_the_trainer_applies_the_ema_at_the_end_of_fit_as_keras_does():
    """dtk.Trainer with Adam(use_ema=True) ends with the moving average in the model, as Keras's
    fit does: the same weights as plain tf_keras's fit on the same batches."""
    x, y = _binary_data(160)
    y = y[:, None]  # (the Trainer's loss does not take 1-D binary labels yet: issue 58)
    mesh = dtk.build_mesh("batch=8")

    def adam(mesh=None):
        return tf_keras.optimizers.Adam(1e-2, use_ema=True, ema_overwrite_frequency=None,
                                        mesh=mesh)

    trainer = dtk.Trainer(mesh=mesh, model=_mlp, layout="data_parallel", optimizer=adam(mesh),
                          loss=tf_keras.losses.BinaryCrossentropy(),
                          config=dtk.TrainerConfig(seed=0, verbose=0, steps_per_execution=1))
    data = dtk.DistributedDataset(tf.data.Dataset.from_tensor_slices((x, y)), mesh,
                                  dtk.InputConfig(global_batch_size=32))
    trainer.fit(data, epochs=2)
    tf_keras.utils.set_random_seed(0)
    plain = _mlp()
    plain.compile(optimizer=adam(), loss=tf_keras.losses.BinaryCrossentropy())
    plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    _close_weights(plain, trainer.model)


def _dropout_compiled(spec):
    model = dtk.distribute(functools.partial(_mlp, dropout=0.3), dtk.build_mesh(spec),
                           layout=_layout(spec), seed=0, allow_replicated=True)
    model.compile(optimizer=tf_keras.optimizers.Adam(1e-2), loss="binary_crossentropy",
                  metrics=["accuracy"])
    return model


def test_dtk_checkpoints_as_a_callback_resume_exactly_across_meshes(tmp_path):
    """dtk.CheckpointCallback under Keras's own fit: a run with Dropout killed after epoch 2 on
    batch=8 resumes on batch=4,model=2 at epoch 3 with the uninterrupted run's numbers (the step
    counter is restored, so the dropout masks continue); on the same mesh, bit for bit. (One run
    writes a directory at a time: the Checkpointer's lock, tested across processes in
    test_checkpoint_faults.)"""
    x, y = _binary_data(192)
    fit = functools.partial(_fit_no_shuffle, x, y)
    full = fit(_dropout_compiled("batch=4,model=2"), [])
    with pytest.raises(RuntimeError, match="killed"):
        fit(_dropout_compiled("batch=8"), [dtk.CheckpointCallback(tmp_path / "a"), _Killed()])
    callback = dtk.CheckpointCallback(tmp_path / "a")
    resumed = fit(_dropout_compiled("batch=4,model=2"), [callback])
    assert callback.restored_epoch == 2
    np.testing.assert_allclose(resumed, full[2:], rtol=1e-5)
    with pytest.raises(RuntimeError, match="killed"):
        fit(_dropout_compiled("batch=4,model=2"),
            [dtk.CheckpointCallback(tmp_path / "b"), _Killed()])
    assert fit(_dropout_compiled("batch=4,model=2"),
               [dtk.CheckpointCallback(tmp_path / "b")]) == full[2:]


@pytest.mark.parametrize("spec", ["batch=8", "batch=4,model=2"])
def test_fsdp_under_keras_fit_is_keras(spec):
    """dtk.distribute(fsdp=True): the weights stored cut over batch and gathered for each
    layer's call; Keras's own fit gives plain tf_keras's numbers (1e-5), and the optimizer state
    is stored cut like the weights."""
    x, y = _binary_data(128)

    def factory():
        return tf_keras.Sequential([
            tf_keras.layers.Dense(64, activation="relu", input_shape=(12,), name="d1"),
            tf_keras.layers.Dense(32, activation="relu", name="d3"),
            tf_keras.layers.Dense(1, activation="sigmoid", name="d2")])

    def run(model):
        model.compile(optimizer=tf_keras.optimizers.Adam(1e-2), loss="binary_crossentropy")
        return model.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False).history

    tf_keras.utils.set_random_seed(0)
    want = run(factory())
    model = dtk.distribute(factory, dtk.build_mesh(spec), layout=_layout(spec), seed=0,
                           allow_replicated=True, fsdp=True)
    got = run(model)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    kernel = model.get_layer("d1").kernel
    assert "batch" in dtensor.fetch_layout(kernel).sharding_specs
    slots = [v for v in model.optimizer.variables if tuple(v.shape) == tuple(kernel.shape)]
    assert slots and all("batch" in dtensor.fetch_layout(v).sharding_specs for v in slots)


def test_remat_under_keras_fit_is_keras():
    """dtk.distribute(remat=[...]): the named layers recompute their activations in the backward
    pass (tf.recompute_grad around their call); Keras's own fit gives plain tf_keras's numbers,
    with Dropout inside the rematerialized layers drawing the same on every mesh."""
    x, y = _binary_data(128)

    def run(model):
        model.compile(optimizer=tf_keras.optimizers.Adam(1e-2), loss="binary_crossentropy")
        return model.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False).history["loss"]

    tf_keras.utils.set_random_seed(0)
    want = run(_mlp())
    model = dtk.distribute(_mlp, dtk.build_mesh("batch=4,model=2"), layout="mlp_model_parallel",
                           seed=0, allow_replicated=True, remat=["d1"])
    assert getattr(model.get_layer("d1"), "_dtk_remat", False)
    np.testing.assert_allclose(run(model), want, rtol=1e-5)
    dropped = {spec: run(dtk.distribute(functools.partial(_mlp, dropout=0.3),
                                        dtk.build_mesh(spec), layout=_layout(spec), seed=0,
                                        allow_replicated=True, remat=["d1", "drop"]))
               for spec in ("batch=1", "batch=8")}
    np.testing.assert_allclose(dropped["batch=8"], dropped["batch=1"], rtol=1e-5)
    with pytest.raises(ValueError, match="remat must be a list of layer-name patterns"):
        dtk.distribute(_mlp, dtk.build_mesh("batch=8"), remat="d1")


def test_gradient_accumulation_under_keras_fit_is_the_whole_batch():
    """dtk.distribute(gradient_accumulation_steps=2): Keras's train_step over two microbatches
    gives the whole batch's numbers: plain tf_keras's loss and accuracy with sample weights and a
    last partial batch (1e-5); with Dropout, batch=1 without accumulation's (the microbatches
    draw the whole batch's masks). A batch whose per-device share does not split is refused."""
    x, y = _binary_data(144)
    weights = np.linspace(0.5, 1.5, len(x)).astype("float32")

    def run(model):
        model.compile(optimizer=tf_keras.optimizers.Adam(1e-2), loss="binary_crossentropy",
                      metrics=["accuracy"])
        return model.fit(x, y, sample_weight=weights, batch_size=32, epochs=2, verbose=0,
                         shuffle=False).history

    tf_keras.utils.set_random_seed(0)
    want = run(_mlp())
    got = run(dtk.distribute(_mlp, dtk.build_mesh("batch=4,model=2"), layout="mlp_model_parallel",
                             seed=0, allow_replicated=True, gradient_accumulation_steps=2))
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)
    dropout = functools.partial(_mlp, dropout=0.3)
    one = run(dtk.distribute(dropout, dtk.build_mesh("batch=1"), seed=0))
    accumulated = run(dtk.distribute(dropout, dtk.build_mesh("batch=8"), seed=0,
                                     gradient_accumulation_steps=4))
    np.testing.assert_allclose(accumulated["loss"], one["loss"], rtol=1e-5)
    model = dtk.distribute(_mlp, dtk.build_mesh("batch=8"), gradient_accumulation_steps=4)
    model.compile(optimizer="adam", loss="binary_crossentropy")
    with pytest.raises(ValueError, match=r"fit\(batch_size=16\) with gradient_accumulation_steps=4: "
                                         r"mesh axis 'batch' \(size 8\) gives each device 2 rows"):
        model.fit(x[:64], y[:64], batch_size=16, verbose=0)


def test_dropout_on_a_last_partial_batch_draws_the_same_on_every_mesh():
    """The last partial batch (144 rows in batches of 32: 16 left) trains with dtk's
    mesh-invariant draws too: its step was traced at a relaxed batch size, where dropout fell
    back to Keras's own draws, which depend on the mesh."""
    x, y = _binary_data(144)

    def run(spec):
        model = dtk.distribute(functools.partial(_mlp, dropout=0.3), dtk.build_mesh(spec),
                               seed=0)
        model.compile(optimizer=tf_keras.optimizers.Adam(1e-2), loss="binary_crossentropy")
        return model.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False).history["loss"]

    np.testing.assert_allclose(run("batch=8"), run("batch=1"), rtol=1e-5)


def _wide_mlp():
    """A kernel of 512 x 256 (131,072 elements: over SHARDED_UPDATE_MIN_ELEMENTS a device on
    both meshes), so the sharded update splits it; the small ones are updated in place."""
    return tf_keras.Sequential([
        tf_keras.layers.Dense(512, activation="relu", input_shape=(12,), name="d1"),
        tf_keras.layers.Dense(256, activation="relu", name="d2"),
        tf_keras.layers.Dense(1, activation="sigmoid", name="out")])


@pytest.mark.parametrize("spec", ["batch=4,model=2"])  # the kernel over model, its copy over
def test_the_sharded_update_is_the_update_in_place(spec, tmp_path):  # model and batch
    """distribute(shard_optimizer_state="auto") (the default) updates the large kernel through a
    copy sharded over batch, with Adam's moments and EMA stored there (1/N a device): the same
    numbers as the update in place, with Keras's BackupAndRestore killing and resuming the
    sharded run (the copy starts each step from the restored weight) and the EMA put into the
    model at the end of fit."""
    x, y = _binary_data(128)

    def compiled(shard):
        model = dtk.distribute(_wide_mlp, dtk.build_mesh(spec), layout=_layout(spec), seed=0,
                               allow_replicated=True, shard_optimizer_state=shard)
        model.compile(optimizer=tf_keras.optimizers.Adam(1e-3, use_ema=True),
                      loss="binary_crossentropy", metrics=["accuracy"])
        return model

    def fit(model, callbacks=()):
        return model.fit(x, y, batch_size=32, epochs=3, verbose=0, shuffle=False,
                         callbacks=list(callbacks)).history

    in_place = compiled(False)
    want = fit(in_place)
    assert in_place._dtk_mesh_state.sharded is None  # pylint: disable=protected-access
    with pytest.raises(RuntimeError, match="killed"):
        fit(compiled("auto"), [tf_keras.callbacks.BackupAndRestore(str(tmp_path)), _Killed()])
    sharded = compiled("auto")
    got = fit(sharded, [tf_keras.callbacks.BackupAndRestore(str(tmp_path))])
    for key in want:
        np.testing.assert_allclose(got[key], want[key][2:], rtol=RTOL, atol=1e-6, err_msg=key)
    for a, b in zip(dtk.gather_weights(in_place), dtk.gather_weights(sharded)):
        np.testing.assert_allclose(b, a, rtol=RTOL, atol=1e-6)  # the EMA, put in by fit's end
    kernel = sharded.get_layer("d2").kernel
    moment = [v for v in sharded.optimizer.variables if v.name.startswith("m/")
              and v.shape == kernel.shape]
    assert moment and "batch" in dtensor.fetch_layout(moment[0]).sharding_specs
    assert "batch" not in dtensor.fetch_layout(kernel).sharding_specs


@pytest.mark.parametrize("spec", ["batch=4,model=2"])  # (batch=8: in the bench, bit for bit)
def test_several_steps_per_call_are_the_steps_one_at_a_time(spec):
    """compile(steps_per_execution=3): 3 batches stacked and one compiled call looping over
    them (the last partial batch, 300 = 9 x 32 + 12, on its own): the same numbers as one step
    per call, bit for bit, with Dropout (dtk's draws keyed by each step), the sharded update, a
    validation split (evaluation also runs 3 a call) and a model's own train_step with two
    optimizers; and plain tf_keras's numbers where no random numbers are drawn."""
    x, y = _binary_data(300 + 100)

    def run(model, spe, factory):
        if factory is _TwoOptimizers:
            model.compile(tf_keras.optimizers.Adam(1e-2), tf_keras.optimizers.SGD(0.05),
                          tf_keras.losses.MeanSquaredError(), steps_per_execution=spe)
            labels = y[:, None]
        else:
            model.compile(optimizer=tf_keras.optimizers.Adam(1e-2), loss="binary_crossentropy",
                          metrics=["accuracy"], steps_per_execution=spe)
            labels = y
        history = model.fit(x, labels, batch_size=32, epochs=2, validation_split=0.25,
                            shuffle=False, verbose=0).history
        return history, (dtk.gather_weights(model) if hasattr(model, "_dtk_mesh_state")
                         else model.get_weights())

    for factory, kwargs in ((functools.partial(_mlp, dropout=0.3), {}), (_wide_mlp, {}),
                            (_TwoOptimizers, {"input_shape": (12,)})):
        results = []
        for spe in (1, 3):
            layout = "data_parallel" if factory is _TwoOptimizers else _layout(spec)
            model = dtk.distribute(factory, dtk.build_mesh(spec), layout=layout, seed=0,
                                   allow_replicated=True, **kwargs)
            results.append(run(model, spe, factory))
        (want, want_weights), (got, got_weights) = results
        assert set(got) == set(want)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        for a, b in zip(want_weights, got_weights):
            np.testing.assert_array_equal(b, a)
        if factory is _wide_mlp:
            wide = got
    tf_keras.utils.set_random_seed(0)
    plain = run(_wide_mlp(), 3, _wide_mlp)[0]
    _close_histories(plain, wide)


def _masked_sequences(n=64):
    rng = np.random.default_rng(0)
    x = rng.integers(1, 20, size=(n, 10)).astype("int32")
    x[:, 6:] = 0  # padding
    x[::3, 4:] = 0  # rows of other lengths: the unmasked count differs between rows
    y = rng.integers(0, 5, size=(n, 10)).astype("int32")
    return x, y


def _masked_tagger():
    inputs = tf_keras.Input((10,), dtype="int32")
    h = tf_keras.layers.Embedding(20, 8, mask_zero=True, name="embed")(inputs)
    outputs = tf_keras.layers.Dense(5, name="d1")(h)
    return tf_keras.Model(inputs, outputs)


def _trainer(factory, spec="batch=8", **kwargs):
    mesh = dtk.build_mesh(spec)
    return dtk.Trainer(mesh=mesh, model=factory, layout="data_parallel", allow_replicated=True,
                       optimizer=dtk.make_optimizer("adam", mesh, learning_rate=1e-2),
                       config=dtk.TrainerConfig(seed=0, verbose=0, steps_per_execution=1),
                       **kwargs)


def _data(trainer, x, y, batch, remainder="drop"):
    return dtk.DistributedDataset(tf.data.Dataset.from_tensor_slices((x, y)), trainer.mesh,
                                  dtk.InputConfig(global_batch_size=batch, remainder=remainder))


def test_the_trainer_masks_the_loss_and_metrics_as_keras_does():
    """dtk.Trainer on a model whose output carries a Keras mask (Embedding(mask_zero=True)):
    the loss is the mean over the unmasked tokens and the metrics skip the masked ones, as
    Keras's fit and evaluate compute them (a padded last evaluation batch too): the same
    losses, accuracy and weights as plain tf_keras."""
    x, y = _masked_sequences()
    loss = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    trainer = _trainer(_masked_tagger, loss=loss, metrics=["accuracy"])
    history = trainer.fit(_data(trainer, x, y, 16), epochs=2).history
    got_eval = trainer.evaluate(_data(trainer, x[:40], y[:40], 16, remainder="pad"))
    tf_keras.utils.set_random_seed(0)
    plain = _masked_tagger()
    plain.compile(optimizer=tf_keras.optimizers.Adam(1e-2), loss=loss, metrics=["accuracy"])
    want = plain.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    want_eval = plain.evaluate(x[:40], y[:40], batch_size=16, verbose=0, return_dict=True)
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(history[key], want[key], rtol=RTOL, err_msg=key)
        np.testing.assert_allclose(got_eval[key], want_eval[key], rtol=RTOL, err_msg=key)
    _close_weights(plain, trainer.model)


def test_the_trainer_stops_when_a_callback_sets_stop_training():
    """As Keras's fit: a callback that sets model.stop_training ends training after that
    epoch (and the EMA of Adam(use_ema=True) goes into the model then, as Keras's fit ends)."""
    x, y = _binary_data(160)
    mesh = dtk.build_mesh("batch=8")
    trainer = dtk.Trainer(mesh=mesh, model=_mlp, layout="data_parallel",
                          optimizer=tf_keras.optimizers.Adam(1e-2, use_ema=True, mesh=mesh),
                          loss=tf_keras.losses.BinaryCrossentropy(),
                          config=dtk.TrainerConfig(seed=0, verbose=0, steps_per_execution=1))

    def stop_after_two(epoch, logs):
        if epoch == 1:
            trainer.model.stop_training = True

    history = trainer.fit(_data(trainer, x, y[:, None], 32), epochs=6,
                          on_epoch_end=[stop_after_two])
    assert len(history.history["loss"]) == 2
    tf_keras.utils.set_random_seed(0)
    plain = _mlp()
    plain.compile(optimizer=tf_keras.optimizers.Adam(1e-2, use_ema=True),
                  loss=tf_keras.losses.BinaryCrossentropy())
    plain.fit(x, y[:, None], batch_size=32, epochs=2, shuffle=False, verbose=0)
    _close_weights(plain, trainer.model)


class _LogsGradNorm(tf_keras.Sequential):
    """keras.io "Customizing what happens in fit()" shape: a train_step that returns a log no
    metric holds (the gradient norm)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x, y, self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        logs = self.compute_metrics(x, y, self(x, training=False), None)
        return dict(logs, grad_norm=tf.linalg.global_norm(grads))


def _logs_model():
    return _LogsGradNorm([tf_keras.layers.Dense(16, activation="relu", input_shape=(12,)),
                          tf_keras.layers.Dense(1, activation="sigmoid")])


def test_the_trainer_keeps_a_train_step_s_own_logs():
    """dtk.Trainer reports a model's own train_step's logs as Keras's fit does (the last step's),
    a log that no metric holds included."""
    x, y = _binary_data(128)
    loss = tf_keras.losses.BinaryCrossentropy()
    trainer = _trainer(_logs_model, loss=loss)
    history = trainer.fit(_data(trainer, x, y[:, None], 32), epochs=2).history
    tf_keras.utils.set_random_seed(0)
    plain = _logs_model()
    plain.compile(optimizer=tf_keras.optimizers.Adam(1e-2), loss=loss)
    want = plain.fit(x, y[:, None], batch_size=32, epochs=2, shuffle=False, verbose=0).history
    assert "grad_norm" in history, sorted(history)
    for key in want:
        np.testing.assert_allclose(history[key], want[key], rtol=RTOL, err_msg=key)


def test_the_trainer_normalizes_sample_weights_as_keras_does():
    """Data that carries sample weights: dtk.Trainer divides the weighted loss by the count of
    examples, as Keras does (not by the weights' sum, which it did), a real example of weight 0
    included; evaluation on a padded last batch too (40 = 16 + 16 + 8), and predict keeps that
    example. The same losses and weights as plain tf_keras's fit(sample_weight=...)."""
    x, y = _binary_data(128)
    y = y[:, None]
    w = np.random.default_rng(1).uniform(0.1, 2.0, size=len(x)).astype("float32")
    w[3] = 0.0
    loss = tf_keras.losses.BinaryCrossentropy()
    trainer = _trainer(_mlp, loss=loss, metrics=["accuracy"])

    def data(n, batch, remainder="drop"):
        return dtk.DistributedDataset(
            tf.data.Dataset.from_tensor_slices((x[:n], y[:n], w[:n])), trainer.mesh,
            dtk.InputConfig(global_batch_size=batch, remainder=remainder))

    history = trainer.fit(data(128, 32), epochs=2).history
    got_eval = trainer.evaluate(data(40, 16, "pad"))
    predicted = trainer.predict(data(40, 16, "pad"))
    tf_keras.utils.set_random_seed(0)
    plain = _mlp()
    plain.compile(optimizer=tf_keras.optimizers.Adam(1e-2), loss=loss, metrics=["accuracy"])
    want = plain.fit(x, y, sample_weight=w, batch_size=32, epochs=2, shuffle=False,
                     verbose=0).history
    want_eval = plain.evaluate(x[:40], y[:40], sample_weight=w[:40], batch_size=16, verbose=0,
                               return_dict=True)
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(history[key], want[key], rtol=RTOL, err_msg=key)
        np.testing.assert_allclose(got_eval[key], want_eval[key], rtol=RTOL, err_msg=key)
    _close_weights(plain, trainer.model)
    assert predicted.shape == (40, 1)
    np.testing.assert_allclose(predicted, plain.predict(x[:40], verbose=0), rtol=RTOL, atol=1e-6)


def test_the_sharded_update_with_fsdp_is_refused_not_ignored():
    """FSDP already stores the optimizer state sharded: asking for both is refused by name."""
    with pytest.raises(ValueError, match=r"shard_optimizer_state=True with fsdp=True.*drop one"):
        dtk.distribute(_mlp, dtk.build_mesh("batch=8"), fsdp=True, shard_optimizer_state=True)


# --- dtk.DistributedDataset under Keras's own fit (issue 71: dtk.train.keras_data) ----------------

def _mnist_like(n=1000, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, 28, 28, 1)).astype("float32"),
            rng.integers(0, 10, n).astype("int64"))


def _dataset(mesh, data, *, shuffle=False, remainder="drop", batch=64):
    return dtk.DistributedDataset(tf.data.Dataset.from_tensor_slices(data), mesh, dtk.InputConfig(
        global_batch_size=batch, shuffle=shuffle, seed=3, remainder=remainder))


_SPARSE = functools.partial(tf_keras.losses.SparseCategoricalCrossentropy, from_logits=True)


def _mnist_distributed(mesh, spe=1, dropout=0.0):
    model = dtk.distribute(functools.partial(dtk.models.mnist_mlp, dropout=dropout), mesh,
                           layout="mlp_model_parallel" if "model" in mesh.dim_names
                           else "data_parallel", seed=0, shard_optimizer_state=False)
    model.compile(optimizer=tf_keras.optimizers.SGD(0.1), loss=_SPARSE(), metrics=["accuracy"],
                  steps_per_execution=spe)
    return model


@pytest.mark.parametrize("spec", ["batch=8", "batch=4,model=2"])
def test_a_distributed_dataset_under_keras_fit_trains_as_the_trainer_bit_for_bit(spec):
    """Issue 71: the Trainer's input, given to Keras's own fit on a dtk.distribute model, trains
    as dtk.Trainer does: the same shuffled batches (epoch e's order), the same updates: weights
    and per-epoch logs equal bit for bit, with one step per call and with 4 (stacked on the mesh
    inside the call). Evaluating padded data counts every example once (the last partial batch
    whole on every device): the Trainer's loss and accuracy, exactly; predict returns every row
    in order."""
    mesh = dtk.build_mesh(spec)
    data = _mnist_like()
    table = "mlp_model_parallel" if "model" in spec else "data_parallel"
    trainer = dtk.Trainer(mesh=mesh, model=dtk.models.mnist_mlp, layout=table,
                          optimizer=dtk.make_optimizer("sgd", mesh, learning_rate=0.1),
                          loss=_SPARSE(), metrics=["accuracy"],
                          config=dtk.TrainerConfig(seed=0, verbose=0, steps_per_execution=1,
                                                   shard_optimizer_state=False))
    want = trainer.fit(_dataset(mesh, data, shuffle=True), epochs=2)
    want_eval = trainer.evaluate(_dataset(mesh, data, remainder="pad"))
    assert want_eval["examples"] == 1000
    for spe in (1, 4):
        model = _mnist_distributed(mesh, spe)
        got = model.fit(_dataset(mesh, data, shuffle=True), epochs=2, verbose=0).history
        assert got == {k: list(want.history[k]) for k in got}, (spe, got, want.history)
        for w, v in zip(trainer.model.weights, model.weights):
            np.testing.assert_array_equal(v.numpy(), w.numpy(), err_msg=f"{spe}: {v.name}")
        got_eval = model.evaluate(_dataset(mesh, data, remainder="pad"), verbose=0,
                                  return_dict=True)
        assert got_eval == {k: want_eval[k] for k in ("loss", "accuracy")}, (got_eval, want_eval)
    predicted = model.predict(_dataset(mesh, data, remainder="pad"), verbose=0)
    np.testing.assert_allclose(predicted, model.predict(data[0], batch_size=64, verbose=0),
                               rtol=1e-6, atol=1e-6)
    assert predicted.shape == (1000, 10)


def test_a_distributed_dataset_resumes_under_keras_fit_at_its_epochs_order(tmp_path):
    """Issue 71: CheckpointCallback with a shuffled DistributedDataset (and Dropout): killed
    after epoch 2, the run resumes at epoch 3 reading epoch 3's order (not epoch 1's again),
    with validation on padded data, and ends with the uninterrupted run's weights and losses,
    bit for bit."""
    mesh = dtk.build_mesh("batch=8")
    data = _mnist_like(512)

    def fit(callbacks):
        model = _mnist_distributed(mesh, spe=2, dropout=0.2)
        history = model.fit(_dataset(mesh, data, shuffle=True), epochs=4, verbose=0,
                            validation_data=_dataset(mesh, tuple(a[:100] for a in data),
                                                     remainder="pad"),
                            callbacks=callbacks).history
        return model, history

    full, full_history = fit([])
    with pytest.raises(RuntimeError, match="killed"):
        fit([dtk.CheckpointCallback(tmp_path), _Killed()])
    callback = dtk.CheckpointCallback(tmp_path)
    resumed, history = fit([callback])
    assert callback.restored_epoch == 2
    assert history["loss"] == full_history["loss"][2:]
    assert history["val_loss"] == full_history["val_loss"][2:]
    for w, v in zip(full.weights, resumed.weights):
        np.testing.assert_array_equal(v.numpy(), w.numpy(), err_msg=v.name)


@pytest.mark.parametrize("spe", [1, 4])
def test_predict_with_several_steps_per_call_returns_every_row(spe):
    """compile(steps_per_execution=4): Keras counts each predict call as 4 batches and keeps
    what it returns; every batch's outputs come back, in order (before issue 71 the call ran
    one batch, and predict returned 64 of 200 rows)."""
    x, _ = _binary_data(200)
    model = dtk.distribute(_mlp, dtk.build_mesh("batch=8"), seed=0)
    model.compile(optimizer="sgd", loss="binary_crossentropy", steps_per_execution=spe)
    got = model.predict(x, batch_size=32, verbose=0)
    tf_keras.utils.set_random_seed(0)
    want = _mlp().predict(x, batch_size=32, verbose=0)
    assert got.shape == (200, 1)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_readme_trainer_example_and_its_keras_fit_twin_run_as_written(tmp_path):
    """README's Trainer example and the Keras-fit lines under it (the same DistributedDatasets
    into Keras's own fit), run as written in a fresh process (one epoch each instead of three,
    the checkpoints in tmp_path): both train to over 90% test accuracy, with the same losses."""
    from tests import procs  # pylint: disable=import-outside-toplevel
    readme = (procs.REPO / "README.md").read_text()
    python = [part.split("```", 1)[0] for part in readme.split("```python\n")[1:]]
    blocks = [next(b for b in python if "dtk.Trainer(" in b and "mlp_export" in b),
              next(b for b in python if "model.fit(train" in b)]
    assert "dtk.Trainer(" in blocks[0] and "model.fit(train" in blocks[1]
    code = "\n".join(blocks).replace("epochs=3", "epochs=1")
    for path in ("/tmp/mlp_export", "/tmp/mlp", "/tmp/fit"):
        code = code.replace(f'"{path}"', repr(str(tmp_path / path.rsplit("/", 1)[1])))
    code = "import tf_keras\n" + code + (
        "\nprint('LOSSES', [history.history['loss'], model.history.history['loss'], "
        "model.history.history['val_accuracy']])\n")
    res = procs.run_python(code, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    trainer_loss, keras_loss, accuracy = eval(  # pylint: disable=eval-used
        res.stdout.split("LOSSES", 1)[1].strip())
    np.testing.assert_allclose(keras_loss, trainer_loss, rtol=1e-6)
    assert accuracy[-1] > 0.9, accuracy


class _ChangeStepsPerCall(tf_keras.callbacks.Callback):
    """Changes Keras's steps per call mid-epoch, as its steps_per_execution="auto" tuner does."""

    def on_train_batch_end(self, batch, logs=None):
        for at, count in ((31, 3), (40, 1), (42, 5)):
            if batch == at:
                self.model._steps_per_execution.assign(count)  # pylint: disable=protected-access


def test_a_distributed_dataset_follows_a_steps_per_call_that_changes_mid_epoch():
    """Issue 71: the prefetch thread stacks the first call's count of batches per item; a later
    call that asks for fewer (3, then 1) takes part of a stack and leaves the rest for the next,
    one that asks for more (5) takes several: every batch trains once, in order, with the
    updates of one step per call, bit for bit."""
    mesh = dtk.build_mesh("batch=8")
    data = _mnist_like(64 * 80)
    changed = _mnist_distributed(mesh, spe=32)  # (the first call's stack split: 1 + 31)
    changed.fit(_dataset(mesh, data, shuffle=True), epochs=2, verbose=0,
                callbacks=[_ChangeStepsPerCall()])
    one = _mnist_distributed(mesh)
    one.fit(_dataset(mesh, data, shuffle=True), epochs=2, verbose=0)
    assert int(changed.optimizer.iterations.numpy()) == 160
    for w, v in zip(one.weights, changed.weights):
        np.testing.assert_array_equal(v.numpy(), w.numpy(), err_msg=v.name)


def test_checkpoint_callback_refuses_a_resume_with_other_settings_unless_allowed(tmp_path):
    """Issue 71 (the Trainer's resume contract, for Keras's fit): a CheckpointCallback run killed
    after epoch 2, resumed with another learning rate or another dropout rate, is refused in one
    line naming each change, before any step; allowed on purpose, the new learning rate is set
    on the restored optimizer and reported; another mesh resumes freely."""
    x, y = _binary_data(192)

    def compiled(spec, rate=1e-2, dropout=0.3):
        model = dtk.distribute(functools.partial(_mlp, dropout=dropout), dtk.build_mesh(spec),
                               layout=_layout(spec), seed=0, allow_replicated=True)
        model.compile(optimizer=tf_keras.optimizers.Adam(rate), loss="binary_crossentropy")
        return model

    with pytest.raises(RuntimeError, match="killed"):
        _fit_no_shuffle(x, y, compiled("batch=8"), [dtk.CheckpointCallback(tmp_path), _Killed()])
    for model, phrase in ((compiled("batch=8", rate=2e-2), r"learning_rate 0.01 -> 0.02"),
                          (compiled("batch=8", dropout=0.5), r"model.\d:Dropout.rate 0.3 -> 0.5")):
        with pytest.raises(ValueError, match=r"checkpoint .* was written with other settings: "
                           + phrase + r"\. .*\(CheckpointCallback\(allow_change=\('"):
            _fit_no_shuffle(x, y, model, [dtk.CheckpointCallback(tmp_path)])
        assert int(model.optimizer.iterations.numpy()) == 12  # the checkpoint's: none trained
    callback = dtk.CheckpointCallback(tmp_path, allow_change=("learning_rate",))
    model = compiled("batch=4,model=2", rate=2e-2)
    losses = _fit_no_shuffle(x, y, model, [callback])
    assert callback.restored_epoch == 2 and len(losses) == 2
    assert callback.resume_changes == {"learning_rate": {"old": 0.01, "new": 0.02}}
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(0.02)


def test_max_steps_stops_mid_call_and_a_checkpointed_run_resumes_to_the_same_weights(tmp_path):
    """Issue 71 (TrainerConfig(max_steps=) for Keras's fit): dtk.MaxSteps(23) with 4 steps per
    call stops at step 23 exactly, inside epoch 3 (its call shortened to the 3 steps left);
    dtk.CheckpointCallback records that position, and the same fit again with MaxSteps(37) trains
    the rest of epoch 3 and on: the weights of one uninterrupted run of 37 steps, bit for bit."""
    mesh = dtk.build_mesh("batch=8")
    data = _mnist_like(64 * 10)

    def fit(callbacks):
        model = _mnist_distributed(mesh, spe=4, dropout=0.2)
        model.fit(_dataset(mesh, data, shuffle=True), epochs=5, verbose=0, callbacks=callbacks)
        return model

    stopped = fit([dtk.CheckpointCallback(tmp_path), dtk.MaxSteps(23)])
    assert int(stopped.optimizer.iterations.numpy()) == 23
    assert int(stopped._steps_per_execution.numpy()) == 4  # pylint: disable=protected-access
    callback = dtk.CheckpointCallback(tmp_path)
    resumed = fit([callback, dtk.MaxSteps(37)])
    assert (callback.restored_epoch, callback.restored_step) == (2, 3)
    whole = fit([dtk.MaxSteps(37)])
    assert int(resumed.optimizer.iterations.numpy()) == 37
    for w, v in zip(whole.weights, resumed.weights):
        np.testing.assert_array_equal(v.numpy(), w.numpy(), err_msg=v.name)
    with pytest.raises(ValueError, match=r"MaxSteps\(max_steps=...\) must be a positive integer; "
                                         r"got 0"):
        dtk.MaxSteps(0)


def _fixed_auto_decisions(monkeypatch) -> list:
    """steps_per_execution="auto" deciding by call count instead of timings: 1 per call, the
    probe's 2 after the second timed call, 3 after the fourth. Returns the list the timed calls'
    step counts are appended to."""
    from dtk.train import auto_steps  # pylint: disable=import-outside-toplevel
    counts = []

    def observe(self, seconds, steps, steps_per_epoch):  # pylint: disable=unused-argument
        counts.append(steps)
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 2:
            self.steps_per_call = 2
        if self.calls == 4:
            self.set(3)

    monkeypatch.setattr(auto_steps.AutoSteps, "observe", observe)
    monkeypatch.setattr(auto_steps, "AUTO_MIN_STEPS", 1)
    return counts


def test_auto_steps_per_call_under_keras_fit_is_dtks_and_bit_identical(monkeypatch):
    """Issue 71 (steps_per_execution="auto" as a compile() option): a dtk.distribute model
    compiled with "auto" runs dtk's calibration (dtk.train.auto_steps, whose choice every client
    shares) instead of Keras's tuner: 1 per call, the probe's 2, then the choice, 3 (fixed here
    in place of timings), the next fit keeps it; the weights and logs are those of one step per
    call, bit for bit, on a DistributedDataset and on arrays."""
    counts = _fixed_auto_decisions(monkeypatch)
    mesh = dtk.build_mesh("batch=8")
    data = _mnist_like(64 * 12)
    one = _mnist_distributed(mesh)
    want = one.fit(_dataset(mesh, data, shuffle=True), epochs=2, verbose=0).history
    auto = _mnist_distributed(mesh, spe="auto")
    got = auto.fit(_dataset(mesh, data, shuffle=True), epochs=2, verbose=0).history
    assert counts[:4] == [1, 1, 2, 2] and auto._dtk_auto_steps == 3  # pylint: disable=protected-access
    assert int(auto.optimizer.iterations.numpy()) == 24
    assert got == want
    for w, v in zip(one.weights, auto.weights):
        np.testing.assert_array_equal(v.numpy(), w.numpy(), err_msg=v.name)
    calls = len(counts)
    auto.fit(data[0], data[1], batch_size=64, epochs=1, shuffle=False, verbose=0)
    one.fit(data[0], data[1], batch_size=64, epochs=1, shuffle=False, verbose=0)
    assert len(counts) == calls  # the choice is kept: no new calibration
    for w, v in zip(one.weights, auto.weights):
        np.testing.assert_array_equal(v.numpy(), w.numpy(), err_msg=v.name)


def test_checkpoint_callback_keeps_the_whole_runs_history_across_a_resume(tmp_path):
    """Issue 71 (the Trainer's checkpoint record, for Keras's fit): Keras's History of a resumed
    fit holds its own epochs; the CheckpointCallback's holds the whole run's, restored from the
    checkpoint: a run killed after epoch 2 and resumed logs epochs 0-3 with the uninterrupted
    run's losses, bit for bit."""
    x, y = _binary_data(192)
    fit = functools.partial(_fit_no_shuffle, x, y)
    whole = dtk.CheckpointCallback(tmp_path / "whole")
    full = fit(_dropout_compiled("batch=8"), [whole])
    with pytest.raises(RuntimeError, match="killed"):
        fit(_dropout_compiled("batch=8"), [dtk.CheckpointCallback(tmp_path / "a"), _Killed()])
    callback = dtk.CheckpointCallback(tmp_path / "a")
    resumed = fit(_dropout_compiled("batch=8"), [callback])
    assert resumed == full[2:]  # Keras's own History: this fit's epochs
    assert whole.epochs == callback.epochs == [0, 1, 2, 3]
    assert whole.history["loss"] == callback.history["loss"] == full


def test_a_resumed_run_keeps_its_automatic_steps_per_call(tmp_path, monkeypatch):
    """compile(steps_per_execution="auto") with dtk.CheckpointCallback: the choice (3, fixed here
    in place of timings) is recorded in the checkpoints; the run killed after epoch 2 and
    resumed takes it after its first call, without calibrating again, and ends on the weights
    of one step per call, bit for bit."""
    counts = _fixed_auto_decisions(monkeypatch)
    mesh = dtk.build_mesh("batch=8")
    data = _mnist_like(64 * 12)
    first = _mnist_distributed(mesh, spe="auto")
    with pytest.raises(RuntimeError, match="killed"):
        first.fit(_dataset(mesh, data, shuffle=True), epochs=4, verbose=0,
                  callbacks=[dtk.CheckpointCallback(tmp_path), _Killed()])
    calibrated = len(counts)
    resumed = _mnist_distributed(mesh, spe="auto")
    resumed.fit(_dataset(mesh, data, shuffle=True), epochs=4, verbose=0,
                callbacks=[dtk.CheckpointCallback(tmp_path)])
    assert len(counts) == calibrated  # no calibration again
    assert int(resumed._steps_per_execution.numpy()) == 3  # pylint: disable=protected-access
    one = _mnist_distributed(mesh)
    one.fit(_dataset(mesh, data, shuffle=True), epochs=4, verbose=0)
    for w, v in zip(one.weights, resumed.weights):
        np.testing.assert_array_equal(v.numpy(), w.numpy(), err_msg=v.name)
