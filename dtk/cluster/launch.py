"""``python -m dtk.cluster.launch``: run N DTensor clients of one command on this machine, safely.

    python -m dtk.cluster.launch --num_clients 2 --devices_per_client 4 -- \\
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
  training resumes from the last checkpoint, which every client saved into the shared directory);
  with ``--min_clients M`` the restart is elastic: it runs on the clients left (one fewer per
  failure, down to M), and a flexible mesh (``--mesh batch=-1``) spans their devices, with the
  same global batch, data order and step count, so the losses continue as if nothing happened;
* SIGTERM or SIGINT to the launcher (``timeout``, Slurm, Kubernetes, Ctrl-C) is forwarded to every
  client; clients still running after a grace period are killed, the launcher's temp directory is
  removed, and the launcher exits with 128 + the signal number;
* a client that stops answering (frozen, or stopped with SIGSTOP) is named as the culprit, not the
  client whose heartbeat check noticed it;
* nothing outlives the launcher (Linux): the launcher runs the group from an inner process that
  it owns, with parent-death signals down the chain, so a SIGKILL of the launcher (a scheduler,
  the OOM killer, ``kill -9``) stops the inner process and every client, and the temp directory
  is removed by whichever process survives. Elsewhere (macOS) a killed launcher's clients run
  until their peers' heartbeat timeout fails them.

Network exposure: TensorFlow's gRPC servers, which DTensor clients start, listen on every
interface (``0.0.0.0:<port>``; TensorFlow has no option to bind one address) and have no
authentication. So by default (``--network auto``) the launcher runs the whole group in a
private network namespace that holds only a loopback interface: the clients reach each other on
127.0.0.1 and nothing outside the machine can reach them (nor can they reach the network: a
script that downloads data needs ``--network host``). Creating the namespace needs root or
unprivileged user namespaces; where neither is available the launcher warns and runs on the
host's network (``--network isolated`` fails instead), whose ports are then reachable from other hosts unless a firewall blocks them.
Multi-machine clusters cannot be isolated this way: run them on a private network only.

The launcher itself never imports TensorFlow.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from dtk import _env
from dtk import usage
from dtk.cluster import env as cluster

_GRACE_S = 3.0      # SIGTERM -> SIGKILL
_POLL_S = 0.1
NETWORK_MODES = ("isolated", "host", "auto")
_IN_NETNS_ENV = "_DTK_LAUNCH_IN_NETNS"  # set on the launcher re-run inside the namespace
_INNER_ENV = "_DTK_LAUNCH_DIR"  # the outer launcher's temp dir, set on the inner launcher
_PR_SET_PDEATHSIG = 1
_PARENT_PID = os.getppid()  # the inner launcher's outer one (it was orphaned if this changes)
# TensorFlow names an unreachable peer as /job:worker/replica:0/task:N in its errors.
_TASK_IN_ERROR = re.compile(r"/job:worker/replica:\d+/task:(\d+)")
_PEER_ERROR_WORDS = ("heartbeat", "unavailable", "failed to connect", "connection reset",
                     "socket closed", "deadline exceeded", "stopped", "unhealthy")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """How ``launch`` runs a group of clients.

    Attributes:
      num_clients: processes to start (one DTensor client each).
      devices_per_client: CPU only: virtual CPUs per client (``DTK_VIRTUAL_DEVICES``); by default
        each client creates as many as its share of the mesh needs.
      max_restarts: relaunches of the whole group after a failure.
      min_clients: elastic restarts: each failure loses its client, and the group restarts on
        the clients left (one fewer per failure), down to ``min_clients``. The command must
        cope with the new count: a mesh with a flexible axis (``--mesh batch=-1``) spans the
        devices that are left, and a resumed ``Trainer`` restores its checkpoint into that
        mesh with the same global batch, data order and step count. None (the default): every
        restart has ``num_clients``.
      start_timeout_s: every client must build its mesh within this many seconds.
      heartbeat_timeout_s: a client that stops answering fails the others after this long.
      verbose: keep TensorFlow's C++ log lines in the clients' output (hidden by default: see
        ``dtk._env.quiet_tensorflow_env``; a user's own ``TF_CPP_MIN_LOG_LEVEL`` is kept).
    """

    num_clients: int
    devices_per_client: int | None = None
    max_restarts: int = 0
    min_clients: int | None = None
    start_timeout_s: float = cluster.DEFAULT_REGISTER_TIMEOUT_S
    heartbeat_timeout_s: float = cluster.DEFAULT_HEARTBEAT_TIMEOUT_S
    verbose: bool = False

    def __post_init__(self):
        if self.num_clients < 1:
            raise ValueError(f"num_clients must be at least 1; got {self.num_clients}")
        if self.devices_per_client is not None and self.devices_per_client < 1:
            raise ValueError(f"devices_per_client must be positive; got {self.devices_per_client}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0; got {self.max_restarts}")
        if self.min_clients is not None and not 1 <= self.min_clients <= self.num_clients:
            raise ValueError(f"min_clients must be between 1 and num_clients "
                             f"({self.num_clients}); got {self.min_clients}")
        if self.min_clients is not None and self.max_restarts == 0:
            raise ValueError(f"min_clients={self.min_clients} (--min_clients) sets how elastic "
                             "restarts shrink the group, but max_restarts is 0, so no restart "
                             "would come; add --max_restarts K (e.g. 2)")
        for name in ("start_timeout_s", "heartbeat_timeout_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):  # NaN fails both comparisons
                raise ValueError(f"{name} must be a positive, finite number of seconds; got "
                                 f"{value!r}")


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
    for key in cluster.SCHEDULER_VARIABLES:
        base.pop(key, None)  # the launcher, not a scheduler, describes this cluster
    jobs = [f"127.0.0.1:{p}" for p in ports]
    if not config.verbose:
        base.update(_env.quiet_tensorflow_env())
    return [dict(base, PYTHONUNBUFFERED="1", **cluster.client_env(
        jobs=jobs, client=i, register_timeout_s=config.start_timeout_s,
        heartbeat_timeout_s=config.heartbeat_timeout_s, virtual_devices=config.devices_per_client,
        ready_file=os.path.join(ready_dir, f"client-{i}.ready")))
        for i in range(config.num_clients)]


def _pump(stream, prefix: str, out, suspects: set[int], client: int) -> None:
    """Copies a client's output, noting the other clients its errors say it lost contact with."""
    for line in iter(stream.readline, ""):
        out.write(f"{prefix}{line}")
        out.flush()
        lower = line.lower()
        if any(w in lower for w in _PEER_ERROR_WORDS):
            suspects.update(int(t) for t in _TASK_IN_ERROR.findall(line) if int(t) != client)
    stream.close()


def _is_stopped(pid: int) -> bool:
    """True when the process is stopped (SIGSTOP, a debugger): it cannot answer heartbeats."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _culprit(procs: list[subprocess.Popen], failed: int, code: int,
             suspects: list[set[int]]) -> int | None:
    """The client to blame when ``failed`` exited because of another client, if one is known.

    A client killed by a signal is its own culprit. Otherwise: a client that is stopped (it
    cannot answer heartbeats), else one that ``failed``'s own errors name as unreachable.
    """
    if code < 0:
        return None
    stopped = [i for i, p in enumerate(procs) if p.poll() is None and _is_stopped(p.pid)]
    if stopped:
        return stopped[0]
    others = sorted(s for s in suspects[failed] if 0 <= s < len(procs))
    return others[0] if others else None


def _die_with_parent(sig: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child receive ``sig`` when its parent dies (any signal,
    SIGKILL included): Linux's parent-death signal, ``prctl(PR_SET_PDEATHSIG)``.

    None elsewhere (macOS, BSD: no equivalent; a killed launcher's clients then run on until
    their peers' heartbeat timeout fails them). Passed to processes started before any thread
    (``preexec_fn`` is unsafe once a process has threads).
    """
    if not sys.platform.startswith("linux"):
        return None
    import ctypes  # pylint: disable=g-import-not-at-top
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec():
        prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl: act as if after
            os.kill(os.getpid(), sig)
    return preexec


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


class _Stop:
    """The signal (SIGTERM/SIGINT) the launcher received, if any; set by its handler."""

    signum: int | None = None


def run_group(command: Sequence[str], config: LaunchConfig, *, out=None,
              stop: type[_Stop] = _Stop) -> int:
    """Runs one group of clients until all succeed or one fails; returns the exit code."""
    out = out or sys.stdout
    # Inside the outer launcher's temp dir when there is one: it removes it if this one is killed.
    root = os.environ.get(_INNER_ENV)
    ready_dir = tempfile.mkdtemp(prefix="dtk-launch-", dir=root if root and os.path.isdir(root)
                                 else None)
    procs, pumps = [], []
    suspects: list[set[int]] = [set() for _ in range(config.num_clients)]
    code, message = 0, None
    try:
        envs = client_envs(config, free_ports(config.num_clients), ready_dir)
        # Every client dies with this launcher, whatever kills it (SIGKILL too), on Linux. All
        # are started before the pump threads (preexec_fn is unsafe in a threaded process).
        preexec = _die_with_parent(signal.SIGKILL)
        for env in envs:
            procs.append(subprocess.Popen(list(command), env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, bufsize=1,
                                          preexec_fn=preexec))
        for i, p in enumerate(procs):
            t = threading.Thread(target=_pump, daemon=True,
                                 args=(p.stdout, f"[client {i}] ", out, suspects[i], i))
            t.start()
            pumps.append(t)
        start = time.monotonic()
        try:
            while True:
                if stop.signum is not None:
                    code = 128 + stop.signum
                    why = (f"received {signal.Signals(stop.signum).name}" if
                           not (root and os.getppid() != _PARENT_PID) else
                           "the launcher (outer process) died")
                    message = (f"{why}; stopping {sum(p.poll() is None for p in procs)} running "
                               "client(s)")
                    break
                codes = [p.poll() for p in procs]
                failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    i, c = failed[0]
                    code = _exit_code(c)
                    time.sleep(0.3)  # let the pumps read the client's last lines
                    culprit = _culprit(procs, i, c, suspects)
                    if culprit is not None:
                        state = ("is stopped (frozen)" if _is_stopped(procs[culprit].pid)
                                 else "stopped answering")
                        message = (f"client {culprit} {state}: client {i} lost contact with it "
                                   f"and {_describe(c)}; stopping the other clients")
                    else:
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
                print(f"dtk.cluster.launch: {message}", file=sys.stderr, flush=True)
            for p in procs:
                if p.poll() is None and _is_stopped(p.pid):
                    p.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            _stop(procs)
            for t in pumps:
                t.join(timeout=2)
    finally:
        shutil.rmtree(ready_dir, ignore_errors=True)
    return code


def run_with_restarts(attempt_fn: Callable[[], Any], *, max_restarts: int,
                      failed: Callable[[Any], bool], describe: Callable[[Any], str],
                      who: str) -> Any:
    """Runs ``attempt_fn`` until it succeeds or ``max_restarts`` restarts are used up.

    The one restart loop of dtk's launchers (local processes and Ray actors).
    """
    for attempt in range(max_restarts + 1):
        start = time.monotonic()
        result = attempt_fn()
        if not failed(result) or attempt == max_restarts:
            return result
        print(f"{who}: attempt {attempt + 1} failed ({describe(result)}) after "
              f"{time.monotonic() - start:.1f} s; restarting the group "
              f"({max_restarts - attempt} restart(s) left)", file=sys.stderr, flush=True)
    return result


def launch(command: Sequence[str], config: LaunchConfig, *, out=None) -> int:
    """Runs ``command`` as ``config.num_clients`` clients, restarting the group on failure.

    Returns:
      0 when every client succeeded, else the exit code of the first client that failed in the
      last attempt (124 when a client did not start in time).
    """
    if not command:
        raise ValueError("no command to launch; put it after '--', e.g. "
                         "python -m dtk.cluster.launch --num_clients 2 -- python train.py")
    _Stop.signum = None
    previous = {}

    def handler(signum, frame):  # pylint: disable=unused-argument
        _Stop.signum = signum

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, handler)
    group = config  # an elastic restart runs a smaller group

    def attempt() -> int:
        nonlocal group
        code = run_group(command, group, out=out)
        size = group.num_clients
        if code != 0 and _Stop.signum is None and config.min_clients is not None and \
                size > config.min_clients:
            group = dataclasses.replace(group, num_clients=size - 1)
            print(f"dtk.cluster.launch: elastic: the next attempt runs on {size - 1} client(s) "
                  f"(--min_clients {config.min_clients})", file=sys.stderr, flush=True)
        return code

    try:
        return run_with_restarts(
            attempt, max_restarts=config.max_restarts,
            failed=lambda code: code != 0 and _Stop.signum is None,
            describe=lambda code: f"code {code}", who="dtk.cluster.launch")
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


# -- network isolation ----------------------------------------------------------------------------
def _loopback_up() -> None:
    """Brings up ``lo`` in a new network namespace (where it starts down)."""
    import fcntl  # pylint: disable=g-import-not-at-top
    import struct  # pylint: disable=g-import-not-at-top
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sh", fcntl.ioctl(s, siocgifflags, struct.pack("16sh", b"lo", 0)))[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sh", b"lo", flags | iff_up))


def _netns_prefix() -> list[str] | None:
    """The ``unshare`` command that gives a process a private network namespace, if permitted."""
    unshare = shutil.which("unshare")
    if not unshare or not sys.platform.startswith("linux"):
        return None
    for prefix in ([unshare, "--net"], [unshare, "--net", "--map-root-user"]):
        if os.geteuid() == 0 and "--map-root-user" in prefix:
            continue
        try:
            ok = subprocess.run([*prefix, "--", "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if ok.returncode == 0:
            return prefix
    return None


def _run_inner(argv: Sequence[str], prefix: list[str] | None) -> int:
    """Runs the group from an inner launcher process, which this (outer) one owns.

    The outer launcher holds the temp dir and waits; the inner one (in a private network
    namespace when ``prefix`` is the ``unshare`` command, else on the host's network) starts and
    watches the clients. Ownership, whatever kills which (Linux): the inner launcher gets SIGTERM
    when the outer one dies (it stops its clients and removes its files, as on Ctrl-C); the
    clients get SIGKILL when the inner one dies; the outer one removes the temp dir and says what
    happened when the inner one is killed.
    """
    root = tempfile.mkdtemp(prefix="dtk-launch-")
    env = dict(os.environ, **{_INNER_ENV: root})
    if prefix:
        env[_IN_NETNS_ENV] = "1"
    command = [*(prefix + ["--"] if prefix else []), sys.executable, "-m", "dtk.cluster.launch", *argv]
    try:
        proc = subprocess.Popen(command, env=env, preexec_fn=_die_with_parent(signal.SIGTERM))

        def forward(signum, frame):  # pylint: disable=unused-argument
            if proc.poll() is None:
                proc.send_signal(signum)

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, forward)
        code = proc.wait()
        if code < 0 and code not in (-signal.SIGTERM, -signal.SIGINT):  # not what we forwarded
            print(f"dtk.cluster.launch: the inner launcher (pid {proc.pid}) {_describe(code)}; its "
                  "clients were stopped with it", file=sys.stderr, flush=True)
        return _exit_code(code)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    original = list(argv)
    command = []
    if "--" in argv:
        split = argv.index("--")
        argv, command = argv[:split], argv[split + 1:]
    parser = usage.ArgumentParser(prog="python -m dtk.cluster.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--num_clients", type=int, required=True, help="client processes")
    parser.add_argument("--devices_per_client", type=int, default=None,
                        help="CPU: virtual devices per client (default: what the mesh needs)")
    parser.add_argument("--max_restarts", type=int, default=0, help="group restarts on failure")
    parser.add_argument("--min_clients", type=int, default=None,
                        help="elastic: each restart runs on one client fewer (the lost one), "
                        "down to this many; use a flexible mesh, e.g. --mesh batch=-1")
    parser.add_argument("--start_timeout", type=float, default=120.0,
                        help="seconds for every client to build its mesh")
    parser.add_argument("--heartbeat_timeout", type=float,
                        default=cluster.DEFAULT_HEARTBEAT_TIMEOUT_S,
                        help="seconds after which a silent client fails the others")
    parser.add_argument("--verbose", action="store_true",
                        help="keep TensorFlow's C++ log lines in the clients' output")
    parser.add_argument("--network", choices=NETWORK_MODES, default="auto",
                        help="auto (default): isolated where permitted, else host with a warning; "
                        "isolated: run the clients in a private network namespace, unreachable "
                        "from other hosts (and without network access), or fail; host: share the "
                        "host's network (the clients' ports are reachable from other hosts)")
    args, extra = parser.parse_known_args(argv)
    if extra:
        hint = "" if command else (
            f"; the command to launch goes after '--', e.g. python -m dtk.cluster.launch --num_clients "
            f"{args.num_clients} -- {' '.join(extra)}")
        parser.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    try:
        config = LaunchConfig(num_clients=args.num_clients,
                              devices_per_client=args.devices_per_client,
                              max_restarts=args.max_restarts, min_clients=args.min_clients,
                              start_timeout_s=args.start_timeout,
                              heartbeat_timeout_s=args.heartbeat_timeout, verbose=args.verbose)
        if not command:
            raise ValueError("no command to launch; put it after '--', e.g. "
                             "python -m dtk.cluster.launch --num_clients 2 -- python train.py")
        if shutil.which(command[0]) is None:
            raise ValueError(f"command {command[0]!r} is not an executable file or on PATH; "
                             "give the program to run after '--', e.g. -- python train.py")
        for line in _env.unknown_names():
            print(f"warning: {line}", file=sys.stderr, flush=True)
        _env.check_all(warn_unknown=False)
    except ValueError as e:
        parser.error(str(e))
        return 2
    if os.environ.get(_INNER_ENV):  # the inner launcher
        if os.environ.get(_IN_NETNS_ENV):
            _loopback_up()
        try:
            return launch(command, config)
        finally:
            shutil.rmtree(os.environ[_INNER_ENV], ignore_errors=True)
    if args.network == "host":
        print("dtk.cluster.launch: warning: --network host: the clients' gRPC ports listen on all "
              "interfaces, unauthenticated, and are reachable from other hosts unless a firewall "
              "blocks them", file=sys.stderr, flush=True)
    else:
        prefix = _netns_prefix()
        if prefix is not None:
            return _run_inner(original, prefix)
        text = ("cannot create a private network namespace here (needs root or unprivileged user "
                "namespaces and the unshare command)")
        if args.network == "isolated":
            parser.error(f"--network isolated: {text}. Use --network host to run on the host's "
                         "network, where the clients' ports are reachable from other hosts "
                         "unless a firewall blocks them")
        print(f"dtk.cluster.launch: warning: {text}; the clients' gRPC ports listen on all interfaces "
              "and are reachable from other hosts unless a firewall blocks them", file=sys.stderr,
              flush=True)
    return _run_inner(original, None)


if __name__ == "__main__":
    sys.exit(main())
