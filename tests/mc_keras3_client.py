"""Keras 3's distribution API on several DTensor clients (issue 68): run under
``python -m dtk.cluster.launch`` (2 clients x 4 CPUs) or alone (8 CPUs). ``keras.distribution.
initialize()``, a DataParallel or ModelParallel distribution, Keras's own fit on a batched
tf.data dataset (each process reads its own rows: Keras's auto-sharding), then evaluate; client 0
writes the losses and a digest of the weights to MC_OUT. MC_MESH: "dp" or "mp"."""

import json
import os

import numpy as np

import dtk  # noqa: F401  (DTensor's parity-safe settings first)
import keras

dtk.enable_keras_distribution()
keras.distribution.initialize()
devices = keras.distribution.list_devices()
assert len(devices) == 8, devices
if os.environ.get("MC_MESH", "dp") == "dp":
    distribution = keras.distribution.DataParallel(devices=devices)
else:
    mesh = keras.distribution.DeviceMesh(shape=(2, 4), axis_names=["data", "model"],
                                         devices=devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["d1/kernel"] = (None, "model")
    layout_map["d1/bias"] = ("model",)
    distribution = keras.distribution.ModelParallel(layout_map=layout_map,
                                                    batch_dim_name="data")
keras.distribution.set_distribution(distribution)
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
x = rng.random((256, 28, 28, 1)).astype("float32")
y = rng.integers(0, 10, 256)
import tensorflow as tf  # pylint: disable=g-import-not-at-top,wrong-import-position
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(32, drop_remainder=True)
inputs = keras.layers.Input(shape=(28, 28, 1))
h = keras.layers.Flatten()(inputs)
h = keras.layers.Dense(200, activation="relu", name="d1")(h)
h = keras.layers.Dropout(0.4)(h)
outputs = keras.layers.Dense(10, activation="softmax", name="d2")(h)
model = keras.Model(inputs, outputs)
model.compile(loss="sparse_categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
history = model.fit(data, epochs=2, verbose=0)
evaluation = model.evaluate(data, verbose=0)
weights = model.get_weights()
if int(os.environ.get("DTENSOR_CLIENT_ID", "0")) == 0 and os.environ.get("MC_OUT"):
    with open(os.environ["MC_OUT"], "w") as f:
        json.dump({"history": history.history, "evaluate": evaluation,
                   "weights": [float(np.asarray(w, np.float64).sum()) for w in weights]}, f)
