"""``python -m dtk.launch``: run N DTensor clients of one command on this machine, safely.

    python -m dtk.launch --num_clients 2 --devices_per_client 4 -- \\
        python scripts/train_mnist.py --mesh batch=8 --dataset idx --data_dir ../shared/data/mnist

Like ``torchrun`` for DTensor: picks free loopback ports, gives each client its ``DTENSOR_*``
environment, prefixes every output line with ``[client i]``, and returns the first failing
client's exit code. Unlike a bare multi-client run, nothing hangs:

* a watchdog stops the whole group as soon as any client exits non-zero (the others would fail
  within the heartbeat timeout anyway, or wait forever in a collective), and says which client
  failed and how;
* every client must join the cluster (build its mesh) within ``--start_timeout`` seconds, or the
  group is stopped with the names of the clients that did not;
* ``--max_restarts K`` relaunches the whole group after a failure (with ``--checkpoint_dir`` the
  training resumes from the last checkpoint, which every client saved into the shared directory).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

_GRACE_S = 3.0      # SIGTERM -> SIGKILL
_POLL_S = 0.1


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """How ``launch`` runs a group of clients.

    Attributes:
      num_clients: processes to start (one DTensor client each).
      devices_per_client: CPU only: virtual CPUs per client (``DTK_VIRTUAL_DEVICES``); by default
        each client creates as many as its share of the mesh needs.
      max_restarts: relaunches of the whole group after a failure.
      start_timeout_s: every client must build its mesh within this many seconds.
      heartbeat_timeout_s: a client that stops answering fails the others after this long.
    """

    num_clients: int
    devices_per_client: int | None = None
    max_restarts: int = 0
    start_timeout_s: float = 120.0
    heartbeat_timeout_s: float = 10.0

    def __post_init__(self):
        if self.num_clients < 1:
            raise ValueError(f"num_clients must be at least 1; got {self.num_clients}")
        if self.devices_per_client is not None and self.devices_per_client < 1:
            raise ValueError(f"devices_per_client must be positive; got {self.devices_per_client}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0; got {self.max_restarts}")
        if self.start_timeout_s <= 0 or self.heartbeat_timeout_s <= 0:
            raise ValueError("start_timeout_s and heartbeat_timeout_s must be positive")


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports that are free on loopback now."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def client_envs(config: LaunchConfig, ports: Sequence[int], ready_dir: str,
                base: dict[str, str] | None = None) -> list[dict[str, str]]:
    """The environment of each client: ``DTENSOR_*``, the readiness file, timeouts."""
    base = dict(os.environ if base is None else base)
    for key in ("TF_CONFIG", "SLURM_PROCID", "SLURM_NTASKS"):
        base.pop(key, None)  # the launcher, not a scheduler, describes this cluster
    jobs = ",".join(f"localhost:{p}" for p in ports)
    envs = []
    for i in range(config.num_clients):
        env = dict(base, DTENSOR_JOBS=jobs, DTENSOR_CLIENT_ID=str(i), DTENSOR_JOB_NAME="worker",
                   DTK_READY_FILE=os.path.join(ready_dir, f"client-{i}.ready"),
                   DTK_REGISTER_TIMEOUT_S=str(config.start_timeout_s),
                   DTK_HEARTBEAT_TIMEOUT_S=str(config.heartbeat_timeout_s),
                   PYTHONUNBUFFERED="1")
        if config.devices_per_client:
            env["DTK_VIRTUAL_DEVICES"] = str(config.devices_per_client)
        envs.append(env)
    return envs


def _pump(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(f"{prefix}{line}")
        out.flush()
    stream.close()


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()  # TensorFlow blocked in C++ may not act on SIGTERM
            p.wait()


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def run_group(command: Sequence[str], config: LaunchConfig, *, out=None) -> int:
    """Runs one group of clients until all succeed or one fails; returns the exit code."""
    out = out or sys.stdout
    with tempfile.TemporaryDirectory(prefix="dtk-launch-") as ready_dir:
        envs = client_envs(config, free_ports(config.num_clients), ready_dir)
        procs, pumps = [], []
        for i, env in enumerate(envs):
            p = subprocess.Popen(list(command), env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, bufsize=1)
            procs.append(p)
            t = threading.Thread(target=_pump, args=(p.stdout, f"[client {i}] ", out), daemon=True)
            t.start()
            pumps.append(t)
        start = time.monotonic()
        code, message = 0, None
        try:
            while True:
                codes = [p.poll() for p in procs]
                failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    i, c = failed[0]
                    code = _exit_code(c)
                    message = f"client {i} {_describe(c)}; stopping the other clients"
                    break
                if all(c == 0 for c in codes):
                    break
                late = [i for i in range(config.num_clients)
                        if not os.path.exists(os.path.join(ready_dir, f"client-{i}.ready"))]
                if late and time.monotonic() - start > config.start_timeout_s:
                    code = 124
                    message = (f"client(s) {late} did not join the cluster (build the mesh) within "
                               f"{config.start_timeout_s:.0f} s; stopping all clients")
                    break
                time.sleep(_POLL_S)
        finally:
            if message:
                print(f"dtk.launch: {message}", file=sys.stderr, flush=True)
            _stop(procs)
            for t in pumps:
                t.join(timeout=2)
        return code


def launch(command: Sequence[str], config: LaunchConfig, *, out=None) -> int:
    """Runs ``command`` as ``config.num_clients`` clients, restarting the group on failure.

    Returns:
      0 when every client succeeded, else the exit code of the first client that failed in the
      last attempt (124 when a client did not start in time).
    """
    if not command:
        raise ValueError("no command to launch; put it after '--', e.g. "
                         "python -m dtk.launch --num_clients 2 -- python train.py")
    for attempt in range(config.max_restarts + 1):
        start = time.monotonic()
        code = run_group(command, config, out=out)
        if code == 0:
            return 0
        if attempt < config.max_restarts:
            print(f"dtk.launch: attempt {attempt + 1} failed with code {code} after "
                  f"{time.monotonic() - start:.1f} s; restarting the group "
                  f"({config.max_restarts - attempt} restart(s) left)", file=sys.stderr, flush=True)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = []
    if "--" in argv:
        split = argv.index("--")
        argv, command = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(prog="python -m dtk.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--num_clients", type=int, required=True, help="client processes")
    parser.add_argument("--devices_per_client", type=int, default=None,
                        help="CPU: virtual devices per client (default: what the mesh needs)")
    parser.add_argument("--max_restarts", type=int, default=0, help="group restarts on failure")
    parser.add_argument("--start_timeout", type=float, default=120.0,
                        help="seconds for every client to build its mesh")
    parser.add_argument("--heartbeat_timeout", type=float, default=10.0,
                        help="seconds after which a silent client fails the others")
    args = parser.parse_args(argv)
    try:
        config = LaunchConfig(num_clients=args.num_clients,
                              devices_per_client=args.devices_per_client,
                              max_restarts=args.max_restarts, start_timeout_s=args.start_timeout,
                              heartbeat_timeout_s=args.heartbeat_timeout)
        return launch(command, config)
    except ValueError as e:
        parser.error(str(e))
        return 2


if __name__ == "__main__":
    sys.exit(main())
