"""Issue 44: blockwise attention (dtk.parallel.attention) equals MultiHeadAttention, values and
gradients, without forming the T x T scores; the LM with it trains alike on sequence meshes."""

import functools

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from dtk.parallel import attention


def _pair(heads=4, key_dim=8, block=4, **kwargs):
    dense = tf_keras.layers.MultiHeadAttention(heads, key_dim, **kwargs)
    blockwise = attention.BlockwiseAttention(heads, key_dim, block_size=block, **kwargs)
    return dense, blockwise


@pytest.mark.parametrize("skip", [True, False], ids=["skip_future", "all_blocks"])
@pytest.mark.parametrize("chained", [False, True], ids=["parallel", "chained"])
@pytest.mark.parametrize("causal, tq, tk, block", [
    (True, 16, 16, 4), (False, 16, 16, 4), (True, 16, 16, 16), (False, 8, 16, 8), (True, 12, 12, 3)])
def test_values_and_gradients_equal_multi_head_attention(monkeypatch, causal, tq, tk, block,
                                                         chained, skip):
    """Both schedules: blocks free to run at once (small scores), and each block chained after
    the last (``_CHAIN_BYTES`` exceeded: the memory linear in T); causal, with the queries
    before each key block skipped (the default) and with every block scored against every
    query (queries sharded along the sequence)."""
    monkeypatch.setattr(attention, "_CHAIN_BYTES", 0 if chained else 1 << 40)
    tf_keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    q = tf.constant(rng.normal(size=(2, tq, 16)), tf.float32)
    kv = tf.constant(rng.normal(size=(2, tk, 16)), tf.float32)
    dense, blockwise = _pair(block=block)
    object.__setattr__(blockwise, "_dtk_queries_sharded", not skip)
    dense(q, kv, use_causal_mask=causal)
    blockwise(q, kv, use_causal_mask=causal)
    blockwise.set_weights(dense.get_weights())
    results = []
    for layer in (dense, blockwise):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([q, kv])
            out = layer(q, kv, use_causal_mask=causal)
            loss = tf.reduce_sum(out * tf.sin(out))
        grads = tape.gradient(loss, [q, kv, *layer.trainable_variables])
        results.append((out.numpy(), [g.numpy() for g in grads]))
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    for got, want in zip(results[1][1], results[0][1]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def gradient_step(layer):
    """A compiled forward and backward pass of causal self-attention: the gradients of the sum of
    ``layer(x, x)`` with respect to ``x`` and the layer's weights."""
    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(layer(x, x, use_causal_mask=True))
        return tape.gradient(loss, [x, *layer.trainable_variables])
    return step


def test_no_tensor_of_the_full_score_shape_is_formed():
    """The forward and backward graphs hold no [B, H, T, T] tensor (MultiHeadAttention's do)."""
    tf_keras.utils.set_random_seed(0)
    x = tf.random.normal([1, 64, 16])

    def shapes(layer):
        layer(x, x, use_causal_mask=True)
        graph = gradient_step(layer).get_concrete_function(x).graph
        found = set()
        for op in graph.get_operations():
            for out in op.outputs:
                if out.shape.rank == 4:
                    found.add(tuple(out.shape.as_list()))
        return found

    dense, blockwise = _pair(block=16)
    assert (1, 4, 64, 64) in shapes(dense)
    blocks = shapes(blockwise)
    assert (1, 4, 64, 64) not in blocks and (1, 4, 64, 16) in blocks


@pytest.mark.parametrize("kwargs, message", [
    ({"dropout": 0.1}, "BlockwiseAttention does not drop attention probabilities"),
    ({"block_size": 0}, "block_size must be a positive integer; got 0"),
    ({"num_heads": 0}, "BlockwiseAttention: num_heads must be a positive integer; got 0"),
    ({"key_dim": 8.0}, "BlockwiseAttention: key_dim must be a positive integer; got 8.0"),
    ({"block_size": "32"}, "block_size must be a positive integer; got '32'"),
])
def test_bad_arguments_are_one_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        attention.BlockwiseAttention(**{"num_heads": 4, "key_dim": 8, **kwargs})


def test_the_function_checks_its_block_size():
    q = tf.zeros([1, 8, 2, 4])
    with pytest.raises(ValueError, match="block_size must be a positive integer; got 0"):
        attention.blockwise_attention(q, q, q, block_size=0, causal=True)


def test_a_block_size_that_does_not_divide_the_sequence_is_one_value_error():
    layer = attention.BlockwiseAttention(4, 8, block_size=5)
    x = tf.zeros([1, 12, 16])
    with pytest.raises(ValueError, match="block_size 5 does not divide the key length 12"):
        layer(x, x)


@pytest.mark.parametrize("keys, block", [(64, 64), (256, 256), (512, 256), (4096, 256),
                                         (384, 192), (1000, 250), (257, 1)])
def test_the_default_block_is_256_keys_or_the_largest_divisor_below(keys, block):
    assert attention.default_block_size(keys) == block
    assert attention.BlockwiseAttention(4, 8).block_size_for(keys) == block
    assert attention.BlockwiseAttention(4, 8, block_size=128).block_size_for(keys) == min(128, keys)


def test_a_length_without_a_divisor_of_32_to_256_is_named_in_a_warning(caplog):
    with caplog.at_level("WARNING", logger="dtk"):
        assert attention.default_block_size(1031) == 1  # a prime
    assert "1031 keys have no divisor between 32 and 256, so blocks of 1 keys" in caplog.text


def test_the_layer_round_trips_through_its_config():
    layer = attention.BlockwiseAttention(4, 8, block_size=32)
    again = attention.BlockwiseAttention.from_config(layer.get_config())
    assert again.block_size == 32 and again.get_config()["num_heads"] == 4


@pytest.mark.slow
def test_one_long_row_takes_the_working_set_the_planner_counts():
    """Forward and backward of one causal row of 8,192 positions (4 heads, blocks of 128) on one
    device grow the process by at most 1.4x the 18 block-sized tensors that attention alone holds
    (dtk.planning.profile.BLOCKS_LIVE's note): 288 MiB; measured 331-339 MiB with the layer's
    projections (2026-11-26), 267 MiB for attention alone since the backward pass chains each
    block's products (``scripts/bench_attention_memory.py``, which this test runs).
    MultiHeadAttention takes 3,984 MiB here. Memory, not time: a busy machine does not change it.
    Mutations: the blocks unchained (2.8 GiB), and the block's queries sliced before the chained
    product (every block's slice made at once: 481 MiB), both fail."""
    import json  # pylint: disable=import-outside-toplevel
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel
    from tests import procs  # pylint: disable=import-outside-toplevel
    res = subprocess.run(
        [sys.executable, str(procs.REPO / "scripts" / "bench_attention_memory.py"), "--json",
         "--rows", "1", "--heads", "4", "--dim", "16", "--queries", "8192", "--keys", "8192",
         "--skip", "--block_sizes", "128"],
        capture_output=True, text=True, timeout=300, cwd=procs.REPO, env=procs.base_env())
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    grew = json.loads(res.stdout.splitlines()[-1])["first_call"]
    planned = 18 * 1 * 4 * 8192 * 128 * 4  # tensors x rows x heads x queries x keys x bytes
    assert grew <= 1.4 * planned, (grew / 2**20, planned / 2**20)
