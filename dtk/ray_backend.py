"""Run a dtk training function as N DTensor clients on Ray actors (optional: ``pip install dtk[ray]``).

    results = dtk.ray_backend.run(train_fn, num_clients=2)   # one result per client, in order

Each actor becomes one DTensor client: the driver picks the ports first, and each actor sets its
``DTENSOR_*`` environment in its constructor, before TensorFlow initializes in that process (the
training function, which builds the mesh, runs afterwards). A dead actor fails the run within
seconds: the driver stops every other actor at once instead of letting them wait in a collective;
``max_restarts`` restarts the whole group (resume from a shared checkpoint directory).

Single machine only: the clients dial each other on 127.0.0.1 (ports picked on the driver), so
every actor must run on the driver's node; Ray is started there with ``num_cpus`` for the group.
DTensor's servers listen on all interfaces (see ``dtk.launch``): run Ray on a private network.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from dtk import cluster
from dtk.launch import LaunchConfig, free_ports, run_with_restarts


class ClientFailedError(RuntimeError):
    """A client of the group failed; ``client`` is its id."""

    def __init__(self, client: int, message: str):
        super().__init__(f"DTensor client {client} failed: {message}")
        self.client = client


def _client_class(ray):
    @ray.remote(max_restarts=0, max_task_retries=0)
    class _Client:  # pylint: disable=too-few-public-methods
        """One DTensor client: the environment is set before TensorFlow initializes here."""

        def __init__(self, env: dict[str, str]):
            os.environ.update(env)

        def run(self, fn: Callable[[], Any]) -> Any:
            return fn()

    return _Client


def _run_group(ray, fn, config: LaunchConfig, timeout_s: float) -> list[Any]:
    ports = free_ports(config.num_clients)
    jobs = [f"127.0.0.1:{p}" for p in ports]
    client_cls = _client_class(ray)
    actors = []
    for i in range(config.num_clients):
        env = cluster.client_env(jobs=jobs, client=i, register_timeout_s=config.start_timeout_s,
                                 heartbeat_timeout_s=config.heartbeat_timeout_s,
                                 virtual_devices=config.devices_per_client)
        env["TF_CPP_MIN_LOG_LEVEL"] = os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")
        actors.append(client_cls.options(num_cpus=0).remote(env))
    refs = [actor.run.remote(fn) for actor in actors]
    index = {ref: i for i, ref in enumerate(refs)}
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    try:
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"clients {[index[r] for r in pending]} did not finish within "
                                   f"{timeout_s:.0f} s")
            done, pending = ray.wait(pending, num_returns=1, timeout=min(left, 1.0))
            for ref in done:
                try:
                    results[index[ref]] = ray.get(ref)
                except Exception as e:  # pylint: disable=broad-except
                    raise ClientFailedError(index[ref], str(e).strip().splitlines()[-1]) from e
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
    return [results[i] for i in range(config.num_clients)]


def run(fn: Callable[[], Any], *, num_clients: int, devices_per_client: int | None = None,
        max_restarts: int = 0, timeout_s: float = 600.0, start_timeout_s: float = cluster.DEFAULT_REGISTER_TIMEOUT_S,
        heartbeat_timeout_s: float = cluster.DEFAULT_HEARTBEAT_TIMEOUT_S) -> list[Any]:
    """Runs ``fn`` on ``num_clients`` Ray actors, each one DTensor client; returns their results.

    ``fn`` builds the mesh itself (``dtk.build_mesh``) and trains; it must be picklable
    (cloudpickle). Ray is started on loopback if it is not running yet.

    Raises:
      ClientFailedError: a client failed in the last attempt (naming it).
      TimeoutError: the group did not finish within ``timeout_s``.
    """
    try:
        import ray  # pylint: disable=g-import-not-at-top
    except ImportError as e:
        raise ImportError("the Ray backend needs Ray: pip install 'dtk[ray]'") from e
    config = LaunchConfig(num_clients=num_clients, devices_per_client=devices_per_client,
                          max_restarts=max_restarts, start_timeout_s=start_timeout_s,
                          heartbeat_timeout_s=heartbeat_timeout_s)
    if not ray.is_initialized():
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False,
                 num_cpus=max(2, num_clients), log_to_driver=True)

    def attempt():
        try:
            return _run_group(ray, fn, config, timeout_s)
        except (ClientFailedError, TimeoutError) as e:
            return e

    result = run_with_restarts(attempt, max_restarts=config.max_restarts,
                               failed=lambda r: isinstance(r, Exception), describe=str,
                               who="dtk.ray_backend")
    if isinstance(result, Exception):
        raise result
    return result
