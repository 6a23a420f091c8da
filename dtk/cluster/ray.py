"""dtk on a Ray cluster: a Ray Train backend for DTensor clients (``pip install 'ray[train,tune]'``: dtk's ray extra).

    from ray.train import ScalingConfig, RunConfig, FailureConfig
    import dtk.cluster.ray

    def train_loop(config):
        mesh = dtk.build_mesh("batch=8")                  # 2 workers x 4 devices
        ...
        checkpoint_dir = "/shared/run1/ckpt"              # storage every worker sees
        dtk.cluster.ray.restore_from_ray(checkpoint_dir)          # after a restart: Ray's latest checkpoint
        trainer = dtk.Trainer(..., config=dtk.TrainerConfig(checkpoint_dir=checkpoint_dir))
        trainer.fit(data, epochs=3, on_epoch_end=[dtk.cluster.ray.ReportCallback(checkpoint_dir)])

    result = dtk.cluster.ray.DTensorTrainer(
        train_loop, train_loop_config={"lr": 1e-3},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path="/shared/ray", failure_config=FailureConfig(max_failures=1)),
        devices_per_worker=4).fit()

Ray schedules the workers (its ``ScalingConfig``: number, GPUs, resources, placement strategy),
restarts a failed group (``FailureConfig``) and keeps the reported checkpoints (``RunConfig``).
Elastic groups (``ScalingConfig(num_workers=(min, max))``, Ray Train v2) need nothing more: each
start gets the jobs of the workers it has, and a loop that builds ``dtk.build_mesh("batch=-1")``
spans their devices and resumes from the newest checkpoint with the same numbers.
The backend (``DTensorConfig``) makes each worker one DTensor client before TensorFlow starts there:
every worker reports its node's address and a port free on that node, and every worker gets the
jobs list in world-rank order, its client id (= its world rank), dtk's start-up and heartbeat
deadlines, and, on CPU workers, its number of virtual devices. ``TF_CONFIG`` is removed (a dtk
client is configured by ``DTENSOR_*`` only). GPU workers keep the GPUs Ray gave them (no sharing
between workers of a node) and use NCCL collectives.

Why not Ray's ``TensorflowTrainer``: it writes ``TF_CONFIG`` for MultiWorkerMirroredStrategy and
does not know DTensor's client contract, its deadlines or virtual devices.

Networking: DTensor's servers listen on all interfaces of every worker's node; run the cluster on a
private network (see README.md, "On a Ray cluster").
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import math
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

try:
    import ray
    import ray.train
    from ray.train.backend import Backend, BackendConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
except ImportError as _e:  # pragma: no cover - depends on the install
    raise ImportError(f"dtk.cluster.ray needs Ray Train: pip install 'ray[train,tune]', dtk's ray extra ({_e})") from _e

from dtk import _env
from dtk.cluster import env as cluster

__all__ = ["DTensorConfig", "DTensorTrainer", "ReportCallback", "restore_from_ray"]

_STATE_FILE = "checkpoint"  # tf.train's checkpoint state file: names the latest checkpoint


@dataclasses.dataclass(frozen=True, kw_only=True)
class DTensorConfig(BackendConfig):
    """How Ray Train makes its workers DTensor clients.

    Attributes:
      devices_per_worker: CPU workers only: virtual CPU devices each worker creates (e.g. 4 for
        2 workers x 4 = a ``batch=8`` mesh on CPUs). None: the worker's real CPU device (1).
      start_timeout_s: how long clients wait for each other at start-up before failing.
      heartbeat_timeout_s: how soon the other clients fail when one dies.
      verbose: keep TensorFlow's C++ lines and DTensor's start-up INFO lines (its whole server
        configuration, device lists) in the workers' logs. By default a worker says one line:
        its client id and devices.
    """

    devices_per_worker: int | None = None
    start_timeout_s: float = cluster.DEFAULT_REGISTER_TIMEOUT_S
    heartbeat_timeout_s: float = cluster.DEFAULT_HEARTBEAT_TIMEOUT_S
    verbose: bool = False

    def __post_init__(self):
        if self.devices_per_worker is not None and (
                not isinstance(self.devices_per_worker, int) or self.devices_per_worker < 1):
            raise ValueError(f"devices_per_worker must be a positive integer or None; got "
                             f"{self.devices_per_worker!r}")
        for name in ("start_timeout_s", "heartbeat_timeout_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be positive and finite; got {value!r}")

    @property
    def backend_cls(self):
        return _DTensorBackend

    @property
    def framework(self):
        from ray.train.v2._internal.util import TrainingFramework  # pylint: disable=g-import-not-at-top
        return TrainingFramework.TENSORFLOW

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _tensorflow_initialized() -> bool:
    """Whether this process's TensorFlow runtime already exists (too late to become a client)."""
    if "tensorflow" not in sys.modules:
        return False
    from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
    ctx = context.context_safe()
    return ctx is not None and ctx._context_handle is not None  # pylint: disable=protected-access


def _reserve_address() -> dict[str, Any]:
    """Runs on a worker: its node's address, a port free on that node, and what the worker has."""
    host = ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    return {"host": host, "port": port, "pid": os.getpid(), "gpus": len(ray.get_gpu_ids()),
            "tf_initialized": _tensorflow_initialized()}


def _job(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def worker_envs(addresses: list[dict[str, Any]], config: DTensorConfig) -> list[dict[str, str]]:
    """Each worker's DTensor client environment, from every worker's reported address (rank order).

    Raises:
      RuntimeError: a worker's TensorFlow is already initialized, or two workers got one address.
    """
    for rank, a in enumerate(addresses):
        if a["tf_initialized"]:
            raise RuntimeError(
                f"Ray Train worker {rank} (pid {a['pid']} on {a['host']}) has already initialized "
                "TensorFlow, so it can no longer become a DTensor client; the DTensor backend must "
                "start before anything in the worker runs TensorFlow (do not reuse such a worker)")
    jobs = [_job(a["host"], a["port"]) for a in addresses]
    if len(set(jobs)) != len(jobs):
        raise RuntimeError(f"two Ray Train workers reported the same address: {jobs}")
    envs = []
    for rank, a in enumerate(addresses):
        env = cluster.client_env(
            jobs=jobs, client=rank, register_timeout_s=config.start_timeout_s,
            heartbeat_timeout_s=config.heartbeat_timeout_s,
            virtual_devices=config.devices_per_worker if not a["gpus"] else None)
        if a["gpus"]:
            env[_env.GPU_NCCL_ENV] = os.environ.get(_env.GPU_NCCL_ENV, "1")
        if not config.verbose:
            env.update(_env.quiet_tensorflow_env())
        envs.append(env)
    return envs


def _set_env(env: dict[str, str], verbose: bool = False) -> None:
    """Runs on a worker: becomes a DTensor client (TF_CONFIG would describe another contract).

    Unless ``verbose``, TensorFlow's Python INFO lines (DTensor logs its whole server
    configuration and device lists at start-up) are hidden, and the worker says one line.
    """
    if _tensorflow_initialized():
        raise RuntimeError(f"TensorFlow initialized in worker pid {os.getpid()} before the DTensor "
                           "backend set its client environment")
    os.environ.update(env)
    os.environ.pop("TF_CONFIG", None)
    if not verbose:
        logging.getLogger("tensorflow").setLevel(logging.WARNING)
        clients = len(env["DTENSOR_JOBS"].split(","))
        devices = (f"{env[_env.VIRTUAL_DEVICES]} virtual CPU devices"
                   if _env.VIRTUAL_DEVICES in env else "its local devices")
        print(f"dtk: Ray Train worker pid {os.getpid()} is DTensor client "
              f"{env['DTENSOR_CLIENT_ID']} of {clients}, with {devices}", flush=True)


class _DTensorBackend(Backend):
    share_cuda_visible_devices = False  # each worker keeps its own GPUs

    def on_start(self, worker_group, backend_config: DTensorConfig):
        addresses = worker_group.execute(_reserve_address)
        envs = worker_envs(addresses, backend_config)
        ray.get([worker_group.execute_single_async(rank, _set_env, env, backend_config.verbose)
                 for rank, env in enumerate(envs)])


class DTensorTrainer(DataParallelTrainer):
    """Ray Train's ``DataParallelTrainer`` whose workers are the clients of one DTensor cluster.

    Same call as Ray's trainers, plus dtk's backend options::

        DTensorTrainer(train_loop_per_worker, train_loop_config=None,
                       scaling_config=ScalingConfig(num_workers=2), run_config=RunConfig(...),
                       devices_per_worker=4)

    ``train_loop_per_worker`` builds the mesh (``dtk.build_mesh``) over all workers' devices;
    use ``ReportCallback`` to report each epoch to Ray and ``restore_from_ray`` to resume after a
    restart.

    Args:
      train_loop_per_worker: ``f()`` or ``f(config)``, run on every worker.
      train_loop_config: the ``config`` dict.
      scaling_config: Ray's ``ScalingConfig``: one worker per DTensor client.
      run_config: Ray's ``RunConfig`` (storage, callbacks, ``FailureConfig``).
      devices_per_worker, start_timeout_s, heartbeat_timeout_s: see ``DTensorConfig``.
      dtensor_config: a whole ``DTensorConfig`` instead of the three options above.
      **kwargs: other ``DataParallelTrainer`` arguments (``datasets``, ``dataset_config``).
    """

    def __init__(self, train_loop_per_worker: Callable[..., Any], *,
                 train_loop_config: dict | None = None, scaling_config=None, run_config=None,
                 devices_per_worker: int | None = None,
                 start_timeout_s: float = cluster.DEFAULT_REGISTER_TIMEOUT_S,
                 heartbeat_timeout_s: float = cluster.DEFAULT_HEARTBEAT_TIMEOUT_S,
                 dtensor_config: DTensorConfig | None = None, **kwargs):
        if "backend_config" in kwargs:
            raise TypeError("DTensorTrainer sets backend_config itself; pass dtensor_config=")
        if dtensor_config is None:
            dtensor_config = DTensorConfig(devices_per_worker=devices_per_worker,
                                           start_timeout_s=start_timeout_s,
                                           heartbeat_timeout_s=heartbeat_timeout_s)
        elif not isinstance(dtensor_config, DTensorConfig):
            raise TypeError(f"dtensor_config must be a dtk.cluster.ray.DTensorConfig; got "
                            f"{type(dtensor_config).__name__}")
        super().__init__(train_loop_per_worker, train_loop_config=train_loop_config,
                         backend_config=dtensor_config, scaling_config=scaling_config,
                         run_config=run_config, **kwargs)


# -- reporting and checkpoints ---------------------------------------------------------------------
def _latest_step(directory: str) -> int | None:
    """The step of the checkpoint that ``directory``'s state file names, or None."""
    try:
        with open(os.path.join(directory, _STATE_FILE), encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    match = re.search(r'^model_checkpoint_path:\s*"(?:.*/)?ckpt-(\d+)"', text, re.M)
    return int(match.group(1)) if match else None


def _stage_latest(directory: str) -> str | None:
    """Copies ``directory``'s latest checkpoint (its files and a state file) into a new temp dir."""
    step = _latest_step(directory)
    if step is None:
        return None
    stage = tempfile.mkdtemp(prefix=f"dtk-ray-ckpt-{step}-")
    for path in glob.glob(os.path.join(glob.escape(directory), f"ckpt-{step}.*")):
        shutil.copy2(path, stage)
    with open(os.path.join(stage, _STATE_FILE), "w", encoding="utf-8") as f:
        f.write(f'model_checkpoint_path: "ckpt-{step}"\nall_model_checkpoint_paths: "ckpt-{step}"\n')
    return stage


class ReportCallback:
    """Reports each epoch's logs to Ray Train on every worker: ``Trainer.fit(on_epoch_end=[...])``,
    or from Keras's ``fit`` through ``tf_keras.callbacks.LambdaCallback(on_epoch_end=report)``
    after a ``dtk.CheckpointCallback`` (``dtk-tune-mnist``'s trials).

    ``ray.train.report`` is a barrier, so every worker calls it; client 0 attaches the latest dtk
    checkpoint from ``checkpoint_dir`` (that checkpoint's files only) as a ``ray.train.Checkpoint``,
    which Ray copies to its run storage and hands back after a restart (``restore_from_ray``).

    Args:
      checkpoint_dir: the ``TrainerConfig.checkpoint_dir`` of the run; None reports metrics only
        (Ray Train V2 keeps the metrics of checkpointed reports in its ``Result``; Ray Tune sees
        every report).
    """

    def __init__(self, checkpoint_dir: str | None = None):
        self.checkpoint_dir = checkpoint_dir

    def __call__(self, epoch: int, logs: dict[str, float]) -> None:
        metrics = {"epoch": epoch + 1, **{k: float(v) for k, v in logs.items()}}
        stage = None
        if self.checkpoint_dir is not None and cluster.is_lead_client():
            stage = _stage_latest(self.checkpoint_dir)
        if _in_tune_trial():  # a single-process Tune trial reports to Tune directly
            from ray import tune  # pylint: disable=g-import-not-at-top
            try:
                tune.report(metrics, checkpoint=None if stage is None
                            else tune.Checkpoint.from_directory(stage))
            finally:
                if stage is not None:
                    shutil.rmtree(stage, ignore_errors=True)
            return
        if stage is None:
            ray.train.report(metrics)
            return
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(stage),
                         delete_local_checkpoint_after_upload=True)


def _in_tune_trial() -> bool:
    """Whether this process is a plain Ray Tune trial (not a Ray Train worker)."""
    try:
        from ray.tune.trainable.trainable_fn_utils import _in_tune_session  # pylint: disable=g-import-not-at-top
    except ImportError:
        return False
    return bool(_in_tune_session())


def restore_from_ray(checkpoint_dir: str, *, timeout_s: float = 600.0) -> int | None:
    """After Ray restarts the group, puts Ray's latest checkpoint into ``checkpoint_dir``.

    Call on every worker before building the ``Trainer``. When ``checkpoint_dir`` already holds
    that checkpoint or a newer one (shared storage survived), nothing is copied; otherwise client 0
    copies the checkpoint's files, then the state file that names it, and the other clients wait
    for that state file. ``checkpoint_dir`` must be storage every worker sees (as for every
    multi-client dtk checkpoint).

    Returns:
      The step of Ray's checkpoint, or None when Ray has none (a first attempt).

    Raises:
      TimeoutError: client 0 did not finish copying within ``timeout_s``.
    """
    if _in_tune_trial():
        from ray import tune  # pylint: disable=g-import-not-at-top
        checkpoint = tune.get_checkpoint()
    else:
        checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as source:
        step = _latest_step(source)
        if step is None:
            raise ValueError(f"Ray checkpoint {checkpoint.path} holds no dtk checkpoint (no "
                             f"'{_STATE_FILE}' file naming ckpt-<step>)")
        have = _latest_step(checkpoint_dir)
        if have is not None and have >= step:
            return step
        if cluster.is_lead_client():
            os.makedirs(checkpoint_dir, exist_ok=True)
            for path in glob.glob(os.path.join(glob.escape(source), f"ckpt-{step}.*")):
                shutil.copy2(path, checkpoint_dir)
            tmp = os.path.join(checkpoint_dir, f".{_STATE_FILE}.ray-{os.getpid()}")
            shutil.copy2(os.path.join(source, _STATE_FILE), tmp)
            os.replace(tmp, os.path.join(checkpoint_dir, _STATE_FILE))
            return step
    deadline = time.monotonic() + timeout_s
    while _latest_step(checkpoint_dir) != step:
        if time.monotonic() > deadline:
            raise TimeoutError(f"client 0 did not restore Ray's checkpoint ckpt-{step} into "
                               f"{checkpoint_dir} within {timeout_s:.0f} s; is the directory on "
                               "storage every worker sees?")
        time.sleep(0.2)
    return step
