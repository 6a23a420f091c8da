"""The candidates the planner weighs, and the rule that chooses among them.

Every factorization of the devices into the table's axes, times the updates (the sharded update
or FSDP), remat or not, and the fewest microbatches whose activations fit; with a ``stage`` axis,
the pipeline splits too. ``choose`` takes the fastest that fits (``TIE`` decides near-ties) or
raises ``PlanError`` with the smallest shortfall.
"""

from __future__ import annotations

import dataclasses
import re

from collections.abc import Callable, Sequence
from typing import Any

from dtk.planning.profile import ModelProfile
from dtk.planning.cost import Axes, MachineCalibration, StepCalibration, all_to_all_bytes, candidate_memory, mib, model_axis_ms, predict_ms, sequence_split


UPDATES = ("zero", "fsdp")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
    """One way to run the model, with its memory per device (bytes) and predicted ms per step."""

    mesh: str
    update: str  # "zero" (the sharded update; replicated where batch=1) or "fsdp"
    remat: bool
    microbatches: int
    memory: dict[str, int]
    budget: int | None
    predicted_ms: float | None
    rejected: str | None = None  # why it cannot run at all (the table, the batch)
    # Mixture of experts: the experts' weights and optimizer state per device (part of
    # ``memory``'s weights and optimizer), and the bytes a device sends by all-to-all a step.
    experts_bytes: int = 0
    all_to_all_bytes: int = 0
    # Pipeline stages (a ``stage`` axis, dtk.parallel.pipeline; 1: none): the idle share of a
    # step ``(S - 1) / (M + S - 1)`` and the bytes a step moves across the stage boundaries
    # (activations forward, their gradients back). ``memory`` is the largest stage's.
    stages: int = 1
    bubble: float = 0.0
    boundary_bytes: int = 0

    @property
    def fits(self) -> bool:
        return self.rejected is None and (self.budget is None or self.memory["total"] <= self.budget)

    @property
    def label(self) -> str:
        parts = [self.mesh, self.update]
        if self.remat:
            parts.append("remat")
        if self.stages > 1:
            parts.append(f"1f1b microbatches={self.microbatches}")
        elif self.microbatches > 1:
            parts.append(f"microbatches={self.microbatches}")
        return " ".join(parts)

    @property
    def config(self) -> dict[str, Any]:
        """What the Trainer and the scripts take: mesh, fsdp, remat, grad accumulation."""
        return {"mesh": self.mesh, "fsdp": self.update == "fsdp", "remat": self.remat,
                "gradient_accumulation_steps": self.microbatches, "stages": self.stages}


class PlanError(ValueError):
    """No candidate fits: the message has the smallest shortfall and what would make it fit."""


def factorizations(devices: int, axes: Sequence[str]) -> list[dict[str, int]]:
    """Every way to write ``devices`` as a product over ``axes`` (``batch`` first)."""
    if len(axes) == 1:
        return [{axes[0]: devices}]
    out = []
    for n in range(devices, 0, -1):
        if devices % n == 0:
            out += [{axes[0]: n, **rest} for rest in factorizations(devices // n, axes[1:])]
    return out


def enumerate_candidates(profile: ModelProfile, table, *, devices: int, global_batch_size: int,
                         budget_bytes: int | None, machine: MachineCalibration | None,
                         step: StepCalibration | None, remat_patterns: Sequence[str] = (),
                         optimizer_slots: int = 2) -> list[Candidate]:
    """Every candidate with its memory and (given the calibrations) its predicted time."""
    from dtk.parallel import layouts  # pylint: disable=g-import-not-at-top
    # The sequence axis is a candidate where the model marks its sequence (sequence layers).
    seq = table.sequence_axis if profile.sequence_length else None
    axes = ["batch"] + [a for a in table.axes
                        if a != "batch" and (a != table.sequence_axis or seq)]
    out = []
    for sizes in factorizations(devices, axes):
        mesh = ",".join(f"{a}={n}" for a, n in sizes.items()
                        if a == "batch" or n > 1 or a not in table.optional_axes)
        b = sizes["batch"]
        for update in UPDATES:
            for remat in ((False, True) if remat_patterns else (False,)):
                base = {"mesh": mesh, "update": update, "remat": remat, "budget": budget_bytes}
                if update == "fsdp" and b == 1:
                    continue  # nothing to shard over: the same as "zero"
                if global_batch_size % b:
                    out.append(Candidate(**base, microbatches=1, memory={"total": 0},
                                         predicted_ms=None, rejected=(
                        f"global batch {global_batch_size} is not divisible by batch={b}")))
                    continue
                why = None
                if seq and sizes.get(seq, 1) > 1:
                    why = (f"sequence length {profile.sequence_length} is not divisible by "
                           f"{seq}={sizes[seq]}" if profile.sequence_length % sizes[seq] else
                           "FSDP with a sharded sequence fails inside DTensor"
                           if update == "fsdp" else None)
                split = sequence_split(profile, table, sizes, fsdp=update == "fsdp")
                if why is None and split and profile.sequence_length % split[1]:
                    # Megatron's sequence parallelism shards it over the tensor-parallel axis
                    # (dtk.parallel.sequence), which the model then refuses (issue 59)
                    why = (f"sequence length {profile.sequence_length} is not divisible by "
                           f"{split[0]}={split[1]}, which shards the sequence (sequence "
                           "parallelism)")
                if why:
                    out.append(Candidate(**base, microbatches=1, memory={"total": 0},
                                         predicted_ms=None, rejected=why))
                    continue
                try:
                    plan = layouts.plan_weights(
                        table, Axes(sizes), profile.weights,
                        fsdp_paths=[p for p, _, _ in profile.weights] if update == "fsdp" else ())
                except ValueError as e:
                    out.append(Candidate(**base, microbatches=1, memory={"total": 0},
                                         predicted_ms=None, rejected=str(e).split(";")[0]))
                    continue
                per_device = global_batch_size // b
                patterns = remat_patterns if remat else ()
                chosen = None
                for k in [k for k in range(1, per_device + 1) if per_device % k == 0]:
                    memory = candidate_memory(profile, plan, update=update, remat=patterns,
                                              rows_per_device=per_device // k,
                                              optimizer_slots=optimizer_slots)
                    chosen = (k, memory)
                    if budget_bytes is None or memory["total"] <= budget_bytes:
                        break
                k, memory = chosen
                predicted = None if machine is None or step is None else predict_ms(
                    profile, plan, machine, step, global_batch_size=global_batch_size,
                    update=update, remat=remat, microbatches=k, remat_patterns=patterns)
                experts = {p for _, _, _, paths in profile.experts for p in paths}
                experts_bytes = layouts.memory_per_device(
                    dataclasses.replace(plan, weights=tuple(
                        w for w in plan.weights if w.path in experts)),
                    optimizer_slots=optimizer_slots,
                    shard_optimizer_state=update == "zero" and b > 1)["total"] if experts else 0
                out.append(Candidate(**base, microbatches=k, memory=memory,
                                     predicted_ms=predicted, experts_bytes=experts_bytes,
                                     all_to_all_bytes=all_to_all_bytes(
                                         profile, plan, per_device // k, k)))
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageSplit:
    """A model cut into stages (``dtk.parallel.pipeline.split``): each stage's top-level layer
    names, and the elements and itemsize of one example's tensor crossing each boundary."""

    layers: tuple[frozenset[str], ...]
    crossing: tuple[tuple[int, int], ...]


def stage_splits(model_factory: Callable[[], Any], input_shape, input_dtype, devices: int
                 ) -> dict[int, StageSplit]:
    """Each stage count a pipeline of ``devices`` can have (a divisor of it, 2 or more, up to
    the model's units), balanced as ``dtk.parallel.pipeline.build`` balances them; {} for a model
    without boundaries (a subclassed model)."""
    from dtk.parallel import materialize, pipeline  # pylint: disable=g-import-not-at-top
    shape = None if isinstance(input_shape, dict) else input_shape
    try:
        model = materialize.lazy_model(model_factory, shape, input_dtype if isinstance(
            input_dtype, str) else "float32")
        units, between = pipeline.cuts(model)
    except Exception:  # pylint: disable=broad-except  (no graph to cut: no pipeline candidate)
        return {}
    out = {}
    for stages in range(2, min(devices, len(units)) + 1):
        if devices % stages:
            continue
        try:
            parts = pipeline.split(model, stages)
        except ValueError:
            continue
        names = tuple(frozenset(layer.name for layer in pipeline.stage_model(
            model, parts, s).layers) for s in range(stages))
        crossing = tuple((int(between[b].shape[1:].num_elements()), between[b].dtype.size)
                         for _, b in parts[:-1])
        out[stages] = StageSplit(layers=names, crossing=crossing)
    return out


def _stage_profile(profile: ModelProfile, layers: frozenset[str]) -> ModelProfile:
    """The part of ``profile`` a stage of these top-level layers holds."""
    return dataclasses.replace(
        profile, weights=tuple(w for w in profile.weights if w[0].split(".")[0] in layers),
        layers=tuple(l for l in profile.layers if l.name.split("/")[0] in layers),
        attention=tuple(a for a in profile.attention if a[0].split("/")[0] in layers),
        experts=())


def pipeline_candidates(profile: ModelProfile, table, splits: dict[int, StageSplit], *,
                        devices: int, global_batch_size: int, budget_bytes: int | None,
                        machine: MachineCalibration | None, step: StepCalibration | None,
                        optimizer_slots: int = 2) -> list[Candidate]:
    """Every pipeline candidate: a stage count, the other axes over each stage's devices, and
    the microbatches (1F1B, dtk's default schedule) predicted fastest among those that fit.

    Memory is the largest stage's: its weights and optimizer state (not sharded within a stage),
    gradients, one microbatch's activations over its layers and, as 1F1B holds them, the inputs
    of up to ``S - s`` microbatches in flight on stage s. Time (the cost model's step on
    ``batch=D``, which runs the same work over the same devices):

        step = (a + e * B) * (M + S - 1) / M          the bubble
             + (M - 1) x the microbatch's own cost
             + M x each stage's model-axis collectives
             + 2 (S - 1) M boundary transfers, each priced as a gather of what a device holds

    The formula's bubble assumes the stages run at once, as on a GPU host; on a CPU host whose
    cores run every virtual device, they run one after another (BUILD.md, "Pipeline
    parallelism")."""
    from dtk.parallel import layouts  # pylint: disable=g-import-not-at-top
    axes = ["batch"] + [a for a in table.axes if a not in ("batch", table.sequence_axis)]
    out = []
    for stages, split in sorted(splits.items()):
        parts = [_stage_profile(profile, names) for names in split.layers]
        for sizes in factorizations(devices // stages, axes):
            mesh = ",".join([f"stage={stages}"] + [
                f"{a}={n}" for a, n in sizes.items()
                if a == "batch" or n > 1 or a not in table.optional_axes])
            base = {"mesh": mesh, "update": "replicated", "remat": False, "budget": budget_bytes,
                    "stages": stages}
            b = sizes["batch"]
            if global_batch_size % b:
                out.append(Candidate(**base, microbatches=1, memory={"total": 0},
                                     predicted_ms=None, rejected=(
                    f"global batch {global_batch_size} is not divisible by batch={b}")))
                continue
            try:
                plans = [layouts.plan_weights(table, Axes(sizes), part.weights)
                         for part in parts]
            except ValueError as e:
                out.append(Candidate(**base, microbatches=1, memory={"total": 0},
                                     predicted_ms=None, rejected=str(e).split(";")[0]))
                continue
            per_device = global_batch_size // b
            options = []
            for m in [m for m in range(1, per_device + 1) if per_device % m == 0]:
                rows = per_device // m
                memories = []
                for s, (part, plan) in enumerate(zip(parts, plans)):
                    memory = candidate_memory(part, plan, update="replicated", remat=(),
                                              rows_per_device=rows,
                                              optimizer_slots=optimizer_slots)
                    if s:  # the inputs 1F1B holds: up to S - s microbatches in flight
                        elements, itemsize = split.crossing[s - 1]
                        memory["activations"] += min(m, stages - s) * rows * elements * itemsize
                        memory["total"] = sum(v for k, v in memory.items() if k != "total")
                    memories.append(memory)
                memory = max(memories, key=lambda mem: mem["total"])
                moved = sum(2 * global_batch_size * e * i for e, i in split.crossing)
                predicted = None
                if machine is not None and step is not None:
                    predicted = ((step.a_ms + step.e_ms * global_batch_size)
                                 * (m + stages - 1) / m + (m - 1) * step.microbatch_ms)
                    predicted += m * sum(model_axis_ms(part, plan, machine, rows)
                                         for part, plan in zip(parts, plans))
                    predicted += 2 * m * sum(machine.gather_ms(b, rows * e * i)
                                             for e, i in split.crossing)
                options.append(Candidate(**base, microbatches=m, memory=memory,
                                         predicted_ms=predicted,
                                         bubble=(stages - 1) / (m + stages - 1),
                                         boundary_bytes=moved))
            fitting = [c for c in options if c.fits] or options[-1:]
            out.append(min(fitting, key=lambda c: (c.predicted_ms or 0.0, -c.microbatches)))
    return out


# Candidates that fit and are predicted within this factor of the fastest are a tie: the cost
# model is not finer than that. A tie goes to the one that is simpler to run.
TIE = 1.01


TIE_RULE = (f"the fastest candidate that fits; those within {TIE - 1:.0%} of it are a tie, which "
            "goes to the sharded update (not FSDP), then no remat, then one stage, then less "
            "memory")


def _tie_key(c: Candidate) -> tuple:
    return (c.update == "fsdp", c.remat, c.stages > 1, c.memory["total"])


def choose(candidates: Sequence[Candidate]) -> Candidate:
    """The chosen candidate, by ``TIE_RULE``; ``PlanError`` when none fits."""
    feasible = [c for c in candidates if c.fits]
    if feasible:
        fastest = min(c.predicted_ms or 0.0 for c in feasible)
        near = [c for c in feasible if (c.predicted_ms or 0.0) <= fastest * TIE]
        return min(near, key=_tie_key)
    runnable = [c for c in candidates if c.rejected is None]
    if not runnable:
        reasons = list(dict.fromkeys(c.rejected for c in candidates))  # each reason once
        split = [re.fullmatch(r"global batch (\d+) is not divisible by batch=(\d+)", r)
                 for r in reasons]
        if all(split):  # every mesh of these devices: one fix, said once
            batch = int(split[0].group(1))
            sizes = sorted({int(m.group(2)) for m in split})
            raise PlanError(
                f"no candidate can run: every mesh of these devices splits the global batch "
                f"{batch} over a batch axis of {' or '.join(map(str, sizes))}, which does not "
                f"divide it; use a global_batch_size (--global_batch_size) that "
                f"{sizes[0]} divides (e.g. {batch + sizes[0] - batch % sizes[0]}), or a device "
                f"count that divides {batch} (--virtual_devices, DTK_VIRTUAL_DEVICES)")
        first = {}  # the first candidate of each reason
        for c in candidates:
            first.setdefault(c.rejected, c)
        raise PlanError("no candidate can run: " + "; ".join(
            f"{c.label}: {reason}" for reason, c in list(first.items())[:4]))
    best = min(runnable, key=lambda c: c.memory["total"])
    memory, budget = best.memory, best.budget
    parts = " + ".join(f"{k} {mib(v)}" for k, v in memory.items() if k != "total" and v)
    raise PlanError(
        f"no plan fits the device memory budget of {mib(budget)} per device: the smallest is "
        f"{best.label} with {parts} = {mib(memory['total'])}, {mib(memory['total'] - budget)} "
        f"over. To fit: more devices (its weights and state divide by the device count), a "
        f"smaller global batch (activations are {mib(memory['activations'])} of it), remat"
        f"{'' if best.remat else ' (not possible: the model names no blocks)'}, or a budget of "
        f"at least {mib(memory['total'])}")
