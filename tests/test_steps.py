"""The parity suite: dtk's compiled steps on 8 devices match single-device training.

Same initial weights (same seed), same data: per-step losses and final weights on every mesh equal
a plain tf_keras run on one device to 1e-5 relative, for each optimizer, on the MNIST MLP and a small
CNN. Plus metrics, padding, steps_per_execution and tracing.
"""

import functools

import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor

import dtk
from dtk.data import input as input_lib
from dtk.parallel import layouts
from dtk import models
from dtk.train import optimizers
from tests import procs

B = 32      # global batch
N = 4       # steps
RTOL = 1e-5

OPTIMIZERS = {
    "sgd": dict(learning_rate=0.1),
    "momentum": dict(learning_rate=0.05, momentum=0.9),
    "adam": dict(learning_rate=0.001),
    "adamw": dict(learning_rate=0.001, weight_decay=0.01),
    "rmsprop": dict(learning_rate=0.005),
    "adagrad": dict(learning_rate=0.1),
}
MESHES = {  # mesh -> layout table per model
    "batch=8": {"mlp": "data_parallel", "cnn": "cnn_data_parallel"},
    "batch=4,model=2": {"mlp": "mlp_model_parallel", "cnn": "cnn_data_parallel"},
    "batch=2,model=4": {"mlp": "mlp_model_parallel", "cnn": "cnn_data_parallel"},
}
FACTORIES = {
    "mlp": functools.partial(models.mnist_mlp, hidden=32),
    "cnn": functools.partial(models.mnist_cnn, filters=(4, 8), hidden=16),
}


def _optimizer(name, mesh=None):
    kwargs = dict(OPTIMIZERS[name])
    base = "sgd" if name == "momentum" else name
    cls = getattr(tf_keras.optimizers, optimizers.OPTIMIZERS[base])
    return cls(mesh=mesh, **kwargs) if mesh is not None else cls(**kwargs)


def _data(n=N, b=B, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.random((n, b, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, (n, b)).astype(np.int64)
    w = np.ones((n, b), np.float32)
    return x, y, w


@functools.lru_cache(maxsize=None)
def _reference(model_name, opt_name):
    """Plain single-device run: per-step losses and final weights."""
    tf_keras.utils.set_random_seed(7)
    model = FACTORIES[model_name]()
    opt = _optimizer(opt_name)
    loss_fn = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    x, y, _ = _data()
    losses = [float(step(x[i], y[i])) for i in range(N)]
    return np.array(losses), [w.numpy() for w in model.weights]


def _dtk_steps(model_name, opt_name, spec, *, spe=1, shard=False):
    mesh = dtk.build_mesh(spec)
    table = layouts.load_table(MESHES[spec][model_name])
    model, _ = layouts.build_model(FACTORIES[model_name], mesh, table, seed=7)
    return dtk.Steps(model, loss="sparse_categorical_crossentropy",
                     optimizer=_optimizer(opt_name, mesh), metrics=["accuracy"], mesh=mesh,
                     config=dtk.StepConfig(steps_per_execution=spe,
                                           shard_optimizer_state=shard)), mesh


def _assert_weights_close(model, expected, rtol):
    for got, want in zip(dtk.gather_weights(model), expected):
        # atol: Adam turns float-rounding differences in near-zero gradients into ~lr-sized steps.
        np.testing.assert_allclose(got, want, rtol=rtol, atol=2e-6)


# The fast lane keeps one case per model kind; the rest run in the whole suite (CI).
_FAST_PARITY = {("mlp", "adam", "batch=4,model=2"), ("cnn", "momentum", "batch=8")}
PARITY_CASES = [pytest.param(*case, marks=() if case in _FAST_PARITY else pytest.mark.slow)
                for case in [("mlp", o, m) for m in MESHES for o in OPTIMIZERS] + [
                    ("cnn", o, m) for m in MESHES for o in ("momentum", "adam")]]


@pytest.mark.parametrize("model_name, opt_name, spec", PARITY_CASES)
def test_parity_with_single_device(model_name, opt_name, spec):
    want_losses, want_weights = _reference(model_name, opt_name)
    steps, mesh = _dtk_steps(model_name, opt_name, spec)
    x, y, w = _data()
    losses = []
    for i in range(N):
        batch = input_lib.pack(mesh, (x[i], y[i], w[i]))
        losses.append(float(steps.train(batch)))
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL)
    _assert_weights_close(steps.model, want_weights, RTOL)
    assert steps.trace_counts["train"] == 1  # one trace for one shape


@pytest.mark.parametrize("model_name, opt_name, spec", [
    ("mlp", "adam", "batch=8"),
    pytest.param("mlp", "momentum", "batch=4,model=2", marks=pytest.mark.slow),
    pytest.param("mlp", "adamw", "batch=2,model=4", marks=pytest.mark.slow),
    pytest.param("cnn", "adam", "batch=8", marks=pytest.mark.slow)])
def test_sharded_optimizer_state_keeps_parity(model_name, opt_name, spec, monkeypatch):
    """The sharded update splits the weights of SHARDED_UPDATE_MIN_ELEMENTS elements a device
    and more, and updates the rest in place: lowered to 1,024 here, the test models' big kernels
    are split and their biases are not, so both kinds train together."""
    monkeypatch.setattr(layouts, "SHARDED_UPDATE_MIN_ELEMENTS", 1 << 10)
    want_losses, want_weights = _reference(model_name, opt_name)
    steps, mesh = _dtk_steps(model_name, opt_name, spec, shard=True)
    x, y, w = _data()
    losses = [float(steps.train(input_lib.pack(mesh, (x[i], y[i], w[i])))) for i in range(N)]
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL)
    _assert_weights_close(steps.model, want_weights, RTOL)
    # The big kernel's optimizer state is sharded over the batch axis: each device holds a slice.
    kernel = max(steps.model.trainable_variables, key=lambda v: int(np.prod(v.shape)))
    slots = [v for v in steps.optimizer.variables if v.shape == kernel.shape]
    assert slots and all("batch" in dtensor.fetch_layout(v).sharding_specs for v in slots)
    assert all(dtensor.fetch_layout(kernel).sharding_specs != dtensor.fetch_layout(v).sharding_specs
               for v in slots)
    # A weight below the threshold keeps its own layout for its state: updated in place.
    small = min(steps.model.trainable_variables, key=lambda v: int(np.prod(v.shape)))
    small_slots = [v for v in steps.optimizer.variables if v.shape == small.shape]
    assert small_slots and all(dtensor.fetch_layout(v).sharding_specs
                               == dtensor.fetch_layout(small).sharding_specs for v in small_slots)


def test_steps_per_execution_is_bit_identical():
    x, y, w = _data(n=6)
    one, mesh = _dtk_steps("mlp", "adam", "batch=4,model=2")
    losses = [float(one.train(input_lib.pack(mesh, (x[i], y[i], w[i])))) for i in range(6)]
    many, mesh = _dtk_steps("mlp", "adam", "batch=4,model=2", spe=3)
    for k in (0, 3):
        last_many = many.train(input_lib.pack(mesh, (x[k:k + 3], y[k:k + 3], w[k:k + 3]),
                                              stacked=True))
    # A call's loss is Keras's: the mean over its steps (train_on_batch's, for one).
    np.testing.assert_allclose(float(last_many), np.mean(losses[3:]), rtol=1e-6)
    for a, b in zip(dtk.gather_weights(one.model), dtk.gather_weights(many.model)):
        np.testing.assert_array_equal(a, b)
    # Traced once per shape: the first call's first step runs alone (its trace gives the loop
    # its logs' layouts), then its other two as a loop, then each stack of three as one loop.
    assert many.trace_counts["train"] == 3
    assert int(many.optimizer.iterations.numpy()) == 6


def test_evaluate_accumulates_keras_metrics_until_reset():
    """``evaluate`` runs Keras's compiled test step: loss and metrics accumulate over calls
    (weighted by each batch's rows) until ``reset_metrics``, with plain Keras's numbers."""
    steps, mesh = _dtk_steps("mlp", "sgd", "batch=8")
    x, y, w = _data(n=2, b=40)
    for i in range(2):
        loss = steps.evaluate(input_lib.pack(mesh, (x[i], y[i], w[i])))
    tf_keras.utils.set_random_seed(7)
    plain = FACTORIES["mlp"]()
    logits = plain(x.reshape(80, *x.shape[2:])).numpy()
    labels = y.reshape(80)
    want_loss = float(tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)(
        labels, logits))
    want_acc = float(np.mean(np.argmax(logits, axis=1) == labels))
    np.testing.assert_allclose(float(loss), want_loss, rtol=RTOL)
    results = steps.results()
    np.testing.assert_allclose(results["loss"], want_loss, rtol=RTOL)
    np.testing.assert_allclose(results["accuracy"], want_acc, rtol=RTOL)
    steps.reset_metrics()
    assert steps.results()["accuracy"] == 0.0


class _ScaleIfLarge(tf_keras.layers.Layer):
    """A layer with Python control flow on a tensor value: it needs AutoGraph to trace."""

    def call(self, inputs):
        if tf.reduce_max(inputs) > 1e6:
            inputs = inputs * 1e-6
        return inputs


def _clipped_loss(labels, logits):
    """A loss function with Python control flow on a tensor value."""
    per_example = tf_keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
    if tf.reduce_min(per_example) < 0.0:
        per_example = tf.zeros_like(per_example)
    return per_example


def test_user_code_is_converted_by_autograph():
    """dtk traces its own step code without AutoGraph (faster first step); user code still gets it."""
    x, y, w = _data(n=2)
    x[1] *= 1e7  # takes the layer's branch
    factory = lambda: tf_keras.Sequential([  # noqa: E731
        tf_keras.layers.Flatten(input_shape=(28, 28, 1)), _ScaleIfLarge(),
        tf_keras.layers.Dense(10, name="out")])
    mesh = dtk.build_mesh("batch=8")
    model, _ = layouts.build_model(factory, mesh, layouts.load_table("data_parallel"), seed=7)
    steps = dtk.Steps(model, loss=_clipped_loss, optimizer="sgd", mesh=mesh)
    tf_keras.utils.set_random_seed(7)
    plain = factory()
    for i in range(2):
        steps.reset_metrics()
        got = float(steps.evaluate(input_lib.pack(mesh, (x[i], y[i], w[i]))))
        want = float(tf.reduce_mean(_clipped_loss(y[i], plain(x[i]))))
        np.testing.assert_allclose(got, want, rtol=RTOL)
    steps.train(input_lib.pack(mesh, (x[0], y[0], w[0])))
    np.testing.assert_allclose(dtk.gather_weights(steps.model)[0].shape, (784, 10))


@pytest.mark.slow
def test_combine_setting_on_breaks_usual_steps_but_not_dtks():
    """Why dtk sets DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION=0, and why its own step does
    not need it: with combining on, a usual step (Keras SGD applied in the same block) drifts,
    while dtk's step (update in a region of its own) still matches one device."""
    code = """
import numpy as np, tensorflow as tf, tf_keras, dtk
from dtk.data import input as input_lib
from dtk import models
dtk.configure_virtual_cpus(8)
rng = np.random.default_rng(0)
x = rng.random((5, 64, 28, 28, 1), dtype=np.float32); y = rng.integers(0, 10, (5, 64))
def run(spec, usual):
    mesh = dtk.build_mesh(spec)
    tf_keras.utils.set_random_seed(3)
    with tf_keras.dtensor.experimental.LayoutMap(mesh=mesh).scope():
        model = models.mnist_mlp()
    opt = tf_keras.optimizers.SGD(0.5, mesh=mesh)
    loss_fn = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    steps = None if usual else dtk.Steps(model, loss=loss_fn, optimizer=opt, mesh=mesh)
    @tf.function
    def usual_step(xb, yb, wb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
        return loss
    out = []
    for i in range(5):
        b = input_lib.pack(mesh, (x[i], y[i].astype(np.int64), np.ones(64, np.float32)))
        out.append(float(usual_step(*b) if usual else steps.train(b)))
    return np.array(out)
for usual in (True, False):
    one = run("batch=1", usual)
    print("DIFF" if usual else "DTK", np.max(np.abs(run("batch=8", usual) - one) / one))
"""
    on = procs.run_python(code, env=procs.base_env(
        DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION="1"), timeout=240)
    off = procs.run_python(code, timeout=240)
    assert on.returncode == 0 and off.returncode == 0, on.stderr[-2000:] + off.stderr[-2000:]
    usual_on = float(on.stdout.split("DIFF")[1].split()[0])
    usual_off = float(off.stdout.split("DIFF")[1].split()[0])
    assert usual_off < 1e-5
    assert usual_on > 1e-3, f"combining all-reduces no longer breaks usual steps ({usual_on})"
    assert float(on.stdout.split("DTK")[1].split()[0]) < 1e-5
    assert float(off.stdout.split("DTK")[1].split()[0]) < 1e-5


_STALE = ("Cannot add function 'dtk_steps_12_body' because a different function with the "
          "same name already exists. [Op:__inference_one_477318]")


@pytest.mark.parametrize("failures, other, calls, raises", [
    (0, False, 1, False),   # the usual call: traced once
    (1, False, 2, False),   # a stale DTensor function name: traced again, called again
    (2, False, 3, False),
    (3, False, 3, True),    # still stale after two fresh traces: the error is the user's to see
    (1, True, 1, True),     # any other error propagates at once, untouched
])
def test_a_stale_dtensor_function_name_retraces_the_step(failures, other, calls, raises):
    """CI saw "Cannot add function 'dtk_accumulate_12_body' ..." once per full suite: DTensor
    compiled a step again and its outlined loop body clashed with the earlier compilation's.
    Keras's compiled step (``MeshCalls``) is made again (new loop names) and called again;
    nothing else is retried."""
    from dtk.train import mesh_calls  # pylint: disable=import-outside-toplevel
    made, called = [], []
    compiled = mesh_calls.MeshCalls(lambda data: data, mesh_calls.MeshState(
        dtk.build_mesh("batch=8"), "batch"), reduce_retracing=False)

    def make():
        made.append(1)

        def fn(x):
            called.append(x)
            if len(called) <= failures:
                message = "Incompatible shapes" if other else _STALE
                raise tf.errors.InvalidArgumentError(None, None, message)
            return x + 1
        compiled.traced = fn

    compiled._make = make  # pylint: disable=protected-access
    make()
    if raises:
        with pytest.raises(tf.errors.InvalidArgumentError):
            compiled._retrying("traced", 1)  # pylint: disable=protected-access
    else:
        assert compiled._retrying("traced", 1) == 2  # pylint: disable=protected-access
    assert len(called) == calls and len(made) == calls


class _OwnStep(tf_keras.Sequential):
    """A model with its own train_step (keras.io's "Customizing what happens in fit()")."""

    def train_step(self, data):
        return super().train_step(data)


@pytest.mark.parametrize("make", ["Trainer", "Steps"])
def test_accumulation_with_a_models_own_train_step_is_one_clear_error(make):
    """Both fronts refuse, with one message, what would change a model's own train_step."""
    mesh = dtk.build_mesh("batch=8")

    def factory():
        return _OwnStep([tf_keras.layers.Flatten(input_shape=(28, 28, 1)),
                         tf_keras.layers.Dense(10)])
    match = (r"model _OwnStep overrides train_step, .*gradient_accumulation_steps > 1 would "
             r"change that step. Drop them for this model")
    with pytest.raises(ValueError, match=match):
        if make == "Trainer":
            dtk.Trainer(mesh=mesh, model=factory, config=dtk.TrainerConfig(
                verbose=0, gradient_accumulation_steps=2))
        else:
            model, _ = layouts.build_model(factory, mesh, "data_parallel", seed=0)
            dtk.Steps(model, loss="sparse_categorical_crossentropy", optimizer="sgd", mesh=mesh,
                      config=dtk.StepConfig(gradient_accumulation_steps=2))
