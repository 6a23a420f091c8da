"""The ops users call (issue 69: BUILD.md, "Your own Keras code": the scan and its table), each a
function of a Dense layer's ``[batch, 16]`` output, shared by the tf_keras and Keras 3 tests."""

import tensorflow as tf

OPS = {
    "gather": lambda h: tf.gather(h, [3, 1, 0, 2], axis=1),
    "gather_batch_dims": lambda h: tf.gather(h, tf.argsort(h, axis=1)[:, :4], axis=1,
                                             batch_dims=1),
    "scatter_nd": lambda h: h + tf.scatter_nd([[0], [2]], tf.ones([2, 16]), [4, 16])[:1] * h,
    "unsorted_segment_sum": lambda h: tf.transpose(
        tf.math.unsorted_segment_sum(tf.transpose(h), [0, 1] * 8, 2)),
    "one_hot": lambda h: tf.one_hot(tf.argmax(h, 1), 16) * h,
    "argsort": lambda h: tf.gather(h, tf.argsort(h[0]), axis=1),
    "sort": lambda h: tf.sort(h, axis=1),
    "top_k": lambda h: tf.math.top_k(h, 4).values,
    "concat": lambda h: tf.concat([h, 2.0 * h[:, :8]], axis=1),
    "cumsum": lambda h: tf.math.cumsum(h, axis=1),
    "cumsum_over_batch": lambda h: tf.math.cumsum(h, axis=0) / 16.0,
}
