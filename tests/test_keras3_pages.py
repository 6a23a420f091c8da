"""keras.io's Keras 3 pages on the mesh (issue 68): each page of ``tests/keras3_pages.py`` as its
page writes it, plus ``dtk.enable_keras_distribution()`` and a distribution, on (data, model)
meshes (1, 1), (8, 1) and (2, 4). Pages without random draws equal plain Keras 3 on one device
(their tolerance; on (2, 4) in the resume test's uninterrupted run); pages with random draws
equal (1, 1) on every mesh. On (2, 4) each page's
fit killed after epoch 1 resumes through Keras's BackupAndRestore to the uninterrupted run's
weights, and its weights file loads into plain Keras 3 with the same predictions."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import dtk

import keras  # noqa: E402  (Keras 3: TensorFlow 2.21 installs it)
from tests import keras3_pages  # noqa: E402  pylint: disable=g-import-not-at-top
from tests.keras3_pages import PAGES  # noqa: E402  pylint: disable=g-import-not-at-top

dtk.enable_keras_distribution()
SHAPES = [(1, 1), (8, 1), (2, 4)]


def _distribution(page, shape):
    devices = keras.distribution.list_devices()[:shape[0] * shape[1]]
    mesh = keras.distribution.DeviceMesh(shape=shape, axis_names=["data", "model"],
                                         devices=devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    for key, axes in page.model_keys.items():  # (a Sequential's paths start with its name)
        layout_map[f"(.*/)?{key}"] = axes
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data")


def _run(name, shape=None, callbacks=(), prebuild=None):
    """The page's build and fit (and predict), under a distribution on ``shape`` or plain.
    With ``callbacks`` (BackupAndRestore), a subclassed model is built by a call first, as
    Keras's BackupAndRestore requires."""
    page = PAGES[name]
    keras.distribution.set_distribution(None if shape is None else _distribution(page, shape))
    try:
        keras.utils.set_random_seed(0)
        model = page.build()
        fit = page.fit()
        if (bool(callbacks) if prebuild is None else prebuild) and not model.built:
            model(keras3_pages.predict_input(fit))
        fit["callbacks"] = [*fit.get("callbacks", []), *callbacks]
        history = model.fit(**fit, shuffle=False, verbose=0).history
        predictions = (model.predict(keras3_pages.predict_input(page.fit()), batch_size=16,
                                     verbose=0) if page.predict else None)
        return model, history, predictions, [np.asarray(w) for w in model.get_weights()]
    finally:
        keras.distribution.set_distribution(None)


@functools.lru_cache(maxsize=None)
def _reference(name):
    """Plain Keras 3 on one device, or, for a page with random draws, (1, 1) on the mesh."""
    return _run(name, None if not PAGES[name].random else (1, 1))[1:]


def _close(page, want, got, what):
    for a, b in zip(keras.tree.flatten(want), keras.tree.flatten(got)):
        np.testing.assert_allclose(np.asarray(b, np.float64), np.asarray(a, np.float64),
                                   rtol=page.rtol, atol=page.atol, err_msg=what)


def test_there_are_twenty_pages():
    assert len(PAGES) >= 20


# (a page with random draws has (1, 1) as its reference, so it runs on the other two; a page
# without is held to its reference on (2, 4) by the resume test below, whose uninterrupted run
# is that very run)
CASES = [(name, shape) for name in sorted(PAGES) for shape in SHAPES
         if not (PAGES[name].random and shape == (1, 1)) and
         (PAGES[name].random or shape != (2, 4))]


def _equals_reference(name, run) -> int:
    """Asserts ``run`` equals the page's reference; returns how many arrays it compared."""
    page = PAGES[name]
    want_history, want_predictions, want_weights = _reference(name)
    model, history, predictions, weights = run
    assert set(history) == set(want_history)
    for key in want_history:
        _close(page, want_history[key], history[key], key)
    if page.predict:
        _close(page, want_predictions, predictions, "predict")
    _close(page, want_weights, weights, "weights")
    if name == "transfer_learning":  # the frozen base did not move
        base = model.get_layer("base").get_layer("base1").kernel
        np.testing.assert_array_equal(np.asarray(base), want_weights[0])
    return len(want_history) + len(want_weights) + bool(page.predict)


@pytest.mark.slow
@pytest.mark.parametrize("name, shape", CASES)
def test_a_keras_io_page_on_the_mesh_equals_its_reference(name, shape):
    # (every logged number, the predictions and every weight; a page has at least a loss and
    # a weight)
    assert _equals_reference(name, _run(name, shape)) >= 2


class _KillAfterFirstEpoch(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            raise RuntimeError("killed")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PAGES))
def test_a_page_killed_and_resumed_and_its_weights_loaded_in_plain_keras(name, tmp_path):
    """On (2, 4): killed after epoch 1, BackupAndRestore resumes to the uninterrupted run's
    weights (pages without random draws: Keras's BackupAndRestore restores no seed state, in
    plain Keras 3 either); the weights file of the sharded model loads into the page's model built by plain
    Keras 3 (no distribution), which then predicts the same."""
    page = PAGES[name]
    if page.random:  # (Keras's BackupAndRestore does not restore SeedGenerator states: a
        # page that draws random numbers resumes 5e-3 off in plain Keras 3 too, measured)
        model, _, predictions, weights = _run(name, (2, 4))
    else:
        # (the reference built as the resumed runs are: a subclassed model by a call first);
        # this uninterrupted run on (2, 4) is also the page's (2, 4) case against plain Keras 3
        straight = _run(name, (2, 4), callbacks=[keras.callbacks.Callback()])
        _equals_reference(name, straight)
        want = straight[3]
        backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
        with pytest.raises(RuntimeError, match="killed"):
            _run(name, (2, 4), callbacks=[backup, _KillAfterFirstEpoch()])
        # the resumed model is the one saved below
        model, _, predictions, weights = _run(name, (2, 4), callbacks=[
            keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))])
        assert len(weights) == len(want)
        _close(page, want, weights, "resumed weights")
    if not model.built:  # (a GAN or VAE whose call is never made: Keras saves no unbuilt model)
        return
    path = str(tmp_path / "page.weights.h5")
    keras.distribution.set_distribution(_distribution(page, (2, 4)))
    model.save_weights(path)
    keras.distribution.set_distribution(None)
    keras.utils.set_random_seed(1)
    plain = page.build()
    if not plain.built:  # a subclassed page model: built by its first batch
        plain(keras3_pages.predict_input(page.fit())) if page.predict else None
    assert plain.built, f"page {name}: plain Keras 3 could not build the page's model"
    if plain.built:
        plain.load_weights(path)
        for a, b in zip(weights, plain.get_weights()):
            np.testing.assert_array_equal(np.asarray(b), a)
        if page.predict:
            _close(page, predictions,
                   plain.predict(keras3_pages.predict_input(page.fit()), batch_size=16,
                                 verbose=0), "plain predict")
