"""dtk.parallel.randomness: dropout and other random layers draw the same values on every mesh.

Parity with dropout on (losses on every mesh equal ``batch=1`` to 1e-5), the statistics of the
draws, and the warning for random ops dtk does not cover. The MNIST MLP with dropout is also
what tests/test_trainer.py (meshes, resume == uninterrupted) and tests/test_launch.py (2 clients x 4,
a killed group resumed) train.
"""

import functools

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import dtk
from dtk.data import input as input_lib
from dtk.parallel import layouts, randomness
from dtk import models

LM = functools.partial(models.transformer_lm, vocab=64, seq_len=16, dim=32, heads=8, layers=1,
                       dropout=0.1)
B, N = 8, 6


def _lm_losses(spec):
    mesh = dtk.build_mesh(spec)
    model, _ = layouts.build_model(LM, mesh, "transformer_lm", seed=7)
    steps = dtk.Steps(model, loss="sparse_categorical_crossentropy",
                      optimizer=dtk.make_optimizer("adam", mesh, learning_rate=3e-3), mesh=mesh)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 64, (N, B, 16)).astype(np.int32)
    y = rng.integers(0, 64, (N, B, 16)).astype(np.int64)
    return np.array([float(steps.train(input_lib.pack(mesh, (x[i], y[i], np.ones(B, np.float32)))))
                     for i in range(N)])


@functools.lru_cache(maxsize=None)
def _lm_one_device():
    return _lm_losses("batch=1")


@pytest.mark.parametrize("spec", [
    pytest.param("batch=8", marks=pytest.mark.slow), "batch=4,model=2",
    pytest.param("batch=2,model=4", marks=pytest.mark.slow),
    # batch=1,model=8 in the release lane (pytest -m zoo): every run still covers a pure model axis
    # through batch=2,model=4, for the suite's time budget.
    pytest.param("batch=1,model=8", marks=(pytest.mark.slow, pytest.mark.zoo))])
def test_lm_with_dropout_matches_one_device(spec):
    """Dropout after the embedding, in attention (MultiHeadAttention's own) and after each block."""
    np.testing.assert_allclose(_lm_losses(spec), _lm_one_device(), rtol=1e-5)


def _all_random_layers():
    return tf_keras.Sequential([
        tf_keras.layers.Flatten(input_shape=(28, 28, 1)),
        tf_keras.layers.GaussianNoise(0.1, name="noise"),
        tf_keras.layers.Dense(32, activation="relu", name="d1"),
        tf_keras.layers.Dropout(0.3, name="drop"),
        tf_keras.layers.Reshape((4, 8)),
        tf_keras.layers.SpatialDropout1D(0.2, name="spatial"),
        tf_keras.layers.GaussianDropout(0.1, name="gdrop"),
        tf_keras.layers.AlphaDropout(0.1, name="adrop"),
        tf_keras.layers.Flatten(),
        tf_keras.layers.Dense(10, name="d2")])


def _random_layer_losses(spec, factory=_all_random_layers, steps_per_call=1):
    mesh = dtk.build_mesh(spec)
    model, _ = layouts.build_model(factory, mesh, "mlp_model_parallel", seed=3,
                                   allow_replicated=True)
    steps = dtk.Steps(model, loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer=dtk.make_optimizer("adam", mesh, learning_rate=1e-3), mesh=mesh,
                      config=dtk.StepConfig(steps_per_execution=steps_per_call))
    rng = np.random.default_rng(0)
    x = rng.random((N, 32, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, (N, 32))
    w = np.ones((N, 32), np.float32)
    if steps_per_call == 1:
        return np.array([float(steps.train(input_lib.pack(mesh, (x[i], y[i], w[i]))))
                         for i in range(N)]), steps
    losses = []
    for i in range(0, N, steps_per_call):
        stack = input_lib.pack(mesh, (x[i:i + steps_per_call], y[i:i + steps_per_call],
                                      w[i:i + steps_per_call]), stacked=True)
        losses.append(float(steps.train(stack)))
    return np.array(losses), steps


@functools.lru_cache(maxsize=None)
def _random_layers_one_device():
    return _random_layer_losses("batch=1")[0]


@pytest.mark.parametrize("spec", [
    "batch=8", pytest.param("batch=4,model=2", marks=pytest.mark.slow),
    pytest.param("batch=1,model=8", marks=pytest.mark.slow)])
def test_every_random_layer_matches_one_device(spec):
    """GaussianNoise, Dropout, SpatialDropout1D (a shared mask), GaussianDropout, AlphaDropout."""
    np.testing.assert_allclose(_random_layer_losses(spec)[0], _random_layers_one_device(),
                               rtol=1e-5)


def test_several_steps_per_call_draw_the_same_masks():
    """The step counter is read inside the compiled loop: 3 steps per call == 3 calls (a
    call's loss is Keras's, the mean over its steps)."""
    stacked, _ = _random_layer_losses("batch=8", steps_per_call=3)
    np.testing.assert_allclose(stacked, _random_layers_one_device().reshape(-1, 3).mean(axis=1),
                               rtol=1e-5)


# -- statistics ---------------------------------------------------------------------------------
def test_dropout_statistics():
    rate, shape = 0.3, (64, 4096)   # 262,144 elements
    x = tf.ones(shape)
    gen = tf_keras.layers.Dropout(rate)
    gen.build(shape)
    gen._random_generator.__class__ = randomness.IndexedRandomGenerator
    gen._random_generator._dtk_seed, gen._random_generator._dtk_layer = 0, 5
    with randomness.step_scope(tf.constant(0, tf.int64)):
        a = gen(x, training=True).numpy()
        again = gen(x, training=True).numpy()   # the layer's second draw in the same step
    with randomness.step_scope(tf.constant(1, tf.int64)):
        b = gen(x, training=True).numpy()
    kept = a != 0
    n = kept.size
    se = np.sqrt(rate * (1 - rate) / n)
    assert abs(kept.mean() - (1 - rate)) < 3 * se, kept.mean()
    np.testing.assert_allclose(a[kept], 1 / (1 - rate), rtol=1e-6)   # kept values scaled
    # Another step, another call: other masks (agreement ~ p^2 + (1-p)^2 = 0.58, not 1).
    for other in (b, again):
        agree = np.mean((other != 0) == kept)
        assert abs(agree - ((1 - rate) ** 2 + rate ** 2)) < 0.01, agree
    # No correlation between neighbours, along rows and down columns.
    k = kept.astype(np.float64) - kept.mean()
    for lag in (k[:, 1:] * k[:, :-1], k[1:, :] * k[:-1, :]):
        corr = lag.mean() / k.var()
        assert abs(corr) < 4 / np.sqrt(lag.size), corr


def test_uniform_and_normal_statistics():
    shape = (512, 1024)
    u = randomness.uniform(shape, key=randomness.stream_key(1, 2, 0), step=3).numpy()
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean() - 0.5) < 3 * np.sqrt(1 / 12 / u.size)
    # 16 equal bins: chi-square with 15 degrees of freedom, far below the 0.1% point (37.7).
    counts = np.histogram(u, bins=16, range=(0, 1))[0]
    expected = u.size / 16
    assert ((counts - expected) ** 2 / expected).sum() < 37.7
    z = randomness.normal(shape, key=randomness.stream_key(1, 2, 1), step=3).numpy()
    assert abs(z.mean()) < 4 / np.sqrt(z.size) and abs(z.std() - 1) < 0.005
    t = randomness.normal(shape, key=randomness.stream_key(1, 2, 2), step=3, truncate=2.0).numpy()
    assert np.abs(t).max() <= 2.0 and abs(t.std() - 0.8796) < 0.005   # truncated at 2 sigma
    # Other layers' keys give unrelated streams.
    v = randomness.uniform(shape, key=randomness.stream_key(1, 3, 0), step=3).numpy()
    assert abs(np.corrcoef(u.ravel(), v.ravel())[0, 1]) < 4 / np.sqrt(u.size)


# -- what dtk does not cover ----------------------------------------------------------------------
class _OwnNoise(tf_keras.layers.Layer):
    """Draws itself (DTensor refuses stateful tf.random.uniform; the stateless op runs per device)."""

    def call(self, inputs, training=None):
        noise = tf.random.stateless_uniform(tf.shape(inputs), seed=[1, 2])
        return inputs + noise * 0.01 if training else inputs


def test_a_layer_calling_tf_random_is_named_once(caplog):
    def factory():
        return tf_keras.Sequential([tf_keras.layers.Flatten(input_shape=(28, 28, 1)),
                                    _OwnNoise(name="own_noise"),
                                    tf_keras.layers.Dense(10, name="d2")])
    with caplog.at_level("WARNING", logger="dtk"):
        _random_layer_losses("batch=8", factory=factory)
    lines = [r.getMessage() for r in caplog.records if "not covered" in r.getMessage()]
    assert len(lines) == 1 and "own_noise" in lines[0] and "StatelessRandomUniform" in lines[0], lines


def test_covered_layers_give_no_warning(caplog):
    with caplog.at_level("WARNING", logger="dtk"):
        _random_layer_losses("batch=8")
    assert not [r for r in caplog.records if "not covered" in r.getMessage()]


def test_control_flow_is_not_a_draw():
    """StatelessWhile / StatelessIf are loops and conditionals, not random ops: a layer with a
    tf.while_loop is not named as an uncovered draw."""
    from dtk.parallel import randomness  # pylint: disable=import-outside-toplevel
    assert not randomness.is_random_op("StatelessWhile")
    assert not randomness.is_random_op("StatelessIf")
    assert randomness.is_random_op("StatelessRandomUniformV2")
    assert randomness.is_random_op("RandomStandardNormal")


class _BackendNoise(tf_keras.layers.Layer):
    """A user's layer drawing through tf_keras.backend itself (as keras.io's VAE samples z)."""

    def call(self, inputs):
        return inputs + 0.01 * tf_keras.backend.random_normal(shape=tf.shape(inputs))


def test_a_layer_drawing_through_tf_keras_backend_is_the_same_on_every_mesh(caplog):
    def factory():
        return tf_keras.Sequential([tf_keras.layers.Flatten(input_shape=(28, 28, 1)),
                                    _BackendNoise(name="backend_noise"),
                                    tf_keras.layers.Dense(10, name="d2")])
    with caplog.at_level("WARNING", logger="dtk"):
        losses, _ = _random_layer_losses("batch=8", factory=factory)
    assert not [r for r in caplog.records if "not covered" in r.getMessage()]
    np.testing.assert_allclose(losses, _random_layer_losses("batch=1", factory=factory)[0],
                               rtol=1e-5)
