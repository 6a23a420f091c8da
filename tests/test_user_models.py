"""Models users bring: ops DTensor cannot lay out, preprocessing state, recurrent layers, export.

The equivalents in ``dtk.parallel.ops`` equal TensorFlow's ops in values and gradients (on one device
and, inside models, on sharded meshes); blocks of MobileNetV2 (depthwise), DenseNet (average
pooling), LSTM/GRU without ``unroll`` and both Normalization forms train on ``batch=8`` and
``batch=4,model=2`` like one device, resume exactly and export exactly. The real applications
(MobileNetV2, DenseNet121, EfficientNetB0) run in the slow lane and in ``scripts/zoo.py``.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import dtk
from dtk.train import checkpoint as ckpt_lib
from dtk.data import input as input_lib
from dtk.parallel import layouts, ops as op_support

L = tf_keras.layers
B = 16


# -- the equivalents against TensorFlow's ops -----------------------------------------------------
@pytest.mark.parametrize("size, kernel, stride, padding, dilation", [
    ((8, 8), 3, 1, "SAME", 1), ((8, 8), 3, 2, "SAME", 1), ((7, 9), 3, 2, "VALID", 1),
    ((9, 9), 5, 2, "SAME", 1), ((1, 6), (1, 3), 1, "VALID", 1), ((8, 8), 3, 1, "SAME", 2)])
def test_depthwise_conv2d_equals_tensorflow(size, kernel, stride, padding, dilation):
    rng = np.random.default_rng(0)
    kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
    x = tf.constant(rng.standard_normal((2, *size, 3)), tf.float32)
    k = tf.constant(rng.standard_normal((kh, kw, 3, 2)), tf.float32)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([x, k])
        want = tf.nn.depthwise_conv2d(x, k, [1, stride, stride, 1], padding,
                                      dilations=[dilation, dilation])
        got = op_support.depthwise_conv2d(x, k, strides=(stride, stride), padding=padding,
                                          dilations=(dilation, dilation))
        loss_want, loss_got = tf.reduce_sum(want ** 2), tf.reduce_sum(got ** 2)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # The gradients sum many products in another order than TensorFlow's kernel: measured against
    # float64, dtk's float32 error is at most a small multiple of TensorFlow's own float32 error
    # (the spread that summation order alone gives; an atol would hide a real difference).
    x64, k64 = tf.cast(x, tf.float64), tf.cast(k, tf.float64)
    with tf.GradientTape() as tape64:
        tape64.watch([x64, k64])
        exact = tf.reduce_sum(tf.nn.depthwise_conv2d(
            x64, k64, [1, stride, stride, 1], padding, dilations=[dilation, dilation]) ** 2)
    for g, w, e in zip(tape.gradient(loss_got, [x, k]), tape.gradient(loss_want, [x, k]),
                       tape64.gradient(exact, [x64, k64])):
        spread = np.max(np.abs(w.numpy() - e.numpy()))
        error = np.max(np.abs(g.numpy() - e.numpy()))
        assert error <= 4 * spread + 1e-12, (error, spread)


@pytest.mark.parametrize("size, patch, stride, rate, padding", [
    ((8, 8), 4, 4, 1, "VALID"), ((9, 10), 3, 3, 1, "VALID"), ((8, 8), 3, 2, 1, "SAME"),
    ((8, 8), 3, 2, 1, "VALID"), ((9, 9), 2, 1, 2, "VALID"), ((7, 8), (2, 3), (2, 3), 1, "SAME")])
def test_extract_patches_equals_tensorflow(size, patch, stride, rate, padding):
    """keras.io's ViT and MLP-Mixer cut images with tf.image.extract_patches, which DTensor
    cannot lay out; dtk's equivalent gives the op's values and gradients exactly."""
    kh, kw = (patch, patch) if isinstance(patch, int) else patch
    sh, sw = (stride, stride) if isinstance(stride, int) else stride
    x = tf.constant(np.random.default_rng(2).standard_normal((2, *size, 3)), tf.float32)
    args = ([1, kh, kw, 1], [1, sh, sw, 1], [1, rate, rate, 1], padding)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        want = tf.raw_ops.ExtractImagePatches(images=x, ksizes=args[0], strides=args[1],
                                              rates=args[2], padding=args[3])
        got = op_support.extract_patches(x, *args)
        loss_want, loss_got = tf.reduce_sum(want ** 3), tf.reduce_sum(got ** 3)
    np.testing.assert_array_equal(got, want)
    try:
        reference = tape.gradient(loss_want, x)
    except tf.errors.InvalidArgumentError as e:  # TF's own gradient: no dilated kernel on some
        if "dilation rates larger than 1" not in str(e):  # CPUs ("Current CPU implementations
            raise  # do not yet support dilation rates larger than 1")
        # The same gradient from where each patch element comes from: the patches of an image
        # of (1 + flat index) name each element's source pixel (0: padding).
        index = tf.constant(1 + np.arange(np.prod(x.shape)).reshape(x.shape), tf.float64)
        source = tf.raw_ops.ExtractImagePatches(images=index, ksizes=args[0], strides=args[1],
                                                rates=args[2], padding=args[3]).numpy()
        flat = np.zeros(int(np.prod(x.shape)), np.float64)
        keep = source > 0
        np.add.at(flat, source[keep].astype(np.int64) - 1,
                  3.0 * want.numpy().astype(np.float64)[keep] ** 2)
        reference = flat.reshape(x.shape)
    # (dtk's rates > 1 are taps in an undilated kernel: no dilated gradient kernel needed)
    np.testing.assert_allclose(tape.gradient(loss_got, x), reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("lengths, inputs, repeat", [
    ((3, 2, 1, 3), (8, 8, 5, 6), False), ((3, 3, 2, 1), (8, 4, 8, 8), True),
    ((3, 3, 3, 3), (5, 8, 4, 8), True)])
def test_ctc_batch_cost_equals_keras(lengths, inputs, repeat):
    """keras.io's OCR page adds Keras's ctc_batch_cost as a loss; DTensor cannot lay out its
    sparse labels and CTCLoss. dtk's forward algorithm gives its values and gradients: with
    short labels, padding past label_length and input_length, repeated labels (a blank
    between them, 4 frames for 3 labels)."""
    rng = np.random.default_rng(3)
    batch, steps, classes, width = 4, 8, 6, 3
    y_pred = tf.nn.softmax(tf.constant(rng.standard_normal((batch, steps, classes)) * 2,
                                       tf.float32))
    labels = rng.integers(0, classes - 1, (batch, width))
    if repeat:
        labels[:, 1] = labels[:, 0]
    y_true = tf.constant(labels, tf.float32)
    input_length = tf.constant(np.array(inputs)[:, None], tf.int64)
    label_length = tf.constant(np.array(lengths)[:, None], tf.int64)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(y_pred)
        want = tf_keras.backend.ctc_batch_cost(y_true, y_pred, input_length, label_length)
        got = op_support.ctc_batch_cost(y_true, y_pred, input_length, label_length)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(tape.gradient(got, y_pred), tape.gradient(want, y_pred),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("size, pool, stride, padding", [
    ((8, 8), 2, 2, "VALID"), ((7, 9), 2, 2, "VALID"), ((8, 8), 3, 2, "SAME"),
    ((7, 7), 3, 1, "SAME"), ((8, 6), 3, 2, "VALID")])
def test_avg_pool_equals_tensorflow(size, pool, stride, padding):
    x = tf.constant(np.random.default_rng(1).standard_normal((2, *size, 3)), tf.float32)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        want = tf.nn.avg_pool2d(x, pool, stride, padding)
        got = op_support.avg_pool(x, (pool, pool), (stride, stride), padding)
        loss_want, loss_got = tf.reduce_sum(want ** 3), tf.reduce_sum(got ** 3)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(tape.gradient(loss_got, x), tape.gradient(loss_want, x),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("size, pool, stride, padding", [
    ((4, 6, 6), 2, 2, "VALID"), ((5, 7, 6), 3, 2, "SAME"), ((4, 5, 5), 3, 1, "VALID")])
def test_avg_pool3d_equals_tensorflow(size, pool, stride, padding):
    x = tf.constant(np.random.default_rng(1).standard_normal((2, *size, 3)), tf.float32)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        want = tf.nn.avg_pool3d(x, pool, stride, padding)
        got = op_support.avg_pool3d(x, (pool,) * 3, (stride,) * 3, padding)
        loss_want, loss_got = tf.reduce_sum(want ** 3), tf.reduce_sum(got ** 3)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(tape.gradient(loss_got, x), tape.gradient(loss_want, x),
                               rtol=1e-5, atol=1e-6)


# -- models ---------------------------------------------------------------------------------------
def mobilenet_blocks():
    """MobileNetV2's inverted residuals (expand, depthwise stride 2, project) and a separable
    convolution, between BatchNormalization and ReLU6, as tf_keras.applications builds them."""
    inputs = tf_keras.Input((12, 12, 3))
    x = L.Conv2D(8, 3, padding="same", use_bias=False)(inputs)
    x = L.ReLU(6.0)(L.BatchNormalization()(x))
    x = L.ReLU(6.0)(L.BatchNormalization()(L.Conv2D(16, 1, use_bias=False)(x)))
    x = L.DepthwiseConv2D(3, strides=2, padding="same", use_bias=False)(x)
    x = L.ReLU(6.0)(L.BatchNormalization()(x))
    x = L.BatchNormalization()(L.Conv2D(8, 1, use_bias=False)(x))
    x = L.Add()([x, L.DepthwiseConv2D(3, padding="same")(x)])
    x = L.SeparableConv2D(8, 3, padding="same")(x)
    return tf_keras.Model(inputs, L.Dense(4)(L.GlobalAveragePooling2D()(x)))


def densenet_blocks():
    """DenseNet's dense block (BN-ReLU-Conv, concatenated) and transition (1x1 conv, 2x2
    average pooling), then an overlapping 'same' average pooling."""
    inputs = tf_keras.Input((12, 12, 3))
    x = L.Conv2D(8, 3, padding="same")(inputs)
    for _ in range(2):
        y = L.Conv2D(4, 3, padding="same")(L.ReLU()(L.BatchNormalization()(x)))
        x = L.Concatenate()([x, y])
    x = L.Conv2D(8, 1)(L.ReLU()(L.BatchNormalization()(x)))
    x = L.AveragePooling2D(2, strides=2)(x)
    x = L.AveragePooling2D(3, strides=1, padding="same")(x)
    return tf_keras.Model(inputs, L.Dense(4)(L.Flatten()(x)))


def lstm_stack():
    inputs = tf_keras.Input((6, 4))
    x = L.LSTM(8, return_sequences=True)(inputs)
    return tf_keras.Model(inputs, L.Dense(4)(L.LSTM(5)(x)))


def gru_stack():
    inputs = tf_keras.Input((6, 4))
    return tf_keras.Model(inputs, L.Dense(4)(L.GRU(6)(L.GRU(8, return_sequences=True)(inputs))))


_ADAPT_DATA = np.random.default_rng(9).random((40, 12, 12, 3)).astype(np.float32) * 4 + 1


def normalization_adapted():
    """``adapt()`` inside the factory, as the Keras guides write it."""
    norm = L.Normalization()
    norm.adapt(_ADAPT_DATA)
    inputs = tf_keras.Input((12, 12, 3))
    return tf_keras.Model(inputs, L.Dense(4)(L.Flatten()(norm(inputs))))


def normalization_given():
    inputs = tf_keras.Input((12, 12, 3))
    x = L.Normalization(mean=[3.0, 2.5, 2.0], variance=[1.5, 1.0, 0.5])(inputs)
    return tf_keras.Model(inputs, L.Dense(4)(L.Flatten()(x)))


MODELS = {"mobilenet": (mobilenet_blocks, (12, 12, 3)), "densenet": (densenet_blocks, (12, 12, 3)),
          "lstm": (lstm_stack, (6, 4)), "gru": (gru_stack, (6, 4)),
          "normalization_adapted": (normalization_adapted, (12, 12, 3)),
          "normalization_given": (normalization_given, (12, 12, 3))}


def _data(shape, steps=3, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.random((steps, B, *shape)) * 4).astype(np.float32)
    return x, rng.integers(0, 4, (steps, B)).astype(np.int64)


def _plain(factory, x, y):
    """One device, plain tf_keras: per-step losses."""
    tf_keras.utils.set_random_seed(2)
    model = factory()
    opt = tf_keras.optimizers.Adam(1e-2)
    loss_fn = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    losses = []
    for xs, ys in zip(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(ys, model(xs, training=True))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
        losses.append(float(loss))
    return np.array(losses)


_FAST_MODELS = {("mobilenet", "batch=4,model=2"), ("gru", "batch=8"),
                ("normalization_adapted", "batch=8")}


@pytest.mark.parametrize("name, spec", [
    pytest.param(n, s, marks=() if (n, s) in _FAST_MODELS else pytest.mark.slow)
    for n in sorted(MODELS) for s in ("batch=8", "batch=4,model=2")])
def test_model_trains_like_one_device(name, spec):
    factory, shape = MODELS[name]
    x, y = _data(shape)
    mesh = dtk.build_mesh(spec)
    model, _ = layouts.build_model(factory, mesh, layouts.load_table("data_parallel"), seed=2,
                                   allow_replicated=True)
    steps = dtk.Steps(model, loss="sparse_categorical_crossentropy",
                      optimizer=tf_keras.optimizers.Adam(1e-2, mesh=mesh), mesh=mesh)
    w = np.ones(B, np.float32)
    losses = [float(steps.train(input_lib.pack(mesh, (xs, ys, w)))) for xs, ys in zip(x, y)]
    np.testing.assert_allclose(losses, _plain(factory, x, y), rtol=1e-5)


def test_build_logs_the_equivalents(caplog):
    mesh = dtk.build_mesh("batch=8")
    with caplog.at_level("INFO", logger="dtk"):
        layouts.build_model(lstm_stack, mesh, "data_parallel", seed=0, allow_replicated=True)
    lines = [r.getMessage() for r in caplog.records if "unrolled" in r.getMessage()]
    assert len(lines) == 1 and "lstm" in lines[0], lines


@pytest.mark.parametrize("factory, words", [
    (lambda: tf_keras.Sequential([tf_keras.Input((None, 4)), L.LSTM(3)]),
     ["'lstm", "static sequence", "fixed"]),
    (lambda: tf_keras.Sequential([tf_keras.Input((None, 6, 6, 1)),
                                  L.ConvLSTM2D(2, 3), L.Flatten(), L.Dense(2)]),
     ["conv_lstm2d", "ConvLSTM2D", "static sequence", "fixed"]),
])
def test_unsupported_layers_refused_before_any_step(factory, words):
    with pytest.raises(ValueError) as err:
        layouts.build_model(factory, dtk.build_mesh("batch=8"), "data_parallel", seed=0,
                            allow_replicated=True)
    for word in words:
        assert word in str(err.value), str(err.value)


def test_step_failure_names_the_op_and_layer_without_unrelated_advice():
    model = mobilenet_blocks()
    message = ("error: 'tf.DepthwiseConv2dNativeBackpropFilter' op does not implement layout "
               "propagation. Please file a feature request")
    line = op_support.explain_failure(message, model)
    assert "DepthwiseConv2dNativeBackpropFilter" in line and "depthwise_conv2d" in line
    assert "restart" not in line and "label" not in line
    assert op_support.explain_failure("some other failure", model) is None


# -- resume and export ----------------------------------------------------------------------------
def _trainer(factory, mesh, tmp_path, *, max_steps):
    return dtk.Trainer(mesh=mesh, model=factory, layout="data_parallel", allow_replicated=True,
                       optimizer=dtk.make_optimizer("adam", mesh, learning_rate=1e-2),
                       metrics=[], config=dtk.TrainerConfig(
                           seed=2, verbose=0, steps_per_execution=1, max_steps=max_steps,
                           checkpoint_dir=str(tmp_path) if tmp_path else None))


def efficientnet_blocks():
    """EfficientNetB0's pieces with its random layers on, as tf_keras.applications builds them:
    an MBConv block (expand, BatchNorm, swish, depthwise, squeeze-and-excitation, project) whose
    residual goes through stochastic depth (Dropout with noise_shape (None, 1, 1, 1)), then the
    top's Dropout before the classifier. (The whole application: one build on batch=4,model=2
    took 7 minutes of CI; its one-step parity runs below.)"""
    inputs = tf_keras.Input((12, 12, 3))
    x = L.Conv2D(8, 3, padding="same", use_bias=False)(inputs)
    x = L.Activation("swish")(L.BatchNormalization()(x))
    h = L.Conv2D(16, 1, use_bias=False)(x)
    h = L.Activation("swish")(L.BatchNormalization()(h))
    h = L.DepthwiseConv2D(3, padding="same", use_bias=False)(h)
    h = L.Activation("swish")(L.BatchNormalization()(h))
    se = L.Reshape((1, 1, 16))(L.GlobalAveragePooling2D()(h))
    se = L.Conv2D(4, 1, activation="swish")(se)
    h = L.multiply([h, L.Conv2D(16, 1, activation="sigmoid")(se)])
    h = L.BatchNormalization()(L.Conv2D(8, 1, use_bias=False)(h))
    h = L.Dropout(0.2, noise_shape=(None, 1, 1, 1))(h)  # stochastic depth
    x = L.add([x, h])
    x = L.Dropout(0.2)(L.GlobalAveragePooling2D()(x))
    return tf_keras.Model(inputs, L.Dense(4)(x))


MODELS["efficientnet_dropout"] = (efficientnet_blocks, (12, 12, 3))


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param("mobilenet", marks=pytest.mark.zoo), "gru",
                                  "normalization_adapted", "efficientnet_dropout"])
def test_resume_and_export_are_exact(tmp_path, name):
    factory, shape = MODELS[name]
    mesh = dtk.build_mesh("batch=4,model=2")
    x, y = _data(shape, steps=4, seed=3)
    data = input_lib.DistributedDataset(
        tf.data.Dataset.from_tensor_slices((x.reshape(-1, *shape), y.reshape(-1))), mesh,
        input_lib.InputConfig(global_batch_size=B))
    whole = _trainer(factory, mesh, None, max_steps=4)
    whole.fit(data, epochs=1)
    _trainer(factory, mesh, tmp_path / "ckpt", max_steps=2).fit(data, epochs=1)
    resumed = _trainer(factory, mesh, tmp_path / "ckpt", max_steps=4)
    resumed.fit(data, epochs=1)
    for got, want in zip(dtk.gather_weights(resumed.model), dtk.gather_weights(whole.model)):
        np.testing.assert_array_equal(got, want)

    paths = resumed.export(str(tmp_path / "export"), formats=["keras"])  # what is read here
    loaded = tf_keras.models.load_model(paths["keras"])
    np.testing.assert_allclose(loaded.predict(x[0], verbose=0), resumed.predict(
        input_lib.DistributedDataset(tf.data.Dataset.from_tensor_slices((x[0], y[0])), mesh,
                                     input_lib.InputConfig(global_batch_size=B))),
        rtol=1e-5, atol=1e-6)


class TwoStatistics(L.Layer):
    """Two non-trainable weights of one shape, created in non-alphabetical order."""

    def build(self, input_shape):
        n = int(input_shape[-1])
        self.zeta = self.add_weight(name="zeta", shape=(n,), trainable=False,
                                    initializer=tf_keras.initializers.Constant(3.0))
        self.kernel = self.add_weight(name="kernel", shape=(n, n))
        self.alpha = self.add_weight(name="alpha", shape=(n,), trainable=False,
                                     initializer=tf_keras.initializers.Constant(-2.0))

    def call(self, x):
        return tf.matmul(x * self.zeta + self.alpha, self.kernel)


def two_statistics():
    return tf_keras.Sequential([tf_keras.Input((5,)), TwoStatistics(name="stats"), L.Dense(3)])


def test_export_maps_weights_by_identity(tmp_path):
    mesh = dtk.build_mesh("batch=8")
    trainer = _trainer(two_statistics, mesh, None, max_steps=None)
    twin = ckpt_lib.plain_copy(trainer.model, two_statistics)
    stats = twin.get_layer("stats")
    np.testing.assert_array_equal(stats.zeta.numpy(), np.full(5, 3.0))
    np.testing.assert_array_equal(stats.alpha.numpy(), np.full(5, -2.0))
    x = np.random.default_rng(0).random((B, 5)).astype(np.float32)
    data = input_lib.DistributedDataset(tf.data.Dataset.from_tensor_slices(
        (x, np.zeros(B, np.int64))), mesh, input_lib.InputConfig(global_batch_size=B))
    paths = trainer.export(str(tmp_path / "export"), formats=["keras"])
    loaded = tf_keras.models.load_model(paths["keras"],
                                        custom_objects={"TwoStatistics": TwoStatistics})
    np.testing.assert_allclose(loaded.predict(x, verbose=0), trainer.predict(data), rtol=1e-6,
                               atol=1e-7)


def test_export_names_the_weight_that_differs():
    mesh = dtk.build_mesh("batch=8")
    trainer = _trainer(two_statistics, mesh, None, max_steps=None)

    def other():
        return tf_keras.Sequential([tf_keras.Input((5,)), TwoStatistics(name="stats"),
                                    L.Dense(4)])
    with pytest.raises(ValueError, match=r"weight 1:Dense[./](kernel|bias): the trained model has "
                                         r"\((5, )?3,?\).*\((5, )?4,?\)"):
        ckpt_lib.plain_copy(trainer.model, other)


# -- the real applications (slow) -----------------------------------------------------------------
def _efficientnet_b0_no_dropout():
    """EfficientNetB0 without its dropout: the plain tf_keras reference draws other masks than
    dtk (dtk's are the same on every mesh, tests/test_randomness.py)."""
    from tf_keras.src.applications import efficientnet  # pylint: disable=g-import-not-at-top
    return efficientnet.EfficientNet(1.0, 1.0, 224, dropout_rate=0.0, drop_connect_rate=0.0,
                                     model_name="efficientnetb0", weights=None,
                                     input_shape=(32, 32, 3), classes=4)


APPLICATIONS = {
    "MobileNetV2": lambda: tf_keras.applications.MobileNetV2(
        input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=4),
    "DenseNet121": lambda: tf_keras.applications.DenseNet121(
        input_shape=(32, 32, 3), weights=None, classes=4),
    "EfficientNetB0": _efficientnet_b0_no_dropout,
}


# The real applications take 45-265 s each (DTensor compiles hundreds of layers): slow and zoo
# marks, so outside the fast lane; CI runs them (BUILD.md, "Test budget"). Their pieces (inverted
# residual and dense blocks, average-pooling transitions, depthwise convolutions, BatchNorm) are
# in the fast lane above.
@pytest.mark.slow
@pytest.mark.zoo
# On 4 of the 8 devices: the step's compile grows with the devices it is instantiated on
# (DenseNet121: 26.9 s on 2, 44.5 s on 8), and the SPMD program is the same.
@pytest.mark.parametrize("name, spec", [("EfficientNetB0", "batch=4"), ("MobileNetV2", "batch=4"),
                                        ("DenseNet121", "batch=2,model=2")])
def test_application_step_equals_one_device(name, spec):
    """One SGD step of the real application on ``spec`` equals plain tf_keras on one device
    (BatchNormalization unfused there too, as dtk runs it): the loss to 1e-5, the whole update
    (the gradient) within 4x one device's own float32 error (measured against float64). Longer
    horizons drift for an honest reason (BUILD.md, 'Models users
    bring'): BatchNormalization's batch statistics are summed in another order on 8 devices, and
    50 of them in a row amplify the last bits, step after step."""
    factory = APPLICATIONS[name]
    mesh = dtk.build_mesh(spec)
    model, _ = layouts.build_model(factory, mesh, "data_parallel", seed=2, allow_replicated=True)
    steps = dtk.Steps(model, loss=tf_keras.losses.SparseCategoricalCrossentropy(),
                      optimizer=tf_keras.optimizers.SGD(0.01, mesh=mesh), mesh=mesh)
    rng = np.random.default_rng(4)
    x = (rng.random((B, 32, 32, 3)) * 255).astype(np.float32)
    y = rng.integers(0, 4, B).astype(np.int64)
    loss = float(steps.train(input_lib.pack(mesh, (x, y, np.ones(B, np.float32)))))

    tf_keras.utils.set_random_seed(2)
    plain = factory()
    for layer in plain.layers:
        if isinstance(layer, L.BatchNormalization):
            layer.fused = False
    initial = {key: w.numpy() for key, w in ckpt_lib._weights_by_identity(plain).items()}  # pylint: disable=protected-access
    opt = tf_keras.optimizers.SGD(0.01)  # (Adam would turn rounding in near-zero gradients
    with tf.GradientTape() as tape:      # into lr-sized steps: SGD compares the gradients)
        want = tf_keras.losses.SparseCategoricalCrossentropy()(y, plain(x, training=True))
    opt.apply_gradients(zip(tape.gradient(want, plain.trainable_variables),
                            plain.trainable_variables))
    np.testing.assert_allclose(loss, float(want), rtol=1e-5)
    exact = _float64_update(factory, initial, x, y)
    got = ckpt_lib._weights_by_identity(model)  # pylint: disable=protected-access
    moved, wanted, exact_moved = [], [], []
    for key, weight in ckpt_lib._weights_by_identity(plain).items():  # pylint: disable=protected-access
        moved.append((dtk.global_value(got[key]) - initial[key]).ravel())
        wanted.append((weight.numpy() - initial[key]).ravel())
        exact_moved.append(exact[key].ravel())
    # The whole update (the gradient, times the rate) against one device's: the difference is at
    # most a small multiple of one device's own float32 error (its distance from the same step in
    # float64), the spread that summation order alone gives. Measured: BUILD.md, "Tolerances".
    moved, wanted = np.concatenate(moved), np.concatenate(wanted)
    spread = np.linalg.norm(wanted - np.concatenate(exact_moved))
    assert np.linalg.norm(moved - wanted) <= 4 * spread, (np.linalg.norm(moved - wanted), spread)


def _plain_in(factory, floatx: str) -> tf_keras.Model:
    """The plain tf_keras model built in ``floatx``, BatchNormalization unfused (as dtk runs it)."""
    tf_keras.backend.set_floatx(floatx)
    try:
        model = factory()
    finally:
        tf_keras.backend.set_floatx("float32")
    for layer in model.layers:
        if isinstance(layer, L.BatchNormalization):
            layer.fused = False
    return model


def _float64_update(factory, initial, x, y):
    """One device's SGD step in float64 from the same float32 initial weights: the update by
    weight key (the exact step, against which float32's own error is measured)."""
    model = _plain_in(factory, "float64")
    weights = ckpt_lib._weights_by_identity(model)  # pylint: disable=protected-access
    for key, weight in weights.items():
        weight.assign(initial[key].astype(np.float64))
    with tf.GradientTape() as tape:
        loss = tf_keras.losses.SparseCategoricalCrossentropy()(
            y, model(tf.constant(x, tf.float64), training=True))
    tf_keras.optimizers.SGD(0.01).apply_gradients(
        zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return {key: weight.numpy() - initial[key] for key, weight in weights.items()}



def _efficientnet_half(dropout: float):
    """tf_keras's EfficientNet at half width and depth (10 blocks of B0's 16, the same kinds:
    depthwise convolutions, squeeze-excitation, BatchNormalization, stochastic depth): the resume
    test's application, at about half B0's build and trace time."""
    from tf_keras.src.applications import efficientnet  # pylint: disable=g-import-not-at-top
    return efficientnet.EfficientNet(0.5, 0.5, 224, dropout_rate=dropout,
                                     drop_connect_rate=dropout, model_name="efficientnet_half",
                                     weights=None, input_shape=(32, 32, 3), classes=4)


# The application resumed onto another mesh (with its dropout and stochastic depth), and its twin
# without random layers for one device's float32 spread. DenseNet121 (no random layer) is held to
# one device directly on batch=2,model=2 in test_application_step_equals_one_device, and
# EfficientNetB0 itself there on batch=4; a second application here took 309 s of CI for the same
# resume, B0 itself 145-178 s (BUILD.md, "Test budget").
RESUMED_APPLICATION = (lambda: _efficientnet_half(0.2), lambda: _efficientnet_half(0.0))
LR = 0.05


def _one_device_step(factory, start: dict[str, np.ndarray], x, y):
    """Plain tf_keras's SGD step on one device from ``start`` (weights by name), in float32 and
    float64: ``(update in float32 by name, |float32 - float64|)``, the second being the spread
    that summation order alone gives this step (BatchNormalization unfused, as dtk runs it)."""
    updates = {}
    for floatx in ("float32", "float64"):
        model = _plain_in(factory, floatx)
        weights = _by_name(model.weights)
        assert set(weights) <= set(start), sorted(set(weights) - set(start))[:5]
        for name, w in weights.items():
            w.assign(start[name].astype(floatx))
        with tf.GradientTape() as tape:
            loss = tf_keras.losses.SparseCategoricalCrossentropy()(
                y, model(tf.constant(x, floatx), training=True))
        tf_keras.optimizers.SGD(LR).apply_gradients(
            zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        updates[floatx] = {name: w.numpy() - start[name] for name, w in weights.items()}
    spread = np.linalg.norm(np.concatenate([(updates["float32"][n] - updates["float64"][n]).ravel()
                                            for n in updates["float32"]]))
    return updates["float32"], spread


def _by_name(items) -> dict:
    """``{name: item}`` for weights (or ``(weight, value)`` pairs), their layer's name without the
    ``_<n>`` that tf_keras appends to an unnamed layer's name in a second build of a process
    (``normalization_1/mean:0`` is ``normalization/mean:0``)."""
    out = {}
    for item in items:
        weight = item[0] if isinstance(item, tuple) else item
        name = re.sub(r"^([^/]*?)_\d+/", r"\1/", weight.name)
        assert name not in out, f"two weights named {name}"
        out[name] = item[1] if isinstance(item, tuple) else item
    return out


def _distance(a: dict, b: dict) -> float:
    return float(np.linalg.norm(np.concatenate([(a[n] - b[n]).ravel() for n in b])))


@pytest.mark.slow
@pytest.mark.zoo
def test_application_resumes_onto_another_mesh_and_exports(tmp_path, monkeypatch):
    """EfficientNet (half B0), with its dropout and stochastic depth on, trains step 1 on
    ``batch=2,model=2``; its checkpoint resumes on ``batch=4`` in a fresh build, bit-identical,
    and step 2 there equals the uninterrupted run's step 2 within 4x one device's own float32
    error of that step (float32 against float64: the spread summation order alone gives,
    measured on its twin without random layers; the masks are the same on every mesh). The
    resumed model exports to plain tf_keras with equal predictions.

    Measured: BUILD.md, "Tolerances". Two builds of a few hundred layers each (about 30 s) and
    their traces; the applications' one step against one device is
    ``test_application_step_equals_one_device``."""
    import shutil  # pylint: disable=g-import-not-at-top
    factory, twin = RESUMED_APPLICATION
    name = "EfficientNet_half_dropout"
    rng = np.random.default_rng(5)
    x = (rng.random((B, 32, 32, 3)) * 255).astype(np.float32)
    y = rng.integers(0, 4, B).astype(np.int64)

    def trainer(spec, directory):
        mesh = dtk.build_mesh(spec)
        data = input_lib.DistributedDataset(tf.data.Dataset.from_tensor_slices((x, y)), mesh,
                                            input_lib.InputConfig(global_batch_size=B))
        run = dtk.Trainer(mesh=mesh, model=factory, layout="data_parallel",
                          allow_replicated=True,
                          optimizer=dtk.make_optimizer("sgd", mesh, learning_rate=LR),
                          metrics=[], config=dtk.TrainerConfig(
                              seed=2, verbose=0, steps_per_execution=1, max_steps=2,
                              checkpoint_dir=str(directory)))
        return run, data

    def weights(run):  # by name
        return _by_name(list(zip(run.model.weights, dtk.gather_weights(run.model))))

    after_one = {}

    def keep_step_one(epoch, _):
        if epoch == 0:  # the checkpoint of step 1 is written (fit waits for it before callbacks)
            shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
            after_one.update(weights(whole))

    # (on 4 of the 8 devices: the same programs, a shorter compile; test_application_step_...)
    whole, data = trainer("batch=2,model=2", tmp_path / "whole")
    whole.fit(data, epochs=2, on_epoch_end=[keep_step_one])
    resumed, data8 = trainer("batch=4", tmp_path / "resumed")
    restored = {}  # the weights the resumed run starts from: restored, before its first step
    restore = dtk.CheckpointCallback.on_train_begin

    def restore_and_keep(callback, logs=None):
        restore(callback, logs)
        restored.update(weights(resumed))
    monkeypatch.setattr(dtk.CheckpointCallback, "on_train_begin", restore_and_keep)
    resumed.fit(data8, epochs=2)
    assert resumed.global_step == 2 and len(restored) == len(after_one) > 100
    for key, want in after_one.items():
        np.testing.assert_array_equal(restored[key], want, err_msg=key)

    # Step 2 on batch=4 (resumed) against step 2 on batch=2,model=2 (uninterrupted).
    step_two = {"batch=2,model=2": weights(whole), "batch=4": weights(resumed)}
    plain_two, spread_two = _one_device_step(twin, after_one, x, y)
    step_two = {mesh: {n: w[n] - after_one[n] for n in plain_two} for mesh, w in step_two.items()}
    print(f"{name}: step 2, batch=4 against batch=2,model=2: "
          f"{_distance(step_two['batch=4'], step_two['batch=2,model=2']):.3g}; one device's "
          f"float32 against float64: {spread_two:.3g}; the update's norm "
          f"{_distance(step_two['batch=4'], {n: 0 for n in plain_two}):.3g}")
    assert _distance(step_two["batch=4"], step_two["batch=2,model=2"]) <= 4 * spread_two, (
        _distance(step_two["batch=4"], step_two["batch=2,model=2"]), spread_two)

    # The .keras file only: a SavedModel of a real application takes 37 s to trace and write, and
    # test_trainer.py::test_export_round_trip serves one.
    paths = resumed.export(str(tmp_path / "export"), formats=["keras"])
    loaded = tf_keras.models.load_model(paths["keras"])
    np.testing.assert_allclose(loaded.predict(x, verbose=0), resumed.predict(data8),
                               rtol=1e-5, atol=1e-6)
