"""TensorFlow ops that DTensor cannot lay out, and the equivalents dtk runs in their place.

DTensor's SPMD expansion lacks a layout propagation rule for some ops, forward or gradient. A
step that uses one fails at its first call with an MLIR message (``'tf.AvgPoolGrad' op does not
implement layout propagation``) that names no layer. dtk keeps the table of such ops here
(``UNSUPPORTED_OPS``), with the Keras layers that create them and what dtk does about each:

- an **equivalent** built from ops DTensor has, applied to the laid-out model's layers by
  ``adapt_layers`` (the user's model code does not change; the plain model and the export are
  untouched). Each is tested for equal values and gradients against the original op;
- or a **refusal before the first step**, naming the layer, the op and what to do
  (``check_layers``), where no equivalent exists.

A failure that still reaches DTensor (a user's layer calling an op outside the table) is mapped
back to the op and the layer's name scope by ``explain_failure``, as one line with the fix.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import types
from typing import Any

import numpy as np
import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor
from tensorflow.python.framework.ops import EagerTensor

from dtk.parallel.mesh import BATCH_AXIS

_log = logging.getLogger("dtk")


@dataclasses.dataclass(frozen=True, kw_only=True)
class UnsupportedOp:
    """One TF op DTensor's SPMD expansion lacks, the layers that use it, and dtk's answer."""

    op: str
    layers: tuple[str, ...]
    handling: str


UNSUPPORTED_OPS: dict[str, UnsupportedOp] = {u.op: u for u in (
    UnsupportedOp(
        op="DepthwiseConv2dNativeBackpropFilter",
        layers=("DepthwiseConv2D", "DepthwiseConv1D", "SeparableConv2D", "SeparableConv1D"),
        handling="equivalent: the native depthwise convolution forward and input gradient, the "
                 "filter gradient as a sum over kernel taps of strided slices (dtk.parallel.ops."
                 "depthwise_conv2d)"),
    UnsupportedOp(
        op="DepthwiseConv2dNativeBackpropInput",
        layers=("DepthwiseConv2D", "DepthwiseConv1D", "SeparableConv2D", "SeparableConv1D"),
        handling="equivalent: the input gradient as each kernel tap's contribution put back at "
                 "its input positions (pads and reshapes; dtk.parallel.ops.depthwise_conv2d)"),
    UnsupportedOp(
        op="AvgPoolGrad",
        layers=("AveragePooling2D", "AveragePooling1D"),
        handling="equivalent: average pooling as a reshape and mean (pool = strides, 'valid'), "
                 "else a sum of strided slices over the window divided by the window's count "
                 "(dtk.parallel.ops.avg_pool)"),
    UnsupportedOp(
        op="AvgPool3DGrad",
        layers=("AveragePooling3D",),
        handling="equivalent: as AvgPoolGrad, in three dims (dtk.parallel.ops.avg_pool3d)"),
    UnsupportedOp(
        op="TensorListFromTensor",
        layers=("LSTM", "GRU", "SimpleRNN", "RNN", "Bidirectional", "ConvLSTM1D", "ConvLSTM2D",
                "ConvLSTM3D"),
        handling="fallback: the recurrent loop unrolled (unroll=True: the values of tf_keras "
                 "unrolled, which with a mask differ from its while loop by about 1e-4 in tf_keras "
                 "itself) where the sequence length is static; refused before the first step "
                 "otherwise"),
    UnsupportedOp(
        op="Bucketize",
        layers=("Discretization",),
        handling="equivalent (output_mode='int'): the bucket index as the count of boundaries "
                 "<= x (comparisons and a sum); refused before the first step in other modes"),
    UnsupportedOp(
        op="ReverseV2",
        layers=("Bidirectional", "RandomFlip"),
        handling="equivalent: the reverse as a product with the exchange matrix (exact; "
                 "dtk.parallel.ops.reverse): Bidirectional's return_sequences output along time "
                 "(the unrolled backward layer reverses its steps in Python, no op); RandomFlip's "
                 "flips, each example flipped or not by one mesh-invariant draw (dtk.parallel.randomness)"),
    UnsupportedOp(
        op="ImageProjectiveTransformV3",
        layers=("RandomRotation", "RandomTranslation", "RandomZoom"),
        handling="equivalent: each output pixel's source point from the image's transform, "
                 "mapped by fill_mode and read with a batched gather at its 1 (nearest) or 4 "
                 "(bilinear) neighbours (dtk.parallel.ops.projective_transform); the random "
                 "transforms drawn mesh-invariantly (dtk.parallel.randomness)"),
    UnsupportedOp(
        op="ExtractImagePatches",
        layers=("a layer calling tf.image.extract_patches (keras.io's ViT and MLP-Mixer "
                "'Patches')",),
        handling="equivalent while dtk traces a step: non-overlapping patches (sizes = strides, "
                 "'VALID', rates 1) as a reshape and transpose, others as a convolution with a "
                 "one-hot kernel (each output is one input times 1 plus zeros: exact; "
                 "dtk.parallel.ops.extract_patches)"),
    UnsupportedOp(
        op="FusedBatchNormV3",
        layers=("BatchNormalization", "LayerNormalization"),
        handling="equivalent: the unfused formulation (moments, then the affine transform)"),
)}

_PROPAGATION = re.compile(r"'tf\.(\w+)' op does not implement layout propagation")
_STATEFUL_RANDOM = "Stateful random operations are not supported"
# DTensor's Split and Concat over a dim that is sharded (a Dense layer's output whose kernel
# columns are split over "model", cut or joined along its last dim).
_SHARDED_DIM = {"Spliting over sharded dimension is not supported":
                (("Split", "SplitV"), "cuts or joins a tensor"),
                "Concat op SPMD with concat dimension in sharded dimension":
                (("ConcatV2",), "cuts or joins a tensor"),
                "last dimensions of TopKV2Op outputs should be UNSHARDED":
                (("TopKV2",), "selects the top k")}
_GATHER_LAYOUTS = "input and output layout do not agree on non-axis dim"
_PAST_THE_SHARD = re.compile(r"indices\[[\d,]+\] = \[[^\]]*\] does not index into shape "
                             r"\[[^\]]*\]")


def _scopes(graph: Any, match) -> list[str]:
    """The name scopes of ``graph``'s ops that ``match`` (their layer's path), gradients' shown
    as the forward scope they belong to."""
    found = []
    for op in graph.get_operations():
        if match(op):
            scope = op.name.rsplit("/", 1)[0] if "/" in op.name else op.name
            scope = scope.removeprefix("gradient_tape/")
            if scope not in found:
                found.append(scope)
    return found


def _shown(scopes: list[str]) -> str:
    return "op scope " + ", ".join(repr(s) for s in scopes[:3]) + (" ..." if len(scopes) > 3
                                                                  else "")


# -- equivalents ----------------------------------------------------------------------------------
def _same_padding(size: int, kernel: int, stride: int, dilation: int = 1) -> tuple[int, int, int]:
    """(output size, pad before, pad after) of TensorFlow's 'SAME' padding on one dim."""
    effective = (kernel - 1) * dilation + 1
    out = -(-size // stride)
    total = max((out - 1) * stride + effective - size, 0)
    return out, total // 2, total - total // 2


def _valid_size(size: int, kernel: int, stride: int, dilation: int = 1) -> int:
    return (size - ((kernel - 1) * dilation + 1)) // stride + 1


def _pads(shape, kernel, strides, padding, dilations=(1, 1)):
    """Output sizes and [before, after] pads of the two spatial dims of an NHWC tensor."""
    outs, pads = [], []
    for size, k, s, d in zip(shape[1:3], kernel, strides, dilations):
        if padding == "SAME":
            out, before, after = _same_padding(int(size), int(k), int(s), int(d))
        else:
            out, before, after = _valid_size(int(size), int(k), int(s), int(d)), 0, 0
        outs.append(out)
        pads.append([before, after])
    return outs, pads


def _tap(x_padded, i, j, outs, strides, dilations):
    """The input window of kernel tap (i, j) for every output position: [B, Ho, Wo, C]."""
    top, left = i * dilations[0], j * dilations[1]
    return x_padded[:, top:top + (outs[0] - 1) * strides[0] + 1:strides[0],
                    left:left + (outs[1] - 1) * strides[1] + 1:strides[1], :]


def _untap(values, i, j, padded_shape, outs, strides):
    """The transpose of ``_tap``: ``values`` [B, Ho, Wo, C] put back at the input positions of
    kernel tap (i, j) in a zero tensor of the padded input's shape (DepthwiseConv2dNative's input
    gradient, which DTensor lacks too, is the sum of these over the taps)."""
    sh, sw = strides
    if sh > 1 or sw > 1:  # spread rows and columns stride apart, zeros between
        # (reshape, not values[:, :, None]: DTensor's strided slice cannot add an axis)
        values = tf.reshape(values, [-1, outs[0], 1, outs[1], 1, values.shape[-1]])
        values = tf.pad(values, [[0, 0], [0, 0], [0, sh - 1], [0, 0], [0, sw - 1], [0, 0]])
        values = tf.reshape(values, [-1, outs[0] * sh, outs[1] * sw, values.shape[-1]])
        values = values[:, :(outs[0] - 1) * sh + 1, :(outs[1] - 1) * sw + 1, :]
    rows, cols = int(values.shape[1]), int(values.shape[2])
    return tf.pad(values, [[0, 0], [i, int(padded_shape[1]) - i - rows],
                           [j, int(padded_shape[2]) - j - cols], [0, 0]])


def depthwise_conv2d(x, kernel, *, strides=(1, 1), padding="VALID", dilations=(1, 1)):
    """``tf.nn.depthwise_conv2d`` (NHWC) whose gradients DTensor can lay out.

    Same values and gradients. The forward pass is the native kernel. DTensor lacks both of its
    gradients (``DepthwiseConv2dNativeBackpropFilter`` and ``...BackpropInput``); dtk computes
    them per kernel tap: the filter gradient from a strided slice of the padded input and the
    output gradient, summed over batch and positions (an all-reduce over the batch axis), and
    the input gradient by putting each tap's contribution back at its input positions (pads and
    reshapes). With dilation the whole convolution is the sum over taps (autodiff).
    """
    padding = padding.upper()
    strides, dilations = tuple(int(s) for s in strides), tuple(int(d) for d in dilations)
    kh, kw, channels, multiplier = (int(d) for d in kernel.shape)
    outs, pads = _pads(x.shape, (kh, kw), strides, padding, dilations)

    def taps_sum(x, kernel):
        xp = tf.pad(x, [[0, 0], pads[0], pads[1], [0, 0]])
        total = 0
        for i in range(kh):
            for j in range(kw):
                window = _tap(xp, i, j, outs, strides, dilations)  # [B, Ho, Wo, C]
                term = tf.expand_dims(window, -1) * kernel[i, j]    # [B, Ho, Wo, C, M]
                total = total + term
        return tf.reshape(total, [-1, outs[0], outs[1], channels * multiplier])

    if dilations != (1, 1):
        return taps_sum(x, kernel)

    @tf.custom_gradient
    def conv(x, kernel):
        y = tf.nn.depthwise_conv2d(x, kernel, [1, *strides, 1], padding)

        def grad(dy):
            xp = tf.pad(x, [[0, 0], pads[0], pads[1], [0, 0]])
            dy5 = tf.reshape(dy, [-1, outs[0], outs[1], channels, multiplier])
            rows, dx = [], 0
            for i in range(kh):
                row = []
                for j in range(kw):
                    window = _tap(xp, i, j, outs, strides, dilations)
                    row.append(tf.einsum("bhwc,bhwcm->cm", window, dy5))
                    dx = dx + _untap(tf.einsum("bhwcm,cm->bhwc", dy5, kernel[i, j]), i, j,
                                     xp.shape, outs, strides)
                rows.append(tf.stack(row))
            height, width = int(x.shape[1]), int(x.shape[2])
            dx = dx[:, pads[0][0]:pads[0][0] + height, pads[1][0]:pads[1][0] + width, :]
            return dx, tf.stack(rows)

        return y, grad

    return conv(x, kernel)


def reverse(x, axes):
    """``tf.reverse`` that DTensor can lay out (it has no layout propagation for ``ReverseV2``).

    Each reversed dim is multiplied by the exchange matrix (ones on the anti-diagonal), on a
    dim that is not sharded in dtk's layouts (time): every output is one input times 1 plus
    zeros, so the values are exact, and the gradient is the same product. Integer and boolean
    tensors (masks) go through float32 and back.
    """
    axes = [axes] if isinstance(axes, int) else list(axes)
    dtype = x.dtype
    y = x if dtype.is_floating else tf.cast(x, tf.float32)
    rank = y.shape.rank
    for axis in axes:
        axis %= rank
        n = int(y.shape[axis])
        exchange = tf.constant(np.eye(n)[::-1], dtype=y.dtype)
        perm = [d for d in range(rank) if d != axis] + [axis]
        moved = tf.transpose(y, perm)
        moved = tf.tensordot(moved, exchange, axes=[[rank - 1], [0]])
        y = tf.transpose(moved, np.argsort(perm))
    return y if dtype.is_floating else tf.cast(y, dtype)


class _WhileActive:
    """Replaces ``<module>.<name>`` (``tf_keras.backend.rnn``, ...) while one of dtk's adapted
    layers runs.

    Installed once, process-wide, as a wrapper that is a pass-through outside those layers (a
    plain model in the same process keeps tf_keras's own function). ``replacement(original, *args,
    **kwargs)`` computes the adapted value.
    """

    def __init__(self, name: str, replacement, module: str = "tf_keras.src.backend"):
        self.name, self.replacement, self.module, self.active = name, replacement, module, 0

    def install(self):
        import importlib  # pylint: disable=g-import-not-at-top
        module = importlib.import_module(self.module)
        original = getattr(module, self.name)
        if getattr(original, "_dtk", False):
            return

        def wrapped(*args, **kwargs):
            if self.active:
                return self.replacement(original, *args, **kwargs)
            return original(*args, **kwargs)

        wrapped._dtk = True  # pylint: disable=protected-access
        setattr(module, self.name, wrapped)


# Bidirectional (return_sequences) and go_backwards: the reverse along time as ``reverse``.
_REVERSE = _WhileActive("reverse", lambda original, x, axes: reverse(x, axes))
# ConvLSTM: ``ConvRNN`` refuses ``unroll=True`` and runs a while loop over TensorLists, which
# DTensor cannot lay out; the same step function unrolled over the static frames can.
_UNROLLED_RNN = _WhileActive("rnn", lambda original, *a, **kw: original(*a, **{**kw,
                                                                                "unroll": True}))


# RandomRotation / RandomTranslation / RandomZoom: tf_keras's image transform (one
# ImageProjectiveTransformV3 op, no layout propagation) as ``projective_transform``.
_TRANSFORM = _WhileActive(
    "transform", lambda original, images, transforms, fill_mode="reflect", fill_value=0.0,
    interpolation="bilinear", output_shape=None, name=None: projective_transform(
        images, transforms, fill_mode=fill_mode, fill_value=fill_value,
        interpolation=interpolation, output_shape=output_shape),
    module="tf_keras.src.layers.preprocessing.image_preprocessing")


def extract_patches(images, sizes, strides, rates, padding, name=None):
    """``tf.image.extract_patches`` from ops DTensor can lay out (it has no layout propagation
    for ``ExtractImagePatches``): the same values and gradients.

    Non-overlapping patches (``sizes == strides``, ``rates`` 1, ``"VALID"``: the ViT and
    MLP-Mixer pages) are a reshape and transpose. Otherwise a convolution whose one-hot kernel
    copies input ``(i, j, c)`` of each window to output channel ``(i * kw + j) * C + c`` (the op's
    order), with the op's strides and padding: each output is one input times 1 plus zeros,
    exact (a NaN or inf input spreads to its window's other outputs, where the op keeps it in
    place). Rates > 1 are written into the kernel (taps ``rate`` apart in a kernel of the
    dilated window's size), not given as the convolution's dilation: the same values and
    padding, and a gradient without a dilated ``Conv2DBackpropInput``, which TensorFlow's CPU
    kernels lack ("dilation rates larger than 1").
    """
    del name
    kh, kw = int(sizes[1]), int(sizes[2])
    sh, sw = int(strides[1]), int(strides[2])
    rh, rw = int(rates[1]), int(rates[2])
    height, width, channels = (int(d) for d in images.shape[1:])
    if (kh, kw) == (sh, sw) and (rh, rw) == (1, 1) and padding.upper() == "VALID":
        oh, ow = height // kh, width // kw
        x = images[:, :oh * kh, :ow * kw, :]
        x = tf.reshape(x, [-1, oh, kh, ow, kw, channels])
        x = tf.transpose(x, [0, 1, 3, 2, 4, 5])
        return tf.reshape(x, [-1, oh, ow, kh * kw * channels])
    depth = kh * kw * channels
    kernel = np.zeros(((kh - 1) * rh + 1, (kw - 1) * rw + 1, channels, depth), np.float32)
    for i in range(kh):
        for j in range(kw):
            for c in range(channels):
                kernel[i * rh, j * rw, c, (i * kw + j) * channels + c] = 1.0
    dtype = images.dtype
    x = images if dtype.is_floating else tf.cast(images, tf.float32)
    out = tf.nn.conv2d(x, tf.constant(kernel, x.dtype), strides=[1, sh, sw, 1],
                       padding=padding.upper())
    return out if dtype.is_floating else tf.cast(out, dtype)


def ctc_batch_cost(y_true, y_pred, input_length, label_length):
    """``tf_keras.backend.ctc_batch_cost`` from ops DTensor can lay out (its dense-to-sparse
    labels and ``CTCLoss`` have no layout propagation): the same values and gradients.

    The CTC forward algorithm in log space over the labels extended with blanks (the last
    class), one step per frame (unrolled over the static frame count), on the same log
    probabilities Keras gives ``CTCLoss`` (``log_softmax(log(y_pred + epsilon))``). Emissions are
    read with a one-hot product (exact), and frames past ``input_length`` keep their state.
    Where Keras's op raises (an empty label; a label that needs more frames than it has), the
    loss here is the probability of all blanks, and about 1e30.

    Returns:
      ``[batch, 1]`` losses, as Keras's.
    """
    steps, classes = int(y_pred.shape[1]), int(y_pred.shape[2])
    width = int(y_true.shape[1])
    label_length = tf.cast(tf.squeeze(label_length, axis=-1), tf.int32)
    input_length = tf.cast(tf.squeeze(input_length, axis=-1), tf.int32)
    logp = tf.nn.log_softmax(tf.math.log(y_pred + tf_keras.backend.epsilon()), axis=-1)
    labels = tf.cast(y_true, tf.int32)
    blank = tf.zeros_like(labels) + (classes - 1)
    extended = tf.reshape(tf.stack([blank, labels], axis=2), [-1, 2 * width])
    extended = tf.concat([extended, blank[:, :1]], axis=1)  # [B, S]: blank, l1, blank, ..., blank
    size = 2 * width + 1
    emit = tf.einsum("btc,bsc->bts", logp, tf.one_hot(extended, classes, dtype=logp.dtype))
    neg = tf.constant(-1e30, logp.dtype)
    position = tf.range(size)[None, :]
    valid = position < (2 * label_length + 1)[:, None]
    skip = tf.concat([tf.zeros_like(extended[:, :2], tf.bool),
                      tf.logical_and(tf.not_equal(extended[:, 2:], classes - 1),
                                     tf.not_equal(extended[:, 2:], extended[:, :-2]))], axis=1)
    alpha = tf.where(tf.logical_and(valid, position < 2), emit[:, 0, :], neg)
    for t in range(1, steps):
        one = tf.concat([tf.fill(tf.shape(alpha[:, :1]), neg), alpha[:, :-1]], axis=1)
        two = tf.concat([tf.fill(tf.shape(alpha[:, :2]), neg), alpha[:, :-2]], axis=1)
        two = tf.where(skip, two, neg)
        new = tf.reduce_logsumexp(tf.stack([alpha, one, two]), axis=0) + emit[:, t, :]
        new = tf.where(valid, new, neg)
        alpha = tf.where((t < input_length)[:, None], new, alpha)
    last = tf.one_hot(2 * label_length, size, dtype=alpha.dtype)
    before = tf.one_hot(2 * label_length - 1, size, dtype=alpha.dtype)  # none for no label
    end = tf.reduce_sum(alpha * last, axis=1)
    end_before = tf.where(label_length > 0, tf.reduce_sum(alpha * before, axis=1), neg)
    loss = -tf.reduce_logsumexp(tf.stack([end, end_before]), axis=0)
    return tf.expand_dims(loss, 1)


_TF_TOP_K = tf.math.top_k  # TensorFlow's, before dtk's wrapper (below) takes the names


def top_k(input, k=1, sorted=True, index_type=tf.int32, name=None):  # pylint: disable=redefined-builtin
    """``tf.math.top_k`` with a gradient DTensor can lay out: TensorFlow's forward values and
    indices, and the values' gradient put back at their positions as a one-hot product summed
    over the k choices (exact: one nonzero term per position). TensorFlow's own gradient
    scatters into the flattened input with global indices, which on a batch sharded over a mesh
    axis index past each device's shard ("ScatterNd: indices[15] = [63] does not index into shape
    [8]"; a Switch Transformer's router)."""
    x = tf.convert_to_tensor(input)

    @tf.custom_gradient
    def values_and_indices(x):
        result = _TF_TOP_K(x, k=k, sorted=sorted, index_type=index_type, name=name)

        def grad(d_values, d_indices=None):  # pylint: disable=unused-argument
            n = x.shape[-1] if x.shape[-1] is not None else tf.shape(x)[-1]
            hit = tf.one_hot(result.indices, n, dtype=d_values.dtype)  # [..., k, n]
            return tf.reduce_sum(hit * tf.expand_dims(d_values, -1), -2)

        return (result.values, result.indices), grad

    values, indices = values_and_indices(x)
    return type(_TF_TOP_K(tf.zeros([1, 1]), k=1))(values, indices)


_TF_ONE_HOT = tf.one_hot


def one_hot(indices, depth, on_value=None, off_value=None, axis=None, dtype=None, name=None):
    """``tf.one_hot`` as a comparison with ``range(depth)`` (the same values): DTensor lays
    ``OneHot``'s output out without the layout of what it is combined with, and on
    ``batch=4,model=2`` ``tf.one_hot(tf.argmax(h, 1), n) * h`` failed ("non-broadcastable
    operands"); a comparison and a cast are elementwise ops it lays out. Other axes: TensorFlow's."""
    if axis not in (None, -1) or not isinstance(depth, int):
        return _TF_ONE_HOT(indices, depth, on_value=on_value, off_value=off_value, axis=axis,
                           dtype=dtype, name=name)
    if dtype is None:
        dtype = (tf.convert_to_tensor(on_value).dtype if on_value is not None else
                 tf.convert_to_tensor(off_value).dtype if off_value is not None else tf.float32)
    indices = tf.convert_to_tensor(indices)
    if indices.dtype not in (tf.int32, tf.int64):
        indices = tf.cast(indices, tf.int64)
    hit = tf.equal(tf.expand_dims(indices, -1), tf.range(depth, dtype=indices.dtype))
    on = tf.cast(1 if on_value is None else on_value, dtype)
    off = tf.cast(0 if off_value is None else off_value, dtype)
    return tf.where(hit, on, off)


def constants_on_mesh(mesh: dtensor.Mesh) -> None:
    """Makes the graph being traced capture host constants on ``mesh``, replicated: a tensor
    user code made eagerly and uses in a step (keras.io's PointNet keeps ``tf.eye(n)`` in a
    regularizer; a loss's class weights) would reach DTensor as a regular tensor, which it
    refuses ("got a regular tensor for input 5 ... but was expecting a DTensor", naming no
    layer). Each constant is copied to the mesh once per graph, when the trace first uses it.
    (A host ``tf.Variable`` cannot be copied: it stays DTensor's error.)"""
    graph = tf.compat.v1.get_default_graph()
    if tf.executing_eagerly() or getattr(graph, "_dtk_constants_mesh", None) is not None or \
            not hasattr(graph, "capture"):
        return
    capture = graph.capture
    copies = {}  # id(host tensor) -> (host tensor, its copy on the mesh)

    def capture_on_mesh(tensor, name=None, shape=None):
        if isinstance(tensor, EagerTensor) and tensor.dtype not in (tf.resource, tf.variant):
            if id(tensor) not in copies:
                with tf.init_scope():
                    copies[id(tensor)] = (tensor, tensor if dtensor.is_dtensor(tensor) else
                                          dtensor.copy_to_mesh(tensor, dtensor.Layout.replicated(
                                              mesh, tensor.shape.rank)))
            tensor = copies[id(tensor)][1]
        return capture(tensor, name=name, shape=shape)

    graph.capture = capture_on_mesh
    graph._dtk_constants_mesh = mesh  # pylint: disable=protected-access


class _DuringSteps:
    """Replaces ``tf.<module>.<name>`` (``tf.image.extract_patches``) while dtk traces a step
    on the mesh (``during_steps``), for user code that calls it itself (a keras.io page's own
    ``Patches`` layer); a pass-through otherwise (a plain model in the same process keeps
    TensorFlow's op)."""

    def __init__(self, module: Any, name: str, replacement):
        self.module, self.name, self.replacement = module, name, replacement
        self.active = 0

    def install(self) -> None:
        original = getattr(self.module, self.name)
        if getattr(original, "_dtk", False):
            return

        def wrapped(*args, **kwargs):
            if self.active:
                return self.replacement(*args, **kwargs)
            return original(*args, **kwargs)

        wrapped._dtk = True  # pylint: disable=protected-access
        setattr(self.module, self.name, wrapped)


def _keras_backends() -> tuple[Any, ...]:
    from tf_keras import backend as public  # pylint: disable=g-import-not-at-top
    from tf_keras.src import backend as private  # pylint: disable=g-import-not-at-top
    return public, private


_DURING_STEPS = (_DuringSteps(tf.image, "extract_patches", extract_patches),
                 _DuringSteps(tf.math, "top_k", top_k), _DuringSteps(tf.nn, "top_k", top_k),
                 _DuringSteps(tf, "one_hot", one_hot),
                 *(_DuringSteps(module, "ctc_batch_cost", ctc_batch_cost)
                   for module in _keras_backends()))


def install_equivalents() -> None:
    """Puts the pass-through wrappers of ``_DURING_STEPS`` in place before a model is built: a
    layer that keeps the function itself (keras.io's OCR ``CTCLayer``: ``self.loss_fn =
    keras.backend.ctc_batch_cost`` in ``__init__``) then holds the wrapper."""
    for r in _DURING_STEPS:
        r.install()


class during_steps:  # pylint: disable=invalid-name
    """Context of a step traced on the mesh: TensorFlow functions DTensor cannot lay out, called
    by user code, run as dtk's equivalents (``_DURING_STEPS``)."""

    def __enter__(self):
        for r in _DURING_STEPS:
            r.install()
            r.active += 1
        return self

    def __exit__(self, *exc):
        for r in _DURING_STEPS:
            r.active -= 1
        return False


def _reflect(coord, size: int):
    """ImageProjectiveTransformV3's "reflect" fill: ``(d c b a | a b c d | d c b a)``."""
    if size <= 1:
        return tf.zeros_like(coord)
    period = 2.0 * size
    c = tf.math.floormod(coord, period)  # [0, 2 size)
    c = tf.where(c >= size, period - c - 1.0, c)
    return tf.clip_by_value(c, 0.0, size - 1.0)


def _wrap(coord, size: int):
    """"wrap" fill, as TensorFlow's kernel computes it: shifted by ``size`` times the number of
    ``size - 1`` spans the point lies out (truncated), then clamped."""
    if size <= 1:
        return tf.zeros_like(coord)
    span = float(size - 1)
    below = coord + size * (tf.floor(-coord / span) + 1.0)  # -coord / span > 0: trunc = floor
    above = coord - size * tf.floor(coord / span)
    c = tf.where(coord < 0.0, below, tf.where(coord > span, above, coord))
    return tf.clip_by_value(c, 0.0, span)


def _round_half_away(x):
    """``std::round``: halves away from zero (``tf.round`` rounds them to even)."""
    return tf.sign(x) * tf.floor(tf.abs(x) + 0.5)


def projective_transform(images, transforms, *, fill_mode: str = "reflect",
                         fill_value: float = 0.0, interpolation: str = "bilinear",
                         output_shape=None):
    """``ImageProjectiveTransformV3`` from ops DTensor lays out: each output pixel's source point
    from its image's transform, mapped into the image by ``fill_mode``, then read with a batched
    gather of the flattened image (``tf.gather(..., batch_dims=1)``) at the 1 (nearest) or 4
    (bilinear) integer points around it. Images ``[B, H, W, C]`` of static size;
    ``transforms`` ``[B, 8]`` or ``[1, 8]``, Keras's convention (output point -> input point).
    """
    if images.shape.rank != 4 or None in images.shape[1:]:
        raise ValueError(f"dtk's image transform takes images [batch, height, width, channels] "
                         f"of static size; got {images.shape}")
    h, w, c = (int(d) for d in images.shape[1:])
    if output_shape is not None:
        static = tf.get_static_value(output_shape)
        if static is None:
            raise ValueError(f"dtk's image transform needs a static output_shape [height, "
                             f"width]; got the tensor {output_shape!r}: pass Python ints")
        oh, ow = (int(d) for d in static)
    else:
        oh, ow = h, w
    dtype = images.dtype
    t = tf.cast(transforms, tf.float32)
    ys, xs = np.meshgrid(np.arange(oh, dtype=np.float32), np.arange(ow, dtype=np.float32),
                         indexing="ij")
    x = tf.constant(xs.reshape(1, -1))
    y = tf.constant(ys.reshape(1, -1))
    a0, a1, a2, b0, b1, b2, c0, c1 = (t[:, k:k + 1] for k in range(8))
    k = c0 * x + c1 * y + 1.0
    degenerate = tf.equal(k, 0.0)
    k = tf.where(degenerate, tf.ones_like(k), k)
    in_x = (a0 * x + a1 * y + a2) / k
    in_y = (b0 * x + b1 * y + b2) / k
    if fill_mode == "reflect":
        in_x, in_y = _reflect(in_x, w), _reflect(in_y, h)
    elif fill_mode == "wrap":
        in_x, in_y = _wrap(in_x, w), _wrap(in_y, h)
    elif fill_mode == "nearest":
        in_x = tf.clip_by_value(in_x, 0.0, w - 1.0)
        in_y = tf.clip_by_value(in_y, 0.0, h - 1.0)
    elif fill_mode != "constant":
        raise ValueError(f"fill_mode {fill_mode!r} is not one of reflect, wrap, nearest, constant")
    flat = tf.reshape(tf.cast(images, tf.float32), [-1, h * w, c])
    fill = tf.cast(fill_value, tf.float32)

    def read(py, px):
        inside = tf.logical_and(tf.logical_and(py >= 0.0, py <= h - 1.0),
                                tf.logical_and(px >= 0.0, px <= w - 1.0))
        inside = tf.logical_and(inside, tf.logical_not(degenerate))
        index = tf.cast(tf.clip_by_value(py, 0.0, h - 1.0) * w
                        + tf.clip_by_value(px, 0.0, w - 1.0), tf.int32)
        values = tf.gather(flat, index, axis=1, batch_dims=1)  # [B, P, C]
        return tf.where(inside[..., None], values, fill)

    if interpolation == "nearest":
        out = read(_round_half_away(in_y), _round_half_away(in_x))
    elif interpolation == "bilinear":
        yf, xf = tf.floor(in_y), tf.floor(in_x)
        yc, xc = yf + 1.0, xf + 1.0
        wx0, wx1 = (xc - in_x)[..., None], (in_x - xf)[..., None]
        wy0, wy1 = (yc - in_y)[..., None], (in_y - yf)[..., None]
        top = wx0 * read(yf, xf) + wx1 * read(yf, xc)
        bottom = wx0 * read(yc, xf) + wx1 * read(yc, xc)
        out = wy0 * top + wy1 * bottom
        out = tf.where(degenerate[..., None], fill, out)
    else:
        raise ValueError(f"interpolation {interpolation!r} is not one of nearest, bilinear")
    return tf.cast(tf.reshape(out, [-1, oh, ow, c]), dtype)


def _while_active(call, *replacements: _WhileActive):
    """``call`` with ``replacements`` active while it runs (as a method: drops ``self``)."""
    def wrapped(self, *args, **kwargs):
        for r in replacements:
            r.active += 1
        try:
            return call(*args, **kwargs)
        finally:
            for r in replacements:
                r.active -= 1
    return wrapped


def _conv_rnn_initial_state(self, inputs):
    """``ConvRNN.get_initial_state`` without its convolution of zeros by a zero kernel: the
    gradient through that convolution fails in DTensor's SPMD expansion (a shape of the global
    batch times the batch axis, measured on every filter count but 2). The same zeros,
    ``[batch, *conv output dims, filters]``, sliced from the input's zeros."""
    from tf_keras.src.utils import conv_utils  # pylint: disable=g-import-not-at-top
    cell = self.cell
    spatial = inputs.shape[2:-1]
    out = [conv_utils.conv_output_length(int(n), cell.kernel_size[i], padding=cell.padding,
                                         stride=cell.strides[i], dilation=cell.dilation_rate[i])
           for i, n in enumerate(spatial)]
    zeros = tf.zeros_like(inputs[(slice(None), 0, *(slice(0, o) for o in out), slice(0, 1))])
    zeros = tf.concat([zeros] * cell.filters, axis=-1)
    return [zeros for _ in cell.state_size] if hasattr(cell.state_size, "__len__") else [zeros]


def _random_flip_call(self, inputs, training=True):
    """``RandomFlip.call`` with flips DTensor can lay out: one uniform draw per example and flip
    (from the layer's generator: mesh-invariant under dtk.parallel.randomness, as Dropout's masks), then
    ``where(draw < 0.5, reverse(x), x)`` on the image's width (horizontal) and height (vertical)
    dims. Batched images only (rank 4, as in a model); outside training, the images as they are.
    """
    if not training:
        return inputs
    if inputs.shape.rank != 4 or inputs.shape[0] is None:
        raise ValueError(f"layer {self.name!r} (RandomFlip) under dtk takes batched images "
                         f"[batch, height, width, channels] of static shape; got {inputs.shape}")
    x = inputs
    batch = int(x.shape[0])
    for mode, axis in (("horizontal", 2), ("vertical", 1)):
        if mode not in self.mode:
            continue
        draw = self._random_generator.random_uniform([batch], 0.0, 1.0, dtype=tf.float32)
        flip = tf.reshape(draw < 0.5, [batch, 1, 1, 1])
        x = tf.where(flip, reverse(x, [axis]), x)
    return x


def avg_pool(x, ksize, strides, padding, data_format="NHWC"):
    """``tf.nn.avg_pool`` on NHWC inputs whose gradient DTensor can lay out.

    Non-overlapping 'VALID' windows (pool size = strides, the common case) are a reshape and a
    mean; other windows are the sum over the window's taps of strided slices, divided by how
    many real (non-padding) inputs each window covers, as TensorFlow's kernel does.
    """
    if data_format not in ("NHWC", "channels_last", None):
        raise ValueError(f"dtk's average pooling takes channels_last (NHWC) inputs; got "
                         f"data_format={data_format!r}")
    ksize, strides = _two(ksize), _two(strides)
    padding = padding.upper()
    height, width, channels = (int(d) for d in x.shape[1:])
    if padding == "VALID" and ksize == strides:
        rows, cols = height // ksize[0], width // ksize[1]
        x = x[:, :rows * ksize[0], :cols * ksize[1], :]
        x = tf.reshape(x, [-1, rows, ksize[0], cols, ksize[1], channels])
        return tf.reduce_mean(x, axis=[2, 4])
    outs, pads = _pads(x.shape, ksize, strides, padding)
    xp = tf.pad(x, [[0, 0], pads[0], pads[1], [0, 0]])
    ones = np.pad(np.ones((height, width), np.float64), pads)
    total, count = 0, np.zeros(outs, np.float64)
    for i in range(ksize[0]):
        for j in range(ksize[1]):
            total = total + _tap(xp, i, j, outs, strides, (1, 1))
            count += ones[i:i + (outs[0] - 1) * strides[0] + 1:strides[0],
                          j:j + (outs[1] - 1) * strides[1] + 1:strides[1]]
    return total * tf.constant((1.0 / count)[None, :, :, None], dtype=x.dtype)


def avg_pool3d(x, ksize, strides, padding, data_format="NDHWC"):
    """``tf.nn.avg_pool3d`` on NDHWC inputs whose gradient DTensor can lay out (it lacks
    ``AvgPool3DGrad``): as ``avg_pool``, in three spatial dims. Non-overlapping 'VALID' windows
    are a reshape and a mean; others the sum of the window's strided slices over the count of
    real inputs each window covers."""
    if data_format not in ("NDHWC", "channels_last", None):
        raise ValueError(f"dtk's 3D average pooling takes channels_last (NDHWC) inputs; got "
                         f"data_format={data_format!r}")
    ksize, strides = _three(ksize), _three(strides)
    padding = padding.upper()
    sizes, channels = [int(d) for d in x.shape[1:4]], int(x.shape[4])
    if padding == "VALID" and ksize == strides:
        outs = [n // k for n, k in zip(sizes, ksize)]
        x = x[:, :outs[0] * ksize[0], :outs[1] * ksize[1], :outs[2] * ksize[2], :]
        d, h = outs[0] * ksize[0], outs[1] * ksize[1]
        # One spatial dim at a time (rank 6 at most: TensorFlow's CPU broadcast, in the
        # gradient of a mean, stops at rank 6).
        x = tf.reduce_mean(tf.reshape(x, [-1, d, h, outs[2], ksize[2], channels]), axis=4)
        x = tf.reduce_mean(tf.reshape(x, [-1, d, outs[1], ksize[1], outs[2], channels]), axis=3)
        return tf.reduce_mean(tf.reshape(x, [-1, outs[0], ksize[0], outs[1], outs[2], channels]),
                              axis=2)
    outs, pads = [], []
    for n, k, st in zip(sizes, ksize, strides):
        if padding == "SAME":
            out, before, after = _same_padding(n, k, st)
        else:
            out, before, after = _valid_size(n, k, st), 0, 0
        outs.append(out)
        pads.append([before, after])
    xp = tf.pad(x, [[0, 0], *pads, [0, 0]])
    ones = np.pad(np.ones(sizes, np.float64), pads)
    total, count = 0, np.zeros(outs, np.float64)
    for i in range(ksize[0]):
        for j in range(ksize[1]):
            for k in range(ksize[2]):
                spans = [slice(t, t + (o - 1) * st + 1, st)
                         for t, o, st in zip((i, j, k), outs, strides)]
                total = total + xp[:, spans[0], spans[1], spans[2], :]
                count += ones[spans[0], spans[1], spans[2]]
    return total * tf.constant((1.0 / count)[None, :, :, :, None], dtype=x.dtype)


def _three(values) -> tuple[int, int, int]:
    """Spatial (depth, height, width) of a 3-tuple or of an NDHWC 5-tuple."""
    values = tuple(int(v) for v in (values if isinstance(values, (list, tuple)) else [values]))
    if len(values) == 5:
        return values[1], values[2], values[3]
    return values * 3 if len(values) == 1 else values[:3]


def _two(values) -> tuple[int, int]:
    """Spatial (height, width) of a 2-tuple or of an NHWC 4-tuple like (1, h, w, 1)."""
    values = tuple(int(v) for v in (values if isinstance(values, (list, tuple)) else [values]))
    if len(values) == 4:
        return values[1], values[2]
    return (values[0], values[0]) if len(values) == 1 else values[:2]


# -- applying them to a laid-out model ------------------------------------------------------------
def _depthwise_call(self, inputs):
    """``DepthwiseConv2D.call`` with dtk's depthwise convolution."""
    outputs = depthwise_conv2d(inputs, self.depthwise_kernel, strides=self.strides,
                               padding=self.padding, dilations=self.dilation_rate)
    if self.use_bias:
        outputs = tf.nn.bias_add(outputs, self.bias)
    return self.activation(outputs) if self.activation is not None else outputs


def _separable_call(self, inputs):
    """``SeparableConv2D.call``: dtk's depthwise convolution, then the 1x1 pointwise one."""
    outputs = depthwise_conv2d(inputs, self.depthwise_kernel, strides=self.strides,
                               padding=self.padding, dilations=self.dilation_rate)
    outputs = tf.nn.conv2d(outputs, self.pointwise_kernel, strides=1, padding="VALID")
    if self.use_bias:
        outputs = tf.nn.bias_add(outputs, self.bias)
    return self.activation(outputs) if self.activation is not None else outputs


def _conv1d_as_2d(call_2d):
    """A 1-D depthwise/separable ``call`` through the 2-D one (a unit height dim)."""
    def call(self, inputs):
        if self.padding == "causal":
            inputs = tf.pad(inputs, [[0, 0], [(self.kernel_size[0] - 1) * self.dilation_rate[0],
                                              0], [0, 0]])
        shim = types.SimpleNamespace(  # (expand_dims: DTensor cannot slice in a new axis)
            depthwise_kernel=tf.expand_dims(self.depthwise_kernel, 0),
            pointwise_kernel=getattr(self, "pointwise_kernel", None),
            strides=(1, self.strides[0]),
            padding="valid" if self.padding == "causal" else self.padding,
            dilation_rate=(1, self.dilation_rate[0]), use_bias=self.use_bias,
            bias=getattr(self, "bias", None), activation=self.activation)
        if shim.pointwise_kernel is not None:
            shim.pointwise_kernel = tf.expand_dims(shim.pointwise_kernel, 0)
        return tf.squeeze(call_2d(shim, tf.expand_dims(inputs, 1)), 1)
    return call


def _discretization_call(self, inputs):
    """``Discretization.call`` (output_mode 'int'): bucket i holds boundaries[i-1] <= x <
    boundaries[i], i.e. the count of boundaries <= x, as ``tf.raw_ops.Bucketize`` computes."""
    inputs = tf.convert_to_tensor(inputs)
    index = tf.zeros_like(inputs, dtype=self.compute_dtype if self.compute_dtype in (
        "int32", "int64") else "int64")
    for boundary in self.bin_boundaries:
        index += tf.cast(inputs >= tf.cast(boundary, inputs.dtype), index.dtype)
    return index


def _channels_last(layer) -> bool:
    return getattr(layer, "data_format", "channels_last") == "channels_last"


def adapt_layers(model: tf_keras.Model, *, batch_axis: str = BATCH_AXIS) -> list[str]:
    """Replaces, in the laid-out ``model``'s layers, every op of ``UNSUPPORTED_OPS`` that has an
    equivalent, and the lookups into Embedding tables sharded on their rows
    (``row_sharded_lookup``). Returns one line per kind of change, for the log.

    Raises:
      ValueError: a layer uses an unsupported op that dtk cannot replace (``check_layers``).
    """
    check_layers(model)
    L = tf_keras.layers  # pylint: disable=invalid-name
    changed: dict[str, list[str]] = {}
    for layer in model._flatten_layers(include_self=False):  # pylint: disable=protected-access
        kind = type(layer)
        if kind in (L.DepthwiseConv2D,):
            layer.call = types.MethodType(_depthwise_call, layer)
        elif kind in (L.SeparableConv2D,):
            layer.call = types.MethodType(_separable_call, layer)
        elif kind in (L.DepthwiseConv1D,):
            layer.call = types.MethodType(_conv1d_as_2d(_depthwise_call), layer)
        elif kind in (L.SeparableConv1D,):
            layer.call = types.MethodType(_conv1d_as_2d(_separable_call), layer)
        elif kind is L.Discretization:
            layer.call = types.MethodType(_discretization_call, layer)
        elif isinstance(layer, (L.AveragePooling1D, L.AveragePooling2D)):
            layer.pool_function = avg_pool
        elif isinstance(layer, L.AveragePooling3D):
            layer.pool_function = avg_pool3d
        elif kind is L.RandomFlip:
            layer.call = types.MethodType(_random_flip_call, layer)
        elif kind.__name__ in _AUGMENTATION:
            _TRANSFORM.install()
            layer.call = types.MethodType(_while_active(layer.call, _TRANSFORM), layer)
        elif isinstance(layer, L.Bidirectional):
            _REVERSE.install()
            layer.call = types.MethodType(_while_active(layer.call, _REVERSE), layer)
        elif isinstance(layer, L.Embedding) and row_sharded_table(layer) is not None:
            layout = row_sharded_table(layer)
            layer._dtk_table_layout = layout  # pylint: disable=protected-access
            layer._dtk_batch_axis = batch_axis  # pylint: disable=protected-access
            layer.call = types.MethodType(_row_sharded_embedding_call, layer)
        elif type(layer).__name__.startswith("ConvLSTM"):
            _UNROLLED_RNN.install()
            _REVERSE.install()
            # go_backwards reverses the frames
            layer.call = types.MethodType(_while_active(layer.call, _UNROLLED_RNN, _REVERSE),
                                          layer)
            if hasattr(layer, "cell") and layer.cell.data_format == "channels_last":
                layer.get_initial_state = types.MethodType(_conv_rnn_initial_state, layer)
        elif isinstance(layer, L.RNN) and not layer.unroll:
            layer.unroll = True
            if hasattr(layer, "_could_use_gpu_kernel"):  # LSTM, GRU: their fused loop ignores it
                layer._could_use_gpu_kernel = False  # pylint: disable=protected-access
        else:
            continue
        changed.setdefault(kind.__name__, []).append(layer.name)
    lines = []
    for kind, names in changed.items():
        what = ("unrolled (DTensor cannot lay out the recurrent loop's TensorList ops; the "
                "values are the same)" if "RNN" in kind or kind in ("LSTM", "GRU", "SimpleRNN")
                else "tables sharded on their rows, looked up block by block (one all-reduce "
                "over the rows' axis; same values and gradients)" if kind == "Embedding"
                else "run with dtk's DTensor-compatible equivalent (same values and gradients)")
        lines.append(f"{kind} {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}: {what}")
    return lines


# A dense update of a row-sharded table is worth a warning from this many bytes a device: below it
# (the recommender's default tables, 0.5 MiB and less a device) it costs less than a step's
# other work, and the line is debug output.
DENSE_UPDATE_WARN_BYTES = 1 << 20


def warn_dense_table_update(layer: tf_keras.layers.Embedding, why: str) -> None:
    """Says what a dense update of a row-sharded table costs (``dtk.train.sparse`` avoids it)."""
    layout = layer._dtk_table_layout  # pylint: disable=protected-access
    rows, dim = layer.embeddings.shape
    shards = layout.mesh.dim_size(layout.sharding_specs[0])
    block_bytes = rows // shards * dim * layer.embeddings.dtype.size
    block = block_bytes / 2 ** 20
    log = _log.warning if block_bytes >= DENSE_UPDATE_WARN_BYTES else _log.debug
    log(
        "Embedding %r: its table [%d, %d] is sharded on its rows over axis %r (%d blocks); its "
        "gradient and optimizer update are dense (%s): every step reads and writes all %d rows "
        "of each device's block (%.1f MiB of weights, and the optimizer's slots as much again "
        "each) whatever ids the batch holds. TrainerConfig(sparse_tables=True) (dtk.distribute's "
        "sparse_tables=True) updates the touched rows only (SGD, Adagrad; Adam as lazy Adam), in a step time flat in the "
        "table's size", layer.name, rows, dim, layout.sharding_specs[0], shards, why, rows // shards, block)


def row_sharded_table(layer: tf_keras.layers.Embedding) -> dtensor.Layout | None:
    """The layout of ``layer``'s table when it is sharded on dim 0 (its rows), else None."""
    table = getattr(getattr(layer, "embeddings", None), "_variable", getattr(layer, "embeddings",
                                                                              None))
    if table is None:
        return None
    # An FSDP weight is stored sharded over the batch axis but computed with its table's layout
    # (dtk.parallel.fsdp): a table FSDP alone cuts on its rows is gathered whole, not looked up
    # block by block (which would replicate the lookup's ids, and with them every activation
    # after it, over the batch axis).
    layout = getattr(table, "_dtk_compute_layout", None)
    if layout is None:
        try:
            layout = dtensor.fetch_layout(table)
        except (ValueError, TypeError, tf.errors.OpError):  # not a DTensor (a plain build)
            return None
    return layout if layout.sharding_specs[0] != dtensor.UNSHARDED else None


ID_OUTSIDE = "an id is outside the rows of"  # the start of the lookup's error (tests read it)


def row_sharded_lookup(table: Any, ids: tf.Tensor, layout: dtensor.Layout,
                       batch_axis: str | None, *, name: str = "") -> tf.Tensor:
    """``tf.gather(table, ids)`` for a table sharded on its rows, from ops DTensor lays out.

    DTensor's ResourceGather refuses a table sharded on dim 0 ("does not support sharded 0th
    dimension"). The table ``[rows, dim]``, sharded over axis ``a`` of size ``S``, is viewed as
    ``[S, rows / S, dim]`` sharded on dim 0: device ``s`` holds rows ``s * rows / S`` onward.
    Every device gathers the local row ``id % (rows / S)`` of its own block for every id, keeps
    the ids it owns (``id // (rows / S) == s``) and zeros the rest; the sum over the ``S``
    blocks (one all-reduce over ``a``) is the lookup. Its gradient reaches the table sharded
    like the table (the read goes through ``dtensor.relayout`` to the table's own layout), never
    at full size. Example: 64 rows on ``model=4`` hold 16 rows a device; id 37 is row 5 of
    device 2's block.

    Args:
      table: the ``[rows, dim]`` variable (or its value), laid out as ``layout``.
      ids: integer ids of any shape, batch-sharded on ``batch_axis`` (None: replicated).
      layout: the table's layout; ``sharding_specs[0]`` is the axis its rows are sharded on.
      batch_axis: the mesh's batch axis, which shards the ids' dim 0.
      name: the Embedding layer's name, for the error on an id outside the table.

    Returns:
      ``[*ids.shape, dim]``, as ``tf.gather(table, ids)``.
    """
    mesh = layout.mesh
    rows_axis, cols_axis = layout.sharding_specs
    shards = mesh.dim_size(rows_axis)
    rows, dim = table.shape
    per = rows // shards
    unsharded = dtensor.UNSHARDED
    ids_axis = batch_axis if batch_axis in mesh.dim_names and batch_axis not in (
        rows_axis, cols_axis) else unsharded
    ids_specs = [ids_axis] + [unsharded] * (ids.shape.rank - 1)
    ids = dtensor.relayout(ids, dtensor.Layout(ids_specs, mesh))
    # An id outside the table would find no owner and look up zeros; plain Keras fails on it.
    # A device that fails here cancels the collectives the others wait in, and the step's error
    # may then be one of those cancellations: the Trainer names the tables then (_tables_hint).
    low, high = tf.reduce_min(ids), tf.reduce_max(ids)
    in_range = tf.reduce_all(tf.logical_and(ids >= 0, ids < rows))
    checked = tf.debugging.Assert(in_range, [
        f"{ID_OUTSIDE} Embedding {name or 'table'} (its table has {rows} rows, sharded on them "
        f"over mesh axis {rows_axis}): ids must be in [0, {rows}); give the layer input_dim "
        "above the largest id, or map the ids into range (e.g. hashing). The smallest "
        "and largest ids of the batch:", low, high], summarize=2)
    with tf.control_dependencies([checked]):
        ids = tf.identity(ids)
    value = dtensor.relayout(tf.convert_to_tensor(table), layout)
    blocks = dtensor.relayout(tf.reshape(value, [shards, per, dim]),
                              dtensor.Layout([rows_axis, unsharded, cols_axis], mesh))
    gathered = tf.gather(blocks, ids % per, axis=1)  # [S, *ids.shape, dim]
    # Which block owns each id, as a one-hot over the blocks (an equality of broadcast ids and
    # block numbers crashed DTensor's layout propagation here; one_hot did not).
    owned = dtensor.relayout(tf.one_hot(ids // per, shards, axis=0, dtype=gathered.dtype),
                             dtensor.Layout([rows_axis, *ids_specs], mesh))
    # Pinned to the ids' layout: a later relayout (the sequence sharded over the rows' axis,
    # dtk.parallel.sequence) must not propagate into the gather's gradient (DTensor: "TransposeOp
    # SPMD needs communication is not supported").
    out = dtensor.relayout(tf.reduce_sum(gathered * owned[..., None], axis=0),
                           dtensor.Layout([*ids_specs, unsharded], mesh))
    if ids_axis != batch_axis and batch_axis in mesh.dim_names and batch_axis != cols_axis:
        # The rows are sharded over the batch axis, so every device looked up every id: hand on
        # each device's own rows (a slice, no communication), batch-sharded as every other
        # activation is. Left replicated, layers that pin their outputs batch-sharded (FSDP's
        # gathered activations) meet replicated tensors, and DTensor fails on the mix
        # ("EmitAllScatter was passed a desired_layout ... not more sharded").
        out = dtensor.relayout(out, dtensor.Layout(
            [batch_axis] + [unsharded] * (ids.shape.rank - 1) + [unsharded], mesh))
    return out


def _row_sharded_embedding_call(self, inputs):
    """``Embedding.call`` on a table sharded on its rows (``row_sharded_lookup``)."""
    if inputs.dtype not in (tf.int32, tf.int64):
        inputs = tf.cast(inputs, tf.int32)
    layout = self._dtk_table_layout  # pylint: disable=protected-access
    out = row_sharded_lookup(self.embeddings, inputs, layout, self._dtk_batch_axis,  # pylint: disable=protected-access
                             name=self.name)
    lookups = getattr(self, "_dtk_lookups", None)  # a training step's forward pass records:
    if getattr(self, "_dtk_sparse", False) and lookups is not None:  # dtk.train.sparse
        lookups.append((inputs, out))  # differentiates w.r.t. the output
    if self._dtype_policy.compute_dtype != self._dtype_policy.variable_dtype:  # pylint: disable=protected-access
        out = tf.cast(out, self._dtype_policy.compute_dtype)  # pylint: disable=protected-access
    return out


def check_layers(model: tf_keras.Model) -> None:
    """Refuses, before any step, layers whose unsupported ops dtk cannot replace.

    Raises:
      ValueError: naming the layer, the op and what to do.
    """
    L = tf_keras.layers  # pylint: disable=invalid-name
    for layer in model._flatten_layers(include_self=False):  # pylint: disable=protected-access
        name = type(layer).__name__
        if isinstance(layer, (L.AveragePooling1D, L.AveragePooling2D, L.AveragePooling3D,
                              L.DepthwiseConv2D,
                              L.SeparableConv2D, L.DepthwiseConv1D, L.SeparableConv1D)) and \
                not _channels_last(layer):
            raise ValueError(
                f"layer {layer.name!r} ({name}, data_format='channels_first') uses an op DTensor "
                f"cannot lay out ({_op_of(name)}), and dtk's equivalent takes channels_last only; "
                "build the model with data_format='channels_last' (the default)")
        if isinstance(layer, L.Discretization) and (
                layer.output_mode != "int" or layer.bin_boundaries is None):
            raise ValueError(
                f"layer {layer.name!r} (Discretization, output_mode={layer.output_mode!r}) uses "
                "Bucketize, which DTensor cannot lay out; dtk replaces it for output_mode='int' "
                "with fixed bin_boundaries only. Discretize in the tf.data pipeline instead")
        if isinstance(layer, L.RNN) and not layer.unroll:
            cells = getattr(layer.cell, "cells", [layer.cell])
            rates = {k: getattr(c, k, 0) for c in cells for k in ("dropout", "recurrent_dropout")
                     if getattr(c, k, 0)}
            if rates and not name.startswith("ConvLSTM"):  # dtk unrolls those itself
                raise ValueError(
                    f"layer {layer.name!r} ({name}, {', '.join(f'{k}={v}' for k, v in rates.items())}"
                    ") caches its dropout masks per graph, and with its recurrent loop the cache "
                    "holds two graphs, which tf_keras cannot build under DTensor layouts; pass "
                    "unroll=True to the layer (dtk unrolls recurrent layers anyway; the masks are "
                    "then drawn the same on every mesh)")
            steps = _static_timesteps(layer)
            if steps is None:
                raise ValueError(
                    f"layer {layer.name!r} ({name}) runs a recurrent loop (TensorList ops), which "
                    "DTensor cannot lay out; dtk unrolls it, which needs a static sequence "
                    "length, but its input's time dim is None. Give the model's Input a fixed "
                    "length, e.g. tf_keras.Input((timesteps, features))")


# Augmentation layers whose image transform (ImageProjectiveTransformV3) dtk replaces.
_AUGMENTATION = ("RandomRotation", "RandomTranslation", "RandomZoom")


def _static_timesteps(layer) -> int | None:
    """The time dim of a built RNN layer's input (None when unknown)."""
    built = getattr(layer, "_build_input_shape", None)
    if built is not None and not isinstance(built, (list, tuple)) or (
            isinstance(built, (list, tuple)) and built and isinstance(built[0], (int, type(None)))):
        dims = tf.TensorShape(built).as_list()
        if len(dims) >= 2:
            return dims[0 if getattr(layer, "time_major", False) else 1]
    try:
        shape = layer.input_shape if not isinstance(layer.input_shape, list) else \
            layer.input_shape[0]
    except (AttributeError, RuntimeError):
        spec = getattr(layer, "input_spec", None)
        spec = spec[0] if isinstance(spec, list) else spec
        shape = getattr(spec, "shape", None)
    if shape is None or len(shape) < 2:
        return None
    axis = 0 if getattr(layer, "time_major", False) else 1
    return shape[axis]


def _op_of(layer_class: str) -> str:
    for unsupported in UNSUPPORTED_OPS.values():
        if layer_class in unsupported.layers:
            return unsupported.op
    return "?"


def explain_failure(message: Any, model: Any = None, graph: Any = None) -> str | None:
    """DTensor's refusal of a step (an MLIR dump naming an op, or "Stateful random operations
    are not supported", naming nothing) as one line: the op, the layers that use it (from the
    model's layer classes and names, and the name scopes of the ops in the traced ``graph``) and
    what to do; None for other errors. DTensor refuses when it expands the step, before the step
    runs: nothing has trained.

    Args:
      message: the error or its text.
      model: the model, whose layers are named.
      graph: the traced step's graph, whose ops' name scopes hold the layer paths.
    """
    from dtk.parallel import randomness  # pylint: disable=g-import-not-at-top
    message = str(getattr(message, "message", message))
    found = _PROPAGATION.search(message)
    if found and randomness.is_random_op(found.group(1)):
        scopes = _scopes(graph, lambda o: o.type == found.group(1)) if graph is not None else []
        return _random_refusal([found.group(1)], scopes)
    if found:
        op = found.group(1)
        known = UNSUPPORTED_OPS.get(op)
        layers = []
        if model is not None:
            classes = set(known.layers) if known else set()
            scoped = {layer.name for layer in model._flatten_layers(include_self=False)  # pylint: disable=protected-access
                      if layer.name and re.search(rf"\b{re.escape(layer.name)}/", message)}
            layers = [f"{layer.name!r} ({type(layer).__name__})"
                      for layer in model._flatten_layers(include_self=False)  # pylint: disable=protected-access
                      if type(layer).__name__ in classes or layer.name in scoped]
        scopes = _scopes(graph, lambda o: o.type == op) if graph is not None else []
        where = (f" used by layer {', '.join(layers[:3])}" if layers else
                 f" used in {_shown(scopes)}" if scopes else "")
        return (f"TensorFlow op {op}{where} has no DTensor layout propagation, so this model "
                "cannot run on a DTensor mesh as it is; compute it in the input pipeline, on the "
                "host, before the batch is laid out, or replace the layer by one dtk supports "
                "(see dtk.parallel.ops.UNSUPPORTED_OPS)")
    past = _PAST_THE_SHARD.search(message)
    if past:
        node = re.search(r"\{\{node ([^}]+)\}\}", message)
        name = node.group(1) if node else ""
        op = name.rsplit("/", 1)[-1] or "a gather or scatter"
        scope = name.rsplit("/", 1)[0].removeprefix("tf.StatefulPartitionedCall/")
        scope = scope.removeprefix("gradient_tape/")
        return (f"{op}{f' in op scope {scope!r}' if scope and scope != name else ''} indexed "
                f"past a device's rows ({past.group(0)}): on a batch split over the mesh, "
                "DTensor gathers and scatters within each device's own rows, so indices into the "
                "whole batch (a tf.range over the batch, flattened positions) go past them; "
                "index per example instead (tf.gather(..., batch_dims=1), "
                "tf.gather_nd(..., batch_dims=1)); nothing was trained by this step")
    for words, (ops, does) in _SHARDED_DIM.items():
        if words in message:
            scopes = _scopes(graph, lambda o, ops=ops: o.type in ops and o.outputs and  # not shapes
                             o.outputs[0].dtype.is_floating) if graph is not None else []
            return (f"{ops[0].removesuffix('V2')}{f' in {_shown(scopes)}' if scopes else ''} "
                    f"{does} along a dim that is sharded over a mesh axis (a layer's output "
                    "whose kernel columns the layout splits over 'model', or one read by a "
                    "layer whose kernel rows it splits), which DTensor cannot do; keep those "
                    "kernels whole on that axis (a layout rule that replicates them, or "
                    "layout='data_parallel'), or work along another dim; nothing was trained "
                    "by this step")
    if _GATHER_LAYOUTS in message and "ResourceGather" in message:
        scopes = _scopes(graph, lambda o: o.type == "ResourceGather") if graph is not None else []
        return (f"an embedding lookup (ResourceGather{f' in {_shown(scopes)}' if scopes else ''})"
                " feeds a layer that the layout shards over a mesh axis (a Dense whose kernel "
                "rows are split over 'model'), and DTensor cannot gather from a table laid out "
                "otherwise into that sharding; shard the table's output dim over the same axis "
                "(a layout rule for the Embedding's 'embeddings' with dims [unsharded, model]), "
                "or lay the consumer out replicated (layout='data_parallel'); nothing was trained "
                "by this step")
    if _STATEFUL_RANDOM in message:
        uncovered = randomness.uncovered_random_ops(graph) if graph is not None else {}
        return _random_refusal(sorted({t for types_ in uncovered.values() for t in types_}),
                               sorted(uncovered))
    return None


def _random_refusal(kinds: list[str], scopes: list[str]) -> str:
    where = f" in {_shown(scopes)}" if scopes else ""
    return (f"random op(s) {', '.join(kinds)}{where}: DTensor cannot run them on a mesh (a "
            "stateful draw, or one it cannot lay out); draw with Keras's random layers, on tf_keras "
            "with tf.random.uniform / normal / truncated_normal or tf.nn.dropout, on Keras 3 with "
            "keras.random.* and a keras.random.SeedGenerator (dtk draws those the same on every "
            "mesh), or draw on the host, in the input pipeline")

