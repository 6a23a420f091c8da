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
from collections.abc import Iterator, Mapping, Sequence

from dtk import _env

DEFAULT_PORT_BASE = 23456
DEFAULT_REGISTER_TIMEOUT_S = 120.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0
JOB_NAME = "worker"
# Variables that describe a cluster: a launcher that describes its own removes these first.
SCHEDULER_VARIABLES = ("TF_CONFIG", "SLURM_PROCID", "SLURM_NTASKS", "DTENSOR_JOBS",
                       "DTENSOR_CLIENT_ID", "DTENSOR_JOB_NAME")


# -- client identity ------------------------------------------------------------------------------
def is_multi_client() -> bool:
    """True when ``DTENSOR_JOBS`` names the clients of a multi-client run."""
    return bool(os.environ.get("DTENSOR_JOBS", "").strip())


def num_clients() -> int:
    """The number of DTensor clients (processes) in this run; 1 without ``DTENSOR_JOBS``."""
    jobs = os.environ.get("DTENSOR_JOBS", "").strip()
    return len([j for j in jobs.split(",") if j.strip()]) if jobs else 1


def client_id() -> int:
    """This process's client id (``DTENSOR_CLIENT_ID``, 0 when unset).

    Raises:
      ValueError: not an integer in ``[0, num_clients)``.
    """
    raw = os.environ.get("DTENSOR_CLIENT_ID", "").strip() or "0"
    n = num_clients()
    if not raw.isdigit() or int(raw) >= n:
        raise ValueError(f"DTENSOR_CLIENT_ID={raw!r} is not a client id of this run: DTENSOR_JOBS "
                         f"names {n} client(s), so it must be an integer in [0, {n - 1}]")
    return int(raw)


def is_lead_client() -> bool:
    """True on client 0, the one that prints progress and writes shared files."""
    return client_id() == 0


def check_job_addresses(jobs: Sequence[str], *, what: str = "job address") -> None:
    """Every job is ``host:port`` with a port in 1-65535.

    Raises:
      ValueError: naming the first malformed address (and ``what`` it came from).
    """
    for job in jobs:
        host, _, port = job.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{what} {job!r} is not host:port (e.g. 10.0.0.2:23456)")


def check_environment() -> None:
    """``DTENSOR_JOBS`` and ``DTENSOR_CLIENT_ID``, when set, describe a cluster this process can
    join: checked before TensorFlow tries (its error is a traceback about a local server).

    Raises:
      ValueError: naming the variable, its value and the form it needs.
    """
    if not is_multi_client():
        return
    jobs = [j.strip() for j in os.environ["DTENSOR_JOBS"].split(",")]
    if any(not j for j in jobs):
        raise ValueError(f"DTENSOR_JOBS={os.environ['DTENSOR_JOBS']!r} has an empty entry; give "
                         "host:port of every client, separated by commas")
    check_job_addresses(jobs, what=f"DTENSOR_JOBS={os.environ['DTENSOR_JOBS']!r}: address")
    client_id()


# -- the client environment contract (written once) ----------------------------------------------
def client_env(*, jobs: Sequence[str], client: int, register_timeout_s: float | None = None,
               heartbeat_timeout_s: float | None = None, virtual_devices: int | None = None,
               ready_file: str | None = None) -> dict[str, str]:
    """The environment that makes a process DTensor client ``client`` of the cluster ``jobs``.

    Every launcher (``dtk.cluster.launch``, the Ray backend, the TF_CONFIG and Slurm bridges, the tests)
    builds a client's environment here, so the contract exists once.

    Args:
      jobs: ``host:port`` of every client, in client-id order.
      client: this client's id.
      register_timeout_s: start-up deadline (``DTK_REGISTER_TIMEOUT_S``); None leaves it unset.
      heartbeat_timeout_s: heartbeat timeout (``DTK_HEARTBEAT_TIMEOUT_S``); None leaves it unset.
      virtual_devices: CPU only: logical CPU devices this client creates.
      ready_file: written when this client's mesh exists (the launcher's start-up watchdog).

    Raises:
      ValueError: no jobs, a malformed ``host:port``, or a client id outside the jobs.
    """
    jobs = [str(j).strip() for j in jobs]
    if not jobs:
        raise ValueError("jobs is empty; give the host:port of every client")
    check_job_addresses(jobs)
    if not 0 <= client < len(jobs):
        raise ValueError(f"client id {client} is outside the {len(jobs)} jobs {jobs}")
    env = {"DTENSOR_JOBS": ",".join(jobs), "DTENSOR_CLIENT_ID": str(client),
           "DTENSOR_JOB_NAME": JOB_NAME}
    if register_timeout_s is not None:
        env[_env.REGISTER_TIMEOUT_S] = str(register_timeout_s)
    if heartbeat_timeout_s is not None:
        env[_env.HEARTBEAT_TIMEOUT_S] = str(heartbeat_timeout_s)
    if virtual_devices is not None:
        env[_env.VIRTUAL_DEVICES] = str(virtual_devices)
    if ready_file is not None:
        env[_env.READY_FILE] = ready_file
    return env


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
    return client_env(jobs=jobs, client=client)


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
    raw_base = str(environ.get(_env.PORT_BASE, "") or DEFAULT_PORT_BASE).strip()
    if not raw_base.isdigit() or not 0 < int(raw_base) < 65536:
        raise ValueError(f"{_env.PORT_BASE}={raw_base!r} is not a port number; set e.g. "
                         f"{_env.PORT_BASE}={DEFAULT_PORT_BASE}")
    base = int(raw_base)
    jobs = [f"{host}:{base + k}" for host, n in zip(hosts, counts) for k in range(n)]
    if len(jobs) != ntasks or not 0 <= rank < ntasks:
        raise ValueError(f"Slurm describes {len(jobs)} tasks ({per_node} on {nodelist}) but "
                         f"SLURM_NTASKS={ntasks}, SLURM_PROCID={rank}")
    return client_env(jobs=jobs, client=rank)


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
    register = register_timeout_s or _env.get_seconds(_env.REGISTER_TIMEOUT_S,
                                                      DEFAULT_REGISTER_TIMEOUT_S)
    heartbeat = heartbeat_timeout_s or _env.get_seconds(_env.HEARTBEAT_TIMEOUT_S,
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


# -- leaving ---------------------------------------------------------------------------------------
EXIT_WAIT_S = 30.0  # a client starved of CPU (4 processes on 2 cores) can lag seconds


def exit_process(status: int, *, wait_s: float = EXIT_WAIT_S) -> None:
    """Ends a finished script's process now, without TensorFlow's teardown (about 1 s per
    process, and in a multi-client run a shutdown in which clients wait on each other).

    Called only once the script is done: its output written and flushed, its collectives over.
    Python's ``atexit`` handlers still run (dtk's checkpoint lock is released). In a multi-client
    run the lead client hosts the coordination service, so it leaves last: every other client
    posts its exit status and leaves, and the lead waits for those posts (at most ``wait_s``
    seconds, long enough for a client starved of CPU; a client that died has already been
    reported by the launcher, which stops the group) before it leaves.
    Measured with 2 clients: the group is gone 0.12-0.22 s after its last line, against
    1.1-2.3 s with the normal teardown.
    """
    import atexit  # pylint: disable=g-import-not-at-top
    import logging  # pylint: disable=g-import-not-at-top
    import sys  # pylint: disable=g-import-not-at-top
    try:
        atexit._run_exitfuncs()  # pylint: disable=protected-access
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        if is_multi_client() and "tensorflow" in sys.modules:
            _leave_group(status, wait_s)
    finally:
        os._exit(status)  # pylint: disable=protected-access


_LEFT = False  # this process has left its multi-client group (_leave_group ran)


def leave_group_at_exit() -> None:
    """Makes the interpreter's normal exit leave the multi-client group cleanly.

    Called once the process has joined the cluster (``dtk.build_mesh``). A user's script ends
    through Python's own exit, not ``exit_process``; TensorFlow's teardown then lets the lead
    take the coordination service away while another client is still shutting down, which
    prints "Failed to send RPC to coordination service" lines that read as a crash. At exit,
    the clients leave in ``exit_process``'s order instead: every other client posts that it is
    done (and silences what TensorFlow prints while it tears down), and the lead waits for the
    posts before its own teardown. The exit status is the script's.
    """
    import atexit  # pylint: disable=g-import-not-at-top
    if is_multi_client():
        atexit.register(_leave_at_exit)


def _leave_at_exit() -> None:
    import sys  # pylint: disable=g-import-not-at-top
    error = getattr(sys, "last_value", None)  # an uncaught exception was printed
    sys.stdout.flush()
    sys.stderr.flush()
    # A client that failed because a peer stopped answering (its heartbeats, a collective) leaves
    # at once: waiting for that peer's post only delays the launcher's report by ``wait_s``
    # (a frozen client's group took 35 s to stop with a 5 s heartbeat timeout, 5 s now).
    _leave_group(0 if error is None else 1, 0.0 if _peer_lost(error) else EXIT_WAIT_S)


def _peer_lost(error) -> bool:
    """True for the errors TensorFlow raises when another client of the group is gone."""
    import sys  # pylint: disable=g-import-not-at-top
    errors = sys.modules.get("tensorflow.python.framework.errors_impl")
    while error is not None:
        if errors is not None and isinstance(error, errors.UnavailableError):
            return True
        if "tasks are unhealthy" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _leave_group(status: int, wait_s: float) -> None:
    global _LEFT  # pylint: disable=global-statement
    if _LEFT:
        return
    _LEFT = True
    from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
    ctx = context.context()
    if ctx.coordination_service is None:  # the cluster was never joined
        return
    try:
        if not is_lead_client():
            # Once posted, the lead may leave and take the coordination service with it; this
            # process's TensorFlow threads may then log the lost service (a race of microseconds
            # before ``os._exit``). Everything of this run is already written and flushed, so what
            # is left to print is noise that reads as a crash: silence it first.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            ctx.set_config_key_value(f"dtk/exit/{client_id()}", str(status))
            return
        for other in range(1, num_clients() if wait_s > 0 else 1):
            ctx.get_config_key_value(f"dtk/exit/{other}", timeout_in_ms=int(wait_s * 1000))
    except Exception:  # pylint: disable=broad-except
        pass  # a peer that is gone: the launcher names it; leaving is all that is left to do
