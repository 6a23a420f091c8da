"""Pipeline parallelism: a model's layers in stages on sub-meshes, microbatches in a schedule.

A ``stage`` mesh axis (``stage=2,batch=4``) splits the devices into sub-meshes, one a stage, each
with the other axes (``batch=4``): stage ``s`` holds its own layers' weights and optimizer state
only, laid out by the layout table on its sub-mesh as on any mesh. DTensor cannot run one
function across two meshes (``../shared/docs/dtensor-notes.md``), so each stage is its own
model (the full model's sub-graph between two boundaries, ``stage_model``) with its own compiled
forward and backward, and Python drives the microbatches through them in a schedule:

- **GPipe**: every microbatch's forward through every stage, then every backward, last first.
- **1F1B** (PipeDream-Flush, Megatron's default): stage ``s`` runs ``S - s - 1`` forwards to
  fill the pipe, then alternates one forward and one backward, then drains. The same bubble
  ``(S - 1) / (M + S - 1)`` as GPipe, with at most ``S - s`` microbatches in flight on stage
  ``s`` against ``M``.

**Boundaries** are where one tensor alone crosses from the layers before to the layers after,
between two *units*: a repeated block (layers named ``block{i}_...``, the LM's; TensorFlow-op
layers such as a residual ``+`` belong to the block they sit in) or a top-level layer of any
Functional or Sequential model. The units are grouped into stages of balanced cost (weight
elements outside embeddings plus output elements per example, the planner's profile of a
layer), or at the layers the user names as each stage's first.

**Backward passes recompute** the stage's forward from the stage's input (GPipe's
re-materialization at partition boundaries): a stage keeps only its inputs between its forward
and its backward, never its activations, and the backward's tape needs no state across calls.

**Exact against one device.** Microbatch ``j`` holds rows ``r * M + j`` of the batch (as
``gradient_accumulation_steps`` splits it), random layers draw for those global rows
(``dtk.parallel.randomness.microbatch_scope``) and for the step both passes run in, each
stage's random layers keep their key in the whole model, and the gradients of the microbatches
are summed before one update per stage: the losses of one device at float tolerance.

Activations and their gradients move between stages as the device-to-device copies of their
shards (the sub-meshes have the same shape, so shard ``i`` of stage ``s`` goes to device ``i``
of stage ``s + 1``).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor

_log = logging.getLogger("dtk")

STAGE_AXIS = "stage"
SCHEDULES = ("gpipe", "1f1b")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """How a pipelined model trains.

    Attributes:
      microbatches: M, microbatches per step; the global batch must divide by M times the
        batch axis.
      schedule: ``"1f1b"`` (default) or ``"gpipe"``.
      boundaries: the names of the layers that start stages 1, 2, ... (None: balanced by cost).
    """

    microbatches: int = 1
    schedule: str = "1f1b"
    boundaries: tuple[str, ...] | None = None

    def __post_init__(self):
        m = self.microbatches
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"PipelineConfig.microbatches must be a positive integer; got {m!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"PipelineConfig.schedule {self.schedule!r} is not a schedule dtk "
                             f"knows; use one of {', '.join(SCHEDULES)}")
        if self.boundaries is not None and (isinstance(self.boundaries, str) or not all(
                isinstance(b, str) for b in self.boundaries)):
            raise ValueError(f"PipelineConfig.boundaries must be a list of layer names; got "
                             f"{self.boundaries!r}")


# -- meshes -----------------------------------------------------------------------------------------
def stage_meshes(mesh: dtensor.Mesh, axis: str = STAGE_AXIS) -> list[dtensor.Mesh]:
    """The sub-mesh of each stage: the devices at one coordinate of ``axis``, with the other
    axes in their order. A sub-mesh numbers its devices from 0 (DTensor's Python reads a
    device's place in the mesh from its id); its devices are the whole mesh's."""
    names = list(mesh.dim_names)
    if axis not in names:
        raise ValueError(f"mesh {mesh_spec(mesh)} has no {axis!r} axis to pipeline over")
    rest = [n for n in names if n != axis]
    if not rest:
        raise ValueError(f"mesh {mesh_spec(mesh)}: a pipeline needs a batch axis beside {axis!r} "
                         f"(e.g. {axis}={mesh.dim_size(axis)},batch=1)")
    ids = np.asarray(mesh.global_device_ids()).reshape([mesh.dim_size(n) for n in names])
    ids = np.moveaxis(ids, names.index(axis), 0)
    local = dict(zip(mesh.local_device_ids(), mesh.local_devices()))
    out = []
    for s in range(mesh.dim_size(axis)):
        flat = [int(i) for i in ids[s].reshape(-1)]
        mine = [p for p, i in enumerate(flat) if i in local]
        # A stage on another client's devices is a mesh without local devices here (it names
        # its devices, as DTensor asks of such a mesh).
        remote = [] if mine else [_device_name(mesh, i) for i in flat]
        out.append(dtensor.Mesh(rest, np.arange(len(flat)).reshape(ids[s].shape), mine,
                                [local[flat[p]] for p in mine], mesh_name=f"{axis}{s}",
                                global_devices=remote, use_xla_spmd=False))
    return out


def _device_name(mesh: dtensor.Mesh, device_id: int) -> str:
    """The full name of another client's device ``device_id`` of ``mesh`` (clients hold equal,
    consecutive blocks of device ids, as ``create_distributed_mesh`` lays them out)."""
    per_client = len(mesh.local_device_ids())
    task, index = divmod(device_id, per_client)
    return f"/job:{dtensor.full_job_name(task)}/device:{mesh.device_type()}:{index}"


def mesh_spec(mesh: dtensor.Mesh) -> str:
    return ",".join(f"{n}={mesh.dim_size(n)}" for n in mesh.dim_names)


# -- where a model can be cut -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Unit:
    """Consecutive layers that stay in one stage: a block, or one top-level layer."""

    name: str
    first: int  # positions in the model's layer order
    last: int
    cost: float


def _order(model: tf_keras.Model):
    """The model's layers in topological order and each one's node, for a Functional or
    Sequential model whose layers are each called once."""
    if not getattr(model, "_is_graph_network", False):
        raise ValueError(
            f"model {model.name!r} is a subclassed model: dtk finds pipeline stages in a "
            "Functional or Sequential model's layers (its graph says which tensors cross between "
            "them); build it with the Functional API, or train it without a stage axis")
    nodes = {}
    for depth_nodes in model._nodes_by_depth.values():  # pylint: disable=protected-access
        for node in depth_nodes:
            if isinstance(node.layer, tf_keras.layers.InputLayer):
                continue
            if id(node.layer) in nodes:
                raise ValueError(
                    f"model {model.name!r}: layer {node.layer.name!r} is called more than once (a "
                    "shared layer); dtk cannot put its calls in different stages. Train it "
                    "without a stage axis")
            nodes[id(node.layer)] = node
    layers = [layer for layer in model.layers if id(layer) in nodes]
    return layers, [nodes[id(layer)] for layer in layers]


def _unit_name(layer, previous: str | None) -> str:
    if layer.name.startswith("tf.") and previous is not None:
        return previous  # a TensorFlow op (a residual +) belongs where it sits
    match = re.match(r"^(.*?\d+)_", layer.name)
    return match.group(1) if match else layer.name


def _elements(tensor) -> int:
    return int(np.prod([d or 1 for d in tensor.shape[1:]]))


def cuts(model: tf_keras.Model) -> tuple[list[Unit], list[Any]]:
    """The model's units and, between each unit and the next, the one tensor that crosses
    (None where more than one crosses: no boundary there)."""
    layers, nodes = _order(model)
    position = {id(layer): i for i, layer in enumerate(layers)}
    produced: dict[int, int] = {}
    last_use: dict[int, int] = {}
    tensors: dict[int, Any] = {}
    for i, node in enumerate(nodes):
        for t in tf.nest.flatten(node.keras_inputs):
            tensors[id(t)] = t
            producer = t._keras_history.layer  # pylint: disable=protected-access
            produced[id(t)] = position.get(id(producer), -1)
            last_use[id(t)] = max(last_use.get(id(t), -1), i)
    for t in tf.nest.flatten(model.outputs):
        tensors[id(t)] = t
        produced[id(t)] = position[id(t._keras_history.layer)]  # pylint: disable=protected-access
        last_use[id(t)] = len(layers)

    def crossing(c: int) -> list:
        return [tensors[k] for k in tensors if produced[k] <= c < last_use[k]]

    units: list[Unit] = []
    name = None
    for i, layer in enumerate(layers):
        unit = _unit_name(layer, name)
        cost = float(sum(int(np.prod(w.shape)) for w in layer.weights
                         if not w.name.split("/")[-1].startswith("embeddings")))
        cost += sum(_elements(t) for t in tf.nest.flatten(nodes[i].outputs))
        if units and unit == name:
            u = units[-1]
            units[-1] = Unit(u.name, u.first, i, u.cost + cost)
        else:
            units.append(Unit(unit, i, i, cost))
        name = unit
    between = []
    for u in units[:-1]:
        live = crossing(u.last)
        between.append(live[0] if len(live) == 1 else None)
    return units, between


def split(model: tf_keras.Model, stages: int, boundaries: Sequence[str] | None = None
          ) -> list[tuple[int, int]]:
    """The units of each of ``stages`` stages: ``[(first unit, last unit), ...]``.

    Raises:
      ValueError: more stages than units the model can be cut between, a named boundary that is
        no layer or no place one tensor alone crosses, or a model with no boundary.
    """
    units, between = cuts(model)
    allowed = [i for i, t in enumerate(between) if t is not None]  # cut after unit i
    if not allowed:
        raise ValueError(
            f"model {model.name!r} has no pipeline stage boundary dtk can find: no place between "
            "its top-level layers or blocks where a single tensor crosses; train it without a "
            "stage axis")
    if stages - 1 > len(allowed):
        raise ValueError(
            f"{stages} pipeline stages for model {model.name!r}, which can be cut in "
            f"{len(allowed) + 1} parts at most (its blocks and top-level layers: "
            f"{', '.join(u.name for u in units[:8])}{' ...' if len(units) > 8 else ''}); use at "
            f"most stage={len(allowed) + 1}, or a model with more blocks")
    if boundaries is not None:
        if len(boundaries) != stages - 1:
            raise ValueError(f"pipeline boundaries {list(boundaries)}: {stages} stages need "
                             f"{stages - 1} (the first layer of each stage after the first)")
        starts = {u.name: i for i, u in enumerate(units)}
        layer_unit = {}
        layers, _ = _order(model)
        for i, u in enumerate(units):
            for layer in layers[u.first:u.last + 1]:
                layer_unit[layer.name] = i
        chosen = []
        for name in boundaries:
            if name not in layer_unit and name not in starts:
                raise ValueError(f"pipeline boundary {name!r} is no layer of model "
                                 f"{model.name!r}; name the first layer of a stage (e.g. "
                                 f"{units[allowed[len(allowed) // 2] + 1].name})")
            i = starts.get(name, layer_unit.get(name))
            if units[i].name != name and layers[units[i].first].name != name or i - 1 not in allowed:
                raise ValueError(
                    f"pipeline boundary {name!r}: more than one tensor crosses there (or it is "
                    f"inside a block); stages can start at "
                    f"{', '.join(units[a + 1].name for a in allowed[:8])}")
            chosen.append(i - 1)
        if chosen != sorted(set(chosen)):
            raise ValueError(f"pipeline boundaries {list(boundaries)} must be in model order, "
                             "each once")
    else:
        chosen = _balanced([u.cost for u in units], allowed, stages)
    edges = [-1, *chosen, len(units) - 1]
    return [(edges[s] + 1, edges[s + 1]) for s in range(stages)]


def _balanced(costs: list[float], allowed: list[int], stages: int) -> list[int]:
    """Cut points (after units in ``allowed``) minimizing the costliest stage."""
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    n = len(costs)
    best: dict[tuple[int, int], tuple[float, list[int]]] = {}

    def solve(start: int, parts: int) -> tuple[float, list[int]]:
        if (start, parts) in best:
            return best[(start, parts)]
        if parts == 1:
            result = (prefix[n] - prefix[start], [])
        else:
            result = (float("inf"), [])
            for c in allowed:
                if c < start or n - 1 - c < parts - 1:
                    continue
                rest, cuts_after = solve(c + 1, parts - 1)
                worst = max(prefix[c + 1] - prefix[start], rest)
                if worst < result[0]:
                    result = (worst, [c, *cuts_after])
        best[(start, parts)] = result
        return result

    return solve(0, stages)[1]


def stage_model(model: tf_keras.Model, stages: list[tuple[int, int]], s: int) -> tf_keras.Model:
    """Stage ``s`` of ``model`` as a Functional model of the same layer objects: from the tensor
    that crosses into it (the model's inputs for stage 0) to the one that crosses out (its
    outputs for the last)."""
    units, between = cuts(model)
    first, last = stages[s]
    inputs = model.inputs if first == 0 else between[first - 1]
    outputs = model.outputs if last == len(units) - 1 else between[last]
    if isinstance(inputs, list) and len(inputs) == 1:
        inputs = inputs[0]
    if isinstance(outputs, list) and len(outputs) == 1:
        outputs = outputs[0]
    return tf_keras.Model(inputs, outputs, name=f"{model.name}_stage{s}")


def clone_stage(whole: tf_keras.Model, part: tf_keras.Model) -> tf_keras.Model:
    """A new model of ``part``'s layers (``stage_model`` of ``whole``), with new weights made
    where it is built (under a layout scope: on a stage's sub-mesh, that stage's weights only).
    Each layer remembers its position in ``whole`` (``dtk.parallel.randomness`` keys draws by it,
    so a stage draws what the whole model draws)."""
    clone = tf_keras.models.clone_model(part)
    position = {id(layer): i for i, layer in enumerate(whole._flatten_layers(include_self=False))}  # pylint: disable=protected-access
    keys = {}
    for layer in clone.layers:
        if isinstance(layer, tf_keras.layers.InputLayer):
            continue
        original = part.get_layer(layer.name)
        for mine, theirs in zip(layer._flatten_layers(include_self=True),  # pylint: disable=protected-access
                                original._flatten_layers(include_self=True)):  # pylint: disable=protected-access
            keys[id(mine)] = position[id(theirs)]
    object.__setattr__(clone, "_dtk_layer_keys", keys)
    return clone


# -- schedules --------------------------------------------------------------------------------------
def stage_order(schedule: str, stages: int, microbatches: int, s: int) -> list[tuple[str, int]]:
    """Stage ``s``'s own sequence of ``("F", j)`` and ``("B", j)``."""
    m = microbatches
    if schedule == "gpipe":
        return [("F", j) for j in range(m)] + [("B", j) for j in reversed(range(m))]
    warmup = min(stages - s - 1, m)
    order = [("F", j) for j in range(warmup)]
    f, b = warmup, 0
    while b < m:
        if f < m:
            order.append(("F", f))
            f += 1
        order.append(("B", b))
        b += 1
    return order


def dispatch_order(schedule: str, stages: int, microbatches: int) -> list[tuple[str, int, int]]:
    """One order for a single driver to issue every stage's work: ``(kind, stage, microbatch)``,
    each stage in its own order (``stage_order``), each op after what it needs (a forward after
    the previous stage's forward of the microbatch, a backward after the next stage's backward),
    in ticks of the schedule's timeline (one op per stage a tick)."""
    queues = [stage_order(schedule, stages, microbatches, s) for s in range(stages)]
    done: set[tuple[str, int, int]] = set()
    out = []
    while any(queues):
        ready = []
        for s, queue in enumerate(queues):
            if not queue:
                continue
            kind, j = queue[0]
            need = (("F", s - 1, j) if s else None) if kind == "F" else (
                ("B", s + 1, j) if s < stages - 1 else ("F", s, j))
            if need is None or need in done:
                ready.append((kind, s, j))
        if not ready:
            raise RuntimeError(f"schedule {schedule} deadlocks")  # a bug in dtk, never input
        for op in ready:
            queues[op[1]].pop(0)
            out.append(op)
        done.update(ready)
    return out


def bubble(stages: int, microbatches: int) -> float:
    """The idle share of a pipeline step: ``(S - 1) / (M + S - 1)``."""
    return (stages - 1) / (microbatches + stages - 1)


# -- building ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class Pipeline:
    """A model built in stages: each stage's laid-out model on its sub-mesh."""

    mesh: dtensor.Mesh  # the whole mesh, with the stage axis
    meshes: tuple[dtensor.Mesh, ...]
    models: tuple[tf_keras.Model, ...]
    plans: tuple[Any, ...]  # each stage's dtk.parallel.layouts.LayoutPlan
    units: tuple[tuple[str, ...], ...]  # each stage's units (blocks, top-level layers)
    # What crosses from stage s to s + 1: one example's shape and the dtype.
    crossing: tuple[tuple[tuple[int, ...], str], ...] = ()
    # The whole model, built with lazy variables (no storage): its object graph is what a
    # checkpoint of the stages is saved as (dtk.train.pipeline.PipelineSteps.checkpoint_objects).
    whole: tf_keras.Model | None = None

    def explain(self) -> str:
        """Each stage: its devices, its units and its weights' bytes per device."""
        names = list(self.mesh.dim_names)
        ids = np.moveaxis(np.asarray(self.mesh.global_device_ids()).reshape(
            [self.mesh.dim_size(n) for n in names]), names.index(STAGE_AXIS), 0)
        lines = []
        for s, (mesh, plan, units) in enumerate(zip(self.meshes, self.plans, self.units)):
            nbytes = sum(w.bytes_per_device for w in plan.weights)
            devices = ",".join(str(int(i)) for i in ids[s].reshape(-1))
            lines.append(f"stage {s} on devices {devices} ({mesh_spec(mesh)}): "
                         f"{', '.join(units)}; {len(plan.weights)} weights, "
                         f"{nbytes / 2 ** 10:.1f} KiB per device")
        return "\n".join(lines)


def _rules_unused_by_every_stage(plans: list) -> list:
    """Each stage's plan, where a rule another stage uses is not "unused" (the embedding's rule
    matches nothing on the last stage, the head's nothing on the first): a note, not a
    WARNING. A rule no stage uses stays one."""
    unused = [{r.pattern for r in p.unused_rules} for p in plans]
    nowhere = set.intersection(*unused) if unused else set()
    out = []
    for plan, mine in zip(plans, unused):
        elsewhere = sorted(mine - nowhere)
        notes = tuple(w for w in plan.warnings if not (elsewhere and "match no weight" in w
                                                       and not w.startswith("optional")))
        if elsewhere:
            still = sorted(mine & nowhere)
            notes += ((f"layout table {plan.table.name!r}: rule(s) {still} match no weight of "
                       "any stage",) if still else ()) + (
                f"rule(s) {elsewhere} match weights of other stages",)
        out.append(dataclasses.replace(plan, unused_rules=tuple(
            r for r in plan.unused_rules if r.pattern in nowhere), warnings=notes))
    return out


def build(model_factory: Callable[[], tf_keras.Model], mesh: dtensor.Mesh, table, *, seed: int,
          config: PipelineConfig = PipelineConfig(), allow_replicated: bool = False) -> Pipeline:
    """Builds ``model_factory``'s model in stages over ``mesh``'s stage axis.

    The whole model's plan is checked on one stage's sub-mesh first (the table's errors and
    warnings, once, as without stages). The whole model is built once with lazy variables (no
    storage) to find the stages; each stage is then ``dtk.parallel.layouts.build_model`` of a
    clone of its part, which makes that stage's weights only, on its sub-mesh. Their initial
    values are the whole model's (``seed``): the whole model's initializers run in its build's
    order, one weight at a time, and each stage keeps its own.

    Raises:
      ValueError: a mesh without a stage axis, a model that cannot be cut in as many stages
        (see ``split``), or a bad layout plan.
    """
    from dtk.parallel import layouts, materialize  # pylint: disable=g-import-not-at-top
    meshes = stage_meshes(mesh)
    table = layouts.load_table(table)
    tf_keras.utils.set_random_seed(seed)
    try:
        whole, lazy = materialize.lazy_model(model_factory, None, "float32"), True
    except Exception:  # pylint: disable=broad-except  (it needs real values: a plain build)
        tf_keras.utils.set_random_seed(seed)
        whole, lazy = model_factory(), False
    # The whole model's plan on a stage's sub-mesh, from the build above (no second build):
    # the table's errors and warnings, once, as without stages.
    plan = layouts._plan_model(table, meshes[0], whole, strict=False,  # pylint: disable=protected-access
                               allow_replicated=allow_replicated)
    for warning in plan.warnings:
        _log.warning("layouts: %s", warning)
    parts = split(whole, len(meshes), config.boundaries)
    units, between = cuts(whole)
    crossing = tuple((tuple(int(d) for d in between[b].shape[1:]), between[b].dtype.name)
                     for _, b in parts[:-1])
    names = tuple(tuple(u.name for u in units[a:b + 1]) for a, b in parts)
    weights = layouts.weight_paths(whole)

    def values(paths):
        """The whole model's initial values in its build's order; those in ``paths``."""
        tf_keras.utils.set_random_seed(seed)
        for path, variable in (materialize.creation_order(weights) if lazy else weights):
            with warnings.catch_warnings():  # each stage draws them again: the same values
                warnings.filterwarnings("ignore", "The initializer .* is unseeded")
                value = materialize.initial_value(variable) if lazy else None
            if path in paths:
                yield path, (value if lazy else variable.numpy())

    models, plans = [], []
    for s, sub in enumerate(meshes):
        part = stage_model(whole, parts, s)
        model, plan = layouts.build_model(
            lambda part=part: clone_stage(whole, part), sub, table, seed=seed,
            allow_replicated=True, log_warnings=False, initial_values=values)
        object.__setattr__(model, "_dtk_stage", (s, len(meshes)))
        models.append(model)
        plans.append(plan)
    plans = _rules_unused_by_every_stage(plans)
    return Pipeline(mesh=mesh, meshes=tuple(meshes), models=tuple(models), plans=tuple(plans),
                    units=names, crossing=crossing, whole=whole)
