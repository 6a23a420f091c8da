"""Reference models for MNIST: the DTensor tutorial's MLP and a small CNN, with their specs.

They are plain tf_keras models with stable layer names (``d1``, ``d2``, ``c1`` ...), because layout
tables in ``layouts/`` refer to weights by those names. Call them inside a layout scope (see
``dtk.parallel.layouts``) to get laid-out DTensor weights; outside one they are ordinary Keras models, which
is how the single-device reference runs in the parity tests are built.

Both return logits (no softmax): use ``from_logits=True`` losses. The last layer is float32 under
mixed precision, because a bfloat16 softmax cross-entropy loses accuracy.
"""

from __future__ import annotations

from dtk import _env

_env.import_tensorflow_quietly()  # before tf_keras loads it: its load-time C++ lines hidden

import tf_keras  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

from dtk.models.spec import ModelSpec

IMAGE_SHAPE = (28, 28, 1)
NUM_CLASSES = 10


def mnist_mlp(*, hidden: int = 128, dropout: float = 0.0,
              name: str = "mnist_mlp") -> tf_keras.Model:
    """784 -> hidden (relu) -> 10, as in the TensorFlow DTensor Keras tutorial.

    With ``dropout > 0``, a ``Dropout`` layer (named ``drop``) follows the hidden layer.
    """
    return tf_keras.Sequential([
        tf_keras.layers.Flatten(input_shape=IMAGE_SHAPE, name="flatten"),
        tf_keras.layers.Dense(hidden, activation="relu", name="d1"),
        *([tf_keras.layers.Dropout(dropout, name="drop")] if dropout else []),
        tf_keras.layers.Dense(NUM_CLASSES, name="d2", dtype="float32"),
    ], name=name)


def mnist_cnn(*, filters: tuple[int, int] = (32, 64), hidden: int = 128,
              name: str = "mnist_cnn") -> tf_keras.Model:
    """Conv(3x3) + MaxPool, twice, then Dense(hidden) and Dense(10): about 99% on MNIST."""
    f1, f2 = filters
    return tf_keras.Sequential([
        tf_keras.layers.Conv2D(f1, 3, activation="relu", input_shape=IMAGE_SHAPE, name="c1"),
        tf_keras.layers.MaxPooling2D(name="p1"),
        tf_keras.layers.Conv2D(f2, 3, activation="relu", name="c2"),
        tf_keras.layers.MaxPooling2D(name="p2"),
        tf_keras.layers.Flatten(name="flatten"),
        tf_keras.layers.Dense(hidden, activation="relu", name="d1"),
        tf_keras.layers.Dense(NUM_CLASSES, name="d2", dtype="float32"),
    ], name=name)


def tiny_transformer(*, vocab: int = 64, seq_len: int = 8, dim: int = 16, heads: int = 4,
                     ff: int = 32, classes: int = NUM_CLASSES, dropout: float = 0.1,
                     name: str = "tiny_transformer") -> tf_keras.Model:
    """One post-norm transformer block over token ids, mean-pooled into a classifier.

    Layer names match ``layouts/transformer_block.toml``. Used by the layer-coverage tests:
    Embedding, MultiHeadAttention, LayerNormalization, Dropout and Dense under DTensor.
    """
    tokens = tf_keras.Input((seq_len,), dtype="int32", name="tokens")
    h = tf_keras.layers.Embedding(vocab, dim, name="embed")(tokens)
    a = tf_keras.layers.MultiHeadAttention(heads, dim // heads, name="attn")(h, h)
    a = tf_keras.layers.Dropout(dropout, name="drop")(a)
    h = tf_keras.layers.LayerNormalization(name="ln1")(h + a)
    f = tf_keras.layers.Dense(ff, activation="relu", name="ff1")(h)
    f = tf_keras.layers.Dense(dim, name="ff2")(f)
    h = tf_keras.layers.LayerNormalization(name="ln2")(h + f)
    pooled = tf_keras.layers.GlobalAveragePooling1D(name="pool")(h)
    logits = tf_keras.layers.Dense(classes, name="head", dtype="float32")(pooled)
    return tf_keras.Model(tokens, logits, name=name)


SPECS = {
    "mlp": ModelSpec(
        name="mlp", factory=mnist_mlp, layout="data_parallel", optimizer="sgd",
        learning_rates={"sgd": 0.45, "adam": 2e-3}, input_shape=IMAGE_SHAPE,
        num_classes=NUM_CLASSES, remat=(r"d\d",),
        note="3 epochs on the offline 24,345 training images: SGD 0.45 -> 95.6% test accuracy "
             "with per-epoch losses equal on every mesh to 1e-7 (Adam at rates that reach 95.5% "
             "turns float rounding into 1e-3 differences over 570 steps)"),
    "cnn": ModelSpec(
        name="cnn", factory=mnist_cnn, layout="cnn_data_parallel", optimizer="adam",
        learning_rates={"adam": 3e-3, "sgd": 0.1}, input_shape=IMAGE_SHAPE,
        num_classes=NUM_CLASSES, remat=(r"c\d", r"d\d"), note="Adam 3e-3: 98.4% test accuracy in 3 epochs"),
}
