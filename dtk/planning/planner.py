"""The plan chosen for the user: mesh, update, remat and microbatches from a memory budget.

``plan(model_factory, devices=8, global_batch_size=32, device_memory_gb=...)`` considers every
candidate: each factorization of the device count into the layout table's axes (``batch`` x
``model``), times the memory options (the sharded "ZeRO" update or FSDP, remat of the model's
blocks or not), each with the fewest microbatches whose activations fit. For each it gives

- **memory per device, from the layout plan** (``dtk.parallel.layouts.plan_weights`` on that mesh, so a
  table that cannot shard a weight on it drops the candidate with the table's own error):
  weights and optimizer state as stored, gradients in the compute layout, the weights FSDP
  gathers, and activations. Activations are the one estimate: the sum of every leaf layer's
  output for one example (measured by one call on one example), plus twice the largest of them
  (the backward pass's gradients of that output and of its input, live at its peak), times the
  rows a device holds at once, divided by the model axis for layers whose kernels the table
  shards on their output dim, and by the sequence axis where the model shards its sequence.
  Remat keeps a block's input and recomputes the rest, so only the largest block's internals
  are live at once.
- **predicted ms per step, from a cost model calibrated on this machine**:

      step = (a + e * B) * (1 + remat_share if remat)    the model's step on batch=D, measured
           + k x model-axis collectives                 row-parallel outputs (forward all-reduce),
             (each alpha_m + bytes / beta_m)             column-parallel inputs (backward
                                                          all-reduce), sharded features (gather)
           + FSDP: its own cost on batch=D and each more microbatch's regather (both
                   measured on batch=D, scaled by the bytes gathered), and 2 more gathers per
                   weight and microbatch on a 2-D mesh
           + (k - 1) x (the microbatch's own cost + its gradient reduction on this mesh)

  ``a`` (per-call overhead) and ``e`` (compute per example) come from timing the model's own
  step on ``batch=D`` at the rows that fit and at half of them; ``remat_share``, the microbatch
  cost and FSDP's cost and regather from the same step with remat, with FSDP, and with 2
  microbatches (with and without FSDP); ``alpha`` and ``beta`` per axis size from timed gathers at two sizes. Each
  variant is timed alternating with the plain step (``paired_ms``). The machine's figures are
  cached in a JSON file keyed by device kind and count (``$DTK_PLAN_CACHE``, default
  ``~/.cache/dtk/plan.json``), the model's by a signature of its weights, table, batch, loss,
  optimizer and remat patterns, so a later run measures nothing.

The fastest candidate that fits is chosen; ``explain_plan`` prints every candidate with its
memory, its prediction and why it was not chosen. When none fits, ``PlanError`` (a ValueError)
gives the smallest shortfall and what would make it fit. Every client computes the same plan
from the same measurements: in a multi-client run client 0 decides whether to measure
(``_cached``) and its figures are used everywhere (``_agree``), as for
``steps_per_execution="auto"``.

The planner is four modules and this entry point, one concern each: ``profile`` (the model's
one-example profile), ``cost`` (memory and predicted time of a candidate), ``candidates`` (what
is weighed, and ``choose``), ``calibration`` (what is measured, and the cache), ``explain`` (the
table and the chart). ``plan`` here runs them in that order.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

from dtk.planning.calibration import (agree, alternating_ms, cache_path, calibrate_machine,
                                      calibrate_step, calibration_candidate, paired_ms)
from dtk.planning.candidates import (TIE, TIE_RULE, Candidate, PlanError, choose,
                                     enumerate_candidates, factorizations, pipeline_candidates,
                                     stage_splits)
from dtk.planning.cost import (MIB, Axes, MachineCalibration, StepCalibration, candidate_memory,
                               mib, predict_ms)
from dtk.planning.explain import Plan, explain_plan, plot_plan
from dtk.planning.profile import LayerProfile, ModelProfile, profile_model

# The names callers know the planner by, wherever they now live.
__all__ = ["Axes", "Candidate", "LayerProfile", "MIB", "MachineCalibration", "ModelProfile", "Plan",
           "PlanError", "StepCalibration", "TIE", "TIE_RULE", "alternating_ms", "cache_path",
           "calibrate_machine", "calibrate_step", "calibration_candidate", "candidate_memory",
           "choose", "enumerate_candidates", "explain_plan", "factorizations", "paired_ms",
           "pipeline_candidates", "plan", "plot_plan", "predict_ms", "profile_model",
           "stage_splits"]

_log = logging.getLogger("dtk")


def plan(model_factory: Callable[[], Any], *, devices: int | None = None,
         global_batch_size: int, device_memory_gb: float | None = None, table=None,
         input_shape: Sequence[int] | None = None, input_dtype: str | None = None,
         num_classes: int | None = None,
         loss: Any = None, optimizer: Any = "adamw",
         remat_patterns: Sequence[str] = (), device_type: str = "auto",
         cache: str | None = None, refresh: bool = False,
         machine: MachineCalibration | None = None,
         step: StepCalibration | None = None, pipeline: bool = False) -> Plan:
    """Chooses the mesh, update, remat and microbatches for ``model_factory`` (module docstring).

    Args:
      model_factory: builds the plain tf_keras model.
      devices: devices in the mesh (default: every device of ``device_type`` on every client).
      global_batch_size: examples per step, over all devices.
      device_memory_gb: memory per device for weights, state, gradients and activations
        (None: no limit; the fastest candidate wins).
      table: the layout table (name, path or LayoutTable).
      input_shape, input_dtype, num_classes: one example's input and the label range; the
        timed steps train on random data of that shape (integer inputs, token ids, are drawn
        from the label range too). Default: the model's input spec and the last dim of its
        output.
      loss, optimizer: what the timed steps train with (loss default: binary cross-entropy for
        a model with one output, a click model's logit; else sparse categorical).
      remat_patterns: the model's blocks, as for ``TrainerConfig(remat=...)``; without them remat
        is not a candidate.
      device_type: as for ``build_mesh``.
      cache: the calibration cache file; refresh: measure again even if cached.
      machine, step: calibrations to use instead of measuring (tests, benchmarks).
      pipeline: consider pipeline stages too (a ``stage`` axis: ``pipeline_candidates``), for a
        caller that runs them (``train_lm.py``).

    Raises:
      PlanError: no candidate fits, with the smallest shortfall and the fix.
      ValueError: bad arguments, named.
    """
    from dtk.cluster import env as cluster_lib  # pylint: disable=g-import-not-at-top
    from dtk.parallel import layouts, mesh as mesh_lib  # pylint: disable=g-import-not-at-top
    if not callable(model_factory):
        raise TypeError(f"model_factory must be a function that builds the tf_keras model (e.g. "
                        f"dtk.models.mnist_mlp); got {type(model_factory).__name__} "
                        f"{model_factory!r}. For a model by name, use dtk.models.MODEL_SPECS"
                        "[name].factory")
    if not isinstance(global_batch_size, int) or isinstance(global_batch_size, bool) or \
            global_batch_size < 1:
        raise ValueError(f"global_batch_size must be a positive integer; got {global_batch_size!r}")
    if devices is not None and (not isinstance(devices, int) or isinstance(devices, bool)
                                or devices < 1):
        raise ValueError(f"devices must be a positive integer (the mesh's device count); got "
                         f"{devices!r}")
    if device_memory_gb is not None and (
            isinstance(device_memory_gb, bool) or not isinstance(device_memory_gb, (int, float))
            or not 0 < device_memory_gb < float("inf")):
        raise ValueError(f"device_memory_gb must be a positive number of GiB (e.g. 0.5); got "
                         f"{device_memory_gb!r}")
    if isinstance(remat_patterns, str):
        raise ValueError(f"remat_patterns must be a list of layer-name patterns, e.g. "
                         f"[{remat_patterns!r}]; got the string {remat_patterns!r} (a string would "
                         "be read letter by letter)")
    for pattern in remat_patterns:
        try:
            re.compile(pattern)
        except (re.error, TypeError) as e:
            raise ValueError(f"remat_patterns: {pattern!r} is not a regular expression: {e}") \
                from None
    for shape in (input_shape.values() if isinstance(input_shape, dict) else [input_shape]):
        if shape is not None and (isinstance(shape, (str, bytes)) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)):
            raise ValueError(
                f"input_shape must be one example's shape as positive integers, without the batch "
                f"dim (e.g. (28, 28, 1)), or a dict of them by input name; got {input_shape!r}")
    table = layouts.load_table(table or "data_parallel")
    kind = mesh_lib.resolve_device_type(device_type)
    if devices is not None and kind == "CPU" and not mesh_lib.is_tensorflow_initialized() \
            and not cluster_lib.is_multi_client():
        # A CPU-only process: ``devices`` virtual CPUs, as the README's dtk.plan(..., devices=8).
        mesh_lib.configure_virtual_cpus(devices)
    if devices is None:  # every device of every client (initializes TensorFlow's devices)
        devices = mesh_lib.build_mesh("batch=-1", device_type=kind).size
    budget = None if device_memory_gb is None else int(device_memory_gb * 1024 * MIB)
    profile = profile_model(model_factory, input_shape, input_dtype=input_dtype)
    input_shape, input_dtype = profile.input_shape, profile.input_dtype
    num_classes = num_classes or profile.outputs
    if loss is None:
        loss = "binary_crossentropy" if profile.outputs == 1 else "sparse_categorical_crossentropy"
    names = {part for layer in profile.layers for part in layer.name.split("/")}
    for pattern in remat_patterns:
        if not any(re.fullmatch(pattern, name) for name in names):
            raise ValueError(
                f"remat_patterns: {pattern!r} matches no layer of the model (layers: "
                f"{sorted(names)[:8]}...); name the model's blocks, as for TrainerConfig(remat=...)")
    common = {"devices": devices, "global_batch_size": global_batch_size,
              "budget_bytes": budget, "remat_patterns": remat_patterns}
    splits = stage_splits(model_factory, input_shape, input_dtype, devices) if pipeline else {}

    def every(machine, step):
        return enumerate_candidates(profile, table, machine=machine, step=step, **common) + \
            pipeline_candidates(profile, table, splits, devices=devices,
                                global_batch_size=global_batch_size, budget_bytes=budget,
                                machine=machine, step=step)
    if machine is None or step is None:
        # Memory first: a budget nothing fits is an error before anything is measured, and
        # the model's step is timed at the rows that fit on batch=D.
        untimed = every(None, None)
        choose(untimed)
        untimed = [c for c in untimed if c.stages == 1]
        data_parallel = [c for c in untimed if c.rejected is None and not c.remat
                         and c.mesh.split(",")[0] == f"batch={devices}"]
        fitting = [c for c in data_parallel if c.fits] or data_parallel
        rows = global_batch_size // min((c.microbatches for c in fitting), default=1)
        # A model whose replicated step does not fit is timed on a candidate that does.
        on = calibration_candidate(untimed, devices) if budget is not None else None
        if on is not None:
            rows = global_batch_size
        if machine is None:
            machine = calibrate_machine(kind, devices, cache=cache, refresh=refresh)
        if step is None:
            step = calibrate_step(model_factory, profile=profile, table=table, machine=machine,
                                  device_type=kind,
                                  devices=devices, batch=max(rows, devices),
                                  input_shape=input_shape, input_dtype=input_dtype, loss=loss,
                                  optimizer=optimizer, remat_patterns=remat_patterns,
                                  num_classes=num_classes, cache=cache, refresh=refresh,
                                  on=on)
    machine, step = agree(machine, step)
    candidates = every(machine, step)
    chosen = choose(candidates)
    _log.debug("plan: %s, predicted %.1f ms/step, %s per device", chosen.label,
               chosen.predicted_ms or 0.0, mib(chosen.memory["total"]))
    return Plan(chosen=chosen, candidates=tuple(candidates), machine=machine, step=step,
                global_batch_size=global_batch_size, table=table.name)
