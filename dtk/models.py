"""Reference models for MNIST: the DTensor tutorial's MLP and a small CNN.

They are plain tf_keras models with stable layer names (``d1``, ``d2``, ``c1`` ...), because layout
tables in ``layouts/`` refer to weights by those names. Call them inside a layout scope (see
``dtk.layouts``) to get laid-out DTensor weights; outside one they are ordinary Keras models, which
is how the single-device reference runs in the parity tests are built.

Both return logits (no softmax): use ``from_logits=True`` losses. The last layer is float32 under
mixed precision, because a bfloat16 softmax cross-entropy loses accuracy.
"""

from __future__ import annotations

import tf_keras

IMAGE_SHAPE = (28, 28, 1)
NUM_CLASSES = 10


def mnist_mlp(*, hidden: int = 128, name: str = "mnist_mlp") -> tf_keras.Model:
    """784 -> hidden (relu) -> 10, as in the TensorFlow DTensor Keras tutorial."""
    return tf_keras.Sequential([
        tf_keras.layers.Flatten(input_shape=IMAGE_SHAPE, name="flatten"),
        tf_keras.layers.Dense(hidden, activation="relu", name="d1"),
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


MODELS = {"mlp": mnist_mlp, "cnn": mnist_cnn}
