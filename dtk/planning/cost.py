"""The planner's cost model: a candidate's memory per device and its predicted ms per step.

Memory comes from the layout plan on the candidate's mesh (weights and optimizer state as stored,
gradients in the compute layout, FSDP's gathered weights) plus the activation estimate from the
model's profile; time from the machine's and the model's calibrations (``MachineCalibration``,
``StepCalibration``, measured by ``calibration``). The formulas are in ``planner``'s module doc.
"""

from __future__ import annotations

import dataclasses
import re

from collections.abc import Sequence

from dtk.planning.profile import LayerProfile, ModelProfile


MIB = 1024 * 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class MachineCalibration:
    """Timed gathers on this machine, per model-axis size: ``size -> (ms per call, ms per MiB)``.

    A gather's size is what each device holds after it; an all-reduce costs two gathers
    (reduce-scatter + gather) of its size.
    """

    device_kind: str
    devices: int
    gather: dict[int, tuple[float, float]]

    def gather_ms(self, axis_size: int, nbytes: float) -> float:
        if axis_size <= 1:
            return 0.0
        alpha, per_mib = self.gather[axis_size]
        return alpha + per_mib * nbytes / MIB


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepCalibration:
    """The model's own step on the ``batch=D`` mesh: ``a + e * B`` ms; remat adds ``remat_share``
    of it (it replays the forward pass: its dispatch and its compute)."""

    a_ms: float
    e_ms: float
    remat_share: float
    # One more microbatch on batch=D, less its gradient reduction: the loop's own cost.
    microbatch_ms: float = 0.0
    # FSDP's gathers again in each more microbatch on batch=D (the sharded update has none).
    fsdp_microbatch_ms: float = 0.0
    # FSDP's step on batch=D less the sharded update's, one microbatch (its gathers and their
    # gradients against the update's one gather).
    fsdp_ms: float = 0.0
    batch_sizes: tuple[int, ...] = ()
    measured_ms: tuple[float, ...] = ()
    # The candidate the step was timed on when the replicated step on batch=D does not fit the
    # budget ("" : batch=D), and what was assumed rather than measured there.
    measured_on: str = ""
    assumed: str = ""


class Axes:
    """The axes of a mesh that need not exist: all that planning layouts reads of a mesh."""

    def __init__(self, sizes: dict[str, int]):
        self.dim_names = list(sizes)
        self._sizes = sizes

    def dim_size(self, name: str) -> int:
        return self._sizes[name]


def _kernel(layer: LayerProfile) -> str | None:
    return next((p for p in layer.weights if p.endswith(("kernel", "embeddings"))), None)


def _column_axis(dims: Sequence[str | None] | None) -> str | None:
    """The axis sharding a kernel's output features (last dim; heads of a ``[dim, heads, d]``
    projection), or None: such a layer's output is split over that axis."""
    if not dims or len(dims) < 2:
        return None
    if dims[-1]:
        return dims[-1]
    return dims[1] if len(dims) == 3 and dims[0] is None else None


def _layer_split(layer: LayerProfile, dims_of: dict[str, tuple], sizes: dict[str, int],
                 sequence: tuple[str, int] | None = None) -> int:
    """How many ways the layer's output is split: a column-parallel kernel, times the sequence
    axis (``sequence``: its name and size, see ``sequence_split``) where it is another axis."""
    kernel = _kernel(layer)
    axis = _column_axis(dims_of.get(kernel)) if kernel else None
    split = sizes.get(axis, 1) if axis else 1
    if sequence and sequence[0] != axis:
        split *= sequence[1]
    return split


def sequence_split(profile: ModelProfile, table, sizes: dict[str, int], *,
                    fsdp: bool) -> tuple[str, int] | None:
    """The axis the model's activations are sharded on along the sequence, and its size, as
    ``dtk.parallel.sequence.choose_axis`` would choose it (None: not sharded). An estimate: every
    activation of a model with sequence layers is counted as carrying the sequence dim."""
    if not profile.sequence_length or table is None:
        return None
    seq = table.sequence_axis
    if seq and sizes.get(seq, 1) > 1:
        return seq, sizes[seq]
    sp = table.sequence_parallel_axis
    if sp and not fsdp and sizes.get(sp, 1) > 1:
        return sp, sizes[sp]
    return None


def _block(layer: LayerProfile, remat: Sequence[str]) -> str | None:
    """The outermost layer on ``layer``'s path that a remat pattern names (as ``dtk.parallel.remat``)."""
    parts = layer.name.split("/")
    for i in range(len(parts)):
        if any(re.fullmatch(p, parts[i]) for p in remat):
            return "/".join(parts[:i + 1])
    return None


def _activation_bytes(profile: ModelProfile, dims_of, sizes, remat: Sequence[str],
                      sequence: tuple[str, int] | None = None) -> int:
    """Bytes per example live for the backward pass (see the module docstring)."""
    kept, blocks, seen, largest = 0, {}, set(), 0
    for layer in profile.layers:
        nbytes = layer.out_elements * layer.itemsize // _layer_split(layer, dims_of, sizes,
                                                                      sequence)
        if not layer.name.endswith(("/blocks", "/experts")):  # working sets (blockwise
            largest = max(largest, nbytes)  # attention's, the experts') have no gradient of their own
        block = _block(layer, remat) if remat else None
        if block is None:
            kept += nbytes
            continue
        # recomputed: only the block's input is kept; its internals live one block at a time
        if block not in seen:
            seen.add(block)
            kept += layer.in_elements * layer.itemsize // (sequence[1] if sequence else 1)
        blocks[block] = blocks.get(block, 0) + nbytes
    # At the backward pass's peak, the gradient of the largest output and of its input are live
    # beside everything kept (attention's [heads, T, T] scores: measured 1.8-2.0x the kept
    # outputs alone on the LM at T = 4,096, scripts/bench_memory.py).
    return kept + max(blocks.values(), default=0) + 2 * largest


def _remat_weights(profile: ModelProfile, remat: Sequence[str]) -> dict[str, str]:
    """weight path -> the remat block that owns it."""
    return {p: block for layer in profile.layers if (block := _block(layer, remat))
            for p in layer.weights}


def compute_dims_of(plan) -> dict[str, tuple]:
    """Each weight's layout while a step computes (FSDP weights are gathered to the table's)."""
    return {w.path: (w.compute_dims if w.compute_dims is not None else w.dims)
            for w in plan.weights}


def _gradient_bytes(plan) -> int:
    """Bytes per device of all gradients, in the compute layout."""
    from dtk.parallel import layouts  # pylint: disable=g-import-not-at-top
    sizes, dims = dict(plan.mesh_axes), compute_dims_of(plan)
    return sum(w.bytes_total // layouts._split(dims[w.path], sizes)  # pylint: disable=protected-access
               for w in plan.weights)


def candidate_memory(profile: ModelProfile, plan, *, update: str, remat: Sequence[str],
                     rows_per_device: int, optimizer_slots: int = 2) -> dict[str, int]:
    """Bytes per device of a candidate: weights, optimizer state, gradients, gathered weights
    and activations (``rows_per_device``: the rows one microbatch puts on a device)."""
    from dtk.parallel import layouts  # pylint: disable=g-import-not-at-top
    sizes = dict(plan.mesh_axes)
    zero = update == "zero" and sizes.get("batch", 1) > 1
    stored = layouts.memory_per_device(plan, optimizer_slots=optimizer_slots,
                                       shard_optimizer_state=zero)
    compute_dims = compute_dims_of(plan)
    gradients = _gradient_bytes(plan)
    gathered = stored["gathered_in_step"]
    if remat and gathered:  # remat gathers a block's weights again and drops them with it
        in_blocks = _remat_weights(profile, remat)
        per_block: dict[str, int] = {}
        outside = 0
        for w in plan.weights:
            if w.compute_dims is None:
                continue
            extra = w.bytes_total // layouts._split(w.compute_dims, sizes) - w.bytes_per_device  # pylint: disable=protected-access
            if w.path in in_blocks:
                block = in_blocks[w.path]
                per_block[block] = per_block.get(block, 0) + extra
            else:
                outside += extra
        gathered = outside + max(per_block.values(), default=0)
    sequence = sequence_split(profile, plan.table, sizes, fsdp=update == "fsdp")
    activations = rows_per_device * _activation_bytes(profile, compute_dims, sizes, remat,
                                                      sequence)
    memory = {"weights": stored["weights"], "optimizer": stored["optimizer"],
              "gradients": gradients, "gathered": gathered, "activations": activations}
    memory["total"] = sum(memory.values())
    return memory


def model_axis_ms(profile: ModelProfile, plan, machine: MachineCalibration, rows: int) -> float:
    """The model axis's collectives per step (see the module docstring), in ms."""
    sizes = dict(plan.mesh_axes)
    m = sizes.get("model", 1)
    if m <= 1:
        return 0.0
    dims_of = compute_dims_of(plan)
    total = 0.0
    for layer in profile.layers:
        kernel = _kernel(layer)
        dims = dims_of.get(kernel) if kernel else None
        if not dims or "model" not in dims:
            continue
        out_bytes = rows * layer.out_elements * layer.itemsize
        in_bytes = rows * layer.in_elements * layer.itemsize
        if kernel.endswith("embeddings") and dims[0] == "model":
            # rows sharded: each device's block looked up, summed over the axis (an all-reduce
            # of the output, dtk.parallel.ops.row_sharded_lookup); its gradient stays sharded
            total += 2 * machine.gather_ms(m, out_bytes)
        elif kernel.endswith("embeddings"):  # features sharded: gathered after the lookup
            total += machine.gather_ms(m, out_bytes)
        elif _column_axis(dims) == "model":  # column parallel
            total += 2 * machine.gather_ms(m, in_bytes)  # backward: the input's gradient
        else:  # row parallel: the output is summed over the axis
            total += 2 * machine.gather_ms(m, out_bytes)
    return total


def _sequence_ms(profile: ModelProfile, plan, machine: MachineCalibration, rows: int) -> float:
    """The ``seq`` axis's collectives per step, in ms: each attention layer gathers its keys' and
    values' input over the axis (forward) and reduce-scatters its gradient (backward). The
    all-to-all alternative moves less (dtk.parallel.sequence times both on the mesh); this is
    the bound."""
    seq = getattr(plan.table, "sequence_axis", None)
    size = dict(plan.mesh_axes).get(seq, 1) if seq else 1
    if size <= 1 or not profile.sequence_length:
        return 0.0
    return sum(2 * machine.gather_ms(size, rows * elements * itemsize)
               for _, elements, itemsize in profile.attention)


def _all_to_all(profile: ModelProfile, plan, sizes: dict[str, int], rows: int
                ) -> list[tuple[int, float]]:
    """Each MoE layer's all-to-all on a mesh of ``sizes``: (axis size, bytes a device holds of
    the expert inputs). The axis is the one sharding the experts' dim 0; the tokens are split over
    the batch rows and, where the table shards the sequence, the sequence axis."""
    dims_of = compute_dims_of(plan)
    seq = getattr(plan.table, "sequence_axis", None)
    split = sizes.get(seq, 1) if seq else 1
    out = []
    for _, moved, itemsize, paths in profile.experts:
        axes = {dims_of[p][0] for p in paths if p in dims_of and len(dims_of[p]) == 3}
        axis = next((a for a in axes if a), None)
        if axis and sizes.get(axis, 1) > 1:
            out.append((sizes[axis], rows * moved * itemsize / split))
    return out


def all_to_all_bytes(profile: ModelProfile, plan, rows: int, microbatches: int = 1) -> int:
    """Bytes a device sends by all-to-all in one step: per MoE layer, the expert inputs to their
    experts and the outputs back, forward and backward (4), each sending ``(n - 1) / n`` of what
    the device holds over an axis of size n."""
    return int(microbatches * sum(4 * nbytes * (n - 1) / n for n, nbytes in
                                  _all_to_all(profile, plan, dict(plan.mesh_axes), rows)))


def _experts_ms(profile: ModelProfile, plan, machine: MachineCalibration, rows: int,
                global_batch_size: int) -> float:
    """The all-to-alls of the MoE layers per step, in ms: 4 per layer, each priced as a gather of
    what a device holds (both send ``(n - 1) / n`` of it). Where the experts are sharded over
    ``batch`` the calibrated step on ``batch=D`` already ran them on all D devices: that share is
    taken off."""
    sizes = dict(plan.mesh_axes)
    ms = sum(4 * machine.gather_ms(n, nbytes) for n, nbytes in
             _all_to_all(profile, plan, sizes, rows))
    dims_of = compute_dims_of(plan)
    over_batch = any(dims_of.get(p, (None,))[0] == "batch" for _, _, _, paths in profile.experts
                     for p in paths if len(dims_of.get(p, ())) == 3)
    if over_batch:
        d = machine.devices
        ms -= sum(4 * machine.gather_ms(d, global_batch_size // d * moved * itemsize)
                  for _, moved, itemsize, _ in profile.experts)
    return ms


def predict_ms(profile: ModelProfile, plan, machine: MachineCalibration, step: StepCalibration,
               *, global_batch_size: int, update: str, remat: bool, microbatches: int,
               remat_patterns: Sequence[str] = ()) -> float:
    """Predicted ms per step of one candidate (the module docstring's formula)."""
    from dtk.parallel import layouts  # pylint: disable=g-import-not-at-top
    sizes = dict(plan.mesh_axes)
    b = sizes.get("batch", 1)
    k = microbatches
    rows = global_batch_size // b // k
    ms = (step.a_ms + step.e_ms * global_batch_size) * (1 + (step.remat_share if remat else 0.0))
    ms += k * model_axis_ms(profile, plan, machine, rows) / sizes.get(
        getattr(plan.table, "sequence_axis", None) or "", 1)
    ms += k * _sequence_ms(profile, plan, machine, rows)
    if profile.experts:
        ms += k * _experts_ms(profile, plan, machine, rows, global_batch_size // k)
    if update == "fsdp":
        # Each microbatch gathers the weights (again in the backward pass for remat's blocks);
        # the sharded update gathers them once, after the update. On batch=D the difference is
        # measured (``fsdp_ms``: 26-39% of the step on the LM of bench_plan.py, priced at zero
        # before 2026-11-26, which chose FSDP over cheaper plans). With a model axis too, DTensor's
        # gradient of the 2-D gather is not a reduce-scatter: about two more gathers per weight.
        in_blocks = _remat_weights(profile, remat_patterns) if remat else {}
        two_d = 2 if sizes.get("model", 1) > 1 else 0
        gathered = full = 0
        for w in plan.weights:
            if w.compute_dims is None:
                continue
            compute = w.bytes_total // layouts._split(w.compute_dims, sizes)  # pylint: disable=protected-access
            gathered += compute
            full += w.bytes_total
            gathers = k * (two_d + (1 if w.path in in_blocks else 0))
            if gathers:
                ms += gathers * machine.gather_ms(b, compute)
        # FSDP's own cost on batch=D, and each more microbatch's gathers again: measured there,
        # scaled by what is gathered
        ms += (step.fsdp_ms + (k - 1) * step.fsdp_microbatch_ms) * gathered / max(full, 1)
    if k > 1:  # the loop's cost, and DTensor reduces every microbatch's gradients (dtk.train.steps)
        ms += (k - 1) * (step.microbatch_ms + 2 * machine.gather_ms(b, _gradient_bytes(plan)))
    return ms


def dtype_bytes(dtype: str) -> int:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    return tf.as_dtype(dtype).size


def mib(n: float | None) -> str:
    return "none" if n is None else f"{n / MIB:.1f} MiB"
