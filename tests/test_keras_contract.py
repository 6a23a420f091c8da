"""``compile()`` means what it means in Keras (issue 40): a factory compiled the way keras.io writes
it trains under dtk with its compiled optimizer, loss and metrics, reports Keras's numbers, and
checkpoints.

The reference is plain tf_keras ``Model.fit`` on one device (same seed, same data, no shuffle).
keras.io's "Simple MNIST convnet" is written as its page writes it, at a smaller width and without
its Dropout where the reference is Keras itself (dtk's dropout draws are mesh-invariant, not
Keras's: the mesh-parity case keeps it, against dtk's own ``batch=1``).
"""

import tempfile
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from tf_keras import layers

import dtk

B, N = 16, 4  # global batch, steps


def convnet(*, optimizer="adam", loss="categorical_crossentropy", metrics=("accuracy",),
            dropout=False, regularizer=None, classes=10, activation="softmax"):
    """keras.io "Simple MNIST convnet" (narrower), compiled in its factory as the page does."""
    def factory():
        model = tf_keras.Sequential([
            tf_keras.Input(shape=(12, 12, 1)),
            layers.Conv2D(4, kernel_size=(3, 3), activation="relu"),
            layers.MaxPooling2D(pool_size=(2, 2)),
            layers.Flatten(),
            *([layers.Dropout(0.5)] if dropout else []),
            layers.Dense(classes, activation=activation, kernel_regularizer=regularizer),
        ])
        opt = optimizer() if callable(optimizer) else optimizer
        model.compile(loss=loss, optimizer=opt, metrics=list(metrics))
        return model
    return factory


def _data(classes=10, one_hot=True):
    rng = np.random.default_rng(0)
    x = rng.random((N * B, 12, 12, 1), dtype=np.float32)
    ids = rng.integers(0, classes, N * B)
    if classes == 1:
        return x, rng.integers(0, 2, (N * B, 1)).astype(np.float32)
    return x, (np.eye(classes, dtype=np.float32)[ids] if one_hot else ids.astype(np.int64))


def _keras_fit(factory, x, y, epochs=1):
    tf_keras.utils.set_random_seed(7)
    model = factory()
    history = model.fit(x, y, batch_size=B, epochs=epochs, shuffle=False, verbose=0)
    return history.history, model


# On a mesh with a model axis: the classifier's kernel column-sharded, the convolution replicated
# (DTensor's convolution gradients are batch parallel).
CLASSIFIER_ON_MODEL = """
name = "convnet_classifier_on_model"
description = "the last Dense layer column-sharded on model"
axes = ["batch", "model"]
optional_axes = ["model"]
[[rules]]
pattern = 'dense.*\\.kernel'
dims = ["unsharded", "model"]
[[rules]]
pattern = 'dense.*\\.bias'
dims = ["model"]
"""


def _dtk_fit(factory, mesh, x, y, epochs=1, **config):
    layout = None
    if "model" in mesh:
        path = Path(tempfile.mkdtemp()) / "convnet_classifier_on_model.toml"
        path.write_text(CLASSIFIER_ON_MODEL)
        layout = dtk.load_table(path)
    mesh = dtk.build_mesh(mesh)
    config.setdefault("verbose", 0)
    config.setdefault("steps_per_execution", 1)
    trainer = dtk.Trainer(mesh=mesh, model=factory, layout=layout,
                          config=dtk.TrainerConfig(seed=7, **config))
    data = dtk.DistributedDataset(tf.data.Dataset.from_tensor_slices((x, y)), mesh,
                                  dtk.InputConfig(global_batch_size=B))
    return trainer.fit(data, epochs=epochs), trainer


def _close(dtk_history, keras_history, rtol=1e-5):
    for key, values in keras_history.items():
        np.testing.assert_allclose(dtk_history[key], values, rtol=rtol, atol=1e-6, err_msg=key)


# A: the compiled optimizer, by name, as an object, as a schedule; on every mesh kind.
@pytest.mark.parametrize("optimizer, mesh", [
    ("adam", "batch=8"),
    (lambda: tf_keras.optimizers.Adam(1e-3), "batch=1"),
    ("sgd", "batch=8"),
    (lambda: tf_keras.optimizers.SGD(1e-2, momentum=0.9), "batch=4,model=2"),
    (lambda: tf_keras.optimizers.RMSprop(1e-3), "batch=8"),
    (lambda: tf_keras.optimizers.Adam(tf_keras.optimizers.schedules.ExponentialDecay(
        1e-2, decay_steps=2, decay_rate=0.5)), "batch=8"),
], ids=["adam", "Adam(1e-3)", "sgd", "SGD-momentum", "RMSprop", "Adam-schedule"])
def test_compiled_optimizer_trains_like_keras_fit(optimizer, mesh):
    factory = convnet(optimizer=optimizer)
    x, y = _data()
    keras_history, _ = _keras_fit(factory, x, y, epochs=2)
    history, trainer = _dtk_fit(factory, mesh, x, y, epochs=2)
    _close(history.history, keras_history)
    assert trainer.model.optimizer is trainer.optimizer  # as after compile()


@pytest.mark.slow  # the fast lane keeps the compiled-optimizer case and the unit tests
# C: "accuracy" and "acc" resolve as in Keras: categorical, sparse or binary by the shapes.
@pytest.mark.parametrize("metric, classes, one_hot, loss, activation", [
    ("accuracy", 10, True, "categorical_crossentropy", "softmax"),
    ("acc", 10, False, "sparse_categorical_crossentropy", "softmax"),
    ("accuracy", 1, False, "binary_crossentropy", "sigmoid"),
    ("crossentropy", 10, True, "categorical_crossentropy", "softmax"),
])
def test_accuracy_resolves_like_keras(metric, classes, one_hot, loss, activation):
    factory = convnet(metrics=(metric,), loss=loss, classes=classes, activation=activation)
    x, y = _data(classes, one_hot)
    keras_history, _ = _keras_fit(factory, x, y)
    assert metric in keras_history
    history, _ = _dtk_fit(factory, "batch=8", x, y)
    _close(history.history, keras_history)


@pytest.mark.slow  # the fast lane keeps the compiled-optimizer case and the unit tests
# L: the reported loss is Keras's, regularization included (training and evaluation).
def test_reported_loss_includes_regularization():
    factory = convnet(regularizer=tf_keras.regularizers.l2(1e-2))
    x, y = _data()
    keras_history, model = _keras_fit(factory, x, y)
    history, trainer = _dtk_fit(factory, "batch=8", x, y)
    _close(history.history, keras_history)
    keras_eval = model.evaluate(x, y, batch_size=B, verbose=0, return_dict=True)
    data = dtk.DistributedDataset(tf.data.Dataset.from_tensor_slices((x, y)), trainer.mesh,
                                  dtk.InputConfig(global_batch_size=B))
    np.testing.assert_allclose(trainer.evaluate(data)["loss"], keras_eval["loss"], rtol=1e-5)


# B: a compiled factory checkpoints with the default (asynchronous) saves and resumes exactly;
# dropout on, mesh parity against dtk's batch=1.
@pytest.mark.slow
def test_compiled_model_checkpoints_and_resumes_exactly(tmp_path):
    factory = convnet(dropout=True)
    x, y = _data()
    whole, _ = _dtk_fit(factory, "batch=1", x, y, epochs=3)
    _dtk_fit(factory, "batch=8", x, y, epochs=1, checkpoint_dir=str(tmp_path))
    resumed, trainer = _dtk_fit(factory, "batch=8", x, y, epochs=3,
                                checkpoint_dir=str(tmp_path))
    assert trainer.config.async_checkpoints
    _close(resumed.history, whole.history)


# H and F: keras.io "The Functional API", the multi-input, multi-output model, as the page writes
# it (smaller), except for one documented change: the titles and bodies have a fixed length
# (shape=(6,) and (10,), not (None,)), since dtk unrolls the LSTM loops, which DTensor cannot lay
# out, and that needs a static number of steps (the refusal says so, before the first step).
# Per-output losses with loss_weights, dict inputs and outputs; predict returns the dict.
def ticket_model():
    num_tags, num_words, num_departments = 12, 100, 4
    title_input = tf_keras.Input(shape=(6,), name="title")
    body_input = tf_keras.Input(shape=(10,), name="body")
    tags_input = tf_keras.Input(shape=(num_tags,), name="tags")
    title_features = layers.Embedding(num_words, 8)(title_input)
    body_features = layers.Embedding(num_words, 8)(body_input)
    title_features = layers.LSTM(8)(title_features)
    body_features = layers.LSTM(4)(body_features)
    x = layers.concatenate([title_features, body_features, tags_input])
    priority_pred = layers.Dense(1, name="priority")(x)
    department_pred = layers.Dense(num_departments, name="department")(x)
    model = tf_keras.Model(inputs=[title_input, body_input, tags_input],
                           outputs={"priority": priority_pred, "department": department_pred})
    model.compile(
        optimizer=tf_keras.optimizers.RMSprop(1e-3),
        loss={"priority": tf_keras.losses.BinaryCrossentropy(from_logits=True),
              "department": tf_keras.losses.CategoricalCrossentropy(from_logits=True)},
        loss_weights={"priority": 1.0, "department": 0.2})
    return model


def _ticket_data():
    rng = np.random.default_rng(0)
    n = N * B
    x = {"title": rng.integers(0, 100, (n, 6)).astype(np.float32),
         "body": rng.integers(0, 100, (n, 10)).astype(np.float32),
         "tags": rng.integers(0, 2, (n, 12)).astype(np.float32)}
    y = {"priority": rng.random((n, 1)).astype(np.float32),
         "department": np.eye(4, dtype=np.float32)[rng.integers(0, 4, n)]}
    return x, y


@pytest.mark.slow  # the fast lane keeps the compiled-optimizer case and the unit tests
@pytest.mark.parametrize("mesh", ["batch=8", "batch=1"])
def test_per_output_losses_with_weights_train_like_keras_fit(mesh):
    x, y = _ticket_data()
    keras_history, model = _keras_fit(ticket_model, x, y, epochs=2)
    history, trainer = _dtk_fit(ticket_model, mesh, x, y, epochs=2)
    np.testing.assert_allclose(history.history["loss"], keras_history["loss"], rtol=1e-5)
    data = dtk.DistributedDataset(tf.data.Dataset.from_tensor_slices((x, y)), trainer.mesh,
                                  dtk.InputConfig(global_batch_size=B))
    predicted = trainer.predict(data)
    want = model.predict(x, batch_size=B, verbose=0)
    assert sorted(predicted) == ["department", "priority"]
    for key in want:
        np.testing.assert_allclose(predicted[key], want[key], rtol=1e-4, atol=1e-6)


# K and G: keras.io "Customizing what happens in fit()": a model's own train_step runs on the mesh,
# with its own metric objects (made in __init__: dtk binds them to the mesh).
class CustomFit(tf_keras.Model):
    """The page's first example, plus a term added to the loss in train_step (issue 40, K)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
            loss = loss + 0.1 * tf.reduce_mean(tf.square(y_pred))  # the model's own objective
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply_gradients(zip(gradients, trainable_vars))
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def custom_fit():
    inputs = tf_keras.Input(shape=(32,))
    outputs = tf_keras.layers.Dense(1)(tf_keras.layers.Dense(16, activation="relu")(inputs))
    model = CustomFit(inputs, outputs)
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    return model


class LowLevelFit(tf_keras.Model):
    """The page's lower-level example: no compiled loss, the model's own metric objects."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = tf_keras.metrics.Mean(name="loss")
        self.mae_metric = tf_keras.metrics.MeanAbsoluteError(name="mae")

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = tf_keras.losses.mean_squared_error(y, y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

    def _evaluation_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        self.loss_tracker.update_state(tf_keras.losses.mean_squared_error(y, y_pred))
        self.mae_metric.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

    test_step = _evaluation_step  # Keras's hook (bound by name, so pytest collects no test_ here)

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


def low_level_fit():
    inputs = tf_keras.Input(shape=(32,))
    outputs = tf_keras.layers.Dense(1)(inputs)
    model = LowLevelFit(inputs, outputs)
    model.compile(optimizer="adam")
    return model


def _regression_data():
    rng = np.random.default_rng(0)
    return (rng.random((N * B, 32), dtype=np.float32),
            rng.random((N * B, 1), dtype=np.float32))


@pytest.mark.slow  # the fast lane keeps the compiled-optimizer case and the unit tests
@pytest.mark.parametrize("factory, mesh", [(custom_fit, "batch=8"), (custom_fit, "batch=1"),
                                           (low_level_fit, "batch=8")],
                         ids=["custom_fit-batch=8", "custom_fit-batch=1", "low_level-batch=8"])
def test_a_models_own_train_step_runs_on_the_mesh(factory, mesh, tmp_path):
    x, y = _regression_data()
    keras_history, model = _keras_fit(factory, x, y, epochs=2)
    history, trainer = _dtk_fit(factory, mesh, x, y, epochs=2, checkpoint_dir=str(tmp_path))
    _close(history.history, keras_history)
    for got, want in zip(dtk.gather_weights(trainer.model), model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    data = dtk.DistributedDataset(tf.data.Dataset.from_tensor_slices((x, y)), trainer.mesh,
                                  dtk.InputConfig(global_batch_size=B))
    results = trainer.evaluate(data)
    want = model.evaluate(x, y, batch_size=B, verbose=0, return_dict=True)
    for key, value in want.items():
        np.testing.assert_allclose(results[key], value, rtol=1e-5, err_msg=key)


# E and I: models with nested Sequentials. ConvNeXt's stem is a Sequential called in a functional
# model; keras.io's "Text classification with Transformer" keeps its feed-forward net as
# self.ffn = keras.Sequential([...]) in a layer. Both train like tf_keras, resume exactly and
# export with predictions equal.
def nested_stem():
    inputs = tf_keras.Input((12, 12, 1))
    stem = tf_keras.Sequential([layers.Conv2D(8, 4, strides=4, name="stem_conv"),
                                layers.LayerNormalization(epsilon=1e-6, name="stem_ln")],
                               name="stem")
    x = layers.GlobalAveragePooling2D()(stem(inputs))
    model = tf_keras.Model(inputs, layers.Dense(10, activation="softmax")(x))
    model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
    return model


class TransformerBlock(layers.Layer):
    """keras.io, "Text classification with Transformer", as the page writes it."""

    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = tf_keras.Sequential(
            [layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs, training=None):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output, training=training)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output, training=training)
        return self.layernorm2(out1 + ffn_output)


class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = tf.shape(x)[-1]
        positions = tf.range(start=0, limit=maxlen, delta=1)
        return self.token_emb(x) + self.pos_emb(positions)


def text_transformer(rate=0.0):
    maxlen, vocab_size, embed_dim, num_heads, ff_dim = 10, 50, 8, 2, 16
    inputs = layers.Input(shape=(maxlen,))
    x = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)(inputs)
    x = TransformerBlock(embed_dim, num_heads, ff_dim, rate)(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dropout(rate)(x)
    x = layers.Dense(8, activation="relu")(x)
    x = layers.Dropout(rate)(x)
    outputs = layers.Dense(2, activation="softmax")(x)
    model = tf_keras.Model(inputs=inputs, outputs=outputs)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def _text_data():
    rng = np.random.default_rng(0)
    return (rng.integers(0, 50, (N * B, 10)).astype(np.float32),
            rng.integers(0, 2, N * B).astype(np.int64))


@pytest.mark.slow  # the fast lane keeps the compiled-optimizer case and the unit tests
@pytest.mark.parametrize("name", ["nested_stem", "text_transformer"])
def test_nested_sequentials_train_resume_and_export(name, tmp_path):
    factory, (x, y) = {"nested_stem": (nested_stem, _data()),
                       "text_transformer": (text_transformer, _text_data())}[name]
    keras_history, _ = _keras_fit(factory, x, y, epochs=2)
    history, trainer = _dtk_fit(factory, "batch=8", x, y, epochs=2)
    _close(history.history, keras_history)
    _dtk_fit(factory, "batch=8", x, y, epochs=1, checkpoint_dir=str(tmp_path / "ckpt"))
    resumed, again = _dtk_fit(factory, "batch=8", x, y, epochs=2,
                              checkpoint_dir=str(tmp_path / "ckpt"))
    for got, want in zip(dtk.gather_weights(again.model), dtk.gather_weights(trainer.model)):
        np.testing.assert_array_equal(got, want)
    paths = again.export(str(tmp_path / "export"))
    loaded = tf_keras.models.load_model(paths["keras"], custom_objects={
        "TransformerBlock": TransformerBlock,
        "TokenAndPositionEmbedding": TokenAndPositionEmbedding})
    data = dtk.DistributedDataset(tf.data.Dataset.from_tensor_slices((x, y)), again.mesh,
                                  dtk.InputConfig(global_batch_size=B))
    np.testing.assert_allclose(loaded.predict(x, verbose=0), again.predict(data), rtol=1e-5,
                               atol=1e-6)


# D: keras.io "Bidirectional LSTM on IMDB", as the page writes it (smaller), with mask_zero as the
# issue's variant, except for one documented change: a fixed review length (shape=(6,), not
# (None,)), since dtk unrolls the LSTM loops. Bidirectional's return_sequences output is
# reversed with dtk's equivalent of ReverseV2.
def bilstm(mask_zero, unroll=False):
    def factory():
        inputs = tf_keras.Input(shape=(6,), dtype="int32")
        x = layers.Embedding(40, 8, mask_zero=mask_zero)(inputs)
        x = layers.Bidirectional(layers.LSTM(6, return_sequences=True, unroll=unroll))(x)
        x = layers.Bidirectional(layers.LSTM(6, unroll=unroll))(x)
        outputs = layers.Dense(1, activation="sigmoid")(x)
        model = tf_keras.Model(inputs, outputs)
        model.compile("adam", "binary_crossentropy", metrics=["accuracy"])
        return model
    return factory


def test_reverse_equals_tf_reverse():
    from dtk.parallel import ops as op_support  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((3, 5, 4)), tf.float32)
    for axes in ([1], [0, 2]):
        with tf.GradientTape() as tape:
            tape.watch(x)
            got = op_support.reverse(x, axes)
            loss = tf.reduce_sum(got * tf.range(60, dtype=tf.float32)[:, None, None][:3] ** 0)
        np.testing.assert_array_equal(got, tf.reverse(x, axes))
        np.testing.assert_array_equal(tape.gradient(loss, x), tf.ones_like(x))
    mask = tf.constant([[True, False, False]])
    np.testing.assert_array_equal(op_support.reverse(mask, [1]), tf.reverse(mask, [1]))


@pytest.mark.slow  # the fast lane keeps the compiled-optimizer case and the unit tests
@pytest.mark.parametrize("mask_zero", [False, True])
def test_bidirectional_lstm_with_sequences_trains_like_keras_fit(mask_zero):
    rng = np.random.default_rng(0)
    x = rng.integers(1, 40, (N * B, 6)).astype(np.int32)
    if mask_zero:
        x[:, 4:] = 0  # padded reviews
    y = rng.integers(0, 2, (N * B, 1)).astype(np.float32)
    # With a mask, tf_keras's own unrolled LSTM differs from its while loop (by 3.8e-4 of the
    # loss here, in plain tf_keras alone): the reference is then tf_keras unrolled, as dtk runs it.
    keras_history, _ = _keras_fit(bilstm(mask_zero, unroll=mask_zero), x, y, epochs=2)
    history, _ = _dtk_fit(bilstm(mask_zero), "batch=8", x, y, epochs=2)
    assert set(history.history) == set(keras_history) and len(history.history["loss"]) == 2
    _close(history.history, keras_history)  # every logged number at Keras's


def test_random_flip_equivalent_flips_whole_examples():
    """RandomFlip under dtk (issue 40): each example is itself, or exactly its mirror image, about
    half of them flipped per mode; at inference the images pass unchanged. Its draws on a mesh
    are mesh-invariant (tests/test_layer_table.py, the RandomFlip rows, against batch=1)."""
    import types  # pylint: disable=import-outside-toplevel
    from dtk.parallel import ops as op_support  # pylint: disable=import-outside-toplevel
    layer = layers.RandomFlip("horizontal", seed=1)
    layer.call = types.MethodType(op_support._random_flip_call, layer)  # pylint: disable=protected-access
    x = tf.constant(np.random.default_rng(0).random((64, 5, 6, 2)), tf.float32)
    out = layer(x, training=True).numpy()
    mirrored = x.numpy()[:, :, ::-1, :]
    same = np.all(out == x.numpy(), axis=(1, 2, 3))
    flipped = np.all(out == mirrored, axis=(1, 2, 3))
    assert np.all(same | flipped) and 16 < flipped.sum() < 48, flipped.sum()
    np.testing.assert_array_equal(layer(x, training=False), x)


@pytest.mark.parametrize("fill_mode", ["reflect", "wrap", "nearest", "constant"])
@pytest.mark.parametrize("interpolation", ["nearest", "bilinear"])
def test_the_image_transform_equivalent_matches_tensorflows_op(fill_mode, interpolation):
    """RandomRotation / RandomTranslation / RandomZoom under dtk (issue 40): dtk's
    projective_transform gives ImageProjectiveTransformV3's images (1e-5) for random projective
    transforms (a third of them affine), in every fill mode and interpolation."""
    from tf_keras.src.layers.preprocessing import image_preprocessing  # pylint: disable=import-outside-toplevel
    from dtk.parallel import ops as op_support  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(0)
    images = tf.constant(rng.normal(size=(3, 9, 11, 2)).astype(np.float32))
    for trial in range(12):
        t = rng.normal(scale=[0.5, 0.5, 4, 0.5, 0.5, 4, 0.01, 0.01], size=(3, 8))
        t[:, 0] += 1
        t[:, 4] += 1
        if trial % 3 == 0:
            t[:, 6:] = 0
        t = t.astype(np.float32)
        want = image_preprocessing.transform(images, t, fill_mode=fill_mode, fill_value=0.5,
                                             interpolation=interpolation)
        got = op_support.projective_transform(images, t, fill_mode=fill_mode, fill_value=0.5,
                                              interpolation=interpolation)
        np.testing.assert_allclose(got, want, atol=1e-5)
