"""Mixture of experts: a feed-forward block of E experts with a learned router, sharded over an
``expert`` mesh axis, whose routing does not depend on the mesh.

``MixtureOfExperts`` replaces a transformer block's MLP (Switch Transformer for ``top_k=1``,
GShard for ``top_k=2``). Its expert weights are ``[E, ...]`` tensors; a layout table shards their
dim 0 over a mesh axis (``layouts/transformer_lm_moe.toml``: ``expert``;
``transformer_lm_moe_batch.toml``: ``batch``), and ``model`` can split each expert's own matrices.

Routing, the choice that makes parity possible. Which tokens an expert takes, and which it drops
when full, must not depend on how tokens are spread over devices. Tokens are routed in **groups
of ``group_size`` consecutive positions of one sequence** (a grouping fixed by the data, not the
mesh), each group with its own capacity per expert::

    capacity = ceil(capacity_factor * top_k * group_size / num_experts)

A token's slot in its expert is its rank among the group's tokens that chose that expert (first
choices before second choices, earlier positions first, as GShard ranks them); a token whose
slot is past the capacity is dropped for that choice: its output is 0 there, so the block's
residual carries it on unchanged. The cost of the choice: a group is smaller than a device's
share of the batch (what MaxText and Switch route over), so with unbalanced routing more tokens
are dropped at the same capacity factor; a larger ``group_size`` drops fewer and costs
``[tokens, E, capacity]`` dispatch tensors that grow with it.

Everything is computed in DTensor's global view with dense dispatch (one-hot einsums, GShard's
formulation), so the numbers are those of one device. The tokens reach their experts by one
relayout of the expert inputs ``[E, batch, chunks, capacity, dim]`` from the tokens' layout (the
batch over ``batch``, the chunks of the sequence over the sequence axis; the table
``transformer_lm_moe`` shards the residual stream's sequence over ``expert``, so the tokens are
split over ``batch`` and ``expert`` together, as in GShard) to the experts' (dim 0 over the
expert axis): an all-to-all. The outputs come back by the reverse one.

The load-balancing loss of Switch (``E * sum_e f_e * p_e``: the fraction of tokens whose first
choice is expert e times its mean router probability) and the router z-loss (the mean squared
log-sum-exp of the router logits) are added with their coefficients through ``add_loss``, as
Keras adds regularization losses. Each training call also adds its counts to the layer's
``routing`` statistics (non-trainable weights): tokens routed, choices dropped, and each expert's
load; ``routing_stats`` reads them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor


@tf_keras.saving.register_keras_serializable(package="dtk")
class MixtureOfExperts(tf_keras.layers.Layer):
    """A feed-forward block of ``num_experts`` experts and a router: ``[B, T, D] -> [B, T, D]``.

    Args:
      num_experts: E, the experts (``dim 0`` of every expert weight).
      hidden: each expert's hidden width (its MLP is ``D -> hidden -> D``).
      top_k: experts per token, 1 (Switch) or 2 (GShard); the gates of a token's choices are
        its router probabilities (for k = 2 renormalized to sum to 1).
      capacity_factor: slots per expert as a multiple of an even share of a group's choices;
        > 0.
      group_size: consecutive positions of one sequence routed together (must divide the
        sequence length); None: the whole sequence.
      balance_loss: the coefficient of Switch's load-balancing loss.
      z_loss: the coefficient of the router z-loss.
      activation: the experts' hidden activation.
    """

    def __init__(self, num_experts: int, hidden: int, *, top_k: int = 1,
                 capacity_factor: float = 1.25, group_size: int | None = None,
                 balance_loss: float = 1e-2, z_loss: float = 1e-3, activation: str = "gelu",
                 **kwargs):
        super().__init__(**kwargs)
        check_settings(num_experts=num_experts, top_k=top_k, capacity_factor=capacity_factor)
        if not isinstance(hidden, int) or hidden < 1:
            raise ValueError(f"hidden must be a positive integer; got {hidden!r}")
        if group_size is not None and (not isinstance(group_size, int) or group_size < 1):
            raise ValueError(f"group_size must be a positive integer or None; got {group_size!r}")
        self.num_experts, self.hidden, self.top_k = num_experts, hidden, top_k
        self.capacity_factor, self.group_size = float(capacity_factor), group_size
        self.balance_loss, self.z_loss = float(balance_loss), float(z_loss)
        self.activation = tf_keras.activations.get(activation)
        self._activation_name = activation

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "num_experts": self.num_experts, "hidden": self.hidden,
                "top_k": self.top_k, "capacity_factor": self.capacity_factor,
                "group_size": self.group_size, "balance_loss": self.balance_loss,
                "z_loss": self.z_loss, "activation": self._activation_name}

    def build(self, input_shape):
        dim = int(input_shape[-1])
        e, h = self.num_experts, self.hidden
        init = lambda: tf_keras.initializers.RandomNormal(stddev=0.02)  # noqa: E731  (one each)
        # Routing is float32 under mixed precision too (Switch's "selective precision"): the
        # router is read as float32, not cast to the compute dtype.
        self.router = self.add_weight(name="router", shape=(dim, e), initializer=init(),
                                      dtype="float32", experimental_autocast=False)
        self.w1 = self.add_weight(name="w1", shape=(e, dim, h), initializer=init())
        self.b1 = self.add_weight(name="b1", shape=(e, h), initializer="zeros")
        self.w2 = self.add_weight(name="w2", shape=(e, h, dim), initializer=init())
        self.b2 = self.add_weight(name="b2", shape=(e, dim), initializer="zeros")
        # Routing statistics, summed over training calls (routing_stats reads them).
        self.tokens = self.add_weight(name="tokens", shape=(), initializer="zeros",
                                      dtype="float32", trainable=False)
        self.dropped = self.add_weight(name="dropped", shape=(), initializer="zeros",
                                       dtype="float32", trainable=False)
        self.load = self.add_weight(name="load", shape=(e,), initializer="zeros",
                                    dtype="float32", trainable=False)
        super().build(input_shape)

    def capacity(self, group: int) -> int:
        """Slots per expert in a group of ``group`` tokens."""
        return max(1, math.ceil(self.capacity_factor * self.top_k * group / self.num_experts))

    def sizes_per_example(self, length: int, dim: int) -> dict[str, int]:
        """Elements one example of ``length`` positions puts through the layer (for the planner):
        ``moved``, the expert inputs one all-to-all carries (``[E, chunks, capacity, dim]``: every
        slot, taken or not, as the dense dispatch sends it); ``live``, what the backward pass
        keeps (the dispatched inputs, the hidden activation before and after the nonlinearity,
        the outputs, and the dispatch and combine tensors)."""
        group = self._group(length)
        slots = length // group * self.num_experts * self.capacity(group)
        dispatch = length * self.num_experts * self.capacity(group)
        return {"moved": slots * dim,
                "live": slots * (2 * dim + 2 * self.hidden) + 2 * dispatch}

    def _group(self, length: int) -> int:
        group = self.group_size or length
        if length % group:
            raise ValueError(
                f"MixtureOfExperts {self.name!r}: group_size {group} does not divide the sequence "
                f"length {length}; routing groups are consecutive positions of one sequence "
                "(use a divisor of the length)")
        return group

    def call(self, x, training=None):
        batch, length, dim = x.shape[0], int(x.shape[1]), int(x.shape[2])
        e, k = self.num_experts, self.top_k
        group = self._group(length)
        chunks = length // group
        cap = self.capacity(group)
        layout = getattr(self, "_dtk_input_layout", None)
        if layout is not None:  # groups that the sequence axis would cut: gathered first
            x = dtensor.relayout(x, layout)
        xg = tf.reshape(x, [-1 if batch is None else batch, chunks, group, dim])
        logits = tf.einsum("bcgd,de->bcge", tf.cast(xg, tf.float32), self.router)
        probs = tf.nn.softmax(logits, axis=-1)
        # Top-k choices, ranked within the group: first choices before second choices.
        remaining, masks, gates = probs, [], []
        for _ in range(k):
            mask = tf.one_hot(tf.argmax(remaining, axis=-1), e, dtype=tf.float32)
            masks.append(mask)
            gates.append(tf.reduce_sum(probs * mask, axis=-1))
            remaining = remaining * (1.0 - mask)
        if k > 1:
            total = tf.add_n(gates)
            gates = [g / total for g in gates]
        taken = tf.zeros_like(masks[0][:, :, :1, :])  # slots filled by earlier choices [b,c,1,E]
        dispatch = combine = None
        kept_any = tf.zeros_like(gates[0])
        for mask, gate in zip(masks, gates):
            position = tf.math.cumsum(mask, axis=2, exclusive=True) + taken
            keep = mask * tf.cast(position < cap, tf.float32)
            taken = taken + tf.reduce_sum(mask, axis=2, keepdims=True)
            slot = tf.one_hot(tf.cast(tf.reduce_sum(position * keep, axis=-1), tf.int32), cap,
                              dtype=tf.float32)  # [b,c,g,cap]
            d = keep[..., None] * slot[:, :, :, None, :]  # [b,c,g,E,cap]
            dispatch = d if dispatch is None else dispatch + d
            c = d * gate[..., None, None]
            combine = c if combine is None else combine + c
            kept_any = kept_any + tf.reduce_sum(keep, axis=-1)
        compute = x.dtype
        expert_in = tf.einsum("bcgem,bcgd->ebcmd", tf.cast(dispatch, compute), xg)
        expert_in = self._to_experts(expert_in)  # the all-to-all, on a mesh
        hidden = self.activation(tf.einsum("ebcmd,edf->ebcmf", expert_in, self.w1)
                                 + self.b1[:, None, None, None, :])
        out = tf.einsum("ebcmf,efd->ebcmd", hidden, self.w2) + self.b2[:, None, None, None, :]
        out = self._to_tokens(out)  # and back
        y = tf.einsum("bcgem,ebcmd->bcgd", tf.cast(combine, compute), out)
        # Switch's load-balancing loss and the router z-loss, over every token of the batch.
        first = tf.reduce_mean(masks[0], axis=[0, 1, 2])
        mean_prob = tf.reduce_mean(probs, axis=[0, 1, 2])
        self.add_loss(self.balance_loss * e * tf.reduce_sum(first * mean_prob))
        self.add_loss(self.z_loss * tf.reduce_mean(
            tf.square(tf.reduce_logsumexp(logits, axis=-1))))
        if training:
            tokens = tf.cast(tf.size(gates[0]), tf.float32)
            self.tokens.assign_add(tokens)
            self.dropped.assign_add(tokens * k - tf.reduce_sum(kept_any))
            load = tf.reduce_sum(dispatch, axis=[0, 1, 2, 4])
            token_layout = getattr(self, "_dtk_token_layout", None)
            if token_layout is not None:  # the variable's (replicated) layout, whatever the
                load = dtensor.relayout(  # layout propagation gave the sum
                    load, dtensor.Layout.replicated(token_layout.mesh, 1))
            self.load.assign_add(load)
        return tf.reshape(y, tf.shape(x))

    def _to_experts(self, t):
        layout = getattr(self, "_dtk_expert_layout", None)
        return t if layout is None else dtensor.relayout(t, layout)

    def _to_tokens(self, t):
        layout = getattr(self, "_dtk_token_layout", None)
        return t if layout is None else dtensor.relayout(t, layout)

    def compute_output_shape(self, input_shape):
        return input_shape


def check_settings(*, num_experts: Any, top_k: Any, capacity_factor: Any,
                   flag: str = "") -> None:
    """Refuses settings no MoE layer can run, naming the argument (``flag``: its command-line
    spelling prefix, e.g. ``--moe_``).

    Raises:
      ValueError: E < 1, k not 1 or 2, k > E, or a capacity factor <= 0.
    """
    name = (lambda n: f"{flag}{n}") if flag else (lambda n: n)
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"{name('experts' if flag else 'num_experts')} must be a positive "
                         f"integer; got {num_experts!r}")
    if top_k not in (1, 2) or isinstance(top_k, bool):
        raise ValueError(f"{name('top_k')} must be 1 (Switch) or 2 (GShard); got {top_k!r}")
    if top_k > num_experts:
        given = f"{name('top_k')} {top_k}" if flag else f"top_k={top_k}"
        raise ValueError(f"{given} is more than the {num_experts} expert(s): each token picks "
                         f"{top_k} different experts; use {name('top_k')} 1, or more experts")
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) or \
            not 0 < capacity_factor < math.inf:
        raise ValueError(f"{name('capacity_factor')} must be a finite number > 0 (slots per "
                         f"expert as a multiple of an even share; 1.25 is Switch's; "
                         f"{num_experts / top_k:g} gives every expert room for every choice); "
                         f"got {capacity_factor!r}")


def moe_layers(model: tf_keras.Model) -> list[MixtureOfExperts]:
    return [layer for layer in model._flatten_layers()  # pylint: disable=protected-access
            if isinstance(layer, MixtureOfExperts)]


def configure(model: tf_keras.Model, mesh: dtensor.Mesh, *, batch_axis: str,
              sequence_axis: str | None) -> list[str]:
    """Gives the model's MoE layers the layouts of their two relayouts on ``mesh`` (their expert
    weights are laid out already); returns lines for the log.

    The expert inputs ``[E, batch, chunks, capacity, dim]`` go to dim 0 over the axis the expert
    weights' dim 0 is sharded on (``batch`` when the table puts the experts there), the batch
    dim over ``batch_axis`` where that is another axis, and back to the tokens' layout: the batch
    over ``batch_axis``, the sequence's chunks over ``sequence_axis``.

    Raises:
      ValueError: experts that the axis cannot divide (naming E, the axis and its size).
    """
    lines = []
    for layer in moe_layers(model):
        specs = dtensor.fetch_layout(getattr(layer.w1, "_variable", layer.w1)).sharding_specs
        expert_axis = None if specs[0] == dtensor.UNSHARDED else specs[0]
        names = mesh.dim_names
        token_batch = batch_axis if batch_axis in names else dtensor.UNSHARDED
        length = int(layer.input_shape[1])
        count = length // layer._group(length)  # pylint: disable=protected-access
        # The chunks of the sequence stay where the sequence axis put them when it divides their
        # count (else they are gathered: the same numbers, without the all-to-all's saving).
        chunks = sequence_axis if sequence_axis in names and \
            count % mesh.dim_size(sequence_axis) == 0 else dtensor.UNSHARDED
        if specs[0] == batch_axis and sequence_axis in names:
            # Measured: DTensor fails to lower the relayouts of tokens sharded along the sequence
            # (Megatron's, over model) to experts over batch, gathered first or not.
            raise ValueError(
                f"layer {layer.name!r}: experts sharded over the batch axis {batch_axis!r} with "
                f"the sequence sharded over {sequence_axis!r} (size "
                f"{mesh.dim_size(sequence_axis)}) fail inside DTensor; put the experts on an "
                "expert axis (layout table transformer_lm_moe, e.g. --mesh "
                "batch=2,expert=2,model=2), or use a mesh without "
                f"{sequence_axis!r}")
        layer._dtk_input_layout = None  # pylint: disable=protected-access
        if sequence_axis in names and chunks == dtensor.UNSHARDED:  # whole groups a device
            layer._dtk_input_layout = dtensor.Layout(  # pylint: disable=protected-access
                [token_batch, dtensor.UNSHARDED, dtensor.UNSHARDED], mesh)
        layer._dtk_token_layout = dtensor.Layout(  # pylint: disable=protected-access
            [dtensor.UNSHARDED, token_batch, chunks, dtensor.UNSHARDED, dtensor.UNSHARDED], mesh)
        if expert_axis is None:
            layer._dtk_expert_layout = None  # pylint: disable=protected-access
            continue
        size = mesh.dim_size(expert_axis)
        if layer.num_experts % size:
            raise ValueError(
                f"{layer.num_experts} experts (layer {layer.name!r}) are not divisible by mesh "
                f"axis {expert_axis!r} of size {size}: each device holds experts / {size}. Use a "
                f"number of experts that is a multiple of {size}, or a smaller {expert_axis!r} axis")
        expert_batch = token_batch if token_batch != expert_axis else dtensor.UNSHARDED
        layer._dtk_expert_layout = dtensor.Layout(  # pylint: disable=protected-access
            [expert_axis, expert_batch, dtensor.UNSHARDED, dtensor.UNSHARDED, dtensor.UNSHARDED],
            mesh)
        lines.append(f"experts: {layer.name}: {layer.num_experts} experts over mesh axis "
                     f"{expert_axis!r} ({layer.num_experts // size} a device), top-{layer.top_k}, "
                     f"capacity {layer.capacity(layer._group(length))} a group of "  # pylint: disable=protected-access
                     f"{layer._group(length)} positions; tokens move by an all-to-all")
    return lines


def describe_routing(stats: dict, capacity_factor: float) -> str:
    """One line on an interval's routing (``routing_stats``): the share of choices dropped and
    the experts' load, and, over 10% dropped, what drops fewer (a dropped choice passes its
    token on by the residual only; early in training the router is uneven)."""
    line = (f"experts: {stats['moe_dropped']:.1%} of the tokens' choices dropped (capacity "
            f"factor {capacity_factor}); load per expert, as a multiple of an even share: min "
            f"{stats['moe_load_min']:.2f}, max {stats['moe_load_max']:.2f}, mean "
            f"{stats['moe_load_mean']:.2f}")
    if stats["moe_dropped"] > 0.1:
        line += ("; to drop fewer, raise capacity_factor (--moe_capacity_factor: slots per "
                 "expert; more memory and all-to-all bytes) or group_size (--moe_group_size: "
                 "routing groups); the balance loss evens the load as training goes on")
    return line


def routing_stats(model: tf_keras.Model) -> dict[str, float]:
    """The routing statistics of the model's MoE layers since the last ``reset_routing_stats``:
    the fraction of choices dropped and the experts' load (min / max / mean, as fractions of an
    even share). Empty for a model without MoE layers."""
    layers = moe_layers(model)
    if not layers:
        return {}
    def global_value(variable):  # a laid-out model's (replicated counts) or a plain one's
        value = variable.read_value()
        if not dtensor.is_dtensor(value):
            return value.numpy()
        mesh = dtensor.fetch_layout(value).mesh
        whole = dtensor.relayout(value, dtensor.Layout.replicated(mesh, value.shape.rank))
        return dtensor.unpack(whole)[0].numpy()

    tokens = sum(float(global_value(layer.tokens)) * layer.top_k for layer in layers)
    if not tokens:
        return {}
    dropped = sum(float(global_value(layer.dropped)) for layer in layers)
    loads = np.concatenate([global_value(layer.load) / max(
        float(global_value(layer.tokens)) * layer.top_k / layer.num_experts, 1.0)
        for layer in layers])
    return {"moe_dropped": dropped / tokens, "moe_load_min": float(loads.min()),
            "moe_load_max": float(loads.max()), "moe_load_mean": float(loads.mean())}


def reset_routing_stats(model: tf_keras.Model) -> None:
    """Zeroes the routing counters. Also after a restore (``dtk.Trainer``,
    ``dtk.CheckpointCallback``): the counters are saved with the layer's weights, and a resumed
    run's first interval would otherwise add its counts to the checkpointed interval's (36.4%
    dropped reported where the uninterrupted run's steps 3-4 dropped 38.8%)."""
    for layer in moe_layers(model):
        for variable in (layer.tokens, layer.dropped, layer.load):
            variable.assign(tf.zeros_like(variable))
