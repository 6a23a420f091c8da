"""keras.io's Keras 3 pages, written as their pages write them (smaller, on data of the pages'
shapes), for ``tests/test_keras3_pages.py`` (issue 68).

Each ``Page`` builds and compiles the page's model (``build``), makes the page's data and
``fit`` arguments (``fit``), and says what was scaled down (``changed``) and which weights the
page's ``ModelParallel`` layout map splits over ``model`` on ``(2, 4)`` (``model_keys``). A page
whose model draws random numbers (dropout, noise, augmentation, a GAN's latent vectors) is
compared across meshes (dtk's draws are the same on every mesh, not TensorFlow's); the others
against plain Keras 3 on one device.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
import tensorflow as tf

import keras
from keras import layers, ops


@dataclasses.dataclass(frozen=True, kw_only=True)
class Page:
    title: str
    build: Callable[[], keras.Model]
    fit: Callable[[], dict]
    changed: str
    model_keys: dict = dataclasses.field(default_factory=dict)
    random: bool = False
    rtol: float = 1e-5
    atol: float = 1e-6
    predict: bool = True


PAGES: dict[str, Page] = {}


def _rng(seed):
    return np.random.default_rng(seed)


# -- keras.io/guides/distribution: the guide's model ----------------------------------------------
def _guide():
    inputs = layers.Input(shape=(28, 28, 1))
    y = layers.Flatten()(inputs)
    y = layers.Dense(units=200, activation="relu", name="d1")(y)
    y = layers.Dropout(0.4)(y)
    outputs = layers.Dense(units=10, activation="softmax", name="d2")(y)
    model = keras.Model(inputs=inputs, outputs=outputs)
    model.compile(loss="mse", optimizer="adam")
    return model


def _guide_fit():
    rng = _rng(0)
    x = rng.random((128, 28, 28, 1)).astype("float32")
    y = keras.utils.to_categorical(rng.integers(0, 10, 128), 10)
    return dict(x=x, y=y, batch_size=32, epochs=2)


PAGES["distribution_guide"] = Page(
    title="Distributed training with Keras (the guide's DataParallel/ModelParallel model)",
    build=_guide, fit=_guide_fit, random=True,
    model_keys={"d1/kernel": (None, "model"), "d1/bias": ("model",)},
    changed="128 random MNIST-shaped images, 2 epochs; the guide builds and compiles the model, "
    "the test fits it")


# -- keras.io/examples/vision/mnist_convnet -------------------------------------------------------
def _convnet():
    model = keras.Sequential([
        keras.Input(shape=(28, 28, 1)),
        layers.Conv2D(8, kernel_size=(3, 3), activation="relu", name="conv1"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Conv2D(16, kernel_size=(3, 3), activation="relu", name="conv2"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Flatten(),
        layers.Dropout(0.5),
        layers.Dense(10, activation="softmax", name="head"),
    ])
    model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
    return model


def _convnet_fit():
    rng = _rng(1)
    x = rng.random((128, 28, 28, 1)).astype("float32")
    y = keras.utils.to_categorical(rng.integers(0, 10, 128), 10)
    return dict(x=x, y=y, batch_size=32, epochs=2, validation_split=0.25)


PAGES["mnist_convnet"] = Page(
    title="Simple MNIST convnet", build=_convnet, fit=_convnet_fit, random=True,
    model_keys={"head/kernel": ("model", None)},
    changed="8 and 16 filters (32, 64 on the page), 128 random images, 2 epochs")


# -- keras.io/guides/sequential_model -------------------------------------------------------------
def _sequential():
    model = keras.Sequential([
        keras.Input(shape=(12,)),
        layers.Dense(16, activation="relu", name="layer1"),
        layers.Dense(8, activation="relu", name="layer2"),
        layers.Dense(4, name="layer3"),
    ])
    model.compile(optimizer=keras.optimizers.RMSprop(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[keras.metrics.SparseCategoricalAccuracy()])
    return model


def _sequential_fit():
    rng = _rng(2)
    return dict(x=rng.normal(size=(160, 12)).astype("float32"), y=rng.integers(0, 4, 160),
                batch_size=32, epochs=3)


PAGES["sequential_model"] = Page(
    title="The Sequential model", build=_sequential, fit=_sequential_fit,
    model_keys={"layer1/kernel": (None, "model"), "layer1/bias": ("model",),
                "layer2/kernel": ("model", None)},
    changed="12 features, layers of 16/8/4 units, 160 random examples")


# -- keras.io/guides/functional_api: a model with several inputs and outputs ---------------------
def _functional():
    title_input = keras.Input(shape=(None,), name="title", batch_size=None, dtype="int32")
    body_input = keras.Input(shape=(None,), name="body", dtype="int32")
    tags_input = keras.Input(shape=(6,), name="tags")
    embed = layers.Embedding(50, 8, name="embed")
    title_features = layers.GlobalAveragePooling1D()(embed(title_input))
    body_features = layers.GlobalAveragePooling1D()(embed(body_input))
    x = layers.concatenate([title_features, body_features, tags_input])
    priority = layers.Dense(1, name="priority")(x)
    department = layers.Dense(4, name="department")(x)
    model = keras.Model(inputs=[title_input, body_input, tags_input],
                        outputs={"priority": priority, "department": department})
    model.compile(optimizer=keras.optimizers.RMSprop(1e-3),
                  loss={"priority": keras.losses.BinaryCrossentropy(from_logits=True),
                        "department": keras.losses.CategoricalCrossentropy(from_logits=True)},
                  loss_weights={"priority": 1.0, "department": 0.2})
    return model


def _functional_fit():
    rng = _rng(3)
    n = 96
    return dict(x={"title": rng.integers(0, 50, (n, 10)).astype("int32"),
                   "body": rng.integers(0, 50, (n, 20)).astype("int32"),
                   "tags": rng.integers(0, 2, (n, 6)).astype("float32")},
                y={"priority": rng.random((n, 1)).astype("float32"),
                   "department": rng.integers(0, 2, (n, 4)).astype("float32")},
                batch_size=32, epochs=2)


PAGES["functional_api"] = Page(
    title="The Functional API (multi-input, multi-output ticket model)", build=_functional,
    fit=_functional_fit, model_keys={},
    changed="a vocabulary of 50, 8-dim embeddings, titles of 10 and bodies of 20 words, 6 tags, "
    "4 departments, 96 random tickets; data parallel only (an embedding split over model, "
    "concatenated with unsplit tags, makes DTensor propagate the split into a 22-row kernel "
    "it cannot divide); 2e-5 (three losses summed in another order over the devices: 1.05e-5 "
    "measured)", rtol=2e-5)


# -- keras.io/examples/structured_data (preprocessing layers): Normalization adapted -------------
def _normalized():
    rng = _rng(4)
    sample = rng.normal(3.0, 2.0, size=(200, 5)).astype("float32")
    norm = layers.Normalization(name="norm")
    norm.adapt(sample)
    model = keras.Sequential([keras.Input((5,)), norm,
                              layers.Dense(16, activation="relu", name="d1"),
                              layers.Dense(1, name="out")])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mean_absolute_error")
    return model


def _normalized_fit():
    rng = _rng(5)
    x = rng.normal(3.0, 2.0, size=(128, 5)).astype("float32")
    return dict(x=x, y=(x @ np.arange(5, dtype="float32"))[:, None], batch_size=32, epochs=3,
                validation_split=0.25)


PAGES["regression_normalization"] = Page(
    title="Basic regression with a Normalization layer adapted to the data (preprocessing)",
    build=_normalized, fit=_normalized_fit,
    model_keys={"d1/kernel": (None, "model"), "d1/bias": ("model",)},
    changed="5 random features (the page's Auto MPG has 9), a linear target, adapted on 200 rows")


# -- keras.io/examples/timeseries/timeseries_classification_from_scratch --------------------------
def _timeseries():
    inputs = keras.Input((32, 1))
    x = inputs
    for i in range(2):
        x = layers.Conv1D(filters=8, kernel_size=3, padding="same", name=f"conv{i}")(x)
        x = layers.BatchNormalization(name=f"bn{i}")(x)
        x = layers.ReLU()(x)
    x = layers.GlobalAveragePooling1D()(x)
    outputs = layers.Dense(2, activation="softmax", name="head")(x)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                  metrics=["sparse_categorical_accuracy"])
    return model


def _timeseries_fit():
    rng = _rng(6)
    return dict(x=rng.normal(size=(128, 32, 1)).astype("float32"), y=rng.integers(0, 2, 128),
                batch_size=32, epochs=2, validation_split=0.25,
                callbacks=[keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5,
                                                             patience=1, min_lr=1e-4)])


PAGES["timeseries_classification"] = Page(
    title="Timeseries classification from scratch (Conv1D, BatchNormalization)",
    build=_timeseries, fit=_timeseries_fit,
    model_keys={},
    changed="2 conv blocks of 8 filters (3 of 64 on the page), series of 32 steps, 128 series; "
    "data parallel only (DTensor's convolution gradients take batch-parallel layouts only: a "
    "head split over model makes them fail); 1e-4: BatchNormalization's moving statistics sum "
    "in another order over the devices (5e-5 measured in predict); atol 5e-4: a convolution's "
    "bias before BatchNormalization has a zero gradient up to rounding, which Adam scales to "
    "about lr a step (2.5e-4 measured after 8 steps at lr 1e-3; its loss and predictions agree)",
    rtol=1e-4, atol=5e-4)


# -- keras.io/examples/vision/image_classification_from_scratch (augmentation, residuals) --------
def _small_xception():
    inputs = keras.Input(shape=(16, 16, 3))
    x = layers.RandomFlip("horizontal")(inputs)
    x = layers.Rescaling(1.0 / 255)(x)
    x = layers.Conv2D(8, 3, strides=2, padding="same", name="stem")(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)
    previous = x
    x = layers.Conv2D(8, 3, padding="same", name="block")(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)
    x = layers.add([x, previous])
    x = layers.GlobalAveragePooling2D()(x)
    x = layers.Dropout(0.25)(x)
    outputs = layers.Dense(1, name="head")(x)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(3e-4),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=[keras.metrics.BinaryAccuracy(name="acc")])
    return model


def _small_xception_fit():
    rng = _rng(7)
    return dict(x=rng.integers(0, 256, (96, 16, 16, 3)).astype("float32"),
                y=rng.integers(0, 2, (96, 1)).astype("float32"), batch_size=32, epochs=2)


PAGES["image_classification_from_scratch"] = Page(
    title="Image classification from scratch (augmentation, a residual block)",
    build=_small_xception, fit=_small_xception_fit, random=True,
    model_keys={},
    changed="16x16 images, one residual block of 8 filters (the page's small Xception is "
    "deeper), RandomFlip only (the page also rotates); data parallel only (convolutions); "
    "1e-3: two BatchNormalizations compound the sum order (4e-4 measured in predict; deep "
    "BatchNormalization nets are chaotic, BUILD.md); atol 5e-4 for the convolutions' biases "
    "before BatchNormalization (zero gradients up to rounding, scaled by Adam)",
    rtol=1e-3, atol=5e-4)


# -- keras.io/examples/nlp/text_classification_with_transformer ----------------------------------
class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim, name="att")
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu", name="ff1"),
                                     layers.Dense(embed_dim, name="ff2")], name="ffn")
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs, training=False):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output, training=training)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output, training=training)
        return self.layernorm2(out1 + ffn_output)


class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = ops.shape(x)[-1]
        positions = ops.arange(start=0, stop=maxlen, step=1)
        return self.token_emb(x) + self.pos_emb(positions)


def _text_transformer():
    maxlen, vocab, dim = 16, 64, 8
    inputs = layers.Input(shape=(maxlen,))
    x = TokenAndPositionEmbedding(maxlen, vocab, dim)(inputs)
    x = TransformerBlock(dim, 2, 16, name="block")(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dropout(0.1)(x)
    x = layers.Dense(8, activation="relu", name="d1")(x)
    outputs = layers.Dense(2, activation="softmax", name="head")(x)
    model = keras.Model(inputs=inputs, outputs=outputs)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def _text_fit():
    rng = _rng(8)
    x = rng.integers(0, 64, (96, 16)).astype("int32")
    return dict(x=x, y=rng.integers(0, 2, 96), batch_size=32, epochs=2,
                validation_data=(x[:32], rng.integers(0, 2, 32)))


PAGES["text_classification_transformer"] = Page(
    title="Text classification with Transformer", build=_text_transformer, fit=_text_fit,
    random=True, model_keys={"d1/kernel": (None, "model"), "d1/bias": ("model",)},
    changed="vocabulary 64, 16 tokens, embedding 8, 2 heads, feed-forward 16 (20000, 200, 32, "
    "2, 32 on the page), random tokens for IMDB")


# -- keras.io/guides/custom_train_step_in_tensorflow ---------------------------------------------
class CustomModel(keras.Model):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = keras.losses.mean_squared_error(y, y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


def _custom_step():
    inputs = keras.Input(shape=(32,))
    outputs = layers.Dense(1, name="d1")(inputs)
    model = CustomModel(inputs, outputs)
    model.compile(optimizer="adam")
    return model


def _custom_step_fit():
    rng = _rng(9)
    return dict(x=rng.random((128, 32)).astype("float32"),
                y=rng.random((128, 1)).astype("float32"), batch_size=32, epochs=3)


PAGES["custom_train_step"] = Page(
    title="Customizing what happens in fit() (TensorFlow): its own train_step and metrics",
    build=_custom_step, fit=_custom_step_fit, model_keys={"d1/kernel": ("model", None)},
    changed="128 random examples (1000 on the page), 3 epochs")


# -- keras.io/guides/custom_train_step_in_tensorflow: the GAN ------------------------------------
class GAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
        self.seed_generator = keras.random.SeedGenerator(1337)

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def train_step(self, real_images):
        if isinstance(real_images, tuple):
            real_images = real_images[0]
        batch_size = tf.shape(real_images)[0]
        random_latent_vectors = keras.random.normal(
            shape=(real_images.shape[0], self.latent_dim), seed=self.seed_generator)
        generated_images = self.generator(random_latent_vectors)
        combined_images = tf.concat([generated_images, real_images], axis=0)
        labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply(grads, self.discriminator.trainable_weights)
        random_latent_vectors = keras.random.normal(
            shape=(real_images.shape[0], self.latent_dim), seed=self.seed_generator)
        misleading_labels = tf.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply(grads, self.generator.trainable_weights)
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


def _gan():
    latent_dim = 8
    discriminator = keras.Sequential([
        keras.Input(shape=(8, 8, 1)),
        layers.Conv2D(8, (3, 3), strides=(2, 2), padding="same", name="dconv"),
        layers.LeakyReLU(negative_slope=0.2),
        layers.GlobalMaxPooling2D(),
        layers.Dense(1, name="dout"),
    ], name="discriminator")
    generator = keras.Sequential([
        keras.Input(shape=(latent_dim,)),
        layers.Dense(4 * 4 * 8, name="gdense"),
        layers.LeakyReLU(negative_slope=0.2),
        layers.Reshape((4, 4, 8)),
        layers.Conv2DTranspose(8, (4, 4), strides=(2, 2), padding="same", name="gconv"),
        layers.LeakyReLU(negative_slope=0.2),
        layers.Conv2D(1, (3, 3), padding="same", activation="sigmoid", name="gout"),
    ], name="generator")
    gan = GAN(discriminator=discriminator, generator=generator, latent_dim=latent_dim)
    gan.compile(d_optimizer=keras.optimizers.Adam(learning_rate=3e-4),
                g_optimizer=keras.optimizers.Adam(learning_rate=3e-4),
                loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))
    return gan


def _gan_fit():
    rng = _rng(10)
    return dict(x=rng.random((64, 8, 8, 1)).astype("float32"), batch_size=16, epochs=2)


PAGES["gan_custom_train_step"] = Page(
    title="Customizing fit(): a GAN (two optimizers, latent vectors from a SeedGenerator)",
    build=_gan, fit=_gan_fit, random=True, predict=False,
    model_keys={},
    changed="8x8 images, 8-dim latent space, 8 filters (28x28, 128, 64 on the page); data "
    "parallel only (convolutions)")


# -- keras.io/examples/structured_data/collaborative_filtering_movielens -------------------------
class RecommenderNet(keras.Model):
    def __init__(self, num_users, num_movies, embedding_size, **kwargs):
        super().__init__(**kwargs)
        self.user_embedding = layers.Embedding(
            num_users, embedding_size, embeddings_initializer="he_normal",
            embeddings_regularizer=keras.regularizers.l2(1e-6), name="user_embedding")
        self.user_bias = layers.Embedding(num_users, 1, name="user_bias")
        self.movie_embedding = layers.Embedding(
            num_movies, embedding_size, embeddings_initializer="he_normal",
            embeddings_regularizer=keras.regularizers.l2(1e-6), name="movie_embedding")
        self.movie_bias = layers.Embedding(num_movies, 1, name="movie_bias")

    def call(self, inputs):
        user_vector = self.user_embedding(inputs[:, 0])
        user_bias = self.user_bias(inputs[:, 0])
        movie_vector = self.movie_embedding(inputs[:, 1])
        movie_bias = self.movie_bias(inputs[:, 1])
        dot_user_movie = ops.sum(user_vector * movie_vector, axis=1, keepdims=True)
        x = dot_user_movie + user_bias + movie_bias
        return ops.nn.sigmoid(x)


def _recommender():
    model = RecommenderNet(40, 60, 8)
    model.compile(loss=keras.losses.BinaryCrossentropy(),
                  optimizer=keras.optimizers.Adam(learning_rate=1e-3))
    return model


def _recommender_fit():
    rng = _rng(11)
    x = np.stack([rng.integers(0, 40, 128), rng.integers(0, 60, 128)], axis=1).astype("int32")
    return dict(x=x, y=rng.random(128).astype("float32"), batch_size=32, epochs=3,
                validation_data=(x[:32], rng.random(32).astype("float32")))


PAGES["collaborative_filtering"] = Page(
    title="Collaborative filtering for movie recommendations (subclassed, embeddings)",
    build=_recommender, fit=_recommender_fit,
    model_keys={"user_embedding/embeddings": (None, "model"),
                "movie_embedding/embeddings": (None, "model")},
    changed="40 users, 60 movies, embeddings of 8 (610, 9724, 50 on the page), random ratings; "
    "2e-5 (the validation loss's sum order over 8 devices: 1.3e-5 measured)", rtol=2e-5)


# -- keras.io/guides/writing_your_own_callbacks + ModelCheckpoint/EarlyStopping -------------------
class LossHistory(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.per_batch = []

    def on_train_batch_end(self, batch, logs=None):
        self.per_batch.append(logs["loss"])


def _callbacks_model():
    model = keras.Sequential([keras.Input((8,)), layers.Dense(16, activation="relu", name="d1"),
                              layers.Dense(1, name="d2")])
    model.compile(optimizer=keras.optimizers.RMSprop(learning_rate=0.01),
                  loss="mean_squared_error", metrics=["mean_absolute_error"])
    return model


def _callbacks_fit():
    rng = _rng(12)
    x = rng.normal(size=(160, 8)).astype("float32")
    return dict(x=x, y=x.sum(1, keepdims=True), batch_size=32, epochs=4,
                validation_split=0.2,
                callbacks=[LossHistory(),
                           keras.callbacks.EarlyStopping(monitor="val_loss", patience=1),
                           keras.callbacks.LearningRateScheduler(
                               lambda epoch, lr: lr if epoch < 2 else lr * 0.5)])


PAGES["callbacks"] = Page(
    title="Writing your own callbacks (+ EarlyStopping, LearningRateScheduler)",
    build=_callbacks_model, fit=_callbacks_fit,
    model_keys={"d1/kernel": (None, "model"), "d1/bias": ("model",)},
    changed="8 random features summed as the target (MNIST on the page), 4 epochs, RMSprop at "
    "0.01 (0.1 on the page magnifies the sum order's rounding past 1e-5)")


# -- keras.io/guides/mixed_precision -------------------------------------------------------------
def _mixed():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        inputs = keras.Input(shape=(16,), name="digits")
        x = layers.Dense(32, activation="relu", name="dense_1")(inputs)
        x = layers.Dense(32, activation="relu", name="dense_2")(x)
        x = layers.Dense(10, name="dense_logits")(x)
        outputs = layers.Activation("softmax", dtype="float32", name="predictions")(x)
        model = keras.Model(inputs=inputs, outputs=outputs)
        model.compile(loss="sparse_categorical_crossentropy",
                      optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return model


def _mixed_fit():
    rng = _rng(13)
    return dict(x=rng.normal(size=(160, 16)).astype("float32"), y=rng.integers(0, 10, 160),
                batch_size=32, epochs=2, validation_split=0.2)


PAGES["mixed_precision"] = Page(
    title="Mixed precision (the guide's model, mixed_bfloat16)", build=_mixed, fit=_mixed_fit,
    model_keys={"dense_1/kernel": (None, "model"), "dense_1/bias": ("model",)},
    changed="mixed_bfloat16 (the page's TPU policy; CPUs compute bfloat16 with no loss "
    "scaling), set in the factory; 16 features, 32 units; SGD (Adam magnifies bfloat16's "
    "rounding in near-zero gradients). A batch split over devices sums bfloat16 products in "
    "another order: agreement to bfloat16's epsilon, one example of accuracy",
    rtol=2.0 ** -8, atol=1.0 / 32)


# -- keras.io/examples/vision/autoencoder --------------------------------------------------------
def _autoencoder():
    inputs = layers.Input(shape=(8, 8, 1))
    x = layers.Conv2D(8, (3, 3), activation="relu", padding="same", name="enc")(inputs)
    x = layers.MaxPooling2D((2, 2), padding="same")(x)
    x = layers.Conv2DTranspose(8, (3, 3), strides=2, activation="relu", padding="same",
                               name="dec")(x)
    x = layers.Conv2D(1, (3, 3), activation="sigmoid", padding="same", name="out")(x)
    model = keras.Model(inputs, x)
    model.compile(optimizer="adam", loss="binary_crossentropy")
    return model


def _autoencoder_fit():
    rng = _rng(14)
    x = rng.random((96, 8, 8, 1)).astype("float32")
    return dict(x=np.clip(x + 0.2 * rng.normal(size=x.shape), 0, 1).astype("float32"), y=x,
                batch_size=32, epochs=2)


PAGES["denoising_autoencoder"] = Page(
    title="Convolutional autoencoder for image denoising (Conv2DTranspose)",
    build=_autoencoder, fit=_autoencoder_fit,
    model_keys={},
    changed="8x8 images, 8 filters (28x28, 32 on the page), one down and one up block; "
    "nothing split over model (DTensor's convolution takes replicated filters)")


# -- keras.io/examples/generative/vae: a Sampling layer and a custom train_step ------------------
class Sampling(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        epsilon = keras.random.normal(shape=ops.shape(z_mean), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


class VAE(keras.Model):
    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder, self.decoder = encoder, decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.kl_loss_tracker]

    def train_step(self, data):
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = ops.mean(ops.sum(
                keras.losses.binary_crossentropy(data, reconstruction), axis=(1, 2)))
            kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
            kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply(grads, self.trainable_weights)
        self.total_loss_tracker.update_state(total_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {"loss": self.total_loss_tracker.result(), "kl_loss": self.kl_loss_tracker.result()}


def _vae():
    latent_dim = 2
    encoder_inputs = keras.Input(shape=(8, 8, 1))
    x = layers.Flatten()(encoder_inputs)
    x = layers.Dense(16, activation="relu", name="enc_dense")(x)
    z_mean = layers.Dense(latent_dim, name="z_mean")(x)
    z_log_var = layers.Dense(latent_dim, name="z_log_var")(x)
    z = Sampling()([z_mean, z_log_var])
    encoder = keras.Model(encoder_inputs, [z_mean, z_log_var, z], name="encoder")
    latent_inputs = keras.Input(shape=(latent_dim,))
    x = layers.Dense(64, activation="sigmoid", name="dec_dense")(latent_inputs)
    decoder_outputs = layers.Reshape((8, 8, 1))(x)
    decoder = keras.Model(latent_inputs, decoder_outputs, name="decoder")
    vae = VAE(encoder, decoder)
    vae.compile(optimizer=keras.optimizers.Adam())
    return vae


def _vae_fit():
    return dict(x=_rng(15).random((64, 8, 8, 1)).astype("float32"), batch_size=16, epochs=2)


PAGES["variational_autoencoder"] = Page(
    title="Variational AutoEncoder (Sampling with keras.random, a custom train_step)",
    build=_vae, fit=_vae_fit, random=True, predict=False,
    model_keys={"enc_dense/kernel": (None, "model"), "enc_dense/bias": ("model",)},
    changed="8x8 images, a dense encoder of 16 units (28x28 and convolutions on the page)")


# -- keras.io/examples/structured_data/imbalanced_classification ---------------------------------
def _imbalanced():
    model = keras.Sequential([keras.Input(shape=(10,)),
                              layers.Dense(32, activation="relu", name="d1"),
                              layers.Dense(32, activation="relu", name="d2"),
                              layers.Dropout(0.3),
                              layers.Dense(1, activation="sigmoid", name="out")])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="binary_crossentropy",
                  metrics=[keras.metrics.FalseNegatives(name="fn"),
                           keras.metrics.FalsePositives(name="fp"),
                           keras.metrics.Precision(name="precision"),
                           keras.metrics.Recall(name="recall")])
    return model


def _imbalanced_fit():
    rng = _rng(16)
    x = rng.normal(size=(192, 10)).astype("float32")
    y = (x[:, 0] > 1.2).astype("float32")
    counts = np.bincount(y.astype(int))
    return dict(x=x, y=y, batch_size=64, epochs=3, validation_split=1 / 3,
                class_weight={0: 1.0 / counts[0], 1: 1.0 / counts[1]})


PAGES["imbalanced_classification"] = Page(
    title="Imbalanced classification: credit card fraud (class_weight, counting metrics)",
    build=_imbalanced, fit=_imbalanced_fit, random=True,
    model_keys={"d1/kernel": (None, "model"), "d2/kernel": ("model", None)},
    changed="10 random features, about 11% positives (the page's 30 features, 0.17%), 192 rows")


# -- keras.io/guides/transfer_learning: a frozen base, then fine-tuning --------------------------
def _transfer():
    base = keras.Sequential([keras.Input((12,)), layers.Dense(16, activation="relu",
                                                               name="base1")], name="base")
    base.trainable = False
    inputs = keras.Input((12,))
    x = base(inputs, training=False)
    outputs = layers.Dense(1, name="head")(x)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=[keras.metrics.BinaryAccuracy()])
    return model


def _transfer_fit():
    rng = _rng(17)
    x = rng.normal(size=(128, 12)).astype("float32")
    return dict(x=x, y=(x[:, :3].sum(1) > 0).astype("float32"), batch_size=32, epochs=2)


PAGES["transfer_learning"] = Page(
    title="Transfer learning & fine-tuning (a frozen base under a new head)",
    build=_transfer, fit=_transfer_fit,
    model_keys={"base1/kernel": (None, "model"), "base1/bias": ("model",)},
    changed="a dense base of 16 units stands for Xception; the head trains, the base stays "
    "frozen (its weights unchanged, checked)")


# -- keras.io/examples/nlp/lstm_seq2seq-like: recurrent layers unrolled ---------------------------
def _seq2seq():
    encoder_inputs = keras.Input(shape=(6, 5))
    encoder = layers.GRU(8, return_state=True, unroll=True, name="encoder")
    _, state = encoder(encoder_inputs)
    decoder_inputs = keras.Input(shape=(6, 5))
    decoder_outputs = layers.GRU(8, return_sequences=True, unroll=True, name="decoder")(
        decoder_inputs, initial_state=state)
    outputs = layers.Dense(5, activation="softmax", name="dense")(decoder_outputs)
    model = keras.Model([encoder_inputs, decoder_inputs], outputs)
    model.compile(optimizer="rmsprop", loss="categorical_crossentropy", metrics=["accuracy"])
    return model


def _seq2seq_fit():
    rng = _rng(18)
    a = keras.utils.to_categorical(rng.integers(0, 5, (64, 6)), 5)
    b = keras.utils.to_categorical(rng.integers(0, 5, (64, 6)), 5)
    return dict(x=[a, b], y=b, batch_size=16, epochs=2, validation_split=0.25)


PAGES["seq2seq"] = Page(
    title="Character-level seq2seq (encoder-decoder, the encoder's state to the decoder)",
    build=_seq2seq, fit=_seq2seq_fit, model_keys={"dense/kernel": (None, None)},
    changed="GRU of 8 units with unroll=True (LSTM of 256 on the page; DTensor cannot lay out "
    "a differentiated while loop: recurrent layers run unrolled), sequences of 6 over 5 "
    "symbols")


# -- keras.io/examples/keras_recipes/sample_weight / tf.data input ---------------------------------
def _tfdata_model():
    model = keras.Sequential([keras.Input((6,)), layers.Dense(8, activation="relu", name="d1"),
                              layers.Dense(3, name="d2")])
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=["accuracy"])
    return model


def _tfdata_fit():
    rng = _rng(19)
    x = rng.normal(size=(128, 6)).astype("float32")
    y = rng.integers(0, 3, 128)
    w = rng.random(128).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((x, y, w)).batch(32)
    return dict(x=data, epochs=2, validation_data=data.take(1))


PAGES["tf_data_sample_weight"] = Page(
    title="Training & evaluation with the built-in methods (tf.data with sample weights)",
    build=_tfdata_model, fit=_tfdata_fit,
    model_keys={"d1/kernel": (None, "model"), "d1/bias": ("model",)},
    changed="6 random features, 3 classes, per-example weights in the dataset", predict=False)


# -- keras.io/guides/training_with_built_in_methods: a PyDataset ---------------------------------
class Batches(keras.utils.PyDataset):
    def __init__(self, x, y, batch_size, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, idx):
        sl = slice(idx * self.batch_size, (idx + 1) * self.batch_size)
        return self.x[sl], self.y[sl]


def _pydataset_fit():
    rng = _rng(20)
    return dict(x=Batches(rng.normal(size=(128, 6)).astype("float32"),
                          rng.integers(0, 3, 128), 32), epochs=2)


PAGES["pydataset"] = Page(
    title="Training & evaluation with the built-in methods (a keras.utils.PyDataset)",
    build=_tfdata_model, fit=_pydataset_fit,
    model_keys={"d1/kernel": (None, "model"), "d1/bias": ("model",)},
    changed="6 random features, 3 classes, batches of 32 served by a PyDataset", predict=False)


def predict_input(fit: dict[str, Any]):
    """What the page predicts on: the fit's x (its first 48 rows)."""
    x = fit["x"]
    if isinstance(x, dict):
        return {k: v[:48] for k, v in x.items()}
    if isinstance(x, list):
        return [v[:48] for v in x]
    return x[:48]
