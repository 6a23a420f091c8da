"""keras.io pages trained by Keras's own ``fit`` as the page calls it: issue 58's acceptance pages.

Each entry keeps its page's model code, ``compile()`` and ``fit()`` call (callbacks,
``class_weight``, validation, a model's own ``compile()`` signature and ``train_step``), smaller
(narrower layers, smaller images and vocabularies, a few steps), on synthetic data of the page's
shapes (nothing downloads). ``changed`` says what differs from the page and why.
``tests/test_keras_io.py::test_keras_io_fit_page`` adds the one line, ``dtk.distribute``, and
trains each on ``batch=1``, ``batch=8`` and ``batch=4,model=2``.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf
import tf_keras
from tf_keras import layers

B = 16  # the global batch of every page here (the pages' own are 32 to 2048)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Page:
    """One keras.io page: its model factory (compiled as the page compiles it), its ``fit``
    arguments as the page passes them (data included), and what differs from the page."""

    page: str
    factory: Callable[[], tf_keras.Model]
    fit: Callable[[], dict[str, Any]]  # fresh arguments (callbacks hold state) for model.fit
    changed: str = ""
    input_shape: tuple[int, ...] | None = None
    draws: bool = False  # the model draws random numbers in training (Dropout, sampling)
    rtol: float = 1e-5  # the agreement asked of every logged number
    # Why a run killed after epoch 1 and run again cannot give the uninterrupted run's numbers
    # (as with Keras's own BackupAndRestore); "" when it does, bit for bit.
    resume_differs: str = ""
    atol: float = 1e-6


def model_for(page: Page, spec: str, *, seed: int = 7) -> tf_keras.Model:
    """The page's model: plain tf_keras (``spec="plain"``, seeded as ``dtk.distribute`` seeds),
    or with the one line ``dtk.distribute`` on mesh ``spec``."""
    if spec == "plain":
        tf_keras.utils.set_random_seed(seed)
        model = page.factory()
        if page.input_shape is not None:
            model(tf.zeros([1, *page.input_shape]))
        return model
    import dtk  # pylint: disable=import-outside-toplevel
    return dtk.distribute(page.factory, dtk.build_mesh(spec), seed=seed, allow_replicated=True,
                          input_shape=page.input_shape)


def _rng(seed=0):
    return np.random.default_rng(seed)


def _tmp(name: str) -> str:
    return os.path.join(tempfile.mkdtemp(), name)


# -- "Imbalanced classification: credit card fraud detection" ----------------------------------
def fraud_detection():
    model = tf_keras.Sequential([
        tf_keras.Input(shape=(12,)),
        layers.Dense(32, activation="relu"),
        layers.Dense(32, activation="relu"),
        layers.Dropout(0.3),
        layers.Dense(32, activation="relu"),
        layers.Dropout(0.3),
        layers.Dense(1, activation="sigmoid"),
    ])
    metrics = [
        tf_keras.metrics.FalseNegatives(name="fn"),
        tf_keras.metrics.FalsePositives(name="fp"),
        tf_keras.metrics.TrueNegatives(name="tn"),
        tf_keras.metrics.TruePositives(name="tp"),
        tf_keras.metrics.Precision(name="precision"),
        tf_keras.metrics.Recall(name="recall"),
    ]
    model.compile(optimizer=tf_keras.optimizers.Adam(1e-2), loss="binary_crossentropy",
                  metrics=metrics)
    return model


def _fraud_fit():
    rng = _rng()
    features = rng.standard_normal((6 * B, 12)).astype(np.float32)
    targets = (rng.random((6 * B, 1)) < 0.1).astype("uint8")
    counts = np.bincount(targets[:, 0], minlength=2)
    weight_for_0, weight_for_1 = 1.0 / counts[0], 1.0 / counts[1]
    val = 2 * B
    return dict(x=features[:-val], y=targets[:-val], batch_size=B, epochs=2, verbose=0,
                callbacks=[tf_keras.callbacks.ModelCheckpoint(
                    _tmp("fraud_model_at_epoch_{epoch}.keras"))],
                validation_data=(features[-val:], targets[-val:]),
                class_weight={0: weight_for_0, 1: weight_for_1})


# -- "Knowledge Distillation" -------------------------------------------------------------------
class Distiller(tf_keras.Model):
    def __init__(self, student, teacher):
        super().__init__()
        self.teacher = teacher
        self.student = student

    def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha=0.1,
                temperature=3):
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn = student_loss_fn
        self.distillation_loss_fn = distillation_loss_fn
        self.alpha = alpha
        self.temperature = temperature

    def train_step(self, data):
        x, y = data
        teacher_predictions = self.teacher(x, training=False)
        with tf.GradientTape() as tape:
            student_predictions = self.student(x, training=True)
            student_loss = self.student_loss_fn(y, student_predictions)
            distillation_loss = (
                self.distillation_loss_fn(
                    tf.nn.softmax(teacher_predictions / self.temperature, axis=1),
                    tf.nn.softmax(student_predictions / self.temperature, axis=1),
                ) * self.temperature**2)
            loss = self.alpha * student_loss + (1 - self.alpha) * distillation_loss
        trainable_vars = self.student.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply_gradients(zip(gradients, trainable_vars))
        self.compiled_metrics.update_state(y, student_predictions)
        results = {m.name: m.result() for m in self.metrics}
        results.update({"student_loss": student_loss, "distillation_loss": distillation_loss})
        return results

    def _evaluation_step(self, data):  # the page's test_step
        x, y = data
        y_prediction = self.student(x, training=False)
        student_loss = self.student_loss_fn(y, y_prediction)
        self.compiled_metrics.update_state(y, y_prediction)
        results = {m.name: m.result() for m in self.metrics}
        results.update({"student_loss": student_loss})
        return results

    test_step = _evaluation_step  # Keras's hook (bound by name: no test_ function to collect)

    def call(self, x):
        return self.student(x)


def distillation():
    teacher = tf_keras.Sequential([
        tf_keras.Input(shape=(12, 12, 1)),
        layers.Conv2D(8, (3, 3), strides=(2, 2), padding="same"),
        layers.LeakyReLU(alpha=0.2),
        layers.MaxPooling2D(pool_size=(2, 2), strides=(1, 1), padding="same"),
        layers.Conv2D(16, (3, 3), strides=(2, 2), padding="same"),
        layers.Flatten(),
        layers.Dense(10),
    ], name="teacher")
    student = tf_keras.Sequential([
        tf_keras.Input(shape=(12, 12, 1)),
        layers.Conv2D(4, (3, 3), strides=(2, 2), padding="same"),
        layers.LeakyReLU(alpha=0.2),
        layers.MaxPooling2D(pool_size=(2, 2), strides=(1, 1), padding="same"),
        layers.Conv2D(8, (3, 3), strides=(2, 2), padding="same"),
        layers.Flatten(),
        layers.Dense(10),
    ], name="student")
    distiller = Distiller(student=student, teacher=teacher)
    distiller.compile(
        optimizer=tf_keras.optimizers.Adam(),
        metrics=[tf_keras.metrics.SparseCategoricalAccuracy()],
        student_loss_fn=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        distillation_loss_fn=tf_keras.losses.KLDivergence(),
        alpha=0.1,
        temperature=10,
    )
    return distiller


def _digits(n=4 * B, size=12):
    rng = _rng(1)
    return (rng.random((n, size, size, 1), dtype=np.float32),
            rng.integers(0, 10, n).astype(np.int64))


def _distillation_fit():
    x, y = _digits()
    return dict(x=x, y=y, batch_size=B, epochs=2, verbose=0)


# -- "Image classification with Vision Transformer" ---------------------------------------------
VIT = dict(image_size=12, patch_size=4, projection_dim=8, num_heads=2, layers=1)


def mlp(x, hidden_units, dropout_rate):
    for units in hidden_units:
        x = layers.Dense(units, activation=tf.nn.gelu)(x)
        x = layers.Dropout(dropout_rate)(x)
    return x


class Patches(layers.Layer):
    def __init__(self, patch_size, **kwargs):
        super().__init__(**kwargs)
        self.patch_size = patch_size

    def call(self, images):
        batch_size = tf.shape(images)[0]
        patches = tf.image.extract_patches(
            images=images,
            sizes=[1, self.patch_size, self.patch_size, 1],
            strides=[1, self.patch_size, self.patch_size, 1],
            rates=[1, 1, 1, 1],
            padding="VALID",
        )
        patch_dims = patches.shape[-1]
        patches = tf.reshape(patches, [batch_size, -1, patch_dims])
        return patches


class PatchEncoder(layers.Layer):
    def __init__(self, num_patches, projection_dim, **kwargs):
        super().__init__(**kwargs)
        self.num_patches = num_patches
        self.projection = layers.Dense(units=projection_dim)
        self.position_embedding = layers.Embedding(input_dim=num_patches,
                                                   output_dim=projection_dim)

    def call(self, patch):
        positions = tf.range(start=0, limit=self.num_patches, delta=1)
        encoded = self.projection(patch) + self.position_embedding(positions)
        return encoded


def vit_classifier(num_classes=10):
    image_size, patch_size = VIT["image_size"], VIT["patch_size"]
    projection_dim, num_heads = VIT["projection_dim"], VIT["num_heads"]
    num_patches = (image_size // patch_size) ** 2
    transformer_units = [projection_dim * 2, projection_dim]
    inputs = layers.Input(shape=(image_size, image_size, 3))
    patches = Patches(patch_size)(inputs)
    encoded_patches = PatchEncoder(num_patches, projection_dim)(patches)
    for _ in range(VIT["layers"]):
        x1 = layers.LayerNormalization(epsilon=1e-6)(encoded_patches)
        attention_output = layers.MultiHeadAttention(
            num_heads=num_heads, key_dim=projection_dim, dropout=0.1)(x1, x1)
        x2 = layers.Add()([attention_output, encoded_patches])
        x3 = layers.LayerNormalization(epsilon=1e-6)(x2)
        x3 = mlp(x3, hidden_units=transformer_units, dropout_rate=0.1)
        encoded_patches = layers.Add()([x3, x2])
    representation = layers.LayerNormalization(epsilon=1e-6)(encoded_patches)
    representation = layers.Flatten()(representation)
    representation = layers.Dropout(0.5)(representation)
    features = mlp(representation, hidden_units=[16, 8], dropout_rate=0.5)
    logits = layers.Dense(num_classes)(features)
    model = tf_keras.Model(inputs=inputs, outputs=logits)
    model.compile(
        optimizer=tf_keras.optimizers.AdamW(learning_rate=0.001, weight_decay=0.0001),
        loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[
            tf_keras.metrics.SparseCategoricalAccuracy(name="accuracy"),
            tf_keras.metrics.SparseTopKCategoricalAccuracy(5, name="top-5-accuracy"),
        ],
    )
    return model


def _images(n=5 * B, size=12, seed=2):
    rng = _rng(seed)
    return (rng.random((n, size, size, 3), dtype=np.float32),
            rng.integers(0, 10, n).astype(np.int64))


def _vit_fit():
    x, y = _images()
    return dict(x=x, y=y, batch_size=B, epochs=2, validation_split=0.2, verbose=0,
                callbacks=[tf_keras.callbacks.ModelCheckpoint(
                    _tmp("checkpoint.weights.h5"), monitor="val_accuracy", save_best_only=True,
                    save_weights_only=True)])


# -- "Image classification with modern MLP models" (MLP-Mixer) ---------------------------------
class MLPMixerLayer(layers.Layer):
    def __init__(self, num_patches, hidden_units, dropout_rate, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mlp1 = tf_keras.Sequential([
            layers.Dense(units=num_patches, activation="gelu"),
            layers.Dense(units=num_patches),
            layers.Dropout(rate=dropout_rate),
        ])
        self.mlp2 = tf_keras.Sequential([
            layers.Dense(units=num_patches, activation="gelu"),
            layers.Dense(units=hidden_units),
            layers.Dropout(rate=dropout_rate),
        ])
        self.normalize = layers.LayerNormalization(epsilon=1e-6)

    def call(self, inputs):
        x = self.normalize(inputs)
        x_channels = tf.linalg.matrix_transpose(x)
        mlp1_outputs = self.mlp1(x_channels)
        mlp1_outputs = tf.linalg.matrix_transpose(mlp1_outputs)
        x = mlp1_outputs + inputs
        x_patches = self.normalize(x)
        mlp2_outputs = self.mlp2(x_patches)
        x = x + mlp2_outputs
        return x


class MixerPatches(layers.Layer):
    """The tf.keras page's Patches (it reshapes to ``num_patches``: a static shape for the
    Dense layers that mix across patches)."""

    def __init__(self, patch_size, num_patches):
        super().__init__()
        self.patch_size = patch_size
        self.num_patches = num_patches

    def call(self, images):
        batch_size = tf.shape(images)[0]
        patches = tf.image.extract_patches(
            images=images,
            sizes=[1, self.patch_size, self.patch_size, 1],
            strides=[1, self.patch_size, self.patch_size, 1],
            rates=[1, 1, 1, 1],
            padding="VALID",
        )
        patch_dims = patches.shape[-1]
        patches = tf.reshape(patches, [batch_size, self.num_patches, patch_dims])
        return patches


def mlp_mixer(num_classes=10, image_size=12, patch_size=4, embedding_dim=8, num_blocks=1,
              dropout_rate=0.2):
    num_patches = (image_size // patch_size) ** 2
    inputs = layers.Input(shape=(image_size, image_size, 3))
    patches = MixerPatches(patch_size, num_patches)(inputs)
    x = layers.Dense(units=embedding_dim)(patches)
    blocks = tf_keras.Sequential([MLPMixerLayer(num_patches, embedding_dim, dropout_rate)
                                  for _ in range(num_blocks)])
    x = blocks(x)
    representation = layers.GlobalAveragePooling1D()(x)
    representation = layers.Dropout(rate=dropout_rate)(representation)
    logits = layers.Dense(num_classes)(representation)
    model = tf_keras.Model(inputs=inputs, outputs=logits)
    model.compile(
        optimizer=tf_keras.optimizers.AdamW(learning_rate=0.005, weight_decay=0.0001),
        loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[
            tf_keras.metrics.SparseCategoricalAccuracy(name="acc"),
            tf_keras.metrics.SparseTopKCategoricalAccuracy(5, name="top5-acc"),
        ],
    )
    return model


def _mixer_fit():
    x, y = _images(seed=3)
    return dict(x=x, y=y, batch_size=B, epochs=2, validation_split=0.2, verbose=0,
                callbacks=[tf_keras.callbacks.EarlyStopping(monitor="val_loss", patience=10,
                                                            restore_best_weights=True),
                           tf_keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5,
                                                                patience=1)])


# -- "English-to-Spanish translation with a sequence-to-sequence Transformer" -----------------
SEQ = dict(vocab_size=40, sequence_length=6, embed_dim=8, latent_dim=16, num_heads=2)


class TransformerEncoder(layers.Layer):
    def __init__(self, embed_dim, dense_dim, num_heads, **kwargs):
        super().__init__(**kwargs)
        self.attention = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.dense_proj = tf_keras.Sequential([layers.Dense(dense_dim, activation="relu"),
                                               layers.Dense(embed_dim)])
        self.layernorm_1 = layers.LayerNormalization()
        self.layernorm_2 = layers.LayerNormalization()
        self.supports_masking = True

    def call(self, inputs, mask=None):
        if mask is not None:
            padding_mask = tf.cast(mask[:, tf.newaxis, :], dtype="int32")
        else:
            padding_mask = None
        attention_output = self.attention(query=inputs, value=inputs, key=inputs,
                                          attention_mask=padding_mask)
        proj_input = self.layernorm_1(inputs + attention_output)
        proj_output = self.dense_proj(proj_input)
        return self.layernorm_2(proj_input + proj_output)


class PositionalEmbedding(layers.Layer):
    def __init__(self, sequence_length, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_embeddings = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.position_embeddings = layers.Embedding(input_dim=sequence_length,
                                                    output_dim=embed_dim)

    def call(self, inputs):
        length = tf.shape(inputs)[-1]
        positions = tf.range(start=0, limit=length, delta=1)
        return self.token_embeddings(inputs) + self.position_embeddings(positions)

    def compute_mask(self, inputs, mask=None):
        return tf.math.not_equal(inputs, 0)


class TransformerDecoder(layers.Layer):
    def __init__(self, embed_dim, latent_dim, num_heads, **kwargs):
        super().__init__(**kwargs)
        self.attention_1 = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.attention_2 = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.dense_proj = tf_keras.Sequential([layers.Dense(latent_dim, activation="relu"),
                                               layers.Dense(embed_dim)])
        self.layernorm_1 = layers.LayerNormalization()
        self.layernorm_2 = layers.LayerNormalization()
        self.layernorm_3 = layers.LayerNormalization()
        self.supports_masking = True

    def call(self, inputs, encoder_outputs, mask=None):
        causal_mask = self.get_causal_attention_mask(inputs)
        if mask is not None:
            padding_mask = tf.cast(mask[:, tf.newaxis, :], dtype="int32")
            padding_mask = tf.minimum(padding_mask, causal_mask)
        else:
            padding_mask = None
        attention_output_1 = self.attention_1(query=inputs, value=inputs, key=inputs,
                                              attention_mask=causal_mask)
        out_1 = self.layernorm_1(inputs + attention_output_1)
        attention_output_2 = self.attention_2(query=out_1, value=encoder_outputs,
                                              key=encoder_outputs, attention_mask=padding_mask)
        out_2 = self.layernorm_2(out_1 + attention_output_2)
        proj_output = self.dense_proj(out_2)
        return self.layernorm_3(out_2 + proj_output)

    def get_causal_attention_mask(self, inputs):
        input_shape = tf.shape(inputs)
        batch_size, sequence_length = input_shape[0], input_shape[1]
        i = tf.range(sequence_length)[:, tf.newaxis]
        j = tf.range(sequence_length)
        mask = tf.cast(i >= j, dtype="int32")
        mask = tf.reshape(mask, (1, input_shape[1], input_shape[1]))
        mult = tf.concat([tf.expand_dims(batch_size, -1), tf.constant([1, 1], dtype=tf.int32)],
                         axis=0)
        return tf.tile(mask, mult)


def seq2seq_transformer():
    vocab_size, sequence_length = SEQ["vocab_size"], SEQ["sequence_length"]
    embed_dim, latent_dim, num_heads = SEQ["embed_dim"], SEQ["latent_dim"], SEQ["num_heads"]
    encoder_inputs = tf_keras.Input(shape=(sequence_length,), dtype="int64",
                                    name="encoder_inputs")
    x = PositionalEmbedding(sequence_length, vocab_size, embed_dim)(encoder_inputs)
    encoder_outputs = TransformerEncoder(embed_dim, latent_dim, num_heads)(x)
    encoder = tf_keras.Model(encoder_inputs, encoder_outputs)
    decoder_inputs = tf_keras.Input(shape=(sequence_length,), dtype="int64",
                                    name="decoder_inputs")
    encoded_seq_inputs = tf_keras.Input(shape=(sequence_length, embed_dim),
                                        name="decoder_state_inputs")
    x = PositionalEmbedding(sequence_length, vocab_size, embed_dim)(decoder_inputs)
    x = TransformerDecoder(embed_dim, latent_dim, num_heads)(x, encoded_seq_inputs)
    x = layers.Dropout(0.5)(x)
    decoder_outputs = layers.Dense(vocab_size, activation="softmax")(x)
    decoder = tf_keras.Model([decoder_inputs, encoded_seq_inputs], decoder_outputs)
    decoder_outputs = decoder([decoder_inputs, encoder_outputs])
    transformer = tf_keras.Model([encoder_inputs, decoder_inputs], decoder_outputs,
                                 name="transformer")
    transformer.compile("rmsprop", loss="sparse_categorical_crossentropy",
                        metrics=["accuracy"])
    return transformer


def _pairs(n, seed):
    """(English ids, Spanish ids) as the page's format_dataset gives them: the decoder reads the
    Spanish sentence up to its last token and predicts it from its second."""
    rng = _rng(seed)
    length, vocab = SEQ["sequence_length"], SEQ["vocab_size"]

    def padded(size):
        ids = rng.integers(1, vocab, (n, size))
        lengths = rng.integers(2, size + 1, n)
        ids[np.arange(size)[None, :] >= lengths[:, None]] = 0  # padding: id 0, masked
        return ids.astype(np.int64)

    eng, spa = padded(length), padded(length + 1)
    return {"encoder_inputs": eng, "decoder_inputs": spa[:, :-1]}, spa[:, 1:]


def _seq2seq_fit():
    def make_dataset(seed, n):
        inputs, targets = _pairs(n, seed)
        dataset = tf.data.Dataset.from_tensor_slices((inputs, targets))
        return dataset.batch(B)

    return dict(x=make_dataset(4, 4 * B), epochs=2, validation_data=make_dataset(5, B),
                verbose=0)


# -- "Image similarity estimation using a Siamese Network with a contrastive loss" ------------
def euclidean_distance(vects):
    x, y = vects
    sum_square = tf.math.reduce_sum(tf.math.square(x - y), axis=1, keepdims=True)
    return tf.math.sqrt(tf.math.maximum(sum_square, tf_keras.backend.epsilon()))


def loss(margin=1):
    def contrastive_loss(y_true, y_pred):
        square_pred = tf.math.square(y_pred)
        margin_square = tf.math.square(tf.math.maximum(margin - (y_pred), 0))
        return tf.math.reduce_mean((1 - y_true) * square_pred + (y_true) * margin_square)
    return contrastive_loss


def siamese():
    input = layers.Input((12, 12, 1))  # pylint: disable=redefined-builtin
    x = layers.BatchNormalization()(input)
    x = layers.Conv2D(4, (3, 3), activation="tanh")(x)
    x = layers.AveragePooling2D(pool_size=(2, 2))(x)
    x = layers.Conv2D(8, (3, 3), activation="tanh")(x)
    x = layers.AveragePooling2D(pool_size=(2, 2))(x)
    x = layers.Flatten()(x)
    x = layers.BatchNormalization()(x)
    x = layers.Dense(10, activation="tanh")(x)
    embedding_network = tf_keras.Model(input, x)
    input_1 = layers.Input((12, 12, 1))
    input_2 = layers.Input((12, 12, 1))
    tower_1 = embedding_network(input_1)
    tower_2 = embedding_network(input_2)
    merge_layer = layers.Lambda(euclidean_distance, output_shape=(1,))([tower_1, tower_2])
    normal_layer = layers.BatchNormalization()(merge_layer)
    output_layer = layers.Dense(1, activation="sigmoid")(normal_layer)
    siamese = tf_keras.Model(inputs=[input_1, input_2], outputs=output_layer)  # pylint: disable=redefined-outer-name
    siamese.compile(loss=loss(margin=1), optimizer="RMSprop", metrics=["accuracy"])
    return siamese


def _siamese_fit():
    x, _ = _digits(5 * B)
    rng = _rng(6)
    other = x[rng.permutation(len(x))]
    labels = (rng.random(len(x)) < 0.5).astype(np.float32)
    val = B
    return dict(x=[x[:-val], other[:-val]], y=labels[:-val],
                validation_data=([x[-val:], other[-val:]], labels[-val:]), batch_size=B,
                epochs=2, verbose=0)


# -- "Collaborative Filtering for Movie Recommendations" ----------------------------------------
class RecommenderNet(tf_keras.Model):
    def __init__(self, num_users, num_movies, embedding_size, **kwargs):
        super().__init__(**kwargs)
        self.num_users = num_users
        self.num_movies = num_movies
        self.embedding_size = embedding_size
        self.user_embedding = layers.Embedding(
            num_users, embedding_size, embeddings_initializer="he_normal",
            embeddings_regularizer=tf_keras.regularizers.l2(1e-6))
        self.user_bias = layers.Embedding(num_users, 1)
        self.movie_embedding = layers.Embedding(
            num_movies, embedding_size, embeddings_initializer="he_normal",
            embeddings_regularizer=tf_keras.regularizers.l2(1e-6))
        self.movie_bias = layers.Embedding(num_movies, 1)

    def call(self, inputs):
        user_vector = self.user_embedding(inputs[:, 0])
        user_bias = self.user_bias(inputs[:, 0])
        movie_vector = self.movie_embedding(inputs[:, 1])
        movie_bias = self.movie_bias(inputs[:, 1])
        dot_user_movie = tf.tensordot(user_vector, movie_vector, 2)
        x = dot_user_movie + user_bias + movie_bias
        return tf.nn.sigmoid(x)


def collaborative_filtering(num_users=30, num_movies=50, embedding_size=8):
    model = RecommenderNet(num_users, num_movies, embedding_size)
    model.compile(loss=tf_keras.losses.BinaryCrossentropy(),
                  optimizer=tf_keras.optimizers.Adam(learning_rate=0.001))
    return model


def _ratings_fit():
    rng = _rng(7)
    n = 5 * B
    x = np.stack([rng.integers(0, 30, n), rng.integers(0, 50, n)], axis=1)
    y = rng.random(n).astype(np.float32)
    train = 4 * B
    return dict(x=x[:train], y=y[:train], batch_size=B, epochs=2, verbose=0,
                validation_data=(x[train:], y[train:]))


# -- "Timeseries forecasting for weather prediction" (its fit with callbacks) -----------------
def weather_lstm(sequence_length=8, features=7):
    inputs = tf_keras.layers.Input(shape=(sequence_length, features))
    lstm_out = tf_keras.layers.LSTM(16)(inputs)
    outputs = tf_keras.layers.Dense(1)(lstm_out)
    model = tf_keras.Model(inputs=inputs, outputs=outputs)
    model.compile(optimizer=tf_keras.optimizers.Adam(learning_rate=0.001), loss="mse")
    return model


def _weather_fit():
    rng = _rng(8)
    values = rng.standard_normal((6 * B + 8, 7)).astype(np.float32)
    targets = values[:, 1:2].cumsum(0) * 0.1

    def dataset(start, stop):
        return tf_keras.preprocessing.timeseries_dataset_from_array(
            values[start:stop], targets[start + 8:stop + 8], sequence_length=8, sampling_rate=1,
            batch_size=B)

    return dict(x=dataset(0, 4 * B), epochs=2, validation_data=dataset(4 * B, 5 * B),
                verbose=0, callbacks=[
                    tf_keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=0,
                                                     patience=5),
                    tf_keras.callbacks.ModelCheckpoint(
                        monitor="val_loss", filepath=_tmp("model_checkpoint.h5"), verbose=0,
                        save_weights_only=True, save_best_only=True)])


# -- "Writing your own callbacks" ---------------------------------------------------------------
def callbacks_guide_model():
    model = tf_keras.Sequential()
    model.add(tf_keras.layers.Dense(1, input_dim=16))
    model.compile(optimizer=tf_keras.optimizers.RMSprop(learning_rate=0.1),
                  loss="mean_squared_error", metrics=["mean_absolute_error"])
    return model


class EarlyStoppingAtMinLoss(tf_keras.callbacks.Callback):
    """Stop training when the loss is at its min, i.e. the loss stops decreasing."""

    def __init__(self, patience=0):
        super().__init__()
        self.patience = patience
        self.best_weights = None

    def on_train_begin(self, logs=None):
        self.wait = 0
        self.stopped_epoch = 0
        self.best = np.inf

    def on_epoch_end(self, epoch, logs=None):
        current = logs.get("loss")
        if np.less(current, self.best):
            self.best = current
            self.wait = 0
            self.best_weights = self.model.get_weights()
        else:
            self.wait += 1
            if self.wait >= self.patience:
                self.stopped_epoch = epoch
                self.model.stop_training = True
                self.model.set_weights(self.best_weights)


class CustomLearningRateScheduler(tf_keras.callbacks.Callback):
    def __init__(self, schedule):
        super().__init__()
        self.schedule = schedule

    def on_epoch_begin(self, epoch, logs=None):
        lr = float(tf_keras.backend.get_value(self.model.optimizer.learning_rate))
        scheduled_lr = self.schedule(epoch, lr)
        tf_keras.backend.set_value(self.model.optimizer.lr, scheduled_lr)


LR_SCHEDULE = [(3, 0.05), (6, 0.01), (9, 0.005), (12, 0.001)]


def lr_schedule(epoch, lr):
    if epoch < LR_SCHEDULE[0][0] or epoch > LR_SCHEDULE[-1][0]:
        return lr
    for i in range(len(LR_SCHEDULE)):
        if epoch == LR_SCHEDULE[i][0]:
            return LR_SCHEDULE[i][1]
    return lr


def _callbacks_fit():
    rng = _rng(9)
    x = rng.standard_normal((4 * B, 16)).astype(np.float32)
    y = (x @ rng.standard_normal(16) * 3).astype(np.float32)
    return dict(x=x, y=y, batch_size=B, steps_per_epoch=2, epochs=15, verbose=0,
                callbacks=[EarlyStoppingAtMinLoss(patience=1),
                           CustomLearningRateScheduler(lr_schedule)])


# -- "Training & evaluation with the built-in methods" (custom metric, add_loss, weights) -----
class CategoricalTruePositives(tf_keras.metrics.Metric):
    def __init__(self, name="categorical_true_positives", **kwargs):
        super().__init__(name=name, **kwargs)
        self.true_positives = self.add_weight(name="ctp", initializer="zeros")

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_pred = tf.reshape(tf.argmax(y_pred, axis=1), shape=(-1, 1))
        values = tf.cast(y_true, "int32") == tf.cast(y_pred, "int32")
        values = tf.cast(values, "float32")
        if sample_weight is not None:
            sample_weight = tf.cast(sample_weight, "float32")
            values = tf.multiply(values, sample_weight)
        self.true_positives.assign_add(tf.reduce_sum(values))

    def result(self):
        return self.true_positives

    def reset_state(self):
        self.true_positives.assign(0.0)


class ActivityRegularizationLayer(layers.Layer):
    def call(self, inputs):
        self.add_loss(tf.reduce_sum(inputs) * 0.1)
        return inputs  # Pass-through layer.


def training_guide_model():
    inputs = tf_keras.Input(shape=(16,), name="digits")
    x = layers.Dense(32, activation="relu", name="dense_1")(inputs)
    x = ActivityRegularizationLayer()(x)
    x = layers.Dense(32, activation="relu", name="dense_2")(x)
    outputs = layers.Dense(10, activation="softmax", name="predictions")(x)
    model = tf_keras.Model(inputs=inputs, outputs=outputs)
    model.compile(optimizer=tf_keras.optimizers.RMSprop(learning_rate=1e-3),
                  loss=tf_keras.losses.SparseCategoricalCrossentropy(),
                  metrics=[CategoricalTruePositives()])
    return model


def _training_guide_fit():
    rng = _rng(10)
    x = rng.standard_normal((5 * B, 16)).astype(np.float32)
    y = rng.integers(0, 10, (5 * B, 1)).astype(np.int64)
    class_weight = {i: 1.0 for i in range(10)}
    class_weight[5] = 2.0
    return dict(x=x[:4 * B], y=y[:4 * B], class_weight=class_weight, batch_size=B, epochs=2,
                validation_data=(x[4 * B:], y[4 * B:]), verbose=0)


# -- "Text classification from scratch" ---------------------------------------------------------
def text_classification(max_features=60, embedding_dim=8, sequence_length=12):
    inputs = tf_keras.Input(shape=(sequence_length,), dtype="int64")
    x = layers.Embedding(max_features, embedding_dim)(inputs)
    x = layers.Dropout(0.5)(x)
    x = layers.Conv1D(8, 3, padding="valid", activation="relu", strides=2)(x)
    x = layers.Conv1D(8, 3, padding="valid", activation="relu", strides=2)(x)
    x = layers.GlobalMaxPooling1D()(x)
    x = layers.Dense(8, activation="relu")(x)
    x = layers.Dropout(0.5)(x)
    predictions = layers.Dense(1, activation="sigmoid", name="predictions")(x)
    model = tf_keras.Model(inputs, predictions)
    model.compile(loss="binary_crossentropy", optimizer="adam", metrics=["accuracy"])
    return model


def _text_fit():
    rng = _rng(11)

    def dataset(n):
        x = rng.integers(0, 60, (n, 12)).astype(np.int64)
        y = rng.integers(0, 2, n).astype(np.int64)  # 1-D labels, as the page's text_dataset
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(B)

    return dict(x=dataset(4 * B), validation_data=dataset(B), epochs=2, verbose=0)


PAGES: dict[str, Page] = {
    "fraud_detection": Page(
        page="Imbalanced classification: credit card fraud detection", factory=fraud_detection,
        fit=_fraud_fit, draws=True,
        changed="12 features, 32 units, 64 training rows, batch 16 (the page's 2048)"),
    "distillation": Page(
        page="Knowledge Distillation", factory=distillation, fit=_distillation_fit,
        input_shape=(12, 12, 1),
        changed="12x12 images, 4-16 filters; the teacher is not trained first (its weights are "
        "the seed's); dtk.distribute(input_shape=...): the Distiller is built by its first fit "
        "on the page",
        # KL divergence of two softmaxes at temperature 10 (both near uniform) times T**2 = 100:
        # the sum's cancellation turns a 1-ULP change in a probability into ~3e-6 of the loss
        # (measured 3.2e-6 on batch=8 against one device; student_loss holds 1e-6)
        atol=1e-5),
    "vit": Page(
        page="Image classification with Vision Transformer", factory=vit_classifier,
        fit=_vit_fit, draws=True,
        changed="12x12 images in 4x4 patches, 1 block of dim 8; no augmentation model (its "
        "Normalization is adapted on the training set, its random zoom is another page's)"),
    "mlp_mixer": Page(
        page="Image classification with modern MLP models (MLP-Mixer)", factory=mlp_mixer,
        fit=_mixer_fit, draws=True,
        changed="12x12 images in 4x4 patches, 1 block of dim 8; no augmentation model"),
    "seq2seq_transformer": Page(
        page="English-to-Spanish translation with a sequence-to-sequence Transformer",
        factory=seq2seq_transformer, fit=_seq2seq_fit, draws=True,
        changed="vocabulary 40, length 6, dim 8; synthetic id pairs padded with 0 (masked "
        "through compute_mask as on the page)"),
    "siamese_contrastive": Page(
        page="Image similarity estimation using a Siamese Network with a contrastive loss",
        factory=siamese, fit=_siamese_fit,
        changed="12x12 images, 4-8 filters of 3x3"),
    "collaborative_filtering": Page(
        page="Collaborative Filtering for Movie Recommendations",
        factory=collaborative_filtering, fit=_ratings_fit, input_shape=(2,),
        changed="30 users, 50 movies, dim 8; dtk.distribute(input_shape=(2,)): the subclassed "
        "model is built by its first fit on the page"),
    "weather_callbacks": Page(
        page="Timeseries forecasting for weather prediction (fit with EarlyStopping and "
        "ModelCheckpoint)", factory=weather_lstm, fit=_weather_fit,
        changed="8 steps of 7 features, 16 units; the page's timeseries_dataset_from_array on "
        "synthetic values"),
    "custom_callbacks": Page(
        page="Writing your own callbacks (EarlyStoppingAtMinLoss, CustomLearningRateScheduler)",
        factory=callbacks_guide_model, fit=_callbacks_fit,
        resume_differs="steps_per_epoch=2 over a finite array: Keras's fit continues one "
        "iterator across epochs, and a resumed fit starts it again at the first batch; the "
        "page's EarlyStoppingAtMinLoss keeps its best loss in the callback, which starts "
        "afresh",
        changed="16 features for 784"),
    "training_guide": Page(
        page="Training & evaluation with the built-in methods (custom metric, add_loss, "
        "class_weight)", factory=training_guide_model, fit=_training_guide_fit,
        changed="16 features, 32 units"),
    "text_classification": Page(
        page="Text classification from scratch", factory=text_classification, fit=_text_fit,
        draws=True,
        changed="vocabulary 60, length 12, 8 filters; token ids as the page's vectorized "
        "dataset gives them"),
}


# -- "DCGAN to generate face images" (its own compile(), two optimizers, draws in train_step) --
LATENT_DIM = 8


def dcgan_parts():
    discriminator = tf_keras.Sequential([
        tf_keras.Input(shape=(16, 16, 3)),
        layers.Conv2D(8, kernel_size=4, strides=2, padding="same"),
        layers.LeakyReLU(alpha=0.2),
        layers.Conv2D(16, kernel_size=4, strides=2, padding="same"),
        layers.LeakyReLU(alpha=0.2),
        layers.Flatten(),
        layers.Dropout(0.2),
        layers.Dense(1, activation="sigmoid"),
    ], name="discriminator")
    generator = tf_keras.Sequential([
        tf_keras.Input(shape=(LATENT_DIM,)),
        layers.Dense(4 * 4 * 16),
        layers.Reshape((4, 4, 16)),
        layers.Conv2DTranspose(16, kernel_size=4, strides=2, padding="same"),
        layers.LeakyReLU(alpha=0.2),
        layers.Conv2DTranspose(8, kernel_size=4, strides=2, padding="same"),
        layers.LeakyReLU(alpha=0.2),
        layers.Conv2D(3, kernel_size=5, padding="same", activation="sigmoid"),
    ], name="generator")
    return discriminator, generator


class GAN(tf_keras.Model):
    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn
        self.d_loss_metric = tf_keras.metrics.Mean(name="d_loss")
        self.g_loss_metric = tf_keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_metric, self.g_loss_metric]

    def train_step(self, real_images):
        batch_size = tf.shape(real_images)[0]
        random_latent_vectors = tf.random.normal(shape=(batch_size, self.latent_dim))
        generated_images = self.generator(random_latent_vectors)
        combined_images = tf.concat([generated_images, real_images], axis=0)
        labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
        labels += 0.05 * tf.random.uniform(tf.shape(labels))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        random_latent_vectors = tf.random.normal(shape=(batch_size, self.latent_dim))
        misleading_labels = tf.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_metric.update_state(d_loss)
        self.g_loss_metric.update_state(g_loss)
        return {"d_loss": self.d_loss_metric.result(), "g_loss": self.g_loss_metric.result()}


class GANMonitor(tf_keras.callbacks.Callback):
    def __init__(self, num_img=3, latent_dim=LATENT_DIM):
        super().__init__()
        self.num_img = num_img
        self.latent_dim = latent_dim
        self.folder = tempfile.mkdtemp()

    def on_epoch_end(self, epoch, logs=None):
        random_latent_vectors = tf.random.normal(shape=(self.num_img, self.latent_dim))
        generated_images = self.model.generator(random_latent_vectors)
        generated_images *= 255
        generated_images.numpy()
        for i in range(self.num_img):
            img = tf_keras.utils.array_to_img(generated_images[i])
            img.save(os.path.join(self.folder, f"generated_img_{epoch:03d}_{i}.png"))


def dcgan():
    discriminator, generator = dcgan_parts()
    gan = GAN(discriminator=discriminator, generator=generator, latent_dim=LATENT_DIM)
    gan.compile(
        d_optimizer=tf_keras.optimizers.Adam(learning_rate=0.0001),
        g_optimizer=tf_keras.optimizers.Adam(learning_rate=0.0001),
        loss_fn=tf_keras.losses.BinaryCrossentropy(),
    )
    return gan


def _faces_fit():
    faces = _rng(12).random((4 * B, 16, 16, 3), dtype=np.float32)
    dataset = tf.data.Dataset.from_tensor_slices(faces).batch(B)
    return dict(x=dataset, epochs=2, verbose=0, callbacks=[GANMonitor(num_img=3)])


PAGES["dcgan"] = Page(
    page="DCGAN to generate face images (its own compile(), two optimizers)", factory=dcgan,
    fit=_faces_fit, draws=True,
    changed="16x16 images, 8-16 filters, latent dim 8; random images for the faces")


# -- "Mixed precision" guide ------------------------------------------------------------------
def mixed_precision_guide():
    from tf_keras import mixed_precision  # pylint: disable=import-outside-toplevel
    mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        inputs = tf_keras.Input(shape=(16,), name="digits")
        num_units = 32
        dense1 = layers.Dense(num_units, activation="relu", name="dense_1")
        x = dense1(inputs)
        dense2 = layers.Dense(num_units, activation="relu", name="dense_2")
        x = dense2(x)
        x = layers.Dense(10, name="dense_logits")(x)
        outputs = layers.Activation("softmax", dtype="float32", name="predictions")(x)
        model = tf_keras.Model(inputs=inputs, outputs=outputs)
        model.compile(loss="sparse_categorical_crossentropy",
                      optimizer=tf_keras.optimizers.RMSprop(), metrics=["accuracy"])
    finally:
        mixed_precision.set_global_policy("float32")
    return model


def _mixed_precision_fit():
    rng = _rng(13)
    x = rng.standard_normal((5 * B, 16)).astype(np.float32)
    y = rng.integers(0, 10, 5 * B).astype(np.int64)
    return dict(x=x, y=y, batch_size=B, epochs=2, validation_split=0.2, verbose=0)


PAGES["mixed_precision"] = Page(
    page="Mixed precision (the guide's model and fit, policy mixed_bfloat16)",
    factory=mixed_precision_guide, fit=_mixed_precision_fit,
    changed="the policy is mixed_bfloat16 (the guide's choice for TPUs; CPUs compute bfloat16, "
    "and it needs no loss scaling), set inside the factory and reset after it (the page sets it "
    "for the process); 16 features, 32 units. A batch split over devices sums its bfloat16 "
    "gradients in another order than one device, so the numbers agree to bfloat16's epsilon "
    "(2^-8; measured 4.7e-4 at most) and the accuracies within one example, not to 1e-5",
    rtol=2.0 ** -8, atol=1.0 / B)  # bfloat16 epsilon; one example of accuracy


# -- "OCR model for reading Captchas" (CTC loss added by a layer) ------------------------------
# (16 wide: 4 time steps after pooling, the fewest CTC takes for 2 labels plus a blank between;
# each step is unrolled in the LSTMs and the CTC recursion)
OCR = dict(img_width=16, img_height=8, max_length=2, characters=9)


class CTCLayer(layers.Layer):
    def __init__(self, name=None):
        super().__init__(name=name)
        self.loss_fn = tf_keras.backend.ctc_batch_cost

    def call(self, y_true, y_pred):
        batch_len = tf.cast(tf.shape(y_true)[0], dtype="int64")
        input_length = tf.cast(tf.shape(y_pred)[1], dtype="int64")
        label_length = tf.cast(tf.shape(y_true)[1], dtype="int64")
        input_length = input_length * tf.ones(shape=(batch_len, 1), dtype="int64")
        label_length = label_length * tf.ones(shape=(batch_len, 1), dtype="int64")
        loss = self.loss_fn(y_true, y_pred, input_length, label_length)
        self.add_loss(loss)
        return y_pred


def ocr_model():
    img_width, img_height = OCR["img_width"], OCR["img_height"]
    input_img = layers.Input(shape=(img_width, img_height, 1), name="image", dtype="float32")
    labels = layers.Input(name="label", shape=(OCR["max_length"],), dtype="float32")
    x = layers.Conv2D(8, (3, 3), activation="relu", kernel_initializer="he_normal",
                      padding="same", name="Conv1")(input_img)
    x = layers.MaxPooling2D((2, 2), name="pool1")(x)
    x = layers.Conv2D(8, (3, 3), activation="relu", kernel_initializer="he_normal",
                      padding="same", name="Conv2")(x)
    x = layers.MaxPooling2D((2, 2), name="pool2")(x)
    new_shape = ((img_width // 4), (img_height // 4) * 8)
    x = layers.Reshape(target_shape=new_shape, name="reshape")(x)
    x = layers.Dense(16, activation="relu", name="dense1")(x)
    x = layers.Dropout(0.2)(x)
    x = layers.Bidirectional(layers.LSTM(8, return_sequences=True, dropout=0.25,
                                         unroll=True))(x)
    # the page: len(char_to_num.get_vocabulary()) + 1, the vocabulary with its OOV token
    x = layers.Dense(OCR["characters"] + 2, activation="softmax", name="dense2")(x)
    output = CTCLayer(name="ctc_loss")(labels, x)
    model = tf_keras.models.Model(inputs=[input_img, labels], outputs=output,
                                  name="ocr_model_v1")
    opt = tf_keras.optimizers.Adam()
    model.compile(optimizer=opt)
    return model


def _captchas_fit():
    rng = _rng(14)

    def dataset(n):
        images = rng.random((n, OCR["img_width"], OCR["img_height"], 1), dtype=np.float32)
        labels = rng.integers(1, OCR["characters"] + 1, (n, OCR["max_length"])).astype(
            np.float32)  # char_to_num's ids (0 is its OOV token)
        return tf.data.Dataset.from_tensor_slices({"image": images, "label": labels}).batch(B)

    return dict(x=dataset(4 * B), validation_data=dataset(B), epochs=2, verbose=0,
                callbacks=[tf_keras.callbacks.EarlyStopping(monitor="val_loss", patience=10,
                                                            restore_best_weights=True)])


PAGES["ocr_ctc"] = Page(
    page="OCR model for reading Captchas (CTC loss through add_loss)", factory=ocr_model,
    fit=_captchas_fit, draws=True,
    changed="16x8 images, 2 characters of 9, 8 filters, one BiLSTM of 8 units; labels of a "
    "static length (shape=(2,), not (None,)) and the LSTM with unroll=True (its dropout masks "
    "are cached per graph, which dtk refuses with that fix): dtk unrolls the CTC recursion over "
    "static lengths; Keras's ctc_batch_cost runs as dtk's equivalent on the mesh "
    "(dtk.parallel.ops.ctc_batch_cost)")
