"""Layout tables: loading, planning and validation before any variable exists, the explainer, and
layer coverage (forward and one optimizer step match one device) under the shipped tables."""

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

MESHES = ["batch=8", "batch=4,model=2", "batch=2,model=4"]
MLP_PATHS = [("d1.kernel", (784, 128), tf.float32), ("d1.bias", (128,), tf.float32),
             ("d2.kernel", (128, 10), tf.float32), ("d2.bias", (10,), tf.float32)]


def _write(tmp_path, text, name="t.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_shipped_tables_load():
    names = layouts.available_tables()
    assert {"data_parallel", "mlp_model_parallel", "cnn_data_parallel",
            "transformer_block"} <= set(names)
    for name in names:
        table = layouts.load_table(name)
        assert table.name == name and table.description and table.axes
    with pytest.raises(ValueError, match="'nope' is unknown; tables: cnn_data_parallel"):
        layouts.load_table("nope")


@pytest.mark.parametrize("spec", MESHES)
@pytest.mark.parametrize("table, factory", [
    ("data_parallel", models.mnist_mlp), ("mlp_model_parallel", models.mnist_mlp),
    ("cnn_data_parallel", models.mnist_cnn),
    ("transformer_block", functools.partial(models.tiny_transformer, dropout=0.0))])
def test_every_table_plans_on_its_meshes(spec, table, factory):
    mesh = dtk.build_mesh(spec)
    idle = table == "data_parallel" and "model" in spec  # devices of `model` would repeat work
    if idle:
        with pytest.raises(ValueError, match="mesh axis 'model' of size .* shards no weight"):
            layouts.plan_layouts(table, mesh, factory, strict=True)
    plan = layouts.plan_layouts(table, mesh, factory, strict=True, allow_replicated=idle)
    sizes = dict(plan.mesh_axes)
    for w in plan.weights:
        split = int(np.prod([sizes[a] for a in w.dims if a]))
        assert w.bytes_per_device * split == w.bytes_total   # shards add up to the weight
        for axis, n in zip(w.dims, w.shape):
            assert axis is None or n % sizes[axis] == 0
    if "model" not in sizes:
        assert not any(any(w.dims) for w in plan.weights)    # optional axis: everything unsharded



@pytest.mark.parametrize("name", sorted(models.MODEL_SPECS))
def test_every_model_spec_brings_a_table_that_plans_its_model(name):
    """Issue 71: a model's layout table travels with it (``ModelSpec``, as torchtitan's): each
    spec's table plans every weight of its model on batch=8, and ``dtk-explain --model`` lists
    exactly the specs (its TensorFlow-free help cannot drift from them)."""
    from dtk import explain_cli  # pylint: disable=g-import-not-at-top
    spec = models.MODEL_SPECS[name]
    assert spec.name == name and models.MODELS[name] is spec.factory
    plan = layouts.plan_layouts(spec.layout, dtk.build_mesh("batch=8"), spec.factory,
                                allow_replicated=True)
    built = spec.factory()
    assert sorted(w.path for w in plan.weights) == sorted(p for p, _ in layouts.weight_paths(built))
    assert explain_cli._model_and_table(models, name) == (spec.factory, spec.layout)
    assert set(explain_cli._MODELS) == set(models.MODEL_SPECS)

def test_mlp_model_parallel_plan_and_explainer():
    mesh = dtk.build_mesh("batch=4,model=2")
    plan = layouts.plan_layouts("mlp_model_parallel", mesh, models.mnist_mlp, strict=True)
    dims = {w.path: w.dims for w in plan.weights}
    assert dims == {"d1.kernel": (None, "model"), "d1.bias": ("model",),
                    "d2.kernel": ("model", None), "d2.bias": (None,)}
    text = layouts.explain(plan)
    total = (784 * 128 + 128 + 128 * 10 + 10) * 4
    per_device = (784 * 64 + 64 + 64 * 10 + 10) * 4
    assert sum(w.bytes_total for w in plan.weights) == total
    assert sum(w.bytes_per_device for w in plan.weights) == per_device
    # The 2 devices of one model group hold the sharded weights once and the replicated ones twice.
    assert 2 * per_device == total + 10 * 4
    assert "d1.kernel  [784, 128]" in text and "[unsharded, model]" in text
    assert "d[2468]\\.bias" in text and "(default:" not in text
    assert text.splitlines()[-1] == ("layouts: mlp_model_parallel on batch=4,model=2: 4 weights "
                                     "(3 sharded), 397.5 KiB in all, 198.8 KiB per device")


def _table(tmp_path, rules, header='axes = ["batch", "model"]\n'):
    return layouts.load_table(_write(tmp_path, header + rules))


@pytest.mark.parametrize("rules, words", [
    ('[[rules]]\npattern = "d1\\\\..*"\ndims = ["unsharded", "model"]\n'
     '[[rules]]\npattern = ".*kernel"\ndims = ["unsharded", "model"]\n',
     r"weight d1.kernel \[784, 128\] matches 2 rules .*'d1\\\\\.\.\*' and '\.\*kernel'"),
    ('[[rules]]\npattern = "d1.kernel"\ndims = ["model"]\n',
     r"gives 1 dims, but weight d1.kernel has shape \[784, 128\] \(rank 2\)"),
    ('[[rules]]\npattern = "d2.kernel"\ndims = ["unsharded", "model"]\n',
     r"weight d2.kernel \[128, 10\]: dim 1 \(10\) is not divisible by mesh axis 'model' \(size 4\)"),
    ('[[rules]]\npattern = "d1.kernel"\ndims = ["model", "model"]\n', "shards two dims"),
])
def test_validation_errors(tmp_path, rules, words):
    with pytest.raises(ValueError, match=words):
        layouts.plan_weights(_table(tmp_path, rules), dtk.build_mesh("batch=2,model=4"), MLP_PATHS)


def test_unknown_axes_unused_rules_and_defaults(tmp_path):
    mesh8 = dtk.build_mesh("batch=8")
    strict_axes = _table(tmp_path, '[[rules]]\npattern = "d1.kernel"\ndims = ["unsharded", "model"]\n')
    with pytest.raises(ValueError, match=r"needs mesh axes \['model'\], which mesh batch=8 does not "
                                         r"have"):
        layouts.plan_weights(strict_axes, mesh8, MLP_PATHS)
    with pytest.raises(ValueError, match="names axis 'expert', which is not in the table's axes"):
        _table(tmp_path, '[[rules]]\npattern = "x"\ndims = ["expert"]\n')
    unused = _table(tmp_path, '[[rules]]\npattern = "d9.kernel"\ndims = ["unsharded", "model"]\n')
    mesh = dtk.build_mesh("batch=4,model=2")
    # A table that shards on model but matches nothing would train everything replicated.
    with pytest.raises(ValueError, match=r"shards weights on mesh axes \['model'\], but on this "
                                         r"model it shards none.*allow_replicated=True"):
        layouts.plan_weights(unused, mesh, MLP_PATHS)
    plan = layouts.plan_weights(unused, mesh, MLP_PATHS, allow_replicated=True)
    assert [r.pattern for r in plan.unused_rules] == ["d9.kernel"]
    assert "match no weight" in plan.warnings[0]
    assert "4 weight(s) matched no rule" in plan.warnings[1]
    summary = layouts.explain(plan).splitlines()[-1]
    assert "WARNING: 1 rule(s) matched nothing; WARNING: 4 weight(s) by default" in summary
    with pytest.raises(ValueError, match=r"rule\(s\) \['d9.kernel'\] match no weight"):
        layouts.plan_weights(unused, mesh, MLP_PATHS, strict=True)
    strict_default = _table(tmp_path, 'default = "error"\n')
    with pytest.raises(ValueError, match=r"weight d1.kernel \[784, 128\] matches no rule"):
        layouts.plan_weights(strict_default, mesh, MLP_PATHS)
    with pytest.raises(ValueError, match="not a valid regular expression"):
        _table(tmp_path, '[[rules]]\npattern = "d1.("\ndims = ["model"]\n')
    with pytest.raises(ValueError, match="unknown keys"):
        _table(tmp_path, 'rulez = 1\n')
    with pytest.raises(ValueError, match="does not exist"):
        layouts.load_table(str(tmp_path / "missing.toml"))


def test_errors_come_before_any_variable_exists(tmp_path, monkeypatch):
    created = []
    original = dtensor.DVariable.__init__

    def spy(self, *args, **kwargs):
        created.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(dtensor.DVariable, "__init__", spy)
    table = _table(tmp_path, '[[rules]]\npattern = "d1.kernel"\ndims = ["unsharded", "model"]\n')
    with pytest.raises(ValueError, match=r"dim 1 \(10\) is not divisible by mesh axis 'model' "
                                         r"\(size 4\)"):
        layouts.build_model(functools.partial(models.mnist_mlp, hidden=10),
                            dtk.build_mesh("batch=2,model=4"), table, seed=0)
    assert created == []


# -- layer coverage: forward and one optimizer step equal one device ------------------------------
def _bn_cnn():
    return tf_keras.Sequential([
        tf_keras.layers.Conv2D(4, 3, input_shape=(28, 28, 1), name="c1"),
        tf_keras.layers.BatchNormalization(name="bn"),
        tf_keras.layers.ReLU(name="relu"),
        tf_keras.layers.MaxPooling2D(name="p1"),
        tf_keras.layers.Flatten(name="flatten"),
        tf_keras.layers.Dense(10, name="d1")])


def _images(b=16, seed=0):
    rng = np.random.default_rng(seed)
    return rng.random((b, 28, 28, 1), dtype=np.float32), rng.integers(0, 10, b).astype(np.int64)


def _tokens(b=16, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 64, (b, 8)).astype(np.int32), rng.integers(0, 10, b).astype(np.int64)


COVERAGE = [
    ("dense", models.mnist_mlp, "mlp_model_parallel", _images),
    ("conv2d", functools.partial(models.mnist_cnn, filters=(4, 8), hidden=16), "cnn_data_parallel",
     _images),
    ("batchnorm", _bn_cnn, "data_parallel", _images),
    ("transformer", functools.partial(models.tiny_transformer, dropout=0.0), "transformer_block",
     _tokens),
]


@pytest.mark.parametrize("spec", ["batch=4,model=2", "batch=2,model=4"])
@pytest.mark.parametrize("name, factory, table, data", COVERAGE, ids=[c[0] for c in COVERAGE])
def test_layer_parity_one_step(name, factory, table, data, spec):
    mesh = dtk.build_mesh(spec)
    model, _ = layouts.build_model(factory, mesh, layouts.load_table(table), seed=5,
                                   allow_replicated=True)
    tf_keras.utils.set_random_seed(5)
    plain = factory()
    x, y = data()
    w = np.ones(len(y), np.float32)
    packed = input_lib.pack(mesh, (x, y, w))
    steps = dtk.Steps(model, loss="sparse_categorical_crossentropy",
                      optimizer=tf_keras.optimizers.SGD(0.1, mesh=mesh), mesh=mesh)
    out = dtk.global_value(steps.predict(packed[0]))
    np.testing.assert_allclose(out, plain(x, training=False).numpy(), rtol=1e-5, atol=1e-6)

    loss = float(steps.train(packed))
    opt = tf_keras.optimizers.SGD(0.1)
    with tf.GradientTape() as tape:
        want = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)(
            y, plain(x, training=True))
    opt.apply_gradients(zip(tape.gradient(want, plain.trainable_variables),
                            plain.trainable_variables))
    np.testing.assert_allclose(loss, float(want), rtol=1e-5)
    for got, ref in zip(dtk.gather_weights(model), plain.get_weights()):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_dropout_trains_under_dtensor():
    mesh = dtk.build_mesh("batch=4,model=2")
    factory = functools.partial(models.tiny_transformer, dropout=0.5)
    model, plan = layouts.build_model(factory, mesh, layouts.load_table("transformer_block"),
                                      seed=1)
    x, y = _tokens()
    packed = input_lib.pack(mesh, (x, y, np.ones(16, np.float32)))
    steps = dtk.Steps(model, loss="sparse_categorical_crossentropy", optimizer="adam", mesh=mesh)
    losses = [float(steps.train(packed)) for _ in range(3)]
    assert all(np.isfinite(losses))
    train_out = dtk.global_value(model(packed[0], training=True))
    eval_out = dtk.global_value(model(packed[0], training=False))
    assert not np.allclose(train_out, eval_out)          # dropout is active in training
    assert "BatchNormalization" not in layouts.explain(plan)  # no note on layers it lacks


def test_variables_made_sharing_handle_compilation_keep_their_names_and_values():
    """Inside ``materialize.shared_handle_compilation`` (every laid-out build), handles are made
    without ``debug_name`` (DTensor then compiles the handle op once a shape, not once a
    variable); each variable stays its own, with its name, and the op is restored after, also
    after an error."""
    from tensorflow.python.ops import gen_resource_variable_ops as gen  # pylint: disable=import-outside-toplevel
    from dtk.parallel import materialize  # pylint: disable=import-outside-toplevel
    mesh = dtk.build_mesh("batch=8")
    original = gen.var_handle_op
    layout = dtensor.Layout.replicated(mesh, 2)
    with materialize.shared_handle_compilation(), materialize.shared_handle_compilation():
        assert gen.var_handle_op is not original
        made = [dtensor.DVariable(dtensor.call_with_layout(tf.fill, layout, [3, 2], float(i)),
                                  name=f"w{i}") for i in range(3)]
    assert gen.var_handle_op is original
    made[1].assign_add(dtensor.call_with_layout(tf.ones, layout, [3, 2]))
    assert [v.name for v in made] == ["w0:0", "w1:0", "w2:0"]
    assert [float(tf.reduce_sum(v.read_value())) for v in made] == [0.0, 12.0, 12.0]
    with pytest.raises(RuntimeError):
        with materialize.shared_handle_compilation():
            raise RuntimeError("a failed build")
    assert gen.var_handle_op is original


def test_planned_memory_counts_the_sharded_update_of_large_weights_only():
    """memory_per_device follows the step's rule (layouts.sharded_update_dims): on batch=8 the MLP's
    784 x 128 kernel (100,352 elements) has its 2 Adam slots and its float32 copy split 8 ways;
    its 128 + 1,280 + 10 other elements keep 2 replicated slots and no copy."""
    plan = layouts.plan_layouts("data_parallel", dtk.build_mesh("batch=8"), models.mnist_mlp,
                                allow_replicated=True)
    large, small = 784 * 128 * 4, (128 + 128 * 10 + 10) * 4
    assert layouts.memory_per_device(plan, optimizer_slots=2)["optimizer"] == 2 * (large + small)
    got = layouts.memory_per_device(plan, optimizer_slots=2, shard_optimizer_state=True)
    assert got["optimizer"] == 3 * large // 8 + 2 * small
    assert got["weights"] == large + small


def test_an_optional_rule_that_matches_nothing_is_a_note_not_a_warning(tmp_path):
    """Issue 70: the shipped MoE tables printed "WARNING: 4 rule(s) matched nothing" on the
    README's own commands: their dense-MLP rules serve models with only some expert blocks.
    Such a rule is ``optional = true``: matching nothing is a note in the plan (strict too),
    never silent; a rule not marked optional still warns."""
    rules = ('[[rules]]\npattern = "d[12].kernel"\ndims = ["unsharded", "model"]\n'
             '[[rules]]\npattern = "d[12].bias"\ndims = ["model"]\n'
             '[[rules]]\npattern = "d9.kernel"\ndims = ["unsharded", "model"]\noptional = true\n')
    mesh = dtk.build_mesh("batch=4,model=2")
    plan = layouts.plan_weights(_table(tmp_path, rules), mesh, MLP_PATHS, strict=True)
    assert plan.unused_rules == ()
    assert any("optional rule(s) ['d9.kernel'] (for other variants of the model) match no weight"
               in w for w in plan.warnings)
    assert "WARNING" not in layouts.explain(plan).splitlines()[-1]
    assert "note: optional rule(s) ['d9.kernel']" in layouts.explain(plan)
    with pytest.raises(ValueError, match=r"rule 3 \('d9.kernel'\): optional must be true or "
                                         r"false; got 'yes'"):
        _table(tmp_path, rules.replace("optional = true", 'optional = "yes"'))
