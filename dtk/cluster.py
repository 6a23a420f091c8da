"""Multi-client plumbing: scheduler bridges, fail-fast timeouts, and cross-client checks.

DTensor's multi-client mode is configured by ``DTENSOR_JOBS`` (``host:port`` of every client, in
client-id order), ``DTENSOR_CLIENT_ID`` and ``DTENSOR_JOB_NAME``. Schedulers describe the same
cluster in their own words; ``scheduler_env`` translates:

* ``TF_CONFIG`` (Kubernetes TFJob, Ray Train, ...): ``{"cluster": {"chief": [...], "worker":
  [...]}, "task": {"type": "worker", "index": 1}}`` -> clients are the chief (if any) then the
  workers, in order; this task's id is its position in that list.
* Slurm (``srun``): ``SLURM_PROCID`` is the client id, ``SLURM_STEP_NODELIST`` (or
  ``SLURM_JOB_NODELIST``) and ``SLURM_STEP_TASKS_PER_NODE`` (or ``SLURM_TASKS_PER_NODE``) give the
  hosts; the task with local id k on a node listens on ``DTK_PORT_BASE + k`` (default 23456).

By default a client that never starts, or a port already in use, makes the other clients wait
forever. ``coordination_timeouts`` makes the cluster's start-up a barrier with a deadline and sets
the heartbeat timeout, so every client fails with a message instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator, Mapping

DEFAULT_PORT_BASE = 23456
DEFAULT_REGISTER_TIMEOUT_S = 120.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0


def expand_hostlist(hostlist: str) -> list[str]:
    """Expands Slurm's compressed host list: ``"node[01-03,07],gpu5"`` -> 4 + 1 host names.

    Raises:
      ValueError: a malformed list (unbalanced brackets, a bad range).
    """
    hosts: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", hostlist):
        match = re.fullmatch(r"([^\[]*)\[([^\]]+)\](.*)", item)
        if not match:
            if "[" in item or "]" in item:
                raise ValueError(f"Slurm host list {hostlist!r}: cannot parse {item!r}")
            hosts.append(item)
            continue
        prefix, ranges, suffix = match.groups()
        for part in ranges.split(","):
            if "-" in part:
                lo, hi = part.split("-", 1)
                if not (lo.isdigit() and hi.isdigit()) or int(lo) > int(hi):
                    raise ValueError(f"Slurm host list {hostlist!r}: bad range {part!r}")
                hosts += [f"{prefix}{i:0{len(lo)}d}{suffix}" for i in range(int(lo), int(hi) + 1)]
            else:
                hosts.append(f"{prefix}{part}{suffix}")
    return hosts


def _tasks_per_node(spec: str, num_nodes: int) -> list[int]:
    """Slurm's ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise ValueError(f"SLURM tasks per node {spec!r}: cannot parse {part!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if len(counts) != num_nodes:
        raise ValueError(f"SLURM tasks per node {spec!r} lists {len(counts)} nodes, the node list "
                         f"{num_nodes}")
    return counts


def env_from_tf_config(tf_config: str | Mapping) -> dict[str, str]:
    """``DTENSOR_*`` variables for the task that ``TF_CONFIG`` describes.

    Raises:
      ValueError: malformed JSON, no chief/worker addresses, or a task not in the cluster.
    """
    try:
        config = json.loads(tf_config) if isinstance(tf_config, str) else dict(tf_config)
    except json.JSONDecodeError as e:
        raise ValueError(f"TF_CONFIG is not valid JSON: {e}") from e
    cluster, task = config.get("cluster", {}), config.get("task", {})
    jobs = list(cluster.get("chief", [])) + list(cluster.get("worker", []))
    if not jobs:
        raise ValueError(f"TF_CONFIG names no chief or worker addresses: {config}")
    kind, index = task.get("type"), task.get("index", 0)
    if kind == "chief":
        client = index
    elif kind == "worker":
        client = len(cluster.get("chief", [])) + int(index)
    else:
        raise ValueError(f"TF_CONFIG task type {kind!r} is not chief or worker; DTensor clients "
                         "are the chief and the workers")
    if not 0 <= client < len(jobs):
        raise ValueError(f"TF_CONFIG task {task} is outside the cluster of {len(jobs)} clients")
    return {"DTENSOR_JOBS": ",".join(jobs), "DTENSOR_CLIENT_ID": str(client),
            "DTENSOR_JOB_NAME": "worker"}


def env_from_slurm(environ: Mapping[str, str]) -> dict[str, str]:
    """``DTENSOR_*`` variables for this Slurm task (one DTensor client per task).

    Raises:
      ValueError: missing or inconsistent Slurm variables.
    """
    try:
        rank, ntasks = int(environ["SLURM_PROCID"]), int(environ["SLURM_NTASKS"])
    except (KeyError, ValueError) as e:
        raise ValueError(f"SLURM_PROCID and SLURM_NTASKS must be set to integers: {e}") from e
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if not nodelist or not per_node:
        raise ValueError("SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST) and "
                         "SLURM_STEP_TASKS_PER_NODE (or SLURM_TASKS_PER_NODE) must be set")
    hosts = expand_hostlist(nodelist)
    counts = _tasks_per_node(per_node, len(hosts))
    base = int(environ.get("DTK_PORT_BASE", DEFAULT_PORT_BASE))
    jobs = [f"{host}:{base + k}" for host, n in zip(hosts, counts) for k in range(n)]
    if len(jobs) != ntasks or not 0 <= rank < ntasks:
        raise ValueError(f"Slurm describes {len(jobs)} tasks ({per_node} on {nodelist}) but "
                         f"SLURM_NTASKS={ntasks}, SLURM_PROCID={rank}")
    return {"DTENSOR_JOBS": ",".join(jobs), "DTENSOR_CLIENT_ID": str(rank),
            "DTENSOR_JOB_NAME": "worker"}


def scheduler_env(environ: Mapping[str, str]) -> tuple[str, dict[str, str]] | None:
    """``(source, DTENSOR_* variables)`` derived from a scheduler, or None.

    ``DTENSOR_JOBS`` set by the user wins; then ``TF_CONFIG``; then a Slurm step of more than one
    task.
    """
    if environ.get("DTENSOR_JOBS", "").strip():
        return None
    if environ.get("TF_CONFIG", "").strip():
        return "TF_CONFIG", env_from_tf_config(environ["TF_CONFIG"])
    if "SLURM_PROCID" in environ and int(environ.get("SLURM_NTASKS", "1") or 1) > 1:
        return "Slurm", env_from_slurm(environ)
    return None


def apply_scheduler_env() -> str | None:
    """Sets ``DTENSOR_*`` in ``os.environ`` from TF_CONFIG or Slurm if needed; returns the source."""
    found = scheduler_env(os.environ)
    if found is None:
        return None
    os.environ.update(found[1])
    return found[0]


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r} must be positive")
    return value


@contextlib.contextmanager
def coordination_timeouts(*, register_timeout_s: float | None = None,
                          heartbeat_timeout_s: float | None = None) -> Iterator[None]:
    """Makes multi-client start-up fail within deadlines instead of waiting forever.

    TensorFlow exposes these settings only through its context configuration, and DTensor's
    ``initialize_accelerator_system`` overwrites that configuration with defaults (no start-up
    deadline). So, while the block runs, dtk intercepts DTensor's call and adds: a start-up
    barrier that every client must reach within ``register_timeout_s`` (default
    ``$DTK_REGISTER_TIMEOUT_S`` or 120 s), and a heartbeat timeout (default
    ``$DTK_HEARTBEAT_TIMEOUT_S`` or 10 s) after which a dead client fails the others.
    """
    from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
    register = register_timeout_s or _seconds("DTK_REGISTER_TIMEOUT_S", DEFAULT_REGISTER_TIMEOUT_S)
    heartbeat = heartbeat_timeout_s or _seconds("DTK_HEARTBEAT_TIMEOUT_S",
                                                DEFAULT_HEARTBEAT_TIMEOUT_S)
    ctx = context.context()
    original = ctx.configure_coordination_service

    def configure(service_type, service_leader="", **kwargs):
        kwargs["cluster_register_timeout_in_ms"] = int(register * 1000)
        kwargs["heartbeat_timeout_in_ms"] = int(heartbeat * 1000)
        result = original(service_type, service_leader, **kwargs)
        # Without the barrier, registration returns at once and a missing client hangs later.
        ctx._coordination_service_config.cluster_register_with_barrier = True  # pylint: disable=protected-access
        return result

    ctx.configure_coordination_service = configure
    try:
        yield
    finally:
        del ctx.configure_coordination_service  # back to the class's method


def check_same_on_all_clients(mesh, value: float, *, what: str) -> None:
    """Raises if ``value`` differs between clients (e.g. a checksum of the initial weights).

    Every client must call this (it is a collective). Single-client: nothing to compare.

    Raises:
      ValueError: the clients disagree, with each client's value.
    """
    import numpy as np  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from tensorflow.experimental import dtensor  # pylint: disable=g-import-not-at-top
    from dtk import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
    clients = mesh_lib.num_clients()
    if clients == 1:
        return
    # One value per device, sharded over a 1-D view of every axis; gathered to all clients.
    layout = dtensor.Layout([*mesh.dim_names], mesh)
    local = [tf.fill([1] * len(mesh.dim_names), tf.constant(value, tf.float64))
             for _ in mesh.local_devices()]
    packed = dtensor.pack(local, layout)
    full = dtensor.relayout(packed, dtensor.Layout.replicated(mesh, len(mesh.dim_names)))
    values = np.asarray(dtensor.unpack(full)[0]).ravel()
    per_client = values.reshape(clients, -1)[:, 0]
    if np.ptp(per_client) != 0:
        raise ValueError(
            f"{what} differs between clients: {dict(enumerate(per_client.tolist()))}; every client "
            "must use the same seed (and the same code and data) or 'replicated' values diverge")
