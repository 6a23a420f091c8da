"""A user's own Keras code on a ``dtk.distribute`` model (issue 69): each kind of code of the
issue, against plain tf_keras (1e-5), on ``batch=1``, ``batch=8`` and ``batch=4,model=2``.

Custom training loops: keras.io's "Writing a training loop from scratch" with one change, its
batches (``dtk.batches_on_mesh(dataset, model)``); the user's own optimizer and metric objects,
made without ``mesh=`` (one of them before ``dtk.distribute``), bound to the mesh by dtk.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import dtk

MESHES = ["batch=1", "batch=8", "batch=4,model=2"]
TOL = dict(rtol=1e-5, atol=1e-5)


def _layout(spec):
    return "mlp_model_parallel" if "model" in spec else "data_parallel"


def _guide_model():
    inputs = tf_keras.Input(shape=(20,), name="digits")
    x = tf_keras.layers.Dense(64, activation="relu", name="dense_1")(inputs)
    x = tf_keras.layers.Dense(64, activation="relu", name="dense_2")(x)
    outputs = tf_keras.layers.Dense(10, name="predictions")(x)
    return tf_keras.Model(inputs=inputs, outputs=outputs)


def _guide_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 20)).astype("float32")
    y = rng.integers(0, 10, 200)
    val = rng.normal(size=(72, 20)).astype("float32"), rng.integers(0, 10, 72)
    return x, y, val


def _guide_loop(model, batches, val_metric):
    """The guide's loop: its first epoch eager, its second with the ``tf.function`` steps; the
    validation loop after each. ``batches`` is the one line dtk changes (identity for plain
    Keras). Returns every loss and metric value, and the weights."""
    x, y, (xv, yv) = _guide_data()
    optimizer = tf_keras.optimizers.Adam(learning_rate=1e-3)
    loss_fn = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    train_acc_metric = tf_keras.metrics.SparseCategoricalAccuracy()
    train_dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)  # 200 = 3 x 64 + 8
    val_dataset = tf.data.Dataset.from_tensor_slices((xv, yv)).batch(32)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss_value = loss_fn(y, logits)
        grads = tape.gradient(loss_value, model.trainable_weights)
        optimizer.apply_gradients(zip(grads, model.trainable_weights))
        train_acc_metric.update_state(y, logits)
        return loss_value

    @tf.function
    def validation_step(x, y):  # (the guide's test_step)
        val_metric.update_state(y, model(x, training=False))

    logged = []
    for epoch in range(2):
        for x_batch, y_batch in batches(train_dataset):
            if epoch == 0:  # the guide's eager loop
                with tf.GradientTape() as tape:
                    logits = model(x_batch, training=True)
                    loss_value = loss_fn(y_batch, logits)
                grads = tape.gradient(loss_value, model.trainable_weights)
                optimizer.apply_gradients(zip(grads, model.trainable_weights))
                train_acc_metric.update_state(y_batch, logits)
            else:
                loss_value = train_step(x_batch, y_batch)
            logged.append(float(loss_value))
        logged.append(float(train_acc_metric.result()))
        train_acc_metric.reset_state()
        for x_batch, y_batch in batches(val_dataset):
            validation_step(x_batch, y_batch)
        logged.append(float(val_metric.result()))
        val_metric.reset_state()
    return np.array(logged), [w.numpy() for w in model.trainable_weights]


@pytest.mark.parametrize("spec", MESHES)
def test_the_guides_custom_loop_runs_with_one_change_and_keras_numbers(spec):
    tf_keras.utils.set_random_seed(0)
    want, want_weights = _guide_loop(_guide_model(), lambda d: d,
                                     tf_keras.metrics.SparseCategoricalAccuracy())
    # A metric made before dtk.distribute, as well as the loop's own made after it.
    val_metric = tf_keras.metrics.SparseCategoricalAccuracy()
    mesh = dtk.build_mesh(spec)
    model = dtk.distribute(_guide_model, mesh, layout=_layout(spec), seed=0,
                           allow_replicated=True)
    got, got_weights = _guide_loop(model, lambda d: dtk.batches_on_mesh(d, model), val_metric)
    np.testing.assert_allclose(got, want, **TOL)
    assert 0 < want[4] < 1 and want[4] != want[-1]  # accuracies, and they moved
    for w, v in zip(want_weights, dtk.gather_weights(model)):
        np.testing.assert_allclose(v, w, **TOL)


def test_a_metric_counts_each_example_once_eagerly_and_traced():
    """The issue's reproduction: 0.0508 (a count 8x the batch) before; Keras's 0.406 now."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(32, 4)).astype("float32")
    y = rng.integers(0, 3, size=(32,))

    def factory():
        return tf_keras.Sequential([tf_keras.Input((4,)), tf_keras.layers.Dense(3)])

    tf_keras.utils.set_random_seed(0)
    plain = tf_keras.metrics.SparseCategoricalAccuracy()
    plain.update_state(y, factory()(x))
    mesh = dtk.build_mesh("batch=8")
    model = dtk.distribute(factory, mesh, seed=0)
    traced, eager = (tf_keras.metrics.SparseCategoricalAccuracy() for _ in range(2))

    @tf.function
    def validation_step(x, y):  # (the guide's test_step)
        traced.update_state(y, model(x, training=False))

    xs, ys = dtk.pack(mesh, (x, y))
    validation_step(xs, ys)
    eager.update_state(ys, model(xs))
    assert 0 < float(plain.result()) < 1
    assert float(traced.result()) == float(eager.result()) == float(plain.result())


def test_host_tensors_into_a_function_on_the_mesh_get_dtks_fix():
    mesh = dtk.build_mesh("batch=8")
    model = dtk.distribute(lambda: tf_keras.Sequential([tf_keras.Input((4,)),
                                                        tf_keras.layers.Dense(3)]), mesh)

    @tf.function
    def predict(x):
        return model(x, training=False)

    with pytest.raises(ValueError, match=r"tf.function 'predict' was given a host tensor "
                       r"\(input 0, shape \[32,4\]\).*dtk.batches_on_mesh\(dataset, model\)"):
        predict(np.zeros((32, 4), np.float32))
    # Eagerly, the laid-out model takes host values (replicated).
    assert model(np.zeros((32, 4), np.float32)).shape == (32, 3)


def test_an_optimizer_that_stepped_off_the_mesh_is_refused_and_a_new_one_bound():
    mesh = dtk.build_mesh("batch=8")
    model = dtk.distribute(lambda: tf_keras.Sequential([tf_keras.Input((4,)),
                                                        tf_keras.layers.Dense(3)]), mesh)
    used = tf_keras.optimizers.SGD(0.1)
    used.apply_gradients([(tf.constant(1.0), tf.Variable(1.0))])  # one step, off the mesh
    fresh = tf_keras.optimizers.SGD(0.1)
    x = dtk.pack(mesh, np.ones((8, 4), np.float32))

    @tf.function
    def step(optimizer):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(x, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_weights),
                                      model.trainable_weights))

    with pytest.raises(ValueError, match=r"optimizer 'SGD' \(SGD\) .* taken 1 step\(s\) off "
                       "the mesh.*make a new one"):
        step(used)
    before = dtk.gather_weights(model)[1]
    step(fresh)
    assert fresh._mesh == mesh and int(fresh.iterations.numpy()) == 1
    assert not np.allclose(dtk.gather_weights(model)[1], before)


@pytest.mark.parametrize("on, message", [
    ("not a model", r"on must be a model made by dtk.distribute or a dtensor.Mesh"),
    (None, r"no mesh to lay the batches out on: pass the dtk.distribute model"),
])
def test_batches_on_mesh_bad_targets(on, message):
    with pytest.raises(ValueError, match=message):
        dtk.batches_on_mesh([np.zeros((8, 4))], on)


# --- Tensors made when the model is built and used in a step -------------------------------

class _OrthogonalRegularizer(tf_keras.regularizers.Regularizer):
    """keras.io's PointNet: ``tf.eye`` made once, on the host, used in every step."""

    def __init__(self, num_features, l2reg=0.001):
        self.num_features, self.l2reg = num_features, l2reg
        self.eye = tf.eye(num_features)

    def __call__(self, x):
        x = tf.reshape(x, (-1, self.num_features, self.num_features))
        xxt = tf.tensordot(x, x, axes=(2, 2))
        xxt = tf.reshape(xxt, (-1, self.num_features, self.num_features))
        return tf.reduce_sum(self.l2reg * tf.square(xxt - self.eye))


class _ScaledBy(tf_keras.layers.Layer):
    """A layer that keeps a numpy array and a host tensor and uses both in ``call``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.scale = tf.constant(np.linspace(0.5, 1.5, 16, dtype=np.float32))
        self.shift = np.full((16,), 0.1, np.float32)

    def call(self, x):
        return x * self.scale + self.shift


def _captures_model():
    return tf_keras.Sequential([
        tf_keras.Input((12,)),
        tf_keras.layers.Dense(16, activity_regularizer=_OrthogonalRegularizer(4), name="d1"),
        _ScaledBy(name="scaled"),
        tf_keras.layers.Dense(2, name="d2")])


@pytest.mark.parametrize("spec", MESHES)
def test_host_constants_captured_by_a_regularizer_and_a_layer_reach_the_step_on_the_mesh(spec):
    """The first step failed on every mesh: "got a regular tensor for input 5 (shape [3,3])"."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(72, 12)).astype("float32")  # 72 = 4 x 16 + 8: a last partial batch
    y = rng.integers(0, 2, 72)

    def run(model):
        model.compile("adam", tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
        return history.history["loss"], model.evaluate(x, y, batch_size=24, verbose=0)

    tf_keras.utils.set_random_seed(0)
    want = run(_captures_model())
    model = dtk.distribute(_captures_model, dtk.build_mesh(spec), layout=_layout(spec), seed=0,
                           allow_replicated=True)
    got = run(model)
    assert want[0][1] < want[0][0]  # it trained: the comparison is not of two idle models
    np.testing.assert_allclose(got[0], want[0], **TOL)
    np.testing.assert_allclose(got[1], want[1], **TOL)


# --- Stateful random ops in a user's layer ---------------------------------------------------

class _CustomDropout(tf_keras.layers.Layer):
    """keras.io's subclassing guide: ``tf.nn.dropout`` in ``call``."""

    def __init__(self, rate, **kwargs):
        super().__init__(**kwargs)
        self.rate = rate

    def call(self, inputs, training=None):
        if training:
            return tf.nn.dropout(inputs, rate=self.rate)
        return inputs


class _Jitter(tf_keras.layers.Layer):
    """``tf.random.normal`` in ``call``, and a draw DTensor cannot run."""

    def __init__(self, categorical=False, **kwargs):
        super().__init__(**kwargs)
        self.categorical = categorical

    def call(self, inputs, training=None):
        if not training:
            return inputs
        if self.categorical:
            logits = tf.zeros([tf.shape(inputs)[0], 3])
            return inputs + tf.cast(tf.random.categorical(logits, 1), inputs.dtype)
        return inputs + 0.1 * tf.random.normal(tf.shape(inputs))


def _random_model(categorical=False):
    return tf_keras.Sequential([
        tf_keras.Input((12,)), tf_keras.layers.Dense(16, name="d1"),
        _CustomDropout(0.5, name="my_dropout"), _Jitter(categorical, name="jitter"),
        tf_keras.layers.Dense(2, name="d2")])


def _fit_random(spec, factory):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 12)).astype("float32")
    y = rng.integers(0, 2, 64)
    model = dtk.distribute(factory, dtk.build_mesh(spec), layout=_layout(spec), seed=0,
                           allow_replicated=True)
    model.compile("adam", tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model.fit(x, y, batch_size=16, epochs=2, verbose=0).history["loss"]


def test_tf_nn_dropout_and_tf_random_in_a_layer_draw_the_same_on_every_mesh():
    """DTensor's "Stateful random operations are not supported" before; dtk's draws now."""
    want = _fit_random("batch=1", _random_model)
    assert len(want) == 2 and np.isfinite(want).all()
    for spec in MESHES[1:]:
        np.testing.assert_allclose(_fit_random(spec, _random_model), want, **TOL)


def test_a_random_op_dtensor_cannot_run_is_refused_with_its_layer():
    with pytest.raises(ValueError, match=r"random op\(s\) Multinomial in op scope "
                       r"'[^']*jitter[^']*'.*Keras's random layers, on tf_keras .*"
                       r"tf.nn.dropout, on Keras 3 with keras.random"):
        _fit_random("batch=8", lambda: _random_model(categorical=True))


# --- Ops whose gradient breaks on a sharded batch -------------------------------------------

class _Router(tf_keras.layers.Layer):
    """A Switch Transformer's router: the top-2 experts' probabilities scale the features."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.gate = tf_keras.layers.Dense(4, name="gate")

    def call(self, x):
        top = tf.math.top_k(tf.nn.softmax(self.gate(x)), k=2)
        chosen = tf.cast(top.indices[:, :1], x.dtype)
        return x * top.values[:, :1] + 0.5 * x * top.values[:, 1:] + chosen


def _router_model():
    return tf_keras.Sequential([tf_keras.Input((12,)), tf_keras.layers.Dense(16, name="d1"),
                                _Router(name="router"), tf_keras.layers.Dense(2, name="d2")])


@pytest.mark.parametrize("spec", MESHES)
def test_top_k_in_a_router_trains_on_a_sharded_batch(spec):
    """``tf.math.top_k``'s gradient on ``batch=8``: "ScatterNd: indices[15] = [63] does not
    index into shape [8]" before."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 12)).astype("float32")
    y = rng.integers(0, 2, 64)

    def run(model):
        model.compile("adam", tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model.fit(x, y, batch_size=16, epochs=2, verbose=0).history["loss"]

    tf_keras.utils.set_random_seed(0)
    want = run(_router_model())
    assert want[1] < want[0]
    got = run(dtk.distribute(_router_model, dtk.build_mesh(spec), layout=_layout(spec), seed=0,
                             allow_replicated=True))
    np.testing.assert_allclose(got, want, **TOL)


# --- Subclassed models, built the ways keras.io builds them -----------------------------------

class _HoldsSequential(tf_keras.Model):
    """An unbuilt ``keras.Sequential`` inside (no input shape): built by dtk's call."""

    def __init__(self):
        super().__init__()
        self.body = tf_keras.Sequential([tf_keras.layers.Dense(16, activation="relu"),
                                         tf_keras.layers.Dense(8)])
        self.head = tf_keras.layers.Dense(2)

    def call(self, x):
        return self.head(self.body(x))


class _Tokens(tf_keras.Model):
    """Integer inputs, an Embedding and a BatchNormalization."""

    def __init__(self):
        super().__init__()
        self.embed = tf_keras.layers.Embedding(50, 8)
        self.norm = tf_keras.layers.BatchNormalization()
        self.head = tf_keras.layers.Dense(2)

    def call(self, x):
        return self.head(tf.reduce_mean(self.norm(self.embed(x)), 1))


class _TwoInputs(tf_keras.Model):
    """Dict inputs of two dtypes."""

    def __init__(self):
        super().__init__()
        self.a = tf_keras.layers.Dense(8)
        self.head = tf_keras.layers.Dense(2)

    def call(self, inputs):
        return self.head(self.a(inputs["a"]) + tf.cast(inputs["b"], tf.float32))


def _called(cls, example):
    def factory():
        model = cls()
        model(example)  # built by a call on a batch, in the factory
        return model
    return factory


def _built(cls, shape):
    def factory():
        model = cls()
        model.build(shape)
        return model
    return factory


_RNG = np.random.default_rng(0)
SUBCLASSED = {
    "holds_unbuilt_sequential": (_HoldsSequential, {"input_shape": (12,)},
                                 _RNG.normal(size=(32, 12)).astype("float32")),
    "called_on_int_batch": (_called(_Tokens, tf.zeros((1, 10), tf.int32)), {},
                            _RNG.integers(0, 50, (32, 10))),
    "build_input_shape": (_built(_Tokens, (None, 10)), {}, _RNG.integers(0, 50, (32, 10))),
    "input_shape_and_dtype": (_Tokens, {"input_shape": (10,), "input_dtype": "int32"},
                              _RNG.integers(0, 50, (32, 10))),
    "called_on_dict_batch": (_called(_TwoInputs, {"a": tf.zeros((1, 12)),
                                                  "b": tf.zeros((1, 8), tf.int32)}), {},
                             {"a": _RNG.normal(size=(32, 12)).astype("float32"),
                              "b": _RNG.integers(0, 3, (32, 8)).astype("int32")}),
}


@pytest.mark.parametrize("spec", MESHES)
@pytest.mark.parametrize("case", sorted(SUBCLASSED))
def test_subclassed_models_built_as_keras_io_builds_them(case, spec):
    """Before: "Weights for model 'sequential' have not yet been created"; a model the factory
    built by a call was called again on float32 ``(None,) + shape``."""
    factory, kwargs, x = SUBCLASSED[case]
    y = np.random.default_rng(1).integers(0, 2, 32)

    def run(model):
        model.compile("adam", tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model.fit(x, y, batch_size=16, epochs=2, verbose=0).history["loss"]

    tf_keras.utils.set_random_seed(0)
    want = run(factory())
    assert want[1] < want[0]
    got = run(dtk.distribute(factory, dtk.build_mesh(spec), seed=0, allow_replicated=True,
                             **kwargs))
    np.testing.assert_allclose(got, want, **TOL)


# --- A trained model's layers in a second dtk.distribute ------------------------------------

def _encoder():
    return tf_keras.Sequential([tf_keras.Input((16, 16, 3)),
                                tf_keras.layers.RandomFlip("horizontal"),
                                tf_keras.layers.Conv2D(4, 3), tf_keras.layers.GlobalAveragePooling2D()],
                               name="encoder")


def test_a_trained_encoder_under_a_new_head_is_refused_with_the_way_to_reuse_its_weights():
    """Two-stage training: the laid-out encoder itself is refused (naming it, not its
    RandomFlip's shape check); built anew with the trained weights copied in, it trains."""
    mesh = dtk.build_mesh("batch=8")
    first = dtk.distribute(lambda: tf_keras.Sequential([_encoder(), tf_keras.layers.Dense(2)]),
                           mesh, input_shape=(16, 16, 3))
    first.compile("adam", tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).normal(size=(32, 16, 16, 3)).astype("float32")
    first.fit(x, np.arange(32) % 2, batch_size=16, verbose=0)
    trained = first.get_layer("encoder")
    with pytest.raises(ValueError, match=r"model_factory uses layer 'encoder' \(Sequential\) of "
                       r"model '\w+', which dtk already laid out.*new_layer.set_weights\("
                       r"dtk.gather_weights\(trained_layer\)\)"):
        dtk.distribute(lambda: tf_keras.Sequential([trained, tf_keras.layers.Dense(3)]), mesh,
                       input_shape=(16, 16, 3))
    weights = dtk.gather_weights(trained)

    def second():
        encoder = _encoder()
        encoder.set_weights(weights)
        encoder.trainable = False
        return tf_keras.Sequential([encoder, tf_keras.layers.Dense(3)])

    model = dtk.distribute(second, mesh, input_shape=(16, 16, 3))
    assert len(weights) == len(model.get_layer("encoder").weights) == 2  # the Conv2D's
    for want, got in zip(weights, dtk.gather_weights(model.get_layer("encoder"))):
        np.testing.assert_array_equal(got, want)
    model.compile("adam", tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, np.arange(32) % 3, batch_size=16, verbose=0)
    for want, got in zip(weights, dtk.gather_weights(model.get_layer("encoder"))):
        np.testing.assert_array_equal(got, want)  # frozen: still the trained weights


# --- Exact resume with fit's default shuffle=True --------------------------------------------

def test_checkpoint_callback_resumes_a_shuffled_fit_bit_for_bit(tmp_path):
    """Keras draws each epoch's order from a stateful op that a new run starts again; under
    dtk.CheckpointCallback a resumed fit draws past the epochs trained, so 2 epochs, then the same
    fit again to 4, equal 4 epochs uninterrupted (weights bit for bit), and the shuffles are
    real (another order than shuffle=False)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 12)).astype("float32")
    y = rng.integers(0, 2, 96)
    mesh = dtk.build_mesh("batch=8")

    def run(directory, epochs, **fit_kwargs):
        model = dtk.distribute(lambda: tf_keras.Sequential([
            tf_keras.Input((12,)), tf_keras.layers.Dense(16, activation="relu"),
            tf_keras.layers.Dense(2)]), mesh, seed=3)
        model.compile(tf_keras.optimizers.Adam(1e-2),
                      tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=16, epochs=epochs, verbose=0,
                  callbacks=[dtk.CheckpointCallback(str(directory))], **fit_kwargs)
        return dtk.gather_weights(model)

    whole = run(tmp_path / "whole", 4)
    run(tmp_path / "resumed", 2)
    resumed = run(tmp_path / "resumed", 4)
    for a, b in zip(whole, resumed):
        np.testing.assert_array_equal(b, a)
    unshuffled = run(tmp_path / "unshuffled", 4, shuffle=False)
    assert not np.array_equal(unshuffled[0], whole[0])
    # and a run from the start shuffles as plain tf_keras does (the orders are Keras's own)
    tf_keras.utils.set_random_seed(3)
    plain = tf_keras.Sequential([tf_keras.Input((12,)), tf_keras.layers.Dense(16, activation="relu"),
                                 tf_keras.layers.Dense(2)])
    plain.compile(tf_keras.optimizers.Adam(1e-2),
                  tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    plain.fit(x, y, batch_size=16, epochs=4, verbose=0)
    for a, b in zip(plain.get_weights(), whole):
        np.testing.assert_allclose(b, a, **TOL)


# --- String and lookup preprocessing layers in the model --------------------------------------

_WORDS = np.array(["red", "green", "blue", "cyan"])


def _string_lookup():
    lookup = tf_keras.layers.StringLookup(output_mode="one_hot")
    lookup.adapt(_WORDS)  # adapted in the factory, as keras.io does
    return tf_keras.Sequential([tf_keras.Input((1,), dtype="string"), lookup,
                                tf_keras.layers.Dense(4, name="d1"), tf_keras.layers.Dense(2, name="d2")])


def _integer_lookup():
    lookup = tf_keras.layers.IntegerLookup(output_mode="one_hot")
    lookup.adapt(np.arange(6))
    return tf_keras.Sequential([tf_keras.Input((1,), dtype="int64"), lookup,
                                tf_keras.layers.Dense(4, name="d1"), tf_keras.layers.Dense(2, name="d2")])


def _hashing():
    return tf_keras.Sequential([tf_keras.Input((1,), dtype="int64"),
                                tf_keras.layers.Hashing(8, output_mode="one_hot"),
                                tf_keras.layers.Dense(4, name="d1"), tf_keras.layers.Dense(2, name="d2")])


def _text_vectorization():
    vectorize = tf_keras.layers.TextVectorization(max_tokens=10, output_sequence_length=4)
    vectorize.adapt(["red green", "blue cyan red", "Green BLUE"])
    return tf_keras.Sequential([tf_keras.Input((1,), dtype="string"), vectorize,
                                tf_keras.layers.Embedding(10, 4),
                                tf_keras.layers.GlobalAveragePooling1D(),
                                tf_keras.layers.Dense(4, name="d1"),
                                tf_keras.layers.Dense(2, name="d2")])


def _normalization():
    normalize = tf_keras.layers.Normalization()
    normalize.adapt(np.random.default_rng(1).normal(3.0, 2.0, (64, 3)))
    return tf_keras.Sequential([tf_keras.Input((3,)), normalize,
                                tf_keras.layers.Dense(4, name="d1"), tf_keras.layers.Dense(2, name="d2")])


def _discretization():
    bins = tf_keras.layers.Discretization(num_bins=4, output_mode="one_hot")
    bins.adapt(np.random.default_rng(1).normal(3.0, 2.0, (64, 1)))
    return tf_keras.Sequential([tf_keras.Input((1,)), bins,
                                tf_keras.layers.Dense(4, name="d1"), tf_keras.layers.Dense(2, name="d2")])


PREPROCESSING = {"StringLookup": (_string_lookup, "words"), "IntegerLookup": (_integer_lookup, "ints"),
                 "Hashing": (_hashing, "ints"), "TextVectorization": (_text_vectorization, "text"),
                 "Normalization": (_normalization, "floats"),
                 "Discretization": (_discretization, "float")}


@pytest.mark.parametrize("spec", MESHES)
@pytest.mark.parametrize("case", sorted(PREPROCESSING))
def test_preprocessing_layers_adapted_in_the_factory_train_with_keras_numbers(case, spec):
    """StringLookup adapted in the factory failed ("you must set the layer's vocabulary");
    TextVectorization failed at the first step on 'tf.StringLower'. The string and lookup layers
    run on the host now, on the raw inputs fit/evaluate/predict and an eager call take;
    Normalization and Discretization, adapted in the factory too, run in the step."""
    factory, kind = PREPROCESSING[case]
    rng = np.random.default_rng(0)
    x = {"words": _WORDS[rng.integers(0, 4, (72, 1))],
         "ints": rng.integers(0, 6, (72, 1)),
         "text": np.array([[" ".join(_WORDS[rng.integers(0, 4, 3)])] for _ in range(72)]),
         "floats": rng.normal(3.0, 2.0, (72, 3)).astype("float32"),
         "float": rng.normal(3.0, 2.0, (72, 1)).astype("float32")}[kind]
    y = rng.integers(0, 2, 72)

    def run(model):
        model.compile("adam", tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        history = model.fit(x, y, batch_size=16, epochs=2, verbose=0).history["loss"]
        return (history, model.evaluate(x, y, batch_size=24, verbose=0),
                model.predict(x, batch_size=24, verbose=0), np.asarray(model(x[:5])))

    tf_keras.utils.set_random_seed(0)
    want = run(factory())
    assert want[0][1] < want[0][0] and want[2].shape == (72, 2)
    got = run(dtk.distribute(factory, dtk.build_mesh(spec), layout=_layout(spec), seed=0,
                             allow_replicated=True))
    for a, b in zip(want, got):
        np.testing.assert_allclose(b, a, **TOL)


class _PickFirstColumn(tf_keras.layers.Layer):
    """``tf.gather_nd`` with ``[row, 0]`` pairs over the whole batch."""

    def call(self, h):
        rows = tf.range(tf.shape(h)[0])
        picked = tf.gather_nd(h, tf.stack([rows, tf.zeros_like(rows)], 1))
        return picked[:, None] * h


def test_indices_into_the_whole_batch_are_refused_with_the_per_example_form():
    """DTensor gathers within each device's rows: "indices[15] = [15, 0] does not index into
    shape [2,16]" (a raw InvalidArgumentError) before."""
    with pytest.raises(ValueError, match=r"(GatherNd|ScatterNd) in op scope '[^']*pick' indexed past a "
                       r"device's rows \(indices\[\d+\] = \[\d+, 0\] does not index into "
                       r"shape \[2,16\]\).*tf.gather_nd\(..., batch_dims=1\)"):
        _fit_random("batch=8", lambda: tf_keras.Sequential([
            tf_keras.Input((12,)), tf_keras.layers.Dense(16, name="d1"),
            _PickFirstColumn(name="pick"), tf_keras.layers.Dense(2, name="d2")]))


# --- The ops users call (BUILD.md, "Your own Keras code": the scan and its table) ------------
from tests.user_ops import OPS  # noqa: E402  (shared with tests/test_keras3.py)


class _Op(tf_keras.layers.Layer):
    def __init__(self, op, **kwargs):
        super().__init__(**kwargs)
        self.op = op

    def call(self, h):
        return OPS[self.op](h)


@pytest.mark.parametrize("op", sorted(OPS))
def test_the_ops_users_call_train_on_the_sharded_meshes(op):
    """Each op between two Dense layers (the first sharded over ``model`` on
    ``batch=4,model=2``), gradient included, against plain tf_keras; ``tf.one_hot`` failed on
    batch=4,model=2 ("non-broadcastable operands") and ``top_k``'s gradient on batch=8."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 12)).astype("float32")
    y = rng.integers(0, 2, 64)

    def factory():
        return tf_keras.Sequential([tf_keras.Input((12,)), tf_keras.layers.Dense(16, name="d1"),
                                    _Op(op, name="op"), tf_keras.layers.Flatten(),
                                    tf_keras.layers.Dense(2, name="out")])

    def run(model):
        model.compile(tf_keras.optimizers.SGD(0.1),
                      tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False).history["loss"]

    tf_keras.utils.set_random_seed(0)
    want = run(factory())
    assert want[1] < want[0]
    for spec in MESHES[1:]:
        got = run(dtk.distribute(factory, dtk.build_mesh(spec), layout=_layout(spec), seed=0,
                                 allow_replicated=True))
        np.testing.assert_allclose(got, want, **TOL, err_msg=spec)


class _Swap(tf_keras.layers.Layer):
    def call(self, h):
        return tf.concat(tf.split(h, [6, 10], axis=1)[::-1], axis=1)


def _swapped():
    return tf_keras.Sequential([tf_keras.Input((12,)), tf_keras.layers.Dense(16, name="d1"),
                                _Swap(name="swap"), tf_keras.layers.Dense(2, name="out")])


def _concatenated(consumer):
    inputs = tf_keras.Input((12,))
    joined = tf_keras.layers.Concatenate(name="join")(
        [tf_keras.layers.Dense(16, name="d1")(inputs), tf_keras.layers.Dense(8, name="d3")(inputs)])
    return tf_keras.Model(inputs, tf_keras.layers.Dense(2, name=consumer)(joined))


@pytest.mark.parametrize("factory, refused", [
    (_swapped, r"Split in op scope '[^']*swap[^']*'"),
    (lambda: _concatenated("d2"), r"Concat in op scope '[^']*join[^']*'"),
    (lambda: _concatenated("out"), None)], ids=["split", "concat_to_row_sharded", "concat"])
def test_a_split_or_concat_along_a_model_sharded_dim_is_refused_or_trains(factory, refused):
    """DTensor cannot split, nor join for a consumer whose kernel rows are sharded, a tensor
    along a dim sharded over ``model`` (Dense outputs whose kernel columns are split): a raw
    MLIR error before ("Spliting over sharded dimension is not supported", "Concat op SPMD with
    concat dimension in sharded dimension is not supported"), now one line naming the layer and
    the fix, before anything trains; the same join into a replicated consumer trains like plain
    tf_keras, and on ``batch=8`` every form trains."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 12)).astype("float32"), rng.integers(0, 2, 32)

    def fit(model):
        model.compile(tf_keras.optimizers.SGD(0.1),
                      tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False).history["loss"]

    def laid_out(spec):
        return dtk.distribute(factory, dtk.build_mesh(spec), layout=_layout(spec), seed=0,
                              allow_replicated=True)

    if refused:
        with pytest.raises(ValueError, match="^" + refused + r" cuts or joins a tensor along a "
                           r"dim that is sharded over a mesh axis.*layout='data_parallel'"):
            fit(laid_out("batch=4,model=2"))
        assert np.isfinite(fit(laid_out("batch=8"))).all()
    else:
        tf_keras.utils.set_random_seed(0)
        want = fit(factory())
        np.testing.assert_allclose(fit(laid_out("batch=4,model=2")), want, **TOL)


_EMBEDDING_COLUMNS = """
name = "embedding_columns"
description = "the table's output dim over model, the Dense after it row-sharded"
axes = ["batch", "model"]
default = "replicated"
[[rules]]
pattern = 'emb\\.embeddings'
dims = ["unsharded", "model"]
[[rules]]
pattern = 'd2\\.kernel'
dims = ["model", "unsharded"]
"""


def test_an_embedding_into_a_row_sharded_dense_is_refused_and_the_fix_trains(tmp_path):
    """An Embedding, pooled, into a Dense whose kernel rows are sharded over ``model`` was a raw
    "input and output layout do not agree on non-axis dim 1" from DTensor's ResourceGather; now
    one line naming the lookup's layer and the fix, and the fix (the table's output dim over
    ``model``) trains like plain tf_keras."""
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 50, (64, 6)), rng.integers(0, 2, 64)

    def factory():
        return tf_keras.Sequential([
            tf_keras.Input((6,), dtype="int64"), tf_keras.layers.Embedding(50, 16, name="emb"),
            tf_keras.layers.GlobalAveragePooling1D(), tf_keras.layers.Dense(2, name="d2")])

    def fit(model):
        model.compile(tf_keras.optimizers.SGD(0.1),
                      tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False).history["loss"]

    mesh = dtk.build_mesh("batch=4,model=2")
    with pytest.raises(ValueError, match=r"^an embedding lookup \(ResourceGather in op scope "
                       r"'[^']*emb'\) feeds a layer .*dims \[unsharded, model\]"):
        fit(dtk.distribute(factory, mesh, layout="mlp_model_parallel", seed=0,
                           allow_replicated=True))
    table = tmp_path / "embedding_columns.toml"
    table.write_text(_EMBEDDING_COLUMNS)
    tf_keras.utils.set_random_seed(0)
    want = fit(factory())
    np.testing.assert_allclose(fit(dtk.distribute(factory, mesh, layout=str(table), seed=0)),
                               want, **TOL)


# --- keras.io's NER (MultiHeadAttention, subclassed) and graph network (GNN node classification)
# as their pages write them (smaller): the two models that got through neither way.
class TransformerBlock(tf_keras.layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = tf_keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = tf_keras.Sequential([tf_keras.layers.Dense(ff_dim, activation="relu"),
                                        tf_keras.layers.Dense(embed_dim)])
        self.layernorm1 = tf_keras.layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = tf_keras.layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = tf_keras.layers.Dropout(rate); self.dropout2 = tf_keras.layers.Dropout(rate)
    def call(self, inputs, training=False):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output, training=training)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.dropout2(self.ffn(out1), training=training)
        return self.layernorm2(out1 + ffn_output)

class TokenAndPositionEmbedding(tf_keras.layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = tf_keras.layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = tf_keras.layers.Embedding(input_dim=maxlen, output_dim=embed_dim)
    def call(self, inputs):
        maxlen = tf.shape(inputs)[-1]
        positions = tf.range(start=0, limit=maxlen, delta=1)
        return self.token_emb(inputs) + self.pos_emb(positions)

class NERModel(tf_keras.Model):
    def __init__(self, num_tags, vocab_size, maxlen=128, embed_dim=32, num_heads=2, ff_dim=32):
        super().__init__()
        self.embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)
        self.transformer_block = TransformerBlock(embed_dim, num_heads, ff_dim)
        self.dropout1 = tf_keras.layers.Dropout(0.1)
        self.ff = tf_keras.layers.Dense(ff_dim, activation="relu")
        self.dropout2 = tf_keras.layers.Dropout(0.1)
        self.ff_final = tf_keras.layers.Dense(num_tags, activation="softmax")
    def call(self, inputs, training=False):
        x = self.embedding_layer(inputs)
        x = self.transformer_block(x)
        x = self.dropout1(x, training=training)
        x = self.ff(x)
        x = self.dropout2(x, training=training)
        return self.ff_final(x)

class CustomNonPaddingTokenLoss(tf_keras.losses.Loss):
    def __init__(self, name="custom_ner_loss"):
        super().__init__(name=name)
    def call(self, y_true, y_pred):  # pylint: disable=arguments-renamed
        loss_fn = tf_keras.losses.SparseCategoricalCrossentropy(
            from_logits=False, reduction=tf_keras.losses.Reduction.NONE)
        loss = loss_fn(y_true, y_pred)
        mask = tf.cast((y_true > 0), dtype=tf.float32)
        loss = loss * mask
        return tf.reduce_sum(loss) / tf.reduce_sum(mask)



def create_ffn(units, name=None):
    return tf_keras.Sequential([tf_keras.layers.BatchNormalization(), tf_keras.layers.Dropout(0.0),
                                tf_keras.layers.Dense(units[0], activation=tf.nn.gelu)], name=name)
class GraphConvLayer(tf_keras.layers.Layer):
    def __init__(self, hidden_units, aggregation_type="mean", **kwargs):
        super().__init__(**kwargs)
        self.aggregation_type = aggregation_type
        self.ffn_prepare = create_ffn(hidden_units)
        self.update_fn = create_ffn(hidden_units)
    def prepare(self, node_repesentations, weights=None):
        messages = self.ffn_prepare(node_repesentations)
        if weights is not None:
            messages = messages * tf.expand_dims(weights, -1)
        return messages
    def aggregate(self, node_indices, neighbour_messages, node_repesentations):
        num_nodes = node_repesentations.shape[0]
        return tf.math.unsorted_segment_mean(neighbour_messages, node_indices, num_segments=num_nodes)
    def update(self, node_repesentations, aggregated_messages):
        h = tf.concat([node_repesentations, aggregated_messages], axis=1)
        node_embeddings = self.update_fn(h)
        return tf.nn.l2_normalize(node_embeddings, axis=-1)
    def call(self, inputs):
        node_repesentations, edges, edge_weights = inputs
        node_indices, neighbour_indices = edges[0], edges[1]
        neighbour_repesentations = tf.gather(node_repesentations, neighbour_indices)
        neighbour_messages = self.prepare(neighbour_repesentations, edge_weights)
        aggregated_messages = self.aggregate(node_indices, neighbour_messages, node_repesentations)
        return self.update(node_repesentations, aggregated_messages)
class GNNNodeClassifier(tf_keras.Model):
    def __init__(self, graph_info, num_classes, hidden_units, aggregation_type="sum", **kwargs):
        super().__init__(**kwargs)
        node_features, edges, edge_weights = graph_info
        self.node_features = node_features; self.edges = edges; self.edge_weights = edge_weights
        self.edge_weights = self.edge_weights / tf.math.reduce_sum(self.edge_weights)
        self.preprocess = create_ffn(hidden_units, name="preprocess")
        self.conv1 = GraphConvLayer(hidden_units, aggregation_type, name="graph_conv1")
        self.postprocess = create_ffn(hidden_units, name="postprocess")
        self.compute_logits = tf_keras.layers.Dense(units=num_classes, name="logits")
    def call(self, input_node_indices):
        x = self.preprocess(self.node_features)
        x1 = self.conv1((x, self.edges, self.edge_weights))
        x = x1 + x
        x = self.postprocess(x)
        node_embeddings = tf.gather(x, input_node_indices)
        return self.compute_logits(node_embeddings)
def _gnn():
    rng = np.random.default_rng(1)
    graph = (tf.constant(rng.normal(size=(40, 8)).astype("float32")),
             tf.constant(np.stack([rng.integers(0, 40, 120), rng.integers(0, 40, 120)])),
             tf.ones(shape=120))
    m = GNNNodeClassifier(graph, 3, [16], name="gnn_model")
    m([1, 10, 20])
    m.compile(optimizer=tf_keras.optimizers.Adam(0.01),
              loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m


def _ner():
    model = NERModel(6, 50, maxlen=12, embed_dim=16, num_heads=2, ff_dim=16)
    model.compile(optimizer="adam", loss=CustomNonPaddingTokenLoss())
    return model


def test_keras_io_graph_network_trains_with_keras_numbers():
    """keras.io's "Node Classification with Graph Neural Networks": a subclassed model holding
    its graph (node features, edges, weights) as tensors, built in the factory by a call on a
    list of node indices, with nested unbuilt Sequentials called on those tensors. Before:
    dtk built from the list as three float inputs, then the nested BatchNormalization took the
    node dim for a feature dim. Now equal to plain tf_keras on every mesh."""
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 40, 64), rng.integers(0, 3, 64)

    def fit(model):
        return model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False).history["loss"]

    tf_keras.utils.set_random_seed(0)
    want = fit(_gnn())
    assert want[1] < want[0]
    for spec in MESHES:
        got = fit(dtk.distribute(_gnn, dtk.build_mesh(spec), seed=0, allow_replicated=True))
        np.testing.assert_allclose(got, want, **TOL, err_msg=spec)


def test_keras_io_ner_model_trains_the_same_on_every_mesh():
    """keras.io's "Named Entity Recognition using Transformers": the subclassed NERModel
    (token and position embeddings, a MultiHeadAttention block, dropout) with its masked loss,
    built from ``input_shape``/``input_dtype``, on a padded ``tf.data`` input: it draws dropout,
    so batch=8 and batch=4,model=2 equal batch=1 (dtk's draws)."""
    rng = np.random.default_rng(0)
    x, y = rng.integers(1, 50, (64, 12)), rng.integers(1, 6, (64, 12))
    x[:, 9:], y[:, 9:] = 0, 0
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    losses = {spec: dtk.distribute(_ner, dtk.build_mesh(spec), seed=0, allow_replicated=True,
                                   input_shape=(12,), input_dtype="int64").fit(
                                       data, epochs=2, verbose=0).history["loss"]
              for spec in MESHES}
    assert losses["batch=1"][1] < losses["batch=1"][0]
    for spec in MESHES[1:]:
        np.testing.assert_allclose(losses[spec], losses["batch=1"], **TOL, err_msg=spec)


# --- Keras's weight accessors on every layout dtk makes (issue 70) ---------------------------

@pytest.mark.parametrize("spec, kwargs", [("batch=8", {"fsdp": True}),
                                          ("batch=4,model=2", {"layout": "mlp_model_parallel"})])
def test_every_keras_weight_accessor_works_on_every_layout(tmp_path, spec, kwargs):
    """``get_weights()`` on an ``fsdp=True`` model was "Trying to copy a non-single-device and
    non-replicated DTensor"; so were a layer's, ``variable.numpy()`` and ``save_weights`` to
    ``.h5``. All read the whole values now; ``set_weights`` writes them."""
    def factory():
        return tf_keras.Sequential([tf_keras.Input((12,)), tf_keras.layers.Dense(16, name="d1"),
                                    tf_keras.layers.Dense(2, name="d2")])

    model = dtk.distribute(factory, dtk.build_mesh(spec), seed=0, **kwargs)
    model.compile("adam", "mse")
    model.fit(np.ones((16, 12), np.float32), np.ones((16, 2), np.float32), batch_size=8,
              verbose=0)  # FSDP's stored shards, after an update
    trained = dtk.gather_weights(model)
    assert len(model.get_weights()) == len(trained) == 4
    for got, want in zip(model.get_weights(), trained):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(model.get_layer("d1").get_weights()[0], trained[0])
    np.testing.assert_array_equal(model.weights[0].numpy(), trained[0])
    model.save_weights(str(tmp_path / "w.h5"))
    plain = factory()
    plain.load_weights(str(tmp_path / "w.h5"))
    for got, want in zip(plain.get_weights(), trained):
        np.testing.assert_array_equal(got, want)
    model.set_weights([2 * w for w in trained])
    for got, want in zip(dtk.gather_weights(model), trained):
        np.testing.assert_array_equal(got, 2 * want)


# --- Inputs that failed inside a traced step, refused before Keras starts (issue 70) ---------

def _bad_fit_calls():
    from dtk.data import input as input_lib  # pylint: disable=import-outside-toplevel
    x = np.zeros((32, 12), np.float32)
    y = np.arange(32) % 3
    unbatched = tf.data.Dataset.from_tensor_slices((x, y))
    return {
        "label_out_of_range": (lambda m: m.fit(x, y + 1, batch_size=16, verbose=0),
                               r"fit\(y=...\): label 3 is outside the 3 classes of model "
                               r"'\w+''s output \(shape \(None, 3\)\).*give the last layer 4 units"),
        "unbatched_dataset": (lambda m: m.fit(unbatched, verbose=0),
                              r"fit\(x=...\): the tf.data dataset is not batched: its elements "
                              r"are single examples of shape \(12,\).*dataset.batch\(batch_size\)"),
        "unbatched_validation": (lambda m: m.fit(x, y, batch_size=16, validation_data=unbatched,
                                                 verbose=0),
                                 r"fit\(validation_data=...\): the tf.data dataset is not batched"),
        # issue 71: Keras's fit takes a DistributedDataset (dtk.train.keras_data); these two not
        "distributed_dataset_and_y": (lambda m: m.fit(input_lib.DistributedDataset(
            unbatched, m._dtk_mesh_state.mesh, input_lib.InputConfig(global_batch_size=16)),  # pylint: disable=protected-access
            y, verbose=0), r"^fit\(y=...\): a dtk.DistributedDataset holds its labels"),
        "distributed_dataset_and_batch_size": (lambda m: m.fit(input_lib.DistributedDataset(
            unbatched, m._dtk_mesh_state.mesh, input_lib.InputConfig(global_batch_size=16)),  # pylint: disable=protected-access
            batch_size=32, verbose=0), r"^fit\(batch_size=...\) with a dtk.DistributedDataset: "
                                       r"the dataset batches itself.*drop batch_size"),
        "distributed_dataset_and_class_weight": (lambda m: m.fit(input_lib.DistributedDataset(
            unbatched, m._dtk_mesh_state.mesh, input_lib.InputConfig(global_batch_size=16)),  # pylint: disable=protected-access
            class_weight={0: 1.0, 1: 1.0, 2: 2.0}, verbose=0),
            r"^fit\(class_weight=...\) with a dtk.DistributedDataset"),
        "distributed_dataset_stacked": (lambda m: m.fit(input_lib.DistributedDataset(
            unbatched, m._dtk_mesh_state.mesh, input_lib.InputConfig(global_batch_size=16,  # pylint: disable=protected-access
                                                                     steps_per_call=2)),
            verbose=0), r"^fit\(x=...\): InputConfig\(steps_per_call=2\) stacks batches for "
                        r"dtk.Trainer; Keras's fit stacks them itself"),
        # issue 70: plain tf_keras refuses these too, but under dtk from inside the traced step
        "x_and_y_lengths": (lambda m: m.fit(x, y[:30], batch_size=16, verbose=0),
                            r"^fit: x has 32 examples, y has 30 examples; give every array"),
        "sample_weight_length": (lambda m: m.fit(x, y, sample_weight=np.ones(30), batch_size=16,
                                                 verbose=0),
                                 r"^fit: x has 32 examples, y has 32 examples, sample_weight "
                                 r"has 30 examples"),
        "sample_weight_rank": (lambda m: m.fit(x, y, sample_weight=np.ones((32, 3)),
                                               batch_size=16, verbose=0),
                               r"^fit\(sample_weight=...\): shape \(32, 3\) has more dims than y "
                               r"\(32,\); give one weight per example"),
        "class_weight_missing_a_class_with_tf_data": (
            lambda m: m.fit(unbatched.batch(16), class_weight={0: 1.0, 1: 2.0}, verbose=0),
            r"^fit\(class_weight=...\): a label is 2, but class_weight has weights for classes "
            r"\[0, 1\] only"),
        "evaluate_x_and_y_lengths": (lambda m: m.evaluate(x[:16], y, batch_size=16, verbose=0),
                                     r"^evaluate: x has 16 examples, y has 32 examples"),
        # issue 70's old raw cases: Keras's "Input 0 ... is incompatible", "Missing data for
        # input", from the traced step
        "features_of_the_wrong_shape": (
            lambda m: m.fit(np.zeros((32, 14), np.float32), y, batch_size=16, verbose=0),
            r"^fit\(x=...\): one example's features have shape \(14,\), but model '\w+' takes "
            r"\(12,\) \(its Input '\w+'\); reshape or resize them"),
        "features_of_the_wrong_shape_in_tf_data": (
            lambda m: m.fit(tf.data.Dataset.from_tensor_slices((np.zeros((32, 14), np.float32),
                                                                y)).batch(16), verbose=0),
            r"^fit\(x=...\): one example's features have shape \(14,\)"),
        "dict_features_into_a_sequential": (
            lambda m: m.fit({"image": x}, y, batch_size=16, verbose=0),
            r"^fit\(x=...\): the features are a dict with keys \['image'\], but model '\w+' "
            r"takes one input, '\w+' of shape \(12,\); map the data to \(features\['image'\], "
            r"labels\)"),
    }


@pytest.mark.parametrize("case", sorted(_bad_fit_calls()))
def test_bad_fit_inputs_are_one_line_before_any_step(case):
    call, message = _bad_fit_calls()[case]
    model = dtk.distribute(lambda: tf_keras.Sequential([tf_keras.Input((12,)),
                                                        tf_keras.layers.Dense(3)]),
                           dtk.build_mesh("batch=8"))
    model.compile("adam", tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match=message):
        call(model)
    assert int(model.optimizer.iterations.numpy()) == 0


def _two_inputs():
    a, b = tf_keras.Input((6,), name="a"), tf_keras.Input((6,), name="b")
    return tf_keras.Model({"a": a, "b": b},
                          tf_keras.layers.Dense(3)(tf_keras.layers.Concatenate()([a, b])))


def _compiled_with_keras3_optimizer():
    import keras  # pylint: disable=import-outside-toplevel
    model = tf_keras.Sequential([tf_keras.Input((12,)), tf_keras.layers.Dense(3)])
    model.compile(keras.optimizers.Adam(), "sparse_categorical_crossentropy")
    return model


def _compiled_with_mse_and_sgd():  # a classifier compiled for regression
    model = tf_keras.Sequential([tf_keras.Input((12,)), tf_keras.layers.Dense(3)])
    model.compile("sgd", "mse")
    return model


def _keras3_layer_inside():
    import keras  # pylint: disable=import-outside-toplevel
    return tf_keras.Sequential([tf_keras.Input((12,)), keras.layers.Dense(3)])


@pytest.mark.parametrize("factory, compiled, call, message", [
    (lambda: tf_keras.Sequential([tf_keras.Input((12,)), tf_keras.layers.Dense(3)]), False,
     lambda m: m.fit(np.zeros((32, 12)), np.zeros(32), batch_size=16, verbose=0),
     r"^fit: model '\w+' is not compiled; call model.compile\(optimizer=..., loss=...\)"),
    (_two_inputs, True,
     lambda m: m.fit({"a": np.zeros((32, 6)), "c": np.zeros((32, 6))}, np.zeros(32),
                     batch_size=16, verbose=0),
     r"^fit\(x=...\): the dict's keys \['a', 'c'\] are not model '\w+''s input names "
     r"\['a', 'b'\].*missing: \['b'\], unknown: \['c'\]"),
    (_compiled_with_keras3_optimizer, None, None,
     r"^model_factory compiled a tf_keras model with a Keras 3 optimizer "
     r"\(keras.src.optimizers.adam.Adam\): tf_keras takes its own objects; use "
     r"tf_keras.optimizers"),
    (_compiled_with_mse_and_sgd, None,
     lambda m: m.fit(np.zeros((32, 12)), np.arange(32) % 3, batch_size=16, verbose=0),
     r"^fit\(y=...\): the labels are one number per example \(shape \(\)\), but the loss "
     r"'mean_squared_error' compares them with the 3 scores per example that model '\w+' "
     r"outputs; for class ids use loss='sparse_categorical_crossentropy'"),
    (_keras3_layer_inside, None, None,
     r"^model_factory mixes Keras 3 \(Dense, from the keras package\) into a tf_keras model"
     r".*tf_keras.layers.Dense")],
    ids=["fit_without_compile", "wrong_dict_keys", "keras3_optimizer_in_the_factory",
         "mse_and_sgd_for_class_ids", "keras3_layer_in_a_tf_keras_model"])
def test_bad_model_setups_are_one_line_before_any_step(factory, compiled, call, message):
    """Issue 70: each was a raw or many-line error from inside the traced step (or tf_keras's
    "Could not interpret optimizer identifier: <keras.src...>"); so were the old cases (mse
    for class ids: "Dimensions must be equal"; tf_keras's "The added layer must be an instance
    of class Layer")."""
    with pytest.raises((ValueError, TypeError), match=message):
        model = dtk.distribute(factory, dtk.build_mesh("batch=8"))
        if compiled:
            model.compile("adam", tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        call(model)


@pytest.mark.parametrize("argv, named", [(["--microbatches", "0"], "--microbatches"),
                                         (["--microbatches=0"], "--microbatches"),
                                         (["--grad_accum", "0"], "--grad_accum")])
def test_a_zero_accumulation_flag_is_named_as_typed(monkeypatch, argv, named):
    """Issue 70: ``--microbatches 0`` got an error naming ``--grad_accum``."""
    from dtk import cli  # pylint: disable=import-outside-toplevel
    monkeypatch.setattr("sys.argv", ["train_lm.py", *argv])
    with pytest.raises(cli.UsageError, match=rf"^{named} must be a positive integer; got 0"):
        cli.check_shared_flags(lambda name: 0 if name == "grad_accum" else None)
