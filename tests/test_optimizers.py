"""Optimizer, metric and loss factories: bound to the mesh, or rejected with the reason."""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import dtk
from dtk.train import optimizers


@pytest.fixture(scope="module")
def mesh():
    return dtk.build_mesh("batch=4,model=2")


@pytest.mark.parametrize("name", sorted(optimizers.OPTIMIZERS))
def test_named_optimizers_are_bound(mesh, name):
    opt = dtk.make_optimizer(name, mesh, learning_rate=0.01)
    assert opt._mesh == mesh
    assert np.isclose(float(opt.learning_rate), 0.01)


def test_optimizer_kwargs_and_none_dropped(mesh):
    opt = dtk.make_optimizer("SGD", mesh, learning_rate=0.1, momentum=0.9, clipnorm=None)
    assert isinstance(opt, tf_keras.optimizers.SGD) and opt.momentum == 0.9
    with pytest.raises(ValueError, match="bad arguments"):
        dtk.make_optimizer("sgd", mesh, not_an_arg=1)


def test_optimizer_instances_checked(mesh):
    bound = tf_keras.optimizers.Adam(mesh=mesh)
    assert dtk.make_optimizer(bound, mesh) is bound
    with pytest.raises(ValueError, match="not bound to the mesh.*Adam\\(mesh=mesh"):
        dtk.make_optimizer(tf_keras.optimizers.Adam(), mesh)
    other = dtk.build_mesh("batch=8")
    with pytest.raises(ValueError, match="not bound to the mesh"):
        dtk.make_optimizer(tf_keras.optimizers.Adam(mesh=other), mesh)
    with pytest.raises(ValueError, match="legacy tf_keras optimizer"):
        dtk.make_optimizer(tf_keras.optimizers.legacy.SGD(), mesh)
    with pytest.raises(ValueError, match="only apply to an optimizer given by name"):
        dtk.make_optimizer(bound, mesh, learning_rate=0.1)


@pytest.mark.parametrize("name, words", [
    ("nadam", "not supported under DTensor"),
    ("adamm", "unknown; choose one of adadelta"),
])
def test_bad_optimizer_names(mesh, name, words):
    with pytest.raises(ValueError, match=words):
        dtk.make_optimizer(name, mesh)


def test_metrics(mesh):
    acc, top5 = dtk.make_metrics(["accuracy", "top5"], mesh)
    assert isinstance(acc, tf_keras.metrics.MeanMetricWrapper) and acc.name == "accuracy"
    assert acc._mesh == mesh and top5._mesh == mesh
    custom = tf_keras.metrics.AUC(mesh=mesh)
    assert dtk.make_metrics([custom], mesh) == [custom]
    # A metric object made without mesh= is made again on the mesh from its config, as
    # compile() takes any metric object (the given one is not updated).
    unbound = tf_keras.metrics.BinaryAccuracy(name="acc", threshold=0.3)
    (rebuilt,) = dtk.make_metrics([unbound], mesh)
    assert rebuilt is not unbound and rebuilt._mesh == mesh
    assert type(rebuilt) is tf_keras.metrics.BinaryAccuracy
    assert rebuilt.get_config() == unbound.get_config()
    with pytest.raises(ValueError, match="unknown"):
        dtk.make_metrics(["acuracy"], mesh)
    with pytest.raises(ValueError, match="repeated"):
        dtk.make_metrics(["accuracy", "accuracy"], mesh)


def test_losses_are_per_example():
    fn = optimizers.make_loss("sparse_categorical_crossentropy")
    logits = tf.constant([[2.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    per = fn(tf.constant([0, 0, 1]), logits).numpy()
    assert per.shape == (3,)
    np.testing.assert_allclose(per, -tf.nn.log_softmax(logits).numpy()[[0, 1, 2], [0, 0, 1]],
                               rtol=1e-6)
    with pytest.raises(ValueError, match="unknown"):
        optimizers.make_loss("hinge_loss_x")
