"""A DLRM-style click model (``dtk-train-recsys``): dense features and embedding tables, and its spec."""

from __future__ import annotations

import numbers

from dtk import _env

_env.import_tensorflow_quietly()  # before tf_keras loads it: its load-time C++ lines hidden

import tf_keras  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

from dtk.models.spec import ModelSpec


@tf_keras.saving.register_keras_serializable(package="dtk")
class DotInteraction(tf_keras.layers.Layer):
    """DLRM's feature interaction: the dot product of every pair of ``[B, dim]`` feature vectors.

    ``n`` inputs give ``[B, n * (n - 1) / 2]``, pairs in order (0, 1), (0, 2) ... Written as
    elementwise products and sums (no triangular gather), which DTensor lays out on any mesh.
    """

    def call(self, features):
        pairs = [tf_keras.backend.sum(features[i] * features[j], axis=-1, keepdims=True)
                 for i in range(len(features)) for j in range(i + 1, len(features))]
        return tf_keras.backend.concatenate(pairs, axis=-1)


@tf_keras.saving.register_keras_serializable(package="dtk")
class IdColumns(tf_keras.layers.Layer):
    """``[B, F]`` ids as a list of ``F`` tensors ``[B]``: one id per table."""

    def call(self, ids):
        return [ids[:, k] for k in range(ids.shape[-1])]


def dlrm(*, table_sizes: tuple[int, ...] = (1 << 16, 1 << 12, 1 << 8, 16), num_dense: int = 8,
         dim: int = 16, bottom: tuple[int, ...] = (64,), top: tuple[int, ...] = (64, 32),
         name: str = "dlrm") -> tf_keras.Model:
    """A DLRM-style click model: one logit per example, from ``{"dense", "ids"}``.

    Dense features go through the bottom MLP (``bot{i}``, ending in ``dim`` units); each
    categorical feature ``t`` (column ``t`` of ``ids``) is looked up in its own table
    ``table{t}`` (``table_sizes[t]`` x ``dim``); ``DotInteraction`` takes the dot products of
    every pair of those vectors, which the top MLP (``top{i}``) reads with the bottom MLP's output
    to give the logit (``out``, float32). Layer names are what ``layouts/recsys*.toml`` refer to.
    """
    if not table_sizes:
        raise ValueError("dlrm needs at least one table (table_sizes is empty)")
    for name, value in (("table_sizes", table_sizes), ("num_dense", num_dense), ("dim", dim),
                        ("bottom", bottom), ("top", top)):
        values = value if isinstance(value, (tuple, list)) else (value,)
        if any(isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1
               for v in values):
            raise ValueError(f"dlrm: {name} must be positive integers; got {value!r}")
    dense = tf_keras.Input((num_dense,), name="dense")
    ids = tf_keras.Input((len(table_sizes),), dtype="int32", name="ids")
    x = dense
    for i, units in enumerate((*bottom, dim)):
        x = tf_keras.layers.Dense(units, activation="relu", name=f"bot{i}")(x)
    columns = IdColumns(name="columns")(ids)
    vectors = [x] + [tf_keras.layers.Embedding(
        rows, dim, name=f"table{t}",
        embeddings_initializer=tf_keras.initializers.RandomNormal(stddev=0.05))(columns[t])
                     for t, rows in enumerate(table_sizes)]
    h = tf_keras.layers.Concatenate(name="joined")([x, DotInteraction(name="interact")(vectors)])
    for i, units in enumerate(top):
        h = tf_keras.layers.Dense(units, activation="relu", name=f"top{i}")(h)
    logit = tf_keras.layers.Dense(1, name="out", dtype="float32")(h)
    return tf_keras.Model({"dense": dense, "ids": ids}, logit, name=name)


SPECS = {"dlrm": ModelSpec(
    name="dlrm", factory=dlrm, layout="recsys_batch_rows", optimizer="adam",
    learning_rates={"adam": 3e-3}, input_shape=None, num_classes=None,
    note="dtk-train-recsys's click model at its default tables (2^16, 2^12, 2^8, 16 rows); one "
         "logit, binary cross-entropy; the tables' rows sharded over the batch axis")}
