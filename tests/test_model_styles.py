"""The DTensor Keras tutorial's MLP written three ways (Sequential, Functional, subclassed) trains on
``batch=4,model=2`` with a dtk table and matches one device; Keras 3 objects get one clear error."""

import keras as keras3  # always there: TensorFlow 2.21 requires it (tf.keras is Keras 3)
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import dtk
from dtk.data import input as input_lib
from dtk import keras_check
from dtk.parallel import layouts

B, N, HIDDEN = 32, 4, 32


def sequential():
    return tf_keras.Sequential([
        tf_keras.layers.Flatten(input_shape=(28, 28, 1)),
        tf_keras.layers.Dense(HIDDEN, activation="relu", name="d1"),
        tf_keras.layers.Dense(10, name="d2")])


def functional():
    x = tf_keras.Input((28, 28, 1))
    h = tf_keras.layers.Dense(HIDDEN, activation="relu", name="d1")(tf_keras.layers.Flatten()(x))
    return tf_keras.Model(x, tf_keras.layers.Dense(10, name="d2")(h))


class SubclassedMLP(tf_keras.Model):
    """As in the tutorial: Dense layers as attributes, weights created on the first call."""

    def __init__(self):
        super().__init__()
        self.flatten = tf_keras.layers.Flatten()
        self.d1 = tf_keras.layers.Dense(HIDDEN, activation="relu")
        self.d2 = tf_keras.layers.Dense(10)

    def call(self, x):
        return self.d2(self.d1(self.flatten(x)))


def subclassed_built():
    """A subclassed model its factory builds itself (keras.io's ``model.build(shape)``)."""
    model = SubclassedMLP()
    model.build((None, 28, 28, 1))
    return model


def subclassed_called_on_input():
    """A subclassed model its factory calls on a symbolic ``Input`` (it failed in DTensor's
    FetchLayout: the weights stayed lazy, issue 59)."""
    model = SubclassedMLP()
    model(tf_keras.Input((28, 28, 1)))
    return model


STYLES = {"sequential": sequential, "functional": functional, "subclassed": SubclassedMLP,
          "subclassed_built": subclassed_built,
          "subclassed_called_on_input": subclassed_called_on_input}


def _data():
    rng = np.random.default_rng(0)
    return (rng.random((N, B, 28, 28, 1), dtype=np.float32),
            rng.integers(0, 10, (N, B)).astype(np.int64))


def _reference(factory):
    tf_keras.utils.set_random_seed(7)
    model = factory()
    model(tf.zeros([1, 28, 28, 1]))
    opt = tf_keras.optimizers.Adam(1e-3)
    loss_fn = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y = _data()
    losses = []
    for i in range(N):
        with tf.GradientTape() as tape:
            loss = loss_fn(y[i], model(x[i]))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("style", sorted(STYLES))
def test_tutorial_mlp_styles_match_one_device(style):
    factory = STYLES[style]
    mesh = dtk.build_mesh("batch=4,model=2")
    model, plan = layouts.build_model(factory, mesh, "mlp_model_parallel", seed=7,
                                      input_shape=(28, 28, 1))
    specs = {w.path: w.spec() for w in plan.weights}
    assert specs["d1.kernel"] == "[unsharded, model]" and specs["d2.kernel"] == "[model, unsharded]"
    steps = dtk.Steps(model, loss="sparse_categorical_crossentropy",
                      optimizer=dtk.make_optimizer("adam", mesh, learning_rate=1e-3), mesh=mesh)
    x, y = _data()
    losses = [float(steps.train(input_lib.pack(mesh, (x[i], y[i], np.ones(B, np.float32)))))
              for i in range(N)]
    np.testing.assert_allclose(losses, _reference(factory), rtol=1e-5)


def test_subclassed_model_without_input_shape_says_how():
    mesh = dtk.build_mesh("batch=8")
    with pytest.raises(ValueError, match=r"unbuilt SubclassedMLP .* pass input_shape="):
        layouts.build_model(SubclassedMLP, mesh, "data_parallel", seed=0)


def test_trainer_builds_a_subclassed_model():
    mesh = dtk.build_mesh("batch=4,model=2")
    trainer = dtk.Trainer(mesh=mesh, model=SubclassedMLP, layout="mlp_model_parallel",
                          input_shape=(28, 28, 1), config=dtk.TrainerConfig(verbose=0))
    assert sum(1 for w in trainer.layout_plan.weights if any(w.dims)) == 3




@pytest.mark.parametrize("what, make", [
    ("model", lambda: dtk.Trainer(mesh=dtk.build_mesh("batch=8"), model=keras3.Sequential(
        [keras3.layers.Dense(2)]), config=dtk.TrainerConfig(verbose=0))),
    ("the model returned by model_factory", lambda: dtk.Trainer(
        mesh=dtk.build_mesh("batch=8"), model=lambda: keras3.Sequential([keras3.layers.Dense(2)]),
        config=dtk.TrainerConfig(verbose=0))),
    ("optimizer", lambda: dtk.make_optimizer(keras3.optimizers.Adam(), dtk.build_mesh("batch=8"))),
    ("loss", lambda: dtk.make_loss(keras3.losses.SparseCategoricalCrossentropy())),
    ("loss", lambda: dtk.make_loss(keras3.losses.sparse_categorical_crossentropy)),
    ("metric", lambda: dtk.make_metrics([keras3.metrics.Accuracy()], dtk.build_mesh("batch=8"))),
])
def test_keras3_objects_get_one_clear_error(what, make):
    with pytest.raises(TypeError, match=rf"{what} is a Keras 3 object .*takes tf_keras \(Keras "
                                        r"2\) objects: build it with tf_keras .*"
                                        r"TF_USE_LEGACY_KERAS=1.*dtk.distribute\(factory, mesh\)"):
        make()


def test_keras2_objects_are_not_mistaken_for_keras3():
    assert not keras_check.is_keras3(tf_keras.layers.Dense(2))
    assert not keras_check.is_keras3(tf_keras.losses.sparse_categorical_crossentropy)
    assert keras_check.is_keras3(keras3.layers.Dense(2))
