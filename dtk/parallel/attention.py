"""Attention without the ``T x T`` score tensor: FlashAttention's recurrence in TensorFlow ops.

``tf_keras.layers.MultiHeadAttention`` materializes the scores ``[rows, heads, T, T]`` (and keeps
them, their softmax and its dropout for the backward pass), so its activation memory grows with
``T^2``: at T = 4,096 and 8 heads, 512 MiB a row in float32. ``BlockwiseAttention`` is the same
layer (same weights, names and outputs) computing attention one block of ``block_size`` keys at a
time with an online softmax (a running maximum and denominator per query), unrolled in Python so
that DTensor lays out every op; its gradient is written by hand (FlashAttention's backward pass:
each block's probabilities recomputed from the saved log-sum-exp), so neither pass holds more than
``[rows, heads, T, block_size]`` of scores. With the sequence sharded over ``seq``
(``dtk.parallel.sequence``) the queries of a device are ``T / seq`` of them.

A causal mask is built per block from global positions (the layer needs no ``[T, T]`` mask);
an explicit ``attention_mask`` falls back to the dense computation. Attention dropout is not
supported (``dropout`` must be 0): the residual dropout of a transformer is unaffected.

Example::

    attn = dtk.parallel.attention.BlockwiseAttention(num_heads=8, key_dim=64, block_size=256)
    out = attn(x, x, use_causal_mask=True)      # as MultiHeadAttention, memory O(T * block)
"""

from __future__ import annotations

import functools
import logging
import math

import tensorflow as tf
import tf_keras


_AHEAD = 1e30  # a key ahead of the query by n positions adds -n * _AHEAD to its score
_LAG = 1  # blocks in flight: block j starts once block j - _LAG is done (2 measured T^2 again)
# Blocks are chained (``_chain``) where all of their scores at once would exceed this: chaining
# costs speed (LM, T = 4,096, batch=8: 3,399 against 2,210 ms a step unchained), and below it
# the scores are small (T = 512, 8 rows, 8 heads: 64 MiB in all; one row of 2,048, 4 heads).
_CHAIN_BYTES = 64 << 20
# Keys per block when none is given. Measured (BUILD.md, "Long sequences"): one row of 4,096 on
# batch=1,seq=8, blocks of 256 held 0.212-0.267x the memory of MultiHeadAttention on batch=8
# (5 runs, median 0.245x), blocks of 128 0.273x, 512 about the same as 256; fewer ops, faster.
DEFAULT_BLOCK_SIZE = 256


@functools.lru_cache(maxsize=None)  # one warning per length
def default_block_size(key_length: int) -> int:
    """Keys per block for ``key_length`` keys when none is given: ``DEFAULT_BLOCK_SIZE``, the
    whole length when it is shorter, else the largest divisor of the length below it."""
    if key_length <= DEFAULT_BLOCK_SIZE:
        return key_length
    block = max(d for d in range(1, DEFAULT_BLOCK_SIZE + 1) if key_length % d == 0)
    if block < 32:
        logging.getLogger("dtk").warning(
            "blockwise attention: %d keys have no divisor between 32 and %d, so blocks of %d "
            "keys (%d blocks, each a few ops, slow to trace and run); a sequence length divisible "
            "by %d is faster", key_length, DEFAULT_BLOCK_SIZE, block, key_length // block,
            DEFAULT_BLOCK_SIZE)
    return block


def _block_scores(q, q_pos, k_blk, k_start, causal, *, heads_first: bool = False):
    """Scores ``[B, H, Tq, bk]`` of one key block (q already scaled, ``[B, Tq, H, D]``, or
    ``[B, H, Tq, D]`` with ``heads_first``), masked if causal.

    ``q_pos``: the queries' global positions times ``_AHEAD``, ``[Tq]`` or ``[B, H, Tq]``."""
    s = tf.einsum("bhqd,bkhd->bhqk" if heads_first else "bqhd,bkhd->bhqk", q, k_blk)
    if causal:
        # 0 where the key is at or before the query, hugely negative after it. Arithmetic, not a
        # broadcast comparison: DTensor crashed on the comparison from T = 1,024 on.
        # Positions times 1e30 (rounding keeps their order): 0 exactly where the key is not
        # ahead, and no [.., Tq, bk] product.
        k_pos = tf.cast(k_start + tf.range(k_blk.shape[1]), s.dtype) * tf.cast(_AHEAD, s.dtype)
        s = s + tf.minimum(q_pos[..., None] - k_pos, 0.0)
    return s


def _chain(previous):
    """A factor of exactly 1.0, ``[B, H, Tq]``, that exists only once ``previous`` (``[B, H, Tq]``,
    from the last block) does.

    A block's score product, causal mask and ``dO V^T`` do not depend on the blocks before it,
    and TensorFlow's executor runs every op that is ready: unrolled, all blocks' were computed at
    once and held until their turn (the ``T x T`` tensor in pieces: 2.9 GiB at T = 8,192 on one
    device, 292 MiB chained; BUILD.md, "Long sequences"). Multiplied into a block's inputs, the
    factor chains it after the last. ``sign(|x| + 1)`` is 1.0 for every finite ``x`` and no
    optimizer folds it. Control dependencies did not chain the blocks. It is used in the
    inputs' own ``[B, H, Tq, ...]`` layout: a transposed factor made DTensor's SPMD expansion
    fail on ``batch=1,seq=8`` (a transpose that "needs communication").
    """
    return tf.sign(tf.abs(previous) + 1.0)


def blockwise_attention(q, k, v, *, block_size: int, causal: bool, skip_future: bool = True):
    """``softmax(q k^T / sqrt(d)) v`` one key block at a time; q ``[B, Tq, H, D]``, k and v
    ``[B, Tk, H, D]``; returns ``[B, Tq, H, D]``. The gradient recomputes each block's
    probabilities (FlashAttention), so memory is ``O(Tq * block_size)`` per row and head.

    With ``causal`` and ``skip_future`` (queries and keys of one length), key block ``j`` is
    scored only against the queries at or after its first key: the queries before it would mask
    all of it. That halves the work of both passes at long lengths (FlashAttention's causal
    skipping). The queries' dim 1 is sliced for it: pass ``skip_future=False`` where that dim is
    sharded (context parallelism with gathered keys), where a slice would gather it."""
    tk = k.shape[1]
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer; got {block_size!r}")
    if tk % block_size:
        raise ValueError(f"block_size {block_size} does not divide the key length {tk}; use a "
                         f"block size that divides it (e.g. {math.gcd(tk, block_size)})")
    scale = 1.0 / math.sqrt(float(q.shape[-1]))
    blocks = tk // block_size
    rows, tq, heads = (int(d or 1) for d in q.shape[:3])
    lag = _LAG if rows * heads * tq * tk * q.dtype.size > _CHAIN_BYTES else blocks
    skip = causal and skip_future and q.shape[1] == tk

    def start(j):  # the first query that sees key block j
        return j * block_size if skip else 0

    def suffix(x, j, axis):  # x from query start(j) on, along its query dim
        s0 = start(j)
        if not s0:
            return x
        return x[(slice(None),) * axis + (slice(s0, None),)]

    def merged(full, part, j, axis):  # full with its queries from start(j) on replaced by part
        s0 = start(j)
        if not s0:
            return part
        return tf.concat([full[(slice(None),) * axis + (slice(0, s0),)], part], axis=axis)

    @tf.custom_gradient
    def attend(q, k, v):
        qs = q * tf.cast(scale, q.dtype)
        qs_h = tf.einsum("bqhd->bhqd", qs) if lag < blocks else None  # [B, H, Tq, D]
        q_pos = tf.cast(tf.range(q.shape[1]), q.dtype) * tf.cast(_AHEAD, q.dtype)
        m = l = acc = None
        ls = []
        for j in range(blocks):
            k_blk = k[:, j * block_size:(j + 1) * block_size]
            v_blk = v[:, j * block_size:(j + 1) * block_size]
            pos = suffix(q_pos, j, 0)
            if j < lag:
                s = _block_scores(suffix(qs, j, 1), pos, k_blk, j * block_size, causal)
            else:
                # Sliced after the chained product: a slice of an input alone would run (and be
                # held) for every block at once.
                one = _chain(ls[j - lag])  # [B, H, Tq]
                s = _block_scores(suffix(qs_h * one[..., None], j, 2), pos * suffix(one, j, 2),
                                  k_blk, j * block_size, causal, heads_first=True)
            m_blk = tf.reduce_max(s, axis=-1)  # [B, H, Tq - start(j)]
            if m is None:
                m_new = m_blk
                p = tf.exp(s - m_new[..., None])
                l = tf.reduce_sum(p, axis=-1)
                acc = tf.einsum("bhqk,bkhd->bhqd", p, v_blk)
            else:
                m_old = suffix(m, j, 2)
                m_new = tf.maximum(m_old, m_blk)
                correction = tf.exp(m_old - m_new)
                p = tf.exp(s - m_new[..., None])
                l = merged(l, suffix(l, j, 2) * correction + tf.reduce_sum(p, axis=-1), j, 2)
                acc = merged(acc, suffix(acc, j, 2) * correction[..., None]
                             + tf.einsum("bhqk,bkhd->bhqd", p, v_blk), j, 2)
                m_new = merged(m, m_new, j, 2)
            m = m_new
            ls.append(l)
        out = tf.einsum("bhqd->bqhd", acc / l[..., None])  # [B, Tq, H, D]
        lse = m + tf.math.log(l)  # [B, H, Tq]

        def grad(d_out):
            d_out_h = tf.einsum("bqhd->bhqd", d_out)  # [B, H, Tq, D]
            out_h = tf.einsum("bqhd->bhqd", out)
            delta = tf.reduce_sum(d_out_h * out_h, axis=-1)  # [B, H, Tq]
            dq_h = None  # [B, H, Tq, D], scaled at the end
            dks, dvs, tokens = [], [], []  # tokens: [B, H, Tq], each once block j is all done
            for j in range(blocks):
                k_blk = k[:, j * block_size:(j + 1) * block_size]
                v_blk = v[:, j * block_size:(j + 1) * block_size]
                pos = suffix(q_pos, j, 0)
                if j < lag:
                    q_j = suffix(qs, j, 1)  # [B, Tq - start(j), H, D]
                    s = _block_scores(q_j, pos, k_blk, j * block_size, causal)
                    d_out_j = suffix(d_out_h, j, 2)
                else:
                    # The block's suffix sliced from the chained products (as above).
                    one = _chain(tokens[j - lag])
                    q_j = suffix(qs_h * one[..., None], j, 2)  # [B, H, Tq - start(j), D]
                    s = _block_scores(q_j, pos * suffix(one, j, 2), k_blk, j * block_size,
                                      causal, heads_first=True)
                    d_out_j = suffix(d_out_h * one[..., None], j, 2)
                p = tf.exp(s - suffix(lse, j, 2)[..., None])  # the block's probabilities
                dvs.append(tf.einsum("bhqk,bhqd->bkhd", p, d_out_j))
                dp = tf.einsum("bhqd,bkhd->bhqk", d_out_j, v_blk)
                ds = p * (dp - suffix(delta, j, 2)[..., None])
                dq_j = tf.einsum("bhqk,bkhd->bhqd", ds, k_blk)
                if start(j):
                    dq_j = tf.pad(dq_j, [[0, 0], [0, 0], [start(j), 0], [0, 0]])
                dq_h = dq_j if dq_h is None else dq_h + dq_j
                dks.append(tf.einsum("bhqk,bhqd->bkhd" if j >= lag else "bhqk,bqhd->bkhd", ds,
                                     q_j))
                if lag < blocks:
                    # The next block starts once this one's three products exist, not only its
                    # scores: products nothing waits on ran late, holding the block's p, ds and
                    # slices meanwhile (4,096 keys, 512 queries, blocks of 128 keys: 122 against
                    # 101 MiB; blocks of 32: 288 against 173; BUILD.md, "Long sequences").
                    kv = tf.reduce_sum(dks[-1], axis=[1, 3]) + tf.reduce_sum(dvs[-1], axis=[1, 3])
                    tokens.append(tf.reduce_sum(dq_h, axis=-1) * _chain(kv)[..., None])
            dq = tf.einsum("bhqd->bqhd", dq_h) * tf.cast(scale, dq_h.dtype)
            return dq, tf.concat(dks, axis=1), tf.concat(dvs, axis=1)

        return out, grad

    return attend(q, k, v)


@tf_keras.saving.register_keras_serializable(package="dtk")
class BlockwiseAttention(tf_keras.layers.MultiHeadAttention):
    """``MultiHeadAttention`` with blockwise attention: the same weights (``_query_dense`` ...,
    so layout tables apply unchanged), values and gradients, memory linear in the key length.

    Args:
      block_size: keys per block; must divide the key length (a block longer than the keys is
        one block). None: ``default_block_size`` of the key length (256 where it divides).
      Others: as ``tf_keras.layers.MultiHeadAttention`` (``dropout`` must be 0).
    """

    def __init__(self, num_heads, key_dim, *, block_size: int | None = None, **kwargs):
        if kwargs.get("dropout", 0.0):
            raise ValueError(f"BlockwiseAttention does not drop attention probabilities "
                             f"(dropout={kwargs['dropout']}); pass dropout=0 (a transformer's "
                             "residual dropout is unaffected) or use MultiHeadAttention")
        given = [("num_heads", num_heads), ("key_dim", key_dim)]
        if block_size is not None:  # None: the default for the key length (default_block_size)
            given.append(("block_size", block_size))
        for name, value in given:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BlockwiseAttention: {name} must be a positive integer; got "
                                 f"{value!r}")
        super().__init__(num_heads, key_dim, **kwargs)
        self.block_size = block_size
        self._dtk_causal = False

    def call(self, query, value, key=None, attention_mask=None, return_attention_scores=False,
             training=None, use_causal_mask=False):
        if return_attention_scores:
            raise ValueError("BlockwiseAttention never forms the attention scores "
                             "(return_attention_scores=True); use MultiHeadAttention for them")
        # The causal mask is applied per block from positions, not as a [T, T] tensor.
        self._dtk_causal = use_causal_mask and attention_mask is None
        return super().call(query, value, key=key, attention_mask=attention_mask,
                            training=training,
                            use_causal_mask=use_causal_mask and not self._dtk_causal)

    def _compute_attention(self, query, key, value, attention_mask=None, training=None):
        if attention_mask is not None or query.shape.rank != 4:
            return super()._compute_attention(query, key, value, attention_mask, training)
        # Future key blocks are skipped by slicing the queries, unless they are sharded along
        # the sequence (dtk.parallel.sequence sets this for context parallelism by all-gather).
        out = blockwise_attention(query, key, value, block_size=self.block_size_for(key.shape[1]),
                                  causal=self._dtk_causal,
                                  skip_future=not getattr(self, "_dtk_queries_sharded", False))
        return out, None

    def block_size_for(self, key_length: int) -> int:
        """The keys per block this layer uses for ``key_length`` keys."""
        if self.block_size is None:
            return default_block_size(int(key_length))
        return min(self.block_size, int(key_length))

    def get_config(self):
        return {**super().get_config(), "block_size": self.block_size}
