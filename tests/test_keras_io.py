"""keras.io's examples as written (tests/keras_io_zoo.py, issue 40): each trains through
``dtk.Trainer`` with the optimizer, loss and metrics its factory compiled, its first epoch on
``batch=8`` and, resumed from that epoch's checkpoint, its second on ``batch=4,model=2``, as on
``batch=1`` (every reported number at 1e-5), and exports a model that plain tf_keras loads with
the same weights and predictions. (Bit-identical resumes on one mesh: tests/test_trainer.py,
tests/test_user_models.py.)"""

import shutil

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import dtk
from dtk.train import checkpoint
from tests import keras_io_fit_pages as fit_pages
from tests import keras_io_zoo as zoo

# Two examples in the fast lane; every one in the whole suite (CI).
FAST = {"image_classification_from_scratch", "vae"}
# Models whose call draws random numbers at inference too (the VAE samples z): their export is
# compared by weights only.
RANDOM_AT_INFERENCE = {"vae"}


def _trainer(name, mesh_spec, **config):
    example = zoo.EXAMPLES[name]
    return dtk.Trainer(mesh=dtk.build_mesh(mesh_spec), model=example.factory,
                       layout="data_parallel", allow_replicated=True,
                       input_shape=example.input_shape,
                       config=dtk.TrainerConfig(seed=7, verbose=0, steps_per_execution=1,
                                                **config))


def _fit(name, mesh_spec_or_trainer, *, epochs=2, **config):
    trainer = (mesh_spec_or_trainer if isinstance(mesh_spec_or_trainer, dtk.Trainer)
               else _trainer(name, mesh_spec_or_trainer, **config))
    x, y = zoo.EXAMPLES[name].data()
    data = dtk.DistributedDataset(tf.data.Dataset.from_tensor_slices((x, y)), trainer.mesh,
                                  dtk.InputConfig(global_batch_size=zoo.B))
    return trainer.fit(data, epochs=epochs).history, trainer


def _check_starts_from_plain_tf_keras_weights(name, model):
    """A dtk build's initial weights are plain tf_keras's build with the same seed (issue 40)."""
    example = zoo.EXAMPLES[name]
    # plain tf_keras in the same process, after dtk (which turns on tf_keras's tf.random.Generator
    # mode, as DTensor requires: random layers then seed themselves differently)
    tf_keras.utils.set_random_seed(7)
    plain = example.factory()
    if not plain.built:
        plain(tf.zeros([1, *example.input_shape]))
    # keyed by where each weight lives (layer index, class, attribute), not by name or order
    want = checkpoint._weights_by_identity(plain)  # pylint: disable=protected-access
    got = checkpoint._weights_by_identity(model)  # pylint: disable=protected-access
    assert sorted(got) == sorted(want)
    for key, variable in want.items():
        np.testing.assert_array_equal(checkpoint.global_value(got[key]), variable.numpy(),
                                      err_msg=key)


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow)
                                  for n in zoo.EXAMPLES])
def test_keras_io_example_trains_like_one_device_resumes_and_exports(name, tmp_path):
    """The batch=8 build starts from plain tf_keras's initial weights (same seed); epoch 1 on
    batch=8, stopped, resumed onto batch=4,model=2 for epoch 2: every number either reports
    equals batch=1's (1e-5), so each mesh trains like one device and the checkpoint carries the
    whole state across meshes; then the export."""
    one, _ = _fit(name, "batch=1")
    ckpt = str(tmp_path / "ckpt")
    stopped = _trainer(name, "batch=8", checkpoint_dir=ckpt)
    _check_starts_from_plain_tf_keras_weights(name, stopped.model)
    _fit(name, stopped, epochs=1)
    history, resumed = _fit(name, "batch=4,model=2", epochs=2, checkpoint_dir=ckpt,
                            allow_change=("mesh",))
    # it resumed after epoch 1, it did not start again
    assert resumed.restored_checkpoint.endswith(f"ckpt-{stopped.global_step}")
    assert resumed.global_step == 2 * stopped.global_step
    assert set(history) == set(one), (sorted(history), sorted(one))
    for key, values in one.items():
        for epoch, spec in enumerate(("batch=8", "batch=4,model=2 (resumed)")):
            np.testing.assert_allclose(history[key][epoch], values[epoch], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{name}, epoch {epoch + 1} on {spec}: {key}")
    got = dtk.gather_weights(resumed.model)
    # Exported: plain tf_keras loads it, with the trained weights and (where the model's call is
    # deterministic) the same predictions.
    # Exported: the model's weights (its own metric objects' state starts afresh, as in Keras).
    kept = [i for i, w in enumerate(resumed.model.weights) if id(w) not in {
        id(v) for m in checkpoint._metric_objects(resumed.model) for v in m.variables}]  # pylint: disable=protected-access
    got = [got[i] for i in kept]
    # The .keras file, which is what the test reads (a SavedModel is written and served by
    # test_trainer.py::test_export_round_trip and the nested-layer export of test_keras_contract.py).
    paths = resumed.export(str(tmp_path / "export"), formats=["keras"])
    example = zoo.EXAMPLES[name]
    if example.keras_loads:
        loaded = tf_keras.models.load_model(paths["keras"], custom_objects=example.custom_objects)
    else:  # plain tf_keras cannot revive the class from its config, with or without dtk
        loaded = example.factory()
        if not loaded.built:
            loaded(tf.zeros([1, *example.input_shape]))
        loaded.load_weights(paths["keras"])
    state = {id(v) for m in checkpoint._metric_objects(loaded) for v in m.variables}  # pylint: disable=protected-access
    exported = [w.numpy() for w in loaded.weights if id(w) not in state]
    assert len(exported) == len(got)
    for g, w in zip(exported, got):
        np.testing.assert_array_equal(g, w)
    if name not in RANDOM_AT_INFERENCE:
        x, y = zoo.EXAMPLES[name].data()
        data = dtk.DistributedDataset(tf.data.Dataset.from_tensor_slices((x, y)), resumed.mesh,
                                      dtk.InputConfig(global_batch_size=zoo.B))
        predicted = resumed.predict(data)
        expected = loaded.predict(x, verbose=0)
        for p, e in zip(tf.nest.flatten(predicted), tf.nest.flatten(expected)):
            np.testing.assert_allclose(p, e, rtol=1e-5, atol=1e-6)


def test_the_zoo_covers_the_pages_the_issue_names():
    pages = " | ".join(e.page for e in zoo.EXAMPLES.values())
    for words in ("MNIST convnet", "Bidirectional LSTM on IMDB", "Text classification with "
                  "Transformer", "Customizing what happens in fit() (train_step)", "no compiled "
                  "loss", "multi-input, multi-output", "U-Net", "3D image", "Next-frame",
                  "Timeseries", "Variational AutoEncoder", "autoencoder"):
        assert words in pages, words
    assert len(zoo.EXAMPLES) >= 15


# Pages whose model draws random numbers in training (Dropout, random augmentation, the VAE's
# sampling): with dtk.distribute they draw dtk's mesh-invariant numbers (keyed by seed, step,
# layer and example), so they equal each other on every mesh but not plain tf_keras's draws.
DRAWS_IN_TRAINING = {"mnist_convnet", "image_classification_from_scratch", "ct_3d",
                     "structured_data", "vae"}
FAST_FIT = {"customizing_fit"}  # a custom train_step; the rest in the whole suite


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST_FIT else pytest.mark.slow)
                                  for n in zoo.EXAMPLES])
def test_keras_io_page_trains_with_keras_own_fit(name):
    """Issue 58: each page as written (its factory compiles it), plus one line,
    ``dtk.distribute``, trained by tf_keras's own ``model.fit`` on batch=4,model=2:
    every logged number equals plain tf_keras's ``fit`` (1e-5); for a page that draws random
    numbers in training, equals batch=1's (dtk's draws do not depend on the mesh)."""
    example = zoo.EXAMPLES[name]
    x, y = example.data()
    random = name in DRAWS_IN_TRAINING
    histories = {}
    # batch=8 through Keras's fit is the acceptance pages' (test_keras_io_fit_page), and this
    # zoo's Trainer test runs it on both meshes: here the model-sharded mesh.
    for spec in ("batch=4,model=2",) + (("batch=1",) if random else ()):
        model = dtk.distribute(example.factory, dtk.build_mesh(spec), seed=7,
                               allow_replicated=True, input_shape=example.input_shape)
        histories[spec] = model.fit(x, y, batch_size=zoo.B, epochs=2, shuffle=False,
                                    verbose=0).history
    if random:
        label, want = "batch=1", histories.pop("batch=1")
    else:
        tf_keras.utils.set_random_seed(7)
        plain = example.factory()
        label, want = "plain tf_keras", plain.fit(x, y, batch_size=zoo.B, epochs=2,
                                                  shuffle=False, verbose=0).history
    for spec, got in histories.items():
        assert set(got) == set(want), (spec, sorted(got), sorted(want))
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{name} on {spec} vs {label}: {key}")


# -- issue 58's acceptance pages: the page's own compile() and fit() call -----------------------
class _CopyAfterFirstEpoch(tf_keras.callbacks.Callback):
    """Copies the checkpoint directory as it stands after epoch 1 (after dtk.CheckpointCallback,
    which comes before it, wrote that epoch's checkpoint), without the run's lock: a run killed
    after its first epoch leaves that directory, and a run started on it resumes at epoch 2.
    One uninterrupted run then gives both the reference numbers and the state to resume."""

    def __init__(self, directory, to):
        super().__init__()
        self.directory, self.to = directory, to

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            shutil.copytree(self.directory, self.to,
                            ignore=shutil.ignore_patterns(checkpoint._LOCK_FILE))  # pylint: disable=protected-access


class _EpochWeights(tf_keras.callbacks.Callback):
    """The weights at each epoch's end, before the page's callbacks act on them (an
    EarlyStopping's restore_best_weights acts on its own state, which no resume carries)."""

    def __init__(self):
        super().__init__()
        self.last = None

    def on_epoch_end(self, epoch, logs=None):
        self.last = dtk.gather_weights(self.model)


def _fit_page(name, spec, *callbacks):
    page = fit_pages.PAGES[name]
    # shuffle=False: Keras draws each epoch's order from the process's seed, which a resumed
    # process does not continue (for its own BackupAndRestore as for dtk's callback); the order
    # is Keras's, drawn on the host before dtk packs the batch, so it is no part of the mesh.
    kwargs = dict(page.fit(), shuffle=False)
    kwargs["callbacks"] = list(callbacks) + list(kwargs.get("callbacks") or [])
    model = fit_pages.model_for(page, spec)
    return model, model.fit(**kwargs).history


def _inputs_of(kwargs):
    """One batch of the page's inputs (to compare predictions)."""
    x = kwargs["x"]
    if isinstance(x, tf.data.Dataset):
        element = next(iter(x))
        return element[0] if isinstance(element, tuple) else element
    return tf.nest.map_structure(lambda a: a[:fit_pages.B], x)


# Models whose own call is not their inference (keras.io's GAN trains through train_step only):
# their export is compared by weights.
NO_PREDICT = {"dcgan"}


@pytest.mark.parametrize("name", list(fit_pages.PAGES))
def test_keras_io_fit_page(name, tmp_path):
    """Each page's model, compile() and fit() call as the page writes them (callbacks,
    class_weight, validation, custom compile() and train_step), plus ``dtk.distribute``: on
    batch=8 every logged number equals plain tf_keras's fit (1e-5), or, for a page that draws
    random numbers in training, batch=1's (dtk's draws do not depend on the mesh; plain tf_keras
    draws others). The batch=8 run also checkpoints (dtk.CheckpointCallback beside the page's
    callbacks); the page's fit run again as written, on batch=4,model=2, on the directory as it
    stood after epoch 1 (what a run killed there leaves) resumes at epoch 2 with the reference's
    numbers and the uninterrupted run's weights: the checkpoint carries the whole state (weights,
    optimizer, the page's callbacks) across meshes, and the second mesh trains like one device.
    (Bit-for-bit resume on the same mesh: ``tests/test_stop_and_rerun.py``,
    ``tests/test_user_keras_code.py``.) The resumed model's save() loads in plain tf_keras (its
    factory, where the page's classes have no get_config) with the same weights and
    predictions."""
    page = fit_pages.PAGES[name]
    ckpt, after_first = str(tmp_path / "ckpt"), str(tmp_path / "after_first_epoch")
    if page.draws:  # dtk's draws are the reference; plain tf_keras's draws are others
        label, want = "batch=1", _fit_page(name, "batch=1")[1]
    else:
        label, want = "plain tf_keras", _fit_page(name, "plain")[1]
    # its directory as it stood after epoch 1 is what a run killed there would have left (the
    # kill itself is test_checkpoint_faults.py's)
    weights = _EpochWeights()
    _, got = _fit_page(name, "batch=8", dtk.CheckpointCallback(ckpt),
                       _CopyAfterFirstEpoch(ckpt, after_first), weights)
    straight = weights.last
    assert set(got) == set(want), (sorted(got), sorted(want))
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=page.rtol, atol=page.atol,
                                   err_msg=f"{name} on batch=8 vs {label}: {key}")

    resume, weights = dtk.CheckpointCallback(after_first), _EpochWeights()
    resumed, rest = _fit_page(name, "batch=4,model=2", resume, weights)
    assert resume.restored_epoch == 1
    if not page.resume_differs:
        assert set(rest) == set(want), (sorted(rest), sorted(want))
        for key, values in want.items():
            np.testing.assert_allclose(
                rest[key], values[1:], rtol=page.rtol, atol=page.atol,
                err_msg=f"{name}, epoch 2 resumed on batch=4,model=2 vs {label}: {key}")
        for a, b in zip(straight, weights.last):
            # near-zero weights: 1e-5 (float32), 1/256 of the scale in bfloat16 pages
            np.testing.assert_allclose(b, a, rtol=page.rtol,
                                       atol=1e-5 if page.rtol <= 1e-5 else page.rtol / 16)

    path = str(tmp_path / "model.keras")
    resumed.save(path)
    custom = {k: v for k, v in vars(fit_pages).items() if isinstance(v, type)}
    try:
        loaded = tf_keras.models.load_model(path, custom_objects=custom, compile=False)
    except (TypeError, ValueError, NotImplementedError):  # a page class without get_config
        loaded = fit_pages.model_for(page, "plain")
        loaded.load_weights(path)
    state = {id(v) for m in checkpoint._metric_objects(loaded) for v in m.variables}  # pylint: disable=protected-access
    mine = {id(v) for m in checkpoint._metric_objects(resumed) for v in m.variables}  # pylint: disable=protected-access
    exported = [w.numpy() for w in loaded.weights if id(w) not in state]
    trained = [w for w, v in zip(dtk.gather_weights(resumed), resumed.weights) if id(v) not in mine]
    assert len(exported) == len(trained)
    for e, t in zip(exported, trained):
        np.testing.assert_array_equal(e, t)
    if name not in NO_PREDICT:
        x = _inputs_of(page.fit())
        for p, e in zip(tf.nest.flatten(resumed.predict(x, verbose=0)),
                        tf.nest.flatten(loaded.predict(x, verbose=0))):
            np.testing.assert_allclose(p, e, rtol=1e-5, atol=1e-6)
