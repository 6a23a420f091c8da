"""keras.io's examples as their pages write them: the zoo of issue 40.

Each entry builds and compiles its model the way its keras.io page does (Keras 2: ``tf_keras``),
smaller (narrower layers, smaller images and vocabularies, a few steps), on synthetic data of the
page's shapes (nothing downloads). Where the page differs from what runs here, ``changed`` says
what and why. ``tests/test_keras_io.py`` trains each on ``batch=1``, ``batch=8`` and
``batch=4,model=2`` through ``dtk.Trainer`` (the factory's compiled optimizer, loss and metrics),
resumes and exports it; ``scripts/keras_io_zoo.py`` times it against plain ``model.fit``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf
import tf_keras
from tf_keras import layers

from tests import test_keras_contract as contract

B, N = 16, 4  # global batch, steps a run


@dataclasses.dataclass(frozen=True, kw_only=True)
class Example:
    """One keras.io page: its model factory (compiled as on the page), synthetic data of its
    shapes, and what differs from the page."""

    page: str
    factory: Callable[[], tf_keras.Model]
    data: Callable[[], tuple[Any, Any]]
    changed: str = ""
    custom_objects: dict | None = None
    # A subclassed model that the page builds by fitting it: dtk builds it before the mesh
    # step, from one example's shape (dtk.Trainer(input_shape=...)).
    input_shape: tuple[int, ...] | None = None
    # Whether plain tf_keras can revive the model's class from its config (load_model); a page's
    # class with its own __init__ and no get_config cannot, with or without dtk: its export is
    # then read with factory().load_weights(model.keras).
    keras_loads: bool = True


def _rng(seed=0):
    return np.random.default_rng(seed)


# -- "Simple MNIST convnet" ----------------------------------------------------------------------
def mnist_convnet():
    model = tf_keras.Sequential([
        tf_keras.Input(shape=(12, 12, 1)),
        layers.Conv2D(8, kernel_size=(3, 3), activation="relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Conv2D(8, kernel_size=(3, 3), activation="relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Flatten(),
        layers.Dropout(0.5),
        layers.Dense(10, activation="softmax"),
    ])
    model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
    return model


def _mnist_data():
    rng = _rng()
    return (rng.random((N * B, 12, 12, 1), dtype=np.float32),
            np.eye(10, dtype=np.float32)[rng.integers(0, 10, N * B)])


# -- "Image classification from scratch" (augmentation inside the model) ------------------------
def image_classification_from_scratch():
    data_augmentation = tf_keras.Sequential([layers.RandomFlip("horizontal"),
                                             layers.RandomRotation(0.1)])
    inputs = tf_keras.Input(shape=(16, 16, 3))
    x = data_augmentation(inputs)
    x = layers.Rescaling(1.0 / 255)(x)
    x = layers.Conv2D(8, 3, strides=2, padding="same")(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)
    previous_block_activation = x
    for size in [16]:
        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(size, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(size, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.MaxPooling2D(3, strides=2, padding="same")(x)
        residual = layers.Conv2D(size, 1, strides=2, padding="same")(previous_block_activation)
        x = layers.add([x, residual])
        previous_block_activation = x
    x = layers.SeparableConv2D(16, 3, padding="same")(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)
    x = layers.GlobalAveragePooling2D()(x)
    x = layers.Dropout(0.25)(x)
    outputs = layers.Dense(1, activation=None)(x)
    model = tf_keras.Model(inputs, outputs)
    model.compile(optimizer=tf_keras.optimizers.Adam(3e-4),
                  loss=tf_keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=[tf_keras.metrics.BinaryAccuracy(name="acc")])
    return model


def _image_data():
    rng = _rng()
    return ((rng.random((N * B, 16, 16, 3)) * 255).astype(np.float32),
            rng.integers(0, 2, (N * B, 1)).astype(np.float32))


# -- "Bidirectional LSTM on IMDB" -----------------------------------------------------------------
def bilstm_imdb():
    inputs = tf_keras.Input(shape=(6,), dtype="int32")
    x = layers.Embedding(50, 8)(inputs)
    x = layers.Bidirectional(layers.LSTM(8, return_sequences=True))(x)
    x = layers.Bidirectional(layers.LSTM(8))(x)
    outputs = layers.Dense(1, activation="sigmoid")(x)
    model = tf_keras.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    return model


def _imdb_data():
    rng = _rng()
    return (rng.integers(1, 50, (N * B, 6)).astype(np.int32),
            rng.integers(0, 2, (N * B, 1)).astype(np.float32))


# -- "Image segmentation with a U-Net-like architecture" -----------------------------------------
def unet(img_size=(16, 16), num_classes=3):
    inputs = tf_keras.Input(shape=img_size + (3,))
    x = layers.Conv2D(8, 3, strides=2, padding="same")(inputs)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)
    previous_block_activation = x
    for filters in [16]:
        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(filters, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(filters, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.MaxPooling2D(3, strides=2, padding="same")(x)
        residual = layers.Conv2D(filters, 1, strides=2, padding="same")(previous_block_activation)
        x = layers.add([x, residual])
        previous_block_activation = x
    for filters in [16, 8]:
        x = layers.Activation("relu")(x)
        x = layers.Conv2DTranspose(filters, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.Activation("relu")(x)
        x = layers.Conv2DTranspose(filters, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.UpSampling2D(2)(x)
        residual = layers.UpSampling2D(2)(previous_block_activation)
        residual = layers.Conv2D(filters, 1, padding="same")(residual)
        x = layers.add([x, residual])
        previous_block_activation = x
    outputs = layers.Conv2D(num_classes, 3, activation="softmax", padding="same")(x)
    model = tf_keras.Model(inputs, outputs)
    model.compile(optimizer="rmsprop", loss="sparse_categorical_crossentropy")
    return model


def _segmentation_data():
    rng = _rng()
    return (rng.random((N * B, 16, 16, 3), dtype=np.float32),
            rng.integers(0, 3, (N * B, 16, 16, 1)).astype(np.int64))


# -- "3D image classification from CT scans" -----------------------------------------------------
def ct_3d(width=12, height=12, depth=8):
    inputs = tf_keras.Input((width, height, depth, 1))
    x = layers.Conv3D(filters=8, kernel_size=3, activation="relu")(inputs)
    x = layers.MaxPool3D(pool_size=2)(x)
    x = layers.BatchNormalization()(x)
    x = layers.Conv3D(filters=8, kernel_size=3, activation="relu", padding="same")(x)
    x = layers.MaxPool3D(pool_size=2)(x)
    x = layers.BatchNormalization()(x)
    x = layers.GlobalAveragePooling3D()(x)
    x = layers.Dense(units=16, activation="relu")(x)
    x = layers.Dropout(0.3)(x)
    outputs = layers.Dense(units=1, activation="sigmoid")(x)
    model = tf_keras.Model(inputs, outputs, name="3dcnn")
    lr_schedule = tf_keras.optimizers.schedules.ExponentialDecay(
        1e-4, decay_steps=100000, decay_rate=0.96, staircase=True)
    model.compile(loss="binary_crossentropy",
                  optimizer=tf_keras.optimizers.Adam(learning_rate=lr_schedule), metrics=["acc"])
    return model


def _ct_data():
    rng = _rng()
    return (rng.random((N * B, 12, 12, 8, 1), dtype=np.float32),
            rng.integers(0, 2, (N * B, 1)).astype(np.float32))


# -- "Next-frame video prediction with Convolutional LSTMs" --------------------------------------
def next_frame_convlstm():
    inp = layers.Input(shape=(3, 8, 8, 1))
    x = layers.ConvLSTM2D(filters=8, kernel_size=(5, 5), padding="same", return_sequences=True,
                          activation="relu")(inp)
    x = layers.BatchNormalization()(x)
    x = layers.ConvLSTM2D(filters=8, kernel_size=(3, 3), padding="same", return_sequences=True,
                          activation="relu")(x)
    x = layers.BatchNormalization()(x)
    x = layers.ConvLSTM2D(filters=8, kernel_size=(1, 1), padding="same", return_sequences=True,
                          activation="relu")(x)
    x = layers.Conv3D(filters=1, kernel_size=(3, 3, 3), activation="sigmoid", padding="same")(x)
    model = tf_keras.models.Model(inp, x)
    model.compile(loss=tf_keras.losses.binary_crossentropy, optimizer=tf_keras.optimizers.Adam())
    return model


def _frames_data():
    rng = _rng()
    frames = (rng.random((N * B, 4, 8, 8, 1)) > 0.7).astype(np.float32)
    return frames[:, :3], frames[:, 1:]


# -- "Timeseries classification from scratch" ----------------------------------------------------
def timeseries_classification(input_shape=(32, 1), num_classes=2):
    input_layer = tf_keras.layers.Input(input_shape)
    x = input_layer
    for _ in range(3):
        x = tf_keras.layers.Conv1D(filters=8, kernel_size=3, padding="same")(x)
        x = tf_keras.layers.BatchNormalization()(x)
        x = tf_keras.layers.ReLU()(x)
    gap = tf_keras.layers.GlobalAveragePooling1D()(x)
    output_layer = tf_keras.layers.Dense(num_classes, activation="softmax")(gap)
    model = tf_keras.models.Model(inputs=input_layer, outputs=output_layer)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                  metrics=["sparse_categorical_accuracy"])
    return model


def _timeseries_data():
    rng = _rng()
    return (rng.normal(size=(N * B, 32, 1)).astype(np.float32),
            rng.integers(0, 2, N * B).astype(np.int64))


# -- "Timeseries forecasting for weather prediction" ---------------------------------------------
def weather_forecasting():
    inputs = tf_keras.layers.Input(shape=(12, 7))
    lstm_out = tf_keras.layers.LSTM(16)(inputs)
    outputs = tf_keras.layers.Dense(1)(lstm_out)
    model = tf_keras.Model(inputs=inputs, outputs=outputs)
    model.compile(optimizer=tf_keras.optimizers.Adam(learning_rate=0.001), loss="mse")
    return model


def _weather_data():
    rng = _rng()
    return (rng.normal(size=(N * B, 12, 7)).astype(np.float32),
            rng.normal(size=(N * B, 1)).astype(np.float32))


# -- "Convolutional autoencoder for image denoising" ---------------------------------------------
def denoising_autoencoder():
    inputs = layers.Input(shape=(12, 12, 1))
    x = layers.Conv2D(8, (3, 3), activation="relu", padding="same")(inputs)
    x = layers.MaxPooling2D((2, 2), padding="same")(x)
    x = layers.Conv2D(8, (3, 3), activation="relu", padding="same")(x)
    x = layers.MaxPooling2D((2, 2), padding="same")(x)
    x = layers.Conv2DTranspose(8, (3, 3), strides=2, activation="relu", padding="same")(x)
    x = layers.Conv2DTranspose(8, (3, 3), strides=2, activation="relu", padding="same")(x)
    x = layers.Conv2D(1, (3, 3), activation="sigmoid", padding="same")(x)
    autoencoder = tf_keras.Model(inputs, x)
    autoencoder.compile(optimizer="adam", loss="binary_crossentropy")
    return autoencoder


def _denoising_data():
    rng = _rng()
    clean = rng.random((N * B, 12, 12, 1), dtype=np.float32)
    noisy = np.clip(clean + 0.4 * rng.normal(size=clean.shape), 0.0, 1.0).astype(np.float32)
    return noisy, clean


# -- "Character-level text generation with LSTM" -------------------------------------------------
def char_lstm(maxlen=10, chars=20):
    model = tf_keras.Sequential([
        tf_keras.Input(shape=(maxlen, chars)),
        layers.LSTM(16),
        layers.Dense(chars, activation="softmax"),
    ])
    model.compile(loss="categorical_crossentropy",
                  optimizer=tf_keras.optimizers.RMSprop(learning_rate=0.01))
    return model


def _char_data():
    rng = _rng()
    x = np.eye(20, dtype=np.float32)[rng.integers(0, 20, (N * B, 10))]
    return x, np.eye(20, dtype=np.float32)[rng.integers(0, 20, N * B)]


# -- "Structured data classification from scratch" -----------------------------------------------
def structured_data():
    rng = _rng(1)
    inputs, encoded = {}, []
    for name in ("age", "trestbps", "chol", "thalach", "oldpeak"):
        inputs[name] = tf_keras.Input(shape=(1,), name=name)
        normalizer = layers.Normalization()
        normalizer.adapt(rng.normal(50.0, 10.0, (64, 1)).astype(np.float32))
        encoded.append(normalizer(inputs[name]))
    all_features = layers.concatenate(encoded)
    x = layers.Dense(32, activation="relu")(all_features)
    x = layers.Dropout(0.5)(x)
    output = layers.Dense(1, activation="sigmoid")(x)
    model = tf_keras.Model(inputs, output)
    model.compile("adam", "binary_crossentropy", metrics=["accuracy"])
    return model


def _structured_data():
    rng = _rng()
    x = {name: rng.normal(50.0, 10.0, (N * B, 1)).astype(np.float32)
         for name in ("age", "trestbps", "chol", "thalach", "oldpeak")}
    return x, rng.integers(0, 2, (N * B, 1)).astype(np.float32)


# -- "Variational AutoEncoder" (a model with its own train_step) ---------------------------------
class Sampling(layers.Layer):
    """Uses (z_mean, z_log_var) to sample z, the vector encoding a digit."""

    def call(self, inputs):
        z_mean, z_log_var = inputs
        batch = tf.shape(z_mean)[0]
        dim = tf.shape(z_mean)[1]
        epsilon = tf_keras.backend.random_normal(shape=(batch, dim))
        return z_mean + tf.exp(0.5 * z_log_var) * epsilon


class VAE(tf_keras.Model):
    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.total_loss_tracker = tf_keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = tf_keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = tf_keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.reconstruction_loss_tracker, self.kl_loss_tracker]

    def call(self, inputs):
        return self.decoder(self.encoder(inputs)[2])

    def train_step(self, data):
        if isinstance(data, tuple):
            data = data[0]
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = tf.reduce_mean(tf.reduce_sum(
                tf_keras.losses.binary_crossentropy(data, reconstruction), axis=(1, 2)))
            kl_loss = -0.5 * (1 + z_log_var - tf.square(z_mean) - tf.exp(z_log_var))
            kl_loss = tf.reduce_mean(tf.reduce_sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {"loss": self.total_loss_tracker.result(),
                "reconstruction_loss": self.reconstruction_loss_tracker.result(),
                "kl_loss": self.kl_loss_tracker.result()}


def vae(latent_dim=2):
    encoder_inputs = tf_keras.Input(shape=(12, 12, 1))
    x = layers.Conv2D(8, 3, activation="relu", strides=2, padding="same")(encoder_inputs)
    x = layers.Conv2D(8, 3, activation="relu", strides=2, padding="same")(x)
    x = layers.Flatten()(x)
    x = layers.Dense(16, activation="relu")(x)
    z_mean = layers.Dense(latent_dim, name="z_mean")(x)
    z_log_var = layers.Dense(latent_dim, name="z_log_var")(x)
    z = Sampling()([z_mean, z_log_var])
    encoder = tf_keras.Model(encoder_inputs, [z_mean, z_log_var, z], name="encoder")
    latent_inputs = tf_keras.Input(shape=(latent_dim,))
    x = layers.Dense(3 * 3 * 8, activation="relu")(latent_inputs)
    x = layers.Reshape((3, 3, 8))(x)
    x = layers.Conv2DTranspose(8, 3, activation="relu", strides=2, padding="same")(x)
    x = layers.Conv2DTranspose(8, 3, activation="relu", strides=2, padding="same")(x)
    decoder_outputs = layers.Conv2DTranspose(1, 3, activation="sigmoid", padding="same")(x)
    decoder = tf_keras.Model(latent_inputs, decoder_outputs, name="decoder")
    model = VAE(encoder, decoder)
    model.compile(optimizer=tf_keras.optimizers.Adam())
    return model


def _vae_data():
    rng = _rng()
    x = rng.random((N * B, 12, 12, 1), dtype=np.float32)
    return x, x


EXAMPLES: dict[str, Example] = {
    "mnist_convnet": Example(page="Simple MNIST convnet", factory=mnist_convnet,
                             data=_mnist_data, changed="12x12 images, 8 filters"),
    "image_classification_from_scratch": Example(
        page="Image classification from scratch", factory=image_classification_from_scratch,
        data=_image_data, changed="16x16 images, one residual block of 16 filters; "
        "RandomFlip and RandomRotation inside the model, as on the page"),
    "bilstm_imdb": Example(page="Bidirectional LSTM on IMDB", factory=bilstm_imdb,
                           data=_imdb_data, changed="Input((6,)) not (None,): dtk unrolls "
                           "the LSTM loops (DTensor cannot lay out them), which needs a static "
                           "length; vocabulary 50, 8 units"),
    "text_transformer": Example(
        page="Text classification with Transformer", factory=contract.text_transformer,
        data=contract._text_data, changed="vocabulary 50, length 10, dim 8",  # pylint: disable=protected-access
        custom_objects={"TransformerBlock": contract.TransformerBlock,
                        "TokenAndPositionEmbedding": contract.TokenAndPositionEmbedding}),
    "customizing_fit": Example(page="Customizing what happens in fit() (train_step)",
                               factory=contract.custom_fit, data=contract._regression_data,  # pylint: disable=protected-access
                               changed="a term added to the loss in train_step",
                               custom_objects={"CustomFit": contract.CustomFit}),
    "customizing_fit_low_level": Example(
        page="Customizing what happens in fit() (no compiled loss, own metrics)",
        factory=contract.low_level_fit, data=contract._regression_data,  # pylint: disable=protected-access
        custom_objects={"LowLevelFit": contract.LowLevelFit}, keras_loads=False),
    "functional_multi_io": Example(
        page="The Functional API (multi-input, multi-output)", factory=contract.ticket_model,
        data=contract._ticket_data, changed="titles and bodies of fixed length (unrolled LSTMs)"),  # pylint: disable=protected-access
    "unet": Example(page="Image segmentation with a U-Net-like architecture", factory=unet,
                    data=_segmentation_data, changed="16x16 images, filters 8/16"),
    "ct_3d": Example(page="3D image classification from CT scans", factory=ct_3d, data=_ct_data,
                     changed="12x12x8 volumes, 8 filters"),
    "next_frame_convlstm": Example(
        page="Next-frame video prediction with Convolutional LSTMs", factory=next_frame_convlstm,
        data=_frames_data, changed="Input((3, 8, 8, 1)): a static number of frames (dtk "
        "unrolls ConvLSTM2D), 8 filters"),
    "timeseries_classification": Example(
        page="Timeseries classification from scratch", factory=timeseries_classification,
        data=_timeseries_data, changed="32 steps, 8 filters"),
    "weather_forecasting": Example(
        page="Timeseries forecasting for weather prediction", factory=weather_forecasting,
        data=_weather_data, changed="12 steps, 16 units"),
    "denoising_autoencoder": Example(
        page="Convolutional autoencoder for image denoising", factory=denoising_autoencoder,
        data=_denoising_data, changed="12x12 images, 8 filters"),
    "char_lstm": Example(page="Character-level text generation with LSTM", factory=char_lstm,
                         data=_char_data, changed="10 characters of 20, 16 units"),
    "structured_data": Example(
        page="Structured data classification from scratch", factory=structured_data,
        data=_structured_data, changed="5 numeric features, normalizers adapted in the factory "
        "on synthetic values"),
    "vae": Example(page="Variational AutoEncoder", factory=vae, data=_vae_data,
                   changed="12x12 images, 8 filters; dtk.Trainer(input_shape=(12, 12, 1)): the "
                   "subclassed VAE is built before its first step", input_shape=(12, 12, 1),
                   keras_loads=False,
                   custom_objects={"VAE": VAE, "Sampling": Sampling}),
}
