"""The layer table: every built-in tf_keras layer that can sit in a trained model, in a tiny model.

Each row trains 2 Adam steps on ``batch=8`` and must equal plain tf_keras on one device (1e-5 on
the losses; ``batch=1`` equals one device, tested elsewhere), or fail before the first step with a
message that names the layer, or is excluded with its reason. Random layers draw other numbers
than plain tf_keras (dtk.parallel.randomness), so their rows must equal dtk on ``batch=1`` instead: the draws
do not depend on the mesh. The few that draw outside Keras's generator train and are named in
one warning.
Every laid-out variable's actual layout is checked against its plan.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor

import dtk
from dtk.data import input as input_lib
from dtk.parallel import layouts

L = tf_keras.layers
B = 16
CLASSES = 3
PARITY, RANDOM, REFUSED = "parity", "random", "refused"
UNCOVERED = "uncovered"  # trains; draws per device, named in a warning (dtk.parallel.randomness)

# Input kinds: one example's shape and dtype.
INPUTS = {"img": ((8, 8, 3), "float32"), "seq": ((6, 4), "float32"), "vec": ((12,), "float32"),
          "vol": ((4, 4, 4, 2), "float32"), "ids": ((6,), "int32"),
          "frames": ((3, 5, 2), "float32"), "frames2d": ((3, 5, 5, 2), "float32"),
          "frames3d": ((2, 3, 3, 3, 2), "float32")}


def _head(x):
    if len(x.shape) > 2:
        x = L.Flatten()(x)
    return L.Dense(CLASSES, name="head")(x)


def single(make, kind="img"):
    """A model: Input -> the layer -> Flatten -> Dense."""
    def factory():
        inputs = tf_keras.Input(INPUTS[kind][0], dtype=INPUTS[kind][1])
        return tf_keras.Model(inputs, _head(make()(inputs)))
    return factory, kind


def merge(make, kind="vec"):
    """A model whose layer takes two inputs: x and Dense(x)."""
    def factory():
        inputs = tf_keras.Input(INPUTS[kind][0])
        other = L.Dense(INPUTS[kind][0][-1], name="other")(inputs)
        return tf_keras.Model(inputs, _head(make()([inputs, other])))
    return factory, kind


def attention(make):
    def factory():
        inputs = tf_keras.Input(INPUTS["seq"][0])
        return tf_keras.Model(inputs, _head(make()([inputs, inputs])))
    return factory, "seq"


# name -> (factory, input kind, expectation)
TABLE = {
    # core
    "Dense": (*single(lambda: L.Dense(5), "vec"), PARITY),
    "EinsumDense": (*single(lambda: L.EinsumDense("ab,bc->ac", output_shape=5), "vec"), PARITY),
    "Activation": (*single(lambda: L.Activation("tanh"), "vec"), PARITY),
    "Embedding": (*single(lambda: L.Embedding(10, 4), "ids"), PARITY),
    "Identity": (*single(lambda: L.Identity(), "vec"), PARITY),
    "Lambda": (*single(lambda: L.Lambda(lambda t: t * 2.0), "vec"), PARITY),
    "Masking": (*single(lambda: L.Masking(0.0), "seq"), PARITY),
    # convolutions
    "Conv1D": (*single(lambda: L.Conv1D(4, 3), "seq"), PARITY),
    "Conv2D": (*single(lambda: L.Conv2D(4, 3), "img"), PARITY),
    "Conv3D": (*single(lambda: L.Conv3D(3, 2), "vol"), PARITY),
    "Conv1DTranspose": (*single(lambda: L.Conv1DTranspose(4, 3), "seq"), PARITY),
    "Conv2DTranspose": (*single(lambda: L.Conv2DTranspose(4, 3, strides=2), "img"), PARITY),
    "Conv3DTranspose": (*single(lambda: L.Conv3DTranspose(2, 2), "vol"), PARITY),
    "DepthwiseConv1D": (*single(lambda: L.DepthwiseConv1D(3, padding="same"), "seq"), PARITY),
    "DepthwiseConv2D": (*single(lambda: L.DepthwiseConv2D(3, strides=2, padding="same"), "img"),
                        PARITY),
    "SeparableConv1D": (*single(lambda: L.SeparableConv1D(4, 3), "seq"), PARITY),
    "SeparableConv2D": (*single(lambda: L.SeparableConv2D(4, 3), "img"), PARITY),
    "LocallyConnected1D": (*single(lambda: L.LocallyConnected1D(3, 3), "seq"), PARITY),
    "LocallyConnected2D": (*single(lambda: L.LocallyConnected2D(2, 3), "img"), PARITY),
    # pooling
    "MaxPooling1D": (*single(lambda: L.MaxPooling1D(), "seq"), PARITY),
    "MaxPooling2D": (*single(lambda: L.MaxPooling2D(), "img"), PARITY),
    "MaxPooling3D": (*single(lambda: L.MaxPooling3D(), "vol"), PARITY),
    "AveragePooling1D": (*single(lambda: L.AveragePooling1D(), "seq"), PARITY),
    "AveragePooling2D": (*single(lambda: L.AveragePooling2D(), "img"), PARITY),
    "AveragePooling2D(3,2,same)": (*single(lambda: L.AveragePooling2D(3, 2, padding="same"),
                                           "img"), PARITY),
    "AveragePooling3D": (*single(lambda: L.AveragePooling3D(), "vol"), PARITY),
    "AveragePooling3D(3,2,same)": (*single(lambda: L.AveragePooling3D(3, 2, "same"), "vol"),
                                   PARITY),
    "GlobalAveragePooling1D": (*single(lambda: L.GlobalAveragePooling1D(), "seq"), PARITY),
    "GlobalAveragePooling2D": (*single(lambda: L.GlobalAveragePooling2D(), "img"), PARITY),
    "GlobalAveragePooling3D": (*single(lambda: L.GlobalAveragePooling3D(), "vol"), PARITY),
    "GlobalMaxPooling1D": (*single(lambda: L.GlobalMaxPooling1D(), "seq"), PARITY),
    "GlobalMaxPooling2D": (*single(lambda: L.GlobalMaxPooling2D(), "img"), PARITY),
    "GlobalMaxPooling3D": (*single(lambda: L.GlobalMaxPooling3D(), "vol"), PARITY),
    # recurrent
    "SimpleRNN": (*single(lambda: L.SimpleRNN(4), "seq"), PARITY),
    "LSTM": (*single(lambda: L.LSTM(4), "seq"), PARITY),
    "GRU": (*single(lambda: L.GRU(4, return_sequences=True), "seq"), PARITY),
    "RNN(LSTMCell)": (*single(lambda: L.RNN(L.LSTMCell(4)), "seq"), PARITY),
    "RNN(StackedRNNCells)": (*single(lambda: L.RNN(L.StackedRNNCells(
        [L.SimpleRNNCell(4), L.GRUCell(3)])), "seq"), PARITY),
    "Bidirectional": (*single(lambda: L.Bidirectional(L.LSTM(3)), "seq"), PARITY),
    "TimeDistributed": (*single(lambda: L.TimeDistributed(L.Dense(3)), "seq"), PARITY),
    "ConvLSTM1D": (*single(lambda: L.ConvLSTM1D(2, 2), "frames"), PARITY),
    "ConvLSTM2D": (*single(lambda: L.ConvLSTM2D(2, 3, padding="same", return_sequences=True),
                           "frames2d"), PARITY),
    "ConvLSTM2D(go_backwards)": (*single(lambda: L.ConvLSTM2D(2, 3, go_backwards=True),
                                         "frames2d"), PARITY),
    "ConvLSTM3D": (*single(lambda: L.ConvLSTM3D(2, 2), "frames3d"), PARITY),
    "ConvLSTM2D(8 filters, valid, strides)": (*single(lambda: L.ConvLSTM2D(
        8, 3, strides=2, return_sequences=True), "frames2d"), PARITY),
    # normalization
    "BatchNormalization": (*single(lambda: L.BatchNormalization(), "img"), PARITY),
    "LayerNormalization": (*single(lambda: L.LayerNormalization(), "seq"), PARITY),
    "GroupNormalization": (*single(lambda: L.GroupNormalization(groups=3), "img"), PARITY),
    "UnitNormalization": (*single(lambda: L.UnitNormalization(), "vec"), PARITY),
    "Normalization(mean, variance)": (*single(lambda: L.Normalization(
        mean=[0.5, 0.4, 0.3], variance=[0.1, 0.2, 0.3]), "img"), PARITY),
    "Normalization(unadapted)": (*single(lambda: L.Normalization(), "img"), PARITY),
    # attention and merging
    "Attention": (*attention(lambda: L.Attention()), PARITY),
    "AdditiveAttention": (*attention(lambda: L.AdditiveAttention()), PARITY),
    "MultiHeadAttention": (*single(lambda: _SelfAttention(), "seq"), PARITY),
    "Add": (*merge(lambda: L.Add()), PARITY),
    "Subtract": (*merge(lambda: L.Subtract()), PARITY),
    "Multiply": (*merge(lambda: L.Multiply()), PARITY),
    "Average": (*merge(lambda: L.Average()), PARITY),
    "Maximum": (*merge(lambda: L.Maximum()), PARITY),
    "Minimum": (*merge(lambda: L.Minimum()), PARITY),
    "Concatenate": (*merge(lambda: L.Concatenate()), PARITY),
    "Dot": (*merge(lambda: L.Dot(axes=1)), PARITY),
    # activations
    "ReLU": (*single(lambda: L.ReLU(), "vec"), PARITY),
    "LeakyReLU": (*single(lambda: L.LeakyReLU(), "vec"), PARITY),
    "PReLU": (*single(lambda: L.PReLU(), "vec"), PARITY),
    "ELU": (*single(lambda: L.ELU(), "vec"), PARITY),
    "ThresholdedReLU": (*single(lambda: L.ThresholdedReLU(0.3), "vec"), PARITY),
    "Softmax": (*single(lambda: L.Softmax(), "vec"), PARITY),
    # reshaping
    "Flatten": (*single(lambda: L.Flatten(), "img"), PARITY),
    "Reshape": (*single(lambda: L.Reshape((3, 4)), "vec"), PARITY),
    "Permute": (*single(lambda: L.Permute((2, 1)), "seq"), PARITY),
    "RepeatVector": (*single(lambda: L.RepeatVector(2), "vec"), PARITY),
    "Cropping1D": (*single(lambda: L.Cropping1D(1), "seq"), PARITY),
    "Cropping2D": (*single(lambda: L.Cropping2D(1), "img"), PARITY),
    "Cropping3D": (*single(lambda: L.Cropping3D(1), "vol"), PARITY),
    "UpSampling1D": (*single(lambda: L.UpSampling1D(), "seq"), PARITY),
    "UpSampling2D": (*single(lambda: L.UpSampling2D(), "img"), PARITY),
    "UpSampling3D": (*single(lambda: L.UpSampling3D(), "vol"), PARITY),
    "ZeroPadding1D": (*single(lambda: L.ZeroPadding1D(), "seq"), PARITY),
    "ZeroPadding2D": (*single(lambda: L.ZeroPadding2D(), "img"), PARITY),
    "ZeroPadding3D": (*single(lambda: L.ZeroPadding3D(), "vol"), PARITY),
    # preprocessing that runs on float tensors in the model
    "Rescaling": (*single(lambda: L.Rescaling(1 / 255.0, offset=0.1), "img"), PARITY),
    "Resizing": (*single(lambda: L.Resizing(6, 6), "img"), PARITY),
    "CenterCrop": (*single(lambda: L.CenterCrop(6, 6), "img"), PARITY),
    "Discretization": (*single(lambda: L.Discretization(bin_boundaries=[0.3, 0.6]), "vec"),
                       PARITY),
    "ActivityRegularization": (*single(lambda: L.ActivityRegularization(l2=0.01), "vec"),
                               PARITY),
    # random layers: equal on every mesh (dtk.parallel.randomness); a few draw outside it (UNCOVERED)
    "Dropout": (*single(lambda: L.Dropout(0.3), "vec"), RANDOM),
    # EfficientNet's stochastic depth: a mask per example (noise_shape with a None dim).
    "Dropout(noise_shape)": (*single(lambda: L.Dropout(0.3, noise_shape=(None, 1, 1, 1)),
                                     "img"), RANDOM),
    "AlphaDropout": (*single(lambda: L.AlphaDropout(0.3), "vec"), RANDOM),
    "GaussianDropout": (*single(lambda: L.GaussianDropout(0.3), "vec"), RANDOM),
    "GaussianNoise": (*single(lambda: L.GaussianNoise(0.3), "vec"), RANDOM),
    "SpatialDropout1D": (*single(lambda: L.SpatialDropout1D(0.3), "seq"), RANDOM),
    "SpatialDropout2D": (*single(lambda: L.SpatialDropout2D(0.3), "img"), RANDOM),
    "LSTM(dropout, recurrent_dropout, unroll)": (*single(
        lambda: L.LSTM(4, dropout=0.2, recurrent_dropout=0.2, unroll=True), "seq"), RANDOM),
    "GRU(dropout)": (*single(lambda: L.GRU(4, dropout=0.2), "seq"), REFUSED),  # needs unroll=True
    "MultiHeadAttention(dropout)": (*single(
        lambda: _SelfAttention(dropout=0.3), "seq"), RANDOM),
    "RandomFlip": (*single(lambda: L.RandomFlip(), "img"), RANDOM),
    "RandomFlip(horizontal)": (*single(lambda: L.RandomFlip("horizontal"), "img"), RANDOM),
    "RandomContrast": (*single(lambda: L.RandomContrast(0.2), "img"), UNCOVERED),
    "RandomBrightness": (*single(lambda: L.RandomBrightness(0.2), "img"), RANDOM),
    "RandomCrop": (*single(lambda: L.RandomCrop(6, 6), "img"), RANDOM),
    "RandomRotation": (*single(lambda: L.RandomRotation(0.2), "img"), RANDOM),
    "RandomRotation(nearest, constant)": (*single(lambda: L.RandomRotation(
        0.3, fill_mode="constant", interpolation="nearest", fill_value=0.5), "img"), RANDOM),
    "RandomTranslation": (*single(lambda: L.RandomTranslation(0.2, 0.2), "img"), RANDOM),
    "RandomTranslation(wrap)": (*single(lambda: L.RandomTranslation(0.3, 0.3, fill_mode="wrap"),
                                        "img"), RANDOM),
    "RandomZoom": (*single(lambda: L.RandomZoom(0.2), "img"), RANDOM),
    "RandomZoom(nearest fill)": (*single(lambda: L.RandomZoom((-0.3, 0.3), fill_mode="nearest"),
                                         "img"), RANDOM),
}

# Layers that cannot be a trained model's layer on their own, with the reason.
EXCLUDED = {
    "InputLayer": "the model's input, no computation",
    "SpectralNormalization": "fails in plain tf_keras 2.21 itself (its InputSpec check)",
    "Layer": "the base class", "Wrapper": "abstract base of wrappers",
    "AbstractRNNCell": "abstract base of cells",
    "LSTMCell": "a cell: trains inside RNN (row RNN(LSTMCell))",
    "GRUCell": "a cell: trains inside RNN (row RNN(StackedRNNCells))",
    "SimpleRNNCell": "a cell: trains inside RNN (row RNN(StackedRNNCells))",
    "StackedRNNCells": "cells: trains inside RNN (row RNN(StackedRNNCells))",
    "RNN": "generic loop over a cell (rows RNN(...))",
    "DenseFeatures": "feature columns on dict inputs, a tf.estimator-era input layer",
    "StringLookup": "string tables run in the tf.data pipeline, not on the mesh",
    "IntegerLookup": "lookup tables run in the tf.data pipeline, not on the mesh",
    "TextVectorization": "string ops run in the tf.data pipeline, not on the mesh",
    "Hashing": "string/integer hashing runs in the tf.data pipeline",
    "HashedCrossing": "feature crossing runs in the tf.data pipeline",
    "CategoryEncoding": "multi-hot encoding of ids runs in the tf.data pipeline",
    "Normalization": "rows Normalization(mean, variance), Normalization(unadapted); adapt() "
                     "in a factory: test_user_models",
    "MultiHeadAttention": "row MultiHeadAttention (self-attention wrapper)",
    "SpatialDropout3D": "random, as SpatialDropout2D",
    "RandomHeight": "random augmentation with a data-dependent output shape",
    "RandomWidth": "random augmentation with a data-dependent output shape",
}


class _SelfAttention(L.Layer):
    """MultiHeadAttention as a one-input layer (query = value = the input)."""

    def __init__(self, dropout=0.0, **kwargs):
        super().__init__(**kwargs)
        self.mha = L.MultiHeadAttention(num_heads=2, key_dim=3, dropout=dropout)

    def call(self, x, training=None):
        return self.mha(x, x, training=training)


def _base_name(row: str) -> str:
    return row.split("(")[0]


def test_every_builtin_layer_has_a_row():
    import inspect  # pylint: disable=g-import-not-at-top
    classes = {}
    for name in dir(L):
        obj = getattr(L, name)
        if inspect.isclass(obj) and issubclass(obj, L.Layer):
            classes.setdefault(obj, []).append(name)
    covered = {_base_name(row) for row in TABLE} | set(EXCLUDED)
    missing = [min(names, key=len) for cls, names in classes.items()
               if not covered & set(names)]
    assert not missing, f"layers with no row in the layer table: {sorted(missing)}"


def _data(kind, seed=0):
    rng = np.random.default_rng(seed)
    shape, dtype = INPUTS[kind]
    x = (rng.integers(0, 10, (2, B, *shape)) if dtype == "int32"
         else rng.random((2, B, *shape))).astype(dtype)
    return x, rng.integers(0, CLASSES, (2, B)).astype(np.int64)


def _plain_losses(factory, x, y):
    tf_keras.utils.set_random_seed(3)
    model = factory()
    opt = tf_keras.optimizers.Adam(1e-2)
    loss_fn = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    losses = []
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            loss = loss_fn(y[i], model(x[i], training=True))
            total = loss + sum(model.losses)  # reported and trained on, as Keras does
        opt.apply_gradients(zip(tape.gradient(total, model.trainable_variables),
                                model.trainable_variables))
        losses.append(float(total))
    return np.array(losses)


@pytest.fixture(scope="module")
def mesh():
    return dtk.build_mesh("batch=8")


def assert_layouts_match_plan(model, plan, mesh):
    """Each variable's actual layout is the one its plan names (not merely the same values)."""
    paths = dict(layouts.weight_paths(model))
    for weight in plan.weights:
        variable = paths[weight.path]
        variable = getattr(variable, "_variable", variable)
        got = dtensor.fetch_layout(variable)
        assert got == plan.layout(weight.path, mesh), (
            f"{weight.path}: {got.sharding_specs} but the plan says {weight.dims}")


# The fast lane runs a row per kind of handling; the whole suite (CI) runs every row.
FAST_ROWS = {"Dense", "DepthwiseConv2D", "AveragePooling2D(3,2,same)", "LSTM", "Discretization",
             "Normalization(mean, variance)", "RandomFlip", "Dropout", "RandomRotation"}


def _dtk_losses(factory, mesh, x, y):
    table = layouts.load_table("data_parallel")
    model, plan = layouts.build_model(factory, mesh, table, seed=3, allow_replicated=True)
    assert_layouts_match_plan(model, plan, mesh)
    steps = dtk.Steps(model, loss="sparse_categorical_crossentropy",
                      optimizer=tf_keras.optimizers.Adam(1e-2, mesh=mesh), mesh=mesh)
    w = np.ones(B, np.float32)
    return np.array([float(steps.train(input_lib.pack(mesh, (x[i], y[i], w))))
                     for i in range(len(x))])


@pytest.mark.parametrize("row", [pytest.param(r, marks=() if r in FAST_ROWS else pytest.mark.slow)
                                 for r in sorted(TABLE)])
def test_layer_trains_like_one_device(row, mesh, caplog):
    factory, kind, expect = TABLE[row]
    x, y = _data(kind)
    if expect == REFUSED:
        with pytest.raises(ValueError, match=r"layer '.*'") as err:
            layouts.build_model(factory, mesh, "data_parallel", seed=3, allow_replicated=True)
        assert "DTensor" in str(err.value)
        return
    with caplog.at_level("WARNING", logger="dtk"):
        losses = _dtk_losses(factory, mesh, x, y)
    assert np.all(np.isfinite(losses)), losses
    uncovered = [r.getMessage() for r in caplog.records if "not covered" in r.getMessage()]
    assert len(uncovered) == (expect == UNCOVERED), uncovered
    if expect == PARITY:
        want = _plain_losses(factory, x, y)
        np.testing.assert_allclose(losses, want, rtol=1e-5, err_msg=row)
    elif expect == RANDOM:
        want = _dtk_losses(factory, dtk.build_mesh("batch=1"), x, y)
        np.testing.assert_allclose(losses, want, rtol=1e-5, err_msg=row)
