"""What the planner measures on this machine, and the cache that keeps it.

``calibrate_machine`` times gathers per axis size; ``calibrate_step`` times the model's own step
on ``batch=D`` and its variants (remat, FSDP, microbatches), each alternating with the plain step
(``paired_ms``). Both are cached in a JSON file (``cache_path``) and, across clients, client 0's
figures are everyone's (``agree``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from dtk import _env
from dtk.planning.profile import ModelProfile, build_dtype, build_shape
from dtk.planning.cost import Axes, MIB, MachineCalibration, StepCalibration, dtype_bytes, predict_ms
from dtk.planning.candidates import Candidate

_log = logging.getLogger("dtk")
# What the planner is measuring, while it measures (a minute or more before its first answer):
# its own level, so that quieting the timed builds' notes (``_log``) leaves it shown.
_progress = logging.getLogger("dtk.planning.progress")
_progress.setLevel(logging.INFO)


# Coordination-service keys are written once: each post gets the next number (every client
# plans in the same order, so the numbers agree).
_POSTS = itertools.count()


def cache_path() -> str:
    return _env.get_str(_env.PLAN_CACHE) or os.path.join(
        os.path.expanduser("~"), ".cache", "dtk", "plan.json")


def _load_cache(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _cached(path: str, key: str, refresh: bool) -> dict | None:
    """The cached entry, or None: measure. In a multi-client run, client 0's answer for every
    client: the measurements run collectives, so all clients measure or none does."""
    from dtk.cluster import env as cluster  # pylint: disable=g-import-not-at-top
    value = None if refresh else _load_cache(path).get(key)
    if not cluster.is_multi_client():
        return value
    from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
    ctx = context.context()
    name = f"dtk/plan/cached/{hashlib.sha256(key.encode()).hexdigest()[:16]}/{next(_POSTS)}"
    if cluster.is_lead_client():
        ctx.set_config_key_value(name, json.dumps(value))
        return value
    return json.loads(ctx.get_config_key_value(name, timeout_in_ms=600_000))


def _store_cache(path: str, key: str, value: dict) -> None:
    """Adds ``key`` to the cache file, atomically; never over a file that is not dtk's cache
    (``_env.check_all`` refuses that before any work; a library call is told here)."""
    data = _load_cache(path)
    if os.path.isdir(path) or (os.path.isfile(path) and os.path.getsize(path) and not data) or \
            not all(k.startswith(_env.PLAN_CACHE_KEY_PREFIXES) for k in data):
        _log.warning("plan: %s is not dtk's plan cache (a directory or another file); the "
                     "calibration is not cached there, and the file is left as it is", path)
        return
    data[key] = value
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:  # a read-only home: measure again next time
        _log.info("plan: could not cache the calibration in %s (%s)", path, e)
        try:
            os.remove(tmp)
        except OSError:
            pass


def calibrate_machine(device_type: str, devices: int, *, cache: str | None = None,
                      refresh: bool = False) -> MachineCalibration:
    """Times gathers over each axis size that divides ``devices`` (cached, see the module doc)."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from tensorflow.experimental import dtensor  # pylint: disable=g-import-not-at-top
    from dtk.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
    path = cache or cache_path()
    key = f"machine/{device_type}:{devices}"
    cached = _cached(path, key, refresh)
    if cached:
        return MachineCalibration(device_kind=device_type, devices=devices,
                                  gather={int(k): tuple(v) for k, v in cached["gather"].items()})
    gather = {}
    small, large = 4 * 1024, 4 * MIB  # bytes per device after the gather
    sizes = [n for n in range(2, devices + 1) if devices % n == 0]
    for i, size in enumerate(sizes):
        _progress.info("plan: timing gathers over an axis of %d devices (%d of %d axis sizes; "
                       "cached for the next run)", size, i + 1, len(sizes))
        mesh = mesh_lib.build_mesh(f"batch={devices // size},model={size}", device_type=device_type)
        points = []
        for nbytes in (small, large):
            rows = devices // size * 8
            width = max(size, nbytes // 4 // 8 // size * size)
            x = dtensor.call_with_layout(tf.ones, dtensor.Layout(["batch", "model"], mesh),
                                         [rows, width])
            target = dtensor.Layout(["batch", dtensor.UNSHARDED], mesh)

            @tf.function
            def gathered(x, target=target):
                return tf.reduce_sum(dtensor.relayout(x, target))

            @tf.function
            def local(x):
                return tf.reduce_sum(x)

            with_gather, without = alternating_ms([lambda: float(gathered(x)),
                                                   lambda: float(local(x))])
            ms = with_gather - without
            points.append((8 * width * 4, max(ms, 0.0)))
        (b0, t0), (b1, t1) = points
        per_mib = max((t1 - t0) / ((b1 - b0) / MIB), 0.0)
        gather[size] = (max(t0, 0.0), per_mib)
    _store_cache(path, key, {"gather": {str(k): list(v) for k, v in gather.items()}})
    return MachineCalibration(device_kind=device_type, devices=devices, gather=gather)


def calibrate_step(model_factory, *, profile: ModelProfile, table, machine: MachineCalibration,
                   device_type: str, devices: int, batch: int, input_shape: Sequence[int], input_dtype: str,
                   loss: Any, optimizer: Any, remat_patterns: Sequence[str], num_classes: int,
                   cache: str | None = None, refresh: bool = False,
                   on: Candidate | None = None) -> StepCalibration:
    """Times the model's own step on ``batch=D`` at ``batch`` rows and at half of them (and at
    ``batch`` with remat), the steps alternating call by call so that noise hits them alike.

    ``batch`` is the global batch, or the microbatch that fits the budget on ``batch=D``: the
    prediction for the likeliest plans is then a measurement, not an extrapolation.

    ``on``: a candidate that fits the budget, for a model whose replicated step on ``batch=D``
    does not (``_calibrate_on``): the step is timed there instead, one build at a time, so the
    calibration never holds more than that candidate's memory per device.
    """
    import numpy as np  # pylint: disable=g-import-not-at-top
    from dtk.parallel import layouts, mesh as mesh_lib  # pylint: disable=g-import-not-at-top
    from dtk.train import steps  # pylint: disable=g-import-not-at-top
    path = cache or cache_path()
    # ("keras-step": timed on Keras's compiled step; a "step/" entry timed dtk's own, before 0.3)
    key = (f"keras-step/{device_type}:{devices}/{profile.signature}/{table.name}/{batch}/"
           f"{json.dumps([str(loss), str(optimizer), list(remat_patterns)])}"
           f"{'/on ' + on.label if on is not None else ''}")
    cached = _cached(path, key, refresh)
    if cached:
        return StepCalibration(**{k: tuple(v) if isinstance(v, list) else v
                                  for k, v in cached.items()})
    if on is not None:
        result = _calibrate_on(on, model_factory=model_factory, profile=profile, table=table,
                               machine=machine, device_type=device_type, batch=batch,
                               input_shape=input_shape, input_dtype=input_dtype, loss=loss,
                               optimizer=optimizer, remat_patterns=remat_patterns,
                               num_classes=num_classes)
        _store_cache(path, key, dataclasses.asdict(result))
        return result
    mesh = mesh_lib.build_mesh(",".join(f"{a}={devices if a == 'batch' else 1}" for a in
                                        ["batch"] + [a for a in table.axes
                                                     if a not in ("batch", table.sequence_axis)]),
                               device_type=device_type)
    half = max(devices, batch // 2 // devices * devices)
    if half == batch:
        batch = 2 * half
    rng = np.random.default_rng(0)

    built = [0]

    def step_fn(rows: int, remat: Sequence[str] = (), k: int = 1, fsdp: bool = False):
        built[0] += 1
        _progress.info("plan: timing the model's step, variant %d of %d: %d rows%s%s%s on "
                       "batch=%d", built[0], len(variants) + 1, rows, ", remat" if remat else "",
                       f", {k} microbatches" if k > 1 else "", ", fsdp" if fsdp else "",
                       devices)
        model, _ = layouts.build_model(model_factory, mesh, table, seed=0,
                                       input_shape=build_shape(input_shape),
                                       input_dtype=build_dtype(input_dtype),
                                       allow_replicated=True, fsdp=fsdp)
        step = steps.Steps(model, loss=loss, optimizer=optimizer, mesh=mesh,
                           config=steps.StepConfig(remat=tuple(remat),
                                                   gradient_accumulation_steps=k))
        packed = _random_batch(rng, mesh, rows, input_shape, input_dtype, num_classes,
                               model.output_shape)
        return lambda: float(step.train(packed, reset_metrics=False))

    variants = {"half": lambda: step_fn(half)}
    if remat_patterns:
        variants["remat"] = lambda: step_fn(batch, remat_patterns)
    if (batch // devices) % 2 == 0:  # microbatches are possible
        variants["k2"] = lambda: step_fn(batch, k=2)
        variants["fsdp_k2"] = lambda: step_fn(batch, k=2, fsdp=True)
    if devices > 1:
        variants["fsdp"] = lambda: step_fn(batch, fsdp=True)
    # The timed builds' notes (FSDP's replicated weights, random layers) are the real run's to
    # give, once: quiet here.
    level = _log.level
    _log.setLevel(logging.ERROR)
    try:
        measured = {"plain": 0.0, **paired_ms(step_fn(batch), variants)}
    finally:
        _log.setLevel(level)
    measured["plain"] = measured.pop("anchor")
    e = max((measured["plain"] - measured["half"]) / (batch - half), 0.0)
    a = max(measured["plain"] - e * batch, 0.0)
    share = max(measured["remat"] / measured["plain"] - 1, 0.0) if "remat" in measured else 0.0
    micro = fsdp_micro = 0.0
    fsdp = max(measured["fsdp"] - measured["plain"], 0.0) if "fsdp" in measured else 0.0
    if "k2" in measured:
        grads = sum(math.prod(shape) * dtype_bytes(dtype) for _, shape, dtype in profile.weights)
        micro = max(measured["k2"] - measured["plain"] - 2 * machine.gather_ms(devices, grads),
                    0.0)
        fsdp_micro = max(measured["fsdp_k2"] - measured["k2"] - fsdp, 0.0)
    result = StepCalibration(a_ms=a, e_ms=e, remat_share=share, microbatch_ms=micro,
                             fsdp_microbatch_ms=fsdp_micro, fsdp_ms=fsdp, batch_sizes=(batch, half),
                             measured_ms=tuple(measured.values()))
    _store_cache(path, key, dataclasses.asdict(result))
    return result


# What a remat candidate's step costs more than the same step without remat, when only the
# remat step fits the budget and so cannot be compared: the forward pass again, about a third
# of a step (forward + backward, the backward about twice the forward).
ASSUMED_REMAT_SHARE = 1 / 3


def _calibrate_on(on: Candidate, *, model_factory, profile: ModelProfile, table,
                  machine: MachineCalibration, device_type: str, batch: int,
                  input_shape: Sequence[int], input_dtype: str, loss: Any, optimizer: Any,
                  remat_patterns: Sequence[str], num_classes: int) -> StepCalibration:
    """The cost model's figures from the step of candidate ``on`` (one that fits the budget),
    for a model whose replicated step on ``batch=D`` does not fit.

    The candidate's step is timed at half and a quarter of ``batch`` rows (where the mesh and the
    microbatches divide them), on one build of the model, dropped afterwards (never more than
    the candidate's memory per device). The cost
    model's collectives for that candidate (``predict_ms`` with no compute) are subtracted, and
    what is left is the compute ``a + e * B`` that every candidate shares. Not measured there:
    the share remat adds when ``on`` uses remat (``ASSUMED_REMAT_SHARE``), and a microbatch's
    own cost (in ``a`` and ``e`` when ``on`` has microbatches); ``explain_plan`` says so.
    """
    import gc  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    from dtk.parallel import layouts, materialize, mesh as mesh_lib  # pylint: disable=g-import-not-at-top
    from dtk.train import steps  # pylint: disable=g-import-not-at-top
    mesh = mesh_lib.build_mesh(on.mesh, device_type=device_type)
    sizes = {name: mesh.dim_size(name) for name in mesh.dim_names}
    b, k = sizes.get("batch", 1), on.microbatches
    unit = b * k
    # Half and a quarter of the batch where the mesh and the microbatches divide them: less
    # activation memory and shorter steps than the whole batch (the cost is linear in it).
    smaller = [rows for rows in (batch // 2, batch // 4) if rows >= unit and rows % unit == 0]
    batches = tuple(smaller) if len(smaller) == 2 else (batch, *smaller[:1])
    remat = tuple(remat_patterns) if on.remat else ()
    rng = np.random.default_rng(0)

    def timed() -> list[float]:
        # One build for both batch sizes (each is traced once): a second build would hold a
        # second copy while the first is released.
        model, _ = layouts.build_model(
            model_factory, mesh, table, seed=0, input_shape=build_shape(input_shape),
            input_dtype=build_dtype(input_dtype),
            allow_replicated=True, fsdp=on.update == "fsdp")
        step = steps.Steps(model, loss=loss, optimizer=optimizer, mesh=mesh, config=steps.StepConfig(
            remat=remat, gradient_accumulation_steps=k,
            shard_optimizer_state=on.update == "zero" and b > 1))
        try:
            out = []
            for rows in batches:
                packed = _random_batch(rng, mesh, rows, input_shape, input_dtype, num_classes,
                                       model.output_shape)
                # Few calls: each step of a model that needs sharding is long.
                out.append(alternating_ms([lambda s=step, p=packed: float(
                    s.train(p, reset_metrics=False))],
                                          rounds=2, warmup=1)[0])
                del packed
            return out
        finally:
            del step, model
            gc.collect()
            materialize.release_free_memory()

    level = _log.level
    _log.setLevel(logging.ERROR)  # the real run gives the builds' notes, once
    try:
        measured = timed()
    finally:
        _log.setLevel(level)
    plan = layouts.plan_weights(table, Axes(sizes), profile.weights,
                                fsdp_paths=[p for p, _, _ in profile.weights]
                                if on.update == "fsdp" else ())
    share = ASSUMED_REMAT_SHARE if on.remat else 0.0
    none = StepCalibration(a_ms=0.0, e_ms=0.0, remat_share=share)

    def compute(rows: int, ms: float) -> float:
        collectives = predict_ms(profile, plan, machine, none, global_batch_size=rows,
                                 update=on.update, remat=on.remat, microbatches=k,
                                 remat_patterns=remat)
        return max(ms - collectives, 0.0) / (1 + share)

    computed = [compute(rows, ms) for rows, ms in zip(batches, measured)]
    if len(batches) == 2:
        e = max((computed[0] - computed[1]) / (batches[0] - batches[1]), 0.0)
        a = max(computed[0] - e * batches[0], 0.0)
    else:  # one batch size only: all of it counted per example
        a, e = 0.0, computed[0] / batches[0]
    assumed = [f"remat +{share:.0%}"] if on.remat else []
    if k > 1:
        assumed.append(f"the {k} microbatches' own cost counted in the compute")
    if on.update == "fsdp":
        assumed.append("FSDP's own cost counted in the compute")
    if len(batches) == 1:
        assumed.append("one batch size: no per-call overhead separated")
    return StepCalibration(a_ms=a, e_ms=e, remat_share=share, batch_sizes=batches,
                           measured_ms=tuple(measured), measured_on=on.label,
                           assumed="; ".join(assumed))


def calibration_candidate(candidates: Sequence[Candidate], devices: int) -> Candidate | None:
    """Where to time the model's step: None (on ``batch=D``, replicated) when some data-parallel
    candidate fits the budget, else the fitting candidate without remat (its share is then
    measured in the step, not assumed) that needs the least memory: timing it never needs more
    memory than the plan that will be chosen, whichever it is. None when none fits (``choose``
    says why)."""
    runnable = [c for c in candidates if c.rejected is None]
    if any(c.fits and not c.remat and c.mesh.split(",")[0] == f"batch={devices}"
           for c in runnable):
        return None
    fitting = [c for c in runnable if c.fits]
    if not fitting:
        return None
    return min(fitting, key=lambda c: (c.remat, c.memory["total"]))


def _random_batch(rng, mesh, rows: int, input_shape: Sequence[int], input_dtype: str,
                  num_classes: int, output_shape) -> tuple:
    """A packed batch of random inputs and labels for a timed step (integer inputs, token ids,
    are drawn from the label range too)."""
    import numpy as np  # pylint: disable=g-import-not-at-top
    from dtk.data import input as input_lib  # pylint: disable=g-import-not-at-top
    def draw(one_shape, dtype):
        shape = [rows, *one_shape]
        if "int" in dtype:
            return rng.integers(0, num_classes, shape).astype(dtype)
        return rng.standard_normal(shape).astype(dtype)

    if isinstance(input_shape, dict):  # named inputs
        x = {k: draw(v, input_dtype[k] if isinstance(input_dtype, dict) else input_dtype)
             for k, v in input_shape.items()}
    else:
        x = draw(input_shape, input_dtype)
    if output_shape[-1] == 1:  # one logit: 0/1 labels of the output's shape
        y = rng.integers(0, 2, [rows, *output_shape[1:]]).astype(np.float32)
    else:
        y = rng.integers(0, num_classes, [rows, *output_shape[1:-1]]).astype(np.int64)
    return input_lib.pack(mesh, (x, y, np.ones(rows, np.float32)))


def paired_ms(anchor: Callable[[], Any], variants: dict[str, Callable[[], Callable[[], Any]]],
              *, rounds: int = 9) -> dict[str, float]:
    """ms per call of ``anchor`` (key ``"anchor"``) and of each variant, measured as ratios.

    Each variant is built (``variants[name]()`` returns its call), timed alternating with the
    anchor, and dropped before the next: two models alive at a time, as in a real run (with many
    alive every step ran 30-40% slower here), and a variant's time is its median ratio to the
    anchor in its own rounds times the anchor's median over all rounds, so drift between
    variants cancels out.
    """
    import gc  # pylint: disable=g-import-not-at-top
    ratios, anchor_ms = {}, []
    for name, build in variants.items():
        fn = build()
        base, other = alternating_ms([anchor, fn], rounds=rounds)
        ratios[name] = other / base
        anchor_ms.append(base)
        del fn
        gc.collect()
    if not anchor_ms:
        anchor_ms = alternating_ms([anchor], rounds=rounds)
    ms = statistics.median(anchor_ms)
    return {"anchor": ms, **{name: r * ms for name, r in ratios.items()}}


def alternating_ms(fns: Sequence[Callable[[], Any]], *, rounds: int = 9,
                   warmup: int = 3) -> list[float]:
    """Median ms per call of each function, called in turn (noise hits them alike)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, out in zip(fns, times):
            start = time.perf_counter()
            fn()
            out.append(1000 * (time.perf_counter() - start))
    return [statistics.median(t) for t in times]


def agree(machine: MachineCalibration, step: StepCalibration
           ) -> tuple[MachineCalibration, StepCalibration]:
    """Client 0's figures on every client, so that every client chooses the same plan."""
    from dtk.cluster import env as cluster  # pylint: disable=g-import-not-at-top
    if not cluster.is_multi_client():
        return machine, step
    from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
    ctx = context.context()
    key = f"dtk/plan/calibration/{next(_POSTS)}"
    if cluster.is_lead_client():
        ctx.set_config_key_value(key, json.dumps(
            {"gather": {str(k): list(v) for k, v in machine.gather.items()},
             "step": dataclasses.asdict(step)}))
        return machine, step
    data = json.loads(ctx.get_config_key_value(key, timeout_in_ms=600_000))
    machine = dataclasses.replace(machine, gather={int(k): tuple(v)
                                                   for k, v in data["gather"].items()})
    s = data["step"]
    step = StepCalibration(**{k: tuple(v) if isinstance(v, list) else v for k, v in s.items()})
    return machine, step
