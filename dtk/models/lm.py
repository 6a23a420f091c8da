"""A byte-level, decoder-only transformer LM (``dtk-train-lm``), dense or with experts, and its specs."""

from __future__ import annotations

import functools

from dtk import _env

_env.import_tensorflow_quietly()  # before tf_keras loads it: its load-time C++ lines hidden

import tf_keras  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

from dtk.models.spec import ModelSpec
from dtk.parallel import experts, sequence
from dtk.parallel.attention import BlockwiseAttention


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


SPECS = {"lm": ModelSpec(
    name="lm", factory=transformer_lm, layout="transformer_lm", optimizer="adamw",
    learning_rates={"adamw": 3e-3, "adam": 3e-3}, input_shape=(128,), num_classes=256,
    remat=(r"block\d+_(attn|ff1|ff2)",),
    note="byte-level LM on Python source; AdamW 3e-3 with 2 blocks of dim 128 learns in minutes"),
    "lm_moe": ModelSpec(
        name="lm_moe", factory=functools.partial(transformer_lm, moe_experts=8, moe_group_size=32),
        layout="transformer_lm_moe_batch", optimizer="adamw",
        learning_rates={"adamw": 3e-3, "adam": 3e-3}, input_shape=(128,), num_classes=256,
        remat=(r"block\d+_(attn|ff1|ff2)",),
        note="dtk-train-lm --moe_experts 8: 8 experts per block, sharded over the batch axis "
             "(remat leaves the expert layers out: they add their routing losses)"),
}
