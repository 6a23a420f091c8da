"""Helpers for tests that need fresh processes: virtual devices and DTensor setup are per process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from dtk.cluster import env as cluster
from dtk.cluster.launch import free_ports  # noqa: F401  (re-exported for the tests)

REPO = Path(__file__).resolve().parent.parent


def base_env(**overrides: str) -> dict[str, str]:
    """The current environment without cluster variables (DTensor, Slurm, TF_CONFIG, dtk), plus overrides."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DTENSOR_", "SLURM_", "DTK_")) and k != "TF_CONFIG"}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # The clients build tf_keras models, as dtk's scripts do (dtk.cli sets the same): TensorFlow
    # then skips importing Keras 3, 0.8 s of CPU in each of the suite's few hundred process
    # starts. The test processes themselves import TensorFlow as a user's script does.
    env.setdefault("TF_USE_LEGACY_KERAS", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.update(overrides)
    return env


def run_python(code: str, *, env: dict[str, str] | None = None, timeout: float = 120,
               args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Runs ``python -c code`` in a fresh process with a timeout; returns the completed process."""
    return subprocess.run([sys.executable, "-c", code, *args], env=env or base_env(),
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


def run_clients(code: str, num_clients: int, *, timeout: float = 180,
                extra_env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
    """Runs ``code`` as ``num_clients`` DTensor clients on loopback; kills all at the timeout."""
    jobs = [f"127.0.0.1:{p}" for p in free_ports(num_clients)]
    procs = []
    for i in range(num_clients):
        env = base_env(**cluster.client_env(jobs=jobs, client=i), **(extra_env or {}))
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def hold_checkpoint_lock(directory, *, host: str, run_id: str) -> subprocess.Popen:
    """A process that holds dtk's lock on a checkpoint ``directory`` (as another run would), with
    its record naming ``host`` and ``run_id``; returns once the lock is held. Kill it to release."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, json, os, sys, time\n"
         "f = open(os.path.join(sys.argv[1], '.dtk-lock'), 'a+')\n"
         "fcntl.flock(f, fcntl.LOCK_EX); f.seek(0); f.truncate()\n"
         "f.write(json.dumps({'host': sys.argv[2], 'pid': os.getpid(), 'started': 0, "
         "'run_id': sys.argv[3]}))\n"
         "f.flush(); print('HELD', flush=True); time.sleep(120)\n", str(directory), host, run_id],
        stdout=subprocess.PIPE, text=True)
    if holder.stdout.readline().strip() != "HELD":
        holder.kill()
        raise RuntimeError("the lock holder did not start")
    return holder
