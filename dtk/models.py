"""Reference models for MNIST: the DTensor tutorial's MLP and a small CNN.

They are plain tf_keras models with stable layer names (``d1``, ``d2``, ``c1`` ...), because layout
tables in ``layouts/`` refer to weights by those names. Call them inside a layout scope (see
``dtk.parallel.layouts``) to get laid-out DTensor weights; outside one they are ordinary Keras models, which
is how the single-device reference runs in the parity tests are built.

Both return logits (no softmax): use ``from_logits=True`` losses. The last layer is float32 under
mixed precision, because a bfloat16 softmax cross-entropy loses accuracy.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable

from dtk import _env

_env.import_tensorflow_quietly()  # before tf_keras loads it: its load-time C++ lines hidden

import tf_keras  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

from dtk.parallel import experts, sequence
from dtk.parallel.attention import BlockwiseAttention

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


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """One model with the defaults that travel with it (as torchtitan's ``ModelSpec``).

    Scripts, tests and benchmarks derive their defaults from here, so they cannot disagree.

    Attributes:
      name: the short name (``--model``).
      factory: builds a new, plain tf_keras model (laid out when called under a layout scope).
      layout: the default layout table.
      optimizer: the default optimizer name.
      learning_rates: tuned learning rate per optimizer name; others use ``fallback_rate``.
      input_shape: one example's input shape, without the batch dim.
      num_classes: output classes (labels must lie in ``[0, num_classes)``).
      note: why the defaults are what they are.
      remat: the layers ``remat=("blocks",)`` (``--remat blocks``) recomputes: layer-name
        patterns of the model's repeated blocks.
    """

    name: str
    factory: Callable[[], tf_keras.Model]
    layout: str
    optimizer: str
    learning_rates: dict[str, float]
    input_shape: tuple[int, ...]
    num_classes: int
    note: str = ""
    remat: tuple[str, ...] = ()

    def remat_patterns(self, requested) -> tuple[str, ...]:
        """``requested`` layer-name patterns, with ``"blocks"`` replaced by the model's own."""
        out = []
        for pattern in requested:
            out.extend(self.remat if pattern == "blocks" else [pattern])
        return tuple(out)

    def learning_rate(self, optimizer: str) -> float:
        """The tuned rate for ``optimizer``, else 0.1 for SGD and 1e-3 for adaptive optimizers."""
        key = optimizer.lower()
        return self.learning_rates.get(key, 0.1 if key == "sgd" else 1e-3)


MODEL_SPECS = {
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
MODELS = {name: spec.factory for name, spec in MODEL_SPECS.items()}


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


# -- a byte-level transformer language model ----------------------------------------------------
@tf_keras.saving.register_keras_serializable(package="dtk")
class PositionEmbedding(tf_keras.layers.Layer):
    """Learned position embeddings ``[seq_len, dim]`` added to the token embeddings."""

    def __init__(self, seq_len: int, dim: int, **kwargs):
        super().__init__(**kwargs)
        self.seq_len, self.dim = seq_len, dim

    def build(self, input_shape):
        self.embeddings = self.add_weight(
            name="embeddings", shape=(self.seq_len, self.dim),
            initializer=tf_keras.initializers.RandomNormal(stddev=0.02))
        super().build(input_shape)

    def call(self, x):
        return x + tf_keras.backend.cast(self.embeddings, x.dtype)[: x.shape[1]]

    def get_config(self):
        return {**super().get_config(), "seq_len": self.seq_len, "dim": self.dim}


def transformer_lm(*, vocab: int = 256, seq_len: int = 128, dim: int = 128, heads: int = 4,
                   layers: int = 2, ff: int | None = None, dropout: float = 0.0,
                   attention: str = "mha", block_size: int | None = None,
                   moe_experts: int = 0, moe_top_k: int = 1, moe_capacity_factor: float = 1.25,
                   moe_every: int = 1, moe_group_size: int | None = None,
                   name: str = "transformer_lm") -> tf_keras.Model:
    """A decoder-only (GPT-style) transformer over byte tokens: next-token logits ``[B, T, vocab]``.

    Token + learned position embeddings, ``layers`` pre-norm blocks of causal multi-head
    self-attention and a GELU MLP (``ff`` = 4 * dim by default), a final layer norm and an output
    projection. Layer names (``embed``, ``pos``, ``block{i}_attn``, ``block{i}_ff1`` ...) are what
    ``layouts/transformer_lm.toml`` refers to. The logits are float32 under mixed precision.

    ``attention="blockwise"`` computes attention ``block_size`` keys at a time
    (``dtk.parallel.attention.BlockwiseAttention``: the same weights, memory linear in
    ``seq_len``; no dropout on the attention probabilities, the residual dropout stays; None:
    the layer's default, 256 keys where they divide ``seq_len``).

    ``moe_experts=E`` replaces the MLP of every ``moe_every``-th block (blocks ``moe_every - 1``,
    ``2 * moe_every - 1``, ...) by a mixture of E experts of width ``ff``
    (``dtk.parallel.experts.MixtureOfExperts``, named ``block{i}_moe``): top-``moe_top_k``
    routing over groups of ``moe_group_size`` positions (None: the whole sequence) with
    ``moe_capacity_factor``, its load-balancing and z-losses added to the loss. Lay it out with
    ``layouts/transformer_lm_moe.toml`` (experts over ``expert``) or
    ``transformer_lm_moe_batch.toml`` (experts over ``batch``).
    """
    ff = ff or 4 * dim
    if attention not in ("mha", "blockwise"):
        raise ValueError(f"attention must be 'mha' or 'blockwise'; got {attention!r}")
    if dim % heads:
        raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
    if moe_experts:
        experts.check_settings(num_experts=moe_experts, top_k=moe_top_k,
                               capacity_factor=moe_capacity_factor)
        if not isinstance(moe_every, int) or moe_every < 1:
            raise ValueError(f"moe_every must be a positive integer; got {moe_every!r}")
    tokens = tf_keras.Input((seq_len,), dtype="int32", name="tokens")
    h = tf_keras.layers.Embedding(vocab, dim, name="embed",
                                  embeddings_initializer=tf_keras.initializers.RandomNormal(
                                      stddev=0.02))(tokens)
    h = PositionEmbedding(seq_len, dim, name="pos")(h)
    # The residual stream, sharded along the sequence where the mesh and table say so
    # (dtk.parallel.sequence); identity layers elsewhere.
    h = sequence.SequenceSharding(name="seq_in")(h)
    h = tf_keras.layers.Dropout(dropout, name="drop_in")(h)
    for i in range(layers):
        a = tf_keras.layers.LayerNormalization(epsilon=1e-5, name=f"block{i}_ln1")(h)
        kv = sequence.SequenceGather(name=f"block{i}_kv")(a)  # every key and value position
        q = sequence.SequenceGather(megatron_only=True, name=f"block{i}_q")(a)
        if attention == "blockwise":
            attn = BlockwiseAttention(heads, dim // heads, block_size=block_size,
                                      name=f"block{i}_attn")
        else:
            attn = tf_keras.layers.MultiHeadAttention(heads, dim // heads, dropout=dropout,
                                                      name=f"block{i}_attn")
        a = attn(q, kv, kv, use_causal_mask=True)
        a = tf_keras.layers.Dropout(dropout, name=f"block{i}_drop1")(a)
        h = sequence.SequenceSharding(name=f"block{i}_seq1")(h + a)
        f = tf_keras.layers.LayerNormalization(epsilon=1e-5, name=f"block{i}_ln2")(h)
        if moe_experts and i % moe_every == moe_every - 1:
            # Routed where the tokens are (no gather): the all-to-all moves them to the experts.
            f = experts.MixtureOfExperts(
                moe_experts, ff, top_k=moe_top_k, capacity_factor=moe_capacity_factor,
                group_size=moe_group_size, name=f"block{i}_moe")(f)
        else:
            f = sequence.SequenceGather(megatron_only=True, name=f"block{i}_ffin")(f)
            f = tf_keras.layers.Dense(ff, activation="gelu", name=f"block{i}_ff1")(f)
            f = tf_keras.layers.Dense(dim, name=f"block{i}_ff2")(f)
        f = tf_keras.layers.Dropout(dropout, name=f"block{i}_drop2")(f)
        h = sequence.SequenceSharding(name=f"block{i}_seq2")(h + f)
    h = tf_keras.layers.LayerNormalization(epsilon=1e-5, name="ln_f")(h)
    logits = tf_keras.layers.Dense(vocab, name="head", dtype="float32")(h)
    return tf_keras.Model(tokens, logits, name=name)


MODEL_SPECS["lm"] = ModelSpec(
    name="lm", factory=transformer_lm, layout="transformer_lm", optimizer="adamw",
    learning_rates={"adamw": 3e-3, "adam": 3e-3}, input_shape=(128,), num_classes=256,
    remat=(r"block\d+_(attn|ff1|ff2)",),
    note="byte-level LM on Python source; AdamW 3e-3 with 2 blocks of dim 128 learns in minutes")
MODELS["lm"] = transformer_lm


# -- a DLRM-style recommender --------------------------------------------------------------------
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
